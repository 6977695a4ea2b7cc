"""Per-key state with Spark: read a store's source, reduce it to one value per key, route every key.

Routing (canonical key text and partition) runs in the shared core's own code, through an Arrow UDF; keys
are serialized a whole batch at a time as well. An audited store's records are checked in the same pass.
A live store's values also carry the merge state its nodes fold the topic's records into (keyroute.core.live),
and a hybrid store's pass finds where its source ends in each topic partition.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from py4j.protocol import Py4JError
from pyspark import StorageLevel
from pyspark.errors import PySparkException
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from keyroute.core.key_format import KeyFormat, KeyFormatError, key_from_value
from keyroute.core.live import Aggregate
from keyroute.core.lmdb_layout import LMDB_MAX_KEY_BYTES, TAG_HASHED, TAG_KEY, db_keys
from keyroute.core.partition_vectorized import partitions as vectorized_partitions
from keyroute.core.partitioner import Partitioner
from keyroute.core.timeline import Timeline, key_parts
from keyroute.pipeline import audit
from keyroute.pipeline.errors import DataError, PipelineError, SpecError
from keyroute.pipeline.lmdb_files import is_text
from keyroute.pipeline.spec import Mode, SourceFormat, StoreSpec
from keyroute.pipeline.timeline import ENTRIES, reduce_timeline, time_type_of, timeline_of

# Internal column names, chosen so they cannot meet a source column by accident.
RAW_KEY = "__keyroute_raw_key"
ERROR = "__keyroute_key_error"
_ROWS = "__keyroute_rows"
_ORDER = "__keyroute_order"
_LATEST = "__keyroute_latest"
_ROUTE = "__keyroute_route"
_OFF_PARTITION = "__keyroute_off_partition"
# Live stores (see "live stores" below).
STATE = "__keyroute_live_state"  # the merge state as a JSON object {"0": ..., "1": ...}, in merge order
_TIE = "__keyroute_tie"
_MAX_OFFSET = "__keyroute_max_offset"
_NULL_OFFSETS = "__keyroute_null_offsets"
_STATE_FIELD = "__keyroute_state_{}"

ROUTE_TYPE = T.StructType(
    [
        T.StructField("key", T.StringType()),
        T.StructField("partition", T.IntegerType()),
        T.StructField("error", T.StringType()),
    ]
)
# A format-2 store's route also carries each key's LMDB key (keyroute.core.lmdb_layout.db_key of the very
# bytes its partition was computed from): the writer sorts by it and the executors store it as it is.
LMDB_KEY = "__keyroute_lmdb_key"
ROUTE_TYPE_WITH_LMDB_KEY = T.StructType([*ROUTE_TYPE.fields, T.StructField("lmdb_key", T.BinaryType())])
# Key formats whose serialized bytes are the canonical text's UTF-8 (Kafka's String and UUID serializers):
# the writer makes their LMDB keys in the JVM (text_lmdb_key_column), the route UDF does not return them.
TEXT_SERIALIZED = frozenset({KeyFormat.STRING, KeyFormat.UUID})

# Kafka's Short/Integer/LongSerializer widths, as in key_format.
_INT_WIDTHS = {KeyFormat.INT16: 2, KeyFormat.INT32: 4, KeyFormat.INT64: 8}
_INT_FORMATS = frozenset(_INT_WIDTHS)
_INT_BOUNDS = {fmt: (-(1 << (8 * n - 1)), (1 << (8 * n - 1)) - 1) for fmt, n in _INT_WIDTHS.items()}
# key_format's syntax checks in RE2, for Arrow's kernels: the same ASCII-only classes, anchored at both ends.
_DECIMAL_PATTERN = r"^-?[0-9]+$"
_UUID_PATTERN = r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"
_INTEGRAL = (T.ByteType, T.ShortType, T.IntegerType, T.LongType)
_EXAMPLES = 3
_SPARK_MESSAGE_CHARS = 400

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

    def release(self) -> None:
        self.frame.unpersist()


@dataclass(frozen=True, slots=True)
class SerializedKeys:
    """A batch of raw keys in Kafka's serialized form; each entry has either data and text, or an error."""

    data: pa.Array  # binary: the bytes the producer's serializer wrote, i.e. what is hashed; null on error
    text: pa.Array  # string: the canonical text; null on error
    error: pa.Array  # string: why the key does not fit the key format; null when it does


def serialize_keys(keys: pa.Array | pa.ChunkedArray, key_format: KeyFormat) -> SerializedKeys:
    """Serialize a batch of raw keys (as `_raw_key` types them) exactly as `key_from_value` does, key for key.

    Batches of well-formed string, integer and uuid keys are serialized by Arrow and NumPy kernels; any other
    batch (bytes keys, or one holding a key that does not fit, which fails the build anyway) key by key.
    """
    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks()
    return _serialize_vectorized(keys, key_format) or _serialize_per_key(keys, key_format)


def route_keys(
    keys: pa.Array,
    key_format: KeyFormat,
    partitioner: Partitioner,
    partitions: int,
    lmdb_key: bool = False,
    timeline: bool = False,
) -> pa.StructArray:
    """Canonical text and partition for a batch of raw keys; a key that does not fit gets an error instead.
    With `lmdb_key`, also the LMDB key the node stores it under (`db_key` of the serialized bytes the
    partition was computed from; null for a key that does not fit), or with `timeline` the key part of its
    entries' LMDB keys (keyroute.core.timeline.key_part).

    Errors are returned, not raised: the driver reports how many keys failed, with examples, rather than
    the first worker traceback.
    """
    serialized = serialize_keys(keys, key_format)
    arrays = [serialized.text, _partitions(serialized.data, partitioner, partitions), serialized.error]
    names = ["key", "partition", "error"]
    if lmdb_key:
        arrays.append(key_parts(serialized.data) if timeline else db_keys(serialized.data))
        names.append("lmdb_key")
    return pa.StructArray.from_arrays(arrays, names=names)


def key_partitions(keys: pa.Array, key_format: KeyFormat, partitioner: Partitioner, partitions: int) -> pa.Array:
    """The partition of every raw key as int32, null for a key that does not fit (the audit's record UDF)."""
    return _partitions(serialize_keys(keys, key_format).data, partitioner, partitions)


def _partitions(data: pa.Array, partitioner: Partitioner, partitions: int) -> pa.Array:
    if not data.null_count:
        return pa.array(vectorized_partitions(partitioner, data, partitions), pa.int32())
    missing = data.is_null().to_numpy(zero_copy_only=False)
    parts = np.zeros(len(data), dtype=np.int32)
    present = data.drop_null()
    if len(present):
        parts[~missing] = vectorized_partitions(partitioner, present, partitions)
    return pa.array(parts, pa.int32(), mask=missing)


def _serialize_vectorized(keys: pa.Array, key_format: KeyFormat) -> SerializedKeys | None:
    """The batch serialized by Arrow/NumPy kernels, or None when it needs `key_from_value` key by key."""
    kind = keys.type
    if key_format is KeyFormat.STRING and is_text(kind):
        # Arrow strings are valid UTF-8, i.e. already the serialized key: the same buffers, seen as bytes.
        binary = pa.large_binary() if pa.types.is_large_string(kind) else pa.binary()
        return SerializedKeys(keys.view(binary), keys.cast(pa.string()), _null_key_errors(keys, key_format))
    if key_format in _INT_WIDTHS:
        numbers = _whole_numbers(keys, key_format)
        if numbers is None:
            return None
        return SerializedKeys(
            _big_endian(numbers, _INT_WIDTHS[key_format]),
            pc.cast(numbers, pa.string()),  # decimal, as str(int): "007" was read as 7 and reads "7"
            _null_key_errors(keys, key_format),
        )
    if key_format is KeyFormat.UUID and is_text(kind) and _all_match(keys, _UUID_PATTERN):
        # Kafka's UUIDSerializer writes the lowercase text; the pattern admits ASCII only.
        text = pc.ascii_lower(keys.cast(pa.string()))
        return SerializedKeys(text.view(pa.binary()), text, _null_key_errors(keys, key_format))
    return None


def _whole_numbers(keys: pa.Array, key_format: KeyFormat) -> pa.Array | None:
    """Integer keys, or strict decimal text, as int64 when every one fits the format; else None."""
    kind = keys.type
    if is_text(kind):
        if not _all_match(keys, _DECIMAL_PATTERN):
            return None
    elif not pa.types.is_integer(kind):
        return None
    try:
        numbers = pc.cast(keys, pa.int64())  # checked: text beyond 64 bits raises rather than wraps
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    low, high = _INT_BOUNDS[key_format]
    bounds = pc.min_max(numbers)
    least, greatest = bounds["min"].as_py(), bounds["max"].as_py()
    if least is not None and not low <= least <= greatest <= high:
        return None
    return numbers


def _big_endian(numbers: pa.Array, width: int) -> pa.Array:
    """int64 values as `width`-byte big-endian two's complement, one binary value each (null stays null)."""
    count = len(numbers)
    values = numbers.fill_null(0).to_numpy()
    # The low `width` bytes of the big-endian int64 are the value's `width`-byte two's complement.
    data = np.ascontiguousarray(values.astype(">i8").view(np.uint8).reshape(count, 8)[:, 8 - width :])
    offsets = np.arange(0, (count + 1) * width, width, dtype=np.int32)
    validity = pc.is_valid(numbers).buffers()[1] if numbers.null_count else None
    return pa.Array.from_buffers(
        pa.binary(),
        count,
        [validity, pa.py_buffer(offsets), pa.py_buffer(data)],
        null_count=numbers.null_count,
    )


def _all_match(keys: pa.Array, pattern: str) -> bool:
    """Whether every non-null key matches `pattern` (RE2 syntax, anchored)."""
    return bool(pc.all(pc.match_substring_regex(keys, pattern)).as_py() is not False)


def _null_key_errors(keys: pa.Array, key_format: KeyFormat) -> pa.Array:
    if not keys.null_count:
        return pa.nulls(len(keys), pa.string())
    # key_from_value's message for a null key.
    message = pa.scalar(f"null key ({key_format.value} keys cannot be null)", pa.string())
    return pc.if_else(keys.is_null(), message, pa.scalar(None, pa.string()))


def _serialize_per_key(keys: pa.Array, key_format: KeyFormat) -> SerializedKeys:
    texts: list[str | None] = []
    datas: list[bytes | None] = []
    errors: list[str | None] = []
    # to_pylist gives exact Python ints/str/bytes: no float detour for int64 keys.
    for value in keys.to_pylist():
        try:
            key = key_from_value(key_format, value)
        except KeyFormatError as exc:
            texts.append(None)
            datas.append(None)
            errors.append(str(exc))
            continue
        texts.append(key.text)
        datas.append(key.data)
        errors.append(None)
    return SerializedKeys(pa.array(datas, pa.binary()), pa.array(texts, pa.string()), pa.array(errors, pa.string()))


def _router(store: StoreSpec) -> Any:
    key_format, partitioner, partitions = store.key_format, store.partitioner, store.partitions
    timeline = store.mode.timeline
    lmdb_key = store.snapshot_format != 1 and (timeline or key_format not in TEXT_SERIALIZED)

    def route(keys: pa.Array) -> pa.Array:
        return route_keys(keys, key_format, partitioner, partitions, lmdb_key, timeline)

    # arrow_udf: whole Arrow batches in and out, no pandas in between (a scalar Arrow UDF, Spark >= 4.1).
    # The kind is read from the type hints; pyspark's stubs insist on functionType, which it warns about.
    return F.arrow_udf(route, ROUTE_TYPE_WITH_LMDB_KEY if lmdb_key else ROUTE_TYPE)  # type: ignore[call-overload]


def _partition_udf(store: StoreSpec) -> Any:
    key_format, partitioner, partitions = store.key_format, store.partitioner, store.partitions

    def partition(keys: pa.Array) -> pa.Array:
        return key_partitions(keys, key_format, partitioner, partitions)

    return F.arrow_udf(partition, T.IntegerType())  # type: ignore[call-overload]


def lmdb_keys(
    keys: pa.Array,
    parts: pa.Array,
    key_format: KeyFormat,
    partitioner: Partitioner,
    partitions: int,
    verify: bool = True,
) -> pa.Array:
    """The LMDB key (`db_key`) of every canonical key text, or null for a key that does not parse or (with
    `verify`) whose serialized bytes do not hash to its row's partition: such a row must never be written."""
    data = serialize_keys(keys, key_format).data
    if verify:
        placed = _partitions(data, partitioner, partitions)
        fits = pc.fill_null(pc.equal(placed, pc.cast(parts, pa.int32())), False)
    else:
        fits = pc.is_valid(data)
    return pc.if_else(fits, db_keys(data), pa.scalar(None, pa.binary()))


def lmdb_key_column(store: StoreSpec, key: Column, partition: Column) -> Column:
    """`lmdb_keys` in an Arrow UDF: the canonical `key` text serialized again with the store's key format,
    checked against `partition`, and laid out as the node's LMDB key (binary, ordered as LMDB orders it).

    The partition check is left out only while a benchmark has swapped `route_step` for one that places
    keys by another hash (`unhashed_route_column`): then no key is where the partitioner puts it.
    """
    key_format, partitioner, partitions = store.key_format, store.partitioner, store.partitions
    verify = route_step is route_column

    def lmdb_key(keys: pa.Array, parts: pa.Array) -> pa.Array:
        return lmdb_keys(keys, parts, key_format, partitioner, partitions, verify)

    return F.arrow_udf(lmdb_key, T.BinaryType())(key, partition)  # type: ignore[call-overload]


def route_column(store: StoreSpec, raw_key: Column) -> Column:
    """struct(key, partition, error) for every raw key: `route_keys` in an Arrow UDF on Spark's workers."""
    return _router(store)(raw_key)


def unhashed_route_column(store: StoreSpec, raw_key: Column) -> Column:
    """FOR BENCHMARKS ONLY: `route_column` without the partition step (no Python UDF, no Kafka hash).

    Keys keep their text and are spread over the store's partitions by Spark's own JVM hash, so the write
    stays as parallel as a real build's; no producer would agree with these partitions.
    """
    placed = F.pmod(F.hash(raw_key), F.lit(store.partitions)).cast(T.IntegerType())
    return F.struct(
        raw_key.cast(T.StringType()).alias("key"),
        placed.alias("partition"),
        F.lit(None).cast(T.StringType()).alias("error"),
    )


def text_lmdb_key_column(key: Column) -> Column:
    """The LMDB key (`db_key`) of a TEXT_SERIALIZED store's canonical `key` text, made by the JVM: the text's
    UTF-8 bytes as Spark holds them (a cast to binary copies them unchanged: the very bytes the route UDF
    received as Arrow strings and computed the partition from), tagged, or hashed when too long for LMDB."""
    data = key.cast(T.BinaryType())
    return F.when(F.length(data) < LMDB_MAX_KEY_BYTES, F.concat(F.lit(bytearray(TAG_KEY)), data)).otherwise(
        F.concat(F.lit(bytearray(TAG_HASHED)), F.unhex(F.sha2(data, 256)))
    )


def _routes_lmdb_key(store: StoreSpec) -> bool:
    """Whether compute_store's frame has the LMDB key column (format 2, routed by `route_column`, keys whose
    serialized bytes are not their text's UTF-8)."""
    return (
        store.snapshot_format != 1
        and (store.mode.timeline or store.key_format not in TEXT_SERIALIZED)
        and route_step is route_column
    )


# Internal hook, not a spec option: how compute_store routes keys. Only benchmarks/pipeline.py replaces it
# (with unhashed_route_column), to time the same build with and without the partition step.
route_step: Callable[[StoreSpec, Column], Column] = route_column


def compute_store(spark: SparkSession, store: StoreSpec) -> ComputedStore:
    """Read, check, reduce and route one store; raise DataError/SpecError naming the store on any problem.

    Spark jobs on the happy path: schema inference (json/csv) and one pass that reduces, routes, caches
    and checks every key (and, for an audited store, every record's source partition). Writing is the next
    pass, over the cache. A failed audit costs a few more jobs, to count and sample the misplaced records.
    """
    with spark_errors(store.name, "computing the store"):
        source = _read_source(spark, store)
        value_columns = _check_columns(store, source.columns)
        keyed = source.withColumn(RAW_KEY, _raw_key(store, source.schema[store.key].dataType))
        source_partition = audit.source_partition(store, source.schema)
        audited = source_partition is not None
        extra = [] if source_partition is None else audit.key_aggregates(source_partition)
        offset = _source_offset(store, source.schema)
        extra += _offset_aggregates(offset)
        timeline = None
        if store.mode.timeline:
            assert store.order_by is not None
            timeline = timeline_of(store, time_type_of(store, source.schema[store.order_by].dataType))
            if store.order_by_type is not None and store.order_by_type is not timeline.time_type:
                raise DataError(
                    store.name,
                    f"order_by_type is {store.order_by_type.value!r} but column {store.order_by!r} of the source "
                    f"is a {timeline.time_type.value}",
                )
            regroup = audit.regroup_key_aggregates() if audited else []
            if offset is not None:  # a windowed store's windows of a key, combined
                regroup += [F.max(_MAX_OFFSET).alias(_MAX_OFFSET), F.sum(_NULL_OFFSETS).alias(_NULL_OFFSETS)]
            reduced = reduce_timeline(store, keyed, RAW_KEY, _ROWS, value_columns, extra, regroup, timeline)
            value = F.col(ENTRIES)
        else:
            reduced, value = _reduce(store, keyed, value_columns, extra, offset)
        state = live_state(store)
        partition = F.col(_ROUTE).getField("partition")
        value_type = reduced.select(value.alias("value")).schema["value"].dataType
        bounded = store.snapshot_format != 1 and timeline is None and _json_bounded(value_type)
        text_bytes = [_row_text_bytes(value_type, state is not None).alias(_TEXT_BYTES)] if bounded else []
        routed = (
            reduced.select(
                F.col(RAW_KEY),
                F.col(_ROWS),
                route_step(store, F.col(RAW_KEY)).alias(_ROUTE),
                value.alias("value"),
                *[F.col(name) for name in (audit.KEY_COLUMNS if audited else ())],
                *([] if state is None else [state.alias(STATE)]),
                *([] if offset is None else [F.col(_MAX_OFFSET), F.col(_NULL_OFFSETS)]),
            )
            .select(
                F.col(RAW_KEY),
                F.col(_ROWS),
                F.col(_ROUTE).getField("key").alias("key"),
                partition.alias("partition"),
                F.col(_ROUTE).getField("error").alias(ERROR),
                *([F.col(_ROUTE).getField("lmdb_key").alias(LMDB_KEY)] if _routes_lmdb_key(store) else []),
                F.col("value"),
                *([audit.key_off_partition(partition).alias(_OFF_PARTITION)] if audited else []),
                *([] if state is None else [F.col(STATE)]),
                *([] if offset is None else [F.col(_MAX_OFFSET), F.col(_NULL_OFFSETS)]),
                *text_bytes,
            )
            .persist(StorageLevel.MEMORY_AND_DISK)
        )
        try:
            checked = _check_keys(store, routed, audited, offset is not None, timeline is not None)
            if source_partition is not None:
                _audit(store, keyed, source_partition, checked)
        except BaseException:
            routed.unpersist()
            raise
    return ComputedStore(
        spec=store,
        frame=routed,
        value_columns=value_columns,
        partition_rows=checked.partition_rows,
        live_offsets=checked.offsets,
        timeline=timeline,
        json_bytes=checked.json_bytes,
        key_bytes=checked.key_bytes,
    )


def _audit(store: StoreSpec, keyed: DataFrame, source_partition: Column, checked: _CheckedKeys) -> None:
    """Raise PartitionAuditError when some record of the source is not in its key's partition."""
    if checked.keys_off_partition:
        computed = _partition_udf(store)(F.col(RAW_KEY))
        findings = audit.find_mismatches(store, keyed, F.col(RAW_KEY), source_partition, computed)
        raise audit.fail(store, findings)
    log.info(
        "store %r: partitioner audit passed: all %d records are in the partition %s assigns (column %r)",
        store.name,
        checked.records,
        store.partitioner.value,
        store.source_partition_column,
    )


@contextmanager
def spark_errors(store: str, doing: str, error: type[PipelineError] = DataError) -> Iterator[None]:
    """Turn Spark's and py4j's exceptions into `error` naming the store, with Spark's first line."""
    try:
        yield
    except (PySparkException, Py4JError) as exc:
        raise error(store, f"Spark failed while {doing}: {spark_message(exc)}") from exc


def spark_message(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= _SPARK_MESSAGE_CHARS else text[:_SPARK_MESSAGE_CHARS] + "…"


def _read_source(spark: SparkSession, store: StoreSpec) -> DataFrame:
    frame = _read(spark, store)
    if not frame.columns:  # only empty files: Spark infers a schema of no columns rather than failing
        raise DataError(store.name, _no_data(store))
    return frame


def _no_data(store: StoreSpec) -> str:
    return f"source {store.source!r} holds no {store.format.value} data (no files, or only empty ones)"


def _read(spark: SparkSession, store: StoreSpec) -> DataFrame:
    try:
        if store.format is SourceFormat.JSON:
            return spark.read.json(store.source, mode="FAILFAST")
        if store.format is SourceFormat.CSV:
            inferred = spark.read.csv(store.source, header=True, inferSchema=True, mode="FAILFAST")
            if store.key not in inferred.columns:
                return inferred
            # Inference would turn key "007" into 7: the key column is read as written, and checked later.
            schema = T.StructType(
                [
                    T.StructField(f.name, T.StringType(), True) if f.name == store.key else f
                    for f in inferred.schema.fields
                ]
            )
            return spark.read.schema(schema).csv(store.source, header=True, mode="FAILFAST")
        return spark.read.parquet(store.source)
    except PySparkException as exc:
        condition = exc.getCondition()
        if condition == "PATH_NOT_FOUND":
            raise DataError(store.name, f"source {store.source!r} does not exist") from exc
        if condition == "UNABLE_TO_INFER_SCHEMA":
            raise DataError(store.name, _no_data(store)) from exc
        raise DataError(
            store.name, f"cannot read {store.format.value} source {store.source!r}: {spark_message(exc)}"
        ) from exc


def _check_columns(store: StoreSpec, available: list[str]) -> tuple[str, ...]:
    """The value columns; every column the spec names must exist in the source, spelled exactly."""

    def require(column: str, role: str) -> None:
        if column in available:
            return
        hint = ""
        near = [c for c in available if c.lower() == column.lower()]
        if near:
            hint = f" (column names are case-sensitive: did you mean {near[0]!r}?)"
        listed = ", ".join(repr(c) for c in available) or "none"
        raise DataError(store.name, f"{role} column {column!r} is not in the source{hint}; available: {listed}")

    require(store.key, "key")
    if store.source_partition_column is not None:
        require(store.source_partition_column, "source_partition_column")
    if store.source_offset_column is not None:
        require(store.source_offset_column, "source_offset_column")
    if store.mode is Mode.AGGREGATE:
        return tuple(store.aggregations)
    assert store.order_by is not None  # the spec guarantees it for modes latest, history and windowed
    require(store.order_by, "order_by")
    if store.mode is Mode.WINDOWED:
        return tuple(store.aggregations)
    if store.columns is not None:
        for column in store.columns:
            require(column, "value")
        if store.mode is Mode.HISTORY and store.order_by not in store.columns:
            return (store.order_by, *store.columns)  # a history row carries its time
        return store.columns
    # The record's Kafka partition and offset are where it was, not part of its value.
    where = (store.key, store.source_partition_column, store.source_offset_column)
    values = tuple(c for c in available if c not in where)
    if not values:
        raise DataError(store.name, f"the source has no columns besides the key {store.key!r}")
    return values


def _quoted(name: str) -> Column:
    # Backticks keep names with dots or spaces whole instead of reading them as nested fields.
    return F.col("`" + name.replace("`", "``") + "`")


def _raw_key(store: StoreSpec, dtype: T.DataType) -> Column:
    """The key column in the one Spark type that key format reads exactly; anything else is refused."""
    column = _quoted(store.key)
    fmt = store.key_format
    is_string = isinstance(dtype, T.StringType)
    is_integral = isinstance(dtype, _INTEGRAL)
    # JSON gives integers beyond 64 bits as decimal(20,0); as text they meet the range check.
    is_whole_decimal = isinstance(dtype, T.DecimalType) and dtype.scale == 0
    if fmt in _INT_FORMATS:
        if is_integral:
            return column.cast(T.LongType())
        if is_string:  # validated as strict decimal text by the key format
            return column
        if is_whole_decimal:
            return column.cast(T.StringType())
    elif fmt is KeyFormat.STRING:
        if is_string:
            return column
        if is_integral or is_whole_decimal:  # what a producer's StringSerializer got: the decimal text
            return column.cast(T.StringType())
    elif fmt is KeyFormat.UUID:
        if is_string:
            return column
    elif fmt is KeyFormat.BYTES and (is_string or isinstance(dtype, T.BinaryType)):
        return column  # binary as is; text as base64url
    expected = {
        KeyFormat.STRING: "string or integer",
        KeyFormat.UUID: "string",
        KeyFormat.BYTES: "binary or base64url string",
    }.get(fmt, "integer or decimal string")
    raise DataError(
        store.name,
        f"key column {store.key!r} has type {dtype.simpleString()}, which cannot hold {fmt.value} keys "
        f"(expected {expected})",
    )


def _reduce(
    store: StoreSpec,
    keyed: DataFrame,
    value_columns: tuple[str, ...],
    extra: Sequence[Column],
    offset: Column | None = None,
) -> tuple[DataFrame, Column]:
    """One row per raw key (nulls included, with its row count and `extra` aggregates), and its value.

    With `offset` (a hybrid store's source offsets), rows that tie on the ordering are decided as the live
    fold decides them: the later offset wins."""
    rows = F.count(F.lit(1)).alias(_ROWS)
    grouped = keyed.groupBy(RAW_KEY)
    if store.mode is Mode.LATEST:
        assert store.order_by is not None
        # max() of a struct compares field by field: the greatest order_by wins, and rows that tie on it
        # are decided by the value columns in their listed order (greatest wins, null lowest), so the
        # result never depends on how Spark split or ordered the input. A hybrid store's ties go to the later
        # offset first, as in the live fold that continues from these values.
        tie = [] if offset is None else [offset.alias(_TIE)]
        candidate = F.struct(_quoted(store.order_by).alias(_ORDER), *tie, *[_quoted(c) for c in value_columns])
        reduced = grouped.agg(rows, *extra, F.max(candidate).alias(_LATEST))
        value = F.struct(*[F.col(_LATEST).getField(c).alias(c) for c in value_columns])
        return reduced, value
    for name, expr in store.aggregations.items():
        # Checked one at a time, so the error names the expression at fault; analysis only, no job.
        try:
            grouped.agg(F.expr(expr).alias(name))
        except PySparkException as exc:
            raise SpecError(
                store.name,
                f"aggregation {name!r} = {expr!r} is not a valid Spark SQL aggregate: {spark_message(exc)}",
            ) from exc
    if store.live is not None:
        aggregated = _live_aggregates(store.merge().aggregates, offset)
    else:
        aggregated = [F.expr(expr).alias(name) for name, expr in store.aggregations.items()]
    reduced = grouped.agg(rows, *extra, *aggregated)
    return reduced, F.struct(*[_quoted(name) for name in store.aggregations])


# --- live stores ------------------------------------------------------------------------------------------
#
# A live store's nodes fold the topic's records into the values this pass computes (keyroute.core.live), so
# each value carries what the fold needs to continue exactly where the source ended: the winning order_by
# of `latest`, the ordering value of each max_by/min_by. A hybrid store's source is the topic's archive;
# its offsets say where each partition's archive ends.


def live_state(store: StoreSpec) -> Column | None:
    """The merge state of every key of a live store, as JSON text of {"0": s0, "1": s1, ...} (the state
    list in order; `lmdb_files.live_value` makes it the list), or None when the fold keeps none."""
    if store.live is None or store.mode.timeline:
        return None  # a history row carries no merge state
    merge = store.merge()
    if not merge.has_state:
        return None
    if store.mode is Mode.LATEST:
        fields = [F.col(_LATEST).getField(_ORDER).alias("0")]
    else:
        fields = [
            (F.col(_STATE_FIELD.format(i)) if agg.has_state else F.lit(None).cast(T.StringType())).alias(str(i))
            for i, agg in enumerate(merge.aggregates)
        ]
    return F.to_json(F.struct(*fields), {"ignoreNullFields": "false"})


def _live_aggregates(aggregates: Sequence[Aggregate], offset: Column | None) -> list[Column]:
    """The live store's aggregations as the fold computes them (and, per max_by/min_by, its state: the
    greatest or least ordering value). Rows that tie on a max_by/min_by ordering go to the later offset,
    as in the fold (a live store with a source always has offsets; without, the tie is Spark's pick)."""
    columns = []
    for i, agg in enumerate(aggregates):
        value = None if agg.column is None else _quoted(agg.column)
        if agg.function == "count":
            columns.append(F.count(F.lit(1) if value is None else value).alias(agg.name))
            continue
        assert value is not None
        if agg.by is None:
            function = {"sum": F.sum, "min": F.min, "max": F.max}[agg.function]
            columns.append(function(value).alias(agg.name))
            continue
        order = _quoted(agg.by)
        latest = agg.function == "max_by"
        ranked: Column = order
        if offset is not None:
            # Null orderings are ignored, as Spark's max_by ignores them; the offset breaks ties.
            ranked = F.when(order.isNotNull(), F.struct(order, offset if latest else -offset))
        pick = F.max_by if latest else F.min_by
        columns.append(pick(value, ranked).alias(agg.name))
        columns.append((F.max if latest else F.min)(order).alias(_STATE_FIELD.format(i)))
    return columns


def _source_offset(store: StoreSpec, schema: T.StructType) -> Column | None:
    """A hybrid store's source offset column as a long, or None for any other store."""
    name = store.source_offset_column
    if name is None:
        return None
    dtype = schema[name].dataType
    if not isinstance(dtype, _INTEGRAL):
        raise DataError(
            store.name,
            f"source_offset_column {name!r} has type {dtype.simpleString()}; it must hold the Kafka offset of "
            "each record, an integer",
        )
    return _quoted(name).cast(T.LongType())


def _offset_aggregates(offset: Column | None) -> list[Column]:
    """Per key: its greatest source offset, and how many of its records have none."""
    if offset is None:
        return []
    return [F.max(offset).alias(_MAX_OFFSET), F.count(F.when(offset.isNull(), True)).alias(_NULL_OFFSETS)]


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
    off_partition = F.count(F.when(F.col(_OFF_PARTITION), True)) if audited else F.lit(0)
    value_type = routed.schema["value"].dataType
    bounded = _TEXT_BYTES in routed.columns
    longest = [F.max(_TEXT_BYTES).alias(_TEXT_BYTES)] if bounded else []
    # The key text's UTF-8 is the serialized key of these formats (what their LMDB keys are made of).
    key_bytes = not entries and store.snapshot_format != 1 and store.key_format in TEXT_SERIALIZED
    if key_bytes:
        longest.append(F.max(F.octet_length(F.col("key"))).alias(_KEY_BYTES))
    # A partition's greatest offset is over its keys' records; the audit proves they are the partition's.
    offset_summary = [F.max(_MAX_OFFSET).alias("max_offset"), F.sum(_NULL_OFFSETS).alias("null_offsets")]
    summary = (
        routed.groupBy("partition")
        .agg(
            F.count(F.lit(1)).alias("rows"),
            F.count_distinct("key").alias("distinct"),
            F.sum(F.when(F.col(RAW_KEY).isNull(), F.col(_ROWS))).alias("null_rows"),
            F.count(F.when(F.col(RAW_KEY).isNotNull() & F.col(ERROR).isNotNull(), True)).alias("bad"),
            F.sum(_ROWS).alias("records"),
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
        offsets=_next_offsets(store, summary) if offsets else None,
        json_bytes=_json_bytes(value_type, max((int(row[_TEXT_BYTES] or 0) for row in summary), default=0))
        if bounded
        else None,
        key_bytes=max((int(row[_KEY_BYTES] or 0) for row in summary), default=0) if key_bytes else None,
    )


# The most bytes `to_json` spells a value of each scalar type in (quotes included): integers with sign,
# floats as Java prints them (-1.2345678901234567E-308, -Infinity), decimals of up to 38 digits with sign,
# point and exponent, dates and timestamps with the widest years, `null` for any of them.
_JSON_SCALAR_BYTES: dict[type[T.DataType], int] = {
    T.NullType: 4,
    T.BooleanType: 5,
    T.ByteType: 20,
    T.ShortType: 20,
    T.IntegerType: 20,
    T.LongType: 20,
    T.FloatType: 32,
    T.DoubleType: 32,
    T.DecimalType: 64,
    T.DateType: 40,
    T.TimestampType: 64,
    T.TimestampNTZType: 64,
}
_KEY_BYTES = "__keyroute_key_bytes"
_TEXT_BYTES = "__keyroute_text_bytes"  # a column of the cached frame: _row_text_bytes


def _json_bounded(value_type: T.DataType) -> bool:
    """Whether `_json_bytes` bounds a value of this type: a struct of scalar fields (the JSON length of its
    string and binary fields depends on the data, `_row_text_bytes`); any other value is not bounded here."""
    return isinstance(value_type, T.StructType) and all(
        isinstance(field.dataType, (T.StringType, T.BinaryType)) or type(field.dataType) in _JSON_SCALAR_BYTES
        for field in value_type.fields
    )


def _row_text_bytes(value_type: T.DataType, state: bool) -> Column:
    """Per row, the bytes `to_json` may spell its value's string and binary fields in beyond `_json_bytes`'s
    fixed part (a string escapes to at most 6 bytes per byte, \\u00XX; binary is base64), plus its merge
    state's JSON. A column of the cached frame, made as the cache is built: the check job then reads one
    integer per row, not the value (reading a struct back from Spark's cache costs far more)."""
    assert isinstance(value_type, T.StructType)
    parts = []
    for field in value_type.fields:
        size = F.coalesce(F.octet_length(F.col("value").getField(field.name)), F.lit(0))
        if isinstance(field.dataType, T.StringType):
            parts.append(size * 6)
        elif isinstance(field.dataType, T.BinaryType):
            parts.append((F.floor(size / 3) + 1) * 4)
    if state:
        parts.append(F.coalesce(F.octet_length(F.col(STATE)), F.lit(0)))
    total = F.lit(0)
    for part in parts:
        total = total + part
    return total.cast(T.LongType())


def _json_bytes(value_type: T.DataType, longest_text_bytes: int) -> int:
    """An upper bound of the bytes of one row's value as `to_json` spells it (object braces, every field's
    escaped name, colon and comma, its value), plus its merge state's JSON: the fixed part of every field
    (a string's or binary's quotes, or null), and the most any row's `_row_text_bytes` came to."""
    assert isinstance(value_type, T.StructType)
    total = 2
    for field in value_type.fields:
        name = 6 * len(field.name.encode("utf-8")) + 2
        if isinstance(field.dataType, (T.StringType, T.BinaryType)):
            value = 4  # the quotes (the rest is the row's text bytes), or null
        else:
            value = max(_JSON_SCALAR_BYTES[type(field.dataType)], 4)
        total += name + 1 + value + 1
    return total + longest_text_bytes


def _next_offsets(store: StoreSpec, summary: list[Any]) -> tuple[int, ...]:
    """Per partition, the first topic offset after the source's records (0 for a partition without any)."""
    missing = sum(row["null_offsets"] or 0 for row in summary)
    if missing:
        raise DataError(
            store.name,
            f"{missing} source row(s) have a null offset (column {store.source_offset_column!r}); a hybrid "
            "store's source is the topic's archive, every record has its offset",
        )
    greatest = {int(row["partition"]): row["max_offset"] for row in summary if row["partition"] is not None}
    return tuple(0 if greatest.get(p) is None else int(greatest[p]) + 1 for p in range(store.partitions))


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
