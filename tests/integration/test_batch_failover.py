"""Batch-get through a real cluster: per-key results in request order over every partition, and no key
lost when a node is killed with SIGKILL while batches are in flight.

Real processes on the session's ZooKeeper: three state nodes and a router (`keyroute node`, `keyroute
router`); a store written by hand in the snapshot format (no Spark) with replication 2, so every partition
has a second replica to answer when its first one dies.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from keyroute.cluster import zk, zk_layout
from keyroute.cluster.partition_map import StoreRecord
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.runtime.settings import ZkSettings
from tests.integration.test_node import write_snapshot
from tests.util import Proc, free_port, wait_for

pytestmark = pytest.mark.integration

STORE = "accounts"
PARTITIONS = 6
RF = 2
NODES = ("n1", "n2", "n3")
KEYS = [f"acct-{i:03d}" for i in range(90)] + ["a/b", "東京-7", "x y?#%", "100%"]
VALUES = {key: {"key": key, "balance": i * 7} for i, key in enumerate(KEYS)}
ABSENT = ["no-such-account", "acct-999", "ghost/1"]
BATCH_THREADS = 2


def partition(key: str) -> int:
    return partition_for(Partitioner.MURMUR2, key.encode("utf-8"), PARTITIONS)


def batch_request() -> tuple[list[Any], list[tuple[str, Any]]]:
    """Keys of every partition, absent keys and keys that are no string, interleaved; and per position
    what must come back: ("found", value), ("absent", key) or ("bad", raw)."""
    keys: list[Any] = []
    expected: list[tuple[str, Any]] = []
    present = KEYS[::3]
    assert {partition(k) for k in present} == set(range(PARTITIONS))
    extras: list[tuple[Any, tuple[str, Any]]] = [
        *((k, ("absent", k)) for k in ABSENT),
        *((raw, ("bad", raw)) for raw in (None, 1.5, {"k": 1}, True, ["acct-001"])),
    ]
    for i, key in enumerate(present):
        keys.append(key)
        expected.append(("found", VALUES[key]))
        if i % 4 == 1 and extras:
            raw, want = extras.pop()
            keys.append(raw)
            expected.append(want)
    for raw, want in extras:
        keys.append(raw)
        expected.append(want)
    return keys, expected


def check_batch(keys: list[Any], expected: list[tuple[str, Any]], results: list[dict[str, Any]]) -> list[str]:
    """Every way the results differ from what each key must get, in request order."""
    problems: list[str] = []
    if len(results) != len(keys):
        return [f"{len(results)} results for {len(keys)} keys"]
    for raw, (kind, want), entry in zip(keys, expected, results, strict=True):
        status = entry.get("status")
        if kind == "found":
            if status != 200 or entry.get("key") != raw or entry.get("value") != want:
                problems.append(f"{raw!r}: expected its value, got {entry}")
            elif entry.get("partition") != partition(raw):
                problems.append(f"{raw!r}: partition {entry.get('partition')}, expected {partition(raw)}")
        elif kind == "absent":
            if status != 404 or entry.get("error") != "key_not_found" or entry.get("key") != raw:
                problems.append(f"{raw!r}: expected key_not_found, got {entry}")
        elif status != 400 or entry.get("error") != "bad_key":
            problems.append(f"{raw!r}: expected bad_key, got {entry}")
    return problems


@dataclass
class Cluster:
    tmp: Path
    connect: str
    nodes: dict[str, Proc] = field(default_factory=dict)
    router: Proc | None = None
    router_url: str = ""
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=10.0, trust_env=False))

    def start_node(self, node_id: str) -> None:
        args = ["node", "--zk", self.connect, "--node-id", node_id, "--port", str(free_port())]
        args += ["--data-dir", str(self.tmp / f"data-{node_id}"), "--zk-session-timeout-s", "4"]
        args += ["--drain-timeout-s", "10"]
        self.nodes[node_id] = Proc(args, self.tmp / f"{node_id}.log").start()

    def start_router(self) -> None:
        port = free_port()
        args = ["router", "--zk", self.connect, "--port", str(port), "--zk-session-timeout-s", "4"]
        args += ["--upstream-timeout-s", "3"]
        self.router = Proc(args, self.tmp / "router.log").start()
        self.router_url = f"http://127.0.0.1:{port}"

    def serving(self) -> list[set[str]]:
        """The nodes the router sees serving each partition."""
        store = self.http.get(self.router_url + "/admin/partition-map?detail=all").json()["stores"][STORE]
        return [{s["node"] for s in entry["serving"]} for entry in store["partition_map"]]

    def settled(self) -> bool:
        """The router sees every partition served by exactly its RF assigned replicas, and every node placed:
        while only two nodes are up, every partition on both of them also looks like "RF replicas each"."""
        store = self.http.get(self.router_url + "/admin/partition-map?detail=all").json()["stores"][STORE]
        placed = {n for entry in store["partition_map"] for n in entry["assigned"]}
        return placed == set(NODES) and all(
            len(entry["assigned"]) == RF and {s["node"] for s in entry["serving"]} == set(entry["assigned"])
            for entry in store["partition_map"]
        )

    def metrics(self) -> dict[str, float]:
        text = self.http.get(self.router_url + "/metrics").text
        return {
            line.split()[0]: float(line.split()[1])
            for line in text.splitlines()
            if line and not line.startswith("#") and len(line.split()) == 2
        }

    def logs(self) -> str:
        procs = {**self.nodes, **({"router": self.router} if self.router is not None else {})}
        return "\n".join(f"----- {name} -----\n{p.output()[-4000:]}" for name, p in procs.items())

    def close(self) -> None:
        if self.router is not None:
            self.router.stop()
        for proc in self.nodes.values():
            proc.stop()
        self.http.close()


@pytest.fixture
def cluster(tmp_path: Path, zk_settings: ZkSettings) -> Iterator[Cluster]:
    client = zk.connect(zk_settings)
    try:
        snapshot = write_snapshot(tmp_path / "snapshots", STORE, VALUES, KeyFormat.STRING, PARTITIONS)
        record = StoreRecord(
            STORE,
            PARTITIONS,
            Partitioner.MURMUR2,
            KeyFormat.STRING,
            1,
            snapshot,
            ("v",),
            RF,
            time.time(),
            retained={1: snapshot},
        )
        client.create(zk_layout.store_path(STORE), record.to_json(), makepath=True)
    finally:
        zk.close(client)
    c = Cluster(tmp_path, zk_settings.connect_string)
    try:
        for node_id in NODES:
            c.start_node(node_id)
        c.start_router()
        yield c
    finally:
        c.close()
        print(c.logs())  # shown only when the test failed


@dataclass
class Batches:
    """Batch-gets sent over and over by client threads; every problem any result shows is kept."""

    url: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)
    sent: int = 0
    problems: list[str] = field(default_factory=list)

    def loop(self) -> None:
        keys, expected = batch_request()
        with httpx.Client(timeout=20.0, trust_env=False) as http:
            while not self.stop.is_set():
                try:
                    r = http.post(f"{self.url}/stores/{STORE}/batch-get", json={"keys": keys})
                    found = (
                        [f"status {r.status_code}: {r.text[:300]}"]
                        if r.status_code != 200
                        else check_batch(keys, expected, r.json()["results"])
                    )
                except httpx.HTTPError as exc:
                    found = [f"{type(exc).__name__}: {exc}"]
                with self.lock:
                    self.sent += 1
                    self.problems += [f"{time.strftime('%H:%M:%S')} {p}" for p in found]
                self.stop.wait(0.005)  # pacing: leave CPU for the nodes on a small machine


def test_batches_answer_every_key_in_order_and_survive_a_node_killed_mid_batch(cluster: Cluster) -> None:
    c = cluster
    wait_for(
        lambda: c.http.get(c.router_url + "/readyz").json().get("complete") is True,
        timeout_s=60,
        message="router ready",
    )
    # Every partition on two of the three nodes, as the router sees it.
    wait_for(c.settled, timeout_s=60, message="every partition on its 2 assigned nodes, every node placed")

    keys, expected = batch_request()
    r = c.http.post(f"{c.router_url}/stores/{STORE}/batch-get", json={"keys": keys})
    assert r.status_code == 200
    results = r.json()["results"]
    assert check_batch(keys, expected, results) == []
    assert [e["key"] for e in results if e["status"] != 400] == [k for k in keys if isinstance(k, str)]

    batches = Batches(c.router_url)
    threads = [threading.Thread(target=batches.loop, daemon=True) for _ in range(BATCH_THREADS)]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: batches.sent >= 20, timeout_s=30, message="batches under way")
        victim = "n2"
        before_kill = batches.sent
        c.nodes[victim].kill9()
        # Batches keep going while the dead node's session expires and its replicas move to the others.
        wait_for(
            lambda: all(nodes and victim not in nodes for nodes in c.serving()),
            timeout_s=60,
            message=f"{victim} gone from the serving view",
        )
        wait_for(lambda: batches.sent >= before_kill + 40, timeout_s=60, message="batches after the kill")
    finally:
        batches.stop.set()
        for thread in threads:
            thread.join(timeout=30)

    metrics = c.metrics()
    print(
        "batch failover:",
        json.dumps(
            {
                "batches": batches.sent,
                "problems": len(batches.problems),
                "failovers": metrics.get("keyroute_router_failovers_total"),
                "upstream_failures": metrics.get("keyroute_router_upstream_failures_total"),
                "unavailable": metrics.get("keyroute_router_unavailable_total"),
            }
        ),
    )
    assert batches.problems == [], batches.problems[:10]
    assert metrics["keyroute_router_unavailable_total"] == 0
    # The kill was survived by failing over, not by luck: batches did reach the dead node and were retried.
    assert metrics["keyroute_router_upstream_failures_total"] >= 1
    assert metrics["keyroute_router_failovers_total"] >= 1
