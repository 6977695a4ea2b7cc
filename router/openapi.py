"""The router's HTTP API as an OpenAPI 3.1 document, served at `/openapi.json`.

It describes the whole router API: the data plane's routes (router/dataplane.py, everything under /stores/)
and the app's (router/app.py). A static value kept in step with both by tests/unit/router/test_openapi.py.
"""

from __future__ import annotations

import json
from typing import Any

from keyroute.formats.avro_answers import AVRO, HEADER_SCHEMA_ID
from keyroute.router.map_views import DEFAULT_LIMIT, FILTER_STATES, MAX_LIMIT, MAX_WAIT_S


def _error(description: str, *, retry_after: bool = False, challenge: bool = False) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }
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


# Answers any request may get before it reaches its endpoint (see keyroute.http.admission).
_GUARD = {
    "431": _error("`headers_too_large`: the request line and headers exceed the configured limit"),
    "503": _error(
        "`overloaded` (too many requests in progress), `partition_unavailable` (no node serves the "
        "partition, a rebalance or reload is in flight), `no_partition_map` (the router has not read the "
        "partition map yet: ZooKeeper unreachable since it started) or `policy_not_satisfied` (this process does "
        "not satisfy the cluster policy): retry after `Retry-After` seconds",
        retry_after=True,
    ),
}
# A read past its caller's quota (keyroute.http.quotas).
_QUOTA = {
    "429": _error(
        "`quota_exceeded`: the caller is over its quota of reads/s on this store (the message names the identity "
        "and the store): retry after `Retry-After` seconds",
        retry_after=True,
    )
}
_INTERNAL = {"500": _error("`internal_error`: an unexpected failure (details are only in the log)")}
_ADMIN = {
    "401": _error("`unauthorized`: an admin token is configured and was not presented", challenge=True),
}
_NOT_ALLOWED = {"405": _error("`method_not_allowed`")}
_NOT_MODIFIED: dict[str, Any] = {}  # filled in below, once the headers are
_INT0 = {"type": "integer", "minimum": 0}
_VIEW_HEADERS = {
    "ETag": {"description": "the map and assignment generations this view is of", "schema": {"type": "string"}},
    "X-Keyroute-Map-Age-S": {
        "description": "seconds since the router's map last changed (a quiet cluster's map grows old: fine)",
        "schema": {"type": "string"},
    },
}
_NOT_MODIFIED.update(description="the map is still the one If-None-Match names", headers=_VIEW_HEADERS)
_STORE = {"name": "store", "in": "path", "required": True, "schema": {"type": "string"}, "description": "store name"}
_READ_HEADERS = {
    name: {"description": description, "schema": {"type": "string"}}
    for name, description in (
        ("X-Keyroute-Partition", "the key's partition"),
        ("X-Keyroute-Node", "the node that answered"),
        ("X-Keyroute-Version", "the store version the value comes from"),
        ("X-Keyroute-Hops", "0 when the first node asked answered, 1 when it forwarded once"),
        ("X-Request-Id", "the request's id (the client's when acceptable, else a new one)"),
        ("X-Keyroute-Offset", "live stores: the partition's last applied offset (-1: none yet)"),
        ("X-Keyroute-Lag", "live stores: how many records the partition was behind the topic"),
    )
}
_OFFSET = {"type": "integer", "minimum": 0, "maximum": (1 << 63) - 1}
_MAP_GENERATION = (
    "the map generation: the highest ZooKeeper modification id among the records the partition map was built"
    " from (not the assignment generation)"
)
# The same in a JSON body, where 14571.0 is the integer 14571 as JSON Schema 2020-12 counts it.
_BODY_OFFSET = {**_OFFSET, "description": "an integer: a JSON number with no fractional part (14571.0 is 14571)"}
_KEY = {
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
_TIME_BOUND = (
    "ISO 8601 for a store ordered by a timestamp (UTC unless the text says otherwise, e.g. "
    "2024-06-11T10:00:00Z) or a date (2024-06-11); a decimal integer for one ordered by an integer column"
)
_LIMIT = {"type": "integer", "minimum": 1, "maximum": 10000, "default": 100}


def _query(
    name: str, description: str | None = None, schema: dict[str, Any] | None = None, required: bool = False
) -> dict[str, Any]:
    """A query parameter (a string unless `schema` says otherwise)."""
    parameter: dict[str, Any] = {
        "name": name,
        "in": "query",
        "required": required,
        "schema": {"type": "string"} if schema is None else schema,
    }
    if description is not None:
        parameter["description"] = description
    return parameter


def _array_of_objects(required: list[str], properties: dict[str, Any]) -> dict[str, Any]:
    """An array of objects with `properties`, the `required` ones in each."""
    return {"type": "array", "items": {"type": "object", "required": required, "properties": properties}}


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


def _timeline_read(operation: str, summary: str, schema: str, what: str, kind: str) -> dict[str, Any]:
    """A history or windows read: its parameters and answers."""
    return {
        "get": {
            "operationId": operation,
            "summary": summary,
            "parameters": [
                _STORE,
                _KEY,
                _query("from", f"{what} from this time on (inclusive). {_TIME_BOUND}"),
                _query("to", f"{what} before this time (exclusive); same form as `from`"),
                _query("limit", "at most this many; `next` then continues the read", _LIMIT),
                _query(
                    "order",
                    "oldest first (asc) or newest first (desc)",
                    {"type": "string", "enum": ["asc", "desc"], "default": "asc"},
                ),
                _query("cursor", "the `next` of the previous page, with the same store, key, from, to and order"),
                _query("min_offset", "live stores only: as for getKey (read your own write)", _OFFSET),
            ],
            "responses": {
                "200": _read_answer(schema, f"the key's {what}, in time order (none: an empty list)", _READ_HEADERS),
                "400": _error(
                    f"`wrong_store_kind`: the store is not a {kind} store; `bad_request`: an unknown, repeated "
                    "or malformed parameter, `from` after `to`, or `limit` out of range; `bad_cursor`: the "
                    "cursor is malformed, altered or continues another read; `bad_key`; `not_live`: "
                    "min_offset on a store that follows no topic"
                ),
                "404": _error("`store_not_found`"),
                **_NOT_ACCEPTABLE,
                "410": _error("`cursor_expired`: the cursor continues a version of the store no longer served"),
                "414": _error("`key_too_long`: the key is longer than `max_key_bytes`"),
                **_NOT_ALLOWED,
                **_QUOTA,
                **_GUARD,
                "503": _error(
                    "`overloaded`, `partition_unavailable` or `not_up_to_bound`: retry after `Retry-After` seconds",
                    retry_after=True,
                ),
                **_INTERNAL,
            },
        }
    }  # fmt: skip


def _json(schema_ref: str, description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema_ref}"}}},
    }
    if headers:
        response["headers"] = headers
    return response


def _read_answer(schema_ref: str, description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    """The 200 of a key, timeline or batch read: JSON, or Avro when the request's Accept prefers it."""
    response = _json(schema_ref, description, {**(headers or {}), **_AVRO_HEADERS})
    response["content"][AVRO] = {
        "schema": {
            "type": "string",
            "contentMediaType": AVRO,
            "description": "the same answer in the Avro envelope `GET /stores/{store}/schema` publishes (also "
            "served as the store's own media type, application/vnd.keyroute.{store}+avro)",
        }
    }
    return response


_AVRO_HEADERS = {
    HEADER_SCHEMA_ID: {
        "description": "Avro answers only: the envelope schema's CRC-64-AVRO fingerprint (16 hex digits)",
        "schema": {"type": "string"},
    }
}
_NOT_ACCEPTABLE = {
    "406": _error(
        "`not_acceptable`: the Accept header offers neither application/json, application/avro nor "
        "application/vnd.keyroute.{store}+avro (the message lists them)"
    )
}


OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {
        "title": "keyroute router",
        "version": "1",
        "description": (
            "One-hop reads of partitioned state: each key is routed to a node serving its partition, "
            "partitioned exactly as Kafka's default partitioner. Every error is a JSON object with an "
            "`error` code and a human `message`. Integers: in a JSON body, any JSON number with no "
            "fractional part, as JSON Schema 2020-12 counts integers (14571, 14571.0 and 1.4571e4 are all "
            "14571); a fraction (14571.5), a boolean or a value out of range is a 400 `bad_request`. In a "
            "query string, decimal digits only (no sign '+', fraction or exponent)."
        ),
    },
    "paths": {
        "/stores/{store}/keys/{key}": {
            "get": {
                "operationId": "getKey",
                "summary": "The value of one key",
                "parameters": [
                    _STORE,
                    _KEY,
                    _query(
                        "min_offset",
                        "live stores only: answer from a state that has applied at least this topic offset of the "
                        "key's partition (read-your-writes after a produce), else 503 not_up_to_bound",
                        _OFFSET,
                    ),
                ],
                "responses": {
                    "200": _read_answer("Found", "the key's value", _READ_HEADERS),
                    "400": _error(
                        "`bad_key`: the key does not fit the store's key format or is not UTF-8; `bad_request`: "
                        "min_offset is not an offset; `not_live`: min_offset on a store that follows no topic"
                    ),
                    "404": _error("`store_not_found`, `key_not_found`, or `not_found` (not a key path)"),
                    **_NOT_ACCEPTABLE,
                    "414": _error("`key_too_long`: the key is longer than `max_key_bytes`"),
                    **_NOT_ALLOWED,
                    **_QUOTA,
                    **_GUARD,
                    "503": _error(
                        "`overloaded` (too many requests in progress), `partition_unavailable` (no node serves the "
                        "partition, a rebalance or reload is in flight) or `not_up_to_bound` (no replica applied "
                        "min_offset within the wait; X-Keyroute-Offset says how far the last one asked got): "
                        "retry after `Retry-After` seconds",
                        retry_after=True,
                    ),
                    **_INTERNAL,
                },
            }
        },
        "/stores/{store}/keys/{key}/history": _timeline_read(
            "getHistory", "Every row of one key in a time range (history stores)", "History", "rows", "history"
        ),
        "/stores/{store}/keys/{key}/windows": _timeline_read(
            "getWindows",
            "The windows of one key that overlap a time range (windowed stores)",
            "Windows",
            "windows",
            "windowed",
        ),
        "/stores/{store}/range": {
            "get": {
                "operationId": "getRange",
                "summary": "The keys of a range, in the store's key order, with their values (routers only)",
                "parameters": [
                    _STORE,
                    _query("from_key", "the first key of the range (inclusive), in the key's text form"),
                    _query("to_key", "the end of the range (exclusive)"),
                    _query("prefix", "string keys: the keys starting with this text (instead of from_key/to_key)"),
                    _query("limit", "at most this many keys; `next` then continues the read", _LIMIT),
                    _query("cursor", "the `next` of the previous page, with the same store and bounds"),
                ],
                "responses": {
                    "200": _json("Range", "the keys in order: bytes of the serialized key; integers numerically"),
                    "400": _error(
                        "`bad_key`: a bound does not fit the key format; `bad_request`: an unknown, repeated or "
                        "malformed parameter, from_key after to_key, a prefix on keys that are not strings, or "
                        "`limit` out of range; `bad_cursor`: the cursor is malformed, altered or continues "
                        "another range"
                    ),
                    "404": _error("`store_not_found`"),
                    "410": _error("`cursor_expired`: the cursor continues a version no longer served"),
                    **_NOT_ALLOWED,
                    **_QUOTA,
                    **_GUARD,
                    "503": _error(
                        "`overloaded` or `partition_unavailable` (no replica of some partition answered): retry "
                        "after `Retry-After` seconds",
                        retry_after=True,
                    ),
                    **_INTERNAL,
                },
            }
        },  # fmt: skip
        "/stores/{store}/batch-get": {
            "post": {
                "operationId": "batchGet",
                "summary": "Many keys of one store, one result per key in request order",
                "parameters": [_STORE],
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/BatchRequest"}}},
                },
                "responses": {
                    "200": _read_answer("BatchResponse", "one entry per key, each with its own status"),
                    "400": _error(
                        '`bad_request`: the body is not JSON of the form {"keys": [...]}, or a bound is malformed '
                        "or names a partition the store lacks"
                    ),
                    "404": _error("`store_not_found`"),
                    **_NOT_ACCEPTABLE,
                    "408": _error("`body_timeout`: the body did not arrive whole within the configured time"),
                    "413": _error("`too_many_keys` (more than `max_batch_keys`) or `body_too_large`"),
                    **_NOT_ALLOWED,
                    **_QUOTA,
                    **_GUARD,
                    **_INTERNAL,
                },
            }
        },
        "/stores/{store}/schema": {
            "get": {
                "operationId": "getAnswerSchema",
                "summary": "The Avro schema of the store's Avro answers (routers and nodes alike)",
                "description": "Key, timeline and batch reads answer Avro binary when the request's Accept "
                "prefers application/avro or application/vnd.keyroute.{store}+avro to JSON (JSON is the "
                "default, and a tie is JSON; errors are always JSON). The envelope holds the JSON answer's "
                "fields (null where it has none); a value is a map from column name to null, boolean, long, "
                "double or string, or a `keyroute.Nested` record with the JSON text of what those do not hold "
                "exactly (an object, an array, an integer beyond 64 bits). One schema serves every store: its "
                "id (X-Keyroute-Schema-Id) is its CRC-64-AVRO fingerprint; the store's columns are named in "
                "its documentation.",
                "parameters": [_STORE],
                "responses": {
                    "200": _json("AnswerSchema", "the schema, its id and the media types"),
                    "404": _error("`store_not_found`"),
                    **_NOT_ALLOWED,
                    **_GUARD,
                    **_INTERNAL,
                },
            }
        },
        "/admin/partition-map": {
            "get": {
                "operationId": "partitionMap",
                "summary": "The partition map: a summary, filtered and paged detail, or the whole document",
                "description": "Without parameters, a summary that does not grow with partitions (per store its "
                "counts of partitions served, under-replicated, unserved, loading and lagging, live lag max and "
                "p99, and a heat strip; per node its zone, state and partition counts; totals and problems). "
                "With `store`, `node`, `state` or `partition` (combined: all must hold), the matching "
                "partitions, paged by `limit` and `cursor`. `detail=all`: the whole document (every store's "
                "every partition). Every answer carries an `ETag` (the map and assignment generations) and "
                "honours `If-None-Match` (304). `since` with `wait_s` is a long poll: it answers when the map "
                "passes generation `since` (or its ETag is no longer the `If-None-Match` given), else after "
                "`wait_s` seconds.",
                "security": [{"adminToken": []}, {}],
                "parameters": [
                    _query("detail", "`all`: the whole document", {"enum": ["all"]}),
                    _query("store", "only this store's partitions"),
                    _query("node", "only partitions this node is assigned or serves"),
                    _query("state", "only partitions in this state", {"enum": list(FILTER_STATES)}),
                    _query("partition", "only this partition (of `store`, else of every store)", _INT0),
                    _query(
                        "limit",
                        f"partitions per page (default {DEFAULT_LIMIT})",
                        {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT},
                    ),
                    _query("cursor", "the `next` of the previous page"),
                    _query("since", "the map generation the caller has (long poll)", _INT0),
                    _query(
                        "wait_s",
                        "how long a long poll may wait",
                        {"type": "number", "minimum": 0, "maximum": MAX_WAIT_S},
                    ),
                ],
                "responses": {
                    "200": _json("PartitionMap", "the router's current view", _VIEW_HEADERS),
                    "304": _NOT_MODIFIED,
                    "400": _error("`bad_request`: a parameter is unknown, repeated or out of range; it is named"),
                    **_ADMIN,
                    **_NOT_ALLOWED,
                    **_GUARD,
                    **_INTERNAL,
                },
            }
        },  # fmt: skip
        "/routing": {
            "get": {
                "operationId": "routing",
                "summary": "What a client needs to send each key to a node serving it (direct routing)",
                "description": "Per store its shape, partitioner, key format and version, and per partition the "
                "serving replicas (preferred first) as indices into `nodes` ([node id, URL] pairs). `since`: "
                "only the stores whose routing changed after that map generation (all of them when the router "
                "does not know that far back: `since` is then absent from the answer); `store` (repeatable): "
                "only those stores. ETag and If-None-Match (304) as the partition map. Open like the data API: "
                "it says no more than reads through the router and the nodes' own answers already show.",
                "parameters": [
                    _query("since", "the map generation the caller has", _INT0),
                    _query("store", "only this store (repeat for several)"),
                ],
                "responses": {
                    "200": _json("Routing", "the routing view", _VIEW_HEADERS),
                    "304": _NOT_MODIFIED,
                    "400": _error("`bad_request`: a parameter is unknown or out of range; it is named"),
                    **_NOT_ALLOWED,
                    **_GUARD,
                    **_INTERNAL,
                },
            }
        },  # fmt: skip
        "/admin/ui": {
            "get": {
                "operationId": "partitionMapPage",
                "summary": "The partition map as a page for people (self-contained HTML, updating itself)",
                "security": [{"adminToken": []}, {"adminSession": []}, {}],
                "responses": {
                    "200": {"description": "the page", "content": {"text/html": {"schema": {"type": "string"}}}},
                    "303": {
                        "description": "to `/admin/login`: no session (or an admin token in the URL, never honoured)"
                    },
                    **_NOT_ALLOWED,
                    **_GUARD,
                    **_INTERNAL,
                },
            }
        },  # fmt: skip
        "/admin/login": {
            "get": {
                "operationId": "loginForm",
                "summary": "The admin login form (self-contained HTML; 303 to /admin/ui without an admin token)",
                "responses": {
                    "200": {"description": "the form", "content": {"text/html": {"schema": {"type": "string"}}}},
                    "303": {"description": "to `/admin/ui`: no admin token is configured"},
                    **_NOT_ALLOWED,
                    **_GUARD,
                    **_INTERNAL,
                },
            },
            "post": {
                "operationId": "login",
                "summary": "Check the form's `token`; set the `keyroute_admin` session cookie",
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/x-www-form-urlencoded": {
                            "schema": {
                                "type": "object",
                                "properties": {"token": {"type": "string"}},
                                "required": ["token"],
                            }
                        }
                    },
                },
                "responses": {
                    "303": {"description": "to `/admin/ui`, with the session cookie set (HttpOnly, SameSite=Strict)"},
                    "401": _error("`unauthorized`: the token is not the admin token (HTML for a browser)"),
                    "413": _error("`body_too_large`"),
                    **_NOT_ALLOWED,
                    **_GUARD,
                    **_INTERNAL,
                },
            },
        },
        "/admin/logout": {
            "post": {
                "operationId": "logout",
                "summary": "Clear the session cookie",
                "responses": {
                    "303": {"description": "to `/admin/login`, with the session cookie cleared"},
                    **_NOT_ALLOWED,
                    **_GUARD,
                    **_INTERNAL,
                },
            }
        },
        "/admin/quotas": {
            "get": {
                "operationId": "quotas",
                "summary": "Each identity's rate against its quota, per store, on this router",
                "security": [{"adminToken": []}, {}],
                "responses": {
                    "200": _json("Quotas", "the quotas and the buckets in use"),
                    **_ADMIN,
                    **_NOT_ALLOWED,
                    **_GUARD,
                    **_INTERNAL,
                },
            }
        },
        "/admin/route": {
            "get": {
                "operationId": "route",
                "summary": "Hash, partition, assigned and serving nodes for one key",
                "security": [{"adminToken": []}, {}],
                "parameters": [
                    _query("store", required=True),
                    _query("key", required=True),
                ],
                "responses": {
                    "200": _json("Route", "where the key goes"),
                    "400": _error("`bad_request` (a parameter is missing) or `bad_key`"),
                    **_ADMIN,
                    "404": _error("`store_not_found`"),
                    **_NOT_ALLOWED,
                    **_GUARD,
                    **_INTERNAL,
                },
            }
        },
        "/healthz": {
            "get": {
                "operationId": "healthz",
                "summary": "The process is alive",
                "responses": {
                    "200": _json("Health", "alive"),
                    **_NOT_ALLOWED,
                    "431": _GUARD["431"],
                    **_INTERNAL,
                },
            }
        },
        "/readyz": {
            "get": {
                "operationId": "readyz",
                "summary": "The router has a complete partition map (stale while ZooKeeper is away)",
                "responses": {
                    "200": _json("Readiness", "ready"),
                    "503": _json("Readiness", "not ready: some partition of a store is served by no node"),
                    **_NOT_ALLOWED,
                    "431": _GUARD["431"],
                    **_INTERNAL,
                },
            }
        },
        "/metrics": {
            "get": {
                "operationId": "metrics",
                "summary": "Prometheus metrics (the admin token with --metrics-require-token; with access control on, "
                "an admin caller unless --metrics-open)",
                "security": [{"adminToken": []}, {}],
                "responses": {
                    "200": {
                        "description": "Prometheus text exposition format",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    },
                    **_ADMIN,
                    **_NOT_ALLOWED,
                    **_GUARD,
                    **_INTERNAL,
                },
            }
        },
        "/openapi.json": {
            "get": {
                "operationId": "openapi",
                "summary": "This document",
                "responses": {
                    "200": {
                        "description": "the OpenAPI 3.1 document of the router's API",
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    },
                    **_NOT_ALLOWED,
                    **_GUARD,
                    **_INTERNAL,
                },
            }
        },
    },
    "components": {
        "securitySchemes": {
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
        },
        "headers": {
            "Retry-After": {"description": "seconds to wait before asking again", "schema": {"type": "integer"}}
        },
        "schemas": {
            "Error": {
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
            "Found": _key_answer("value", {"type": "object", "description": "the store's value columns for the key"}),
            "History": _key_answer(
                "rows",
                {
                    "type": "array",
                    "items": {"type": "object"},
                    "description": "the key's rows (value columns and the order_by column), in time order",
                },
                "present when more rows follow: the next page's cursor",
            ),
            "Windows": _key_answer(
                "windows",
                _array_of_objects(
                    ["start", "end", "value"],
                    {
                        "start": {"description": "the window's first time (inclusive)"},
                        "end": {"description": "the window's end (exclusive)"},
                        "value": {"type": "object", "description": "the aggregations over the window"},
                    },
                ),
                "present when more windows follow",
            ),
            "Range": {
                "type": "object",
                "required": ["store", "keys"],
                "properties": {
                    "store": {"type": "string"},
                    "keys": _array_of_objects(
                        ["key", "partition", "value"],
                        {
                            "key": {"type": "string"},
                            "partition": {"type": "integer", "minimum": 0},
                            "value": {"description": "the key's value (a history or windowed store's latest)"},
                        },
                    ),
                    "next": {"type": "string", "description": "present when more keys follow: the next page's cursor"},
                },
            },
            "BatchRequest": {
                "type": "object",
                "required": ["keys"],
                "properties": {
                    "keys": {
                        "type": "array",
                        "items": {"type": ["string", "integer"]},
                        "description": "strings; integers are accepted for integer key formats (a JSON number "
                        "with no fractional part: 5.0 is the key 5)",
                    },
                    "min_offset": {
                        **_OFFSET,
                        "description": "live stores: a bound for every partition of the request (see getKey); "
                        "a JSON number with no fractional part (14571.0 is 14571)",
                    },
                    "min_offsets": {
                        "type": "object",
                        "description": "live stores: a bound per partition, by partition number; with "
                        "min_offset too, the larger bound applies",
                        "propertyNames": {"pattern": "^[0-9]+$"},
                        "additionalProperties": _BODY_OFFSET,
                    },
                },
            },
            "BatchEntry": {
                "type": "object",
                "required": ["key", "status"],
                "properties": {
                    "key": {"type": ["string", "integer"]},
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
            "BatchResponse": {
                "type": "object",
                "required": ["results"],
                "properties": {"results": {"type": "array", "items": {"$ref": "#/components/schemas/BatchEntry"}}},
            },
            "AnswerSchema": {
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
            "PartitionMap": {
                "type": "object",
                "description": "`view` says which: `summary` (the default), `detail` (`partitions`, `matched`, "
                "and `next` when more pages follow) or, with `detail=all`, the whole document without `view`: "
                "stores (partitions, partitioner, key format, version), nodes, and per partition "
                "the assigned replicas and the serving nodes with versions; the map generation, the assignment "
                "generation and the map's age. A live "
                "store says `live` (and `topic`), and each of its partitions lists under `live` every replica's "
                "report: node, version, offset, lag_records, lag_ms, state, applied, skipped, error",
                "required": ["generation"],
                "properties": {
                    "view": {"enum": ["summary", "detail"]},
                    "stores": {"type": "object"},
                    "nodes": {"type": "object"},
                    "generation": {"type": "integer", "description": _MAP_GENERATION},
                    "router": {"type": "boolean"},
                },
            },
            "Routing": {
                "type": "object",
                "required": ["format", "generation", "nodes", "stores", "store_names"],
                "properties": {
                    "format": {"type": "integer", "description": "raised on a change older clients cannot read"},
                    "generation": {"type": "integer", "description": _MAP_GENERATION},
                    "assignment_generation": {"type": "integer"},
                    "stale": {"type": "boolean"},
                    "since": {"type": "integer", "description": "present when only changed stores are given"},
                    "store_names": {"type": "array", "items": {"type": "string"}},
                    "nodes": {"type": "array", "items": {"type": "array", "items": {"type": "string"}}},
                    "stores": {"type": "object"},
                },
            },
            "Endpoint": {
                "type": "object",
                "properties": {"node": {"type": "string"}, "url": {"type": "string"}, "version": {"type": "integer"}},
            },
            "Route": {
                "type": "object",
                "required": ["store", "key", "hash", "partition", "assigned", "serving"],
                "properties": {
                    "store": {"type": "string"},
                    "key": {"type": "string"},
                    "hash": {"type": "integer"},
                    "partition": {"type": "integer"},
                    "assigned": {"type": "array", "items": {"type": "string"}},
                    "serving": {"type": "array", "items": {"$ref": "#/components/schemas/Endpoint"}},
                    "last_known": {"type": "array", "items": {"$ref": "#/components/schemas/Endpoint"}},
                },
            },
            "Quotas": {
                "type": "object",
                "required": ["routers", "identities", "buckets"],
                "properties": {
                    "routers": {"type": "integer", "description": "routers up, sharing every quota"},
                    "identities": {
                        "type": "object",
                        "description": "the quota file: per identity rate, burst_s, stores",
                    },
                    "buckets": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "identity": {"type": "string"},
                                "store": {"type": "string"},
                                "quota": {"type": "number", "description": "reads/s, cluster-wide"},
                                "share": {"type": "number", "description": "reads/s this router enforces"},
                                "used": {"type": "number", "description": "share of the last burst's tokens spent"},
                                "reads": {"type": "integer"},
                                "rejected": {"type": "integer"},
                            },
                        },
                    },
                },
            },
            "Health": {
                "type": "object",
                "required": ["status"],
                "properties": {"status": {"const": "ok"}},
            },
            "Readiness": {
                "type": "object",
                "required": ["ready", "stale", "generation", "complete", "stores_loading"],
                "properties": {
                    "ready": {"type": "boolean"},
                    "stale": {"type": "boolean"},
                    "generation": {"type": "integer", "description": _MAP_GENERATION},
                    "complete": {"type": "boolean"},
                    "stores_loading": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}

OPENAPI_JSON = json.dumps(OPENAPI, ensure_ascii=False).encode("utf-8")
