"""keyroute.pipeline.timeline: how a history or windowed store's `order_by` column becomes its time (the
column's type and the spec's `order_by_type`), which texts count as ISO 8601, and where a bad text is found
in its file. Pure: Spark's types only, no session."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest
from pyspark.sql import types as T

from keyroute.pipeline.errors import DataError
from keyroute.pipeline.spec import Mode, SourceFormat, StoreSpec
from keyroute.pipeline.timeline import (
    DATE_TEXT,
    INTEGER_TEXT,
    TIMESTAMP_TEXT,
    Reading,
    first_line_of,
    time_reading,
    time_type_of,
)
from keyroute.storage.timeline import DATE_PATTERN, INTEGER_PATTERN, TIMESTAMP_PATTERN, TimeType, parse_order_text


def history(order_by_type: TimeType | None = None) -> StoreSpec:
    return StoreSpec(
        name="trips",
        source="/data/trips",
        format=SourceFormat.JSON,
        key="customer",
        partitions=2,
        mode=Mode.HISTORY,
        order_by="ts",
        order_by_type=order_by_type,
    )


@pytest.mark.parametrize(
    ("dtype", "declared", "time_type", "reading"),
    [
        (T.StringType(), None, TimeType.TIMESTAMP, Reading.TEXT),
        (T.StringType(), TimeType.TIMESTAMP, TimeType.TIMESTAMP, Reading.TEXT),
        (T.StringType(), TimeType.DATE, TimeType.DATE, Reading.TEXT),
        (T.StringType(), TimeType.INTEGER, TimeType.INTEGER, Reading.TEXT),
        (T.TimestampType(), None, TimeType.TIMESTAMP, Reading.AS_IS),
        (T.TimestampNTZType(), TimeType.TIMESTAMP, TimeType.TIMESTAMP, Reading.AS_IS),
        (T.DateType(), None, TimeType.DATE, Reading.AS_IS),
        (T.DateType(), TimeType.DATE, TimeType.DATE, Reading.AS_IS),
        (T.DateType(), TimeType.TIMESTAMP, TimeType.TIMESTAMP, Reading.MIDNIGHT),
        (T.LongType(), None, TimeType.INTEGER, Reading.AS_IS),
        (T.IntegerType(), TimeType.INTEGER, TimeType.INTEGER, Reading.AS_IS),
        (T.LongType(), TimeType.TIMESTAMP, TimeType.TIMESTAMP, Reading.EPOCH_MILLIS),
    ],
)
def test_the_time_type_is_the_declared_one_else_the_column_s(
    dtype: T.DataType, declared: TimeType | None, time_type: TimeType, reading: Reading
) -> None:
    assert time_reading(history(declared), dtype) == (time_type, reading)


@pytest.mark.parametrize(
    ("dtype", "declared", "message"),
    [
        (
            T.LongType(),
            TimeType.DATE,
            "store 'trips': order_by_type is 'date' but column 'ts' of the source is bigint: a date store's "
            "order_by is a date column or ISO 8601 date text such as 2024-06-11",
        ),
        (
            T.TimestampType(),
            TimeType.INTEGER,
            "store 'trips': order_by_type is 'integer' but column 'ts' of the source is timestamp: an integer "
            "store's order_by is an integer column or integer text",
        ),
        (
            T.DoubleType(),
            None,
            "store 'trips': order_by column 'ts' is double: a history store orders by a timestamp, date or "
            "integer column, or by ISO 8601 text",
        ),
        (T.BooleanType(), TimeType.TIMESTAMP, "store 'trips': order_by column 'ts' is boolean: a history store orders"),
    ],
)
def test_a_column_that_is_no_time_of_the_type_is_refused(
    dtype: T.DataType, declared: TimeType | None, message: str
) -> None:
    with pytest.raises(DataError) as err:
        time_reading(history(declared), dtype)
    assert str(err.value).startswith(message)


def test_time_type_of_names_the_column_and_what_a_timeline_orders_by() -> None:
    with pytest.raises(DataError, match="orders by a timestamp, date or integer column"):
        time_type_of(history(), T.MapType(T.StringType(), T.StringType()))


# Java's and Python's regular expressions agree on these patterns (classes, groups, ? and {m,n} only); Spark
# is given them anchored to the whole text.
def test_spark_is_given_the_shared_patterns_anchored() -> None:
    for pattern, java in (
        (TIMESTAMP_PATTERN, TIMESTAMP_TEXT),
        (DATE_PATTERN, DATE_TEXT),
        (INTEGER_PATTERN, INTEGER_TEXT),
    ):
        assert java == f"^(?:{pattern})\\z"


TIMESTAMPS = [
    "2024-06-11T10:00:00Z",
    "2024-06-11T10:00:00.250Z",
    "2024-06-11T10:00:00.123456789Z",
    "2024-06-11T12:00:00+02:00",
    "2024-06-11T12:00:00+0200",
    "2024-06-11T12:00:00+02",
    "2024-06-11T04:30:00-05:30",
    "2024-06-11 10:00:00",
    "2024-06-11T10:00",
    "2024-06-11",
]
NOT_TIMESTAMPS = [
    "yesterday",
    "2024",
    "2024-06",
    " 2024-06-11",
    "2024-06-11T10:00:00 UTC",
    "2024-06-11T10:00:00America/New_York",
    "20240611T100000Z",
    "2024-06-11t10:00:00Z",
    "2024-06-11T10:00:00.Z",
    "2024-06-11T10:00Z",  # an offset needs the seconds (as Spark's cast reads them)
    "2024-06-11T10:00:00+19:00",
    "2024-06-11T10:00:00+02:60",
    "2024-06-11T24:00:00Z",
    "2024-02-30",
    "2024-06-11\n",
    "1718100000000",
    "",
]


@pytest.mark.parametrize("text", TIMESTAMPS)
def test_iso_8601_timestamps_are_read(text: str) -> None:
    assert re.fullmatch(TIMESTAMP_PATTERN, text)
    assert parse_order_text(text, TimeType.TIMESTAMP) is not None


@pytest.mark.parametrize("text", NOT_TIMESTAMPS)
def test_other_texts_are_no_timestamps(text: str) -> None:
    assert parse_order_text(text, TimeType.TIMESTAMP) is None


def test_dates_and_integers_are_read_strictly() -> None:
    assert parse_order_text("2024-06-11", TimeType.DATE) == 19885
    assert parse_order_text("0000-02-29", TimeType.DATE) == -719469  # the proleptic calendar, as Spark's
    bad_dates = ["2024-06-11T00:00:00Z", "2024-6-11", "11.06.2024", "20240611", "2023-02-29", "1900-02-29"]
    assert not any(parse_order_text(t, TimeType.DATE) is not None for t in bad_dates)
    good = {"0": 0, "-17": -17, "+42": 42, "1718100000000": 1718100000000, "9223372036854775807": 2**63 - 1}
    assert {t: parse_order_text(t, TimeType.INTEGER) for t in good} == good
    bad = ["1.5", "1e3", " 7", "", "12345678901234567890", "9223372036854775808", "٣"]
    assert not any(parse_order_text(t, TimeType.INTEGER) is not None for t in bad)


# --- where a bad text is --------------------------------------------------------------------------------


def test_the_first_json_line_holding_a_bad_text_is_found(tmp_path: Path) -> None:
    path = tmp_path / "events.json"
    lines = [
        {"k": "a", "ts": "2024-06-11T10:00:00Z"},
        {"k": "b", "ts": None},
        {"k": "c"},
        {"k": "d", "ts": "soon"},
        {"k": "e", "ts": "later"},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines[:2]) + "\n\nnot json\n" + "\n".join(
        json.dumps(line) for line in lines[2:]
    ) + "\n", encoding="utf-8")  # fmt: skip
    assert first_line_of(path, SourceFormat.JSON, "ts", {"later", "soon"}) == (6, "soon")
    assert first_line_of(path, SourceFormat.JSON, "ts", {"never"}) is None


def test_a_json_value_that_is_no_string_is_matched_by_its_json_text(tmp_path: Path) -> None:
    path = tmp_path / "events.json.gz"
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        fh.write('{"ts": "2024-06-11"}\n{"ts": 17}\n{"ts": true}\n')
    assert first_line_of(path, SourceFormat.JSON, "ts", {"true", "17"}) == (2, "17")


def test_the_first_csv_line_holding_a_bad_text_is_found_across_quoted_line_breaks(tmp_path: Path) -> None:
    path = tmp_path / "events.csv"
    path.write_text('k,note,ts\na,"two\nlines",2024-06-11\nb,x,tomorrow\n', encoding="utf-8")
    assert first_line_of(path, SourceFormat.CSV, "ts", {"tomorrow"}) == (4, "tomorrow")
    assert first_line_of(path, SourceFormat.CSV, "when", {"tomorrow"}) is None


def test_a_file_that_cannot_be_read_locates_nothing(tmp_path: Path) -> None:
    assert first_line_of(tmp_path / "gone.json", SourceFormat.JSON, "ts", {"x"}) is None
    binary = tmp_path / "binary.csv"
    binary.write_bytes(b"ts\n\xff\xfe\n")
    assert first_line_of(binary, SourceFormat.CSV, "ts", {"x"}) is None
