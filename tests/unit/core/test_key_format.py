"""Pins keyroute.keys.key_format to the bytes Kafka's serializers write and to strict, canonical key parsing.

Expected bytes are literal: Java's Short/Integer/Long serializers write big-endian two's complement.
"""

from __future__ import annotations

import struct
import uuid

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyroute.keys import key_format
from keyroute.keys.key_format import (
    Key,
    KeyFormat,
    KeyFormatError,
    key_from_data,
    key_from_value,
    parse_key,
)

INT_FORMATS = [KeyFormat.INT16, KeyFormat.INT32, KeyFormat.INT64]
EXAMPLES = settings(max_examples=200, deadline=None)


# --- KeyFormat.parse -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(KeyFormat))
def test_key_format_parse_accepts_every_value(fmt: KeyFormat) -> None:
    assert KeyFormat.parse(fmt.value) is fmt
    assert KeyFormat.parse(fmt.value.upper()) is fmt


@pytest.mark.parametrize("name", ["", "int", "long", "integer", "str", " string"])
def test_key_format_parse_names_the_allowed_formats(name: str) -> None:
    with pytest.raises(ValueError) as err:
        KeyFormat.parse(name)
    assert str(err.value) == (
        f"unknown key format {name!r} (expected one of: string, int16, int32, int64, uuid, bytes, avro, protobuf, "
        "json_schema)"
    )


def test_key_format_error_is_a_value_error() -> None:
    assert issubclass(KeyFormatError, ValueError)


def test_key_is_frozen_and_hashable() -> None:
    key = parse_key(KeyFormat.STRING, "a")
    assert key == Key("a", b"a")
    assert {key: 1}[Key("a", b"a")] == 1
    with pytest.raises(AttributeError):
        key.text = "b"  # type: ignore[misc]


# --- string --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "",
        "a",
        "a/b",
        "100%",
        "%2F",
        "a+b",
        "what?",
        "#frag",
        " spaced out ",
        "ü",
        "日本",
        "😀",
        "null",
        "\x00",
    ],
)
def test_string_keys_are_utf8_and_round_trip(text: str) -> None:
    key = parse_key(KeyFormat.STRING, text)
    assert key == Key(text, text.encode("utf-8"))
    assert key_from_data(KeyFormat.STRING, key.data) == key
    assert key_from_value(KeyFormat.STRING, text) == key


def test_string_key_exact_bytes() -> None:
    assert parse_key(KeyFormat.STRING, "ü").data == b"\xc3\xbc"
    assert parse_key(KeyFormat.STRING, "日本").data == b"\xe6\x97\xa5\xe6\x9c\xac"
    assert parse_key(KeyFormat.STRING, "😀").data == b"\xf0\x9f\x98\x80"


def test_string_key_with_lone_surrogate_is_rejected() -> None:
    with pytest.raises(KeyFormatError, match="not a valid string"):
        parse_key(KeyFormat.STRING, "a\udc80b")


def test_stored_string_key_must_be_utf8() -> None:
    with pytest.raises(KeyFormatError, match="not valid UTF-8"):
        key_from_data(KeyFormat.STRING, b"\xff")


@pytest.mark.parametrize("value", [1, 1.5, b"a", True, uuid.UUID(int=0)])
def test_string_key_from_non_str_value_is_rejected(value: object) -> None:
    with pytest.raises(KeyFormatError, match="string key"):
        key_from_value(KeyFormat.STRING, value)


# --- int16 / int32 / int64 -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "text", "data"),
    [
        (KeyFormat.INT16, "0", b"\x00\x00"),
        (KeyFormat.INT16, "1", b"\x00\x01"),
        (KeyFormat.INT16, "-1", b"\xff\xff"),
        (KeyFormat.INT16, "32767", b"\x7f\xff"),
        (KeyFormat.INT16, "-32768", b"\x80\x00"),
        (KeyFormat.INT32, "0", b"\x00\x00\x00\x00"),
        (KeyFormat.INT32, "-1", b"\xff\xff\xff\xff"),
        (KeyFormat.INT32, "258", b"\x00\x00\x01\x02"),
        (KeyFormat.INT32, "2147483647", b"\x7f\xff\xff\xff"),
        (KeyFormat.INT32, "-2147483648", b"\x80\x00\x00\x00"),
        (KeyFormat.INT64, "-1", b"\xff" * 8),
        (KeyFormat.INT64, "1", b"\x00" * 7 + b"\x01"),
        (KeyFormat.INT64, "9223372036854775807", b"\x7f" + b"\xff" * 7),
        (KeyFormat.INT64, "-9223372036854775808", b"\x80" + b"\x00" * 7),
    ],
)
def test_int_keys_are_big_endian_twos_complement(fmt: KeyFormat, text: str, data: bytes) -> None:
    key = parse_key(fmt, text)
    assert key == Key(text, data)
    assert key_from_data(fmt, data) == key
    assert key_from_value(fmt, int(text)) == key


def test_int_bytes_match_java_serializer_layout() -> None:
    # Java's ShortSerializer/IntegerSerializer/LongSerializer write the value's bytes most significant first.
    for value in (0, 1, -1, 12345, -12345, 32767, -32768):
        assert parse_key(KeyFormat.INT16, str(value)).data == struct.pack(">h", value)
    for value in (0, 1, -1, 1 << 30, -(1 << 31), (1 << 31) - 1):
        assert parse_key(KeyFormat.INT32, str(value)).data == struct.pack(">i", value)
    for value in (0, 1, -1, 1 << 40, -(1 << 63), (1 << 63) - 1):
        assert parse_key(KeyFormat.INT64, str(value)).data == struct.pack(">q", value)


@pytest.mark.parametrize(
    ("text", "canonical"),
    [("007", "7"), ("-0", "0"), ("-000", "0"), ("0000", "0"), ("-0042", "-42")],
)
@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_int_text_is_canonicalised(fmt: KeyFormat, text: str, canonical: str) -> None:
    assert parse_key(fmt, text).text == canonical
    assert parse_key(fmt, text) == parse_key(fmt, canonical)


@pytest.mark.parametrize(
    "text",
    ["+1", " 1", "1 ", "1.0", "1e3", "0x10", "1_000", "-", "--1", "1-", "one", "\u0661", "１", "\n1", "1\n"],
)
@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_int_text_must_be_strict_decimal(fmt: KeyFormat, text: str) -> None:
    with pytest.raises(KeyFormatError, match=f"not a valid {fmt.value}"):
        parse_key(fmt, text)


@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_empty_int_key_is_rejected(fmt: KeyFormat) -> None:
    with pytest.raises(KeyFormatError, match=f"empty key is not a valid {fmt.value}"):
        parse_key(fmt, "")


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        (KeyFormat.INT16, "32768"),
        (KeyFormat.INT16, "-32769"),
        (KeyFormat.INT32, "2147483648"),
        (KeyFormat.INT32, "-2147483649"),
        (KeyFormat.INT64, "9223372036854775808"),
        (KeyFormat.INT64, "-9223372036854775809"),
        (KeyFormat.INT64, "18446744073709551615"),
        (KeyFormat.INT64, "100000000000000000000"),
    ],
)
def test_out_of_range_int_is_rejected_not_wrapped(fmt: KeyFormat, text: str) -> None:
    with pytest.raises(KeyFormatError, match=f"does not fit {fmt.value}"):
        parse_key(fmt, text)
    with pytest.raises(KeyFormatError, match=f"does not fit {fmt.value}"):
        key_from_value(fmt, int(text))


def test_out_of_range_message_names_format_and_range() -> None:
    with pytest.raises(KeyFormatError) as err:
        parse_key(KeyFormat.INT16, "99999")
    assert str(err.value) == "key '99999' does not fit int16 (range -32768..32767)"


def test_huge_int_text_is_rejected_before_it_is_converted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A megabyte of digits from a URL never reaches int() (quadratic in the digits): the length decides."""
    converted: list[int] = []

    def counting_int(value: object, *args: object) -> int:
        if isinstance(value, str):
            converted.append(len(value))
        return int(value, *args)  # type: ignore[call-overload, no-any-return]

    monkeypatch.setattr(key_format, "int", counting_int, raising=False)
    text = "9" * 100_000
    with pytest.raises(KeyFormatError, match="does not fit int64") as err:
        parse_key(KeyFormat.INT64, text)
    assert converted == []
    assert len(str(err.value)) < 200
    # The counter sees conversions: a key that fits is converted once.
    assert parse_key(KeyFormat.INT64, "42").data == (42).to_bytes(8, "big", signed=True)
    assert converted == [2]


def test_leading_zeros_do_not_count_towards_range() -> None:
    assert parse_key(KeyFormat.INT16, "0" * 50 + "32767").text == "32767"


def test_int_key_from_values() -> None:
    assert key_from_value(KeyFormat.INT32, -1).data == b"\xff\xff\xff\xff"
    assert key_from_value(KeyFormat.INT32, "-1").data == b"\xff\xff\xff\xff"
    assert key_from_value(KeyFormat.INT64, np.int64(-5)) == parse_key(KeyFormat.INT64, "-5")
    assert key_from_value(KeyFormat.INT16, np.int16(7)) == parse_key(KeyFormat.INT16, "7")


@pytest.mark.parametrize("value", [True, False, 1.0, b"\x00\x01", uuid.UUID(int=1), np.float64(1.0)])
@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_int_key_from_non_int_value_is_rejected(fmt: KeyFormat, value: object) -> None:
    with pytest.raises(KeyFormatError, match=f"{fmt.value} key cannot be made"):
        key_from_value(fmt, value)


def test_int_key_from_huge_int_value_is_rejected() -> None:
    with pytest.raises(KeyFormatError, match="does not fit int64"):
        key_from_value(KeyFormat.INT64, 10**5000)


@pytest.mark.parametrize(("fmt", "width"), [(KeyFormat.INT16, 2), (KeyFormat.INT32, 4), (KeyFormat.INT64, 8)])
def test_stored_int_key_must_have_exact_width(fmt: KeyFormat, width: int) -> None:
    for length in (0, width - 1, width + 1):
        with pytest.raises(KeyFormatError, match=f"expected {width}"):
            key_from_data(fmt, b"\x00" * length)


# --- uuid ----------------------------------------------------------------------------------------------

UUID_TEXT = "123e4567-e89b-12d3-a456-426614174000"


def test_uuid_key_is_its_lowercase_text() -> None:
    key = parse_key(KeyFormat.UUID, UUID_TEXT.upper())
    # Kafka's UUIDSerializer writes uuid.toString() as UTF-8: 36 ASCII bytes, lowercase.
    assert key == Key(UUID_TEXT, UUID_TEXT.encode("ascii"))
    assert len(key.data) == 36
    assert parse_key(KeyFormat.UUID, "123E4567-e89b-12D3-a456-426614174000") == key
    assert key_from_data(KeyFormat.UUID, key.data) == key


def test_uuid_key_from_values() -> None:
    expected = parse_key(KeyFormat.UUID, UUID_TEXT)
    assert key_from_value(KeyFormat.UUID, uuid.UUID(UUID_TEXT)) == expected
    assert key_from_value(KeyFormat.UUID, UUID_TEXT.upper()) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "123e4567e89b12d3a456426614174000",
        "{123e4567-e89b-12d3-a456-426614174000}",
        "urn:uuid:123e4567-e89b-12d3-a456-426614174000",
        "123e4567-e89b-12d3-a456-42661417400",
        "123e4567-e89b-12d3-a456-4266141740000",
        "123e4567-e89b-12d3-a456-42661417400g",
        "123e4567-e89b-12d3a456-426614174000-",
        " 123e4567-e89b-12d3-a456-426614174000",
        "１23e4567-e89b-12d3-a456-426614174000",
    ],
)
def test_malformed_uuid_is_rejected(text: str) -> None:
    with pytest.raises(KeyFormatError, match="not a valid uuid"):
        parse_key(KeyFormat.UUID, text)


def test_stored_uuid_key_must_be_canonical() -> None:
    with pytest.raises(KeyFormatError, match="canonical lowercase"):
        key_from_data(KeyFormat.UUID, UUID_TEXT.upper().encode("ascii"))
    with pytest.raises(KeyFormatError, match="expected 36"):
        key_from_data(KeyFormat.UUID, uuid.UUID(UUID_TEXT).bytes)


@pytest.mark.parametrize("value", [1, b"x" * 36, 1.0])
def test_uuid_key_from_other_types_is_rejected(value: object) -> None:
    with pytest.raises(KeyFormatError, match="uuid key cannot be made"):
        key_from_value(KeyFormat.UUID, value)


# --- bytes ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "canonical", "data"),
    [
        ("", "", b""),
        ("QQ", "QQ", b"A"),
        ("QQ==", "QQ", b"A"),
        ("QUI", "QUI", b"AB"),
        ("QUI=", "QUI", b"AB"),
        ("QUJD", "QUJD", b"ABC"),
        ("AQID", "AQID", b"\x01\x02\x03"),
        ("-_8", "-_8", b"\xfb\xff"),
        ("-_8=", "-_8", b"\xfb\xff"),
        ("----", "----", b"\xfb\xef\xbe"),
    ],
)
def test_bytes_keys_are_base64url_with_optional_padding(text: str, canonical: str, data: bytes) -> None:
    key = parse_key(KeyFormat.BYTES, text)
    assert key == Key(canonical, data)
    assert key_from_data(KeyFormat.BYTES, data) == key
    assert key_from_value(KeyFormat.BYTES, text) == key


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("+_8", "base64url"),
        ("/w", "base64url"),
        ("a+b/", "base64url"),
        ("QQ ", "base64url"),
        (" QQ", "base64url"),
        ("Q Q", "base64url"),
        ("QQ\n", "base64url"),
        ("QQ=", "padding"),
        ("QUJD=", "padding"),
        ("QUJD==", "padding"),
        ("QQ===", "base64url"),
        ("=", "padding"),
        ("==", "padding"),
        ("Q", "length"),
        ("QUJDR", "length"),
        ("QR", "canonical"),
        ("QR==", "canonical"),
        ("QUJ", "canonical"),
        ("QQ=Q", "base64url"),
        ("QQé", "base64url"),
    ],
)
def test_malformed_or_non_canonical_bytes_key_is_rejected(text: str, reason: str) -> None:
    with pytest.raises(KeyFormatError, match=reason):
        parse_key(KeyFormat.BYTES, text)


def test_bytes_key_from_raw_values() -> None:
    raw = bytes(range(256))
    key = key_from_value(KeyFormat.BYTES, raw)
    assert key.data == raw
    assert "=" not in key.text
    assert parse_key(KeyFormat.BYTES, key.text) == key
    assert key_from_value(KeyFormat.BYTES, bytearray(raw)) == key
    assert key_from_value(KeyFormat.BYTES, memoryview(raw)) == key
    assert isinstance(key_from_value(KeyFormat.BYTES, bytearray(b"x")).data, bytes)


@pytest.mark.parametrize("value", [1, 1.0, uuid.UUID(int=0), ["QQ"]])
def test_bytes_key_from_other_types_is_rejected(value: object) -> None:
    with pytest.raises(KeyFormatError, match="bytes key cannot be made"):
        key_from_value(KeyFormat.BYTES, value)


# --- shared --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(KeyFormat))
def test_null_key_is_rejected(fmt: KeyFormat) -> None:
    with pytest.raises(KeyFormatError, match="^null key"):
        key_from_value(fmt, None)


def test_error_messages_escape_control_characters() -> None:
    with pytest.raises(KeyFormatError) as err:
        parse_key(KeyFormat.INT32, "1\r\nX-Injected: yes")
    assert "\n" not in str(err.value)


@EXAMPLES
@given(st.text())
def test_any_valid_string_round_trips(text: str) -> None:
    try:
        key = parse_key(KeyFormat.STRING, text)
    except KeyFormatError:
        return  # lone surrogates only
    assert key_from_data(KeyFormat.STRING, key.data) == key


@EXAMPLES
@given(st.binary(max_size=64))
def test_any_bytes_round_trip_through_canonical_text(data: bytes) -> None:
    key = key_from_data(KeyFormat.BYTES, data)
    assert parse_key(KeyFormat.BYTES, key.text) == key
    assert key.data == data


@EXAMPLES
@given(st.sampled_from(INT_FORMATS), st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1))
def test_ints_in_range_round_trip_and_out_of_range_fail(fmt: KeyFormat, value: int) -> None:
    bits = {KeyFormat.INT16: 16, KeyFormat.INT32: 32, KeyFormat.INT64: 64}[fmt]
    if -(1 << (bits - 1)) <= value < 1 << (bits - 1):
        key = parse_key(fmt, str(value))
        assert key.data == value.to_bytes(bits // 8, "big", signed=True)
        assert key_from_data(fmt, key.data) == key
    else:
        with pytest.raises(KeyFormatError):
            parse_key(fmt, str(value))


@EXAMPLES
@given(st.uuids())
def test_any_uuid_round_trips(value: uuid.UUID) -> None:
    key = key_from_value(KeyFormat.UUID, value)
    assert key.text == str(value)
    assert parse_key(KeyFormat.UUID, str(value).upper()) == key
    assert key_from_data(KeyFormat.UUID, key.data) == key
