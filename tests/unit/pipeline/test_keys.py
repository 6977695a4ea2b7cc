"""keyroute.pipeline.keys.route_keys: a batch of raw keys to canonical text and partition, errors returned per key.

The function that runs inside Spark's Arrow UDF, tested here on plain Arrow arrays (no Spark session).
"""

from __future__ import annotations

import uuid

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyroute.keys.key_format import KeyFormat, KeyFormatError, key_from_value, parse_key
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.pipeline import keys as pipeline_keys
from keyroute.pipeline.keys import key_partitions, route_keys, serialize_keys


def routed(
    keys: pa.Array, fmt: KeyFormat, partitioner: Partitioner = Partitioner.MURMUR2, n: int = 12
) -> list:
    result = route_keys(keys, fmt, partitioner, n)
    assert result.type == pa.struct([("key", pa.string()), ("partition", pa.int32()), ("error", pa.string())])
    assert len(result) == len(keys)
    return result.to_pylist()


@pytest.mark.parametrize("partitioner", list(Partitioner))
def test_string_keys_are_hashed_as_utf8_bytes(partitioner: Partitioner) -> None:
    keys = ["a/b", "100%", "a+b", "what?", "#frag", " spaced ", "日本", "😀", ""]
    rows = routed(pa.array(keys), KeyFormat.STRING, partitioner, 7)
    assert rows == [
        {"key": k, "partition": partition_for(partitioner, k.encode("utf-8"), 7), "error": None} for k in keys
    ]


def test_int64_keys_keep_every_bit() -> None:
    keys = [-(2**63), 2**63 - 1, 0, -1, 2**53 + 1]
    rows = routed(pa.array(keys, pa.int64()), KeyFormat.INT64)
    for value, row in zip(keys, rows, strict=True):
        data = value.to_bytes(8, "big", signed=True)
        assert row == {
            "key": str(value),
            "partition": partition_for(Partitioner.MURMUR2, data, 12),
            "error": None,
        }


def test_decimal_text_in_an_int_store_is_strict_and_canonical() -> None:
    rows = routed(pa.array(["007", "-12", "abc", " 1", "1.0", "+5", "٣"]), KeyFormat.INT32)
    assert [r["key"] for r in rows[:2]] == ["7", "-12"]
    assert rows[0]["partition"] == partition_for(Partitioner.MURMUR2, (7).to_bytes(4, "big", signed=True), 12)
    for row in rows[2:]:
        assert row["key"] is None and row["partition"] is None
        assert "is not a valid int32" in row["error"]


def test_out_of_range_int_is_an_error_not_a_wrap() -> None:
    rows = routed(pa.array([70000, -32768], pa.int64()), KeyFormat.INT16)
    assert rows[0] == {
        "key": None,
        "partition": None,
        "error": "key 70000 does not fit int16 (range -32768..32767)",
    }
    assert rows[1]["key"] == "-32768"


def test_uuid_keys_are_lowercased_and_checked() -> None:
    upper = str(uuid.UUID(int=0xABCDEF)).upper()
    rows = routed(pa.array([upper, "not-a-uuid"]), KeyFormat.UUID)
    assert rows[0]["key"] == upper.lower()
    assert rows[0]["partition"] == partition_for(Partitioner.MURMUR2, upper.lower().encode("ascii"), 12)
    assert "is not a valid uuid" in rows[1]["error"]


def test_bytes_keys_from_binary_and_from_base64url_text_agree() -> None:
    raw = bytes([0, 255, 16, 32])
    text = parse_key(KeyFormat.BYTES, "AP8QIA").text
    from_binary = routed(pa.array([raw], pa.binary()), KeyFormat.BYTES)
    from_text = routed(pa.array([text]), KeyFormat.BYTES)
    assert from_binary == from_text
    assert from_binary[0]["partition"] == partition_for(Partitioner.MURMUR2, raw, 12)


def test_a_key_of_the_wrong_type_is_an_error() -> None:
    rows = routed(pa.array([1.5]), KeyFormat.INT64)
    assert rows[0]["error"] == "a int64 key cannot be made from a value of type float"


def test_a_null_key_is_an_error_even_in_an_int_column() -> None:
    rows = routed(pa.array([None, 3], pa.int64()), KeyFormat.INT64)
    assert rows[0] == {"key": None, "partition": None, "error": "null key (int64 keys cannot be null)"}
    assert rows[1]["key"] == "3"


# --- serialize_keys: Arrow/NumPy kernels for whole batches, equal to key_from_value key for key ------------


def one_by_one(fmt: KeyFormat, values: list[object]) -> list[tuple[bytes | None, str | None, str | None]]:
    expected: list[tuple[bytes | None, str | None, str | None]] = []
    for value in values:
        try:
            key = key_from_value(fmt, value)
        except KeyFormatError as exc:
            expected.append((None, None, str(exc)))
        else:
            expected.append((key.data, key.text, None))
    return expected


def serialized(
    keys: pa.Array | pa.ChunkedArray, fmt: KeyFormat
) -> list[tuple[bytes | None, str | None, str | None]]:
    result = serialize_keys(keys, fmt)
    assert result.text.type == pa.string() and result.error.type == pa.string()
    assert pa.types.is_binary(result.data.type) or pa.types.is_large_binary(result.data.type)
    return list(zip(result.data.to_pylist(), result.text.to_pylist(), result.error.to_pylist(), strict=True))


INT64_EDGES = [-(2**63), 2**63 - 1, 0, -1, 1, 255, 256, -256, 2**31, -(2**31) - 1, 2**53 + 1]
WELL_FORMED = [
    (KeyFormat.INT64, pa.array([*INT64_EDGES, None], pa.int64())),
    (KeyFormat.INT32, pa.array([-(2**31), 2**31 - 1, 0, -1, 7, None], pa.int64())),
    (KeyFormat.INT16, pa.array([-(2**15), 2**15 - 1, 0, -1, None], pa.int64())),
    (KeyFormat.INT16, pa.array([-128, 127, 0], pa.int8())),
    (KeyFormat.INT64, pa.array([-(2**31), 2**31 - 1], pa.int32())),
    (KeyFormat.INT64, pa.array(["007", "-0", "-12", "9223372036854775807", "-9223372036854775808", None])),
    (KeyFormat.INT32, pa.array(["2147483647", "-2147483648", "0042"], pa.large_string())),
    (KeyFormat.UUID, pa.array([str(uuid.UUID(int=0xABCDEF)).upper(), str(uuid.UUID(int=1)), None])),
    (KeyFormat.STRING, pa.array(["a/b", "日本", "😀", "", None])),
    (KeyFormat.STRING, pa.array(["x", "", None, "ü"], pa.large_string())),
]


@pytest.mark.parametrize(("fmt", "keys"), WELL_FORMED)
def test_well_formed_batches_are_serialized_by_kernels_exactly_as_key_by_key(
    fmt: KeyFormat, keys: pa.Array
) -> None:
    assert pipeline_keys.serialize_vectorized(keys, fmt) is not None  # the fast path, not the per-key loop
    assert serialized(keys, fmt) == one_by_one(fmt, keys.to_pylist())
    # Spark may hand over slices of a larger batch: offsets into shared buffers.
    assert serialized(keys[1:], fmt) == one_by_one(fmt, keys.to_pylist()[1:])
    chunked = pa.chunked_array([keys[:2], keys[2:]], keys.type)
    assert serialized(chunked, fmt) == one_by_one(fmt, keys.to_pylist())


@pytest.mark.parametrize(
    ("fmt", "bad"),
    [
        (KeyFormat.INT16, pa.array([1, 70000], pa.int64())),
        (KeyFormat.INT32, pa.array([1, 2**31], pa.int64())),
        (KeyFormat.INT64, pa.array([1, 2**64 - 1], pa.uint64())),
        *[
            (KeyFormat.INT64, pa.array(["1", text]))
            for text in ["+5", " 1", "1 ", "1.0", "٣", "12\n", "", "abc", "99999999999999999999", "--1"]
        ],
        (KeyFormat.INT16, pa.array(["1", "40000"])),
        (KeyFormat.UUID, pa.array([str(uuid.UUID(int=5)), str(uuid.UUID(int=5)) + "\n"])),
        (KeyFormat.UUID, pa.array([str(uuid.UUID(int=5)), "not-a-uuid"])),
        (KeyFormat.INT64, pa.array([1.5])),
    ],
)
def test_a_batch_with_a_bad_key_still_matches_key_by_key(fmt: KeyFormat, bad: pa.Array) -> None:
    rows = serialized(bad, fmt)
    assert rows == one_by_one(fmt, bad.to_pylist())
    assert rows[-1][2] is not None  # the bad key has its error


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)), max_size=40),
    fmt=st.sampled_from([KeyFormat.INT16, KeyFormat.INT32, KeyFormat.INT64, KeyFormat.STRING]),
    as_text=st.booleans(),
)
def test_integer_keys_property(values: list[int | None], fmt: KeyFormat, as_text: bool) -> None:
    keys = (
        pa.array([None if v is None else str(v) for v in values]) if as_text else pa.array(values, pa.int64())
    )
    if fmt is KeyFormat.STRING and not as_text:
        return  # raw_key_column casts an integer column to its decimal text for a string store
    assert serialized(keys, fmt) == one_by_one(fmt, keys.to_pylist())


@pytest.mark.parametrize("partitioner", list(Partitioner))
def test_key_partitions_are_null_for_keys_that_do_not_fit(partitioner: Partitioner) -> None:
    keys = pa.array(["12", "x", None, "-3"])
    parts = key_partitions(keys, KeyFormat.INT32, partitioner, 7).to_pylist()
    assert parts == [
        partition_for(partitioner, (12).to_bytes(4, "big", signed=True), 7),
        None,
        None,
        partition_for(partitioner, (-3).to_bytes(4, "big", signed=True), 7),
    ]
