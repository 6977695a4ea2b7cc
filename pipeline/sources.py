"""A store's source in Spark: reading it, and the columns the spec names in it, checked and typed.

Every column the spec names must exist, spelled exactly; the Kafka partition and offset columns of a topic's
archive must hold integers.
"""

from __future__ import annotations

import difflib

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
    """The store's source as Spark reads it; DataError when it is missing, unreadable or holds no data."""
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
