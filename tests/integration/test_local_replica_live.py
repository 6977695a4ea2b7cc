"""keyroute.local with a live store, on real processes: a `keyroute node` (the cluster's answers), librdkafka's
mock broker, and worker processes of one application sharing one data directory (tests/integration/
local_worker.py): one applies, the others read. Records stream in while the applying worker is killed -9: a
reading worker takes over from the stored offsets, every answer any worker gave reflected exactly the
records up to its offset, and at the end every count equals what was produced (nothing lost or applied
twice) and the node's answer; a worker started after all stopped resumes from the stored offsets. A new live
version swaps in only once caught up, every answer exact throughout."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from keyroute.client import Client, Value
from keyroute.cluster import zk, zk_layout
from keyroute.cluster.partition_map import StoreRecord
from keyroute.dev.kafka_mock import MockKafka
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.local import LocalReplica
from keyroute.runtime.settings import ZkSettings
from keyroute.storage.live import LiveConfig
from keyroute.storage.lmdb_layout import build_partition_file
from keyroute.storage.snapshot import FORMAT_2, Manifest, checksum_file, data_file, version_dir, write_manifest
from tests.integration.test_live_node import COUNT, PARTITIONS, LiveNode, partition, publish_live_store
from tests.util import wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
STORE = "counts"


class Worker:
    """One application process holding a LocalReplica on the shared data directory."""

    def __init__(self, tmp: Path, zk_settings: ZkSettings, name: str) -> None:
        self.log = tmp / f"{name}.log"
        args = ["--zk", zk_settings.connect_string, "--store", STORE, "--data-dir", str(tmp / "shared")]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.integration.local_worker", *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                cwd=ROOT,
                text=True,
            )
        self.started = self._line()
        self._lock = threading.Lock()

    def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"worker ended:\n{self.log.read_text()[-4000:]}"
        return json.loads(line)

    def ask(self, **request: Any) -> dict[str, Any]:
        with self._lock:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            return self._line()

    def get(self, key: str) -> dict[str, Any]:
        return self.ask(op="get", store=STORE, key=key)

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def test_workers_sharing_a_data_directory_answer_exactly_through_a_kill_9_of_the_applying_one(
    tmp_path: Path, zk_settings: ZkSettings, kafka: MockKafka, kafka_topic: Callable[[int], str]
) -> None:
    topic = kafka_topic(PARTITIONS)
    publish_live_store(tmp_path, zk_settings, STORE, topic, kafka.bootstrap_servers, COUNT)
    node = LiveNode(tmp_path, zk_settings, kafka.bootstrap_servers, topic).start()
    keys = [f"k{i}" for i in range(40)]
    # (partition, offset) of every record, by key: what an answer at offset o must have counted.
    delivered: dict[str, list[tuple[int, int]]] = {k: [] for k in keys}
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers, "log_level": 3, "linger.ms": 1})

    def produce(n: int, pace_s: float = 0.0) -> None:
        """`n` records, a batch of 500 every `pace_s` at most (a stream lasting a while, not a burst)."""
        for i in range(n):
            key = keys[i % len(keys)]
            if pace_s and i % 500 == 499:
                time.sleep(pace_s)

            def done(err: Any, msg: Any, key: str = key) -> None:
                assert err is None, err
                delivered[key].append((msg.partition(), msg.offset()))

            producer.produce(topic, key=key.encode(), value=json.dumps({"user": key, "amount": 1}).encode(),
                             partition=partition(key), on_delivery=done)  # fmt: skip
            if i % 500 == 0:
                producer.poll(0)
        assert producer.flush(10) == 0

    def counted(key: str, p: int, offset: int) -> int:
        return sum(1 for q, o in delivered[key] if q == p and o <= offset)

    answers: list[dict[str, Any]] = []

    def counts_match(worker: Worker) -> bool:
        for key in keys:
            got = worker.get(key)
            n = len(delivered[key])
            if got.get("value") != {"n": n, "total": n}:
                return False
            answers.append(got)
        return True

    workers: list[Worker] = []
    try:
        first = Worker(tmp_path, zk_settings, "w1")
        workers.append(first)
        assert first.started["applying"] is True
        second = Worker(tmp_path, zk_settings, "w2")
        workers.append(second)
        assert second.started["applying"] is False
        produce(1000)
        for worker in (first, second):
            wait_for(lambda w=worker: counts_match(w), timeout_s=60, message="the first 1000 records")

        # Records stream in; both workers read meanwhile; the applying one is killed -9 mid-stream.
        streaming = threading.Thread(target=produce, args=(20000, 0.05))
        streaming.start()
        rng = random.Random(7)

        def applied(worker: Worker) -> int:
            return sum(row["offset"] + 1 for row in worker.ask(op="status")[STORE].values())

        while applied(second) < 2500:  # the applying worker is mid-stream (the reader sees its commits)
            for worker in (first, second):
                answers.append(worker.get(rng.choice(keys)))
        assert streaming.is_alive()
        first.kill9()
        wait_for(lambda: second.ask(op="applying")["applying"], timeout_s=30, message="w2 to take over")
        third = Worker(tmp_path, zk_settings, "w3")  # a new worker process joins as a reader
        workers.append(third)
        assert third.started["applying"] is False
        for _ in range(100):
            for worker in (second, third):
                answers.append(worker.get(rng.choice(keys)))
        streaming.join()
        for worker in (second, third):
            wait_for(lambda w=worker: counts_match(w), timeout_s=90, message="every record once after kill -9")

        # Every answer any worker gave counted exactly the records of its key up to the offset it reflects.
        assert len(answers) > 300
        for got in answers:
            n = counted(got["key"], got["partition"], got["offset"])
            assert got["value"] == {"n": n, "total": n}, got
        # The same answers as the cluster's, at the same offsets.
        for key in keys:
            cluster = node.wait(lambda key=key: (r := node.read(STORE, key)).json()["value"]["n"] == len(delivered[key])
                                and r, f"the node's count of {key}")  # fmt: skip
            local = third.get(key)
            assert (local["value"], local["offset"]) == (
                cluster.json()["value"],
                int(cluster.headers["x-keyroute-offset"]),
            )
        per_partition = Counter(p for v in delivered.values() for p, _ in v)
        status = third.ask(op="status")[STORE]
        assert {int(p): row["offset"] for p, row in status.items()} == {
            p: per_partition[p] - 1 for p in range(PARTITIONS)
        }

        # Every worker stops (cleanly); records arrive meanwhile; a new one resumes from the stored offsets.
        second.stop()
        third.stop()
        produce(500)
        fourth = Worker(tmp_path, zk_settings, "w4")
        workers.append(fourth)
        assert fourth.started["applying"] is True
        wait_for(lambda: counts_match(fourth), timeout_s=60, message="the records produced while none ran, once")
    finally:
        for worker in workers:
            worker.stop()
        node.close()
        for worker in workers:
            print(f"----- {worker.log.name} -----\n{worker.log.read_text()[-3000:]}")


def publish_live_version(tmp: Path, settings: ZkSettings, topic: str, bootstrap: str, version: int) -> None:
    """An empty format-2 `version` of the live store STORE replaying its topic from the start, made current."""
    snapshot = version_dir(str(tmp / "snapshots"), STORE, version)
    with tempfile.TemporaryDirectory() as scratch:
        built = build_partition_file([], Path(scratch))
        checksums, sizes = {}, {}
        for p in range(PARTITIONS):
            dest = snapshot / data_file(p)
            dest.parent.mkdir(parents=True)
            shutil.copyfile(built.path, dest)
            checksums[p] = checksum_file(dest).value
            sizes[p] = dest.stat().st_size
    live = LiveConfig(topic, bootstrap, COUNT, (0,) * PARTITIONS, catch_up_records=0)
    columns = tuple(a.name for a in COUNT.aggregates)
    manifest = Manifest(
        STORE, version, PARTITIONS, Partitioner.MURMUR2, KeyFormat.STRING, columns, (0,) * PARTITIONS,
        created_at=time.time(), format=FORMAT_2, files={p: (data_file(p),) for p in range(PARTITIONS)},
        checksums=checksums, bytes=sizes, live=live,
    )  # fmt: skip
    write_manifest(snapshot, manifest)
    client = zk.connect(settings)
    try:
        raw, _ = client.get(zk_layout.store_path(STORE))
        record = dataclasses.replace(StoreRecord.from_json(raw), version=version, snapshot=str(snapshot))
        client.set(zk_layout.store_path(STORE), record.to_json())
    finally:
        zk.close(client)


def test_a_live_version_swaps_in_once_caught_up_and_every_answer_is_exact_throughout(
    tmp_path: Path, zk_settings: ZkSettings, kafka: MockKafka, kafka_topic: Callable[[int], str]
) -> None:
    topic = kafka_topic(PARTITIONS)
    publish_live_store(tmp_path, zk_settings, STORE, topic, kafka.bootstrap_servers, COUNT)
    node = LiveNode(tmp_path, zk_settings, kafka.bootstrap_servers, topic).start()
    keys = [f"k{i}" for i in range(20)]
    offsets: dict[str, list[tuple[int, int]]] = {k: [] for k in keys}
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers, "log_level": 3, "linger.ms": 1})
    for i in range(4000):
        key = keys[i % len(keys)]
        value = json.dumps({"user": key, "amount": 1}).encode()

        def delivered(err: Any, msg: Any, key: str = key) -> None:
            offsets[key].append((msg.partition(), msg.offset()))

        producer.produce(topic, key=key.encode(), value=value, partition=partition(key), on_delivery=delivered)
        if i % 500 == 0:
            producer.poll(0)
    assert producer.flush(10) == 0
    try:
        with (
            Client(node.url) as client,
            LocalReplica(zk_settings, [STORE], tmp_path / "local", registry=None) as replica,
        ):
            replica.wait_ready(timeout_s=60)
            wait_for(lambda: all(replica.get(STORE, k).value["n"] == 200 for k in keys), timeout_s=60, message="v1")
            publish_live_version(tmp_path, zk_settings, topic, kafka.bootstrap_servers, 2)
            seen: list[Value] = []
            while replica.status()[STORE][0]["version"] != 2 or replica.status()[STORE][1]["version"] != 2:
                seen += [replica.get(STORE, k) for k in keys]
            seen += [replica.get(STORE, k) for k in keys]
            # Version 2 replays the topic beside version 1 and is swapped in only once caught up: no answer
            # ever shows a partial count, before, during or after the swap.
            assert {v.version for v in seen} == {1, 2}
            for v in seen:
                assert v.offset is not None
                n = sum(1 for p, o in offsets[v.key] if p == v.partition and o <= v.offset)
                assert v.value == {"n": n, "total": n} == {"n": 200, "total": 200}, v
            wait_for(lambda: client.get(STORE, keys[0]).version == 2, timeout_s=60, message="the node on v2")
            for key in keys:
                local, cluster = replica.get(STORE, key), client.get(STORE, key)
                assert (local.version, local.value, local.offset) == (cluster.version, cluster.value, cluster.offset)
            wait_for(lambda: not (tmp_path / "local" / "stores" / STORE / "v1").exists(), message="v1's files to go")
    finally:
        node.close()
