"""Building live stores (keyroute.pipeline.build with keyroute.pipeline.live) on a real SparkSession, a real
ZooKeeper and librdkafka's mock cluster: the topic is checked (partition count, reachable, exists) before any
Spark work; a hybrid version records where its archive ends and stores values the nodes' fold continues
exactly; a live-only version is empty and starts at the topic's watermarks."""

from __future__ import annotations

import json
import random
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import lmdb
import pytest
from pyspark.sql import SparkSession

from keyroute.cluster.partition_map import StoreRecord
from keyroute.dev.kafka_mock import MockKafka
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.pipeline import build as build_module
from keyroute.pipeline.build import KafkaAccess, build
from keyroute.pipeline.errors import PartitionAuditError, PipelineError, SpecError, TopicError
from keyroute.runtime.settings import ZkSettings
from keyroute.storage.live import Merge, decode_state, value_bytes
from keyroute.storage.snapshot import FORMAT_2, Manifest, checksum_file, data_file, existing_versions, read_manifest
from tests.integration.test_pipeline import store_record, write_jsonl, write_spec
from tests.util import Proc, free_port, wait_for

Row = dict[str, Any]
PARTITIONS = 3


def produce(kafka: MockKafka, topic: str, records: Sequence[tuple[str, Row | None]]) -> list[tuple[int, int]]:
    """Produce (key, value) records to the partition murmur2 gives each key, in order; their (partition,
    offset) as the broker acknowledged them."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers, "log_level": 3, "linger.ms": 5})
    acked: dict[int, tuple[int, int]] = {}

    def on_delivery(index: int) -> Callable[[Any, Any], None]:
        def done(err: Any, msg: Any) -> None:
            assert err is None, err
            acked[index] = (msg.partition(), msg.offset())

        return done

    for i, (key, value) in enumerate(records):
        partition = partition_for(Partitioner.MURMUR2, key.encode(), PARTITIONS)
        body = None if value is None else json.dumps(value).encode()
        producer.produce(topic, key=key.encode(), value=body, partition=partition, on_delivery=on_delivery(i))
    assert producer.flush(30) == 0
    return [acked[i] for i in range(len(records))]


def stored_values(snapshot: Path, manifest: Manifest) -> dict[str, bytes]:
    """Every key's stored bytes in a format-2 version (keys as text), opened read-only as a node opens it."""
    found: dict[str, bytes] = {}
    for partition in range(manifest.partitions):
        env = lmdb.open(str((snapshot / data_file(partition)).parent), readonly=True, lock=False, max_dbs=0)
        try:
            with env.begin() as txn:
                for key, value in txn.cursor():
                    assert bytes(key)[:1] == b"=", "string keys are stored whole"
                    found[bytes(key)[1:].decode()] = bytes(value)
        finally:
            env.close()
    return found


def fold(merge: Merge, stored: bytes | None, rows: Sequence[Row]) -> bytes | None:
    for row in rows:
        new = merge.apply(stored, row)
        stored = stored if new is None else new
    return stored


def decoded(stored: bytes | None) -> tuple[Any, Any]:
    return (None, None) if stored is None else (json.loads(value_bytes(stored)), decode_state(stored))


def build_spec(tmp_path: Path, name: str, fields: Mapping[str, Any], live: Mapping[str, Any]) -> Path:
    path = write_spec(tmp_path / "stores.toml", {name: fields})
    with path.open("a", encoding="utf-8") as spec:
        spec.write(f'[stores."{name}".live]\n')
        spec.writelines(f"{field} = {json.dumps(value)}\n" for field, value in live.items())
    return path


@pytest.fixture
def no_spark(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A build of live-only stores must not start Spark."""

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("a live-only build started Spark")

    monkeypatch.setattr(build_module, "create_session", forbidden)
    yield


# --- hybrid stores: the batch part, and the fold continuing on top of it ---------------------------------


def trade_events(rng: random.Random, count: int) -> list[tuple[str, Row]]:
    """Trades over a few assets with many ties on `ts` and some nulls, so tie-breaking and null handling
    both matter."""
    events = []
    for _ in range(count):
        asset = f"A{rng.randrange(12):02d}"
        price = None if rng.random() < 0.1 else round(rng.uniform(1, 100), 2)
        events.append(
            (
                asset,
                {
                    "asset": asset,
                    "ts": None if rng.random() < 0.05 else rng.randrange(20),
                    "price": price,
                    "qty": None if rng.random() < 0.1 else rng.randrange(1, 50),
                    "venue": rng.choice(["x", "y", "z"]),
                },
            )
        )
    return events


HYBRID_STORES: dict[str, dict[str, Any]] = {
    "latest": {
        "mode": "latest",
        "order_by": "ts",
        # no `columns`: every source column but key, partition and offset
    },
    "aggregate": {
        "mode": "aggregate",
        "aggregations": {
            "trades": "count(*)",
            "priced": "count(price)",
            "volume": "sum(qty)",
            "low": "min(price)",
            "high": "max(price)",
            "last_price": "max_by(price, ts)",
            "first_venue": "min_by(venue, ts)",
        },
    },
}


@pytest.mark.parametrize("mode", sorted(HYBRID_STORES))
def test_a_hybrid_version_ends_where_its_archive_ends_and_the_fold_continues_exactly(
    spark: SparkSession,
    zk_settings: ZkSettings,
    kafka: MockKafka,
    kafka_topic: Callable[[int], str],
    tmp_path: Path,
    mode: str,
) -> None:
    topic = kafka_topic(PARTITIONS)
    events = trade_events(random.Random(mode), 400)
    placed = produce(kafka, topic, events)
    # The archive: each partition's records up to a cut that differs per partition (none at all for one).
    cuts = {0: 0, 1: 37, 2: 95}
    by_partition: dict[int, list[tuple[int, Row]]] = defaultdict(list)
    for (partition, offset), (_, row) in zip(placed, events, strict=True):
        by_partition[partition].append((offset, row))
    assert all(len(by_partition[p]) > cuts[p] for p in range(PARTITIONS))
    archive = [
        {**row, "kafka_partition": p, "kafka_offset": offset}
        for p, records in by_partition.items()
        for offset, row in records[: cuts[p]]
    ]
    write_jsonl(tmp_path / "archive" / "part-1.json", archive)
    fields = {
        "source": "archive",
        "format": "json",
        "key": "asset",
        "partitions": PARTITIONS,
        "source_partition_column": "kafka_partition",
        "source_offset_column": "kafka_offset",
        **HYBRID_STORES[mode],
    }
    spec = build_spec(tmp_path, "trades", fields, {"topic": topic, "bootstrap_servers": kafka.bootstrap_servers})

    [published] = build(spec, zk_settings, str(tmp_path / "out"), spark=spark)

    manifest = read_manifest(Path(published.snapshot))
    assert manifest.format == FORMAT_2 and manifest.live is not None
    expected_offsets = tuple(by_partition[p][cuts[p] - 1][0] + 1 if cuts[p] else 0 for p in range(PARTITIONS))
    assert expected_offsets == (0, 37, 95)  # the broker's offsets start at 0 in a new topic
    assert manifest.live.offsets == expected_offsets
    assert published.live_offsets == expected_offsets
    assert (manifest.live.topic, manifest.live.bootstrap_servers) == (topic, kafka.bootstrap_servers)
    record = store_record(zk_settings, "trades")
    assert record is not None and record.live
    merge = manifest.live.merge
    if mode == "latest":
        assert merge.columns == ("price", "qty", "ts", "venue")  # the batch part's answer columns
        assert manifest.value_columns == merge.columns

    batch = stored_values(Path(published.snapshot), manifest)
    assert sum(manifest.rows) == len(batch) == len({row["asset"] for row in archive})
    keys = {key for key, _ in events}
    for key in sorted(keys):
        p = partition_for(Partitioner.MURMUR2, key.encode(), PARTITIONS)
        rows = [row for _, row in by_partition[p] if row["asset"] == key]
        archived = [row for _, row in by_partition[p][: cuts[p]] if row["asset"] == key]
        rest = [row for offset, row in by_partition[p] if offset >= expected_offsets[p] and row["asset"] == key]
        assert len(archived) + len(rest) == len(rows)
        everything = fold(merge, None, rows)
        if archived:
            # The batch part alone is what the fold of the archived records gives, state included.
            assert decoded(batch[key]) == decoded(fold(merge, None, archived)), key
        continued = fold(merge, batch.get(key), rest)
        assert decoded(continued) == decoded(everything), key

    # A real node loads the version, replays the topic from where the archive ends and serves the fold of
    # every record, each answer at the partition's last offset.
    last = {p: max(offset for offset, _ in by_partition[p]) for p in range(PARTITIONS)}
    expected = {key: fold(merge, None, [row for k, row in events if k == key]) for key in keys}
    port = free_port()
    node = Proc(
        ["node", "--zk", zk_settings.connect_string, "--node-id", "n1", "--port", str(port),
         "--data-dir", str(tmp_path / "node"), "--zk-session-timeout-s", "4"],
        tmp_path / "node.log",
    ).start()  # fmt: skip
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10, trust_env=False) as http:

            def served() -> bool:
                try:
                    return http.get("/readyz").status_code == 200
                except httpx.HTTPError:
                    return False

            wait_for(served, timeout_s=60, message=node.output()[-4000:])
            for key in sorted(keys):
                p = partition_for(Partitioner.MURMUR2, key.encode(), PARTITIONS)
                answer = http.get(f"/stores/trades/keys/{key}", params={"min_offset": last[p]})
                assert answer.status_code == 200, (key, answer.text)
                want = expected[key]
                assert want is not None
                assert answer.json()["value"] == json.loads(value_bytes(want)), key
                assert int(answer.headers["X-Keyroute-Offset"]) == last[p]
    finally:
        node.stop()


def test_a_hybrid_source_past_the_end_of_the_topic_fails_the_build(
    spark: SparkSession, zk_settings: ZkSettings, kafka: MockKafka, kafka_topic: Callable[[int], str], tmp_path: Path
) -> None:
    topic = kafka_topic(PARTITIONS)
    produce(kafka, topic, [("k1", {"k": "k1", "ts": 1})])
    p = partition_for(Partitioner.MURMUR2, b"k1", PARTITIONS)
    write_jsonl(tmp_path / "archive.json", [{"k": "k1", "ts": 1, "part": p, "off": 7}])
    fields = {
        "source": "archive.json",
        "format": "json",
        "key": "k",
        "partitions": PARTITIONS,
        "mode": "latest",
        "order_by": "ts",
        "source_partition_column": "part",
        "source_offset_column": "off",
    }
    spec = build_spec(tmp_path, "k", fields, {"topic": topic, "bootstrap_servers": kafka.bootstrap_servers})
    with pytest.raises(TopicError) as err:
        build(spec, zk_settings, str(tmp_path / "out"), spark=spark)
    assert err.value.store == "k"
    assert f"partition {p}: source ends at offset 7, topic at 0" in str(err.value)
    assert store_record(zk_settings, "k") is None
    assert existing_versions(str(tmp_path / "out"), "k") == []


def test_the_audit_still_catches_an_archive_record_in_the_wrong_partition(
    spark: SparkSession, zk_settings: ZkSettings, kafka: MockKafka, kafka_topic: Callable[[int], str], tmp_path: Path
) -> None:
    topic = kafka_topic(PARTITIONS)
    produce(kafka, topic, [("k1", {"k": "k1", "ts": 1}), ("k2", {"k": "k2", "ts": 1})])
    right = partition_for(Partitioner.MURMUR2, b"k1", PARTITIONS)
    wrong = (partition_for(Partitioner.MURMUR2, b"k2", PARTITIONS) + 1) % PARTITIONS
    archive = [{"k": "k1", "ts": 1, "part": right, "off": 0}, {"k": "k2", "ts": 1, "part": wrong, "off": 0}]
    write_jsonl(tmp_path / "archive.json", archive)
    fields = {
        "source": "archive.json",
        "format": "json",
        "key": "k",
        "partitions": PARTITIONS,
        "mode": "latest",
        "order_by": "ts",
        "source_partition_column": "part",
        "source_offset_column": "off",
    }
    spec = build_spec(tmp_path, "k", fields, {"topic": topic, "bootstrap_servers": kafka.bootstrap_servers})
    with pytest.raises(PartitionAuditError) as err:
        build(spec, zk_settings, str(tmp_path / "out"), spark=spark)
    assert err.value.store == "k" and "1 of 2 records" in str(err.value)
    assert store_record(zk_settings, "k") is None


# --- live-only stores: empty versions at the watermarks ----------------------------------------------------


def live_only_fields() -> dict[str, Any]:
    return {"key": "user", "partitions": PARTITIONS, "mode": "latest", "order_by": "ts", "columns": ["ts", "page"]}


def assert_empty_version(snapshot: Path, manifest: Manifest) -> None:
    assert manifest.format == FORMAT_2 and manifest.rows == (0,) * PARTITIONS
    for partition in range(PARTITIONS):
        path = snapshot / data_file(partition)
        checksum = checksum_file(path)
        assert (manifest.bytes[partition], manifest.checksums[partition]) == (checksum.size, checksum.value)
    assert stored_values(snapshot, manifest) == {}


@pytest.mark.parametrize("start", ["earliest", "latest"])
def test_a_live_only_build_publishes_empty_partitions_starting_at_the_watermarks(
    zk_settings: ZkSettings,
    kafka: MockKafka,
    kafka_topic: Callable[[int], str],
    tmp_path: Path,
    no_spark: None,
    start: str,
) -> None:
    topic = kafka_topic(PARTITIONS)
    users = [f"u{i}" for i in range(40)]
    placed = produce(kafka, topic, [(u, {"user": u, "ts": 1, "page": "/"}) for u in users])
    ends = [0] * PARTITIONS
    for partition, offset in placed:
        ends[partition] = max(ends[partition], offset + 1)
    assert all(ends), "every partition got records"
    spec = build_spec(
        tmp_path,
        "clicks",
        live_only_fields(),
        {"topic": topic, "bootstrap_servers": kafka.bootstrap_servers, "start": start},
    )
    output = tmp_path / "out"

    [first] = build(spec, zk_settings, str(output))

    manifest = read_manifest(Path(first.snapshot))
    assert_empty_version(Path(first.snapshot), manifest)
    assert manifest.value_columns == ("ts", "page")
    assert manifest.live is not None
    assert manifest.live.offsets == (tuple(ends) if start == "latest" else (0,) * PARTITIONS)
    assert manifest.live.merge == Merge("latest", "user", order_by="ts", columns=("ts", "page"))
    assert first.describe()["live"] is True and first.rows == 0
    record = store_record(zk_settings, "clicks")
    assert record is not None and record.live and record.version == 1

    # Every build publishes a new version; `latest` follows the topic's end as it grows.
    more = produce(kafka, topic, [(u, {"user": u, "ts": 2, "page": "/2"}) for u in users[:10]])
    for partition, offset in more:
        ends[partition] = max(ends[partition], offset + 1)
    [second] = build(spec, zk_settings, str(output))
    assert second.version == 2 and existing_versions(str(output), "clicks") == [1, 2]
    again = read_manifest(Path(second.snapshot))
    assert_empty_version(Path(second.snapshot), again)
    assert again.live is not None
    assert again.live.offsets == (tuple(ends) if start == "latest" else (0,) * PARTITIONS)
    assert store_record(zk_settings, "clicks").version == 2  # type: ignore[union-attr]


# --- the topic is checked before anything else ------------------------------------------------------------


def test_a_topic_with_another_partition_count_fails_naming_the_store(
    zk_settings: ZkSettings, kafka: MockKafka, kafka_topic: Callable[[int], str], tmp_path: Path, no_spark: None
) -> None:
    topic = kafka_topic(PARTITIONS + 1)
    spec = build_spec(
        tmp_path, "clicks", live_only_fields(), {"topic": topic, "bootstrap_servers": kafka.bootstrap_servers}
    )
    with pytest.raises(SpecError) as err:
        build(spec, zk_settings, str(tmp_path / "out"))
    assert err.value.store == "clicks"
    assert str(err.value) == (
        f"store 'clicks': topic {topic!r} has {PARTITIONS + 1} partitions but the store has {PARTITIONS}: "
        "store partition p is topic partition p, so the counts must be equal"
    )
    assert store_record(zk_settings, "clicks") is None


def test_an_unknown_topic_fails_naming_the_store_and_is_not_created(
    zk_settings: ZkSettings, kafka: MockKafka, tmp_path: Path, no_spark: None
) -> None:
    spec = build_spec(
        tmp_path, "clicks", live_only_fields(), {"topic": "nope-x", "bootstrap_servers": kafka.bootstrap_servers}
    )
    for _ in range(2):  # the first ask must not have created it (brokers may auto-create on metadata requests)
        with pytest.raises(TopicError) as err:
            build(spec, zk_settings, str(tmp_path / "out"))
        assert err.value.store == "clicks"
        assert "topic 'nope-x'" in str(err.value) and "Unknown topic" in str(err.value)


def test_an_unreachable_broker_fails_naming_the_store_and_the_servers(
    zk_settings: ZkSettings, tmp_path: Path, no_spark: None
) -> None:
    servers = f"127.0.0.1:{free_port()}"
    spec = build_spec(tmp_path, "clicks", live_only_fields(), {"topic": "clicks", "bootstrap_servers": servers})
    with pytest.raises(TopicError) as err:
        build(spec, zk_settings, str(tmp_path / "out"), kafka=KafkaAccess({}, timeout_s=1.5))
    assert err.value.store == "clicks"
    message = str(err.value)
    assert f"from Kafka at {servers!r} within 1.5 s" in message
    assert "Connection refused" in message  # librdkafka's own words on why
    assert store_record(zk_settings, "clicks") is None


def test_secret_settings_come_from_the_environment_given(
    zk_settings: ZkSettings, kafka: MockKafka, kafka_topic: Callable[[int], str], tmp_path: Path, no_spark: None
) -> None:
    topic = kafka_topic(PARTITIONS)
    path = build_spec(
        tmp_path, "clicks", live_only_fields(), {"topic": topic, "bootstrap_servers": kafka.bootstrap_servers}
    )
    with path.open("a", encoding="utf-8") as spec:
        # A setting the mock cluster ignores (no SASL): what matters is where its value comes from.
        spec.write('kafka = { "sasl.password" = "${CLICKS_KAFKA_PASSWORD}" }\n')
    with pytest.raises(TopicError) as err:
        build(path, zk_settings, str(tmp_path / "out"))
    assert "names ${CLICKS_KAFKA_PASSWORD}, which is not set" in str(err.value)

    [published] = build(
        path, zk_settings, str(tmp_path / "out"), kafka=KafkaAccess({"CLICKS_KAFKA_PASSWORD": "s3cret"})
    )
    manifest_text = (Path(published.snapshot) / "manifest.json").read_text()
    assert "s3cret" not in manifest_text and "${CLICKS_KAFKA_PASSWORD}" in manifest_text
    record = store_record(zk_settings, "clicks")
    assert isinstance(record, StoreRecord) and record.live


def test_a_bad_live_spec_fails_before_kafka_zookeeper_or_spark(tmp_path: Path, no_spark: None) -> None:
    fields = {**live_only_fields(), "snapshot_format": 1}
    spec = build_spec(tmp_path, "clicks", fields, {"topic": "t", "bootstrap_servers": "127.0.0.1:1"})
    zk = ZkSettings(hosts=f"127.0.0.1:{free_port()}", chroot="/x", session_timeout_s=1.0)
    with pytest.raises(PipelineError) as err:
        build(spec, zk, str(tmp_path / "out"))
    assert isinstance(err.value, SpecError) and "'snapshot_format' must be 2 for a live store" in str(err.value)


def test_a_live_only_history_store_is_built_and_its_node_appends_every_record(
    zk_settings: ZkSettings,
    kafka: MockKafka,
    kafka_topic: Callable[[int], str],
    tmp_path: Path,
    no_spark: None,
) -> None:
    topic = kafka_topic(PARTITIONS)
    fields = {
        "key": "user",
        "partitions": PARTITIONS,
        "mode": "history",
        "order_by": "ts",
        "order_by_type": "timestamp",
        "columns": ["page"],
        "retention": "4 rows",
    }
    spec = build_spec(
        tmp_path, "visits", fields, {"topic": topic, "bootstrap_servers": kafka.bootstrap_servers, "start": "earliest"}
    )
    [version] = build(spec, zk_settings, str(tmp_path / "out"))
    manifest = read_manifest(Path(version.snapshot))
    assert_empty_version(Path(version.snapshot), manifest)
    assert manifest.timeline is not None and manifest.timeline.kind.value == "history"
    assert manifest.live is not None and manifest.live.merge.mode == "history"
    assert (manifest.live.merge.time_type, manifest.live.merge.retention_count) == ("timestamp", 4)
    assert manifest.value_columns == ("ts", "page")
    record = store_record(zk_settings, "visits")
    assert record is not None and record.timeline == manifest.timeline

    base_ms = 1_718_100_000_000
    records = [(f"u{i % 5}", {"user": f"u{i % 5}", "ts": base_ms + i * 1000, "page": f"/{i}"}) for i in range(30)]
    records.append(("u1", {"user": "u1", "ts": "2024-06-11T10:00:30.5Z", "page": "/iso"}))  # ISO 8601 text
    records.append(("u1", {"user": "u1", "ts": base_ms + 30_000, "page": "/late"}))  # before /iso in time
    produce(kafka, topic, records)
    port = free_port()
    node = Proc(
        ["node", "--zk", zk_settings.connect_string, "--node-id", "n1", "--port", str(port),
         "--data-dir", str(tmp_path / "data"), "--zk-session-timeout-s", "4"],
        tmp_path / "node.log",
    ).start()  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}/stores/visits/keys/u3/history"
        wanted = [r for k, r in records if k == "u3"][-4:]  # the newest 4 rows are kept

        def rows() -> list[dict[str, Any]]:
            response = httpx.get(url, timeout=5)
            return response.json()["rows"] if response.status_code == 200 else []

        wait_for(lambda: [r["page"] for r in rows()] == [r["page"] for r in wanted], timeout_s=60, message="rows")
        assert rows()[0]["ts"].endswith("Z") and rows()[0]["ts"].startswith("2024-06-11T10:00:")
        u1 = url.replace("/u3/", "/u1/")
        wait_for(lambda: "/late" in [r["page"] for r in httpx.get(u1, timeout=5).json()["rows"]], 30, message="u1")
        recent = httpx.get(u1, params={"from": "2024-06-11T10:00:27Z"}, timeout=5).json()["rows"]
        assert [r["page"] for r in recent] == ["/late", "/iso"]  # in time order, not in arrival order
        assert recent[1]["ts"] == "2024-06-11T10:00:30.500Z"
    finally:
        node.stop()


def test_a_hybrid_history_store_holds_the_archive_and_its_node_appends_the_rest_once(
    spark: SparkSession,
    zk_settings: ZkSettings,
    kafka: MockKafka,
    kafka_topic: Callable[[int], str],
    tmp_path: Path,
) -> None:
    topic = kafka_topic(PARTITIONS)
    rng = random.Random(31)
    events = [
        (f"A{n % 7}", {"asset": f"A{n % 7}", "ts": rng.randrange(50), "qty": n}) for n in range(300)
    ]  # times repeat across the archive's end: rows of equal time are all kept
    placed = produce(kafka, topic, events)
    cuts = {0: 0, 1: 21, 2: 60}
    by_partition: dict[int, list[tuple[int, Row]]] = defaultdict(list)
    for (partition, offset), (_, row) in zip(placed, events, strict=True):
        by_partition[partition].append((offset, row))
    archive = [
        {**row, "kafka_partition": p, "kafka_offset": offset}
        for p, records in by_partition.items()
        for offset, row in records[: cuts[p]]
    ]
    write_jsonl(tmp_path / "archive" / "part-1.json", archive)
    fields = {
        "source": "archive",
        "format": "json",
        "key": "asset",
        "partitions": PARTITIONS,
        "source_partition_column": "kafka_partition",
        "source_offset_column": "kafka_offset",
        "mode": "history",
        "order_by": "ts",
        "columns": ["qty"],
    }
    spec = build_spec(tmp_path, "fills", fields, {"topic": topic, "bootstrap_servers": kafka.bootstrap_servers})
    [published] = build(spec, zk_settings, str(tmp_path / "out"), spark=spark)
    manifest = read_manifest(Path(published.snapshot))
    assert manifest.timeline is not None and manifest.live is not None
    assert manifest.live.merge.mode == "history" and manifest.live.merge.time_type == "integer"
    assert sum(manifest.rows) == len(archive)

    port = free_port()
    node = Proc(
        ["node", "--zk", zk_settings.connect_string, "--node-id", "n1", "--port", str(port),
         "--data-dir", str(tmp_path / "node"), "--zk-session-timeout-s", "4"],
        tmp_path / "node.log",
    ).start()  # fmt: skip
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10, trust_env=False) as http:

            def history(key: str) -> list[tuple[int, int]]:
                answer = http.get(f"/stores/fills/keys/{key}/history", params={"limit": "1000"})
                return [(r["ts"], r["qty"]) for r in answer.json()["rows"]] if answer.status_code == 200 else []

            for key in sorted({k for k, _ in events}):
                want = sorted((row["ts"], row["qty"]) for k, row in events if k == key)
                wait_for(lambda key=key, want=want: sorted(history(key)) == want, timeout_s=60, message=key)
                assert [t for t, _ in history(key)] == sorted(t for t, _ in want)
    finally:
        node.stop()


def test_a_live_only_windowed_store_is_built_and_its_node_folds_records_into_windows(
    zk_settings: ZkSettings,
    kafka: MockKafka,
    kafka_topic: Callable[[int], str],
    tmp_path: Path,
    no_spark: None,
) -> None:
    topic = kafka_topic(PARTITIONS)
    fields = {
        "key": "user",
        "partitions": PARTITIONS,
        "mode": "windowed",
        "order_by": "ts",
        "order_by_type": "timestamp",
        "window": "1 minute",
        "aggregations": {"clicks": "count(*)", "spent": "sum(amount)"},
    }
    spec = build_spec(
        tmp_path,
        "per_minute",
        fields,
        {"topic": topic, "bootstrap_servers": kafka.bootstrap_servers, "start": "earliest"},
    )
    [version] = build(spec, zk_settings, str(tmp_path / "out"))
    manifest = read_manifest(Path(version.snapshot))
    assert manifest.timeline is not None and manifest.timeline.window == 60_000_000
    assert manifest.live is not None and manifest.live.merge.mode == "windowed"
    assert manifest.value_columns == ("clicks", "spent")

    base_ms = 1_718_100_000_000  # 2024-06-11T10:00:00Z
    records = [("u1", {"user": "u1", "ts": base_ms + s * 1000, "amount": s}) for s in (5, 30, 59, 61, 150)]
    produce(kafka, topic, records)
    port = free_port()
    node = Proc(
        ["node", "--zk", zk_settings.connect_string, "--node-id", "n1", "--port", str(port),
         "--data-dir", str(tmp_path / "data"), "--zk-session-timeout-s", "4"],
        tmp_path / "node.log",
    ).start()  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}/stores/per_minute/keys/u1/windows"
        want = [
            {
                "start": "2024-06-11T10:00:00.000Z",
                "end": "2024-06-11T10:01:00.000Z",
                "value": {"clicks": 3, "spent": 94},
            },
            {
                "start": "2024-06-11T10:01:00.000Z",
                "end": "2024-06-11T10:02:00.000Z",
                "value": {"clicks": 1, "spent": 61},
            },
            {
                "start": "2024-06-11T10:02:00.000Z",
                "end": "2024-06-11T10:03:00.000Z",
                "value": {"clicks": 1, "spent": 150},
            },
        ]

        def windows() -> list[dict[str, Any]]:
            response = httpx.get(url, timeout=5)
            return response.json()["windows"] if response.status_code == 200 else []

        wait_for(lambda: windows() == want, timeout_s=60, message="the windows")
    finally:
        node.stop()


def test_a_hybrid_windowed_store_takes_only_aggregations_without_merge_state(tmp_path: Path) -> None:
    from keyroute.pipeline.spec import load_spec

    fields = {
        "source": "archive",
        "format": "json",
        "key": "user",
        "partitions": PARTITIONS,
        "source_partition_column": "p",
        "source_offset_column": "o",
        "mode": "windowed",
        "order_by": "ts",
        "window": "1 minute",
        "aggregations": {"last": "max_by(page, ts)"},
    }
    spec = build_spec(tmp_path, "w", fields, {"topic": "t", "bootstrap_servers": "127.0.0.1:9"})
    with pytest.raises(SpecError, match="count, sum, min and max only"):
        load_spec(spec)


def test_a_hybrid_windowed_store_holds_the_archive_s_windows_and_its_node_folds_the_rest(
    spark: SparkSession,
    zk_settings: ZkSettings,
    kafka: MockKafka,
    kafka_topic: Callable[[int], str],
    tmp_path: Path,
) -> None:
    topic = kafka_topic(PARTITIONS)
    rng = random.Random(32)
    events = [(f"A{n % 5}", {"asset": f"A{n % 5}", "ts": rng.randrange(40), "qty": n}) for n in range(200)]
    placed = produce(kafka, topic, events)
    cuts = {0: 0, 1: 15, 2: 40}
    by_partition: dict[int, list[tuple[int, Row]]] = defaultdict(list)
    for (partition, offset), (_, row) in zip(placed, events, strict=True):
        by_partition[partition].append((offset, row))
    archive = [
        {**row, "kafka_partition": p, "kafka_offset": offset}
        for p, records in by_partition.items()
        for offset, row in records[: cuts[p]]
    ]
    write_jsonl(tmp_path / "archive" / "part-1.json", archive)
    fields = {
        "source": "archive",
        "format": "json",
        "key": "asset",
        "partitions": PARTITIONS,
        "source_partition_column": "kafka_partition",
        "source_offset_column": "kafka_offset",
        "mode": "windowed",
        "order_by": "ts",
        "window": "10 ms",  # an integer time is in milliseconds
        "advance": "5 ms",
        "aggregations": {"n": "count(*)", "qty": "sum(qty)", "low": "min(qty)"},
    }
    spec = build_spec(tmp_path, "fills", fields, {"topic": topic, "bootstrap_servers": kafka.bootstrap_servers})
    [published] = build(spec, zk_settings, str(tmp_path / "out"), spark=spark)
    manifest = read_manifest(Path(published.snapshot))
    assert manifest.live is not None and manifest.live.merge.mode == "windowed"

    port = free_port()
    node = Proc(
        ["node", "--zk", zk_settings.connect_string, "--node-id", "n1", "--port", str(port),
         "--data-dir", str(tmp_path / "node"), "--zk-session-timeout-s", "4"],
        tmp_path / "node.log",
    ).start()  # fmt: skip
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10, trust_env=False) as http:

            def windows(key: str) -> list[tuple[int, dict[str, Any]]]:
                answer = http.get(f"/stores/fills/keys/{key}/windows", params={"limit": "1000"})
                return [(w["start"], w["value"]) for w in answer.json()["windows"]] if answer.status_code == 200 else []

            for key in sorted({k for k, _ in events}):
                rows = [row for k, row in events if k == key]
                starts = sorted(
                    {
                        s
                        for r in rows
                        for s in (r["ts"] - r["ts"] % 5, r["ts"] - r["ts"] % 5 - 5)
                        if s <= r["ts"] < s + 10
                    }
                )
                want = []
                for start in starts:
                    inside = [r["qty"] for r in rows if start <= r["ts"] < start + 10]
                    want.append((start, {"n": len(inside), "qty": sum(inside), "low": min(inside)}))
                try:
                    wait_for(lambda key=key, want=want: windows(key) == want, timeout_s=30, message=key)
                except AssertionError:
                    raise AssertionError(f"{key}: {windows(key)} != {want}") from None
    finally:
        node.stop()
