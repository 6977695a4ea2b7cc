"""Where a hybrid store's source ends in each topic partition: the source's offsets, reduced per key and
summed up per partition in the compute pass.

A hybrid store's source is its topic's archive; its nodes apply the topic from one past the greatest source
offset of each partition (keyroute.pipeline.live checks those offsets against the topic).
"""

from __future__ import annotations

from typing import Any

from pyspark.sql import Column
from pyspark.sql import functions as F
from pyspark.sql import types as T

from keyroute.pipeline.columns import MAX_OFFSET, NULL_OFFSETS
from keyroute.pipeline.errors import DataError
from keyroute.pipeline.sources import record_column
from keyroute.pipeline.spec import StoreSpec


def source_offset(store: StoreSpec, schema: T.StructType) -> Column | None:
    """A hybrid store's source offset column as a long, or None for any other store."""
    return record_column(store, schema, "source_offset_column", store.source_offset_column, "offset")


def offset_aggregates(offset: Column | None) -> list[Column]:
    """Per key: its greatest source offset, and how many of its records have none."""
    if offset is None:
        return []
    return [F.max(offset).alias(MAX_OFFSET), F.count(F.when(offset.isNull(), True)).alias(NULL_OFFSETS)]


def regroup_offset_aggregates() -> list[Column]:
    """`offset_aggregates` of several groups of a key's records (a windowed store's windows) combined."""
    return [F.max(MAX_OFFSET).alias(MAX_OFFSET), F.sum(NULL_OFFSETS).alias(NULL_OFFSETS)]


def partition_offset_summary() -> list[Column]:
    """Per partition, over its keys' `offset_aggregates`: what `next_offsets` reads."""
    return [F.max(MAX_OFFSET).alias("max_offset"), F.sum(NULL_OFFSETS).alias("null_offsets")]


def next_offsets(store: StoreSpec, summary: list[Any]) -> tuple[int, ...]:
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
