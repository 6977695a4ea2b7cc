"""The live fold (keyroute.storage.live): records one at a time give what Spark SQL gives over all of them."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.storage.live import (
    OFFSET_KEY,
    STATE_SEPARATOR,
    Aggregate,
    BadRecord,
    LiveConfig,
    LiveSpecError,
    Merge,
    Reason,
    RecordReader,
    check_kafka_settings,
    decode_state,
    parse_aggregate,
    value_bytes,
)
from keyroute.storage.lmdb_layout import TAG_HASHED, TAG_KEY

AGGREGATE = Merge(
    "aggregate",
    "asset",
    aggregates=(
        parse_aggregate("trades", "count(*)"),
        parse_aggregate("priced", "count(price)"),
        parse_aggregate("volume", "sum(qty)"),
        parse_aggregate("low", "min(price)"),
        parse_aggregate("high", "max(price)"),
        parse_aggregate("last_price", "max_by(price, ts)"),
        parse_aggregate("first_price", "min_by(price, ts)"),
    ),
)
LATEST = Merge("latest", "customer", order_by="ts", columns=("ts", "route"))


def fold(merge: Merge, rows: list[dict[str, object]]) -> bytes | None:
    stored: bytes | None = None
    for row in rows:
        new = merge.apply(stored, row)
        stored = stored if new is None else new
    return stored


def spark_like_aggregate(rows: list[dict[str, object]]) -> dict[str, object]:
    """What Spark SQL's aggregates give over all rows at once (nulls ignored)."""
    prices = [r["price"] for r in rows if r["price"] is not None]
    qtys = [r["qty"] for r in rows if r["qty"] is not None]
    by_ts = [r for r in rows if r["ts"] is not None]
    return {
        "trades": len(rows),
        "priced": len(prices),
        "volume": sum(qtys) if qtys else None,
        "low": min(prices) if prices else None,
        "high": max(prices) if prices else None,
        "last_price": max(by_ts, key=lambda r: r["ts"])["price"] if by_ts else None,
        "first_price": min(by_ts, key=lambda r: r["ts"])["price"] if by_ts else None,
    }


trade = st.fixed_dictionaries(
    {
        "price": st.one_of(st.none(), st.integers(-1000, 1000)),
        "qty": st.one_of(st.none(), st.integers(0, 10**6)),
        # distinct timestamps keep max_by/min_by unambiguous (a tie is the later record's, Spark's is any)
        "ts": st.none(),
    }
)


@settings(max_examples=200, deadline=None)
@given(st.lists(trade, min_size=1, max_size=30), st.randoms(use_true_random=False))
def test_an_aggregate_folded_one_record_at_a_time_equals_spark_over_all(rows: list[dict], rnd: random.Random) -> None:
    stamps = rnd.sample(range(10_000), len(rows))
    rows = [{**row, "ts": None if i % 7 == 3 else stamps[i]} for i, row in enumerate(rows)]
    stored = fold(AGGREGATE, rows)
    assert stored is not None
    assert json.loads(value_bytes(stored)) == spark_like_aggregate(rows)


@settings(max_examples=100, deadline=None)
@given(st.lists(trade, min_size=2, max_size=30), st.data())
def test_a_fold_split_anywhere_continues_from_its_stored_state(rows: list[dict], data: st.DataObject) -> None:
    rows = [{**row, "ts": i * 3 % 17} for i, row in enumerate(rows)]
    cut = data.draw(st.integers(1, len(rows) - 1))
    first = fold(AGGREGATE, rows[:cut])
    # The stored bytes are all that carries over (a node restarting from LMDB, or a batch version).
    resumed = first
    for row in rows[cut:]:
        resumed = AGGREGATE.apply(resumed, row) or resumed
    assert resumed == fold(AGGREGATE, rows)


def test_latest_keeps_the_greatest_order_by_and_a_tie_goes_to_the_later_record() -> None:
    stored = fold(LATEST, [{"ts": 5, "route": "A", "x": 1}, {"ts": 3, "route": "B"}])
    assert value_bytes(stored or b"") == b'{"ts":5,"route":"A"}'
    assert LATEST.apply(stored, {"ts": 4, "route": "C"}) is None  # older: changes nothing
    tie = LATEST.apply(stored, {"ts": 5, "route": "D"})
    assert tie is not None and value_bytes(tie) == b'{"ts":5,"route":"D"}'
    assert decode_state(tie) == [5]


def test_latest_without_columns_keeps_every_field_but_the_key() -> None:
    merge = Merge("latest", "customer", order_by="ts", time_type="timestamp")
    stored = merge.apply(None, {"customer": "c1", "ts": "2026-01-02T00:00:00Z", "seat": "3A"})
    assert stored is not None
    assert json.loads(value_bytes(stored)) == {"ts": "2026-01-02T00:00:00Z", "seat": "3A"}
    assert merge.apply(stored, {"ts": "2026-01-01T23:59:59Z", "seat": "9C"}) is None


def test_latest_orders_time_text_by_its_instant_whatever_its_offset() -> None:
    merge = Merge("latest", "id", order_by="ts", time_type="timestamp")
    early = {"id": "early", "ts": "2024-04-29T10:00:00+02:00"}  # 08:00Z
    later = {"id": "later", "ts": "2024-04-29T09:00:00Z"}
    for rows in ([early, later], [later, early]):
        stored = fold(merge, rows)
        assert json.loads(value_bytes(stored or b"")) == {"ts": later["ts"]}
        # the state is the instant, in microseconds since the epoch
        assert decode_state(stored or b"") == [1_714_381_200_000_000]


def test_an_untyped_latest_orders_numbers_and_refuses_text() -> None:
    merge = Merge("latest", "id", order_by="ts")
    stored = fold(merge, [{"ts": 2.5, "v": 1}, {"ts": 2, "v": 2}])
    assert json.loads(value_bytes(stored or b"")) == {"ts": 2.5, "v": 1}
    with pytest.raises(BadRecord) as caught:
        merge.apply(stored, {"ts": "2024-04-29T09:00:00Z", "v": 3})
    assert caught.value.reason is Reason.BAD_TYPE
    assert 'order_by_type = "timestamp"' in str(caught.value)


@pytest.mark.parametrize(
    ("time_type", "raw"),
    [
        ("timestamp", "29/04/2024 09:00"),
        ("timestamp", "2024-04-29T09:00+02:00"),  # an offset needs the seconds
        ("timestamp", "2024-04-29T09:00:00+19:00"),
        ("timestamp", True),
        ("timestamp", [1]),
        ("date", "2024-04-29T09:00:00Z"),
        ("date", 19842),
        ("integer", "1.5"),
        ("integer", 1.5),
        ("integer", 2**63),
    ],
)
def test_an_ordering_value_that_cannot_be_typed_is_refused(time_type: str, raw: object) -> None:
    merge = Merge("latest", "id", order_by="ts", time_type=time_type)
    with pytest.raises(BadRecord) as caught:
        merge.apply(None, {"ts": raw})
    assert caught.value.reason is Reason.BAD_TYPE
    assert str(caught.value).startswith("'ts' = ")


def test_a_history_time_python_cannot_show_is_refused_not_raised() -> None:
    for time_type, raw in (("date", "0000-02-29"), ("timestamp", "0000-12-31T23:00:00Z")):
        merge = Merge("history", "id", order_by="t", columns=("v",), time_type=time_type)
        with pytest.raises(BadRecord) as caught:
            merge.history_row({"t": raw, "v": 1})
        assert caught.value.reason is Reason.BAD_TYPE


def test_max_by_and_min_by_order_by_the_instant() -> None:
    merge = Merge(
        "aggregate",
        "asset",
        aggregates=(
            Aggregate("last", "max_by", "price", "ts", "timestamp"),
            Aggregate("first", "min_by", "price", "ts", "timestamp"),
        ),
    )
    rows = [
        {"price": 1, "ts": "2024-04-29T10:00:00+02:00"},  # 08:00Z
        {"price": 2, "ts": "2024-04-29T09:00:00Z"},
        {"price": 3, "ts": "2024-04-29T03:00:00.5-05:30"},  # 08:30:00.5Z
        {"price": 4, "ts": 1_714_374_000_000},  # epoch ms: 07:00Z
    ]
    stored = fold(merge, rows)
    assert json.loads(value_bytes(stored or b"")) == {"last": 2, "first": 4}
    assert decode_state(stored or b"") == [1_714_381_200_000_000, 1_714_374_000_000_000]


@pytest.mark.parametrize(
    ("merge", "row", "reason"),
    [
        (LATEST, {"route": "A"}, Reason.MISSING_COLUMN),
        (LATEST, {"ts": 1}, Reason.MISSING_COLUMN),
        (LATEST, {"ts": [1], "route": "A"}, Reason.BAD_TYPE),
        (AGGREGATE, {"price": 1, "ts": 1}, Reason.MISSING_COLUMN),
        (AGGREGATE, {"price": 1, "qty": "many", "ts": 1}, Reason.BAD_TYPE),
        (AGGREGATE, {"price": True, "qty": 1, "ts": 1}, Reason.BAD_TYPE),
    ],
)
def test_rows_that_cannot_be_folded_are_refused_with_a_reason(merge: Merge, row: dict, reason: Reason) -> None:
    before = merge.apply(None, {"price": 1, "qty": 1, "ts": 0, "route": "Z"})
    with pytest.raises(BadRecord) as caught:
        merge.apply(before, row)
    assert caught.value.reason is reason


def test_value_bytes_cut_exactly_at_the_state_and_batch_values_pass_whole() -> None:
    stored = AGGREGATE.apply(None, {"price": 7, "qty": 2, "ts": 9})
    assert stored is not None and STATE_SEPARATOR in stored
    assert json.loads(value_bytes(stored))["last_price"] == 7
    batch_value = b'{"a":"\\u0000 is escaped in JSON"}'
    assert value_bytes(batch_value) == batch_value
    assert decode_state(batch_value) is None
    # a value holding a NUL character is stored escaped, so it never splits
    assert json.loads(value_bytes(LATEST.apply(None, {"ts": 1, "route": "a\0b"}) or b"")) == {"ts": 1, "route": "a\0b"}


@pytest.mark.parametrize(
    ("expression", "function", "column", "by"),
    [
        ("count(*)", "count", None, None),
        (" COUNT( qty ) ", "count", "qty", None),
        ("sum(`unit price`)", "sum", "unit price", None),
        ("max_by(price, ts)", "max_by", "price", "ts"),
        ("min_by(price,ts)", "min_by", "price", "ts"),
    ],
)
def test_mergeable_aggregates_parse(expression: str, function: str, column: str | None, by: str | None) -> None:
    agg = parse_aggregate("out", expression)
    assert (agg.function, agg.column, agg.by) == (function, column, by)


@pytest.mark.parametrize(
    "expression",
    ["avg(x)", "sum(*)", "count(distinct x)", "max_by(x)", "sum(x, y)", "sum(x) + 1", "percentile(x, 0.5)", ""],
)
def test_other_aggregates_are_refused_with_the_list_of_mergeable_ones(expression: str) -> None:
    with pytest.raises(LiveSpecError, match=r"count\(\*\), count\(col\), sum\(col\).*min_by\(col, ord\)"):
        parse_aggregate("out", expression)


def test_records_are_read_with_the_partitioner_and_key_format() -> None:
    partitions = 6
    key = b"customer-42"
    home = partition_for(Partitioner.MURMUR2, key, partitions)
    reader = RecordReader(KeyFormat.STRING, Partitioner.MURMUR2, partitions, home)
    assert reader.read(key, b'{"ts":1}') == (key, {"ts": 1})
    assert reader.read(key, None) == (key, None)  # tombstone
    elsewhere = RecordReader(KeyFormat.STRING, Partitioner.MURMUR2, partitions, (home + 1) % partitions)
    cases = [
        (elsewhere, key, b"{}", Reason.MISPLACED),
        (reader, None, b"{}", Reason.NULL_KEY),
        (reader, key, b"not json", Reason.NOT_JSON),
        (reader, key, b"\xff\xfe", Reason.NOT_JSON),
        (reader, key, b"[1, 2]", Reason.NOT_OBJECT),
        (RecordReader(KeyFormat.INT32, Partitioner.MURMUR2, 1, 0), b"abc", b"{}", Reason.BAD_KEY),
    ]
    for r, k, v, reason in cases:
        with pytest.raises(BadRecord) as caught:
            r.read(k, v)
        assert caught.value.reason is reason, (k, v)


def test_the_offset_entry_never_meets_a_key() -> None:
    assert OFFSET_KEY[:1] not in (TAG_KEY, TAG_HASHED)
    assert OFFSET_KEY < TAG_HASHED < TAG_KEY  # it sorts before every key: scans of keys start after it


def test_live_config_round_trips_and_resolves_secret_references() -> None:
    config = LiveConfig(
        topic="trades",
        bootstrap_servers="kafka-0:9092",
        merge=AGGREGATE,
        offsets=(0, 17, 3),
        kafka={"security.protocol": "SASL_SSL", "sasl.password": "${KAFKA_PASSWORD}"},
        on_bad_record="stop",
        catch_up_records=50,
    )
    doc = json.loads(json.dumps(config.to_json()))
    assert LiveConfig.from_json(doc) == config
    assert "s3cret" not in json.dumps(doc)
    resolved = config.consumer_settings({"KAFKA_PASSWORD": "s3cret"})
    assert resolved == {"security.protocol": "SASL_SSL", "sasl.password": "s3cret"}
    with pytest.raises(LiveSpecError, match="KAFKA_PASSWORD"):
        config.consumer_settings({})
    with pytest.raises(ValueError, match="on_bad_record"):
        LiveConfig.from_json({**doc, "on_bad_record": "ignore"})


def test_kafka_settings_keep_secrets_out_and_spell_values_for_librdkafka() -> None:
    assert check_kafka_settings({"fetch.wait.max.ms": 10, "check.crcs": True, "sasl.password": "${PW}"}) == {
        "fetch.wait.max.ms": "10",
        "check.crcs": "true",
        "sasl.password": "${PW}",
    }
    with pytest.raises(LiveSpecError, match="secret"):
        check_kafka_settings({"sasl.password": "hunter2"})
    with pytest.raises(LiveSpecError, match="keyroute's own"):
        check_kafka_settings({"group.id": "mine"})
    with pytest.raises(LiveSpecError, match="string, number or boolean"):
        check_kafka_settings({"x": [1]})


def test_integers_beyond_64_bits_stay_exact_and_non_finite_numbers_are_refused() -> None:
    big = 2**70 + 1
    reader = RecordReader(KeyFormat.STRING, Partitioner.MURMUR2, 1, 0)
    _, row = reader.read(b"k", f'{{"qty": {big}, "price": 1, "ts": 1}}'.encode())
    assert row is not None and row["qty"] == big
    stored = AGGREGATE.apply(None, row)
    stored = AGGREGATE.apply(stored, row)
    assert stored is not None and json.loads(value_bytes(stored))["volume"] == 2 * big
    for text in (b'{"ts": 1e999}', b'{"ts": NaN}', b'{"ts": 12345678901234567890e999}'):
        with pytest.raises(BadRecord) as caught:
            reader.read(b"k", text)
        assert caught.value.reason is Reason.NOT_JSON, text
    huge = AGGREGATE.apply(None, {"price": 1, "qty": 1.5e308, "ts": 1})
    with pytest.raises(BadRecord, match="overflows") as caught:
        AGGREGATE.apply(huge, {"price": 1, "qty": 1.5e308, "ts": 2})
    assert caught.value.reason is Reason.BAD_TYPE


def test_keys_are_proven_once_and_a_misplaced_key_is_refused_every_time() -> None:
    partitions = 4
    key = b"customer-7"
    home = partition_for(Partitioner.MURMUR2, key, partitions)
    elsewhere = RecordReader(KeyFormat.STRING, Partitioner.MURMUR2, partitions, (home + 1) % partitions)
    for _ in range(3):
        with pytest.raises(BadRecord) as caught:
            elsewhere.read(key, b"{}")
        assert caught.value.reason is Reason.MISPLACED
    reader = RecordReader(KeyFormat.STRING, Partitioner.MURMUR2, partitions, home)
    assert [reader.read(key, b'{"n": 1}') for _ in range(3)] == [(key, {"n": 1})] * 3
