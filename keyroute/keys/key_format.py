"""Key formats: the exact bytes Kafka's serializers write for a key, and its canonical text form.

Keys arrive as URL segments, CLI arguments, data-source values or stored bytes; all meet in one `Key`.
"""

from __future__ import annotations

import base64
import enum
import numbers
import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from keyroute.keys.partitioner import parse_choice

if TYPE_CHECKING:
    from keyroute.keys.key_schema import KeyCodec, KeySchema

# Explicit [0-9] rather than \d, which in str patterns also matches non-ASCII digits such as '٣'.
_DECIMAL = re.compile(r"-?[0-9]+")
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_BASE64URL = re.compile(r"[A-Za-z0-9_-]*(={0,2})")
_UUID_TEXT_LENGTH = 36
# Long enough to recognise a key in an error message, short enough that a hostile URL can't bloat logs.
_SHOWN_CHARS = 64


class KeyFormat(enum.StrEnum):
    """How a store's keys were serialized: Kafka's String/Short/Integer/Long/UUID/ByteArraySerializer, or
    Confluent's Schema Registry serializers (Avro, Protobuf, JSON Schema: keyroute.keys.key_schema)."""

    STRING = "string"
    INT16 = "int16"
    INT32 = "int32"
    INT64 = "int64"
    UUID = "uuid"
    BYTES = "bytes"
    AVRO = "avro"
    PROTOBUF = "protobuf"
    JSON_SCHEMA = "json_schema"

    @property
    def registered(self) -> bool:
        """Whether keys of this format are framed with a Schema Registry schema id (need a `KeySchema`)."""
        return self in _REGISTERED

    @classmethod
    def parse(cls, name: str) -> KeyFormat:
        """Read a key format name from the CLI or a config file (case-insensitive)."""
        return parse_choice(cls, name, "key format")


class KeyFormatError(ValueError):
    """A key that cannot be expressed in its store's key format; the message says which format and why."""


@dataclass(frozen=True, slots=True)
class Key:
    """One key in both of its forms; equal keys have equal text and equal data."""

    text: str  # canonical text form: what appears in JSON answers and snapshot files
    data: bytes  # the bytes Kafka's serializer produces; what is hashed and stored


_REGISTERED = frozenset({KeyFormat.AVRO, KeyFormat.PROTOBUF, KeyFormat.JSON_SCHEMA})

_INT_WIDTHS: dict[KeyFormat, int] = {KeyFormat.INT16: 2, KeyFormat.INT32: 4, KeyFormat.INT64: 8}


def _show(text: str) -> str:
    shown = text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "…"
    return repr(shown)


def _int_bounds(fmt: KeyFormat) -> tuple[int, int]:
    bits = _INT_WIDTHS[fmt] * 8
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


def _int_key(fmt: KeyFormat, value: int, shown: str) -> Key:
    low, high = _int_bounds(fmt)
    if not low <= value <= high:
        # Never wrap: a wrapped key would silently address a different record.
        raise KeyFormatError(f"key {shown} does not fit {fmt.value} (range {low}..{high})")
    return Key(str(value), value.to_bytes(_INT_WIDTHS[fmt], "big", signed=True))


def _parse_int(fmt: KeyFormat, text: str) -> Key:
    if not text:
        raise KeyFormatError(f"empty key is not a valid {fmt.value}")
    if not _DECIMAL.fullmatch(text):
        raise KeyFormatError(
            f"key {_show(text)} is not a valid {fmt.value} (expected decimal digits, optional leading '-')"
        )
    digits = text.lstrip("-").lstrip("0") or "0"
    # No 64-bit value has 20 digits; bail out before int() meets a megabyte of digits from a URL.
    if len(digits) > 19:
        low, high = _int_bounds(fmt)
        raise KeyFormatError(f"key {_show(text)} does not fit {fmt.value} (range {low}..{high})")
    return _int_key(fmt, int(text), _show(text))


def _parse_uuid(text: str) -> Key:
    if not _UUID.fullmatch(text):
        raise KeyFormatError(f"key {_show(text)} is not a valid uuid (expected 8-4-4-4-12 hex digits)")
    canonical = text.lower()
    # Kafka's UUIDSerializer writes uuid.toString(): the lowercase hyphenated text, not the 16 raw bytes.
    return Key(canonical, canonical.encode("ascii"))


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _parse_bytes(text: str) -> Key:
    match = _BASE64URL.fullmatch(text)
    if match is None:
        raise KeyFormatError(
            f"key {_show(text)} is not valid base64url (only A-Z a-z 0-9 '-' '_' and optional '=' padding)"
        )
    unpadded = text[: match.start(1)]
    if match.group(1) and len(text) % 4:
        raise KeyFormatError(f"key {_show(text)} is not valid base64url (wrong amount of '=' padding)")
    if len(unpadded) % 4 == 1:
        raise KeyFormatError(f"key {_show(text)} is not valid base64url (impossible length {len(unpadded)})")
    data = base64.urlsafe_b64decode(unpadded + "=" * (-len(unpadded) % 4))
    # Unused low bits must be zero, or two spellings would name one key.
    if _b64url(data) != unpadded:
        raise KeyFormatError(f"key {_show(text)} is not canonical base64url (non-zero trailing bits)")
    return Key(unpadded, data)


def _parse_string(text: str) -> Key:
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        raise KeyFormatError(f"key {_show(text)} is not a valid string (contains a lone surrogate)") from None
    return Key(text, data)


def _codec(fmt: KeyFormat, schema: KeySchema | None) -> KeyCodec:
    if schema is None or schema.format is not fmt:
        raise KeyFormatError(f"{fmt.value} keys need the store's key schema (its record has none)")
    return schema.codec


def parse_key(fmt: KeyFormat, text: str, schema: KeySchema | None = None) -> Key:
    """A key as written in a (percent-decoded) URL path segment or on the CLI; `schema`: the store's key
    schema, for the Schema Registry formats."""
    if fmt is KeyFormat.STRING:
        return _parse_string(text)
    if fmt in _INT_WIDTHS:
        return _parse_int(fmt, text)
    if fmt is KeyFormat.UUID:
        return _parse_uuid(text)
    if fmt is KeyFormat.BYTES:
        return _parse_bytes(text)
    if fmt in _REGISTERED:
        return _codec(fmt, schema).parse(text)
    raise KeyFormatError(f"unknown key format {fmt!r}")


def key_from_value(fmt: KeyFormat, value: object, schema: KeySchema | None = None) -> Key:
    """A key from a value as a data source (e.g. a Spark row) gives it."""
    if value is None:
        raise KeyFormatError(f"null key ({fmt.value} keys cannot be null)")
    if fmt in _REGISTERED:
        return _codec(fmt, schema).from_value(value)
    if isinstance(value, str):
        return parse_key(fmt, value)
    if fmt in _INT_WIDTHS and isinstance(value, numbers.Integral) and not isinstance(value, bool):
        # numbers.Integral rather than int so NumPy/pandas integer columns work too.
        number = int(value)
        # str() of a huge int is slow (and refused past 4300 digits); its size says enough.
        shown = str(number) if number.bit_length() <= 128 else f"of {number.bit_length()} bits"
        return _int_key(fmt, number, shown)
    if fmt is KeyFormat.UUID and isinstance(value, uuid.UUID):
        return _parse_uuid(str(value))
    if fmt is KeyFormat.BYTES and isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        return Key(_b64url(data), data)
    raise KeyFormatError(f"a {fmt.value} key cannot be made from a value of type {type(value).__name__}")


def key_from_data(fmt: KeyFormat, data: bytes, schema: KeySchema | None = None) -> Key:
    """Rebuild a key from the serialized bytes (as read back from a store)."""
    if fmt in _REGISTERED:
        return _codec(fmt, schema).from_data(data)
    data = bytes(data)
    if fmt is KeyFormat.STRING:
        try:
            return Key(data.decode("utf-8"), data)
        except UnicodeDecodeError as exc:
            reason = f"{exc.reason} at byte {exc.start}"
            raise KeyFormatError(f"stored string key is not valid UTF-8 ({reason})") from None
    if fmt in _INT_WIDTHS:
        width = _INT_WIDTHS[fmt]
        if len(data) != width:
            raise KeyFormatError(f"stored {fmt.value} key has {len(data)} bytes, expected {width}")
        value = int.from_bytes(data, "big", signed=True)
        return Key(str(value), data)
    if fmt is KeyFormat.UUID:
        if len(data) != _UUID_TEXT_LENGTH:
            raise KeyFormatError(f"stored uuid key has {len(data)} bytes, expected {_UUID_TEXT_LENGTH}")
        key = _parse_uuid(data.decode("ascii", errors="replace"))
        # Uppercase bytes would re-serialize differently, so they are not a key this store could hold.
        if key.data != data:
            raise KeyFormatError(f"stored uuid key {key.text!r} is not in canonical lowercase form")
        return key
    if fmt is KeyFormat.BYTES:
        return Key(_b64url(data), data)
    raise KeyFormatError(f"unknown key format {fmt!r}")
