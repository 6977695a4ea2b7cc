"""A store's source reduced to one row per raw key, and its value, per mode (latest, aggregate); a live
store's values also carry the merge state its nodes fold the topic's records into (keyroute.storage.live).

History and windowed stores are reduced to timelines by keyroute.pipeline.timeline.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pyspark.errors import PySparkException
from pyspark.sql import Column, DataFrame, GroupedData
from pyspark.sql import functions as F
from pyspark.sql import types as T

from keyroute.pipeline.columns import LATEST, ORDER, RAW_KEY, ROWS, STATE_FIELD, TIE
from keyroute.pipeline.errors import SpecError
from keyroute.pipeline.sources import quoted
from keyroute.pipeline.spark_errors import spark_message
from keyroute.pipeline.spec import Mode, StoreSpec
from keyroute.storage.live import Aggregate

if TYPE_CHECKING:
    from keyroute.pipeline.ordering import Orderings


def reduce_per_key(
    store: StoreSpec,
    keyed: DataFrame,
    value_columns: tuple[str, ...],
    extra: Sequence[Column],
    offset: Column | None = None,
    orderings: Orderings | None = None,
) -> tuple[DataFrame, Column]:
    """One row per raw key (nulls included, with its row count and `extra` aggregates), and its value.
    Rows are ordered by the typed values of their `orderings` (keyroute.pipeline.ordering), never by text.

    With `offset` (a hybrid store's source offsets), rows that tie on the ordering are decided as the live
    fold decides them: the later offset wins."""
    rows = F.count(F.lit(1)).alias(ROWS)
    grouped = keyed.groupBy(RAW_KEY)
    if store.mode is Mode.LATEST:
        assert store.order_by is not None
        # max() of a struct compares field by field: the greatest order_by wins, and rows that tie on it
        # are decided by the value columns in their listed order (greatest wins, null lowest), so the
        # result never depends on how Spark split or ordered the input. A hybrid store's ties go to the later
        # offset first, as in the live fold that continues from these values.
        tie = [] if offset is None else [offset.alias(TIE)]
        order = quoted(store.order_by) if orderings is None else orderings.value(store.order_by)
        candidate = F.struct(order.alias(ORDER), *tie, *[quoted(c) for c in value_columns])
        reduced = grouped.agg(rows, *extra, F.max(candidate).alias(LATEST))
        value = F.struct(*[F.col(LATEST).getField(c).alias(c) for c in value_columns])
        return reduced, value
    check_aggregations(store, grouped)
    if store.live is not None:
        aggregated = _live_aggregates(store.merge().aggregates, offset, orderings)
    else:
        expressions = store.aggregations if orderings is None else orderings.aggregations
        aggregated = [F.expr(expr).alias(name) for name, expr in expressions.items()]
    reduced = grouped.agg(rows, *extra, *aggregated)
    return reduced, F.struct(*[quoted(name) for name in store.aggregations])


def check_aggregations(store: StoreSpec, grouped: GroupedData) -> None:
    """SpecError naming the first of the store's aggregations that is no Spark SQL aggregate over `grouped`."""
    for name, expr in store.aggregations.items():
        # Checked one at a time, so the error names the expression at fault; analysis only, no job.
        try:
            grouped.agg(F.expr(expr).alias(name))
        except PySparkException as exc:
            raise SpecError(
                store.name,
                f"aggregation {name!r} = {expr!r} is not a valid Spark SQL aggregate: {spark_message(exc)}",
            ) from exc


# --- live stores ------------------------------------------------------------------------------------------
#
# A live store's nodes fold the topic's records into the values this pass computes (keyroute.storage.live), so
# each value carries what the fold needs to continue exactly where the source ended: the winning order_by
# of `latest`, the ordering value of each max_by/min_by.


def live_state(store: StoreSpec) -> Column | None:
    """The merge state of every key of a live store, as JSON text of {"0": s0, "1": s1, ...} (the state
    list in order; `lmdb_files.live_value` makes it the list), or None when the fold keeps none. An ordering
    value is kept as rows were compared by it (an int64 of its type), as the live fold keeps it."""
    if store.live is None or store.mode.timeline:
        return None  # a history row carries no merge state
    merge = store.merge()
    if not merge.has_state:
        return None
    if store.mode is Mode.LATEST:
        fields = [F.col(LATEST).getField(ORDER).alias("0")]
    else:
        fields = [
            (F.col(STATE_FIELD.format(i)) if agg.has_state else F.lit(None).cast(T.StringType())).alias(str(i))
            for i, agg in enumerate(merge.aggregates)
        ]
    return F.to_json(F.struct(*fields), {"ignoreNullFields": "false"})


def _live_aggregates(
    aggregates: Sequence[Aggregate], offset: Column | None, orderings: Orderings | None
) -> list[Column]:
    """The live store's aggregations as the fold computes them (and, per max_by/min_by, its state: the
    greatest or least ordering value). Rows that tie on a max_by/min_by ordering go to the later offset,
    as in the fold (a live store with a source always has offsets; without, the tie is Spark's pick)."""
    columns = []
    for i, agg in enumerate(aggregates):
        value = None if agg.column is None else quoted(agg.column)
        if agg.function == "count":
            columns.append(F.count(F.lit(1) if value is None else value).alias(agg.name))
            continue
        assert value is not None
        if agg.by is None:
            function = {"sum": F.sum, "min": F.min, "max": F.max}[agg.function]
            columns.append(function(value).alias(agg.name))
            continue
        order = quoted(agg.by) if orderings is None else orderings.value(agg.by)
        latest = agg.function == "max_by"
        ranked: Column = order
        if offset is not None:
            # Null orderings are ignored, as Spark's max_by ignores them; the offset breaks ties.
            ranked = F.when(order.isNotNull(), F.struct(order, offset if latest else -offset))
        pick = F.max_by if latest else F.min_by
        columns.append(pick(value, ranked).alias(agg.name))
        columns.append((F.max if latest else F.min)(order).alias(STATE_FIELD.format(i)))
    return columns
