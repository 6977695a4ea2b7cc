"""How the build orders a store's rows: the columns that decide an order (a `latest` store's `order_by`, the
ordering argument of every `max_by` and `min_by`, a history or windowed store's time column), the type each
is compared as, and its values in that type.

    timestamp, date or integer column   its own type, or `order_by_type`'s reading of it (keyroute.pipeline
                                        .timeline.time_reading: integers as epoch milliseconds, dates at
                                        midnight)
    text                                `order_by_type`; without it, the type every value parses as
                                        (timestamp, else integer; said in the log), else the build fails
                                        naming the store, the column, a value and the fix
    any other type (double, decimal)    compared as it is; `order_by_type` refuses it

A text is never compared as text: a value that cannot be typed fails the build, naming the store, the
column, the value and where it is. Typed orderings are compared as int64s in their type's unit
(keyroute.storage.timeline), kept in a column beside the source's own; a live store's merge state keeps that
int64, as the live fold does with the records that follow (keyroute.storage.live.order_value, which reads
every text as the build does).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from pyspark.errors import PySparkException
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from keyroute.pipeline.columns import ORDER_TEXT, ORDER_VALUE, RAW_KEY, SOURCE_FILE
from keyroute.pipeline.errors import DataError, SpecError
from keyroute.pipeline.order_args import ordering_arguments, ordering_column, replace_orderings
from keyroute.pipeline.sources import quoted
from keyroute.pipeline.spec import Mode, StoreSpec
from keyroute.pipeline.timeline import (
    Reading,
    natural_type,
    parsed_text,
    refuse_text,
    time_column,
    time_reading,
)
from keyroute.storage.timeline import TimeType

log = logging.getLogger(__name__)

ORDER_BY = "order_by column"
BY = "max_by/min_by ordering column"
FIX = ' (a text column is ordered by its type: order_by_type = "timestamp", or "date", "integer")'
# What the build tries, in order, for a text column without `order_by_type` (a date is a timestamp too).
_INFERRED = (TimeType.TIMESTAMP, TimeType.INTEGER)
_SAID = {TimeType.TIMESTAMP: "an ISO 8601 time", TimeType.INTEGER: "an integer"}


@dataclass(frozen=True, slots=True)
class Ordering:
    """One column that orders rows: the type it is compared as (None: as it is, a number), and the column
    holding its int64 value in that type (None when compared as it is)."""

    column: str
    time_type: TimeType | None
    value: str | None = None


@dataclass(frozen=True, slots=True)
class Orderings:
    """A store's orderings by column, and its aggregations with each ordering argument replaced by the
    column of its typed values."""

    columns: Mapping[str, Ordering] = field(default_factory=dict)
    aggregations: Mapping[str, str] = field(default_factory=dict)

    def value(self, column: str) -> Column:
        """What rows are ordered by where `column` orders them."""
        ordering = self.columns.get(column)
        return quoted(column) if ordering is None or ordering.value is None else F.col(ordering.value)

    def types(self) -> dict[str, TimeType | None]:
        return {column: ordering.time_type for column, ordering in self.columns.items()}


def text_types(store: StoreSpec, keyed: DataFrame, columns: Mapping[str, str]) -> dict[str, TimeType]:
    """The type each text column of `columns` (column -> what it is to the store, for messages) is ordered
    as: `order_by_type`, every value checked, or without it the type every value parses as. One Spark job
    over `keyed` (the source with RAW_KEY); DataError naming the store, the column, a value that does not
    parse and where it is, otherwise."""
    declared = store.order_by_type
    tried = (declared,) if declared is not None else _INFERRED
    counts = []
    for column in columns:
        text = quoted(column)
        counts.append(F.count(text))
        counts += [F.count(parsed_text(text, time_type)) for time_type in tried]
    row = keyed.agg(*counts).collect()[0]
    found: dict[str, TimeType] = {}
    for i, (column, role) in enumerate(columns.items()):
        values, parsed = row[i * (len(tried) + 1)], row[i * (len(tried) + 1) + 1 :][: len(tried)]
        fitting = [time_type for time_type, count in zip(tried, parsed, strict=True) if count == values]
        if fitting:
            found[column] = fitting[0]
            if declared is None:
                log.info(
                    "store %r: %s %r is text without order_by_type; every value is %s, so it is ordered as %s "
                    '(order_by_type = "%s" says so)',
                    store.name,
                    role,
                    column,
                    _SAID[fitting[0]],
                    fitting[0].value,
                    fitting[0].value,
                )
            continue
        time_type = tried[0]
        text = quoted(column)
        bad = keyed.where(text.isNotNull() & parsed_text(text, time_type).isNull()).select(
            text.alias(ORDER_TEXT), F.input_file_name().alias(SOURCE_FILE), F.col(RAW_KEY)
        )
        [first] = bad.agg(F.min(SOURCE_FILE)).collect()
        refuse_text(store, bad, first[0], RAW_KEY, time_type, column, role, "" if declared else FIX)
    return found


def timeline_text_type(store: StoreSpec, keyed: DataFrame) -> TimeType | None:
    """A history or windowed store's text `order_by`: the type it is read as (`text_types`); None when the
    column is no text."""
    assert store.order_by is not None
    if not isinstance(keyed.schema[store.order_by].dataType, T.StringType):
        return None
    return text_types(store, keyed, {store.order_by: ORDER_BY})[store.order_by]


def type_orderings(store: StoreSpec, keyed: DataFrame) -> tuple[DataFrame, Orderings]:
    """`keyed` with a column of typed values per ordering of a latest store or of the aggregations (a
    history or windowed store's `order_by` is its time, read by keyroute.pipeline.timeline.read_times), and
    those orderings. A text column's type is decided by `text_types` (one job); SpecError for a max_by or
    min_by ordered by a text expression."""
    wanted: dict[str, str] = {}  # ordering argument (as written) -> its column
    if store.mode is Mode.LATEST:
        assert store.order_by is not None
        wanted[store.order_by] = store.order_by
    for argument in ordering_arguments(store.aggregations.values()):
        column = ordering_column(argument)
        if column is not None and column in keyed.columns:
            wanted[argument] = column
            continue
        _refuse_text_expression(store, keyed, argument)
    if not wanted:
        return keyed, Orderings(aggregations=store.aggregations)
    roles = {column: ORDER_BY if store.mode is Mode.LATEST else BY for column in wanted.values()}
    texts = {c: role for c, role in roles.items() if isinstance(keyed.schema[c].dataType, T.StringType)}
    decided = text_types(store, keyed, texts) if texts else {}
    columns: dict[str, Ordering] = {}
    for column, role in roles.items():
        dtype = keyed.schema[column].dataType
        if natural_type(dtype) is None and column not in decided:
            if store.order_by_type is not None:
                raise DataError(
                    store.name,
                    f"{role} {column!r} is {dtype.simpleString()}: order_by_type "
                    f"{store.order_by_type.value!r} reads a timestamp, date or integer column, or text",
                )
            columns[column] = Ordering(column, None)
            continue
        time_type, reading = time_reading(store, dtype, column, decided.get(column))
        value = ORDER_VALUE.format(len(columns))
        keyed = keyed.withColumn(value, _typed(quoted(column), time_type, reading))
        columns[column] = Ordering(column, time_type, value)
    replacement = {
        argument: f"`{columns[column].value}`"
        for argument, column in wanted.items()
        if columns[column].value is not None
    }
    aggregations = {name: replace_orderings(expr, replacement) for name, expr in store.aggregations.items()}
    return keyed, Orderings(columns, aggregations)


def _typed(column: Column, time_type: TimeType, reading: Reading) -> Column:
    """A column's values as int64s of `time_type` (null where a text does not parse: refused before)."""
    if reading is Reading.TEXT:
        return time_column(parsed_text(column, time_type), time_type)
    if reading is Reading.EPOCH_MILLIS:
        return time_column(F.timestamp_millis(column), time_type)
    if reading is Reading.MIDNIGHT:
        return time_column(column.cast(T.TimestampType()), time_type)
    return time_column(column, time_type)


def _refuse_text_expression(store: StoreSpec, keyed: DataFrame, argument: str) -> None:
    """SpecError when an ordering argument that is an expression is text (it cannot be typed here)."""
    try:
        dtype = keyed.select(F.expr(argument)).schema[0].dataType
    except PySparkException:
        return  # not a valid expression: the aggregation's own check names it
    if isinstance(dtype, T.StringType):
        raise SpecError(
            store.name,
            f"a max_by/min_by is ordered by the text expression {argument!r}, which would compare as text: "
            "order it by a column (read as order_by_type) or by a typed expression such as "
            f"to_timestamp({argument})",
        )
