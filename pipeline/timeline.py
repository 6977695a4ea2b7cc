"""History and windowed stores in the pipeline: each key's timeline as one array, entries in time order.

`reduce_timeline` turns the keyed source into one row per raw key (as the other modes do, so routing, key
checks and the audit are the same) whose value is the key's entries, an array of struct(t, v) sorted by
time: `t` the int64 time (keyroute.core.timeline's units), `v` the entry's JSON text (a history row; a
window's {"start", "end", "value"}). The writer explodes the arrays into one LMDB entry each, under
key part + time + the entry's index in the array (`entry_lmdb_key`).
"""

from __future__ import annotations

from collections.abc import Sequence

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from keyroute.core.timeline import (
    INT64_MIN,
    StoreKind,
    Timeline,
    TimelineError,
    TimeType,
    duration_in_units,
)
from keyroute.pipeline.errors import DataError, SpecError
from keyroute.pipeline.sources import INTEGRAL, quoted
from keyroute.pipeline.spec import Mode, StoreSpec

# The entries column of the reduced frame (the `value` of a timeline store's ComputedStore.frame).
ENTRIES = "__keyroute_entries"
TIME = "t"
TEXT = "v"
_WINDOW_START = "__keyroute_window_start"
_LAST_START = "__keyroute_last_window_start"


def time_type_of(store: StoreSpec, dtype: T.DataType) -> TimeType:
    """The time type of the store's `order_by` column; DataError for a type a timeline cannot order by."""
    if isinstance(dtype, (T.TimestampType, T.TimestampNTZType)):
        return TimeType.TIMESTAMP
    if isinstance(dtype, T.DateType):
        return TimeType.DATE
    if isinstance(dtype, INTEGRAL):
        return TimeType.INTEGER
    raise DataError(
        store.name,
        f"order_by column {store.order_by!r} is {dtype.simpleString()}: a {store.mode.value} store orders by a "
        "timestamp, date or integer column",
    )


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
) -> DataFrame:
    """One row per `raw_key` with `rows` (its source records), the `extra` aggregates and ENTRIES (the
    sorted, retained entries). Windowed stores aggregate per key and window first; `regroup` then combines
    the `extra` aggregates of a key's windows (under the same names)."""
    assert store.order_by is not None
    time = time_column(quoted(store.order_by), timeline.time_type)
    source = keyed.withColumn(TIME, time)
    nulls = source.where(F.col(TIME).isNull() & F.col(raw_key).isNotNull()).limit(1).count()
    if nulls:
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
        reduced = _windows(store, source, raw_key, rows, extra, regroup, timeline)
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
    aggregated = [F.expr(expr).alias(name) for name, expr in store.aggregations.items()]
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
