"""Rows ordered by ISO 8601 text in any offset are ordered by their instants, as Python's
`datetime.fromisoformat` compares them, in the build (Spark, keyroute.pipeline.ordering and reduce) and in the
live fold (keyroute.storage.live) alike: a `latest` store's winner, `max_by`/`min_by`, and a history row's time;
and Spark's reading of any text shaped like a time or an integer is the live fold's, refusals included.

Each example is one generated batch of many keys, reduced by a few Spark jobs on the session's SparkSession
(tests/conftest.py), so the examples are few and each is wide.
"""

from __future__ import annotations

import datetime as dt
import json
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from keyroute.pipeline.columns import RAW_KEY
from keyroute.pipeline.ordering import type_orderings
from keyroute.pipeline.reduce import reduce_per_key
from keyroute.pipeline.spec import Mode, SourceFormat, StoreSpec
from keyroute.pipeline.timeline import parsed_text, time_column
from keyroute.storage.live import Aggregate, Merge, decode_state, value_bytes
from keyroute.storage.timeline import TimeType, parse_order_text

pytestmark = pytest.mark.integration

EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
LOW = (dt.datetime(1900, 1, 1, tzinfo=dt.UTC) - EPOCH) // dt.timedelta(microseconds=1)
HIGH = (dt.datetime(2100, 1, 1, tzinfo=dt.UTC) - EPOCH) // dt.timedelta(microseconds=1)
COMMON = {"source": "/generated", "format": SourceFormat.JSON, "key": "k", "partitions": 1}
LATEST = StoreSpec(
    name="latest", mode=Mode.LATEST, order_by="ts", columns=("ts", "v"), order_by_type=TimeType.TIMESTAMP, **COMMON
)
AGGREGATE = StoreSpec(
    name="aggregate",
    mode=Mode.AGGREGATE,
    aggregations={"last": "max_by(v, ts)", "first": "min_by(v, ts)"},
    order_by_type=TimeType.TIMESTAMP,
    **COMMON,
)
LIVE_LATEST = Merge("latest", "k", order_by="ts", columns=("ts", "v"), time_type="timestamp")
LIVE_AGGREGATE = Merge(
    "aggregate",
    "k",
    aggregates=(
        Aggregate("last", "max_by", "v", "ts", "timestamp"),
        Aggregate("first", "min_by", "v", "ts", "timestamp"),
    ),
)
LIVE_HISTORY = Merge("history", "k", order_by="ts", columns=("v",), time_type="timestamp")


def spelled(micros: int, offset_minutes: int, style: int, separator: str, digits: int) -> str:
    """The instant `micros` as ISO 8601 text in the zone `offset_minutes` east of UTC: one of several offset
    spellings, a fraction of `digits` digits (cut, or padded with zeros), or only its UTC date."""
    moment = EPOCH + dt.timedelta(microseconds=micros)
    if style == 0:
        return moment.date().isoformat()  # a date: its 00:00 UTC
    if style == 1:
        offset_minutes = 0  # no offset: UTC
    local = moment + dt.timedelta(minutes=offset_minutes)
    text = local.strftime("%Y-%m-%d") + separator + local.strftime("%H:%M:%S")
    if digits:
        text += "." + f"{local.microsecond:06d}000"[:digits]
    if style == 1:
        return text
    if style == 2 and offset_minutes == 0:
        return text + "Z"
    sign = "-" if offset_minutes < 0 else "+"
    hours, minutes = divmod(abs(offset_minutes), 60)
    if style == 3 and minutes == 0:
        return f"{text}{sign}{hours:02d}"
    if style == 4:
        return f"{text}{sign}{hours:02d}{minutes:02d}"
    return f"{text}{sign}{hours:02d}:{minutes:02d}"


def instant(text: str) -> int:
    """The oracle: the text's instant as Python's datetime reads it (no offset: UTC), in microseconds."""
    moment = dt.datetime.fromisoformat(text)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return (moment - EPOCH) // dt.timedelta(microseconds=1)


times = st.builds(
    spelled,
    st.integers(LOW, HIGH),
    # whole hours most of the time, as real zones are, and any minute too
    st.one_of(st.integers(-18, 18).map(lambda h: h * 60), st.integers(-18 * 60, 18 * 60)),
    st.integers(0, 5),
    st.sampled_from(["T", " "]),
    st.integers(0, 9),
)
# Many keys with a few rows each; the rows of a key have distinct instants (a tie in max_by is anyone's).
batches = st.lists(st.lists(times, min_size=1, max_size=6), min_size=40, max_size=120)


def rows_of(batch: list[list[str]]) -> list[dict[str, Any]]:
    rows = []
    for k, texts in enumerate(batch):
        seen: set[int] = set()
        for text in texts:
            if instant(text) not in seen:
                seen.add(instant(text))
                rows.append({"k": f"k{k}", "ts": text, "v": len(rows)})
    return rows


def fold(merge: Merge, rows: list[dict[str, Any]]) -> bytes | None:
    stored = None
    for row in rows:
        stored = merge.apply(stored, row) or stored
    return stored


# No shrinking: each step of it is Spark jobs; a failing batch is reported whole, with the text it fails on.
@settings(
    max_examples=4,
    deadline=None,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(batches, st.randoms(use_true_random=False))
def test_time_text_in_any_offset_orders_as_its_instant_in_spark_and_in_the_live_fold(
    spark: SparkSession, batch: list[list[str]], rnd: random.Random
) -> None:
    rows = rows_of(batch)
    rnd.shuffle(rows)  # the order of arrival decides nothing
    frame = spark.createDataFrame(rows, "k string, ts string, v bigint").repartition(3)
    keyed = frame.withColumn(RAW_KEY, F.col("k"))

    # One instant per text: Spark's reading, the live fold's and Python's are the same number.
    spark_times = dict(
        frame.select("ts", time_column(parsed_text(F.col("ts"), TimeType.TIMESTAMP), TimeType.TIMESTAMP)).collect()
    )
    for row in rows:
        text = row["ts"]
        assert spark_times[text] == parse_order_text(text, TimeType.TIMESTAMP) == instant(text), text
        assert LIVE_HISTORY.history_row(row)[0] == instant(text), text

    by_key: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_key.setdefault(row["k"], []).append(row)
    newest = {k: max(rs, key=lambda r: instant(r["ts"])) for k, rs in by_key.items()}
    oldest = {k: min(rs, key=lambda r: instant(r["ts"])) for k, rs in by_key.items()}

    typed, orderings = type_orderings(LATEST, keyed)
    reduced, value = reduce_per_key(LATEST, typed, ("ts", "v"), [], None, orderings)
    latest = {row[0]: row[1].asDict() for row in reduced.select(RAW_KEY, value).collect()}
    assert latest == {k: {"ts": r["ts"], "v": r["v"]} for k, r in newest.items()}

    typed, orderings = type_orderings(AGGREGATE, keyed)
    reduced, value = reduce_per_key(AGGREGATE, typed, ("last", "first"), [], None, orderings)
    aggregated = {row[0]: row[1].asDict() for row in reduced.select(RAW_KEY, value).collect()}
    assert aggregated == {k: {"last": newest[k]["v"], "first": oldest[k]["v"]} for k in by_key}

    for k, key_rows in by_key.items():
        stored = fold(LIVE_LATEST, key_rows)
        assert stored is not None
        assert json.loads(value_bytes(stored)) == {"ts": newest[k]["ts"], "v": newest[k]["v"]}
        assert decode_state(stored) == [instant(newest[k]["ts"])]
        folded = fold(LIVE_AGGREGATE, key_rows)
        assert folded is not None
        assert decode_state(folded) == [instant(newest[k]["ts"]), instant(oldest[k]["ts"])]
        assert value_bytes(folded) == b'{"last":%d,"first":%d}' % (newest[k]["v"], oldest[k]["v"])


# Texts shaped like ISO 8601, valid or not: fields out of range, an offset without seconds, too many
# fraction digits, a lower-case letter, a trailing line break; and integer-like texts.
near_times = st.from_regex(
    r"[0-9]{4}-[0-1][0-9]-[0-3][0-9]([T t][0-2][0-9]:[0-6][0-9](:[0-6][0-9](\.[0-9]{0,10})?)?"
    r"(Z|z|[+-][0-2][0-9](:?[0-6][0-9])?)?)?\n?",
    fullmatch=True,
)
near_integers = st.from_regex(r"[+-]?[0-9]{1,20}\n?", fullmatch=True)
EDGES = [
    "0000-02-29",
    "0000-01-01T00:00:00+02:00",
    "0001-01-01T00:00:00+02:00",
    "9999-12-31T23:59:59-02:00",
    "2024-06-11T10:00:00+18:00",
    "2024-06-11T10:00:00-18:00",
    "2024-06-11T10:00:00+18:01",
    "2024-06-11T10:00:00+1800",
    "2024-06-11T10:00+02",
    "2024-06-11T10:00",
    "2024-06-11T24:00:00Z",
    "2024-02-29",
    "2023-02-29",
    "1900-02-29",
    "2000-02-29T12:00:00.123456789-05:30",
    "2024-06-11\n",
    "9223372036854775807",
    "-9223372036854775808",
    "9223372036854775808",
    "+0",
    "-00017",
]


@settings(
    max_examples=3,
    deadline=None,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.lists(near_times, min_size=100, max_size=300), st.lists(near_integers, min_size=20, max_size=60))
def test_spark_and_the_live_fold_read_every_text_alike_or_refuse_it_alike(
    spark: SparkSession, texts: list[str], integers: list[str]
) -> None:
    texts = sorted(set(texts + integers + EDGES))
    frame = spark.createDataFrame([(t,) for t in texts], "t string")
    column = F.col("t")
    read = [time_column(parsed_text(column, tt), tt).alias(tt.value) for tt in TimeType]
    for row in frame.select("t", *read).collect():
        for time_type in TimeType:
            assert row[time_type.value] == parse_order_text(row["t"], time_type), (row["t"], time_type)
