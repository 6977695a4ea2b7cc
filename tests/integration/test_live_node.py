"""Live stores on real `keyroute node` processes, a real ZooKeeper and librdkafka's mock cluster: records
produced with confluent-kafka are folded into the partitions the node holds (values, tombstones,
aggregates), bad and misplaced records are counted and skipped (or stop the partition), the applied offset
survives a restart and a kill -9 without loss or double application, a broker outage leaves the node
serving (stalled), and a partition whose records are gone (a gap) is not served.

Versions are written by hand (an empty format-2 version with `live` in its manifest, as the pipeline writes
one for a live store without a source) and published with kazoo."""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import lmdb
import pytest
from confluent_kafka import Producer

from keyroute.cluster import zk, zk_layout
from keyroute.cluster.partition_map import StoreRecord
from keyroute.dev.kafka_mock import MockKafka
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.key_schema import KeySchema
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.keys.schema_registry import RegistrySettings
from keyroute.replica.store import PartitionId, partition_path
from keyroute.runtime.settings import ZkSettings
from keyroute.storage.live import Aggregate, LiveConfig, Merge
from keyroute.storage.lmdb_layout import build_partition_file, db_key
from keyroute.storage.snapshot import FORMAT_2, Manifest, checksum_file, data_file, version_dir, write_manifest
from keyroute.storage.timeline import StoreKind, Timeline, TimeType, key_part
from keyroute.storage.ttl import Ttl
from tests.util import Proc, free_port, wait_for

pytestmark = pytest.mark.integration

PARTITIONS = 2
LATEST = Merge("latest", "user", order_by="ts", columns=("ts", "page"))
COUNT = Merge("aggregate", "user", aggregates=(Aggregate("n", "count", None), Aggregate("total", "sum", "amount")))


def partition(key: str) -> int:
    return partition_for(Partitioner.MURMUR2, key.encode(), PARTITIONS)


def keys_of(p: int, count: int, prefix: str = "u") -> list[str]:
    found = []
    i = 0
    while len(found) < count:
        if partition(f"{prefix}{i}") == p:
            found.append(f"{prefix}{i}")
        i += 1
    return found


def publish_live_store(
    tmp: Path,
    zk_settings: ZkSettings,
    name: str,
    topic: str,
    bootstrap: str,
    merge: Merge,
    *,
    offsets: tuple[int, ...] = (0,) * PARTITIONS,
    on_bad_record: str = "skip",
    catch_up_records: int = 0,
    timeline: Timeline | None = None,
    value_format: str = "json",
    schema_registry: RegistrySettings | None = None,
    key_schema: KeySchema | None = None,
    ttl: Ttl | None = None,
) -> None:
    """An empty format-2 version 1 of a live store, published in ZooKeeper (`key_schema`: of Schema Registry
    keys; else string keys)."""
    key_format = KeyFormat.STRING if key_schema is None else key_schema.format
    snapshot = version_dir(str(tmp / "snapshots"), name, 1)
    with tempfile.TemporaryDirectory() as scratch:
        built = build_partition_file([], Path(scratch))
        checksums, sizes = {}, {}
        for p in range(PARTITIONS):
            dest = snapshot / data_file(p)
            dest.parent.mkdir(parents=True)
            shutil.copyfile(built.path, dest)
            checksums[p] = checksum_file(dest).value
            sizes[p] = dest.stat().st_size
    live = LiveConfig(
        topic,
        bootstrap,
        merge,
        offsets,
        on_bad_record=on_bad_record,
        catch_up_records=catch_up_records,
        value_format=value_format,
        schema_registry=schema_registry,
    )
    columns = ("ts", "page") if merge.mode != "aggregate" else tuple(a.name for a in merge.aggregates)
    files = {p: (data_file(p),) for p in range(PARTITIONS)}
    manifest = Manifest(
        name, 1, PARTITIONS, Partitioner.MURMUR2, key_format, columns, (0,) * PARTITIONS,
        created_at=time.time(), format=FORMAT_2, files=files, checksums=checksums, bytes=sizes, live=live,
        timeline=timeline,
    )  # fmt: skip
    write_manifest(snapshot, manifest)
    record = StoreRecord(
        name, PARTITIONS, Partitioner.MURMUR2, key_format, 1, str(snapshot), columns, 1, time.time(), live=True,
        timeline=timeline, key_schema=key_schema, ttl=ttl,
    )  # fmt: skip
    client = zk.connect(zk_settings)
    try:
        client.create(zk_layout.store_path(name), record.to_json(), makepath=True)
    finally:
        zk.close(client)


class LiveNode:
    """One `keyroute node` process (restartable on the same data directory) and a producer."""

    def __init__(
        self, tmp: Path, zk_settings: ZkSettings, bootstrap: str, topic: str, args: tuple[str, ...] = ()
    ) -> None:
        self.tmp = tmp
        self.args = args
        self.zk_settings = zk_settings
        self.topic = topic
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Proc | None = None
        self.http = httpx.Client(timeout=10, trust_env=False)
        self.producer_servers = bootstrap
        self.producer = Producer({"bootstrap.servers": bootstrap, "log_level": 3, "linger.ms": 1})
        self.starts = 0

    def start(self) -> LiveNode:
        args = ["node", "--zk", self.zk_settings.connect_string, "--node-id", "n1", "--port", str(self.port)]
        args += ["--data-dir", str(self.tmp / "data"), "--zk-session-timeout-s", "4", "--drain-timeout-s", "2"]
        args += self.args
        self.starts += 1
        self.proc = Proc(args, self.tmp / f"node-{self.starts}.log").start()
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def produce(self, key: str | None, value: Any, p: int | None = None, raw: bytes | None = None) -> None:
        body = raw if raw is not None else (None if value is None else json.dumps(value).encode())
        target = p if p is not None else partition(key or "")
        self.producer.produce(self.topic, key=None if key is None else key.encode(), value=body, partition=target)

    def flush(self) -> None:
        assert self.producer.flush(10) == 0

    def read(self, store: str, key: str) -> httpx.Response:
        return self.http.get(f"{self.url}/stores/{store}/keys/{key}")

    def value(self, store: str, key: str) -> Any:
        response = self.read(store, key)
        return response.json()["value"] if response.status_code == 200 else response.status_code

    def live(self, store: str) -> dict[int, dict[str, Any]]:
        """partition -> the node's own live status of it (from its /admin/partition-map)."""
        rows = self.http.get(self.url + "/admin/partition-map").json()["local"].get(store, [])
        return {row["partition"]: row["live"] for row in rows if "live" in row}

    def metric(self, name: str, **labels: str) -> float:
        text = self.http.get(self.url + "/metrics").text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def wait(self, predicate: Callable[[], Any], message: str, timeout_s: float = 30) -> Any:
        try:
            return wait_for(predicate, timeout_s=timeout_s, interval_s=0.05, message=message)
        except AssertionError:
            print(self.proc.output()[-8000:] if self.proc is not None else "")
            raise

    def close(self) -> None:
        self.stop()
        self.http.close()


@pytest.fixture
def live_node(
    tmp_path: Path, zk_settings: ZkSettings, kafka: MockKafka, kafka_topic: Callable[[int], str]
) -> Iterator[Callable[..., LiveNode]]:
    nodes: list[LiveNode] = []

    def make(store: str, merge: Merge, node_args: tuple[str, ...] = (), **publish: Any) -> LiveNode:
        topic = kafka_topic(PARTITIONS)
        publish_live_store(tmp_path, zk_settings, store, topic, kafka.bootstrap_servers, merge, **publish)
        node = LiveNode(tmp_path, zk_settings, kafka.bootstrap_servers, topic, node_args)
        nodes.append(node)
        return node.start()

    yield make
    for node in nodes:
        node.close()


def test_records_are_applied_tombstones_delete_and_bad_ones_are_counted_and_skipped(live_node) -> None:  # type: ignore[no-untyped-def]
    node = live_node("clicks", LATEST)
    a, b = keys_of(0, 2)
    (c,) = keys_of(1, 1)
    node.produce(a, {"user": a, "ts": 1, "page": "/one"})
    node.produce(a, {"user": a, "ts": 3, "page": "/three"})
    node.produce(a, {"user": a, "ts": 2, "page": "/older"})  # an older ts changes nothing
    node.produce(b, {"user": b, "ts": 1, "page": "/b"})
    node.produce(c, {"user": c, "ts": 1, "page": "/c"})
    node.produce(c, None)  # tombstone
    node.produce(b, {"user": b, "ts": 5, "page": "/misplaced"}, p=1)  # b belongs to partition 0
    node.produce("x", None, p=0, raw=b"not json")
    node.produce(None, {"ts": 1}, p=0)
    node.produce(b, {"user": b, "page": "/no-ts"})  # no order_by
    node.flush()

    node.wait(lambda: node.live("clicks").get(0, {}).get("offset") == 6, "partition 0 to apply its 7 records")
    node.wait(lambda: node.live("clicks").get(1, {}).get("offset") == 2, "partition 1 to apply its 3 records")
    assert node.value("clicks", a) == {"ts": 3, "page": "/three"}
    assert node.value("clicks", b) == {"ts": 1, "page": "/b"}
    assert node.value("clicks", c) == 404
    status = node.live("clicks")
    assert status[0]["skipped"] == {"missing_column": 1, "not_json": 1, "null_key": 1}
    assert status[1]["skipped"] == {"misplaced": 1}
    assert status[0]["state"] == status[1]["state"] == "live"
    assert status[0]["applied"] == 4 and status[1]["applied"] == 2
    assert node.metric("keyroute_node_live_skipped_records_total", store="clicks", reason="misplaced") == 1
    assert node.metric("keyroute_node_live_applied_records_total", store="clicks") == 6
    assert node.metric("keyroute_node_live_offset", store="clicks", partition="0") == 6
    assert node.metric("keyroute_node_live_state", store="clicks", partition="1", state="live") == 1
    answer = node.read("clicks", a)
    assert answer.headers.get("x-keyroute-offset") == "6"


def test_expired_values_leave_the_answers_at_once_and_the_disk_at_the_next_sweep(live_node) -> None:  # type: ignore[no-untyped-def]
    # Expired since 1970 and served until 2100, whatever the clock of the machine running the test.
    node = live_node("expiring", LATEST, node_args=("--expiry-sweep-s", "0.2"), ttl=Ttl.parse("30 days", "ts"))
    old, fresh, later = keys_of(0, 3)
    node.produce(old, {"user": old, "ts": 1, "page": "/old"})
    node.produce(fresh, {"user": fresh, "ts": 4_102_444_800_000, "page": "/fresh"})
    node.produce(later, {"user": later, "ts": 2, "page": "/soon gone"})
    node.flush()
    node.wait(lambda: node.live("expiring").get(0, {}).get("offset") == 2, "partition 0 to apply its records")
    assert node.read("expiring", old).json()["error"] in ("expired", "key_not_found")  # no rebuild
    assert node.value("expiring", fresh) == {"ts": 4_102_444_800_000, "page": "/fresh"}

    env = lmdb.open(str(partition_path(node.tmp / "data", PartitionId("expiring", 1, 0))), readonly=True, lock=True)
    try:

        def on_disk(key: str) -> bool:
            with env.begin() as txn:
                return txn.get(db_key(key.encode())) is not None

        node.wait(lambda: not on_disk(old) and not on_disk(later), "the sweep to delete the expired values")
        assert on_disk(fresh)
    finally:
        env.close()
    assert node.read("expiring", old).json()["error"] == "key_not_found"
    assert node.value("expiring", fresh) == {"ts": 4_102_444_800_000, "page": "/fresh"}
    node.produce(old, {"user": old, "ts": 4_102_444_800_001, "page": "/back"})  # a key expired is written anew
    node.flush()
    node.wait(lambda: node.value("expiring", old) == {"ts": 4_102_444_800_001, "page": "/back"}, "the new value")


def test_on_bad_record_stop_stops_the_partition_before_the_bad_record(live_node) -> None:  # type: ignore[no-untyped-def]
    node = live_node("strict", LATEST, on_bad_record="stop")
    a, b = keys_of(0, 2)
    node.produce(a, {"user": a, "ts": 1, "page": "/a"})
    node.produce(b, {"user": b, "ts": 1, "page": 7}, raw=b"[1, 2]")  # offset 1: not an object
    node.produce(b, {"user": b, "ts": 2, "page": "/b"})
    node.flush()
    status = node.wait(lambda: (s := node.live("strict").get(0)) and s["state"] == "stopped" and s, "the stop")
    assert status["offset"] == 0 and "offset 1" in status["error"] and "not_object" in status["error"]
    # It keeps serving what it applied; the other partition goes on.
    node.wait(lambda: node.value("strict", a) == {"ts": 1, "page": "/a"}, "the stopped partition to serve")
    assert node.value("strict", b) == 404
    node.wait(lambda: node.live("strict")[1]["state"] == "live", "partition 1 to be live")


def test_counts_survive_a_restart_and_a_kill_9_mid_stream_without_loss_or_double_apply(live_node) -> None:  # type: ignore[no-untyped-def]
    node = live_node("counts", COUNT)
    keys = [f"k{i}" for i in range(40)]
    produced: Counter[str] = Counter()

    def produce(n: int) -> None:
        for i in range(n):
            key = keys[i % len(keys)]
            node.produce(key, {"user": key, "amount": 1})
            produced[key] += 1
            if i % 500 == 0:
                node.producer.poll(0)
        node.flush()

    def counts_match() -> bool:
        return all(node.value("counts", k) == {"n": produced[k], "total": produced[k]} for k in keys)

    produce(2000)
    node.wait(counts_match, "the first 2000 records")
    node.stop()  # a clean restart resumes from the stored offsets
    produce(1000)
    node.start()
    node.wait(counts_match, "the records produced while it was down, once each")

    # kill -9 while records stream in (a producer thread), then restart on the same files.
    streaming = threading.Thread(target=produce, args=(20000,))
    streaming.start()
    node.wait(lambda: sum(s["applied"] for s in node.live("counts").values()) > 500, "applying mid-stream")
    assert node.proc is not None
    node.proc.kill9()
    streaming.join()
    node.start()
    node.wait(counts_match, "every record once after kill -9", timeout_s=60)
    offsets = {p: s["offset"] for p, s in node.live("counts").items()}
    per_partition = Counter({p: 0 for p in range(PARTITIONS)})
    for key, n in produced.items():
        per_partition[partition(key)] += n
    assert offsets == {p: per_partition[p] - 1 for p in range(PARTITIONS)}


def test_a_broker_outage_stalls_the_partitions_which_keep_serving(tmp_path: Path, zk_settings: ZkSettings) -> None:
    with MockKafka() as own:  # its own cluster: taking the broker down must not touch other tests' topics
        own.create_topic("events", PARTITIONS)
        publish_live_store(tmp_path, zk_settings, "events", "events", own.bootstrap_servers, LATEST)
        node = LiveNode(tmp_path, zk_settings, own.bootstrap_servers, "events").start()
        try:
            (a,) = keys_of(0, 1)
            node.produce(a, {"user": a, "ts": 1, "page": "/a"})
            node.flush()
            node.wait(lambda: node.value("events", a) == {"ts": 1, "page": "/a"}, "the first record")
            own.broker_down(1)
            node.wait(
                lambda: {s["state"] for s in node.live("events").values()} == {"stalled"}, "both partitions stalled"
            )
            assert node.value("events", a) == {"ts": 1, "page": "/a"}
            assert "broker" in node.live("events")[0]["error"]
            own.broker_up(1)
            node.wait(lambda: {s["state"] for s in node.live("events").values()} == {"live"}, "live again")
            node.produce(a, {"user": a, "ts": 2, "page": "/again"})
            node.flush()
            node.wait(lambda: node.value("events", a) == {"ts": 2, "page": "/again"}, "a record after the outage")
        finally:
            node.close()


def test_a_partition_whose_records_are_gone_is_not_served(live_node) -> None:  # type: ignore[no-untyped-def]
    # The version says partition 0 goes on from offset 5, but the topic holds nothing there (recreated).
    node = live_node("gappy", LATEST, offsets=(5, 0))
    (a,) = keys_of(0, 1)
    (b,) = keys_of(1, 1)
    node.produce(b, {"user": b, "ts": 1, "page": "/b"})
    node.flush()
    node.wait(lambda: node.value("gappy", b) == {"ts": 1, "page": "/b"}, "partition 1 to be served")
    status = node.wait(lambda: (s := node.live("gappy").get(0)) and s["state"] == "gap" and s, "the gap")
    assert "new version" in status["error"]
    answer = node.read("gappy", a)
    assert answer.status_code == 503, answer.text

    def announced() -> list[list[str]]:
        # The node's map follows its serving record through a ZooKeeper watch: a moment behind its reads.
        parts = node.http.get(node.url + "/admin/partition-map").json()["stores"]["gappy"]["partition_map"]
        return [[e["node"] for e in part["serving"]] for part in parts]

    node.wait(lambda: announced() == [[], ["n1"]], "partition 1 announced, partition 0 not")
    assert node.http.get(node.url + "/readyz").status_code == 200  # the rest is served: the node is ready


def test_records_gone_to_retention_are_a_gap_and_the_other_partition_is_served(live_node) -> None:  # type: ignore[no-untyped-def]
    """The broker drops a partition's oldest records while the node is down (the mock cluster keeps about
    5 MB per partition, as retention would): on its return the node finds its next offset below the low
    watermark, withdraws that partition with a message saying which records are gone, and serves the other."""
    node = live_node("retained", LATEST)
    (a,) = keys_of(0, 1)
    (b,) = keys_of(1, 1)
    node.produce(a, {"user": a, "ts": 1, "page": "/a"})
    node.produce(b, {"user": b, "ts": 1, "page": "/b"})
    node.flush()
    node.wait(lambda: node.value("retained", a) == {"ts": 1, "page": "/a"}, "partition 0's first record")
    node.wait(lambda: node.value("retained", b) == {"ts": 1, "page": "/b"}, "partition 1's first record")
    node.stop()
    filler = keys_of(0, 70, prefix="big")
    for i, key in enumerate(filler):
        node.produce(key, {"user": key, "ts": 2 + i, "page": "x" * 100_000})
        node.flush()  # one batch per record: the broker drops whole batches
    low, _ = _watermarks(node, 0)
    assert low > 1, "the broker kept every record: no retention to test"
    node.start()
    status = node.wait(lambda: (s := node.live("retained").get(0)) and s["state"] == "gap" and s, "the gap")
    assert f"records 1..{low - 1} of topic" in status["error"] and "are gone" in status["error"]
    assert node.read("retained", a).status_code == 503  # never answered as if the partition were complete
    node.wait(lambda: node.value("retained", b) == {"ts": 1, "page": "/b"}, "partition 1 served again")
    assert node.live("retained")[1]["state"] == "live"
    assert node.read("retained", a).status_code == 503


def test_a_deleted_topic_stalls_its_partitions_which_keep_serving_and_a_recreated_one_is_a_gap(
    live_node, kafka: MockKafka
) -> None:  # type: ignore[no-untyped-def]
    node = live_node("deleted", LATEST)
    (a,) = keys_of(0, 1)
    node.produce(a, {"user": a, "ts": 1, "page": "/a"})
    node.flush()
    node.wait(lambda: node.value("deleted", a) == {"ts": 1, "page": "/a"}, "the first record")
    kafka.delete_topic(node.topic)
    statuses = node.wait(
        lambda: (s := node.live("deleted")) and {v["state"] for v in s.values()} == {"stalled"} and s,
        "both partitions stalled",
    )
    assert all(node.topic in s["error"] for s in statuses.values()), statuses
    assert node.value("deleted", a) == {"ts": 1, "page": "/a"}  # what it has is still served
    # The topic comes back empty: partition 0's next offset (1) is past its end, so its records are gone.
    kafka.create_topic(node.topic, PARTITIONS)
    status = node.wait(lambda: (s := node.live("deleted").get(0)) and s["state"] == "gap" and s, "partition 0's gap")
    assert "beyond the end" in status["error"]
    assert node.read("deleted", a).status_code == 503
    node.wait(lambda: node.live("deleted")[1]["state"] == "live", "partition 1 (next offset 0) live again")


def _watermarks(node: LiveNode, p: int) -> tuple[int, int]:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": node.producer_servers, "group.id": "watermarks", "log_level": 3})
    try:
        low, high = consumer.get_watermark_offsets(TopicPartition(node.topic, p), timeout=10)
        return int(low), int(high)
    finally:
        consumer.close()


HISTORY = Merge("history", "user", order_by="ts", columns=("page",), time_type="integer")
HISTORY_TIMELINE = Timeline(StoreKind.HISTORY, "ts", TimeType.INTEGER)


def history(node: LiveNode, store: str, key: str, **params: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    query = {"limit": "1000", **params}
    while True:
        response = node.http.get(f"{node.url}/stores/{store}/keys/{key}/history", params=query)
        assert response.status_code == 200, response.text
        rows += response.json()["rows"]
        if "next" not in response.json():
            return rows
        query = {**query, "cursor": response.json()["next"]}


def test_a_live_history_store_appends_every_record_once_through_a_kill_9(live_node) -> None:  # type: ignore[no-untyped-def]
    node = live_node("visits", HISTORY, timeline=HISTORY_TIMELINE)
    keys = [f"k{i}" for i in range(12)]
    produced: dict[str, list[int]] = {k: [] for k in keys}
    counter = iter(range(10**9))

    def produce(n: int) -> None:
        for i in range(n):
            key = keys[i % len(keys)]
            ts = next(counter) % 97  # times repeat: rows of equal time are all kept
            node.produce(key, {"user": key, "ts": ts, "page": f"/p{ts}"})
            produced[key].append(ts)
            if i % 500 == 0:
                node.producer.poll(0)
        node.flush()

    def all_applied() -> bool:
        return all(sorted(r["ts"] for r in history(node, "visits", k)) == sorted(produced[k]) for k in keys)

    produce(600)
    node.wait(all_applied, "every record a row")
    rows = history(node, "visits", keys[0])
    assert [r["ts"] for r in rows] == sorted(r["ts"] for r in rows)  # time order
    assert rows[0] == {"ts": rows[0]["ts"], "page": f"/p{rows[0]['ts']}"}
    answer = node.http.get(f"{node.url}/stores/visits/keys/{keys[0]}/history", params={"from": "10", "to": "20"})
    assert answer.headers["x-keyroute-offset"] == str(node.live("visits")[partition(keys[0])]["offset"])
    assert [r["ts"] for r in answer.json()["rows"]] == sorted(t for t in produced[keys[0]] if 10 <= t < 20)
    assert node.value("visits", keys[0])["ts"] == max(produced[keys[0]])  # a get: the latest row

    # Read your own write: a history read bounded by the next offset waits for the record produced meanwhile.
    p0 = partition(keys[0])
    offset = node.live("visits")[p0]["offset"]
    url = f"{node.url}/stores/visits/keys/{keys[0]}/history"
    bounded: dict[str, httpx.Response] = {}
    reader = threading.Thread(
        target=lambda: bounded.setdefault("r", node.http.get(url, params={"min_offset": str(offset + 1)}))
    )
    reader.start()
    node.produce(keys[0], {"user": keys[0], "ts": 1000, "page": "/mine"})
    produced[keys[0]].append(1000)
    node.flush()
    reader.join()
    assert bounded["r"].status_code == 200, bounded["r"].text
    assert bounded["r"].json()["rows"][-1] == {"ts": 1000, "page": "/mine"}
    assert int(bounded["r"].headers["x-keyroute-offset"]) >= offset + 1
    never = node.http.get(url, params={"min_offset": str(offset + 10**6)})
    assert (never.status_code, never.json()["error"]) == (503, "not_up_to_bound")

    # kill -9 mid-stream and restart: every record is a row exactly once (re-applied records rewrite their
    # own entry, never add one).
    streaming = threading.Thread(target=produce, args=(6000,))
    streaming.start()
    node.wait(lambda: sum(s["applied"] for s in node.live("visits").values()) > 900, "applying mid-stream")
    assert node.proc is not None
    node.proc.kill9()
    streaming.join()
    node.start()
    node.wait(all_applied, "every record once after kill -9", timeout_s=60)

    node.produce(keys[1], None)  # a tombstone deletes the key's history
    node.flush()
    node.wait(lambda: history(node, "visits", keys[1]) == [], "the tombstone")
    assert sorted(r["ts"] for r in history(node, "visits", keys[2])) == sorted(produced[keys[2]])


def test_a_live_history_keeps_what_its_retention_says(live_node) -> None:  # type: ignore[no-untyped-def]
    newest = Merge("history", "user", order_by="ts", columns=("page",), time_type="integer", retention_count=3)
    node = live_node("recent", newest, timeline=HISTORY_TIMELINE)
    (a,) = keys_of(0, 1)
    for ts in (5, 1, 9, 7, 3, 8):
        node.produce(a, {"user": a, "ts": ts, "page": "/"})
    node.produce(a, {"user": a, "ts": "soon", "page": "/"})  # not an integer time: skipped
    node.flush()
    node.wait(lambda: node.live("recent").get(0, {}).get("offset") == 6, "the records")
    assert [r["ts"] for r in history(node, "recent", a)] == [7, 8, 9]
    assert node.live("recent")[0]["skipped"] == {"bad_type": 1}


def test_a_live_history_keeps_its_time_span_of_rows(live_node) -> None:  # type: ignore[no-untyped-def]
    (a,) = keys_of(0, 1)
    span = Merge("history", "user", order_by="ts", columns=("page",), time_type="integer", retention_span=10)
    node = live_node("window10", span, timeline=HISTORY_TIMELINE)
    for ts in (100, 95, 105, 80, 111, 101):  # stream time 111 at the end: keeps ts > 101
        node.produce(a, {"user": a, "ts": ts, "page": "/"})
    node.flush()
    node.wait(lambda: node.live("window10").get(0, {}).get("offset") == 5, "the records")
    assert [r["ts"] for r in history(node, "window10", a)] == [105, 111]


def test_a_live_historys_expired_rows_leave_the_answers_at_once_and_the_disk_at_the_next_sweep(live_node) -> None:  # type: ignore[no-untyped-def]
    (a,) = keys_of(0, 1)
    ttl = Ttl.parse("30 days", "ts")  # 1970 is expired and 2100 served, whatever the machine's clock
    node = live_node("visits", HISTORY, node_args=("--expiry-sweep-s", "0.2"), timeline=HISTORY_TIMELINE, ttl=ttl)
    for ts in (1, 4_102_444_800_000, 2):
        node.produce(a, {"user": a, "ts": ts, "page": f"/{ts}"})
    node.flush()
    node.wait(lambda: node.live("visits").get(0, {}).get("offset") == 2, "the records")
    assert [r["ts"] for r in history(node, "visits", a)] == [4_102_444_800_000]  # no rebuild
    env = lmdb.open(str(partition_path(node.tmp / "data", PartitionId("visits", 1, 0))), readonly=True, lock=True)
    try:

        def rows_on_disk() -> int:
            with env.begin() as txn:
                return sum(1 for k, _ in txn.cursor() if bytes(k).startswith(key_part(a.encode())))

        node.wait(lambda: rows_on_disk() == 1, "the sweep to delete the expired rows")
    finally:
        env.close()
    assert [r["ts"] for r in history(node, "visits", a)] == [4_102_444_800_000]


def test_a_live_windowed_store_folds_each_record_into_its_windows(live_node) -> None:  # type: ignore[no-untyped-def]
    aggregates = (
        Aggregate("n", "count", None),
        Aggregate("total", "sum", "amount"),
        Aggregate("last", "max_by", "page", "ts"),
    )
    merge = Merge("windowed", "user", order_by="ts", aggregates=aggregates, time_type="integer", window=10, advance=5)
    timeline = Timeline(StoreKind.WINDOWED, "ts", TimeType.INTEGER, window=10, advance=5)
    node = live_node("per10", merge, timeline=timeline)
    (a,) = keys_of(0, 1)
    records = [(12, 1, "/a"), (3, 2, "/b"), (14, 3, "/c"), (7, 4, "/d"), (-2, 5, "/e")]
    for ts, amount, page in records:
        node.produce(a, {"user": a, "ts": ts, "amount": amount, "page": page})
    node.flush()
    node.wait(lambda: node.live("per10").get(0, {}).get("offset") == 4, "the records")

    def expected(start: int) -> dict[str, Any]:
        inside = [(t, amt, p) for t, amt, p in records if start <= t < start + 10]
        return {"n": len(inside), "total": sum(amt for _, amt, _ in inside), "last": max(inside)[2]}

    starts = sorted({s for t, _, _ in records for s in range(t - t % 5 - 5, t - t % 5 + 1, 5) if s <= t < s + 10})
    answer = node.http.get(f"{node.url}/stores/per10/keys/{a}/windows", params={"limit": "100"})
    assert answer.status_code == 200, answer.text
    windows = answer.json()["windows"]
    assert [(w["start"], w["end"]) for w in windows] == [(s, s + 10) for s in starts]
    assert [w["value"] for w in windows] == [expected(s) for s in starts]  # no merge state in answers
    overlapping = node.http.get(f"{node.url}/stores/per10/keys/{a}/windows", params={"from": "13", "to": "15"})
    assert [w["start"] for w in overlapping.json()["windows"]] == [s for s in starts if s < 15 and s + 10 > 13]
    assert node.value("per10", a) == windows[-1]  # a get: the latest window
