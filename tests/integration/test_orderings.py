"""Rows ordered by time text are ordered by its instant, whatever the offset it is written in: a `latest`
store's winner and `max_by`/`min_by` built by the real pipeline (the session's SparkSession and ZooKeeper),
and folded by a real `keyroute node` consuming librdkafka's mock cluster; a text that cannot be typed fails
the build (or, in the live fold, is skipped and counted), never compared as text."""

from __future__ import annotations

import datetime as dt
import json
import logging
import random
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from pyspark.sql import SparkSession

from keyroute.dev.kafka_mock import MockKafka
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.pipeline.build import build
from keyroute.pipeline.errors import DataError, PipelineError, SpecError
from keyroute.runtime.settings import ZkSettings
from keyroute.storage.live import value_bytes
from keyroute.storage.snapshot import read_manifest
from keyroute.storage.timeline import TimeType, key_of_part, key_part
from tests.integration.test_live_pipeline import (
    PARTITIONS,
    build_spec,
    decoded,
    fold,
    produce,
    stored_values,
)
from tests.integration.test_pipeline import assert_nothing_published, write_jsonl, write_spec
from tests.integration.test_timeline_pipeline import entries_by_key
from tests.util import Proc, free_port, wait_for

pytestmark = pytest.mark.integration

EARLY = {"id": "early", "ts": "2024-04-29T10:00:00+02:00"}  # 08:00Z, and the greater text
LATER = {"id": "later", "ts": "2024-04-29T09:00:00Z"}


def instant(text: str) -> dt.datetime:
    moment = dt.datetime.fromisoformat(text)
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=dt.UTC)


def values(snapshot: str) -> dict[str, Any]:
    """Every key's answer value in a version, as a node serves it."""
    stored = stored_values(Path(snapshot), read_manifest(Path(snapshot)))
    return {key: json.loads(value_bytes(raw)) for key, raw in stored.items()}


# Keys whose rows' text order is not their time order: offsets, fractions of a second, a bare date.
ROWS = [
    {"k": "K", **EARLY, "seq": "9"},
    {"k": "K", **LATER, "seq": "10"},
    {"k": "F", "id": "f1", "ts": "2024-04-29T09:00:00.5Z", "seq": "-3"},
    {"k": "F", "id": "f2", "ts": "2024-04-29 14:30:00.25+05:30", "seq": "+7"},  # 09:00:00.25Z
    {"k": "F", "id": "f3", "ts": "2024-04-29T03:30:00.750-0530", "seq": "8"},  # 09:00:00.75Z
    {"k": "D", "id": "d1", "ts": "2024-04-29", "seq": "2"},  # 00:00Z
    {"k": "D", "id": "d2", "ts": "2024-04-28T23:00:00-02", "seq": "1"},  # 2024-04-29T01:00Z
    {"k": "N", "id": "n1", "ts": None, "seq": None},
    {"k": "N", "id": "n2", "ts": "1999-12-31T23:59:59.999999999+00:00", "seq": "0"},
]


def test_time_text_in_any_offset_orders_latest_and_max_by_by_its_instant(
    spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_jsonl(tmp_path / "events.json", ROWS)
    common = {"source": "events.json", "format": "json", "key": "k", "partitions": 2}
    stores = {
        "typed": {**common, "mode": "latest", "order_by": "ts", "order_by_type": "timestamp", "columns": ["id"]},
        "found": {**common, "mode": "latest", "order_by": "ts", "columns": ["id", "ts"]},  # no order_by_type
        "by_seq": {**common, "mode": "latest", "order_by": "seq", "columns": ["id"]},  # integer text
        "extremes": {
            **common,
            "mode": "aggregate",
            "aggregations": {"last": "max_by(id, ts)", "first": "min_by(id, `ts`)", "n": "count(*)"},
        },
    }
    spec = write_spec(tmp_path / "stores.toml", stores)
    with caplog.at_level(logging.INFO, logger="keyroute.pipeline.ordering"):
        published = {p.store: p for p in build(spec, zk_settings, str(tmp_path / "out"), spark=spark)}

    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in ROWS:
        by_key[row["k"]].append(row)
    timed = {k: [r for r in rows if r["ts"] is not None] for k, rows in by_key.items()}
    newest = {k: max(rows, key=lambda r: instant(r["ts"])) for k, rows in timed.items()}
    oldest = {k: min(rows, key=lambda r: instant(r["ts"])) for k, rows in timed.items()}
    assert newest["K"]["id"] == "later" and newest["F"]["id"] == "f3" and newest["D"]["id"] == "d2"

    assert values(published["typed"].snapshot) == {k: {"id": r["id"]} for k, r in newest.items()}
    assert values(published["found"].snapshot) == {k: {"id": r["id"], "ts": r["ts"]} for k, r in newest.items()}
    # Integer text is ordered as integers ("10" after "9", "+7" before "8").
    by_seq = {k: max((r for r in rows if r["seq"]), key=lambda r: int(r["seq"])) for k, rows in by_key.items()}
    assert values(published["by_seq"].snapshot) == {k: {"id": r["id"]} for k, r in by_seq.items()}
    assert values(published["extremes"].snapshot) == {
        k: {"last": newest[k]["id"], "first": oldest[k]["id"], "n": len(by_key[k])} for k in by_key
    }

    said = [r.getMessage() for r in caplog.records if r.name == "keyroute.pipeline.ordering"]
    assert (
        "store 'found': order_by column 'ts' is text without order_by_type; every value is an ISO 8601 time, so it "
        'is ordered as timestamp (order_by_type = "timestamp" says so)'
    ) in said
    assert any(
        m.startswith("store 'by_seq': order_by column 'seq' is text") and "ordered as integer" in m for m in said
    )
    assert any(m.startswith("store 'extremes': max_by/min_by ordering column 'ts' is text") for m in said)
    assert not any("'typed'" in m for m in said)  # a declared type is not news


def test_windowed_and_history_stores_type_their_text_orderings_too(
    spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path
) -> None:
    rows = [row for row in ROWS if row["ts"] is not None]  # a timeline's rows all have a time
    write_jsonl(tmp_path / "events.json", rows)
    common = {"source": "events.json", "format": "json", "key": "k", "partitions": 2}
    stores = {
        "per_day": {
            **common,
            "mode": "windowed",
            "order_by": "ts",
            "window": "1 day",
            "aggregations": {"last": "max_by(id, ts)", "first": "min_by(id, seq)"},
        },
        "by_seq": {**common, "mode": "history", "order_by": "seq", "columns": ["id"]},
    }
    spec = write_spec(tmp_path / "stores.toml", stores)
    published = {p.store: p for p in build(spec, zk_settings, str(tmp_path / "out"), spark=spark)}

    windows = entries_by_key(Path(published["per_day"].snapshot), 2, KeyFormat.STRING)

    def window(row: dict[str, Any]) -> tuple[str, dt.date]:  # the key's window: the UTC day
        return row["k"], instant(row["ts"]).astimezone(dt.UTC).date()

    # the row of each window with the latest ts, and with the least seq (the last one written wins)
    last = {window(r): r for r in sorted(rows, key=lambda r: instant(r["ts"]))}
    first = {window(r): r for r in sorted(rows, key=lambda r: -int(r["seq"]))}
    found = {
        (key_of_part(part), dt.date.fromisoformat(json.loads(v)["start"][:10])): json.loads(v)["value"]
        for part, entries in windows.items()
        for _, v in entries
    }
    assert found == {(k.encode(), day): {"last": last[k, day]["id"], "first": first[k, day]["id"]} for k, day in last}

    history = read_manifest(Path(published["by_seq"].snapshot)).timeline
    assert history is not None and history.time_type is TimeType.INTEGER  # every seq is integer text
    entries = entries_by_key(Path(published["by_seq"].snapshot), 2, KeyFormat.STRING)
    for key in {r["k"] for r in rows}:
        want = sorted((int(r["seq"]), r["id"]) for r in rows if r["k"] == key)
        assert [(t, json.loads(v)["id"]) for t, v in entries[key_part(key.encode())]] == want


@pytest.mark.parametrize(
    ("fields", "rows", "error", "message"),
    [
        pytest.param(
            {"mode": "latest", "order_by": "ts"},
            [LATER, {"id": "x", "ts": "29/04/2024 09:00"}],
            DataError,
            "store 'trips': order_by column 'ts' holds '29/04/2024 09:00' ({dir}/events.json line 2), which is not "
            "an ISO 8601 timestamp such as 2024-06-11T10:00:00Z, 2024-06-11 12:00:00.250+02:00 or 2024-06-11 (a "
            'text column is ordered by its type: order_by_type = "timestamp", or "date", "integer")',
            id="text-without-type",
        ),
        pytest.param(
            {"mode": "latest", "order_by": "ts", "order_by_type": "timestamp"},
            [EARLY, LATER, {"id": "x", "ts": "2024-04-29T09:00+02:00"}],
            DataError,
            "store 'trips': order_by column 'ts' holds '2024-04-29T09:00+02:00' ({dir}/events.json line 3), which "
            "is not an ISO 8601 timestamp such as 2024-06-11T10:00:00Z, 2024-06-11 12:00:00.250+02:00 or 2024-06-11",
            id="declared-type",
        ),
        pytest.param(
            {"mode": "aggregate", "aggregations": {"last": "max_by(id, ts)"}, "order_by_type": "date"},
            [{"id": "x", "ts": "2024-04-29"}, LATER],
            DataError,
            "store 'trips': max_by/min_by ordering column 'ts' holds '2024-04-29T09:00:00Z' ({dir}/events.json "
            "line 2), which is not an ISO 8601 date such as 2024-06-11",
            id="max_by-declared-date",
        ),
        pytest.param(
            {"mode": "aggregate", "aggregations": {"last": "max_by(id, concat(ts, ''))"}},
            [LATER],
            SpecError,
            "store 'trips': a max_by/min_by is ordered by the text expression \"concat(ts, '')\", which would "
            "compare as text: order it by a column (read as order_by_type) or by a typed expression such as "
            "to_timestamp(concat(ts, ''))",
            id="text-expression",
        ),
    ],
)
def test_an_ordering_that_cannot_be_typed_fails_the_build_in_one_line(
    spark: SparkSession,
    zk_settings: ZkSettings,
    tmp_path: Path,
    fields: dict[str, Any],
    rows: list[dict[str, Any]],
    error: type[PipelineError],
    message: str,
) -> None:
    write_jsonl(tmp_path / "events.json", [{"k": "K", **row} for row in rows])
    spec = write_spec(
        tmp_path / "stores.toml",
        {"trips": {"source": "events.json", "format": "json", "key": "k", "partitions": 2, **fields}},
    )
    with pytest.raises(error) as err:
        build(spec, zk_settings, str(tmp_path / "out"), spark=spark)
    assert str(err.value) == message.format(dir=tmp_path)
    assert_nothing_published(zk_settings, tmp_path / "out", ["trips"])


# --- the live fold ------------------------------------------------------------------------------------------


def key_in(partition: int, prefix: str) -> str:
    return next(
        f"{prefix}{i}"
        for i in range(1000)
        if partition_for(Partitioner.MURMUR2, f"{prefix}{i}".encode(), PARTITIONS) == partition
    )


def test_a_live_store_s_node_orders_records_by_their_instant_and_skips_untyped_ones(
    zk_settings: ZkSettings, kafka: MockKafka, kafka_topic: Callable[[int], str], tmp_path: Path
) -> None:
    topic = kafka_topic(PARTITIONS)
    live = {"topic": topic, "bootstrap_servers": kafka.bootstrap_servers, "start": "earliest"}
    common = {"key": "user", "partitions": PARTITIONS, "order_by_type": "timestamp"}
    spec = write_spec(
        tmp_path / "stores.toml",
        {
            "latest": {**common, "mode": "latest", "order_by": "ts", "columns": ["id", "ts"]},
            "extremes": {
                **common,
                "mode": "aggregate",
                "aggregations": {"last": "max_by(id, ts)", "first": "min_by(id, ts)", "n": "count(*)"},
            },
        },
    )
    with spec.open("a", encoding="utf-8") as fh:
        for store in ("latest", "extremes"):
            fh.write(f"[stores.{store}.live]\n" + "".join(f"{f} = {json.dumps(v)}\n" for f, v in live.items()))
    versions = {v.store: v for v in build(spec, zk_settings, str(tmp_path / "out"))}
    merge = read_manifest(Path(versions["latest"].snapshot)).live.merge  # type: ignore[union-attr]
    assert merge.time_type == "timestamp"
    aggregates = read_manifest(Path(versions["extremes"].snapshot)).live.merge.aggregates  # type: ignore[union-attr]
    assert [a.by_type for a in aggregates] == ["timestamp", "timestamp", None]

    forward, backward, bad = key_in(0, "f"), key_in(1, "b"), key_in(0, "x")
    records: list[tuple[str, dict[str, Any]]] = [
        (forward, {"user": forward, **EARLY}),
        (forward, {"user": forward, **LATER}),
        (backward, {"user": backward, **LATER}),
        (backward, {"user": backward, **EARLY}),
        (backward, {"user": backward, "id": "ms", "ts": 1_714_377_600_000}),  # 08:00Z in epoch ms: not later
        (bad, {"user": bad, "id": "first", "ts": "2024-04-29T07:00:00Z"}),
        (bad, {"user": bad, "id": "untyped", "ts": "29/04/2024 09:00"}),  # skipped, counted
    ]
    produce(kafka, topic, records)
    port = free_port()
    node = Proc(
        ["node", "--zk", zk_settings.connect_string, "--node-id", "n1", "--port", str(port),
         "--data-dir", str(tmp_path / "data"), "--zk-session-timeout-s", "4"],
        tmp_path / "node.log",
    ).start()  # fmt: skip
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10, trust_env=False) as http:

            def partitions(store: str) -> dict[int, dict[str, Any]]:
                try:
                    rows = http.get("/admin/partition-map").json()["local"].get(store, [])
                except (httpx.HTTPError, ValueError):
                    return {}
                return {row["partition"]: row["live"] for row in rows if "live" in row}

            def applied() -> bool:  # the last offset of each partition: 4 records in 0, 3 in 1
                return all(
                    partitions(store).get(p, {}).get("offset") == last
                    for store in ("latest", "extremes")
                    for p, last in ((0, 3), (1, 2))
                )

            wait_for(applied, timeout_s=60, message=node.output()[-4000:])

            def value(store: str, key: str) -> Any:
                answer = http.get(f"/stores/{store}/keys/{key}")
                assert answer.status_code == 200, answer.text
                return answer.json()["value"]

            assert value("latest", forward) == {"id": "later", "ts": LATER["ts"]}
            assert value("latest", backward) == {"id": "later", "ts": LATER["ts"]}
            assert value("latest", bad) == {"id": "first", "ts": "2024-04-29T07:00:00Z"}
            assert value("extremes", forward) == {"last": "later", "first": "early", "n": 2}
            assert value("extremes", backward)["last"] == "later"
            assert value("extremes", bad) == {"last": "first", "first": "first", "n": 1}
            for store in ("latest", "extremes"):
                status = partitions(store)
                assert status[0]["skipped"] == {"bad_type": 1} and status[1]["skipped"] == {}
                assert status[0]["last_bad_record"].startswith("offset 3: bad_type: 'ts' = '29/04/2024 09:00' is not")
    finally:
        node.stop()


def test_a_hybrid_store_s_batch_part_and_live_fold_order_time_text_alike(
    spark: SparkSession, zk_settings: ZkSettings, kafka: MockKafka, kafka_topic: Callable[[int], str], tmp_path: Path
) -> None:
    """The archive's values (built by Spark) hold the merge state the fold of the same records holds, and the
    fold continues from them to what it gives over every record: both read each text as the same instant."""
    rng = random.Random(42)
    base = dt.datetime(2024, 4, 29, 8, tzinfo=dt.UTC)
    events = []
    for i in range(240):
        asset = f"A{rng.randrange(8)}"
        moment = base + dt.timedelta(seconds=rng.randrange(30), microseconds=rng.choice([0, 250_000, 999_999]))
        zone = dt.timezone(dt.timedelta(minutes=rng.choice([0, 120, -330, 345, -600])))
        text = moment.astimezone(zone).isoformat()  # many instants spelled several ways (ties too)
        events.append((asset, {"asset": asset, "ts": text.replace("+00:00", "Z"), "seq": i}))
    topic = kafka_topic(PARTITIONS)
    placed = produce(kafka, topic, events)
    cuts = {0: 20, 1: 0, 2: 50}
    by_partition: dict[int, list[tuple[int, dict[str, Any]]]] = defaultdict(list)
    for (partition, offset), (_, row) in zip(placed, events, strict=True):
        by_partition[partition].append((offset, row))
    archive = [
        {**row, "kafka_partition": p, "kafka_offset": offset}
        for p, records in by_partition.items()
        for offset, row in records[: cuts[p]]
    ]
    write_jsonl(tmp_path / "archive" / "part-1.json", archive)
    common = {
        "source": "archive",
        "format": "json",
        "key": "asset",
        "partitions": PARTITIONS,
        "source_partition_column": "kafka_partition",
        "source_offset_column": "kafka_offset",
        "order_by_type": "timestamp",
    }
    live = {"topic": topic, "bootstrap_servers": kafka.bootstrap_servers}
    for name, fields in (
        ("latest", {"mode": "latest", "order_by": "ts", "columns": ["ts", "seq"]}),
        ("extremes", {"mode": "aggregate", "aggregations": {"last": "max_by(seq, ts)", "first": "min_by(seq, ts)"}}),
    ):
        spec = build_spec(tmp_path, name, {**common, **fields}, live)
        [published] = build(spec, zk_settings, str(tmp_path / "out"), spark=spark)
        manifest = read_manifest(Path(published.snapshot))
        assert manifest.live is not None
        merge = manifest.live.merge
        batch = stored_values(Path(published.snapshot), manifest)
        for asset in sorted({a for a, _ in events}):
            p = partition_for(Partitioner.MURMUR2, asset.encode(), PARTITIONS)
            archived = [row for _, row in by_partition[p][: cuts[p]] if row["asset"] == asset]
            rest = [row for _, row in by_partition[p][cuts[p] :] if row["asset"] == asset]
            if archived:
                assert decoded(batch[asset]) == decoded(fold(merge, None, archived)), (name, asset)
            assert decoded(fold(merge, batch.get(asset), rest)) == decoded(fold(merge, None, archived + rest))
            everything = archived + rest
            newest = max(instant(r["ts"]) for r in everything)
            winner = json.loads(value_bytes(fold(merge, None, everything) or b""))
            if name == "latest":
                assert instant(winner["ts"]) == newest
            else:
                by_seq = {r["seq"]: instant(r["ts"]) for r in everything}
                assert by_seq[winner["last"]] == newest
                assert by_seq[winner["first"]] == min(by_seq.values())
