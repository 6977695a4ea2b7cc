"""Per-key state with Spark: read a store's source, reduce it to one value per key, route every key.

Routing (canonical key text and partition) runs in the shared core's own code, through an Arrow UDF.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
from py4j.protocol import Py4JError
from pyspark import StorageLevel
from pyspark.errors import PySparkException
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from keyroute_core.key_format import KeyFormat, KeyFormatError, key_from_value
from keyroute_core.partition_vectorized import partitions as vectorized_partitions
from keyroute_core.partitioner import Partitioner
from pipeline.errors import DataError, PipelineError, SpecError
from pipeline.spec import Mode, SourceFormat, StoreSpec

# Internal column names, chosen so they cannot meet a source column by accident.
RAW_KEY = "__keyroute_raw_key"
ERROR = "__keyroute_key_error"
_ROWS = "__keyroute_rows"
_ORDER = "__keyroute_order"
_LATEST = "__keyroute_latest"
_ROUTE = "__keyroute_route"

ROUTE_TYPE = T.StructType(
    [
        T.StructField("key", T.StringType()),
        T.StructField("partition", T.IntegerType()),
        T.StructField("error", T.StringType()),
    ]
)

_INT_FORMATS = frozenset({KeyFormat.INT16, KeyFormat.INT32, KeyFormat.INT64})
_INTEGRAL = (T.ByteType, T.ShortType, T.IntegerType, T.LongType)
_EXAMPLES = 3
_SPARK_MESSAGE_CHARS = 400


@dataclass(frozen=True, slots=True)
class ComputedStore:
    """A store reduced to one row per key, with columns `key` (canonical text), `partition`, `value`.

    `frame` is cached; call `release()` once it has been written. `partition_rows[p]` is the number of
    keys in partition p, counted from `frame` while checking it.
    """

    spec: StoreSpec
    frame: DataFrame
    value_columns: tuple[str, ...]
    partition_rows: tuple[int, ...]

    def release(self) -> None:
        self.frame.unpersist()


def route_keys(
    keys: pa.Array, key_format: KeyFormat, partitioner: Partitioner, partitions: int
) -> pa.StructArray:
    """Canonical text and partition for a batch of raw keys; a key that does not fit gets an error instead.

    Errors are returned, not raised: the driver reports how many keys failed, with examples, rather than
    the first worker traceback.
    """
    no_errors = pa.nulls(len(keys), pa.string())
    if key_format is KeyFormat.STRING and _is_text(keys.type) and keys.null_count == 0:
        # Arrow strings are valid UTF-8, i.e. already the serialized key: hash the buffers as they are.
        parts = vectorized_partitions(partitioner, keys, partitions)
        return pa.StructArray.from_arrays(
            [keys.cast(pa.string()), pa.array(parts, pa.int32()), no_errors],
            names=["key", "partition", "error"],
        )
    texts: list[str | None] = []
    datas: list[bytes] = []
    valid: list[int] = []
    errors: list[str | None] = []
    # to_pylist gives exact Python ints/str/bytes: no float detour for int64 keys.
    for i, value in enumerate(keys.to_pylist()):
        try:
            key = key_from_value(key_format, value)
        except KeyFormatError as exc:
            texts.append(None)
            errors.append(str(exc))
            continue
        texts.append(key.text)
        datas.append(key.data)
        valid.append(i)
        errors.append(None)
    parts_all = np.full(len(texts), -1, dtype=np.int32)
    if datas:
        parts_all[valid] = vectorized_partitions(partitioner, datas, partitions)
    mask = np.array([t is None for t in texts], dtype=bool)
    return pa.StructArray.from_arrays(
        [
            pa.array(texts, pa.string()),
            pa.array(parts_all, pa.int32(), mask=mask),
            pa.array(errors, pa.string()),
        ],
        names=["key", "partition", "error"],
    )


def _is_text(data_type: pa.DataType) -> bool:
    return bool(pa.types.is_string(data_type) or pa.types.is_large_string(data_type))


def _router(store: StoreSpec) -> Any:
    key_format, partitioner, partitions = store.key_format, store.partitioner, store.partitions

    def route(keys: pa.Array) -> pa.Array:
        return route_keys(keys, key_format, partitioner, partitions)

    # arrow_udf: whole Arrow batches in and out, no pandas in between (a scalar Arrow UDF, Spark >= 4.1).
    # The kind is read from the type hints; pyspark's stubs insist on functionType, which it warns about.
    return F.arrow_udf(route, ROUTE_TYPE)  # type: ignore[call-overload]


def compute_store(spark: SparkSession, store: StoreSpec) -> ComputedStore:
    """Read, check, reduce and route one store; raise DataError/SpecError naming the store on any problem.

    Spark jobs on the happy path: schema inference (json/csv) and one pass that reduces, routes, caches
    and checks every key. Writing is the next pass, over the cache.
    """
    with spark_errors(store.name, "computing the store"):
        source = _read_source(spark, store)
        value_columns = _check_columns(store, source.columns)
        keyed = source.withColumn(RAW_KEY, _raw_key(store, source.schema[store.key].dataType))
        reduced, value = _reduce(store, keyed, value_columns)
        route = _router(store)
        routed = (
            reduced.select(
                F.col(RAW_KEY), F.col(_ROWS), route(F.col(RAW_KEY)).alias(_ROUTE), value.alias("value")
            )
            .select(
                F.col(RAW_KEY),
                F.col(_ROWS),
                F.col(_ROUTE).getField("key").alias("key"),
                F.col(_ROUTE).getField("partition").alias("partition"),
                F.col(_ROUTE).getField("error").alias(ERROR),
                F.col("value"),
            )
            .persist(StorageLevel.MEMORY_AND_DISK)
        )
        try:
            partition_rows = _check_keys(store, routed)
        except BaseException:
            routed.unpersist()
            raise
    return ComputedStore(spec=store, frame=routed, value_columns=value_columns, partition_rows=partition_rows)


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
        raise DataError(
            store.name, f"{role} column {column!r} is not in the source{hint}; available: {listed}"
        )

    require(store.key, "key")
    if store.mode is Mode.AGGREGATE:
        return tuple(store.aggregations)
    assert store.order_by is not None  # the spec guarantees it for mode latest
    require(store.order_by, "order_by")
    if store.columns is not None:
        for column in store.columns:
            require(column, "value")
        return store.columns
    values = tuple(c for c in available if c != store.key)
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


def _reduce(store: StoreSpec, keyed: DataFrame, value_columns: tuple[str, ...]) -> tuple[DataFrame, Column]:
    """One row per raw key (nulls included, with their row count) and the column holding its value."""
    rows = F.count(F.lit(1)).alias(_ROWS)
    grouped = keyed.groupBy(RAW_KEY)
    if store.mode is Mode.LATEST:
        assert store.order_by is not None
        # max() of a struct compares field by field: the greatest order_by wins, and rows that tie on it
        # are decided by the value columns in their listed order (greatest wins, null lowest), so the
        # result never depends on how Spark split or ordered the input.
        candidate = F.struct(_quoted(store.order_by).alias(_ORDER), *[_quoted(c) for c in value_columns])
        reduced = grouped.agg(rows, F.max(candidate).alias(_LATEST))
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
    reduced = grouped.agg(rows, *[F.expr(expr).alias(name) for name, expr in store.aggregations.items()])
    return reduced, F.struct(*[_quoted(name) for name in store.aggregations])


def _check_keys(store: StoreSpec, routed: DataFrame) -> tuple[int, ...]:
    """Keys per partition; DataError for null keys, keys that do not fit the format, or duplicate keys.

    One job summarises the whole frame per partition. Equal keys land in the same partition, so a
    partition holding fewer distinct keys than rows holds a duplicate; rows that could not be routed
    (null or malformed keys) have no partition. Examples are fetched only when something is wrong.
    """
    summary = (
        routed.groupBy("partition")
        .agg(
            F.count(F.lit(1)).alias("rows"),
            F.count_distinct("key").alias("distinct"),
            F.sum(F.when(F.col(RAW_KEY).isNull(), F.col(_ROWS))).alias("null_rows"),
            F.count(F.when(F.col(RAW_KEY).isNotNull() & F.col(ERROR).isNotNull(), True)).alias("bad"),
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
    counts = {int(row["partition"]): int(row["rows"]) for row in summary if row["partition"] is not None}
    return tuple(counts.get(p, 0) for p in range(store.partitions))


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
