"""A store's source in Spark: reading it, and the columns the spec names in it, checked and typed.

A source is files (json, csv, parquet, orc), a table of the session's catalog or a Spark SQL query. Every
column the spec names must exist, spelled exactly; the Kafka partition and offset columns of a topic's
archive must hold integers.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable

from pyspark.errors import PySparkException
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from keyroute.pipeline.errors import DataError
from keyroute.pipeline.spark_errors import spark_message
from keyroute.pipeline.spec import Mode, SourceFormat, StoreSpec

# Spark's integer types: what a Kafka partition, offset or integer key is read as.
INTEGRAL = (T.ByteType, T.ShortType, T.IntegerType, T.LongType)


def read_source(spark: SparkSession, store: StoreSpec) -> DataFrame:
    """The store's batch part as Spark reads it: `source` files, a `source_table` of the session's catalog or
    the result of `source_sql`. DataError, naming Spark's reason in one line, when it is missing, unreadable
    or holds no data."""
    if (table := store.source_table) is not None:
        frame = _read_catalog(store, lambda: spark.table(table))
    elif (sql := store.source_sql) is not None:
        frame = _read_catalog(store, lambda: _query(spark, sql))
    else:
        frame = _read(spark, store)
    if not frame.columns:  # only empty files: Spark infers a schema of no columns rather than failing
        raise DataError(store.name, _no_data(store))
    return frame


def _query(spark: SparkSession, sql: str) -> DataFrame:
    """The query's result, analysed but not run. Only a query is taken: Spark's parser is asked for one first,
    since `spark.sql` runs any other statement (DROP TABLE, INSERT) at once. A trailing ';' is dropped."""
    sql = sql.rstrip().removesuffix(";")
    spark._jsparkSession.sessionState().sqlParser().parseQuery(sql)  # ParseException for any other statement
    return spark.sql(sql)


def _read_catalog(store: StoreSpec, read: Callable[[], DataFrame]) -> DataFrame:
    """A table or query's result; its analysis (no job) finds a missing table or column and bad SQL."""
    try:
        return read()
    except PySparkException as exc:
        raise DataError(store.name, f"cannot read {store.describe_source()}: {spark_message(exc)}") from exc


def _no_data(store: StoreSpec) -> str:
    if store.format is None:
        return f"{store.describe_source()} has no columns"
    return f"source {store.source!r} holds no {store.format.value} data (no files, or only empty ones)"


def _read(spark: SparkSession, store: StoreSpec) -> DataFrame:
    assert store.source is not None and store.format is not None
    try:
        if store.format is SourceFormat.CSV:
            return _read_csv(spark, store, store.source)
        options = dict(store.options)
        if store.format is SourceFormat.JSON:
            options = {"mode": "FAILFAST", **options}
        return spark.read.format(store.format.value).options(**options).load(store.source)
    except PySparkException as exc:
        condition = exc.getCondition()
        if condition == "PATH_NOT_FOUND":
            raise DataError(store.name, f"source {store.source!r} does not exist") from exc
        if condition == "UNABLE_TO_INFER_SCHEMA":
            raise DataError(store.name, _no_data(store)) from exc
        raise DataError(
            store.name, f"cannot read {store.format.value} source {store.source!r}: {spark_message(exc)}"
        ) from exc


def _read_csv(spark: SparkSession, store: StoreSpec, source: str) -> DataFrame:
    options = {"header": "true", "inferSchema": "true", "mode": "FAILFAST", **store.options}
    inferred = spark.read.options(**options).csv(source)
    if store.key not in inferred.columns:
        return inferred
    # Inference would turn key "007" into 7: the key column is read as written, and checked later.
    schema = T.StructType(
        [T.StructField(f.name, T.StringType(), True) if f.name == store.key else f for f in inferred.schema.fields]
    )
    return spark.read.schema(schema).options(**options).csv(source)


def value_columns_of(store: StoreSpec, available: list[str]) -> tuple[str, ...]:
    """The value columns; every column the spec names must exist in the source, spelled exactly."""

    def require(column: str, role: str) -> None:
        if column in available:
            return
        hint = ""
        near = [c for c in available if c.lower() == column.lower()]
        if near:
            hint = f" (column names are case-sensitive: did you mean {near[0]!r}?)"
        else:
            close = difflib.get_close_matches(column, available, n=1)
            if close:
                hint = f" (did you mean {close[0]!r}?)"
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


def quoted(name: str) -> Column:
    """The source column `name`."""
    # Backticks keep names with dots or spaces whole instead of reading them as nested fields.
    return F.col("`" + name.replace("`", "``") + "`")


def record_column(store: StoreSpec, schema: T.StructType, option: str, name: str | None, what: str) -> Column | None:
    """The source column `name` that spec `option` names, holding the Kafka `what` (partition, offset) of each
    record, as a long; None when the option is not set. DataError when the column is not of an integer type."""
    if name is None:
        return None
    dtype = schema[name].dataType
    if not isinstance(dtype, INTEGRAL):
        raise DataError(
            store.name,
            f"{option} {name!r} has type {dtype.simpleString()}; it must hold the Kafka {what} of each record, "
            "an integer",
        )
    return quoted(name).cast(T.LongType())
