"""Zero failed reads through membership changes, a crash, a version swap and a ZooKeeper restart.

Real processes on a ZooKeeper of the test's own (it is restarted): 3 state nodes and a router; a store
written by hand in the snapshot format (no Spark) with replication 2. Client threads read through the
router the whole time, single keys and batches, and check every answer against the values of the version
it claims. Meanwhile: a node joins, one is killed with SIGKILL and restarted, version 2 is published,
ZooKeeper is restarted, and a node leaves on SIGTERM. Expected: no failed request, no wrong answer, and
no version-1 answer to a request sent after the router saw every partition served at version 2.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from kazoo.client import KazooClient

from keyroute.cluster import zk, zk_layout
from keyroute.cluster.partition_map import StoreRecord
from keyroute.dev.zookeeper_server import EmbeddedZooKeeper
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.runtime.settings import ZkSettings
from tests.integration.test_node import key_url, write_snapshot
from tests.util import Proc, free_port, wait_for

pytestmark = pytest.mark.integration

STORE = "bookings"
PARTITIONS = 8
RF = 2
KEYS = [f"C{i:04d}" for i in range(240)] + ["a/b", "東京-42", "x y?#%"]
VALUES = {
    version: {key: {"key": key, "version": version, "fare": i * version} for i, key in enumerate(KEYS)}
    for version in (1, 2)
}
SESSION_TIMEOUT_S = "4"
CLIENT_THREADS = 3


def partition(key: str) -> int:
    return partition_for(Partitioner.MURMUR2, key.encode("utf-8"), PARTITIONS)


@dataclass
class Tally:
    """What the clients saw. Touched by several threads: one lock."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: int = 0
    keys: int = 0
    failed: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    old_after_new: list[str] = field(default_factory=list)
    versions: Counter[int] = field(default_factory=Counter)
    hops: Counter[str] = field(default_factory=Counter)
    # Set (monotonic time) when v2 is published, and when the router's map serves only v2.
    published_v2_at: float | None = None
    all_v2_at: float | None = None

    def check(self, sent_at: float, key: str, version: Any, value: Any) -> None:
        """One answered key: legitimate version, exactly that version's value, never v1 once all is v2."""
        with self.lock:
            self.keys += 1
            self.versions[version] += 1
            allowed = {1} if self.published_v2_at is None else {1, 2}
            if version not in allowed or value != VALUES[version][key]:
                self.wrong.append(f"{key!r}: version {version}, value {value!r}")
            elif version == 1 and self.all_v2_at is not None and sent_at > self.all_v2_at:
                self.old_after_new.append(f"{key!r} at +{sent_at - self.all_v2_at:.3f}s")

    def fail(self, what: str) -> None:
        with self.lock:
            self.failed.append(f"{time.strftime('%H:%M:%S')} {what}")


def client_loop(router_url: str, tally: Tally, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=router_url, timeout=20.0, trust_env=False) as http:
        while not stop.is_set():
            sent_at = time.monotonic()
            try:
                if rng.random() < 0.7:
                    key = rng.choice(KEYS)
                    r = http.get(key_url(STORE, key))
                    if r.status_code != 200:
                        tally.fail(f"GET {key!r}: {r.status_code} {r.text[:200]}")
                    else:
                        body = r.json()
                        tally.check(sent_at, key, body["version"], body["value"])
                        with tally.lock:
                            tally.hops[r.headers.get("x-keyroute-hops", "?")] += 1
                else:
                    batch = rng.sample(KEYS, 12)
                    r = http.post(f"/stores/{STORE}/batch-get", json={"keys": batch})
                    if r.status_code != 200:
                        tally.fail(f"batch: {r.status_code} {r.text[:200]}")
                    else:
                        per_partition: dict[int, set[int]] = {}
                        for key, entry in zip(batch, r.json()["results"], strict=True):
                            if entry.get("status") != 200:
                                tally.fail(f"batch entry {key!r}: {entry}")
                                continue
                            tally.check(sent_at, key, entry["version"], entry["value"])
                            per_partition.setdefault(partition(key), set()).add(entry["version"])
                        for p, versions in per_partition.items():
                            if len(versions) > 1:  # one batch, one partition: one version
                                with tally.lock:
                                    tally.wrong.append(f"batch mixed versions {versions} in partition {p}")
                with tally.lock:
                    tally.requests += 1
            except httpx.HTTPError as exc:
                tally.fail(f"{type(exc).__name__}: {exc}")
            time.sleep(0.003)  # pacing: leave CPU for the nodes on a small machine


class ChaosCluster:
    def __init__(self, tmp: Path, zk_server: EmbeddedZooKeeper, settings: ZkSettings) -> None:
        self.tmp = tmp
        self.zk_server = zk_server
        self.settings = settings
        self.connect = settings.connect_string
        self.nodes: dict[str, Proc] = {}
        self.exited: dict[str, Proc] = {}
        self.router: Proc | None = None
        self.router_url = ""
        self.http = httpx.Client(timeout=10.0, trust_env=False)

    def start_node(self, node_id: str) -> None:
        args = ["node", "--zk", self.connect, "--node-id", node_id, "--port", str(free_port())]
        args += ["--data-dir", str(self.tmp / f"data-{node_id}"), "--zk-session-timeout-s", SESSION_TIMEOUT_S]
        args += ["--drain-timeout-s", "30", "--version-grace-s", "5"]
        self.nodes[node_id] = Proc(args, self.tmp / f"{node_id}.log").start()

    def start_router(self) -> None:
        port = free_port()
        args = ["router", "--zk", self.connect, "--port", str(port)]
        args += ["--zk-session-timeout-s", SESSION_TIMEOUT_S, "--upstream-timeout-s", "3"]
        self.router = Proc(args, self.tmp / "router.log").start()
        self.router_url = f"http://127.0.0.1:{port}"

    def pmap(self) -> dict[str, Any]:
        return dict(self.http.get(self.router_url + "/admin/partition-map?detail=all").json())

    def metrics(self) -> dict[str, float]:
        text = self.http.get(self.router_url + "/metrics").text
        return {
            line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")
        }

    def settled(self, version: int, nodes: set[str]) -> bool:
        """The router sees exactly `nodes`, and every partition served by its assigned replicas at
        `version` only."""
        m = self.pmap()
        if m["stale"] or set(m["nodes"]) != nodes or STORE not in m["stores"]:
            return False
        store = m["stores"][STORE]
        if store["version"] != version:
            return False
        if {n for entry in store["partition_map"] for n in entry["assigned"]} != nodes:
            return False  # the controller has not placed every node yet
        for entry in store["partition_map"]:
            serving = {s["node"] for s in entry["serving"]}
            if len(entry["assigned"]) != min(RF, len(nodes)) or serving != set(entry["assigned"]):
                return False
            if any(s["version"] != version for s in entry["serving"]):
                return False
        return True

    def wait_settled(self, version: int, nodes: set[str], what: str, timeout_s: float = 40.0) -> float:
        started = time.monotonic()
        wait_for(lambda: self.settled(version, nodes), timeout_s=timeout_s, interval_s=0.1, message=what)
        return time.monotonic() - started

    def logs(self) -> str:
        procs = {**{f"{n} (exited)": p for n, p in self.exited.items()}, **self.nodes}
        if self.router is not None:
            procs["router"] = self.router
        return "\n".join(f"----- {name} -----\n{p.output()[-5000:]}" for name, p in procs.items())

    def close(self) -> None:
        if self.router is not None:
            self.router.stop()
        for proc in self.nodes.values():
            if proc.alive and proc.popen is not None:
                proc.popen.send_signal(signal.SIGTERM)  # all at once: nobody waits to hand over
        for proc in self.nodes.values():
            proc.stop()
        self.http.close()


@pytest.fixture
def chaos(tmp_path: Path) -> Iterator[tuple[ChaosCluster, KazooClient]]:
    # A ZooKeeper of its own: this test restarts it.
    server = EmbeddedZooKeeper(port=free_port(), data_dir=tmp_path / "zookeeper").start()
    settings = ZkSettings(hosts=server.connect_string, chroot="/chaos", session_timeout_s=4.0)
    client = zk.connect(settings)
    cluster = ChaosCluster(tmp_path, server, settings)
    try:
        yield cluster, client
    finally:
        cluster.close()
        zk.close(client)
        server.stop()
        print(cluster.logs())  # shown only when the test failed


def publish(client: KazooClient, tmp: Path, version: int, retained: dict[int, str]) -> str:
    snapshot = write_snapshot(tmp / "snapshots", STORE, VALUES[version], KeyFormat.STRING, PARTITIONS, version=version)
    record = StoreRecord(
        STORE,
        PARTITIONS,
        Partitioner.MURMUR2,
        KeyFormat.STRING,
        version,
        snapshot,
        ("v",),
        RF,
        time.time(),
        retained={**retained, version: snapshot},
    )
    path = zk_layout.store_path(STORE)
    if client.exists(path):
        client.set(path, record.to_json())
    else:
        client.create(path, record.to_json())
    return snapshot


def test_reads_never_fail_through_joins_crashes_version_swaps_zookeeper_restarts_and_leaves(
    chaos: tuple[ChaosCluster, KazooClient],
) -> None:
    c, client = chaos
    v1 = publish(client, c.tmp, 1, {})
    for node_id in ("n1", "n2", "n3"):
        c.start_node(node_id)
    c.start_router()
    wait_for(
        lambda: c.http.get(c.router_url + "/readyz").json().get("complete") is True,
        timeout_s=60,
        message="router ready",
    )
    c.wait_settled(1, {"n1", "n2", "n3"}, "three nodes settled", timeout_s=60)

    tally = Tally()
    stop = threading.Event()
    clients = [
        threading.Thread(target=client_loop, args=(c.router_url, tally, stop, seed), daemon=True)
        for seed in range(CLIENT_THREADS)
    ]
    for thread in clients:
        thread.start()
    timeline: list[tuple[str, float]] = []
    started = time.monotonic()

    def step(what: str, action: Callable[[], object]) -> None:
        t0 = time.monotonic()
        print(f"{time.strftime('%H:%M:%S')} chaos step: {what}")
        action()
        timeline.append((what, time.monotonic() - t0))

    try:
        wait_for(lambda: tally.requests >= 50, timeout_s=30, message="reads under way")

        # A node joins: the controller moves a share of every partition's replicas to it.
        c.start_node("n4")
        step("join n4", lambda: c.wait_settled(1, {"n1", "n2", "n3", "n4"}, "n4 placed"))

        # kill -9: the router retries each in-flight read on the other replica; the dead node's records
        # go when its session expires, and the controller re-places its replicas.
        c.nodes["n2"].kill9()
        c.exited["n2-killed"] = c.nodes.pop("n2")
        step("kill -9 n2", lambda: c.wait_settled(1, {"n1", "n3", "n4"}, "n2 gone, its replicas re-placed"))

        # Restarted with its data directory: it registers again and gets a share back.
        c.start_node("n2")
        step("restart n2", lambda: c.wait_settled(1, {"n1", "n2", "n3", "n4"}, "n2 back"))

        # Version 2: loaded beside version 1 and swapped partition by partition.
        with tally.lock:
            tally.published_v2_at = time.monotonic()
        publish(client, c.tmp, 2, {1: v1})

        def all_v2() -> None:
            c.wait_settled(2, {"n1", "n2", "n3", "n4"}, "every partition on version 2")
            with tally.lock:
                tally.all_v2_at = time.monotonic()

        step("publish v2", all_v2)
        wait_for(lambda: tally.versions[2] >= 50, timeout_s=30, message="reads of version 2")

        # ZooKeeper restarts under traffic: everybody keeps serving the last map, marked stale.
        before_restart = tally.keys

        def restart_zookeeper() -> None:
            c.zk_server.stop()
            stale = wait_for(lambda: c.pmap()["stale"], timeout_s=20, message="router map marked stale")
            assert stale and c.http.get(c.router_url + "/readyz").status_code == 200
            c.zk_server.start()
            c.wait_settled(2, {"n1", "n2", "n3", "n4"}, "fresh map after the restart", timeout_s=60)

        step("restart ZooKeeper", restart_zookeeper)
        assert tally.keys > before_restart

        # A drain request, then SIGTERM: n3 hands its partitions over, de-announces, finishes in-flight reads,
        # exits 0 (without the request a SIGTERM is a planned restart: tests/integration/test_planned_restart.py).
        leaving = c.nodes.pop("n3")
        c.exited["n3"] = leaving

        def leave() -> None:
            assert leaving.popen is not None
            drain = ["node-drain", "--zk", c.connect, "--node-id", "n3"]
            assert subprocess.run([sys.executable, "-m", "keyroute", *drain], timeout=60).returncode == 0
            leaving.popen.send_signal(signal.SIGTERM)
            assert leaving.popen.wait(timeout=45) == 0
            c.wait_settled(2, {"n1", "n2", "n4"}, "n3's partitions on the others")

        step("SIGTERM n3", leave)
        wait_for(lambda: tally.requests >= 200, timeout_s=30, message="some more reads")
    finally:
        stop.set()
        for thread in clients:
            thread.join(timeout=30)

    metrics = c.metrics()
    summary = {
        "requests": tally.requests,
        "keys": tally.keys,
        "failed": len(tally.failed),
        "wrong": len(tally.wrong),
        "old_after_new": len(tally.old_after_new),
        "versions": dict(tally.versions),
        "hops": dict(tally.hops),
        "router_failovers": metrics.get("keyroute_router_failovers_total"),
        "router_misroutes": metrics.get("keyroute_router_misroutes_total"),
        "router_upstream_failures": metrics.get("keyroute_router_upstream_failures_total"),
        "seconds": round(time.monotonic() - started, 1),
        "steps_s": {what: round(s, 2) for what, s in timeline},
    }
    print("chaos:", json.dumps(summary))
    assert not tally.failed, tally.failed[:10]
    assert not tally.wrong, tally.wrong[:10]
    assert not tally.old_after_new, tally.old_after_new[:10]
    assert tally.versions[1] > 0 and tally.versions[2] > 0
    # The crash was survived by retrying the other replica, not by luck: reads did reach the dead node.
    assert metrics["keyroute_router_failovers_total"] >= 1
