"""Per-key state with Spark: one pass that reads a store's source, reduces it to one value per key, routes
every key, caches the result and checks it.

Each step has its module: keyroute.pipeline.sources reads the source, keyroute.pipeline.reduce (or
keyroute.pipeline.timeline) reduces it, keyroute.pipeline.keys routes the keys, keyroute.pipeline.offsets
finds where a hybrid store's source ends, keyroute.pipeline.json_size bounds a row's JSON, and
keyroute.pipeline.audit checks an audited store's records. This module runs them as one pass and checks
the keys it produced.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql import types as T

from keyroute.pipeline import audit, json_size, keys, ordering, sources
from keyroute.pipeline.columns import (
    ERROR,
    KEY_BYTES,
    LMDB_KEY,
    MAX_OFFSET,
    NEWEST,
    NULL_OFFSETS,
    OFF_PARTITION,
    RAW_KEY,
    ROUTE,
    ROWS,
    STATE,
    TEXT_BYTES,
)
from keyroute.pipeline.errors import DataError
from keyroute.pipeline.keys import TEXT_SERIALIZED
from keyroute.pipeline.offsets import (
    next_offsets,
    offset_aggregates,
    partition_offset_summary,
    regroup_offset_aggregates,
    source_offset,
)
from keyroute.pipeline.reduce import check_aggregations, live_state, reduce_per_key
from keyroute.pipeline.spark_errors import spark_errors
from keyroute.pipeline.spec import StoreSpec
from keyroute.pipeline.timeline import ENTRIES, read_times, reduce_timeline, time_column, timeline_of
from keyroute.storage.timeline import Timeline, TimeType
from keyroute.storage.ttl import Ttl

_EXAMPLES = 3

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ComputedStore:
    """A store reduced to one row per key, with columns `key` (canonical text), `partition`, `value`.

    `frame` is cached; call `release()` once it has been written. `partition_rows[p]` is the number of
    keys in partition p, counted from `frame` while checking it.

    A live store whose fold keeps a merge state has a `STATE` column too (`live_value` appends it to the
    value); a hybrid store has `live_offsets[p]`, one past the greatest source offset of partition p (0
    when the source has none), i.e. the first offset of the topic its nodes apply on top.
    """

    spec: StoreSpec
    frame: DataFrame
    value_columns: tuple[str, ...]
    partition_rows: tuple[int, ...]
    live_offsets: tuple[int, ...] | None = None
    # History and windowed stores: `value` is the key's entries (keyroute.pipeline.timeline), and
    # `partition_rows` counts entries, as the files hold them.
    timeline: Timeline | None = None
    # At most this many bytes of JSON text per row, as `to_json` spells `value` (and the merge state, when
    # there is one), from the widest row's strings, counted while checking the frame; None when the value's
    # type bounds no such figure (nested types, timelines). keyroute.pipeline.writer sizes its Arrow batches
    # by it (it bounds a row of the value's struct in Arrow too: a string's JSON is at least its bytes and
    # its offset, a number's at least its width).
    json_bytes: int | None = None
    # Format-2 stores of TEXT_SERIALIZED keys (not timelines): the most bytes a key serializes to (its text's
    # UTF-8), counted while checking the frame; None when not counted. keyroute.pipeline.writer sorts the
    # rows by their key text when no key is too long to be its own LMDB key.
    key_bytes: int | None = None
    # The type each ordering column was compared as (keyroute.pipeline.ordering): a live store's fold orders
    # its records the same way.
    order_types: Mapping[str, TimeType | None] = field(default_factory=dict)

    def release(self) -> None:
        self.frame.unpersist()


@dataclass(frozen=True, slots=True)
class CheckedStore:
    """A store's source read, and every column the spec names in it checked for presence and type: schema
    inference and analysis only, no Spark job over the data. `compute_store` continues from it.

    `source` is the source as read, a timeline store's `order_by` already in its time type
    (keyroute.pipeline.timeline.read_times); `keyed` adds the raw key column and the typed values of the
    store's `orderings` (keyroute.pipeline.ordering).
    """

    spec: StoreSpec
    source: DataFrame
    keyed: DataFrame
    value_columns: tuple[str, ...]
    timeline: Timeline | None = None
    orderings: ordering.Orderings = field(default_factory=ordering.Orderings)


def check_store(spark: SparkSession, store: StoreSpec) -> CheckedStore:
    """Read the store's source and check the columns the spec names in it (the key's, the order_by's, the
    value columns, the audit's and offset columns' types, the aggregations' expressions); raise
    DataError/SpecError naming the store. Only schema inference (json/csv) reads data, and for a text
    column that orders rows one job that checks (or finds) the type of its values."""
    with spark_errors(store.name, "checking the store's source"):
        source = sources.read_source(spark, store)
        value_columns = sources.value_columns_of(store, source.columns)
        raw_key = keys.raw_key_column(store, source.schema[store.key].dataType)
        audit.source_partition(store, source.schema)
        source_offset(store, source.schema)
        timeline = None
        if store.mode.timeline:
            text_type = ordering.timeline_text_type(store, source.withColumn(RAW_KEY, raw_key))
            time_type, source = read_times(store, source, text_type)
            timeline = timeline_of(store, time_type)
        keyed, orderings = ordering.type_orderings(store, source.withColumn(RAW_KEY, raw_key))
        if store.aggregations:
            check_aggregations(store, keyed.groupBy(RAW_KEY))
    return CheckedStore(store, source, keyed, value_columns, timeline, orderings)


def compute_store(
    spark: SparkSession, store: StoreSpec, checked: CheckedStore | None = None, now_s: float | None = None
) -> ComputedStore:
    """Read, check, reduce and route one store; raise DataError/SpecError naming the store on any problem.
    `checked` is the store's `check_store`, when the caller checked it already. A store with a `ttl` leaves
    out the rows expired at `now_s` (seconds since the epoch; the build's clock, default now): `unexpired`.

    Spark jobs on the happy path: schema inference (json/csv) and one pass that reduces, routes, caches
    and checks every key (and, for an audited store, every record's source partition). Writing is the next
    pass, over the cache. A failed audit costs a few more jobs, to count and sample the misplaced records.
    """
    if checked is None:
        checked = check_store(spark, store)
    with spark_errors(store.name, "computing the store"):
        source, keyed, value_columns = checked.source, checked.keyed, checked.value_columns
        orderings = checked.orderings
        source_partition = audit.source_partition(store, source.schema)
        audited = source_partition is not None
        extra = [] if source_partition is None else audit.key_aggregates(source_partition)
        offset = source_offset(store, source.schema)
        extra += offset_aggregates(offset)
        timeline = checked.timeline
        if store.ttl is not None and offset is None:
            keyed = unexpired(store, keyed, orderings, timeline, time.time() if now_s is None else now_s)
        if timeline is not None:
            regroup = audit.regroup_key_aggregates() if audited else []
            if offset is not None:  # a windowed store's windows of a key, combined
                regroup += regroup_offset_aggregates()
            reduced = reduce_timeline(
                store, keyed, RAW_KEY, ROWS, value_columns, extra, regroup, timeline, orderings.aggregations
            )
            value = F.col(ENTRIES)
        else:
            reduced, value = reduce_per_key(store, keyed, value_columns, extra, offset, orderings)
        state = live_state(store)
        partition = F.col(ROUTE).getField("partition")
        value_type = reduced.select(value.alias("value")).schema["value"].dataType
        bounded = store.snapshot_format != 1 and timeline is None and json_size.json_bounded(value_type)
        text_bytes = [json_size.row_text_bytes(value_type, state is not None).alias(TEXT_BYTES)] if bounded else []
        routed = (
            reduced.select(
                F.col(RAW_KEY),
                F.col(ROWS),
                keys.route_step(store, F.col(RAW_KEY)).alias(ROUTE),
                value.alias("value"),
                *[F.col(name) for name in (audit.KEY_COLUMNS if audited else ())],
                *([] if state is None else [state.alias(STATE)]),
                *([] if offset is None else [F.col(MAX_OFFSET), F.col(NULL_OFFSETS)]),
            )
            .select(
                F.col(RAW_KEY),
                F.col(ROWS),
                F.col(ROUTE).getField("key").alias("key"),
                partition.alias("partition"),
                F.col(ROUTE).getField("error").alias(ERROR),
                *([F.col(ROUTE).getField("lmdb_key").alias(LMDB_KEY)] if keys.routes_lmdb_key(store) else []),
                F.col("value"),
                *([audit.key_off_partition(partition).alias(OFF_PARTITION)] if audited else []),
                *([] if state is None else [F.col(STATE)]),
                *([] if offset is None else [F.col(MAX_OFFSET), F.col(NULL_OFFSETS)]),
                *text_bytes,
            )
            .persist(StorageLevel.MEMORY_AND_DISK)
        )
        try:
            counted = _check_keys(store, routed, audited, offset is not None, timeline is not None)
            if source_partition is not None:
                _audit(store, keyed, source_partition, counted)
        except BaseException:
            routed.unpersist()
            raise
    return ComputedStore(
        spec=store,
        frame=routed,
        value_columns=value_columns,
        partition_rows=counted.partition_rows,
        live_offsets=counted.offsets,
        timeline=timeline,
        json_bytes=counted.json_bytes,
        key_bytes=counted.key_bytes,
        order_types=orderings.types(),
    )


def unexpired(
    store: StoreSpec, keyed: DataFrame, orderings: ordering.Orderings, timeline: Timeline | None, now_s: float
) -> DataFrame:
    """`keyed` without the rows a node would not serve at `now_s` for the store's `ttl`
    (keyroute.storage.ttl), at the node's boundary (`Ttl.timeline_low`, in the time's own unit): a history
    store's rows whose time is no later than now - ttl (a row without a time is kept: the build refuses it
    later); a latest store's key whose latest `order_by` is, all its rows (a key whose rows all lack a time is
    kept: a node cannot age its value), and older rows of the others, which the latest row wins over anyway.
    Not applied to a store built with source offsets (a live store's hybrid build: its offsets come from every
    row): the nodes serving it leave its expired values out of answers."""
    assert store.ttl is not None and store.order_by is not None
    ttl = Ttl.parse(store.ttl, store.order_by)
    column = sources.quoted(store.order_by)
    if timeline is not None:
        times = time_column(column, timeline.time_type)
        return keyed.where(times.isNull() | (times >= F.lit(ttl.timeline_low(now_s, timeline.time_type))))
    typed = orderings.columns.get(store.order_by)
    if typed is None:
        return keyed
    if typed.value is None or typed.time_type is None:
        # A number compared as it is: a node reads it as milliseconds since the epoch.
        served = column.cast(T.DoubleType()) > F.lit(ttl.cutoff_us(now_s) / 1000)
        times = column
    else:
        times = F.col(typed.value)
        served = times >= F.lit(ttl.timeline_low(now_s, typed.time_type))
    newest = F.max(times).over(Window.partitionBy(F.col(RAW_KEY)))
    return keyed.withColumn(NEWEST, newest).where(served | F.col(NEWEST).isNull()).drop(NEWEST)


def _audit(store: StoreSpec, keyed: DataFrame, source_partition: Column, checked: _CheckedKeys) -> None:
    """Raise PartitionAuditError when some record of the source is not in its key's partition."""
    if checked.keys_off_partition:
        computed = keys.partition_column(store, F.col(RAW_KEY))
        findings = audit.find_mismatches(store, keyed, F.col(RAW_KEY), source_partition, computed)
        raise audit.fail(store, findings)
    log.info(
        "store %r: partitioner audit passed: all %d records are in the partition %s assigns (column %r)",
        store.name,
        checked.records,
        store.partitioner.value,
        store.source_partition_column,
    )


@dataclass(frozen=True, slots=True)
class _CheckedKeys:
    partition_rows: tuple[int, ...]  # keys per partition
    records: int  # source records
    keys_off_partition: int  # audited stores: keys with a record outside the key's partition
    offsets: tuple[int, ...] | None = None  # hybrid stores: one past each partition's greatest offset
    json_bytes: int | None = None  # ComputedStore.json_bytes
    key_bytes: int | None = None  # ComputedStore.key_bytes


def _check_keys(
    store: StoreSpec, routed: DataFrame, audited: bool, offsets: bool = False, entries: bool = False
) -> _CheckedKeys:
    """Keys per partition; DataError for null keys, keys that do not fit the format, or duplicate keys.

    One job summarises the whole frame per partition. Equal keys land in the same partition, so a
    partition holding fewer distinct keys than rows holds a duplicate; rows that could not be routed
    (null or malformed keys) have no partition. Examples are fetched only when something is wrong.
    """
    off_partition = F.count(F.when(F.col(OFF_PARTITION), True)) if audited else F.lit(0)
    value_type = routed.schema["value"].dataType
    bounded = TEXT_BYTES in routed.columns
    longest = [F.max(TEXT_BYTES).alias(TEXT_BYTES)] if bounded else []
    # The key text's UTF-8 is the serialized key of these formats (what their LMDB keys are made of).
    key_bytes = not entries and store.snapshot_format != 1 and store.key_format in TEXT_SERIALIZED
    if key_bytes:
        longest.append(F.max(F.octet_length(F.col("key"))).alias(KEY_BYTES))
    # A partition's greatest offset is over its keys' records; the audit proves they are the partition's.
    offset_summary = partition_offset_summary()
    summary = (
        routed.groupBy("partition")
        .agg(
            F.count(F.lit(1)).alias("rows"),
            F.count_distinct("key").alias("distinct"),
            F.sum(F.when(F.col(RAW_KEY).isNull(), F.col(ROWS))).alias("null_rows"),
            F.count(F.when(F.col(RAW_KEY).isNotNull() & F.col(ERROR).isNotNull(), True)).alias("bad"),
            F.sum(ROWS).alias("records"),
            off_partition.alias("off_partition"),
            *(offset_summary if offsets else []),
            # A timeline store's files hold one entry per element of its keys' entries.
            *([F.sum(F.size(F.col("value"))).alias("entries")] if entries else []),
            *longest,
        )
        .collect()
    )
    null_rows = sum(row["null_rows"] or 0 for row in summary)
    if null_rows:
        raise DataError(
            store.name,
            f"{null_rows} source row(s) have a null key (column {store.key!r}); every row needs a key",
        )
    bad = sum(row["bad"] for row in summary)
    if bad:
        _raise_bad_keys(store, routed, bad)
    if any(row["rows"] != row["distinct"] for row in summary if row["partition"] is not None):
        _raise_duplicate_keys(store, routed)
    counted = "entries" if entries else "rows"
    counts = {int(row["partition"]): int(row[counted] or 0) for row in summary if row["partition"] is not None}
    return _CheckedKeys(
        partition_rows=tuple(counts.get(p, 0) for p in range(store.partitions)),
        records=sum(row["records"] or 0 for row in summary),
        keys_off_partition=sum(row["off_partition"] for row in summary),
        offsets=next_offsets(store, summary) if offsets else None,
        json_bytes=json_size.json_bytes(value_type, max((int(row[TEXT_BYTES] or 0) for row in summary), default=0))
        if bounded
        else None,
        key_bytes=max((int(row[KEY_BYTES] or 0) for row in summary), default=0) if key_bytes else None,
    )


def _raise_bad_keys(store: StoreSpec, routed: DataFrame, count: int) -> None:
    bad = routed.where(F.col(RAW_KEY).isNotNull() & F.col(ERROR).isNotNull())
    examples = [row[0] for row in bad.select(ERROR).orderBy(ERROR).limit(_EXAMPLES).collect()]
    raise DataError(
        store.name,
        f"{count} key(s) in column {store.key!r} do not fit key format {store.key_format.value}, "
        f"e.g.: {'; '.join(examples)}",
    )


def _raise_duplicate_keys(store: StoreSpec, routed: DataFrame) -> None:
    """Two source keys that serialize to the same bytes (e.g. a uuid in two cases) would be one key."""
    spellings = F.sort_array(F.collect_set(F.col(RAW_KEY).cast(T.StringType())))
    duplicates = (
        routed.where(F.col("key").isNotNull())
        .groupBy("key")
        .agg(F.count(F.lit(1)).alias("n"), spellings.alias("spellings"))
        .where(F.col("n") > 1)
    )
    count = duplicates.count()
    examples = [
        f"{row['key']!r} from {', '.join(repr(s) for s in row['spellings'])}"
        for row in duplicates.orderBy("key").limit(_EXAMPLES).collect()
    ]
    raise DataError(
        store.name,
        f"{count} key(s) in column {store.key!r} are spelled several ways that are the same "
        f"{store.key_format.value} key, e.g.: {'; '.join(examples)}",
    )
