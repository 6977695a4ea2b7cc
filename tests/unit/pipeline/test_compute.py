"""pipeline.compute.route_keys: a batch of raw keys to canonical text and partition, errors returned per key.

The function that runs inside Spark's Arrow UDF, tested here on plain Arrow arrays (no Spark session).
"""

from __future__ import annotations

import uuid

import pyarrow as pa
import pytest

from keyroute_core.key_format import KeyFormat, parse_key
from keyroute_core.partitioner import Partitioner, partition_for
from pipeline.compute import route_keys, spark_message


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


def test_spark_message_keeps_the_first_line_only() -> None:
    exc = RuntimeError("[UNRESOLVED_COLUMN] cannot resolve `x`\n  at org.apache.spark...\n")
    assert spark_message(exc) == "[UNRESOLVED_COLUMN] cannot resolve `x`"
    assert spark_message(RuntimeError("x" * 1000)).endswith("…")


def test_a_null_key_is_an_error_even_in_an_int_column() -> None:
    rows = routed(pa.array([None, 3], pa.int64()), KeyFormat.INT64)
    assert rows[0] == {"key": None, "partition": None, "error": "null key (int64 keys cannot be null)"}
    assert rows[1]["key"] == "3"
