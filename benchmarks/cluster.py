"""Cluster timings on real processes: how fast a ZooKeeper change reaches the router, a join rebalances,
a kill -9 fails over, and a restarted node comes back with its data reused versus loaded afresh.

Run from the repository root: `.venv/bin/python benchmarks/cluster.py [--write]`; --write records the
figures in the "## Cluster" section of benchmarks/RESULTS.md (other sections are left as they are).
Everything runs on this machine: one ZooKeeper (the embedded one), node and router processes, and a store
written in the snapshot format by this script (no Spark).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import random
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import harness  # benchmarks/harness.py: ports, ZooKeeper, waiting, RESULTS.md
import httpx
from kazoo.client import KazooClient

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from keyroute.cluster import placement_records, zk, zk_layout  # noqa: E402
from keyroute.cluster.partition_map import Assignment, ServingRecord, StoreRecord  # noqa: E402
from keyroute.dev.zookeeper_server import EmbeddedZooKeeper  # noqa: E402
from keyroute.keys.key_format import KeyFormat  # noqa: E402
from keyroute.keys.partitioner import Partitioner, partition_for  # noqa: E402
from keyroute.runtime.settings import ZkSettings  # noqa: E402
from keyroute.storage.snapshot import Manifest, partition_dir, version_dir, write_manifest  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SECTION = "## Cluster"
STORE = "bench"


# -- plumbing ---------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


Proc = harness.Proc  # `python -m keyroute ...` of this tree, its output in a log file


@dataclass
class Cluster:
    """Node and router processes on one ZooKeeper chroot."""

    work: Path
    zk_settings: ZkSettings
    session_timeout_s: float
    client: KazooClient = field(init=False)
    nodes: dict[str, tuple[Proc, str]] = field(default_factory=dict)
    routers: list[Proc] = field(default_factory=list)
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=10.0, trust_env=False))

    def __post_init__(self) -> None:
        self.client = zk.connect(self.zk_settings)

    def start_node(self, node_id: str, data_dir: Path | None = None) -> str:
        port = harness.free_port()
        data = data_dir or self.work / f"data-{node_id}"
        args = ["node", "--zk", self.zk_settings.connect_string, "--node-id", node_id, "--port", str(port)]
        args += ["--data-dir", str(data), "--zk-session-timeout-s", str(self.session_timeout_s)]
        self.nodes[node_id] = (Proc(args, self.work / f"{node_id}.log"), f"http://127.0.0.1:{port}")
        return self.nodes[node_id][1]

    def start_router(self) -> str:
        port = harness.free_port()
        args = ["router", "--zk", self.zk_settings.connect_string, "--port", str(port)]
        args += ["--zk-session-timeout-s", str(self.session_timeout_s), "--upstream-timeout-s", "2"]
        self.routers.append(Proc(args, self.work / f"router-{len(self.routers)}.log"))
        url = f"http://127.0.0.1:{port}"
        harness.wait(lambda: self.http.get(url + "/healthz").status_code == 200, 30, "router up")
        return url

    def settled(self, router: str, nodes: set[str], rf: int) -> bool:
        m = self.http.get(router + "/admin/partition-map?detail=all").json()
        if m["stale"] or set(m["nodes"]) != nodes or STORE not in m["stores"]:
            return False
        entries = m["stores"][STORE]["partition_map"]
        if {n for entry in entries for n in entry["assigned"]} != nodes:
            return False  # the router has not seen the assignment that places every node yet
        for entry in entries:
            serving = {s["node"] for s in entry["serving"]}
            if len(entry["assigned"]) != min(rf, len(nodes)) or serving != set(entry["assigned"]):
                return False
        return True

    def assignment(self) -> Assignment:
        current = placement_records.read(self.client)[0]
        assert current is not None, "no assignment yet"
        return current

    def close(self) -> None:
        for proc in self.routers:
            proc.stop()
        for proc, _ in self.nodes.values():
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        for proc, _ in self.nodes.values():
            proc.stop()
        self.http.close()
        zk.close(self.client)


def write_store(root: Path, keys: int, partitions: int, version: int = 1) -> str:
    """`keys` string keys with small JSON values, in the snapshot format, partitioned like Kafka does."""
    snapshot = version_dir(str(root), STORE, version)
    per_partition: list[list[str]] = [[] for _ in range(partitions)]
    for i in range(keys):
        key = f"customer-{i:08d}"
        per_partition[partition_for(Partitioner.MURMUR2, key.encode(), partitions)].append(key)
    for p, items in enumerate(per_partition):
        folder = partition_dir(snapshot, p)
        folder.mkdir(parents=True)
        with open(folder / "part-00000.json", "w") as fh:
            for key in sorted(items):
                value = {"customer": key, "route": f"R{len(key) % 7}", "fare": 12.5, "version": version}
                fh.write(json.dumps({"key": key, "value": value}) + "\n")
    counts = tuple(len(items) for items in per_partition)
    manifest = Manifest(STORE, version, partitions, Partitioner.MURMUR2, KeyFormat.STRING, ("v",), counts)
    write_manifest(snapshot, manifest)
    return str(snapshot)


def publish(client: KazooClient, snapshot: str, partitions: int, rf: int, version: int = 1) -> None:
    record = StoreRecord(
        STORE, partitions, Partitioner.MURMUR2, KeyFormat.STRING, version, snapshot, ("v",), rf, time.time()
    )
    path = zk_layout.store_path(STORE)
    if client.exists(path):
        client.set(path, record.to_json())
    else:
        client.create(path, record.to_json(), makepath=True)


# -- 1. ZooKeeper change -> router ---------------------------------------------------------------------


def routed_to(poll: httpx.Client, route: str, url: str) -> bool:
    return bool(poll.get(route).json()["serving"][0]["url"] == url)


def measure_propagation(
    work: Path, zk_server: EmbeddedZooKeeper, changes: int, timeout_s: float
) -> dict[str, Any]:
    """A serving record's URL changes: how long until the router routes by it (polled /admin/route)."""
    settings = ZkSettings(hosts=zk_server.connect_string, chroot="/propagation", session_timeout_s=timeout_s)
    cluster = Cluster(work / "propagation", settings, timeout_s)
    cluster.work.mkdir()
    try:
        record = StoreRecord(STORE, 8, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/unused", (), 1)
        cluster.client.create(zk_layout.store_path(STORE), record.to_json())
        path = zk_layout.serving_path("fake")

        def serving_at(url: str) -> bytes:
            return ServingRecord("fake", url, {STORE: dict.fromkeys(range(8), 1)}).to_json()

        cluster.client.create(path, serving_at("http://fake-0:1"), ephemeral=True)
        router = cluster.start_router()
        route = f"{router}/admin/route?store={STORE}&key=customer-1"
        poll = httpx.Client(timeout=5.0, trust_env=False)
        harness.wait(lambda: poll.get(route).json()["serving"], 30, "router sees the fake node")
        latencies_ms: list[float] = []
        for i in range(1, changes + 1):
            url = f"http://fake-{i}:1"
            cluster.client.set(path, serving_at(url))
            written = time.perf_counter()
            harness.wait(functools.partial(routed_to, poll, route, url), 10, "the change", 0)
            latencies_ms.append((time.perf_counter() - written) * 1000)
            time.sleep(0.02)
        poll.close()
        return {
            "changes": changes,
            "p50_ms": statistics.median(latencies_ms),
            "p99_ms": percentile(latencies_ms, 99),
            "max_ms": max(latencies_ms),
        }
    finally:
        cluster.close()


# -- 2/3. join and kill -9 on a loaded cluster -----------------------------------------------------------


@dataclass
class Reads:
    """One thread reading random keys through the router, sequentially, recording each outcome."""

    router: str
    keys: int
    samples: list[tuple[float, float, int]] = field(default_factory=list)  # (sent at, latency s, status)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        rng = random.Random(7)
        with httpx.Client(base_url=self.router, timeout=20.0, trust_env=False) as http:
            while not self.stop.is_set():
                key = f"customer-{rng.randrange(self.keys):08d}"
                sent = time.monotonic()
                try:
                    status = http.get(f"/stores/{STORE}/keys/{quote(key)}").status_code
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))
                    status = 0
                self.samples.append((sent, time.monotonic() - sent, status))

    def between(self, start: float, end: float) -> list[tuple[float, float, int]]:
        return [s for s in self.samples if start <= s[0] < end]


def failovers(cluster: Cluster, router: str) -> float:
    for line in cluster.http.get(router + "/metrics").text.splitlines():
        if line.startswith("keyroute_router_failovers_total "):
            return float(line.split()[1])
    return 0.0


def measure_cluster(work: Path, zk_server: EmbeddedZooKeeper, args: argparse.Namespace) -> dict[str, Any]:
    settings = ZkSettings(
        hosts=zk_server.connect_string, chroot="/cluster", session_timeout_s=args.session_timeout_s
    )
    cluster = Cluster(work / "cluster", settings, args.session_timeout_s)
    cluster.work.mkdir()
    out: dict[str, Any] = {}
    try:
        snapshot = write_store(cluster.work / "snapshots", args.keys, args.partitions)
        publish(cluster.client, snapshot, args.partitions, 2)
        router = cluster.start_router()
        started = time.monotonic()
        for node_id in ("n1", "n2", "n3"):
            cluster.start_node(node_id)
        harness.wait(lambda: cluster.settled(router, {"n1", "n2", "n3"}, 2), 300, "three nodes settled", 0.05)
        out["initial_s"] = time.monotonic() - started

        reads = Reads(router, args.keys)
        reader = threading.Thread(target=reads.run, daemon=True)
        reader.start()
        time.sleep(2.0)  # a baseline of reads before anything happens

        # Join: until the controller has placed n4, and until every partition is served as assigned.
        before = cluster.assignment()
        joined = time.monotonic()
        cluster.start_node("n4")
        harness.wait(
            lambda: any("n4" in r for per in cluster.assignment().stores.values() for r in per),
            60,
            "n4 placed",
        )
        out["join_assigned_s"] = time.monotonic() - joined
        harness.wait(lambda: cluster.settled(router, {"n1", "n2", "n3", "n4"}, 2), 300, "n4 rebalanced", 0.02)
        out["join_settled_s"] = time.monotonic() - joined
        after = cluster.assignment()
        out["join_moved_replicas"] = sum(
            len(set(r).difference(before.replicas(STORE, p))) for p, r in enumerate(after.stores[STORE])
        )
        out["join_failed_reads"] = sum(1 for s in reads.between(joined, time.monotonic()) if s[2] != 200)

        # kill -9 n2 under reads: retries keep reads whole; the map drops n2 at session expiry.
        time.sleep(1.0)
        base = failovers(cluster, router)
        last_failover = [0.0]
        watching = threading.Event()

        def watch_failovers() -> None:
            seen = base
            while not watching.is_set():
                now = failovers(cluster, router)
                if now > seen:
                    seen, last_failover[0] = now, time.monotonic()
                time.sleep(0.02)

        watcher = threading.Thread(target=watch_failovers, daemon=True)
        watcher.start()
        killed = time.monotonic()
        cluster.nodes["n2"][0].kill9()
        harness.wait(
            lambda: "n2" not in cluster.http.get(router + "/admin/partition-map?detail=all").json()["nodes"],
            60,
            "n2 dropped",
            0.02,
        )
        out["kill_map_drop_s"] = time.monotonic() - killed
        harness.wait(lambda: cluster.settled(router, {"n1", "n3", "n4"}, 2), 300, "n2's replicas re-placed", 0.02)
        out["kill_settled_s"] = time.monotonic() - killed
        time.sleep(1.0)
        watching.set()
        watcher.join()
        window = reads.between(killed, killed + out["kill_map_drop_s"])
        baseline = reads.between(killed - 3.0, killed)
        out["kill_failovers"] = failovers(cluster, router) - base
        out["kill_last_retry_s"] = (last_failover[0] - killed) if last_failover[0] else 0.0
        out["kill_failed_reads"] = sum(1 for s in reads.between(killed, time.monotonic()) if s[2] != 200)
        out["kill_reads_in_window"] = len(window)
        out["kill_latency_ms"] = {
            "baseline_p50": statistics.median(s[1] for s in baseline) * 1000,
            "window_p50": statistics.median(s[1] for s in window) * 1000,
            "window_p99": percentile([s[1] for s in window], 99) * 1000,
            "window_max": max(s[1] for s in window) * 1000,
        }
        reads.stop.set()
        reader.join(timeout=30)
        out["reads_total"] = len(reads.samples)
        out["reads_failed_total"] = sum(1 for s in reads.samples if s[2] != 200)
    finally:
        cluster.close()
    return out


# -- 4. restart with data reused vs loaded afresh ---------------------------------------------------------


def measure_restart(work: Path, zk_server: EmbeddedZooKeeper, args: argparse.Namespace) -> dict[str, Any]:
    """One node holding every partition (rf 1): time from process start to /readyz 200, with an empty
    data directory (fresh load) and after kill -9 with its data directory kept (reuse)."""
    settings = ZkSettings(
        hosts=zk_server.connect_string, chroot="/restart", session_timeout_s=args.session_timeout_s
    )
    cluster = Cluster(work / "restart", settings, args.session_timeout_s)
    cluster.work.mkdir()
    data = cluster.work / "data-solo"
    fresh: list[float] = []
    reused: list[float] = []
    try:
        snapshot = write_store(cluster.work / "snapshots", args.keys, args.partitions)
        publish(cluster.client, snapshot, args.partitions, 1)

        def start_and_time() -> float:
            started = time.monotonic()
            url = cluster.start_node("solo", data)
            harness.wait(lambda: cluster.http.get(url + "/readyz").status_code == 200, 300, "solo ready", 0.01)
            return time.monotonic() - started

        for _ in range(args.restarts):
            shutil.rmtree(data, ignore_errors=True)
            fresh.append(start_and_time())
            cluster.nodes["solo"][0].kill9()
            reused.append(start_and_time())
            cluster.nodes["solo"][0].kill9()
    finally:
        cluster.close()
    return {
        "fresh_s": statistics.median(fresh),
        "reused_s": statistics.median(reused),
        "fresh_all": fresh,
        "reused_all": reused,
    }


# -- report ------------------------------------------------------------------------------------------------


def section(
    prop: dict[str, Any],
    clus: dict[str, Any],
    restart: dict[str, Any],
    args: argparse.Namespace,
    command: str,
) -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lat = clus["kill_latency_ms"]
    rows = [
        (
            "ZooKeeper change -> router routes by it",
            f"p50 {prop['p50_ms']:.1f} ms, p99 {prop['p99_ms']:.1f} ms,"
            f" max {prop['max_ms']:.1f} ms over {prop['changes']} changes",
        ),
        ("3 nodes start and load (rf 2) until the router's map is settled", f"{clus['initial_s']:.1f} s"),
        ("join: node 4 placed by the controller", f"{clus['join_assigned_s']:.2f} s"),
        (
            "join: rebalance done (every partition served as assigned)",
            f"{clus['join_settled_s']:.2f} s, {clus['join_moved_replicas']} replicas moved,"
            f" {clus['join_failed_reads']} failed reads",
        ),
        (
            "kill -9: reads retried on the other replica",
            f"{clus['kill_failovers']:.0f} retries, the last"
            f" {clus['kill_last_retry_s']:.2f} s after the kill,"
            f" {clus['kill_failed_reads']} failed reads",
        ),
        (
            "kill -9: read latency until the map drops the node",
            f"p50 {lat['window_p50']:.1f} ms (before: {lat['baseline_p50']:.1f} ms),"
            f" p99 {lat['window_p99']:.1f} ms,"
            f" max {lat['window_max']:.1f} ms ({clus['kill_reads_in_window']} reads)",
        ),
        ("kill -9: the router's map drops the node (session expiry)", f"{clus['kill_map_drop_s']:.2f} s"),
        ("kill -9: its replicas re-placed and served", f"{clus['kill_settled_s']:.2f} s"),
        (
            "restart, data directory kept (kill -9, start again): start -> /readyz 200",
            f"{restart['reused_s']:.2f} s (median of {len(restart['reused_all'])})",
        ),
        (
            "restart, empty data directory (fresh load): start -> /readyz 200",
            f"{restart['fresh_s']:.2f} s (median of {len(restart['fresh_all'])})",
        ),
    ]
    lines = [
        SECTION,
        "",
        f"`{command}` on {datetime.date.today().isoformat()}: embedded ZooKeeper, node and router processes"
        f" on one machine, ZooKeeper session timeout {args.session_timeout_s:g} s."
        f" Store: {args.keys:,} string keys, {args.partitions} partitions, ~100-byte JSON values;"
        " the cluster rows use replication 2 (3 nodes, then"
        " a 4th joins, then one is killed) with one client reading random keys through the router meanwhile;"
        " the restart rows use one node holding every partition.",
        f"Machine: {os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()},"
        f" load average {load:.1f} at the end (other work shares the cores).",
        "",
        "| what | measured |",
        "| --- | --- |",
        *(f"| {what} | {value} |" for what, value in rows),
        "",
        f"Reads during the run: {clus['reads_total']:,}, failed: {clus['reads_failed_total']}."
        " The map propagation time is from the ZooKeeper write returning to the first `/admin/route` answer"
        " that shows it (polled back to back, ~1 ms apart): watch delivery, the re-read of every record, and"
        " the hand-over to the event loop.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=200_000, help="keys in the store (default: 200,000)")
    parser.add_argument("--partitions", type=int, default=12, help="partitions (default: 12)")
    parser.add_argument("--changes", type=int, default=50, help="ZooKeeper changes timed (default: 50)")
    parser.add_argument("--restarts", type=int, default=3, help="restarts timed each way (default: 3)")
    parser.add_argument("--session-timeout-s", type=float, default=4.0, help="ZooKeeper session timeout")
    parser.add_argument("--write", action="store_true", help=f"record the figures in {RESULTS.name}")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="keyroute-cluster-bench-"))
    server = harness.zookeeper_server(work).start()
    try:
        prop = measure_propagation(work, server, args.changes, args.session_timeout_s)
        print("propagation:", json.dumps(prop), flush=True)
        clus = measure_cluster(work, server, args)
        print("cluster:", json.dumps(clus), flush=True)
        restart = measure_restart(work, server, args)
        print("restart:", json.dumps(restart), flush=True)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    command = shlex.join(
        [".venv/bin/python", "benchmarks/cluster.py", *(argv if argv is not None else sys.argv[1:])]
    )
    text = section(prop, clus, restart, args, command)
    harness.record(SECTION, text, args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
