"""Schema Registry keys: the exact bytes Confluent's serializers write for a key, from the key's text.

A producer that serializes its keys with Confluent's Avro, Protobuf or JSON Schema serializer writes
`0x00 | schema id (4 bytes, big-endian) | payload` (Protobuf adds the message's index path as zigzag varints
before the payload), and its partitioner hashes all of it. A store of such keys records the key schema (id
and text) in its record, so routers, nodes and the client make the same bytes from a key's text without
asking the registry: `KeySchema.codec` builds, once per schema, a `KeyCodec` that does.

Key texts: a primitive key (Avro string/int/long, a JSON Schema string/integer, a Protobuf message of one
scalar field) is written as itself (`alice`, `42`); a record key as a JSON object (`{"region":"eu","id":7}`),
its canonical text being compact JSON with the schema's fields in the schema's order.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import io
import logging
import os
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import orjson

from keyroute.keys.key_format import Key, KeyFormat, KeyFormatError
from keyroute.keys.schema_registry import RegistrySettings, RegistrySettingsError, registry_client

SCHEMA_KEY_FORMATS = frozenset(f for f in KeyFormat if f.registered)

_MAGIC = 0
_DECIMAL = re.compile(r"-?[0-9]{1,20}")
_SHOWN_CHARS = 64
_SHORT_KEY = 128
_INT_RANGES = {"int": (-(1 << 31), (1 << 31) - 1), "long": (-(1 << 63), (1 << 63) - 1)}


class KeySchemaChanged(KeyFormatError):
    """Serialized key bytes written under another schema id than the store's key schema."""

    def __init__(self, message: str, schema_id: int) -> None:
        super().__init__(message)
        self.schema_id = schema_id


def _show(text: str) -> str:
    return repr(text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "…")


def _lone_surrogate(text: str) -> KeyFormatError:
    return KeyFormatError(f"key {_show(text)} is not a valid string (contains a lone surrogate)")


def _utf8(text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise _lone_surrogate(text) from None


def zigzag_varint(value: int) -> bytes:
    """Avro's (and Protobuf's sint64) encoding of a signed 64-bit integer."""
    return uvarint(((value << 1) ^ (value >> 63)) & 0xFFFFFFFFFFFFFFFF)


def uvarint(n: int) -> bytes:
    """Protobuf's base-128 varint of an unsigned 64-bit integer (a negative int32/int64 as its two's complement)."""
    n &= 0xFFFFFFFFFFFFFFFF
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_zigzag(data: bytes, at: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise KeyFormatError("serialized key ends inside a varint")
        byte = data[at]
        at += 1
        n |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return (n >> 1) ^ -(n & 1), at


def wire_prefix(schema_id: int) -> bytes:
    """Confluent's framing before the payload: the magic byte and the schema id, big-endian."""
    return struct.pack(">bI", _MAGIC, schema_id)


@dataclass(frozen=True, slots=True)
class KeySchema:
    """A store's key schema as the build resolved it: format, registry id and registered text.

    `message`: for Protobuf, the full name of the key's message type ("" = the schema's first message).
    Protobuf schema text is what the registry answers with `format=serialized` (a base64
    FileDescriptorProto, as confluent-kafka's Python serializer registers it)."""

    format: KeyFormat
    schema_id: int
    schema: str
    message: str = ""

    def __post_init__(self) -> None:
        if self.format not in SCHEMA_KEY_FORMATS:
            raise ValueError(f"{self.format.value} keys have no key schema")
        if not 0 <= self.schema_id <= 0xFFFFFFFF:
            raise ValueError(f"key schema id {self.schema_id} is not a 4-byte unsigned integer")

    @property
    def codec(self) -> KeyCodec:
        """This schema's key serializer (built once per schema, then shared)."""
        return _codec(self)

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.format.value, "id": self.schema_id, "schema": self.schema, "message": self.message}

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> KeySchema:
        """Raises KeyError, TypeError or ValueError when `obj` is not one."""
        schema = obj["schema"]
        if not isinstance(schema, str):
            raise TypeError(f"key schema text must be a string, got {type(schema).__name__}")
        return cls(KeyFormat(obj["format"]), int(obj["id"]), schema, str(obj.get("message", "")))


class KeyCodec:
    """Makes a `Key` of one key schema from its text, a source value or its serialized bytes."""

    __slots__ = ("describe", "prefix", "schema_id")

    def __init__(self, schema: KeySchema, prefix: bytes, describe: str) -> None:
        self.schema_id = schema.schema_id
        self.prefix = prefix
        self.describe = describe  # e.g. "Avro schema 7"

    def parse(self, text: str) -> Key:
        """A key as written in a URL path segment, on the CLI or in a batch-get body."""
        raise NotImplementedError

    def from_value(self, value: object) -> Key:
        """A key from a data-source value: the text form, a number, or a mapping (a record key)."""
        if isinstance(value, str):
            return self.parse(value)
        if value is None:
            raise KeyFormatError(f"null key ({self.describe} keys cannot be null)")
        as_dict = getattr(value, "asDict", None)  # a Spark Row
        if as_dict is not None:
            value = as_dict(recursive=True)
        return self._from_object(value)

    def _from_object(self, value: object) -> Key:
        raise NotImplementedError

    def from_data(self, data: bytes) -> Key:
        """The key whose serialized bytes are `data` (a Kafka record's key, a stored key)."""
        data = bytes(data)
        if len(data) < 5 or data[0] != _MAGIC:
            raise KeyFormatError(
                f"serialized key is not in Schema Registry wire format (no magic byte 0, {len(data)} bytes)"
            )
        schema_id = int.from_bytes(data[1:5], "big")
        if schema_id != self.schema_id:
            raise KeySchemaChanged(
                f"key written under schema id {schema_id}, not the store's key schema id {self.schema_id}", schema_id
            )
        if not data.startswith(self.prefix):
            raise KeyFormatError(f"serialized key does not start with {self.describe}'s prefix")
        try:
            key = self._decoded(data[len(self.prefix) :])
        except KeyFormatError:
            raise
        except Exception as exc:  # noqa: BLE001 - any decoder's complaint about bytes it cannot read
            raise KeyFormatError(f"serialized key does not decode with {self.describe}: {exc}") from None
        if key.data != data:
            raise KeyFormatError(f"serialized key is not in the canonical form {self.describe} writes")
        return key

    def _decoded(self, payload: bytes) -> Key:
        raise NotImplementedError

    def _record_text(self, text: str) -> Mapping[str, Any]:
        try:
            obj = orjson.loads(text)
        except orjson.JSONDecodeError:
            raise KeyFormatError(f"key {_show(text)} is not a JSON object (a {self.describe} record key)") from None
        if not isinstance(obj, dict):
            raise KeyFormatError(f"key {_show(text)} is not a JSON object (a {self.describe} record key)")
        return obj


def _int_text(text: str, kind: str, describe: str) -> int:
    if not _DECIMAL.fullmatch(text):
        raise KeyFormatError(f"key {_show(text)} is not a valid {kind} ({describe}: decimal digits, optional '-')")
    return int(text)


def _check_int(value: object, kind: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise KeyFormatError(f"{where} must be {kind}, got {_type_name(value)}")
    low, high = _INT_RANGES.get(kind, _INT_RANGES["long"])
    if not low <= value <= high:
        raise KeyFormatError(f"{where} does not fit {kind} (range {low}..{high})")
    return value


def _type_name(value: object) -> str:
    return {
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        dict: "an object",
        list: "an array",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def _compact(obj: object) -> str:
    return orjson.dumps(obj).decode("utf-8")


# --- Avro ------------------------------------------------------------------------------------------------


class AvroKeyCodec(KeyCodec):
    """Avro keys as confluent-kafka's AvroSerializer (fastavro's schemaless writer) writes them."""

    __slots__ = ("_fields", "_heads", "_kind", "_parsed")

    def __init__(self, schema: KeySchema) -> None:
        import fastavro

        super().__init__(schema, wire_prefix(schema.schema_id), f"Avro schema {schema.schema_id}")
        try:
            raw = orjson.loads(schema.schema)
        except orjson.JSONDecodeError:
            raw = schema.schema  # a bare primitive name, e.g. string
        try:
            # Its shape is the schema's: a name, a list or a dict.
            self._parsed = cast(Any, fastavro.parse_schema(raw))
        except Exception as exc:  # noqa: BLE001 - fastavro raises several kinds for a bad schema
            raise ValueError(f"{self.describe} is not an Avro schema: {exc}") from None
        kind = self._parsed if isinstance(self._parsed, str) else self._parsed.get("type")
        if isinstance(kind, dict):
            kind = kind.get("type")
        if kind not in ("string", "int", "long", "record"):
            raise ValueError(
                f"{self.describe}: keys of Avro type {kind!r} are not supported (string, int, long, record)"
            )
        self._kind = kind
        # A string key's bytes start with the prefix and its length as a zigzag varint: made once for the
        # lengths most keys have.
        self._heads = tuple(self.prefix + zigzag_varint(n) for n in range(_SHORT_KEY))
        self._fields: tuple[tuple[str, Any, bool, Any], ...] = ()
        if kind == "record":
            self._fields = tuple(
                (f["name"], f["type"], "default" in f, f.get("default")) for f in self._parsed["fields"]
            )

    def parse(self, text: str) -> Key:
        kind = self._kind
        if kind == "string":
            data = _utf8(text)
            n = len(data)
            return Key(text, (self._heads[n] if n < _SHORT_KEY else self.prefix + zigzag_varint(n)) + data)
        if kind != "record":
            number = _check_int(_int_text(text, kind, self.describe), kind, f"key {_show(text)}")
            return Key(str(number), self.prefix + zigzag_varint(number))
        return self._from_object(self._record_text(text))

    def _from_object(self, value: object) -> Key:
        kind = self._kind
        if kind == "string":
            raise KeyFormatError(f"a {self.describe} string key cannot be made from {_type_name(value)}")
        if kind != "record":
            number = _check_int(value, kind, "key")
            return Key(str(number), self.prefix + zigzag_varint(number))
        if not isinstance(value, Mapping):
            raise KeyFormatError(f"a {self.describe} record key must be a JSON object, got {_type_name(value)}")
        record = {}
        for name, avro_type, has_default, default in self._fields:
            if name in value:
                record[name] = _avro_value(value[name], avro_type, f"key field {name!r}")
            elif has_default:
                record[name] = default
            else:
                raise KeyFormatError(f"key field {name!r} is missing ({self.describe} has no default for it)")
        extra = [name for name in value if name not in record]
        if extra:
            raise KeyFormatError(f"key field {extra[0]!r} is not in {self.describe}")
        return Key(_compact(record), self.prefix + self._write(record))

    def _write(self, record: Mapping[str, Any]) -> bytes:
        import fastavro

        out = io.BytesIO()
        try:
            fastavro.schemaless_writer(out, self._parsed, record)
        except Exception as exc:  # noqa: BLE001 - a value our checks let through that fastavro refuses
            raise KeyFormatError(f"key does not fit {self.describe}: {exc}") from None
        return out.getvalue()

    def _decoded(self, payload: bytes) -> Key:
        import fastavro

        stream = io.BytesIO(payload)
        value: Any = fastavro.schemaless_reader(stream, self._parsed, None)  # what the schema reads as
        if stream.tell() != len(payload):
            extra = len(payload) - stream.tell()
            raise KeyFormatError(f"serialized key has {extra} bytes past its {self.describe} payload")
        if self._kind == "string":
            return self.parse(value)
        return self._from_object(value)


_AVRO_CHECKS: dict[str, Callable[[object], bool]] = {
    "null": lambda v: v is None,
    "boolean": lambda v: isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "double": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
}


def _avro_value(value: object, avro_type: Any, where: str) -> object:
    """`value` checked against (and, for numbers, made exactly) the field's Avro type."""
    if isinstance(avro_type, list):  # a union: the first branch the value fits, as fastavro picks it
        for branch in avro_type:
            try:
                return _avro_value(value, branch, where)
            except KeyFormatError:
                continue
        names = ", ".join(b if isinstance(b, str) else str(b.get("type")) for b in avro_type)
        raise KeyFormatError(f"{where} fits none of [{names}], got {_type_name(value)}")
    name = avro_type if isinstance(avro_type, str) else avro_type.get("type")
    if name in _INT_RANGES:
        return _check_int(value, name, where)
    if name == "enum":
        if not isinstance(value, str) or value not in avro_type["symbols"]:
            raise KeyFormatError(f"{where} must be one of {avro_type['symbols']}, got {value!r}")
        return value
    check = _AVRO_CHECKS.get(name)
    if check is None:
        raise KeyFormatError(f"{where}: Avro type {name!r} is not supported in keys")
    if not check(value):
        raise KeyFormatError(f"{where} must be {name}, got {_type_name(value)}")
    return value


# --- JSON Schema -----------------------------------------------------------------------------------------


# Schema keywords that do not constrain a value.
_ANNOTATIONS = frozenset({"type", "$schema", "$id", "title", "description", "$comment", "examples"})


class JsonSchemaKeyCodec(KeyCodec):
    """JSON Schema keys as confluent-kafka's JSONSerializer writes them: compact JSON (orjson's, or
    json.dumps with separators (',', ':') and ensure_ascii=False), UTF-8. Jackson (Java) writes the same for
    strings, integers and objects whose properties come in the schema's order."""

    __slots__ = ("_kind", "_order", "_plain", "_validator")

    def __init__(self, schema: KeySchema) -> None:
        import jsonschema

        super().__init__(schema, wire_prefix(schema.schema_id), f"JSON Schema {schema.schema_id}")
        try:
            parsed = orjson.loads(schema.schema)
            jsonschema.validators.validator_for(parsed).check_schema(parsed)
        except (orjson.JSONDecodeError, jsonschema.SchemaError) as exc:
            raise ValueError(f"{self.describe} is not a JSON Schema: {exc}") from None
        kind = parsed.get("type") if isinstance(parsed, dict) else None
        if kind not in ("string", "integer", "object"):
            raise ValueError(f"{self.describe}: keys of JSON type {kind!r} are not supported (string, integer, object)")
        self._kind = kind
        self._order = tuple(parsed.get("properties", {})) if kind == "object" else ()
        self._validator = jsonschema.validators.validator_for(parsed)(parsed)
        # A bare {"type": "string"} or {"type": "integer"} constrains nothing the checks here leave open.
        self._plain = kind != "object" and set(parsed) <= _ANNOTATIONS

    def parse(self, text: str) -> Key:
        if self._kind == "string":
            if self._plain:
                try:
                    return Key(text, self.prefix + orjson.dumps(text))
                except TypeError:
                    raise _lone_surrogate(text) from None
            return self._from_object(text, text)
        if self._kind == "integer" and self._plain:
            number = _check_int(_int_text(text, "integer", self.describe), "long", f"key {_show(text)}")
            return Key(str(number), self.prefix + str(number).encode("ascii"))
        if self._kind == "integer":
            return self._from_object(_int_text(text, "integer", self.describe))
        return self._from_object(self._record_text(text))

    def _from_object(self, value: object, text: str | None = None) -> Key:
        if self._kind == "integer":
            value = _check_int(value, "long", "key")
        elif self._kind == "object" and isinstance(value, Mapping):
            order = self._order
            value = {**{k: value[k] for k in order if k in value}, **{k: v for k, v in value.items() if k not in order}}
        error = next(iter(sorted(self._validator.iter_errors(value), key=lambda e: list(e.path))), None)
        if error is not None:
            field = ".".join(str(p) for p in error.absolute_path)
            where = f"key field {field!r}" if field else "key"
            raise KeyFormatError(f"{where} does not fit {self.describe}: {error.message}")
        try:
            payload = orjson.dumps(value)
        except TypeError as exc:
            raise KeyFormatError(f"key does not fit {self.describe}: {exc}") from None
        if text is None:
            text = str(value) if self._kind == "integer" else payload.decode("utf-8")
        return Key(text, self.prefix + payload)

    def _decoded(self, payload: bytes) -> Key:
        value = orjson.loads(payload)
        if self._kind == "string":
            if not isinstance(value, str):
                raise KeyFormatError(f"serialized key is {_type_name(value)}, not a string")
            return self._from_object(value, value)
        return self._from_object(value)


# --- Protobuf --------------------------------------------------------------------------------------------


_PROTO_INTS = {
    "TYPE_INT32": "int",
    "TYPE_SINT32": "int",
    "TYPE_SFIXED32": "int",
    "TYPE_INT64": "long",
    "TYPE_SINT64": "long",
    "TYPE_SFIXED64": "long",
    "TYPE_UINT32": "uint32",
    "TYPE_FIXED32": "uint32",
    "TYPE_UINT64": "uint64",
    "TYPE_FIXED64": "uint64",
}
# Field types whose single-field key messages are written directly: descriptor type -> wire type.
_DIRECT_TYPES = {9: 2, 3: 0, 5: 0}  # TYPE_STRING: length-delimited; TYPE_INT64, TYPE_INT32: varint
_UNSIGNED = {"uint32": (0, (1 << 32) - 1), "uint64": (0, (1 << 64) - 1)}


class ProtobufKeyCodec(KeyCodec):
    """Protobuf keys as confluent-kafka's ProtobufSerializer writes them: the prefix, the message's index
    path in its file (zigzag varints; a lone 0 for the file's first message) and the message's bytes."""

    __slots__ = ("_class", "_fields", "_kinds", "_single", "_tag")

    def __init__(self, schema: KeySchema) -> None:
        from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

        try:
            proto = descriptor_pb2.FileDescriptorProto.FromString(base64.standard_b64decode(schema.schema))
            pool = descriptor_pool.DescriptorPool()
            _add_dependencies(pool, proto)
            file = pool.Add(proto) and pool.FindFileByName(proto.name)
        except Exception as exc:  # noqa: BLE001 - base64, protobuf decode and pool errors alike
            raise ValueError(
                f"Protobuf schema {schema.schema_id} is not a base64 FileDescriptorProto "
                f"(read it from the registry with format=serialized): {exc}"
            ) from None
        names = list(file.message_types_by_name)
        if not names:
            raise ValueError(f"Protobuf schema {schema.schema_id} defines no message")
        wanted = schema.message or f"{file.package + '.' if file.package else ''}{names[0]}"
        try:
            descriptor = pool.FindMessageTypeByName(wanted)
        except KeyError:
            raise ValueError(f"Protobuf schema {schema.schema_id} has no message {wanted!r}") from None
        prefix = wire_prefix(schema.schema_id) + _index_bytes(_index_path(descriptor))
        super().__init__(schema, prefix, f"Protobuf schema {schema.schema_id} ({descriptor.full_name})")
        self._class = message_factory.GetMessageClass(descriptor)
        self._fields = descriptor.fields
        scalar = len(self._fields) == 1 and self._fields[0].message_type is None and not self._fields[0].is_repeated
        self._single = self._fields[0] if scalar else None
        self._kinds = {f.name: _field_kind(f) for f in self._fields}
        # One proto3 string, int32 or int64 field without presence (the usual key message): its bytes are
        # written here, as the serializer writes them (nothing for the default value), without a message.
        self._tag = None
        single = self._single
        if single is not None and not single.has_presence and single.type in _DIRECT_TYPES:
            self._tag = uvarint(single.number << 3 | _DIRECT_TYPES[single.type])

    def parse(self, text: str) -> Key:
        single = self._single
        if single is None:
            return self._from_object(self._record_text(text))
        kind = self._kinds[single.name]
        tag = self._tag
        if tag is not None:
            if kind == "TYPE_STRING":
                data = _utf8(text)
                return Key(text, self.prefix + tag + uvarint(len(data)) + data if data else self.prefix)
            number = _check_int(_int_text(text, kind, self.describe), kind, f"key {_show(text)}")
            return Key(str(number), self.prefix + tag + uvarint(number) if number else self.prefix)
        if kind in _PROTO_INTS.values():
            return self._from_object({single.name: _int_text(text, kind, self.describe)})
        if kind == "TYPE_STRING":
            return self._from_object({single.name: text})
        raise KeyFormatError(f"{self.describe}: keys of one {kind} field are not supported")

    def _from_object(self, value: object) -> Key:
        from google.protobuf import json_format

        single = self._single
        if single is not None and not isinstance(value, Mapping):
            value = {single.name: value}
        if not isinstance(value, Mapping):
            raise KeyFormatError(f"a {self.describe} record key must be a JSON object, got {_type_name(value)}")
        by_name = {f.name: f for f in self._fields}
        for name, field_value in value.items():
            field = by_name.get(name)
            if field is None:
                raise KeyFormatError(f"key field {name!r} is not in {self.describe}")
            _check_proto_scalar(field, self._kinds[name], field_value)
        message = self._class()
        try:
            json_format.ParseDict(dict(value), message)
        except json_format.ParseError as exc:
            raise KeyFormatError(f"key does not fit {self.describe}: {exc}") from None
        return self._key_of(message)

    def _key_of(self, message: Any) -> Key:
        payload = message.SerializeToString()
        single = self._single
        if single is not None:
            text = str(getattr(message, single.name))
        else:
            text = _compact({f.name: _proto_plain(f, getattr(message, f.name)) for f in self._fields})
        return Key(text, self.prefix + payload)

    def _decoded(self, payload: bytes) -> Key:
        message = self._class.FromString(payload)
        return self._key_of(message)


def _field_kind(field: Any) -> str:
    from google.protobuf.descriptor import FieldDescriptor

    name = next(k for k, v in vars(FieldDescriptor).items() if k.startswith("TYPE_") and v == field.type)
    return _PROTO_INTS.get(name, name)


def _check_proto_scalar(field: Any, kind: str, value: object) -> None:
    """A field value of a JSON key, checked so the error names the field (json_format's messages vary)."""
    if field.message_type is not None or field.is_repeated:
        return
    where = f"key field {field.name!r}"
    if kind in ("int", "long"):
        _check_int(value, kind, where)
    elif kind in _UNSIGNED:
        low, high = _UNSIGNED[kind]
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise KeyFormatError(f"{where} must be a {kind} ({low}..{high}), got {value!r}")
    elif kind == "TYPE_STRING" and not isinstance(value, str):
        raise KeyFormatError(f"{where} must be a string, got {_type_name(value)}")
    elif kind == "TYPE_BOOL" and not isinstance(value, bool):
        raise KeyFormatError(f"{where} must be a boolean, got {_type_name(value)}")


def _proto_plain(field: Any, value: Any) -> Any:
    if field.message_type is not None or field.is_repeated:
        from google.protobuf import json_format

        if field.is_repeated:
            return [json_format.MessageToDict(v) if field.message_type is not None else v for v in value]
        return json_format.MessageToDict(value, preserving_proto_field_name=True)
    if field.enum_type is not None:
        return field.enum_type.values_by_number[value].name
    return value


def _index_path(descriptor: Any) -> list[int]:
    """The message's place in its file: index among the file's messages, then among each parent's nested
    types (confluent-kafka's _create_index_array)."""
    path: list[int] = []
    current = descriptor
    while current.containing_type is not None:
        parent = current.containing_type
        path.insert(0, list(parent.nested_types).index(current))
        current = parent
    path.insert(0, list(current.file.message_types_by_name).index(current.name))
    return path


def _index_bytes(path: list[int]) -> bytes:
    if path == [0]:
        return b"\x00"  # the file's first message: the serializer's one-byte short form
    return zigzag_varint(len(path)) + b"".join(zigzag_varint(i) for i in path)


def _add_dependencies(pool: Any, proto: Any) -> None:
    """Well-known types a key schema imports (google/protobuf/*.proto) come from the default pool."""
    from google.protobuf import descriptor_pb2, descriptor_pool

    default = descriptor_pool.Default()
    for dependency in proto.dependency:
        found = default.FindFileByName(dependency)
        dep_proto = descriptor_pb2.FileDescriptorProto()
        found.CopyToProto(dep_proto)
        _add_dependencies(pool, dep_proto)
        with contextlib.suppress(TypeError):  # already added by another dependency
            pool.Add(dep_proto)


_CODECS: dict[KeyFormat, Callable[[KeySchema], KeyCodec]] = {
    KeyFormat.AVRO: AvroKeyCodec,
    KeyFormat.PROTOBUF: ProtobufKeyCodec,
    KeyFormat.JSON_SCHEMA: JsonSchemaKeyCodec,
}


@functools.lru_cache(maxsize=256)
def _codec(schema: KeySchema) -> KeyCodec:
    return _CODECS[schema.format](schema)


def check_key_schema(schema: KeySchema) -> None:
    """Raise ValueError, saying why, when `schema` cannot serialize keys (checked when a store is built)."""
    schema.codec  # noqa: B018 - building the codec is the check


class KeySchemaLookupError(ValueError):
    """The registry cannot be reached or does not have the key schema asked for; the message says which."""


def fetch_key_schema(
    fmt: KeyFormat,
    registry: RegistrySettings,
    subject: str | None = None,
    schema_id: int | None = None,
    message: str = "",
    environ: Mapping[str, str] | None = None,
) -> KeySchema:
    """The key schema of `subject` (its latest version) or of `schema_id`, read from `registry` (its `${ENV}`
    settings from `environ`, default the process's) and checked to make keys. Protobuf schemas are asked for
    in serialized form (a base64 FileDescriptorProto)."""
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    # The registry client's HTTP library logs every request at INFO: noise on a command's stderr.
    for name in ("httpx", "httpx2"):
        logging.getLogger(name).setLevel(logging.WARNING)
    url = registry.url
    try:
        client = registry_client(registry, os.environ if environ is None else environ)
    except RegistrySettingsError as exc:
        raise KeySchemaLookupError(str(exc)) from None
    serialized = "serialized" if fmt is KeyFormat.PROTOBUF else None
    what = f"key subject {subject!r}" if subject is not None else f"key schema id {schema_id}"
    try:
        if subject is not None:
            latest = client.get_latest_version(subject, fmt=serialized)
            schema_id, registered = latest.schema_id, latest.schema
        else:
            assert schema_id is not None
            registered = client.get_schema(schema_id, fmt=serialized)
    except SchemaRegistryError as exc:
        raise KeySchemaLookupError(f"{what} is not in the schema registry at {url} ({exc.error_message})") from None
    except Exception as exc:  # noqa: BLE001 - connection errors of the client's HTTP library
        raise KeySchemaLookupError(f"the schema registry at {url} cannot be read for {what}: {exc}") from None
    expected = {KeyFormat.AVRO: "AVRO", KeyFormat.PROTOBUF: "PROTOBUF", KeyFormat.JSON_SCHEMA: "JSON"}[fmt]
    if (registered.schema_type or "AVRO") != expected:
        raise KeySchemaLookupError(f"{what} is a {registered.schema_type} schema, not {expected} ({fmt.value} keys)")
    assert schema_id is not None and registered.schema_str is not None
    schema = KeySchema(fmt, schema_id, registered.schema_str, message)
    try:
        check_key_schema(schema)
    except ValueError as exc:
        raise KeySchemaLookupError(f"{what}: {exc}") from None
    return schema
