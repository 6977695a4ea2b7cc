"""keyroute.pipeline.json_size: the bound on a row's JSON, which sizes the write job's Arrow batches (checked
against Spark's to_json in tests/integration/test_pipeline.py)."""

from __future__ import annotations

from pyspark.sql import types as T

from keyroute.pipeline.json_size import json_bounded, json_bytes


def test_the_json_of_a_flat_value_is_bounded_by_its_widest_row() -> None:
    value = T.StructType(
        [
            T.StructField("n", T.LongType()),
            T.StructField("s", T.StringType()),
            T.StructField("b", T.BinaryType()),
            T.StructField("ü", T.DoubleType()),
        ]
    )
    assert json_bounded(value)
    # The widest row: a string of 10 bytes (6 each escaped) and 9 bytes of binary (base64: 12).
    longest_row = 6 * 10 + 4 * (9 // 3 + 1)
    bound = json_bytes(value, longest_row)
    # {"n":<20>,"s":"<10 bytes, 6 each escaped>","b":"<base64 of 9 bytes: 12>","ü":<32>} with names escaped
    # to 6 bytes per byte as well, a comma after every field, 4 bytes for quotes (or null) of each text.
    names = (6 * 1 + 2) * 3 + (6 * 2 + 2)
    assert bound == 2 + names + 4 * 2 + 20 + (6 * 10 + 4) + (4 * 4 + 4) + 32
    assert json_bytes(value, longest_row + 50) == bound + 50  # a merge state's JSON, counted as it is


def test_a_value_with_nested_or_unknown_types_has_no_bound() -> None:
    for field_type in (T.ArrayType(T.LongType()), T.MapType(T.StringType(), T.LongType()), T.DayTimeIntervalType()):
        value = T.StructType([T.StructField("n", T.LongType()), T.StructField("x", field_type)])
        assert not json_bounded(value)
    assert not json_bounded(T.ArrayType(T.StringType()))  # a timeline's entries
