"""A development Schema Registry: the subset of Confluent Schema Registry's REST API that confluent-kafka's
SchemaRegistryClient and its Avro / Protobuf / JSON Schema serializers use, for tests and `keyroute demo`.

It is a double, not a registry for production: state is held in memory (optionally written to a JSON file after
every change and read back at start), compatibility is checked for Avro only (BACKWARD, FORWARD, FULL and their
_TRANSITIVE forms, by reading one schema's fields with the other), and Protobuf / JSON Schema texts are stored as
given. Answers and error bodies have the real registry's shape: `{"error_code": 40401, "message": ...}`.

Run it with `keyroute schema-registry --port N [--data FILE]`.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

MEDIA_TYPE = "application/vnd.schemaregistry.v1+json"
SCHEMA_TYPES = ("AVRO", "PROTOBUF", "JSON")
LEVELS = (
    "NONE",
    "BACKWARD",
    "BACKWARD_TRANSITIVE",
    "FORWARD",
    "FORWARD_TRANSITIVE",
    "FULL",
    "FULL_TRANSITIVE",
)
DEFAULT_LEVEL = "BACKWARD"


class RegistryError(Exception):
    """An answer with the real registry's error body: HTTP `status`, `{"error_code": code, "message": ...}`."""

    def __init__(self, status: int, code: int, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def _subject_not_found(subject: str) -> RegistryError:
    return RegistryError(404, 40401, f"Subject '{subject}' not found.")


def _version_not_found(version: Any) -> RegistryError:
    return RegistryError(404, 40402, f"Version {version} not found.")


def _schema_not_found(what: str = "Schema not found") -> RegistryError:
    return RegistryError(404, 40403, what)


def _invalid_schema(why: str) -> RegistryError:
    return RegistryError(422, 42201, f"Invalid schema: {why}")


# ------------------------------------------------------------------------------------------------ Avro rules
_PROMOTIONS = {
    "int": {"int", "long", "float", "double"},
    "long": {"long", "float", "double"},
    "float": {"float", "double"},
    "string": {"string", "bytes"},
    "bytes": {"bytes", "string"},
}


def _avro_parse(text: str, named: dict[str, Any] | None = None) -> Any:
    """The schema parsed by fastavro (names resolved), or an Invalid schema error."""
    import fastavro

    try:
        return fastavro.parse_schema(json.loads(text), named_schemas=named if named is not None else {})
    except Exception as exc:  # fastavro raises several kinds (SchemaParseException, ValueError, KeyError...)
        raise _invalid_schema(str(exc) or type(exc).__name__) from None


def _kind(schema: Any) -> str:
    if isinstance(schema, list):
        return "union"
    if isinstance(schema, dict):
        return str(schema["type"]) if isinstance(schema["type"], str) else _kind(schema["type"])
    return str(schema)


def _avro_reads(reader: Any, writer: Any, named: dict[str, Any], path: str, seen: set[tuple[str, str]]) -> str | None:
    """Why data written with `writer` cannot be read with `reader` (Avro's schema resolution), else None."""
    if isinstance(reader, str) and reader in named:
        reader = named[reader]
    if isinstance(writer, str) and writer in named:
        writer = named[writer]
    if isinstance(writer, list):  # every branch the writer may have used must be readable
        for branch in writer:
            why = _avro_reads(reader, branch, named, path, seen)
            if why:
                return why
        return None
    if isinstance(reader, list):
        if any(_avro_reads(branch, writer, named, path, seen) is None for branch in reader):
            return None
        return f"{path or 'the value'}: the reader's union has no branch for the writer's {_kind(writer)}"
    rk, wk = _kind(reader), _kind(writer)
    if rk != wk and rk not in _PROMOTIONS.get(wk, ()):
        return f"{path or 'the value'}: {wk} cannot be read as {rk}"
    if rk == "record":
        key = (reader.get("name", ""), writer.get("name", ""))
        if key in seen:  # a recursive type: already being compared
            return None
        seen = seen | {key}
        written = {f["name"]: f for f in writer["fields"]}
        for field in reader["fields"]:
            where = f"{path}.{field['name']}" if path else field["name"]
            if field["name"] in written:
                why = _avro_reads(field["type"], written[field["name"]]["type"], named, where, seen)
                if why:
                    return why
            elif "default" not in field:
                return f"{where}: a field the writer does not have, without a default"
    elif rk == "array":
        return _avro_reads(reader["items"], writer["items"], named, f"{path}[]", seen)
    elif rk == "map":
        return _avro_reads(reader["values"], writer["values"], named, f"{path}{{}}", seen)
    elif rk == "enum":
        missing = set(writer["symbols"]) - set(reader["symbols"])
        if missing and "default" not in reader:
            return f"{path or 'the value'}: the reader lacks the symbols {sorted(missing)}"
    elif rk == "fixed" and reader["size"] != writer["size"]:
        return f"{path or 'the value'}: fixed of size {writer['size']} cannot be read as size {reader['size']}"
    return None


def avro_incompatibility(new: str, old: str, level: str) -> str | None:
    """Why `new` breaks compatibility `level` with `old` (one earlier version), else None."""
    named: dict[str, Any] = {}
    new_parsed, old_parsed = _avro_parse(new, named), _avro_parse(old, {})
    named.update(_named(old_parsed))
    named.update(_named(new_parsed))
    if level.startswith(("BACKWARD", "FULL")):
        why = _avro_reads(new_parsed, old_parsed, named, "", set())
        if why:
            return f"the new schema cannot read data written with the old one: {why}"
    if level.startswith(("FORWARD", "FULL")):
        why = _avro_reads(old_parsed, new_parsed, named, "", set())
        if why:
            return f"the old schema cannot read data written with the new one: {why}"
    return None


def _named(schema: Any, out: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every named type of a parsed schema, by full name."""
    out = {} if out is None else out
    if isinstance(schema, list):
        for branch in schema:
            _named(branch, out)
    elif isinstance(schema, dict):
        if schema.get("type") in ("record", "enum", "fixed", "error") and "name" in schema:
            out[schema["name"]] = schema
        for field in schema.get("fields", ()):
            _named(field["type"], out)
        for key in ("items", "values"):
            if key in schema:
                _named(schema[key], out)
        if isinstance(schema.get("type"), dict | list):
            _named(schema["type"], out)
    return out


# ------------------------------------------------------------------------------------------------ the state
class Registry:
    """Schemas by id, subjects' versions and compatibility levels; thread-safe; written to `data` (a JSON
    file) after every change when given."""

    def __init__(self, data: Path | None = None) -> None:
        self.data = data
        self._lock = threading.Lock()
        self.schemas: dict[int, dict[str, Any]] = {}
        self.subjects: dict[str, list[dict[str, Any]]] = {}
        self.config: dict[str, str] = {}
        self.level = DEFAULT_LEVEL
        if data is not None and data.exists():
            self._load(data)

    # ---- persistence
    def _load(self, path: Path) -> None:
        try:
            state = json.loads(path.read_text())
            self.schemas = {int(k): v for k, v in state["schemas"].items()}
            self.subjects = {k: list(v) for k, v in state["subjects"].items()}
            self.config = dict(state.get("config", {}))
            self.level = str(state.get("level", DEFAULT_LEVEL))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path} is not a schema registry data file: {exc}") from None

    def _save(self) -> None:
        if self.data is None:
            return
        state = {"schemas": self.schemas, "subjects": self.subjects, "config": self.config, "level": self.level}
        tmp = self.data.with_name(self.data.name + ".tmp")
        tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
        os.replace(tmp, self.data)

    # ---- helpers
    @staticmethod
    def _normal(schema: str, schema_type: str) -> str:
        """The text two registrations compare by: JSON re-serialised with sorted keys (Avro, JSON Schema)."""
        if schema_type in ("AVRO", "JSON"):
            try:
                return json.dumps(json.loads(schema), sort_keys=True, separators=(",", ":"))
            except ValueError:
                raise _invalid_schema("not JSON") from None
        return schema

    def _versions(self, subject: str, deleted: bool = False) -> list[dict[str, Any]]:
        versions = [v for v in self.subjects.get(subject, ()) if deleted or not v.get("deleted")]
        if not versions:
            raise _subject_not_found(subject)
        return versions

    def _version(self, subject: str, version: str, deleted: bool = False) -> dict[str, Any]:
        versions = self._versions(subject, deleted)
        if version == "latest" or version == "-1":
            return versions[-1]
        try:
            number = int(version)
        except ValueError:
            raise RegistryError(
                422,
                42202,
                f"The specified version '{version}' is not a valid version id. Allowed values are between "
                '[1, 2^31-1] and the string "latest"',
            ) from None
        for entry in versions:
            if entry["version"] == number:
                return entry
        raise _version_not_found(number)

    def _answer(self, subject: str, entry: dict[str, Any]) -> dict[str, Any]:
        schema = self.schemas[entry["id"]]
        return {"subject": subject, "version": entry["version"], "id": entry["id"], **self._schema_body(schema)}

    @staticmethod
    def _schema_body(schema: dict[str, Any]) -> dict[str, Any]:
        body: dict[str, Any] = {"schema": schema["schema"], "guid": schema["guid"]}
        if schema["schemaType"] != "AVRO":
            body["schemaType"] = schema["schemaType"]
        if schema["references"]:
            body["references"] = schema["references"]
        return body

    @staticmethod
    def _request_schema(body: Any) -> tuple[str, str, list[dict[str, Any]]]:
        if not isinstance(body, dict) or not isinstance(body.get("schema"), str):
            raise _invalid_schema('the body must be a JSON object with a "schema" string')
        schema_type = str(body.get("schemaType") or "AVRO").upper()
        if schema_type not in SCHEMA_TYPES:
            raise RegistryError(422, 42201, f"Invalid schema type {schema_type}: one of {', '.join(SCHEMA_TYPES)}")
        references = body.get("references") or []
        if not isinstance(references, list) or not all(
            isinstance(r, dict) and {"name", "subject", "version"} <= r.keys() for r in references
        ):
            raise _invalid_schema("references must be a list of {name, subject, version}")
        return (
            body["schema"],
            schema_type,
            [{"name": str(r["name"]), "subject": str(r["subject"]), "version": int(r["version"])} for r in references],
        )

    def _referenced_avro(self, references: list[dict[str, Any]]) -> dict[str, Any]:
        """The named types of the schemas an Avro schema references (so its text may use their names)."""
        named: dict[str, Any] = {}
        for ref in references:
            entry = self._version(ref["subject"], str(ref["version"]))
            schema = self.schemas[entry["id"]]
            named.update(self._referenced_avro(schema["references"]))
            _avro_parse(schema["schema"], named)
        return named

    def level_of(self, subject: str) -> str:
        return self.config.get(subject, self.level)

    def _incompatibility(
        self, subject: str, schema: str, schema_type: str, against: list[dict[str, Any]]
    ) -> str | None:
        level = self.level_of(subject)
        if level == "NONE" or schema_type != "AVRO" or not against:
            return None
        earlier = against if level.endswith("_TRANSITIVE") else against[-1:]
        for entry in earlier:
            old = self.schemas[entry["id"]]
            if old["schemaType"] != "AVRO" or old["references"]:
                continue
            why = avro_incompatibility(schema, old["schema"], level)
            if why:
                return f"version {entry['version']} ({level}): {why}"
        return None

    # ---- the API's operations
    def register(self, subject: str, body: Any) -> dict[str, Any]:
        schema, schema_type, references = self._request_schema(body)
        with self._lock:
            key = [self._normal(schema, schema_type), schema_type, references]
            if schema_type == "AVRO":
                _avro_parse(schema, self._referenced_avro(references))
            live = [v for v in self.subjects.get(subject, ()) if not v.get("deleted")]
            for entry in live:
                known = self.schemas[entry["id"]]
                if known["key"] == key:
                    return {"id": entry["id"], **self._answer(subject, entry)}
            why = self._incompatibility(subject, schema, schema_type, live)
            if why:
                raise RegistryError(
                    409,
                    409,
                    f"Schema being registered is incompatible with an earlier schema for "
                    f'subject "{subject}", details: {why}',
                )
            schema_id = next((i for i, s in self.schemas.items() if s["key"] == key), None)
            if schema_id is None:
                schema_id = max(self.schemas, default=0) + 1
                self.schemas[schema_id] = {
                    "schema": schema,
                    "schemaType": schema_type,
                    "references": references,
                    "key": key,
                    "guid": str(uuid.uuid4()),
                }
            versions = self.subjects.setdefault(subject, [])
            entry = {"version": max((v["version"] for v in versions), default=0) + 1, "id": schema_id}
            versions.append(entry)
            self._save()
            return self._answer(subject, entry)

    def lookup(self, subject: str, body: Any, deleted: bool) -> dict[str, Any]:
        schema, schema_type, references = self._request_schema(body)
        with self._lock:
            key = [self._normal(schema, schema_type), schema_type, references]
            for entry in self._versions(subject, deleted):
                known = self.schemas[entry["id"]]
                if known["key"] == key:
                    return self._answer(subject, entry)
        raise _schema_not_found()

    def schema(self, schema_id: int, subject: str | None) -> dict[str, Any]:
        with self._lock:
            if schema_id not in self.schemas:
                raise _schema_not_found(f"Schema {schema_id} not found")
            if subject is not None and not any(v["id"] == schema_id for v in self.subjects.get(subject, ())):
                raise _schema_not_found(f"Schema {schema_id} not found under subject {subject}")
            return self._schema_body(self.schemas[schema_id])

    def schema_versions(self, schema_id: int) -> list[dict[str, Any]]:
        with self._lock:
            if schema_id not in self.schemas:
                raise _schema_not_found(f"Schema {schema_id} not found")
            return [
                {"subject": subject, "version": v["version"]}
                for subject, versions in sorted(self.subjects.items())
                for v in versions
                if v["id"] == schema_id and not v.get("deleted")
            ]

    def subject_names(self, deleted: bool) -> list[str]:
        with self._lock:
            return sorted(s for s, vs in self.subjects.items() if any(deleted or not v.get("deleted") for v in vs))

    def version_numbers(self, subject: str, deleted: bool) -> list[int]:
        with self._lock:
            return [v["version"] for v in self._versions(subject, deleted)]

    def get_version(self, subject: str, version: str, deleted: bool) -> dict[str, Any]:
        with self._lock:
            return self._answer(subject, self._version(subject, version, deleted))

    def delete_subject(self, subject: str, permanent: bool) -> list[int]:
        with self._lock:
            versions = self._versions(subject, deleted=permanent)
            numbers = [v["version"] for v in versions]
            if permanent:
                del self.subjects[subject]
            else:
                for v in versions:
                    v["deleted"] = True
            self._save()
            return numbers

    def delete_version(self, subject: str, version: str, permanent: bool) -> int:
        with self._lock:
            entry = self._version(subject, version, deleted=permanent)
            if permanent:
                self.subjects[subject].remove(entry)
                if not self.subjects[subject]:
                    del self.subjects[subject]
            else:
                entry["deleted"] = True
            self._save()
            return int(entry["version"])

    def set_level(self, subject: str | None, body: Any) -> dict[str, str]:
        level = str(body.get("compatibility", "")).upper() if isinstance(body, dict) else ""
        if level not in LEVELS:
            raise RegistryError(422, 42203, f"Invalid compatibility level: one of {', '.join(LEVELS)}")
        with self._lock:
            if subject is None:
                self.level = level
            else:
                self.config[subject] = level
            self._save()
        return {"compatibility": level}

    def get_level(self, subject: str | None, default_to_global: bool) -> dict[str, str]:
        with self._lock:
            if subject is None:
                return {"compatibilityLevel": self.level}
            if subject in self.config:
                return {"compatibilityLevel": self.config[subject]}
            if default_to_global:
                return {"compatibilityLevel": self.level}
        raise RegistryError(404, 40408, f"Subject '{subject}' does not have subject-level compatibility configured")

    def delete_level(self, subject: str) -> dict[str, str]:
        with self._lock:
            level = self.config.pop(subject, self.level)
            self._save()
        return {"compatibilityLevel": level}

    def check(self, subject: str, version: str | None, body: Any, verbose: bool) -> dict[str, Any]:
        schema, schema_type, references = self._request_schema(body)
        with self._lock:
            if schema_type == "AVRO":
                _avro_parse(schema, self._referenced_avro(references))
            if version is None:
                against = [v for v in self.subjects.get(subject, ()) if not v.get("deleted")]
            else:
                against = [self._version(subject, version)]
            if version is not None and not self.level_of(subject).endswith("_TRANSITIVE"):
                against = against[-1:]
            why = self._incompatibility(subject, schema, schema_type, against)
        answer: dict[str, Any] = {"is_compatible": why is None}
        if verbose:
            answer["messages"] = [why] if why else []
        return answer


# ------------------------------------------------------------------------------------------------ HTTP
def _json(content: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(content, status_code=status, media_type=MEDIA_TYPE)


def _flag(request: Request, name: str) -> bool:
    return request.query_params.get(name, "false").strip().lower() == "true"


async def _body(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        raise RegistryError(422, 42201, "Invalid schema: the body is not JSON") from None


def _schema_id(request: Request) -> int:
    try:
        return int(request.path_params["schema_id"])
    except ValueError:
        raise _schema_not_found(f"Schema {request.path_params['schema_id']} not found") from None


def create_app(registry: Registry) -> Starlette:
    """The registry's REST API as an ASGI app."""

    async def register(request: Request) -> JSONResponse:
        return _json(registry.register(request.path_params["subject"], await _body(request)))

    async def lookup(request: Request) -> JSONResponse:
        body = await _body(request)
        return _json(registry.lookup(request.path_params["subject"], body, _flag(request, "deleted")))

    async def schema_by_id(request: Request) -> JSONResponse:
        return _json(registry.schema(_schema_id(request), request.query_params.get("subject")))

    async def schema_versions(request: Request) -> JSONResponse:
        return _json(registry.schema_versions(_schema_id(request)))

    async def schema_types(request: Request) -> JSONResponse:
        return _json(list(SCHEMA_TYPES))

    async def subjects(request: Request) -> JSONResponse:
        return _json(registry.subject_names(_flag(request, "deleted")))

    async def versions(request: Request) -> JSONResponse:
        return _json(registry.version_numbers(request.path_params["subject"], _flag(request, "deleted")))

    async def delete_subject(request: Request) -> JSONResponse:
        return _json(registry.delete_subject(request.path_params["subject"], _flag(request, "permanent")))

    async def version(request: Request) -> JSONResponse:
        subject, number = request.path_params["subject"], request.path_params["version"]
        if request.method == "DELETE":
            return _json(registry.delete_version(subject, number, _flag(request, "permanent")))
        return _json(registry.get_version(subject, number, _flag(request, "deleted")))

    async def version_schema(request: Request) -> JSONResponse:
        answer = registry.get_version(request.path_params["subject"], request.path_params["version"], False)
        return JSONResponse(
            json.loads(answer["schema"]) if answer.get("schemaType", "AVRO") != "PROTOBUF" else answer["schema"]
        )

    async def config(request: Request) -> JSONResponse:
        subject = request.path_params.get("subject")
        if request.method == "PUT":
            return _json(registry.set_level(subject, await _body(request)))
        if request.method == "DELETE" and subject is not None:
            return _json(registry.delete_level(subject))
        return _json(registry.get_level(subject, _flag(request, "defaultToGlobal")))

    async def compatibility(request: Request) -> JSONResponse:
        subject, number = request.path_params["subject"], request.path_params.get("version")
        body = await _body(request)
        return _json(registry.check(subject, number, body, _flag(request, "verbose")))

    async def mode(request: Request) -> JSONResponse:
        return _json({"mode": "READWRITE"})

    async def root(request: Request) -> JSONResponse:
        return _json({})

    async def registry_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RegistryError)
        return _json({"error_code": exc.code, "message": exc.message}, exc.status)

    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        return _json({"error_code": 404, "message": "HTTP 404 Not Found"}, 404)

    async def method_not_allowed(request: Request, exc: Exception) -> JSONResponse:
        return _json({"error_code": 405, "message": "HTTP 405 Method Not Allowed"}, 405)

    # A subject may hold "/" (a Protobuf reference's subject is its file name, sent as %2F), so subjects are
    # matched as paths: the routes with the longer tails come first.
    routes = [
        Route("/", root),
        Route("/schemas/types", schema_types),
        Route("/schemas/ids/{schema_id}", schema_by_id),
        Route("/schemas/ids/{schema_id}/versions", schema_versions),
        Route("/subjects", subjects),
        Route("/subjects/{subject:path}/versions/{version}/schema", version_schema),
        Route("/subjects/{subject:path}/versions/{version}", version, methods=["GET", "DELETE"]),
        Route("/subjects/{subject:path}/versions", versions, methods=["GET"]),
        Route("/subjects/{subject:path}/versions", register, methods=["POST"]),
        Route("/subjects/{subject:path}", lookup, methods=["POST"]),
        Route("/subjects/{subject:path}", delete_subject, methods=["DELETE"]),
        Route("/config", config, methods=["GET", "PUT"]),
        Route("/config/{subject:path}", config, methods=["GET", "PUT", "DELETE"]),
        Route("/compatibility/subjects/{subject:path}/versions/{version}", compatibility, methods=["POST"]),
        Route("/compatibility/subjects/{subject:path}/versions", compatibility, methods=["POST"]),
        Route("/mode", mode),
        Route("/mode/{subject:path}", mode),
    ]
    return Starlette(
        routes=routes,
        exception_handlers={RegistryError: registry_error, 404: not_found, 405: method_not_allowed},
    )


def serve(host: str, port: int, data: Path | None = None) -> None:
    """Serve the registry in the foreground until interrupted (uvicorn)."""
    import uvicorn

    registry = Registry(data)
    uvicorn.run(create_app(registry), host=host, port=port, log_level="warning", access_log=False)
