"""Avro answers: key, batch-get and timeline (history, windows) reads answered as Avro binary on request.

A read whose `Accept` prefers `application/avro` (or the store's own media type,
`application/vnd.keyroute.{store}+avro`) over JSON is answered with the same answer as JSON, written in
the envelope `ANSWER_SCHEMA` (one schema for every store and read kind; `GET /stores/{store}/schema`
publishes it). Errors stay JSON whatever was asked; JSON stays the default (no `Accept`, `*/*`,
`application/json`); an `Accept` offering neither is 406 not_acceptable.

The envelope's fields are the JSON answer's: `store`, `key`, `partition`, `version` and `value` (a key
read), `rows` or `windows` and `next` (a timeline read), `results` (a batch-get: one `Entry` per key, as
its JSON entry). A field the JSON answer lacks is null. A value (a row) is a map from column name to a
`Field`: null, boolean, long, double or string as Avro's own types; what those cannot hold exactly (an
object, an array, an integer beyond 64 bits) is a `Nested` record with the value's JSON text. Values
carry the columns they were stored with, so the schema holds for every store kind and every evolution of
its columns; `schema_document` names the store's columns in the schema's documentation.

`X-Keyroute-Schema-Id` names the schema: its CRC-64-AVRO (Rabin) fingerprint of the Parsing Canonical
Form, 16 hex digits (Avro's own schema fingerprint, the one its single-object encoding uses).
`decode_answer` gives back exactly the dict the JSON answer parses to.
"""

from __future__ import annotations

import copy
import functools
import io
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import orjson
from fastavro import parse_schema, schemaless_reader, schemaless_writer
from fastavro.schema import fingerprint, to_parsing_canonical_form

from keyroute.core.api import ApiError

AVRO = "application/avro"
JSON_TYPE = "application/json"
HEADER_SCHEMA_ID = "X-Keyroute-Schema-Id"
NESTED = "keyroute.Nested"

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


def store_media_type(store: str) -> str:
    """The store's own media type for its Avro answers."""
    return f"application/vnd.keyroute.{store}+avro"


def _optional(name: str, kind: Any) -> dict[str, Any]:
    return {"name": name, "type": ["null", kind], "default": None}


_NESTED_RECORD = {
    "type": "record",
    "name": "Nested",
    "doc": "A JSON value Avro's other branches do not hold exactly (an object, an array, an integer beyond 64"
    " bits, a value that is not an object), as its JSON text.",
    "fields": [{"name": "json", "type": "string"}],
}
# A column's value (Nested defined at its first use, named after it).
_FIELD = ["null", "boolean", "long", "double", "string", _NESTED_RECORD]
_FIELD_AGAIN = ["null", "boolean", "long", "double", "string", NESTED]
# A value or a row: its columns. JSON null is absent (a value always is an object; anything else is Nested).
_VALUE = ["null", {"type": "map", "values": _FIELD}, NESTED]
_VALUE_AGAIN = ["null", {"type": "map", "values": _FIELD_AGAIN}, NESTED]

ANSWER_SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "Answer",
    "namespace": "keyroute",
    "doc": "A keyroute read's answer: the JSON answer's fields, null where the JSON answer has none.",
    "fields": [
        _optional("store", "string"),
        _optional("key", "string"),
        _optional("partition", "int"),
        _optional("version", "long"),
        {"name": "value", "type": _VALUE, "default": None},
        _optional("rows", {"type": "array", "items": _VALUE_AGAIN}),
        _optional("windows", {"type": "array", "items": _VALUE_AGAIN}),
        _optional("next", "string"),
        _optional(
            "results",
            {
                "type": "array",
                "items": {
                    "type": "record",
                    "name": "Entry",
                    "doc": "One key of a batch-get, as its JSON entry.",
                    "fields": [
                        {"name": "key", "type": _FIELD_AGAIN},
                        {"name": "status", "type": "int"},
                        _optional("partition", "int"),
                        _optional("version", "long"),
                        _optional("offset", "long"),
                        _optional("node", "string"),
                        {"name": "value", "type": _VALUE_AGAIN, "default": None},
                        _optional("error", "string"),
                        _optional("message", "string"),
                    ],
                },
            },
        ),
    ],
}

_PARSED = parse_schema(copy.deepcopy(ANSWER_SCHEMA))
SCHEMA_ID = fingerprint(to_parsing_canonical_form(_PARSED), "CRC-64-AVRO")  # 16 hex digits
_TOP_FIELDS = ("store", "key", "partition", "version", "next")
_ENTRY_FIELDS = ("partition", "version", "offset", "node", "error", "message")


class NotAcceptable(ApiError):
    """A read whose Accept offers none of the answer's media types."""

    status = 406
    code = "not_acceptable"


# -- choosing the answer's media type ---------------------------------------------------------------------

# The Accept values that mean JSON, answered without parsing them (every read checks).
_JSON_ACCEPTS = frozenset({b"*/*", b"application/json", b"application/json, */*"})


def answer_type(accept: bytes | None, store: str) -> bytes | None:
    """The Avro media type to answer a read of `store` with (bytes, for the content type), or None for JSON,
    as the raw `Accept` header's value `accept` prefers (JSON on a tie). Raises NotAcceptable (406) when
    it offers neither."""
    if accept is None or accept in _JSON_ACCEPTS:
        return None
    return _negotiate(accept, store)


@functools.lru_cache(maxsize=512)
def _negotiate(accept: bytes, store: str) -> bytes | None:
    ranges = _media_ranges(accept.decode("latin-1"))
    named = store_media_type(store)
    q_json = _quality(ranges, JSON_TYPE)
    best_avro, q_avro = AVRO, _quality(ranges, AVRO)
    q_named = _quality(ranges, named)
    if q_named > q_avro:
        best_avro, q_avro = named, q_named
    if q_json <= 0 and q_avro <= 0:
        raise NotAcceptable(
            f"Accept {accept.decode('latin-1')[:200]!r} offers none of the media types this read answers in:"
            f" {JSON_TYPE}, {AVRO}, {named}"
        )
    return best_avro.encode("ascii") if q_avro > q_json else None


def _media_ranges(accept: str) -> list[tuple[str, float]]:
    """(media range, q) of an Accept value, lower-cased; a q that does not read counts as 1."""
    ranges = []
    for part in accept.split(","):
        kind, *params = part.split(";")
        kind = kind.strip().lower()
        if not kind:
            continue
        q = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = min(max(float(value.strip()), 0.0), 1.0)
                except ValueError:
                    q = 1.0
        ranges.append((kind, q))
    return ranges


def _quality(ranges: Sequence[tuple[str, float]], offered: str) -> float:
    """The q the most specific of `ranges` matching the media type `offered` gives it (0: none matches)."""
    offered = offered.lower()
    family = offered.split("/", 1)[0] + "/*"
    best_rank, best_q = -1, 0.0
    for kind, q in ranges:
        rank = 2 if kind == offered else 1 if kind == family else 0 if kind == "*/*" else -1
        if rank > best_rank:
            best_rank, best_q = rank, q
        elif rank == best_rank >= 0:
            best_q = max(best_q, q)
    return best_q


# -- encoding ---------------------------------------------------------------------------------------------


def _nested(value: Any) -> tuple[str, dict[str, str]]:
    return NESTED, {"json": json.dumps(value, ensure_ascii=False, separators=(",", ":"))}


def _field(value: Any) -> Any:
    """One column's value: as it is when an Avro scalar holds it exactly, else Nested."""
    kind = type(value)
    if kind is dict or kind is list or (kind is int and not _INT64_MIN <= value <= _INT64_MAX):
        return _nested(value)
    return value


def _value(value: Any) -> Any:
    """A value or a row for the envelope's `_VALUE` union (the branch named, so the writer does not search)."""
    if type(value) is not dict:
        return _nested(value)
    row = None
    for column, item in value.items():
        kind = type(item)
        if kind is dict or kind is list or (kind is int and not _INT64_MIN <= item <= _INT64_MAX):
            if row is None:
                row = dict(value)
            row[column] = _nested(item)
    return "map", value if row is None else row


def _entry(entry: Mapping[str, Any]) -> dict[str, Any]:
    out = {"key": _field(entry.get("key")), "status": entry["status"]}
    for name in _ENTRY_FIELDS:
        if name in entry:
            out[name] = entry[name]
    if "value" in entry:
        out["value"] = _value(entry["value"])
    return out


def envelope(answer: Mapping[str, Any]) -> dict[str, Any]:
    """The record the envelope writes for a JSON answer (parsed)."""
    out: dict[str, Any] = {}
    for name in _TOP_FIELDS:
        if name in answer:
            out[name] = answer[name]
    if "value" in answer:
        out["value"] = _value(answer["value"])
    for name in ("rows", "windows"):
        if name in answer:
            out[name] = "array", [_value(item) for item in answer[name]]
    if "results" in answer:
        out["results"] = "array", [_entry(entry) for entry in answer["results"]]
    return out


def encode_answer(answer: Mapping[str, Any]) -> bytes:
    """A JSON answer (parsed) as the envelope's Avro binary."""
    out = io.BytesIO()
    schemaless_writer(out, _PARSED, envelope(answer))
    return out.getvalue()


# A run of 20 digits or more: maybe an integer orjson would read as a float (beyond 64 bits).
_LONG_DIGITS = re.compile(rb"[0-9]{20}")


def encode_body(body: bytes) -> bytes:
    """A JSON answer's body as the envelope's Avro binary (its values parsed once, from the stored bytes)."""
    if _LONG_DIGITS.search(body) is None:
        try:
            return encode_answer(orjson.loads(body))
        except orjson.JSONDecodeError:
            pass
    # What orjson does not read as a client's JSON parser does (integers beyond 64 bits, NaN), the standard
    # library does.
    return encode_answer(json.loads(body))


def avro_headers(headers: Iterable[tuple[bytes, bytes]], media_type: bytes) -> list[tuple[bytes, bytes]]:
    """A JSON answer's raw headers for its Avro answer of `media_type`: the content type and the schema id."""
    out = [(name, value) for name, value in headers if name.lower() != b"content-type"]
    out.append((b"content-type", media_type))
    out.append((_SCHEMA_ID_HEADER, _SCHEMA_ID))
    return out


def avro_answer(
    status: int, headers: Iterable[tuple[bytes, bytes]], body: bytes, media_type: bytes
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """A read's answer (status, raw headers, JSON body) as Avro of `media_type` when it is a 200; an error
    stays as it is (JSON)."""
    if status != 200:
        return status, list(headers), body
    return status, avro_headers(headers, media_type), encode_body(body)


_SCHEMA_ID_HEADER = HEADER_SCHEMA_ID.lower().encode("ascii")
_SCHEMA_ID = SCHEMA_ID.encode("ascii")


# -- decoding ---------------------------------------------------------------------------------------------


def _unnest(value: Any) -> Any:
    if type(value) is tuple:  # Nested, by the name the reader gave
        return json.loads(value[1]["json"])
    return value


def _plain(value: Any) -> Any:
    if type(value) is dict:
        for column, item in value.items():
            if type(item) is tuple:
                value[column] = _unnest(item)
        return value
    return _unnest(value)


def decode_answer(data: bytes) -> dict[str, Any]:
    """The dict the JSON answer parses to, from the envelope's Avro binary."""
    record = schemaless_reader(io.BytesIO(data), _PARSED, None, return_record_name=True)
    out: dict[str, Any] = {}
    for name, item in record.items():
        if item is None:
            continue
        if name == "value":
            out[name] = _plain(item)
        elif name in ("rows", "windows"):
            out[name] = [_plain(row) for row in item]
        elif name == "results":
            out[name] = [_decoded_entry(entry) for entry in item]
        else:
            out[name] = item
    return out


def _decoded_entry(entry: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"key": _unnest(entry["key"])}
    for name, item in entry.items():
        if item is None or name == "key":
            continue
        out[name] = _plain(item) if name == "value" else item
    return out


# -- the published schema ---------------------------------------------------------------------------------


def schema_document(store: str, columns: Sequence[str] = ()) -> dict[str, Any]:
    """The envelope's schema as `GET /stores/{store}/schema` publishes it: `ANSWER_SCHEMA`, its
    documentation naming the store and the columns its values hold (a documentation change only: the
    fingerprint, `SCHEMA_ID`, is every store's)."""
    schema = copy.deepcopy(ANSWER_SCHEMA)
    listed = ", ".join(columns) if columns else "the columns each value was stored with"
    schema["doc"] = f"{schema['doc']} Store {store!r}; its values' columns: {listed}."
    return schema


def schema_answer(store: str, columns: Sequence[str] = ()) -> bytes:
    """The body of `GET /stores/{store}/schema`: the schema id, the media types, and the schema."""
    return orjson.dumps(
        {
            "store": store,
            "schema_id": SCHEMA_ID,
            "media_types": [AVRO, store_media_type(store)],
            "columns": list(columns),
            "schema": schema_document(store, columns),
        }
    )
