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
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import orjson
from fastavro import parse_schema, schemaless_reader
from fastavro.schema import fingerprint, to_parsing_canonical_form

from keyroute.api import ApiError, found_body
from keyroute.keys.key_schema import uvarint

AVRO = "application/avro"
JSON_TYPE = "application/json"
HEADER_SCHEMA_ID = "X-Keyroute-Schema-Id"
NESTED = "keyroute.Nested"

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


def store_media_type(store: str) -> str:
    """The store's own media type for its Avro answers."""
    return f"application/vnd.keyroute.{store}+avro"


def _nullable(name: str, kind: Any) -> dict[str, Any]:
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
        _nullable("store", "string"),
        _nullable("key", "string"),
        _nullable("partition", "int"),
        _nullable("version", "long"),
        {"name": "value", "type": _VALUE, "default": None},
        _nullable("rows", {"type": "array", "items": _VALUE_AGAIN}),
        _nullable("windows", {"type": "array", "items": _VALUE_AGAIN}),
        _nullable("next", "string"),
        _nullable(
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
                        _nullable("partition", "int"),
                        _nullable("version", "long"),
                        _nullable("offset", "long"),
                        _nullable("node", "string"),
                        {"name": "value", "type": _VALUE_AGAIN, "default": None},
                        _nullable("error", "string"),
                        _nullable("message", "string"),
                    ],
                },
            },
        ),
    ],
}

_PARSED = parse_schema(copy.deepcopy(ANSWER_SCHEMA))
SCHEMA_ID = fingerprint(to_parsing_canonical_form(_PARSED), "CRC-64-AVRO")  # 16 hex digits


class NotAcceptable(ApiError):
    """A read whose Accept offers none of the answer's media types."""

    status = 406
    code = "not_acceptable"


# -- choosing the answer's media type ---------------------------------------------------------------------

# The Accept values that mean JSON, answered without parsing them (every read checks; the data planes' key
# reads check it themselves, a call less per read).
JSON_ACCEPTS = frozenset({b"*/*", b"application/json", b"application/json, */*"})


def answer_type(accept: bytes | None, store: str) -> bytes | None:
    """The Avro media type to answer a read of `store` with (bytes, for the content type), or None for JSON,
    as the raw `Accept` header's value `accept` prefers (JSON on a tie). Raises NotAcceptable (406) when
    it offers neither."""
    if accept is None or accept in JSON_ACCEPTS:
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


# The envelope is fixed, so it is written by hand, field by field in its order (fastavro's generic writer
# resolves every union by trying its branches: several times the CPU per answer).
# tests/unit/core/test_avro_answers.py checks that these bytes are fastavro's for the same schema.
# Union branches, as their zigzag indexes: Field [null, boolean, long, double, string, Nested], Value [null,
# map, Nested], optional fields [null, X].
_NULL = b"\x00"
_PRESENT = b"\x02"
_FIELD_TRUE, _FIELD_FALSE = b"\x02\x01", b"\x02\x00"
_FIELD_LONG, _FIELD_DOUBLE, _FIELD_STRING, _FIELD_NESTED = b"\x04", b"\x06", b"\x08", b"\x0a"
_VALUE_MAP, _VALUE_NESTED = b"\x02", b"\x04"
_SMALL = [bytes([n]) for n in range(0x80)]  # zigzag values 0-127: one byte
_DOUBLE = struct.Struct("<d").pack
_BIG = 2.0**63


class _Parsed(list):  # type: ignore[type-arg]
    """The parts of an answer being written whose values orjson parsed: it reads an integer beyond 64 bits as a
    float, so a float of that size makes `encode_body` parse the answer again, exactly (`_Reparse`)."""

    __slots__ = ()


class _Reparse(Exception):
    pass


def _long(n: int) -> bytes:
    """An Avro int or long: zigzag, then a little-endian base-128 varint."""
    n = (n << 1) ^ (n >> 63)
    return _SMALL[n] if n < 0x80 else uvarint(n)


def _string(text: str, out: list[bytes]) -> None:
    # A lone surrogate (JSON escapes it; UTF-8 cannot hold it) raises UnicodeEncodeError: a column's value is
    # then Nested (`_field`); anything else makes the answer JSON (`avro_answer`) or a 406 (a batch-get).
    data = text.encode("utf-8")
    out.append(_long(len(data)))
    out.append(data)


def _nested(value: Any, out: list[bytes]) -> None:
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    if type(out) is _Parsed and "e+" in text:
        raise _Reparse  # a float this large may be an integer orjson read as a float
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate in it: escaped, as JSON allows
        data = json.dumps(value, separators=(",", ":")).encode("ascii")
    out.append(_long(len(data)))
    out.append(data)


def _text_field(value: str, out: list[bytes]) -> None:
    try:
        data = value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: Nested, its JSON escaping it
        out.append(_FIELD_NESTED)
        _nested(value, out)
        return
    out.append(_FIELD_STRING)
    out.append(_long(len(data)))
    out.append(data)


def _field(value: Any, out: list[bytes]) -> None:
    """One column's value (or a batch entry's key): as an Avro scalar when one holds it exactly, else Nested."""
    kind = type(value)
    if kind is str:
        _text_field(value, out)
    elif kind is int and _INT64_MIN <= value <= _INT64_MAX:
        out.append(_FIELD_LONG)
        out.append(_long(value))
    elif kind is float:
        if (value >= _BIG or value <= -_BIG) and type(out) is _Parsed:
            raise _Reparse  # maybe an integer orjson read as a float
        out.append(_FIELD_DOUBLE)
        out.append(_DOUBLE(value))
    elif value is None:
        out.append(_NULL)
    elif kind is bool:
        out.append(_FIELD_TRUE if value else _FIELD_FALSE)
    else:  # an object, an array, an integer beyond 64 bits
        out.append(_FIELD_NESTED)
        _nested(value, out)


# Column names as written (length and UTF-8), for the names answers repeat; bounded, as a live store's
# records may bring any names.
_COLUMNS: dict[str, bytes] = {}
_MAX_COLUMNS = 4096


def _column(name: str) -> bytes:
    written = _COLUMNS.get(name)
    if written is None:
        data = name.encode("utf-8")
        written = _long(len(data)) + data
        if len(_COLUMNS) < _MAX_COLUMNS:
            _COLUMNS[name] = written
    return written


def _value(value: Any, out: list[bytes]) -> None:
    """A value or a row: its columns as a map, or Nested when it is not an object. (`_field`, inline for the
    common strings and integers: this loop is most of an answer's cost.)"""
    if type(value) is not dict:
        out.append(_VALUE_NESTED)
        _nested(value, out)
        return
    append = out.append
    append(_VALUE_MAP)
    if value:
        append(_long(len(value)))
        for column, item in value.items():
            written = _COLUMNS.get(column)
            append(written if written is not None else _column(column))
            kind = type(item)
            if kind is str:
                _text_field(item, out)
            elif kind is int and _INT64_MIN <= item <= _INT64_MAX:
                append(_FIELD_LONG)
                append(_long(item))
            else:
                _field(item, out)
    append(_NULL)  # the end of the map's blocks


def _long_to(n: int, out: list[bytes]) -> None:
    out.append(_long(n))


def _values(items: list[Any], out: list[bytes]) -> None:
    if items:
        out.append(_long(len(items)))
        for item in items:
            _value(item, out)
    out.append(_NULL)


def _record(record: Mapping[str, Any], fields: tuple[tuple[str, Any], ...], out: list[bytes]) -> None:
    """The fields of a record, in the schema's order: (name, how to write it) each, None for a `Value`; a field
    the JSON answer lacks is null."""
    for name, write in fields:
        if write is None:  # a Value: present, even as JSON null (then Nested), or absent
            if name in record:
                _value(record[name], out)
            else:
                out.append(_NULL)
            continue
        item = record.get(name)
        if item is None:
            out.append(_NULL)
        else:
            out.append(_PRESENT)
            write(item, out)


_ENTRY = (
    ("partition", _long_to),
    ("version", _long_to),
    ("offset", _long_to),
    ("node", _string),
    ("value", None),
    ("error", _string),
    ("message", _string),
)


def _entry(entry: Mapping[str, Any], out: list[bytes]) -> None:
    _field(entry.get("key"), out)
    out.append(_long(entry["status"]))
    _record(entry, _ENTRY, out)


def _entries(entries: list[Mapping[str, Any]], out: list[bytes]) -> None:
    if entries:
        out.append(_long(len(entries)))
        for entry in entries:
            _entry(entry, out)
    out.append(_NULL)


_ANSWER = (
    ("store", _string),
    ("key", _string),
    ("partition", _long_to),
    ("version", _long_to),
    ("value", None),
    ("rows", _values),
    ("windows", _values),
    ("next", _string),
    ("results", _entries),
)


def encode_answer(answer: Mapping[str, Any]) -> bytes:
    """A JSON answer (parsed) as the envelope's Avro binary."""
    out: list[bytes] = []
    _record(answer, _ANSWER, out)
    return b"".join(out)


def _answer(answer: Mapping[str, Any], out: list[bytes]) -> None:
    _record(answer, _ANSWER, out)


def _from_json(
    text: bytes, build: Callable[[Any], Mapping[str, Any]], write: Callable[[Any, list[bytes]], None] = _answer
) -> bytes:
    """`write` (an answer, or a batch entry) of `build(parsed)`, `text` parsed once by orjson (again by the
    standard library where orjson does not read it as a client's JSON parser does: NaN; an integer beyond 64
    bits, a float to it)."""
    out: list[bytes] = _Parsed()
    try:
        write(build(orjson.loads(text)), out)
    except (orjson.JSONDecodeError, _Reparse):
        out = []
        write(build(json.loads(text)), out)
    return b"".join(out)


def _itself(parsed: Any) -> Any:
    return parsed


def encode_body(body: bytes) -> bytes:
    """A JSON answer's body as the envelope's Avro binary."""
    return _from_json(body, _itself)


def found_avro(store: str, key: str, partition: int, version: int, value_json: bytes) -> bytes:
    """`keyroute.api.found_body`'s Avro twin: a key read's 200 answer written straight from the stored
    value's JSON bytes (no JSON answer built and parsed again). Text Avro cannot hold (a lone surrogate,
    escaped in JSON) gives `found_body`'s JSON instead: `is_avro` tells them apart."""

    def answer(value: Any) -> dict[str, Any]:
        return {"store": store, "key": key, "partition": partition, "version": version, "value": value}

    try:
        return _from_json(value_json, answer)
    except UnicodeEncodeError:
        return found_body(store, key, partition, version, value_json)


def found_entry_avro(
    key: str, partition: int, version: int, value_json: bytes, offset: int | None = None, node: str | None = None
) -> bytes:
    """`keyroute.http.forwarding.found_entry`'s Avro twin: a found key's batch entry written straight from the
    stored value's JSON bytes, for `results_avro` (the `Entry` record's fields in order, written here rather
    than through `_record`: a batch has many). Raises NotAcceptable for text Avro cannot hold."""
    out: list[bytes] = _Parsed()
    try:
        _text_field(key, out)
        out += (_STATUS_200, _PRESENT, _long(partition), _PRESENT, _long(version))
        if offset is None:
            out.append(_NULL)
        else:
            out += (_PRESENT, _long(offset))
        if node is None:
            out.append(_NULL)
        else:
            out.append(_PRESENT)
            _string(node, out)
        head = len(out)
        try:
            _value(orjson.loads(value_json), out)
        except (orjson.JSONDecodeError, _Reparse):
            del out[head:]
            exact: list[bytes] = []  # not `_Parsed`: its floats are floats
            _value(json.loads(value_json), exact)
            out += exact
    except UnicodeEncodeError:
        raise _not_avro() from None
    out.append(_NO_ERROR)
    return b"".join(out)


_STATUS_200 = _long(200)
_NO_ERROR = _NULL * 2  # error, message


def _not_avro() -> NotAcceptable:
    return NotAcceptable(
        "the answer holds text Avro cannot carry (a lone surrogate, escaped in JSON): ask for application/json"
    )


# A batch-get's envelope up to its entries: store, key, partition, version, value, rows, windows, next all
# null, then `results` present.
_RESULTS_HEAD = _NULL * 8 + _PRESENT


def results_avro(entries: Sequence[bytes]) -> bytes:
    """A batch-get's Avro answer from its entries, each written as Avro already (`found_entry_avro`) or as
    JSON (errors, entries from other nodes: written now). Raises NotAcceptable for text Avro cannot hold."""
    out = [_RESULTS_HEAD]
    if entries:
        out.append(_long(len(entries)))
        try:
            for entry in entries:
                out.append(entry if is_avro(entry) else _from_json(entry, _itself, _entry))
        except UnicodeEncodeError:
            raise _not_avro() from None
    out.append(_NULL)
    return b"".join(out)


def is_avro(body: bytes) -> bool:
    """Whether a body (a key read's 200, a batch entry) written by `found_avro` or `found_entry_avro` is Avro:
    JSON's starts with "{", an answer's envelope with the store's union index (0x02), an entry's with its
    key's (0x08)."""
    return body[:1] != b"{"


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
    try:
        return status, avro_headers(headers, media_type), encode_body(body)
    except UnicodeEncodeError:
        # Text Avro cannot hold (a lone surrogate, which JSON escapes): the answer stays JSON, as it says.
        return status, list(headers), body


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
    # The answer schema is a record: it reads as a dict.
    record = cast("dict[str, Any]", schemaless_reader(io.BytesIO(data), _PARSED, None, return_record_name=True))
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
