"""Live record values written by Confluent's Schema Registry serializers, read as the rows a JSON record gives.

    value_format = "json"          the value is a JSON object (keyroute.storage.live reads it; no registry)
    value_format = "avro"          0x00 | schema id (4 bytes, big-endian) | Avro binary of a record
    value_format = "protobuf"      0x00 | schema id | message indexes (zigzag varints) | Protobuf message
    value_format = "json_schema"   0x00 | schema id | a JSON object, valid against the schema

A `ValueDecoder` builds one reader per schema id the first time a record names it (the schema is fetched from
the registry once: `keyroute.keys.schema_registry.SchemaFetcher`), then decodes every record of that id without
asking the registry again. A decoded record is the row a JSON record with the same content gives:

    Avro long, int          integers (never floats)            Protobuf int64/uint64/...  integers
    Avro float, double      floats                             Protobuf enums             the value's name
    decimal                 the number a JSON record spelling it gives (an integer when whole, else the
                            nearest double, as the JSON path reads "12.30")
    timestamp-millis/micros ISO 8601 text in UTC as Spark writes timestamps ("2024-06-11T10:00:00.000Z"; six
                            fraction digits for a micros value with sub-millisecond digits); the raw integer
                            when the column is the `order_by` of a store ordered by an integer
    date                    "YYYY-MM-DD" (the raw day number for an integer `order_by`)
    time-millis/micros      "HH:MM:SS.fff"; uuid: its text; bytes and fixed: base64 text, as Spark's to_json
    google.protobuf.Timestamp / google.type.Date    as timestamp-micros / date

Bad values raise `BadRecord`: `not_wire_format` (no magic byte / too short), `unknown_schema` (the registry
does not know the id, or its schema is not of the store's format), `bad_payload` (the bytes do not decode
with their schema, or a JSON value breaks its JSON Schema), `missing_column` (a schema without a field the
store needs: the store, field and schema id are named). A registry that cannot be reached raises
`RegistryUnavailable`: the caller retries the record later.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import io
import json
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from keyroute.formats.proto_text import parse_proto_text
from keyroute.keys.schema_registry import (
    RegistrySettings,
    RegistrySettingsError,
    RegistryUnavailable,
    SchemaFetcher,
    UnknownSchema,
)
from keyroute.storage.live import BadRecord, LiveSpecError, Merge, Reason, loads_json

VALUE_FORMATS = ("json", "avro", "protobuf", "json_schema")
# The registry's schemaType of each registry format.
SCHEMA_TYPES = {"avro": "AVRO", "protobuf": "PROTOBUF", "json_schema": "JSON"}
# How long an id the registry did not know is answered as unknown before the registry is asked again.
UNKNOWN_RETRY_S = 30.0

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_EPOCH_DAY = dt.date(1970, 1, 1)

Row = dict[str, Any]
Convert = Callable[[Any], Any]


def check_value_format(value_format: Any, registry: Any) -> None:
    """LiveSpecError unless `value_format` is known and a registry is given exactly when it needs one."""
    if value_format not in VALUE_FORMATS:
        raise LiveSpecError(f"unknown value_format {value_format!r} (expected one of: {', '.join(VALUE_FORMATS)})")
    if value_format == "json" and registry is not None:
        raise LiveSpecError('a schema_registry table is for value_format "avro", "protobuf" or "json_schema"')
    if value_format != "json" and registry is None:
        raise LiveSpecError(f'value_format "{value_format}" needs a schema_registry table (url = ...)')


# --- shown values ------------------------------------------------------------------------------------------


def _timestamp_text(micros: int) -> str:
    moment = _EPOCH + dt.timedelta(microseconds=micros)
    head = moment.strftime("%Y-%m-%dT%H:%M:%S.")
    sub = moment.microsecond
    return head + (f"{sub // 1000:03d}Z" if sub % 1000 == 0 else f"{sub:06d}Z")


def _millis_text(millis: int) -> str:
    return _timestamp_text(millis * 1000)


def _date_text(days: int) -> str:
    return (_EPOCH_DAY + dt.timedelta(days=days)).isoformat()


def _time_text(micros: int) -> str:
    seconds, sub = divmod(micros, 1_000_000)
    minutes, second = divmod(seconds, 60)
    return f"{minutes // 60:02d}:{minutes % 60:02d}:{second:02d}.{sub // 1000:03d}"


def _number(value: decimal.Decimal) -> int | float:
    """A decimal as a JSON record spelling it reads: whole numbers exact, others the nearest double."""
    if value == value.to_integral_value():
        return int(value)
    return float(value)


def _base64(value: bytes) -> str:
    return base64.b64encode(value).decode("ascii")


def _jsonable(value: Any) -> Any:
    """Values fastavro converted itself (inside unions of several logical types), as the table above shows them."""
    kind = value.__class__
    if kind is dict:
        return {k: _jsonable(v) for k, v in value.items()}
    if kind is list:
        return [_jsonable(v) for v in value]
    if kind is dt.datetime:
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        delta = value - _EPOCH
        return _timestamp_text((delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds)
    if kind is dt.date:
        return value.isoformat()
    if kind is dt.time:
        return value.isoformat(timespec="milliseconds")
    if kind is decimal.Decimal:
        return _number(value)
    if kind is uuid.UUID:
        return str(value)
    if kind is bytes:
        return _base64(value)
    return value


# --- the decoder -------------------------------------------------------------------------------------------


class ValueDecoder:
    """Rows of one live store's registry-framed values (`value_format` avro, protobuf or json_schema).

    `fetcher` makes the SchemaFetcher on first use (so a registry that is down, or settings whose `${ENV}` is
    not set, stall the partition instead of failing the node). Readers are kept per schema id. Not
    thread-safe: one decoder per applier thread."""

    def __init__(
        self,
        value_format: str,
        fetcher: Callable[[], SchemaFetcher],
        *,
        store: str,
        merge: Merge,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if value_format not in SCHEMA_TYPES:
            raise ValueError(f"value_format {value_format!r} is not a Schema Registry format")
        self.value_format = value_format
        self.store = store
        self._make_fetcher = fetcher
        self._fetcher: SchemaFetcher | None = None
        self._needed = merge.needed_columns()
        order_by = merge.order_by
        # A timestamp or date in the order_by column of a store ordered by an integer stays an integer.
        self._raw_time_column = order_by if merge.time_type == "integer" else None
        self._clock = clock
        self._readers: dict[int, Callable[[bytes], Row]] = {}
        self._unknown: dict[int, tuple[float, str]] = {}

    @property
    def fetcher(self) -> SchemaFetcher:
        if self._fetcher is None:
            try:
                self._fetcher = self._make_fetcher()
            except RegistrySettingsError as exc:
                raise RegistryUnavailable(f"the schema registry client cannot be created: {exc}") from None
        return self._fetcher

    def decode(self, value: bytes) -> Row:
        if len(value) < 5 or value[0] != 0:
            raise BadRecord(
                Reason.NOT_WIRE_FORMAT,
                f"the value is not in the Schema Registry wire format (magic byte 0, 4-byte schema id; "
                f"the store's value_format is {self.value_format})",
            )
        schema_id = int.from_bytes(value[1:5], "big")
        reader = self._readers.get(schema_id)
        if reader is None:
            reader = self._reader(schema_id)
        return reader(value)

    def check(self, schema_id: int) -> None:
        """BadRecord when no record of `schema_id` can be applied (unknown, another format, not readable, or
        without a column the store needs: the store, field and schema id named); RegistryUnavailable."""
        reader = self._readers.get(schema_id) or self._reader(schema_id)
        refusal = getattr(reader, "refusal", None)
        if refusal is not None:
            raise BadRecord(Reason.MISSING_COLUMN, refusal)

    def _reader(self, schema_id: int) -> Callable[[bytes], Row]:
        known = self._unknown.get(schema_id)
        if known is not None:
            if self._clock() < known[0]:
                raise BadRecord(Reason.UNKNOWN_SCHEMA, known[1])
            del self._unknown[schema_id]
        try:
            # A registry answers Protobuf schemas as .proto text unless asked for the serialized descriptor.
            schema = self.fetcher.by_id(schema_id, "serialized" if self.value_format == "protobuf" else None)
            expected = SCHEMA_TYPES[self.value_format]
            if schema.schema_type != expected:
                raise UnknownSchema(f"schema id {schema_id} is {schema.schema_type}, not {expected}")
            builder = {"avro": self._avro, "protobuf": self._protobuf, "json_schema": self._json_schema}
            reader = builder[self.value_format](schema_id, schema)
        except UnknownSchema as exc:
            message = f"schema id {schema_id}: {exc}"
            self._unknown[schema_id] = (self._clock() + UNKNOWN_RETRY_S, message)
            raise BadRecord(Reason.UNKNOWN_SCHEMA, message) from None
        self._readers[schema_id] = reader
        return reader

    def _missing(self, schema_id: int, fields: set[str]) -> Callable[[Any], Row] | None:
        """A reader refusing every record of a schema without a field the store needs, else None."""
        for column, why in self._needed:
            if column not in fields:
                message = (
                    f"schema id {schema_id} has no field {column!r}, which store {self.store!r} needs ({why}): "
                    "a schema that removes it cannot be applied"
                )

                def refuse(value: Any, message: str = message) -> Row:
                    raise BadRecord(Reason.MISSING_COLUMN, message)

                refuse.refusal = message  # type: ignore[attr-defined]  # what `check` reports
                return refuse
        return None

    def _references(self, schema: Any, seen: set[tuple[str, int]], fmt: str | None = None) -> list[Any]:
        """The schemas `schema` references, depth first (each before the schemas that use it)."""
        found: list[Any] = []
        for ref in schema.references or ():
            key = (ref.subject, ref.version)
            if key in seen:
                continue
            seen.add(key)
            registered = self.fetcher.version(ref.subject, ref.version, fmt)
            found += self._references(registered.schema, seen, fmt)
            found.append((ref.name, registered.schema))
        return found

    # -- Avro -------------------------------------------------------------------------------------------

    def _avro(self, schema_id: int, schema: Any) -> Callable[[bytes], Row]:
        import fastavro

        named: dict[str, Any] = {}
        try:
            for _, referenced in self._references(schema, set()):
                fastavro.parse_schema(_plain_avro(json.loads(referenced.schema_str), None)[0], named_schemas=named)
            plain, convert = _plain_avro(json.loads(schema.schema_str), self._raw_time_column)
            parsed = fastavro.parse_schema(plain, named_schemas=named)
        except (ValueError, TypeError, KeyError, fastavro.schema.SchemaParseException) as exc:
            raise UnknownSchema(f"not an Avro schema fastavro reads: {exc}") from None
        if not isinstance(parsed, dict) or parsed.get("type") != "record":
            raise UnknownSchema("the value schema is not an Avro record")
        refuse = self._missing(schema_id, {f["name"] for f in parsed["fields"]})
        if refuse is not None:
            return refuse
        read = _avro_record_reader()
        options: dict[str, Any] = {}
        bytes_io = io.BytesIO
        bad = Reason.BAD_PAYLOAD

        def decode(value: bytes) -> Row:
            stream = bytes_io(value)
            stream.seek(5)
            try:
                row = read(stream, parsed, named, None, options)
            except Exception as exc:  # EOFError, IndexError, UnicodeDecodeError, ValueError...: not this schema
                raise BadRecord(bad, f"the value does not decode with schema id {schema_id}: {exc!r}") from None
            if stream.tell() != len(value):
                raise BadRecord(bad, f"the value has bytes after the record of schema id {schema_id}")
            if convert is not None:
                for name, change in convert:
                    held = row[name]
                    if held is not None:
                        row[name] = change(held)
            return row

        return decode

    # -- JSON Schema ------------------------------------------------------------------------------------

    def _json_schema(self, schema_id: int, schema: Any) -> Callable[[bytes], Row]:
        try:
            document = json.loads(schema.schema_str)
        except ValueError as exc:
            raise UnknownSchema(f"not a JSON Schema: {exc}") from None
        properties = document.get("properties") if isinstance(document, dict) else None
        if isinstance(properties, dict) and document.get("additionalProperties") is False:
            refuse = self._missing(schema_id, set(properties))
            if refuse is not None:
                return refuse
        bad = Reason.BAD_PAYLOAD
        validator = _json_validator(document, schema)

        def decode(value: bytes) -> Row:
            try:
                row = loads_json(value[5:])
            except (UnicodeDecodeError, ValueError):
                raise BadRecord(bad, f"the value of schema id {schema_id} is not UTF-8 JSON") from None
            if row.__class__ is not dict:
                raise BadRecord(bad, f"the value of schema id {schema_id} is JSON {type(row).__name__}, not an object")
            if validator is not None and not validator.is_valid(row):
                why = next(iter(validator.iter_errors(row))).message
                raise BadRecord(bad, f"the value does not match schema id {schema_id}: {why}")
            return row

        return decode

    # -- Protobuf ---------------------------------------------------------------------------------------

    def _protobuf(self, schema_id: int, schema: Any) -> Callable[[bytes], Row]:
        from google.protobuf import descriptor_pool, message_factory

        pool = descriptor_pool.DescriptorPool()
        try:
            for name, referenced in self._references(schema, set(), "serialized"):
                _add_proto(pool, _file_proto(referenced.schema_str, name))
            file = _add_proto(pool, _file_proto(schema.schema_str, f"schema-{schema_id}.proto"))
        except UnknownSchema:
            raise
        except Exception as exc:  # TypeError, DecodeError from a descriptor the pool refuses
            raise UnknownSchema(f"not a Protobuf schema: {exc}") from None
        messages = list(file.message_types_by_name.values())
        if not messages:
            raise UnknownSchema("the Protobuf schema defines no message")
        classes: dict[tuple[int, ...], tuple[Any, Callable[[Any], Row]]] = {}

        def message_of(indexes: tuple[int, ...]) -> tuple[Any, Callable[[Any], Row]]:
            held = classes.get(indexes)
            if held is None:
                descriptor = messages[indexes[0]]
                for i in indexes[1:]:
                    descriptor = descriptor.nested_types[i]
                refuse = self._missing(schema_id, {f.name for f in descriptor.fields})
                held = (message_factory.GetMessageClass(descriptor), refuse or _proto_converter(descriptor))
                classes[indexes] = held
            return held

        bad = Reason.BAD_PAYLOAD
        from google.protobuf.message import DecodeError

        refusals = [self._missing(schema_id, {f.name for f in m.fields}) for m in messages]
        if all(refusals):  # no message of the schema has the store's columns
            return refusals[0]  # type: ignore[return-value]

        def decode(value: bytes) -> Row:
            try:
                indexes, start = _message_indexes(value, 5)
                cls, convert = message_of(indexes)
                message = cls.FromString(value[start:])
            except (IndexError, DecodeError, ValueError, RuntimeError) as exc:
                raise BadRecord(bad, f"the value does not decode with schema id {schema_id}: {exc!r}") from None
            return convert(message)

        return decode


def _json_validator(document: Any, schema: Any) -> Any:
    """A validator of values against a JSON Schema built once (jsonschema), or None when the schema cannot be
    checked here (it references other registered schemas, or jsonschema does not take it)."""
    if schema.references or not isinstance(document, dict):
        return None
    import jsonschema

    try:
        cls = jsonschema.validators.validator_for(document)
        cls.check_schema(document)
        validator = cls(document)
        validator.is_valid({})  # a $ref it cannot resolve raises here, not per record
    except Exception:  # SchemaError, referencing errors
        return None
    return validator


def _avro_record_reader() -> Callable[..., Any]:
    """fastavro's reader of one datum from a stream, with a schema already parsed: its compiled `read_record`
    where this fastavro has one (no per-call schema parsing), else the public schemaless_reader."""
    try:
        from fastavro._read import read_record  # type: ignore[attr-defined]

        return read_record  # type: ignore[no-any-return]
    except ImportError:  # pragma: no cover - fastavro without its compiled reader
        import fastavro

        def read(stream: Any, parsed: Any, named: Any, reader_schema: Any, options: Any) -> Any:
            return fastavro.schemaless_reader(stream, parsed, None)

        return read


# Avro logical types read here (fastavro would make datetime, Decimal, UUID objects of them).
_TIME_LOGICAL = {
    "timestamp-millis": _millis_text,
    "timestamp-micros": _timestamp_text,
    "local-timestamp-millis": _millis_text,
    "local-timestamp-micros": _timestamp_text,
    "date": _date_text,
    "time-millis": lambda ms: _time_text(ms * 1000),
    "time-micros": _time_text,
}


def _plain_avro(schema: Any, raw_column: str | None) -> tuple[Any, list[tuple[str, Convert]] | None]:
    """The schema without the logical types of the record's fields (fastavro then reads their plain values)
    and, per such field, how its value is shown; a field whose values need converting deeper (nested
    records, arrays, unions of logical types) keeps its schema and is shown by `_jsonable`."""
    if not isinstance(schema, dict) or schema.get("type") != "record":
        return schema, None
    fields = []
    convert: list[tuple[str, Convert]] = []
    for field in schema.get("fields", ()):
        name, ftype = field.get("name"), field.get("type")
        plain, change = _plain_field(ftype, raw=name == raw_column)
        if change is not None:
            convert.append((name, change))
            field = {**field, "type": plain}
        elif _has_conversions(ftype):
            convert.append((name, _jsonable))
        fields.append(field)
    return {**schema, "fields": fields}, convert or None


def _plain_field(ftype: Any, raw: bool) -> tuple[Any, Convert | None]:
    """A field's type without its logical type, and the conversion of its plain value (None: nothing to do).
    A nullable type (["null", T]) keeps its null branch."""
    if isinstance(ftype, list):
        others = [b for b in ftype if b != "null"]
        if len(others) == 1 and len(ftype) == 2:
            plain, change = _plain_field(others[0], raw)
            return ([plain if b != "null" else b for b in ftype] if change is not None else ftype), change
        return ftype, None
    if not isinstance(ftype, dict):
        return ftype, (_base64 if ftype == "bytes" else None)
    base, logical = ftype.get("type"), ftype.get("logicalType")
    if logical in _TIME_LOGICAL and base in ("int", "long"):
        return base, (int if raw else _TIME_LOGICAL[logical])  # int: the plain value, as it is
    if logical == "decimal" and base in ("bytes", "fixed"):
        scale = int(ftype.get("scale", 0))
        plain = "bytes" if base == "bytes" else {k: v for k, v in ftype.items() if k not in ("logicalType",)}

        def to_number(data: bytes, scale: int = scale) -> int | float:
            return _number(decimal.Decimal(int.from_bytes(data, "big", signed=True)).scaleb(-scale))

        return plain, to_number
    if logical == "uuid" and base == "string":
        return "string", str  # the text as written (fastavro would make a UUID of it)
    if base in ("bytes", "fixed") and logical is None:
        return ftype, _base64
    return ftype, None


def _has_conversions(ftype: Any) -> bool:
    """Whether values of a type hold something fastavro shows as a non-JSON object (logical types, bytes)."""
    if isinstance(ftype, list):
        return any(_has_conversions(b) for b in ftype)
    if isinstance(ftype, dict):
        if ftype.get("logicalType") or ftype.get("type") in ("bytes", "fixed"):
            return True
        inner = [f.get("type") for f in ftype.get("fields", ())] + [ftype.get("items"), ftype.get("values")]
        return any(_has_conversions(t) for t in inner if t is not None)
    return ftype == "bytes"


# --- Protobuf ----------------------------------------------------------------------------------------------


def _message_indexes(value: bytes, pos: int) -> tuple[tuple[int, ...], int]:
    """The message indexes after the schema id (a zigzag varint count, then that many zigzag varints; a lone
    0 means the first message) and where the message starts."""
    count, pos = _zigzag(value, pos)
    if count == 0:
        return (0,), pos
    if not 0 < count <= 64:
        raise ValueError(f"{count} message indexes")
    indexes = []
    for _ in range(count):
        index, pos = _zigzag(value, pos)
        indexes.append(index)
    return tuple(indexes), pos


def _zigzag(value: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = value[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return (result >> 1) ^ -(result & 1), pos
        shift += 7
        if shift > 63:
            raise ValueError("a varint longer than 64 bits")


def _file_proto(schema_str: str, name: str) -> Any:
    """A FileDescriptorProto from a registered Protobuf schema: base64 of a serialized FileDescriptorProto (as
    confluent-kafka's Python serializer registers, and a registry answers for format=serialized), or .proto
    text (as producers in other languages register, and a registry answers by default)."""
    from google.protobuf import descriptor_pb2

    proto = descriptor_pb2.FileDescriptorProto()
    try:
        proto.ParseFromString(base64.b64decode(schema_str, validate=True))
    except Exception:  # not base64, or not a descriptor: .proto text (a registry that ignores the format)
        try:
            return parse_proto_text(schema_str, name)
        except ValueError as exc:
            raise UnknownSchema(f"neither a serialized descriptor nor .proto text: {exc}") from None
    if not proto.name:
        proto.name = name
    return proto


def _add_proto(pool: Any, proto: Any) -> Any:
    """Add a file to `pool` (and the well-known files it imports, from the default pool); its FileDescriptor."""
    from google.protobuf import descriptor_pb2, descriptor_pool

    for dependency in proto.dependency:
        try:
            pool.FindFileByName(dependency)
        except KeyError:
            try:
                known = descriptor_pool.Default().FindFileByName(dependency)
            except KeyError:
                raise UnknownSchema(f"the Protobuf schema imports {dependency!r}, which no reference gives") from None
            copy = descriptor_pb2.FileDescriptorProto()
            known.CopyToProto(copy)
            _add_proto(pool, copy)
    try:
        return pool.FindFileByName(proto.name)
    except KeyError:
        return pool.Add(proto)


def _proto_converter(descriptor: Any) -> Callable[[Any], Row]:
    """A message's row: every field by name; int64s as integers, enums by name, bytes as base64, messages as
    objects (absent: null), google.protobuf.Timestamp and google.type.Date as timestamp and date texts."""
    plan = [(f.name, _proto_value(f)) for f in descriptor.fields]

    def convert(message: Any) -> Row:
        row: Row = {}
        for name, value_of in plan:
            row[name] = value_of(message)
        return row

    return convert


def _proto_value(field: Any) -> Callable[[Any], Any]:
    from google.protobuf.descriptor import FieldDescriptor

    name = field.name
    one = _proto_single(field)
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        value_field = field.message_type.fields_by_name["value"]
        inner = _proto_single(value_field)
        return lambda m: {str(k): inner(v) for k, v in getattr(m, name).items()}
    if getattr(field, "is_repeated", None) or getattr(field, "label", None) == FieldDescriptor.LABEL_REPEATED:
        return lambda m: [one(v) for v in getattr(m, name)]
    if field.message_type is not None or field.has_presence:
        return lambda m: one(getattr(m, name)) if m.HasField(name) else None
    return lambda m: one(getattr(m, name))


def _proto_single(field: Any) -> Callable[[Any], Any]:
    from google.protobuf.descriptor import FieldDescriptor

    if field.type == FieldDescriptor.TYPE_ENUM:
        names = {v.number: v.name for v in field.enum_type.values}
        return lambda v: names.get(v, v)
    if field.type == FieldDescriptor.TYPE_BYTES:
        return _base64
    if field.message_type is not None:
        full = field.message_type.full_name
        if full == "google.protobuf.Timestamp":
            return lambda v: _timestamp_text(v.seconds * 1_000_000 + v.nanos // 1000)
        if full == "google.type.Date":
            return lambda v: dt.date(v.year, v.month, v.day).isoformat()
        if (
            full.startswith("google.protobuf.")
            and full.endswith("Value")
            and "value" in field.message_type.fields_by_name
        ):
            return lambda v: v.value  # wrappers: Int64Value, StringValue, ...
        return _proto_converter(field.message_type)
    return lambda v: v


def value_decoder(
    value_format: str, registry: RegistrySettings | None, environ: Mapping[str, str], *, store: str, merge: Merge
) -> ValueDecoder | None:
    """The decoder of a live store's values (None for JSON values)."""
    if value_format == "json" or registry is None:
        return None
    return ValueDecoder(value_format, lambda: SchemaFetcher(registry, environ), store=store, merge=merge)
