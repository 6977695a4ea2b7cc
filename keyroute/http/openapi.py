"""The OpenAPI 3.1 documents of routers and nodes, generated from their route tables.

As in Starlette's `SchemaGenerator` (which reads each endpoint's docstring), every route carries its own
operations, one per method (`Operation`), where it is declared: a data-plane route
(`keyroute.http.routing.Route`) as its `operations`, an app's route as an `ApiRoute`. `document` walks a
service's data-plane route table and its app's routes and writes the document: the paths are the routes'
templates, the methods their operations', and the schemas the operations name (`Schema`) go once under
`components`. No path is written by hand, so the document cannot leave a route out or name one that is
not there. Each app serves its own at `/openapi.json` (`ApiRoute(OPENAPI_PATH, endpoint(...), OPENAPI)`).

Here too are the parts both services' operations are made of (parameters, error answers, schemas), and the
operations of the routes both serve alike: the data API's key, timeline and batch reads and its answers'
schema, the admin login, health, metrics and the document itself.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.routing import Route as StarletteRoute

from keyroute.formats.avro_answers import AVRO, HEADER_SCHEMA_ID

if TYPE_CHECKING:
    from keyroute.http.routing import RouteTable

OPENAPI_PATH = "/openapi.json"
_METHODS = ("GET", "PUT", "POST", "DELETE", "OPTIONS", "PATCH", "TRACE")


@dataclass(frozen=True)
class Schema:
    """A named schema: written once under `components/schemas`, referenced wherever an operation uses it.
    `body` may itself hold other `Schema`s."""

    name: str
    body: Mapping[str, Any] = field(hash=False)


@dataclass(frozen=True)
class Operation:
    """What one method of one route does, as OpenAPI says it: the route gives the path. `responses`,
    `parameters` and `body` (the request body) are OpenAPI objects, with `Schema`s where they reference one."""

    id: str
    summary: str
    responses: Mapping[str, Any] = field(hash=False)
    method: str = "GET"
    description: str | None = None
    parameters: Sequence[Mapping[str, Any]] = field(default=(), hash=False)
    body: Mapping[str, Any] | None = field(default=None, hash=False)
    security: Sequence[Mapping[str, Sequence[str]]] | None = field(default=None, hash=False)

    def item(self) -> dict[str, Any]:
        """The OpenAPI operation object (`Schema`s still in it)."""
        out: dict[str, Any] = {"operationId": self.id, "summary": self.summary}
        if self.description is not None:
            out["description"] = self.description
        if self.security is not None:
            out["security"] = [dict(requirement) for requirement in self.security]
        if self.parameters:
            out["parameters"] = list(self.parameters)
        if self.body is not None:
            out["requestBody"] = self.body
        out["responses"] = dict(self.responses)
        return out


class ApiRoute(StarletteRoute):
    """A route of an app (Starlette's) with its operations: it answers their methods (HEAD with GET)."""

    def __init__(self, path: str, endpoint: Callable[..., Any], *operations: Operation) -> None:
        if not operations:
            raise ValueError(f"a documented route has an operation: {path}")
        super().__init__(path, endpoint, methods=[operation.method for operation in operations])
        self.operations = operations


def document(info: Mapping[str, Any], routes: Iterable[tuple[str, Sequence[Operation]]]) -> dict[str, Any]:
    """The OpenAPI 3.1 document of `routes` ((path template, its operations), in order): `info` is its
    title, version and description."""
    schemas: dict[str, Any] = {}

    def resolved(node: Any) -> Any:
        if isinstance(node, Schema):
            if node.name not in schemas:
                schemas[node.name] = None  # named first: met again inside its own body, it is a reference
                schemas[node.name] = resolved(node.body)
            return {"$ref": f"#/components/schemas/{node.name}"}
        if isinstance(node, Mapping):
            return {key: resolved(value) for key, value in node.items()}
        if isinstance(node, (list, tuple)):
            return [resolved(value) for value in node]
        return node

    paths: dict[str, Any] = {}
    bodies: dict[str, Schema] = {}
    for template, operations in routes:
        item = paths.setdefault(template, {})
        for operation in operations:
            method = operation.method.lower()
            if method in item:
                raise ValueError(f"{operation.method} {template} has two operations")
            for schema in _schemas_in(operation.item()):
                if bodies.setdefault(schema.name, schema) != schema:
                    raise ValueError(f"two different schemas are named {schema.name!r}")
            item[method] = resolved(operation.item())
    return {
        "openapi": "3.1.0",
        "info": dict(info),
        "paths": paths,
        "components": {
            "securitySchemes": SECURITY_SCHEMES,
            "headers": {"Retry-After": RETRY_AFTER_HEADER},
            "schemas": schemas,
        },
    }


def _schemas_in(node: Any) -> Iterable[Schema]:
    if isinstance(node, Schema):
        yield node
        yield from _schemas_in(node.body)
    elif isinstance(node, Mapping):
        for value in node.values():
            yield from _schemas_in(value)
    elif isinstance(node, (list, tuple)):
        for value in node:
            yield from _schemas_in(value)


def routes_of(data_plane: RouteTable, app_routes: Iterable[BaseRoute]) -> list[tuple[str, Sequence[Operation]]]:
    """The documented routes of a service: its data plane's (in table order; a route without operations,
    one that only explains a 404, is not part of the API), then its app's. Every route of the app is
    documented, and every method of a data-plane route has its operation (ValueError otherwise)."""
    found: list[tuple[str, Sequence[Operation]]] = []
    for route in data_plane.routes:
        if not route.operations:
            continue
        methods = {operation.method for operation in route.operations}
        if methods != set(route.methods):
            raise ValueError(f"{route.template}: methods {sorted(route.methods)}, operations of {sorted(methods)}")
        found.append((route.template, route.operations))
    for app_route in app_routes:
        if not isinstance(app_route, ApiRoute):
            raise ValueError(f"an app's route without operations: {getattr(app_route, 'path', app_route)!r}")
        found.append((app_route.path, app_route.operations))
    return found


def endpoint(info: Mapping[str, Any], data_plane: Callable[[], RouteTable]) -> Callable[[Request], Awaitable[Response]]:
    """The `/openapi.json` endpoint of an app whose data plane's routes `data_plane()` gives: the document
    of both, made at the first request (the app's routes are all declared by then) and kept."""
    made: list[bytes] = []

    async def openapi(request: Request) -> Response:
        if not made:
            text = document(info, routes_of(data_plane(), request.app.routes))
            made.append(json.dumps(text, ensure_ascii=False).encode("utf-8"))
        return Response(made[0], media_type="application/json")

    return openapi


# -- the parts operations are made of -----------------------------------------------------------------------

SECURITY_SCHEMES = {
    "adminToken": {
        "type": "http",
        "scheme": "bearer",
        "description": "the admin token (--admin-token / KEYROUTE_ADMIN_TOKEN), when one is configured",
    },
    "adminSession": {
        "type": "apiKey",
        "in": "cookie",
        "name": "keyroute_admin",
        "description": "the session cookie POST /admin/login sets (for the /admin paths)",
    },
}
RETRY_AFTER_HEADER = {"description": "seconds to wait before asking again", "schema": {"type": "integer"}}
# An /admin endpoint: the admin token, or none when none is configured.
ADMIN_SECURITY: tuple[Mapping[str, Sequence[str]], ...] = ({"adminToken": []}, {})

ERROR = Schema(
    "Error",
    {
        "type": "object",
        "required": ["error", "message"],
        "properties": {
            "error": {
                "type": "string",
                "description": "a stable code",
                "examples": ["key_not_found", "partition_unavailable"],
            },
            "message": {"type": "string", "description": "for humans"},
        },
    },
)


def error(description: str, *, retry_after: bool = False, challenge: bool = False) -> dict[str, Any]:
    """An error answer: `{"error", "message"}`, with `Retry-After` or `WWW-Authenticate`."""
    response: dict[str, Any] = {"description": description, "content": {"application/json": {"schema": ERROR}}}
    headers: dict[str, Any] = {}
    if retry_after:
        headers["Retry-After"] = {"$ref": "#/components/headers/Retry-After"}
    if challenge:
        headers["WWW-Authenticate"] = {
            "description": '`Bearer` (no token sent) or `Bearer error="invalid_token"`',
            "schema": {"type": "string"},
        }
    if headers:
        response["headers"] = headers
    return response


def quota_buckets(member: str, **extra: Any) -> dict[str, Any]:
    """The `buckets` of a quotas answer (keyroute.http.quotas), one per identity and store read, as a router
    and a node both answer them: `member` names who enforces the `share`; `extra`, the fields only it adds."""
    return {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "identity": {"type": "string"},
                "store": {"type": "string"},
                "quota": {"type": "number", "description": "reads/s, cluster-wide"},
                "share": {"type": "number", "description": f"reads/s this {member} enforces"},
                "used": {"type": "number", "description": "share of the last burst's tokens spent"},
                "reads": {"type": "integer"},
                "rejected": {"type": "integer"},
                **extra,
            },
        },
    }


QUOTA_IDENTITIES = {"type": "object", "description": "the quota file: per identity rate, burst_s, stores"}


def json_answer(
    schema: Schema | Mapping[str, Any], description: str, headers: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """A JSON answer of `schema`."""
    response: dict[str, Any] = {"description": description, "content": {"application/json": {"schema": schema}}}
    if headers:
        response["headers"] = dict(headers)
    return response


def text_answer(media_type: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {media_type: {"schema": {"type": "string"}}}}


# Answers any request may get before it reaches its endpoint (see keyroute.http.admission).
GUARD = {
    "431": error("`headers_too_large`: the request line and headers exceed the configured limit"),
    "503": error(
        "`overloaded` (too many requests in progress), `partition_unavailable` (no node serves the "
        "partition, a rebalance or reload is in flight), `no_partition_map` (a router that has not read the "
        "partition map yet: ZooKeeper unreachable since it started) or `policy_not_satisfied` (this process does "
        "not satisfy the cluster policy): retry after `Retry-After` seconds",
        retry_after=True,
    ),
}
# A read past its caller's quota (keyroute.http.quotas).
QUOTA = {
    "429": error(
        "`quota_exceeded`: the caller is over its quota of reads/s on this store (the message names the identity "
        "and the store): retry after `Retry-After` seconds",
        retry_after=True,
    )
}
INTERNAL = {"500": error("`internal_error`: an unexpected failure (details are only in the log)")}
ADMIN = {"401": error("`unauthorized`: an admin token is configured and was not presented", challenge=True)}
NOT_ALLOWED = {"405": error("`method_not_allowed`")}
# What every admin, health or document answer may also be.
ALWAYS = {**NOT_ALLOWED, **GUARD, **INTERNAL}
NOT_ACCEPTABLE = {
    "406": error(
        "`not_acceptable`: the Accept header offers neither application/json, application/avro nor "
        "application/vnd.keyroute.{store}+avro (the message lists them)"
    )
}
KEY_TOO_LONG = {"414": error("`key_too_long`: the key is longer than `max_key_bytes`")}

INT0 = {"type": "integer", "minimum": 0}
OFFSET = {"type": "integer", "minimum": 0, "maximum": (1 << 63) - 1}
# The same in a JSON body, where 14571.0 is the integer 14571 as JSON Schema 2020-12 counts it.
BODY_OFFSET = {**OFFSET, "description": "an integer: a JSON number with no fractional part (14571.0 is 14571)"}
LIMIT = {"type": "integer", "minimum": 1, "maximum": 10000, "default": 100}
MAP_GENERATION = (
    "the map generation: the highest ZooKeeper modification id among the records the partition map was built"
    " from (not the assignment generation)"
)
TIME_BOUND = (
    "ISO 8601 for a store ordered by a timestamp (UTC unless the text says otherwise, e.g. "
    "2024-06-11T10:00:00Z) or a date (2024-06-11); a decimal integer for one ordered by an integer column"
)

STORE = {"name": "store", "in": "path", "required": True, "schema": {"type": "string"}, "description": "store name"}
KEY = {
    "name": "key",
    "in": "path",
    "required": True,
    "schema": {"type": "string"},
    "description": (
        "one path segment, percent-encoded UTF-8 ('/' as %2F); decimal for int16/int32/"
        "int64 stores, base64url for bytes stores, a JSON object for a Schema Registry record key; at most "
        "`max_key_bytes` bytes decoded"
    ),
}


def query(
    name: str, description: str | None = None, schema: Mapping[str, Any] | None = None, required: bool = False
) -> dict[str, Any]:
    """A query parameter (a string unless `schema` says otherwise)."""
    parameter: dict[str, Any] = {
        "name": name,
        "in": "query",
        "required": required,
        "schema": {"type": "string"} if schema is None else dict(schema),
    }
    if description is not None:
        parameter["description"] = description
    return parameter


def array_of_objects(required: list[str], properties: dict[str, Any]) -> dict[str, Any]:
    """An array of objects with `properties`, the `required` ones in each."""
    return {"type": "array", "items": {"type": "object", "required": required, "properties": properties}}


def string_headers(*pairs: tuple[str, str]) -> dict[str, Any]:
    """Response headers, each a string, by (name, description)."""
    return {name: {"description": description, "schema": {"type": "string"}} for name, description in pairs}


# -- the data API both serve ------------------------------------------------------------------------------

READ_HEADERS = string_headers(
    ("X-Keyroute-Partition", "the key's partition"),
    ("X-Keyroute-Node", "the node that answered"),
    ("X-Keyroute-Version", "the store version the value comes from"),
    ("X-Keyroute-Hops", "0 when the first node asked answered, 1 when it forwarded once"),
    ("X-Request-Id", "the request's id (the client's when acceptable, else a new one)"),
    ("X-Keyroute-Offset", "live stores: the partition's last applied offset (-1: none yet)"),
    ("X-Keyroute-Lag", "live stores: how many records the partition was behind the topic"),
)
AVRO_HEADERS = string_headers(
    (HEADER_SCHEMA_ID, "Avro answers only: the envelope schema's CRC-64-AVRO fingerprint (16 hex digits)")
)


def read_answer(schema: Schema, description: str, headers: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The 200 of a key, timeline or batch read: JSON, or Avro when the request's Accept prefers it."""
    response = json_answer(schema, description, {**(headers or {}), **AVRO_HEADERS})
    response["content"][AVRO] = {
        "schema": {
            "type": "string",
            "contentMediaType": AVRO,
            "description": "the same answer in the Avro envelope `GET /stores/{store}/schema` publishes (also "
            "served as the store's own media type, application/vnd.keyroute.{store}+avro)",
        }
    }
    return response


def _key_answer(name: str, schema: dict[str, Any], next_description: str | None = None) -> dict[str, Any]:
    """The answer to a read of one key: the store, key, partition and version it was read at, and `name`
    (then `next`, the cursor of the next page, when the read is paged)."""
    properties: dict[str, Any] = {
        "store": {"type": "string"},
        "key": {"type": "string"},
        "partition": {"type": "integer", "minimum": 0},
        "version": {"type": "integer", "minimum": 1},
        name: schema,
    }
    if next_description is not None:
        properties["next"] = {"type": "string", "description": next_description}
    return {"type": "object", "required": ["store", "key", "partition", "version", name], "properties": properties}


FOUND = Schema(
    "Found", _key_answer("value", {"type": "object", "description": "the store's value columns for the key"})
)
HISTORY = Schema(
    "History",
    _key_answer(
        "rows",
        {
            "type": "array",
            "items": {"type": "object"},
            "description": "the key's rows (value columns and the order_by column), in time order",
        },
        "present when more rows follow: the next page's cursor",
    ),
)
WINDOWS = Schema(
    "Windows",
    _key_answer(
        "windows",
        array_of_objects(
            ["start", "end", "value"],
            {
                "start": {"description": "the window's first time (inclusive)"},
                "end": {"description": "the window's end (exclusive)"},
                "value": {"type": "object", "description": "the aggregations over the window"},
            },
        ),
        "present when more windows follow",
    ),
)


def _batch_schemas(any_key: bool) -> tuple[Schema, Schema]:
    """The request and answer schemas of a batch-get: a router takes any JSON value as a key, answering one
    its store cannot take as that key's 400 entry (`any_key`); a node takes strings and integers only."""
    given: dict[str, Any] = {} if any_key else {"type": ["string", "integer"]}
    request = Schema(
        "BatchRequest",
        {
            "type": "object",
            "required": ["keys"],
            "properties": {
                "keys": {
                    "type": "array",
                    "items": given,
                    "description": "strings; integers are accepted for integer key formats (a JSON number "
                    "with no fractional part: 5.0 is the key 5)"
                    + ("; any other JSON value is answered as that key's 400 entry" if any_key else ""),
                },
                "min_offset": {
                    **OFFSET,
                    "description": "live stores: a bound for every partition of the request (see getKey); "
                    "a JSON number with no fractional part (14571.0 is 14571)",
                },
                "min_offsets": {
                    "type": "object",
                    "description": "live stores: a bound per partition, by partition number; with "
                    "min_offset too, the larger bound applies",
                    "propertyNames": {"pattern": "^[0-9]+$"},
                    "additionalProperties": BODY_OFFSET,
                },
            },
        },
    )
    entry = Schema(
        "BatchEntry",
        {
            "type": "object",
            "required": ["key", "status"],
            "properties": {
                "key": {**given, "description": "the key as the request gave it"},
                "status": {"type": "integer", "description": "the HTTP status a single read would get"},
                "partition": {"type": "integer"},
                "version": {"type": "integer"},
                "value": {"type": "object"},
                "offset": {"type": "integer", "description": "live stores: the partition's last applied offset"},
                "node": {"type": "string", "description": "found keys: the node that read it"},
                "error": {
                    "type": "string",
                    "description": "present when status is not 200 (`not_up_to_bound`, `not_live`, ...)",
                },
                "message": {"type": "string"},
            },
        },
    )
    answer = Schema(
        "BatchResponse",
        {"type": "object", "required": ["results"], "properties": {"results": {"type": "array", "items": entry}}},
    )
    return request, answer


ANSWER_SCHEMA = Schema(
    "AnswerSchema",
    {
        "type": "object",
        "required": ["store", "schema_id", "media_types", "columns", "schema"],
        "properties": {
            "store": {"type": "string"},
            "schema_id": {"type": "string", "description": "what X-Keyroute-Schema-Id says"},
            "media_types": {"type": "array", "items": {"type": "string"}},
            "columns": {"type": "array", "items": {"type": "string"}, "description": "the value columns"},
            "schema": {"type": "object", "description": "the Avro schema (JSON)"},
        },
    },
)
ENDPOINT = Schema(
    "Endpoint",
    {
        "type": "object",
        "properties": {"node": {"type": "string"}, "url": {"type": "string"}, "version": {"type": "integer"}},
    },
)

# A projection (keyroute.storage.projection), on every read of values.
FIELDS_QUERY = query(
    "fields",
    "only these fields of each value (a history row; a window's value), comma-separated, nested by dots "
    "(`a,b.c`); answered as JSON only; fields the store lacks are 400 unknown_fields",
)

GET_KEY = Operation(
    "getKey",
    "The value of one key",
    parameters=(
        STORE,
        KEY,
        query(
            "min_offset",
            "live stores only: answer from a state that has applied at least this topic offset of the "
            "key's partition (read-your-writes after a produce), else 503 not_up_to_bound",
            OFFSET,
        ),
        FIELDS_QUERY,
    ),
    responses={
        "200": read_answer(FOUND, "the key's value", READ_HEADERS),
        "400": error(
            "`bad_key`: the key does not fit the store's key format or is not UTF-8; `bad_request`: "
            "min_offset is not an offset or fields are malformed; `not_live`: min_offset on a store that follows "
            "no topic; `unknown_fields`: fields the store's values do not have"
        ),
        "404": error(
            "`store_not_found`, `key_not_found`, `expired` (the value is older than the store's ttl), or "
            "`not_found` (not a key path)"
        ),
        **NOT_ACCEPTABLE,
        **KEY_TOO_LONG,
        **NOT_ALLOWED,
        **QUOTA,
        **GUARD,
        "503": error(
            "`overloaded` (too many requests in progress), `partition_unavailable` (no node serves the "
            "partition, a rebalance or reload is in flight) or `not_up_to_bound` (no replica applied "
            "min_offset within the wait; X-Keyroute-Offset says how far the last one asked got): "
            "retry after `Retry-After` seconds",
            retry_after=True,
        ),
        **INTERNAL,
    },
)


def _timeline_read(operation: str, summary: str, schema: Schema, what: str, kind: str) -> Operation:
    """A history or windows read: its parameters and answers."""
    return Operation(
        operation,
        summary,
        parameters=(
            STORE,
            KEY,
            query("from", f"{what} from this time on (inclusive). {TIME_BOUND}"),
            query("to", f"{what} before this time (exclusive); same form as `from`"),
            query("limit", "at most this many; `next` then continues the read", LIMIT),
            query(
                "order",
                "oldest first (asc) or newest first (desc)",
                {"type": "string", "enum": ["asc", "desc"], "default": "asc"},
            ),
            query("cursor", "the `next` of the previous page, with the same store, key, from, to and order"),
            query("min_offset", "live stores only: as for getKey (read your own write)", OFFSET),
            FIELDS_QUERY,
        ),
        responses={
            "200": read_answer(schema, f"the key's {what}, in time order (none: an empty list)", READ_HEADERS),
            "400": error(
                f"`wrong_store_kind`: the store is not a {kind} store; `bad_request`: an unknown, repeated "
                "or malformed parameter, `from` after `to`, or `limit` out of range; `bad_cursor`: the "
                "cursor is malformed, altered or continues another read; `bad_key`; `not_live`: "
                "min_offset on a store that follows no topic"
            ),
            "404": error("`store_not_found`"),
            **NOT_ACCEPTABLE,
            "410": error("`cursor_expired`: the cursor continues a version of the store no longer served"),
            **KEY_TOO_LONG,
            **NOT_ALLOWED,
            **QUOTA,
            **GUARD,
            "503": error(
                "`overloaded`, `partition_unavailable` or `not_up_to_bound`: retry after `Retry-After` seconds",
                retry_after=True,
            ),
            **INTERNAL,
        },
    )


GET_HISTORY = _timeline_read(
    "getHistory", "Every row of one key in a time range (history stores)", HISTORY, "rows", "history"
)
GET_WINDOWS = _timeline_read(
    "getWindows", "The windows of one key that overlap a time range (windowed stores)", WINDOWS, "windows", "windowed"
)


def batch_get(any_key: bool) -> Operation:
    """POST /stores/{store}/batch-get: see `_batch_schemas` for `any_key`."""
    request, answer = _batch_schemas(any_key)
    return Operation(
        "batchGet",
        "Many keys of one store, one result per key in request order",
        method="POST",
        parameters=(STORE, FIELDS_QUERY),
        body={"required": True, "content": {"application/json": {"schema": request}}},
        responses={
            "200": read_answer(answer, "one entry per key, each with its own status"),
            "400": error(
                '`bad_request`: the body is not JSON of the form {"keys": [...]}, or a bound is malformed '
                "or names a partition the store lacks"
                + ("" if any_key else ", or a key is neither a JSON string nor an integer")
            ),
            "404": error("`store_not_found`"),
            **NOT_ACCEPTABLE,
            "408": error("`body_timeout`: the body did not arrive whole within the configured time"),
            "413": error("`too_many_keys` (more than `max_batch_keys`) or `body_too_large`"),
            **NOT_ALLOWED,
            **QUOTA,
            **GUARD,
            **INTERNAL,
        },
    )


# -- several stores at once (keyroute.http.multi_store) ---------------------------------------------------

STORES = {
    "name": "stores",
    "in": "path",
    "required": True,
    "schema": {"type": "string"},
    "description": "store names joined by ',' (`profile,balance`), each at most once, at most 16",
}
STORE_FIELDS_QUERY = query(
    "fields",
    "only these fields of every store's values (each store must have them: else that store's entry is 400 "
    "unknown_fields); `fields.{store}=a,b` instead for one store",
)
STORE_ENTRY = Schema(
    "StoreEntry",
    {
        "type": "object",
        "required": ["key", "status"],
        "description": "one store's part of the answer: a batch-get entry, with the status a single read of the "
        "key in that store would get",
        "properties": {
            "key": {"type": ["string", "integer"]},
            "status": {"type": "integer"},
            "partition": {"type": "integer"},
            "version": {"type": "integer"},
            "offset": {"type": "integer", "description": "live stores: the partition's last applied offset"},
            "node": {"type": "string", "description": "found keys: the node that read it"},
            "value": {"type": "object"},
            "error": {"type": "string", "description": "present when status is not 200"},
            "message": {"type": "string"},
        },
    },
)
STORES_ANSWER = Schema(
    "StoresAnswer",
    {
        "type": "object",
        "required": ["key", "stores"],
        "properties": {
            "key": {"type": ["string", "integer"]},
            "stores": {
                "type": "object",
                "description": "each store read, in the order named: its entry",
                "additionalProperties": STORE_ENTRY,
            },
        },
    },
)
_STORES_ERRORS = {
    "404": error("`not_found` (no such path)"),
    **KEY_TOO_LONG,
    **NOT_ALLOWED,
    "401": error("`unauthorized`: access control is on and no valid credentials came", challenge=True),
    "403": error("`forbidden`: the caller may not read some of the stores (the message names them)"),
    **QUOTA,
    **GUARD,
    **INTERNAL,
}

GET_STORES = Operation(
    "getStores",
    "One key's values in several stores",
    description="Each store's entry has its own status (404 key_not_found, expired, store_not_found; 503 "
    "partition_unavailable or not_up_to_bound): one store's failure never fails the others. Co-located stores "
    "are answered by one node (X-Keyroute-Node, X-Keyroute-Hops 0).",
    parameters=(
        STORES,
        KEY,
        query(
            "min_offset",
            "live stores: a bound per store, `store:offset` joined by ',' (`quotes:14571,ticks:9`)",
            {"type": "string", "pattern": "^[^:,]+:[0-9]+(,[^:,]+:[0-9]+)*$"},
        ),
        STORE_FIELDS_QUERY,
    ),
    responses={
        "200": json_answer(STORES_ANSWER, "every store's entry for the key", READ_HEADERS),
        "400": error(
            "`bad_request`: the stores are not names joined by ',' (empty, repeated, more than 16), or the query "
            "is malformed (an unknown parameter, a bound or projection naming a store not read)"
        ),
        **_STORES_ERRORS,
    },
)
STORES_REQUEST = Schema(
    "StoresRequest",
    {
        "type": "object",
        "required": ["keys"],
        "additionalProperties": False,
        "properties": {
            "keys": {
                "oneOf": [
                    {"type": "array", "items": {"type": ["string", "integer"]}},
                    {
                        "type": "object",
                        "additionalProperties": {"type": "array", "items": {"type": ["string", "integer"]}},
                    },
                ],
                "description": "a list: every store reads every key; an object: each store (of the path) its own keys",
            },
            "min_offset": {
                "type": "object",
                "description": "live stores: a bound per store",
                "additionalProperties": BODY_OFFSET,
            },
        },
    },
)
STORES_RESULTS = Schema(
    "StoresResults",
    {
        "type": "object",
        "required": ["results"],
        "properties": {"results": {"type": "array", "items": STORES_ANSWER}},
    },
)
READ_STORES = Operation(
    "readStores",
    "Many keys in several stores: one result per key, each with every store's entry",
    method="POST",
    parameters=(STORES, STORE_FIELDS_QUERY),
    body={"required": True, "content": {"application/json": {"schema": STORES_REQUEST}}},
    responses={
        "200": json_answer(STORES_RESULTS, "one result per key (per distinct key of the object form)"),
        "400": error(
            "`bad_request`: the stores are malformed, the body is not of the form documented (a key neither a "
            "string nor an integer, a store not of the path), or the query is malformed"
        ),
        "408": error("`body_timeout`: the body did not arrive whole within the configured time"),
        "413": error("`too_many_keys` (more reads of a key in a store than `max_batch_keys`) or `body_too_large`"),
        **_STORES_ERRORS,
    },
)


GET_ANSWER_SCHEMA = Operation(
    "getAnswerSchema",
    "The Avro schema of the store's Avro answers (routers and nodes alike)",
    description="Key, timeline and batch reads answer Avro binary when the request's Accept "
    "prefers application/avro or application/vnd.keyroute.{store}+avro to JSON (JSON is the "
    "default, and a tie is JSON; errors are always JSON). The envelope holds the JSON answer's "
    "fields (null where it has none); a value is a map from column name to null, boolean, long, "
    "double or string, or a `keyroute.Nested` record with the JSON text of what those do not hold "
    "exactly (an object, an array, an integer beyond 64 bits). One schema serves every store: its "
    "id (X-Keyroute-Schema-Id) is its CRC-64-AVRO fingerprint; the store's columns are named in "
    "its documentation.",
    parameters=(STORE,),
    responses={
        "200": json_answer(ANSWER_SCHEMA, "the schema, its id and the media types"),
        "404": error("`store_not_found`"),
        **ALWAYS,
    },
)

# -- the routes both apps serve -------------------------------------------------------------------------------


def login_form(after: str) -> Operation:
    """GET /admin/login, leading to `after` when there is nothing to log in to."""
    return Operation(
        "loginForm",
        f"The admin login form (self-contained HTML; 303 to {after} without an admin token)",
        responses={
            "200": text_answer("text/html", "the form"),
            "303": {"description": f"to `{after}`: no admin token is configured"},
            **ALWAYS,
        },
    )


def login(after: str) -> Operation:
    """POST /admin/login, leading to `after`."""
    return Operation(
        "login",
        "Check the form's `token`; set the `keyroute_admin` session cookie",
        method="POST",
        body={
            "required": True,
            "content": {
                "application/x-www-form-urlencoded": {
                    "schema": {"type": "object", "properties": {"token": {"type": "string"}}, "required": ["token"]}
                }
            },
        },
        responses={
            "303": {
                "description": f"to `{after}`, with the session cookie set (HttpOnly, SameSite=Strict); without "
                "an admin token configured, to it at once"
            },
            "400": error("`bad_request`: the form has no `token` field"),
            "401": error("`unauthorized`: the token is not the admin token (HTML for a browser)"),
            "413": error("`body_too_large`"),
            **ALWAYS,
        },
    )


LOGOUT = Operation(
    "logout",
    "Clear the session cookie",
    method="POST",
    responses={"303": {"description": "to `/admin/login`, with the session cookie cleared"}, **ALWAYS},
)


# What both apps' GET /admin/route answer says of a key; each app adds its own fields.
ROUTE_FIELDS = {
    "store": {"type": "string"},
    "key": {"type": "string"},
    "hash": {"type": "integer"},
    "partition": {"type": "integer"},
    "assigned": {"type": "array", "items": {"type": "string"}},
    "serving": {"type": "array", "items": ENDPOINT},
}


def route_operation(schema: Schema, summary: str, description: str | None = None) -> Operation:
    """GET /admin/route: where one key goes, answered as `schema` (each app's own fields)."""
    return Operation(
        "route",
        summary,
        description=description,
        security=ADMIN_SECURITY,
        parameters=(query("store", required=True), query("key", required=True)),
        responses={
            "200": json_answer(schema, "where the key goes"),
            "400": error("`bad_request` (a parameter is missing) or `bad_key`"),
            **ADMIN,
            "404": error("`store_not_found`"),
            **ALWAYS,
        },
    )


def quotas_operation(schema: Schema, summary: str, description: str) -> Operation:
    """GET /admin/quotas: the quotas and the buckets in use, answered as `schema` (each app's own fields)."""
    return Operation(
        "quotas",
        summary,
        description=description,
        security=ADMIN_SECURITY,
        responses={"200": json_answer(schema, "the quotas and the buckets in use"), **ADMIN, **ALWAYS},
    )


def readyz_operation(schema: Schema, summary: str, description: str, not_ready: str) -> Operation:
    """GET /readyz: 200 when ready, 503 (`not_ready` says when) otherwise, both answered as `schema`."""
    return Operation(
        "readyz",
        summary,
        description=description,
        responses={
            "200": json_answer(schema, "ready"),
            "503": json_answer(schema, not_ready),
            **NOT_ALLOWED,
            "431": GUARD["431"],
            **INTERNAL,
        },
    )


HEALTH = Schema("Health", {"type": "object", "required": ["status"], "properties": {"status": {"const": "ok"}}})
HEALTHZ = Operation(
    "healthz",
    "The process is alive",
    responses={"200": json_answer(HEALTH, "alive"), **NOT_ALLOWED, "431": GUARD["431"], **INTERNAL},
)
METRICS = Operation(
    "metrics",
    "Prometheus metrics (the admin token with --metrics-require-token; with access control on, "
    "an admin caller unless --metrics-open)",
    security=ADMIN_SECURITY,
    responses={"200": text_answer("text/plain", "Prometheus text exposition format"), **ADMIN, **ALWAYS},
)
OPENAPI = Operation(
    "openapi",
    "This document",
    responses={
        "200": {
            "description": "the OpenAPI 3.1 document of this process's API",
            "content": {"application/json": {"schema": {"type": "object"}}},
        },
        **ALWAYS,
    },
)
INFO_DESCRIPTION = (
    "Every error is a JSON object with an `error` code and a human `message`. Integers: in a JSON body, any "
    "JSON number with no fractional part, as JSON Schema 2020-12 counts integers (14571, 14571.0 and 1.4571e4 "
    "are all 14571); a fraction (14571.5), a boolean or a value out of range is a 400 `bad_request`. In a "
    "query string, decimal digits only (no sign '+', fraction or exponent)."
)
