"""History and windowed stores in the pipeline: each key's timeline as one array, entries in time order.

`reduce_timeline` turns the keyed source into one row per raw key (as the other modes do, so routing, key
checks and the audit are the same) whose value is the key's entries, an array of struct(t, v) sorted by
time: `t` the int64 time (keyroute.storage.timeline's units), `v` the entry's JSON text (a history row; a
window's {"start", "end", "value"}). The writer explodes the arrays into one LMDB entry each, under
key part + time + the entry's index in the array (`entry_lmdb_key`).
"""

from __future__ import annotations

import csv
import enum
import gzip
import json
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import IO, Any
from urllib.parse import unquote, urlparse

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from keyroute.pipeline.columns import ORDER_TEXT, SOURCE_FILE
from keyroute.pipeline.errors import DataError, SpecError
from keyroute.pipeline.sources import INTEGRAL, quoted
from keyroute.pipeline.spec import Mode, SourceFormat, StoreSpec
from keyroute.storage.timeline import (
    DATE_PATTERN,
    INT64_MIN,
    INTEGER_PATTERN,
    TIMESTAMP_PATTERN,
    StoreKind,
    Timeline,
    TimelineError,
    TimeType,
    duration_in_units,
    java_pattern,
)

# The entries column of the reduced frame (the `value` of a timeline store's ComputedStore.frame).
ENTRIES = "__keyroute_entries"
TIME = "t"
TEXT = "v"
_WINDOW_START = "__keyroute_window_start"
_LAST_START = "__keyroute_last_window_start"


def natural_type(dtype: T.DataType) -> TimeType | None:
    """The time type a column of Spark type `dtype` is by itself; None for a text column and every other type."""
    if isinstance(dtype, (T.TimestampType, T.TimestampNTZType)):
        return TimeType.TIMESTAMP
    if isinstance(dtype, T.DateType):
        return TimeType.DATE
    if isinstance(dtype, INTEGRAL):
        return TimeType.INTEGER
    return None


def time_type_of(store: StoreSpec, dtype: T.DataType) -> TimeType:
    """The time type of the store's `order_by` column; DataError for a type a timeline cannot order by."""
    natural = natural_type(dtype)
    if natural is not None:
        return natural
    raise DataError(
        store.name,
        f"order_by column {store.order_by!r} is {dtype.simpleString()}: a {store.mode.value} store orders by a "
        "timestamp, date or integer column, or by ISO 8601 text",
    )


class Reading(enum.Enum):
    """How a timeline store's `order_by` column becomes its time."""

    AS_IS = "as is"  # a column of the time type
    TEXT = "text"  # ISO 8601 text (a timestamp or a date) or an integer's decimal text, parsed
    EPOCH_MILLIS = "epoch milliseconds"  # integers, as milliseconds since 1970-01-01T00:00:00Z
    MIDNIGHT = "midnight"  # dates, as timestamps at 00:00 UTC


# What text a time type reads (Java regular expressions, checked before Spark's lenient cast, which would take
# "2024" or a zone name too): keyroute.storage.timeline's patterns, which the live fold reads the same texts with.
TIMESTAMP_TEXT = java_pattern(TIMESTAMP_PATTERN)
DATE_TEXT = java_pattern(DATE_PATTERN)
INTEGER_TEXT = java_pattern(INTEGER_PATTERN)
_TEXT: dict[TimeType, tuple[str, T.DataType, str]] = {
    TimeType.TIMESTAMP: (
        TIMESTAMP_TEXT,
        T.TimestampType(),
        "an ISO 8601 timestamp such as 2024-06-11T10:00:00Z, 2024-06-11 12:00:00.250+02:00 or 2024-06-11",
    ),
    TimeType.DATE: (DATE_TEXT, T.DateType(), "an ISO 8601 date such as 2024-06-11"),
    TimeType.INTEGER: (INTEGER_TEXT, T.LongType(), "an integer"),
}
# At most this many of a source's bad texts are looked for in its file, and this many characters of one shown.
_BAD_TEXTS = 1_000
_SHOWN_CHARS = 100


def time_reading(
    store: StoreSpec, dtype: T.DataType, column: str | None = None, text_type: TimeType | None = None
) -> tuple[TimeType, Reading]:
    """The type `column` (default: the store's `order_by`) of Spark type `dtype` is ordered as, and how it is
    read as it: `order_by_type` when the spec declares it, else the column's own; a text column as `text_type`
    (what every value of it parses as, keyroute.pipeline.ordering) when given. DataError when they do not
    fit."""
    column = store.order_by if column is None else column
    declared = store.order_by_type
    if isinstance(dtype, T.StringType):
        return text_type or declared or TimeType.TIMESTAMP, Reading.TEXT
    natural = time_type_of(store, dtype)
    if declared is None or declared is natural:
        return natural, Reading.AS_IS
    if declared is TimeType.TIMESTAMP and natural is TimeType.INTEGER:
        return declared, Reading.EPOCH_MILLIS
    if declared is TimeType.TIMESTAMP and natural is TimeType.DATE:
        return declared, Reading.MIDNIGHT
    takes = {
        TimeType.DATE: "a date store's order_by is a date column or ISO 8601 date text such as 2024-06-11",
        TimeType.INTEGER: "an integer store's order_by is an integer column or integer text",
    }[declared]
    raise DataError(
        store.name,
        f"order_by_type is {declared.value!r} but column {column!r} of the source is {dtype.simpleString()}: {takes}",
    )


def read_times(store: StoreSpec, source: DataFrame, text_type: TimeType | None = None) -> tuple[TimeType, DataFrame]:
    """The store's time type, and the source with its `order_by` column in that type's Spark type (analysis
    only, no job). Text that does not parse becomes null, with ORDER_TEXT and SOURCE_FILE beside it to say
    which value and where (`reduce_timeline` refuses it)."""
    assert store.order_by is not None
    time_type, reading = time_reading(store, source.schema[store.order_by].dataType, text_type=text_type)
    column = quoted(store.order_by)
    if reading is Reading.AS_IS:
        return time_type, source
    if reading is Reading.EPOCH_MILLIS:
        parsed = F.timestamp_millis(column)
    elif reading is Reading.MIDNIGHT:
        parsed = column.cast(T.TimestampType())
    else:
        parsed = parsed_text(column, time_type)
        source = source.withColumn(ORDER_TEXT, column).withColumn(SOURCE_FILE, F.input_file_name())
    return time_type, source.withColumn(store.order_by, parsed)


def parsed_text(column: Column, time_type: TimeType) -> Column:
    """A text column read as `time_type`'s Spark type (timestamp, date, bigint); null where a text is not one.
    Agrees with keyroute.storage.timeline.parse_order_text, the live fold's reading, on every text."""
    pattern, spark_type, _ = _TEXT[time_type]
    return F.when(column.rlike(pattern), column.try_cast(spark_type))


def expected_text(time_type: TimeType) -> str:
    """What a text of `time_type` looks like, as messages say it."""
    return _TEXT[time_type][2]


def timeline_of(store: StoreSpec, time_type: TimeType) -> Timeline:
    """The store's Timeline (SpecError for a window or retention its time type cannot express)."""
    assert store.order_by is not None
    try:
        kind, window, advance = StoreKind.HISTORY, None, None
        if store.mode is Mode.WINDOWED:
            assert store.window is not None
            kind, window = StoreKind.WINDOWED, duration_in_units(store.window, time_type)
            advance = window if store.advance is None else duration_in_units(store.advance, time_type)
        if store.retention is not None and store.retention.duration is not None:
            duration_in_units(store.retention.duration, time_type)
        retention = None if store.retention is None else store.retention.text
        return Timeline(kind, store.order_by, time_type, window=window, advance=advance, retention=retention)
    except TimelineError as exc:
        raise SpecError(store.name, str(exc)) from None


def time_column(column: Column, time_type: TimeType) -> Column:
    """The column's times as int64 in the timeline's unit."""
    if time_type is TimeType.TIMESTAMP:
        return F.unix_micros(column.cast(T.TimestampType()))
    if time_type is TimeType.DATE:
        return F.unix_date(column).cast(T.LongType())
    return column.cast(T.LongType())


def shown_time(times: Column, time_type: TimeType) -> Column:
    """int64 times back in the column's type, for the JSON of a window's bounds."""
    if time_type is TimeType.TIMESTAMP:
        return F.timestamp_micros(times)
    if time_type is TimeType.DATE:
        return F.date_from_unix_date(times.cast(T.IntegerType()))
    return times


def reduce_timeline(
    store: StoreSpec,
    keyed: DataFrame,
    raw_key: str,
    rows: str,
    value_columns: tuple[str, ...],
    extra: Sequence[Column],
    regroup: Sequence[Column],
    timeline: Timeline,
    aggregations: Mapping[str, str] | None = None,
) -> DataFrame:
    """One row per `raw_key` with `rows` (its source records), the `extra` aggregates and ENTRIES (the
    sorted, retained entries). Windowed stores aggregate per key and window first (`aggregations`: the
    store's, as keyroute.pipeline.ordering typed their orderings); `regroup` then combines the `extra`
    aggregates of a key's windows (under the same names)."""
    assert store.order_by is not None
    time = time_column(quoted(store.order_by), timeline.time_type)
    source = keyed.withColumn(TIME, time)
    untimed = source.where(F.col(TIME).isNull() & F.col(raw_key).isNotNull())
    if ORDER_TEXT in source.columns:
        # Text that does not parse is the likelier mistake, and the one a message can point at: said first,
        # from the first file (by name) that holds some.
        bad = untimed.where(F.col(ORDER_TEXT).isNotNull())
        [found] = untimed.agg(
            F.count(F.lit(1)).alias("rows"), F.min(F.when(F.col(ORDER_TEXT).isNotNull(), F.col(SOURCE_FILE)))
        ).collect()
        if found[1] is not None:
            refuse_text(store, bad, found[1], raw_key, timeline.time_type)
        missing = found[0] > 0
    else:
        missing = untimed.limit(1).count() > 0
    if missing:
        raise DataError(store.name, f"some source rows have a null {store.order_by!r} (the time a timeline needs)")
    retention = store.retention
    if retention is not None and retention.duration is not None:
        latest = source.agg(F.max(TIME)).collect()[0][0]
        if latest is not None:
            kept = duration_in_units(retention.duration, timeline.time_type)
            source = source.where(F.col(TIME) > F.lit(max(int(latest) - kept, INT64_MIN)))
    if timeline.kind is StoreKind.HISTORY:
        row = F.to_json(F.struct(*[quoted(c) for c in value_columns]), {"ignoreNullFields": "false"})
        entry = F.struct(F.col(TIME).alias(TIME), row.alias(TEXT))
        records = F.count(F.lit(1)).alias(rows)
        reduced = source.groupBy(raw_key).agg(records, *extra, F.sort_array(F.collect_list(entry)).alias(ENTRIES))
    else:
        reduced = _windows(store, source, raw_key, rows, extra, regroup, timeline, aggregations)
    if retention is not None and retention.count is not None:
        newest = F.slice(F.sort_array(F.col(ENTRIES), asc=False), 1, retention.count)
        reduced = reduced.withColumn(ENTRIES, F.sort_array(newest))
    return reduced


def _windows(
    store: StoreSpec,
    source: DataFrame,
    raw_key: str,
    rows: str,
    extra: Sequence[Column],
    regroup: Sequence[Column],
    timeline: Timeline,
    aggregations: Mapping[str, str] | None = None,
) -> DataFrame:
    """Every window a row falls in (start <= t < start + window, starts on multiples of advance),
    aggregated per key and window, then gathered per key."""
    assert timeline.window is not None and timeline.advance is not None
    size, advance = timeline.window, timeline.advance
    t = F.col(TIME)
    last = t - F.pmod(t, F.lit(advance))
    # The earliest start s = last - n * advance with s > t - size.
    count = F.floor((last - t + F.lit(size - 1)) / F.lit(advance)).cast(T.LongType())
    first = last - count * F.lit(advance)
    placed = source.withColumn(_LAST_START, last).withColumn(
        _WINDOW_START, F.explode(F.sequence(first, last, F.lit(advance).cast(T.LongType())))
    )
    expressions = store.aggregations if aggregations is None else aggregations
    aggregated = [F.expr(expr).alias(name) for name, expr in expressions.items()]
    # Each record counted once, in its last window (hopping windows hold a record several times).
    records = F.count(F.when(F.col(_WINDOW_START) == F.col(_LAST_START), True)).alias(rows)
    windows = placed.groupBy(raw_key, _WINDOW_START).agg(records, *extra, *aggregated)
    start = F.col(_WINDOW_START)
    text = F.to_json(
        F.struct(
            shown_time(start, timeline.time_type).alias("start"),
            shown_time(start + F.lit(size), timeline.time_type).alias("end"),
            F.struct(*[quoted(name) for name in store.aggregations]).alias("value"),
        ),
        {"ignoreNullFields": "false"},
    )
    entry = F.struct(start.alias(TIME), text.alias(TEXT))
    return windows.groupBy(raw_key).agg(
        F.sum(rows).alias(rows), *regroup, F.sort_array(F.collect_list(entry)).alias(ENTRIES)
    )


# --- order_by text that does not parse --------------------------------------------------------------------


def refuse_text(
    store: StoreSpec,
    bad: DataFrame,
    file: str | None,
    raw_key: str,
    time_type: TimeType,
    column: str | None = None,
    role: str = "order_by column",
    fix: str = "",
) -> None:
    """DataError naming the column (default: `order_by`; `role` says what it is to the store), the first text
    of `file` that does not parse and its line (JSON lines and CSV files Python can open), else the file and
    the row's key, then `fix` when given. `bad` holds the texts as ORDER_TEXT and their files as SOURCE_FILE.
    Only on failure: a job or two, and a scan of the one file."""
    column = store.order_by if column is None else column
    assert column is not None
    expected = expected_text(time_type)
    in_file = bad.where(F.col(SOURCE_FILE) == F.lit(file)) if file else bad
    path = _local_path(file)
    where = None
    if path is not None and store.format in (SourceFormat.JSON, SourceFormat.CSV):
        texts = {row[0] for row in in_file.select(ORDER_TEXT).distinct().limit(_BAD_TEXTS).collect()}
        located = first_line_of(path, store.format, column, texts)
        if located is not None:
            line, text = located
            where = f"{path} line {line}"
    if where is None:
        row = in_file.select(ORDER_TEXT, raw_key).limit(1).collect()[0]
        text = row[0]
        shown_file = f"{path or file}, " if file else ""
        where = f"{shown_file}key {_shown(row[1])}"
    raise DataError(
        store.name,
        f"{role} {column!r} holds {_shown(text)} ({where}), which is not {expected}{fix}",
    )


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "…"


def _local_path(file: str | None) -> Path | None:
    """The local file a row came from (Spark names it by a file: URI), or None for other filesystems."""
    if not file:
        return None
    parsed = urlparse(file)
    if parsed.scheme not in ("", "file"):
        return None
    return Path(unquote(parsed.path))


def first_line_of(
    path: Path, source_format: SourceFormat, column: str, texts: Collection[str]
) -> tuple[int, str] | None:
    """The first line (1-based) of a JSON lines or CSV file whose `column` holds one of `texts`, and that
    text; None when the file cannot be read or none matches (as Spark reads it, a JSON value that is no string
    is its JSON text)."""
    try:
        with _open_text(path) as fh:
            if source_format is SourceFormat.JSON:
                return _first_json_line(fh, column, texts)
            return _first_csv_line(fh, column, texts)
    except (OSError, UnicodeDecodeError, csv.Error):
        return None


def _open_text(path: Path) -> IO[str]:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


def _first_json_line(fh: IO[str], column: str, texts: Collection[str]) -> tuple[int, str] | None:
    for number, line in enumerate(fh, start=1):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or record.get(column) is None:
            continue
        value = record[column]
        text = value if isinstance(value, str) else json.dumps(value)
        if text in texts:
            return number, text
    return None


def _first_csv_line(fh: IO[str], column: str, texts: Collection[str]) -> tuple[int, str] | None:
    reader = csv.reader(fh)
    header = next(reader, None)
    if header is None or column not in header:
        return None
    index = header.index(column)
    for row in reader:
        if len(row) > index and row[index] in texts:
            return reader.line_num, row[index]
    return None
