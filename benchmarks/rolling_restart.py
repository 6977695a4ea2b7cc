"""A rolling restart of every node of an unchanged cluster under read load: what it copies and what it fails.

Run from the repository root: `.venv/bin/python benchmarks/rolling_restart.py [--write] [--previous REV]`.
For this work tree and for the revision REV (a `git worktree` of it, as benchmarks/router.py's --previous; the
worktree is removed at the end), in one run, on the same embedded ZooKeeper (a chroot each):

1. `--nodes` node processes and one router of that code, `--stores` stores of `--partitions` partitions at
   replication factor `--rf`, `--keys` keys each, written in the snapshot format by this script (no Spark);
2. `--readers` threads read random keys of every store through the router, one request after another;
3. every node in turn gets SIGTERM, is waited for, is started again on its data directory (same node id,
   same port) and is waited for until every node is ready and every partition is served by its assigned
   replicas, as a rolling update of a StatefulSet does;
4. measured from outside, the same way for both revisions: partitions (re)loaded into a data directory
   (the partition's marker file written anew) and the bytes of their data files, replicas the assignment
   moved and partitions whose replicas changed at any time (a ZooKeeper watch on the placement root), and
   reads that did not answer 200.

`--write` records the table in the "## Rolling restart" section of benchmarks/RESULTS.md with the command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import harness  # benchmarks/harness.py: ports, ZooKeeper, waiting, RESULTS.md
import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.router import THIS_TREE, Build, revision_build  # noqa: E402
from keyroute.cluster import placement_records, zk, zk_layout  # noqa: E402
from keyroute.cluster.partition_map import Assignment, StoreRecord  # noqa: E402
from keyroute.dev.zookeeper_server import EmbeddedZooKeeper  # noqa: E402
from keyroute.keys.key_format import KeyFormat  # noqa: E402
from keyroute.keys.partitioner import Partitioner, partition_for  # noqa: E402
from keyroute.runtime.settings import ZkSettings  # noqa: E402
from keyroute.state_node.placement import moved_replicas  # noqa: E402
from keyroute.storage.snapshot import DATA_FILE, Manifest, partition_dir, version_dir, write_manifest  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SECTION = "## Rolling restart"
# The revision before planned restarts held a node's partitions: the main line this work started from.
DEFAULT_PREVIOUS = "a9eb5f6"
MARKER = "loaded.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--previous", default=DEFAULT_PREVIOUS, help="the revision to compare with (git rev)")
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rf", type=int, default=2)
    parser.add_argument("--stores", type=int, default=3)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--keys", type=int, default=20_000, help="keys per store")
    parser.add_argument("--readers", type=int, default=2, help="threads reading through the router")
    parser.add_argument("--write", action="store_true", help="record the table in benchmarks/RESULTS.md")
    parser.add_argument("--keep", type=Path, help="work in this (new) directory and keep it: logs, data directories")
    return parser.parse_args(argv)


# -- the data ---------------------------------------------------------------------------------------------


def store_names(count: int) -> list[str]:
    return [f"bench{i}" for i in range(count)]


def key_of(i: int) -> str:
    return f"customer-{i:08d}"


def write_stores(root: Path, args: argparse.Namespace) -> dict[str, str]:
    """Every store in the snapshot format (JSON rows, loaded row by row: the node writes every byte)."""
    snapshots = {}
    for store in store_names(args.stores):
        snapshot = version_dir(str(root), store, 1)
        per_partition: list[list[str]] = [[] for _ in range(args.partitions)]
        for i in range(args.keys):
            key = key_of(i)
            per_partition[partition_for(Partitioner.MURMUR2, key.encode(), args.partitions)].append(key)
        for p, keys in enumerate(per_partition):
            folder = partition_dir(snapshot, p)
            folder.mkdir(parents=True)
            with open(folder / "part-00000.json", "w") as fh:
                for key in keys:
                    fh.write(json.dumps({"key": key, "value": {"customer": key, "store": store, "fare": 12.5}}) + "\n")
        counts = tuple(len(keys) for keys in per_partition)
        write_manifest(
            snapshot, Manifest(store, 1, args.partitions, Partitioner.MURMUR2, KeyFormat.STRING, ("v",), counts)
        )
        snapshots[store] = str(snapshot)
    return snapshots


# -- the cluster ------------------------------------------------------------------------------------------


@dataclass
class Process:
    name: str
    args: list[str]
    build: Build
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "keyroute", *self.args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.build.cwd,
                env={**os.environ, **self.build.env, "KEYROUTE_LOG_LEVEL": "INFO"},
            )

    def sigterm(self, timeout_s: float = 120.0) -> int:
        assert self.popen is not None
        self.popen.send_signal(signal.SIGTERM)
        return self.popen.wait(timeout=timeout_s)

    def stop(self) -> None:
        if self.popen is not None:
            harness.stop(self.popen, 60)


@dataclass
class Cluster:
    build: Build
    work: Path
    zk_settings: ZkSettings
    args: argparse.Namespace
    nodes: dict[str, tuple[Process, str]] = field(default_factory=dict)
    router: tuple[Process, str] | None = None
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=10.0, trust_env=False))

    def start(self) -> None:
        connect = self.zk_settings.connect_string
        for i in range(self.args.nodes):
            node_id = f"node-{i}"
            port = harness.free_port()
            args = ["node", "--zk", connect, "--node-id", node_id, "--port", str(port)]
            args += ["--data-dir", str(self.work / f"data-{node_id}")]
            proc = Process(node_id, args, self.build, self.work / f"{node_id}.log")
            proc.start()
            self.nodes[node_id] = (proc, f"http://127.0.0.1:{port}")
        port = harness.free_port()
        args = ["router", "--zk", connect, "--port", str(port)]
        router = Process("router", args, self.build, self.work / "router.log")
        router.start()
        self.router = (router, f"http://127.0.0.1:{port}")

    @property
    def router_url(self) -> str:
        assert self.router is not None
        return self.router[1]

    def settled(self) -> bool:
        """Every node ready, and through the router's eyes every partition of every store served by exactly
        its assigned replicas, which place every node."""
        for _, url in self.nodes.values():
            if self.http.get(url + "/readyz").status_code != 200:
                return False
        m = self.http.get(self.router_url + "/admin/partition-map?detail=all").json()
        if m["stale"] or set(m["nodes"]) != set(self.nodes):
            return False
        placed = set()
        for store in store_names(self.args.stores):
            entries = m["stores"].get(store, {}).get("partition_map")
            if not entries:
                return False
            for entry in entries:
                serving = {s["node"] for s in entry["serving"]}
                if len(entry["assigned"]) != min(self.args.rf, len(self.nodes)) or serving != set(entry["assigned"]):
                    return False
                placed.update(entry["assigned"])
        return placed == set(self.nodes)

    def close(self) -> None:
        if self.router is not None:
            self.router[0].stop()
        for proc, _ in self.nodes.values():
            if proc.popen is not None and proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        for proc, _ in self.nodes.values():
            proc.stop()
        self.http.close()


@dataclass
class Reads:
    """Threads reading random keys of every store through the router, one request after another."""

    router: str
    stores: list[str]
    keys: int
    counts: dict[int, int] = field(default_factory=dict)  # status (0: no answer) -> reads
    examples: dict[int, list[str]] = field(default_factory=dict)  # status -> the first few answers other than 200
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=self.router, timeout=20.0, trust_env=False) as http:
            while not self.stop.is_set():
                store, key = rng.choice(self.stores), key_of(rng.randrange(self.keys))
                try:
                    answer = http.get(f"/stores/{store}/keys/{quote(key)}")
                    status, text = answer.status_code, answer.text[:300]
                except httpx.HTTPError as exc:
                    status, text = 0, repr(exc)
                with self.lock:
                    self.counts[status] = self.counts.get(status, 0) + 1
                    if status != 200 and len(self.examples.setdefault(status, [])) < 3:
                        self.examples[status].append(f"{store} {key}: {text}")

    @contextmanager
    def running(self, threads: int) -> Iterator[Reads]:
        workers = [threading.Thread(target=self.run, args=(seed,), daemon=True) for seed in range(threads)]
        for worker in workers:
            worker.start()
        try:
            yield self
        finally:
            self.stop.set()
            for worker in workers:
                worker.join(timeout=30)


class Placements:
    """Every assignment written while it watches: replicas moved, and partitions whose replicas changed."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.first: Assignment | None = None
        self._last: Assignment | None = None
        self.moved = 0
        self.changed: set[tuple[str, int]] = set()
        self.writes = 0
        self._lock = threading.Lock()
        client.DataWatch(zk_layout.PLACEMENT, self._on_root)

    def _on_root(self, data: bytes | None, stat: Any) -> None:
        if data is None:
            return
        try:
            current = placement_records.read(self._client)[0]
        except Exception:  # a root ahead of its records for a moment: the next write is read
            return
        if current is None:
            return
        with self._lock:
            if self._last is None:
                self.first = self._last = current
                return
            if current.generation == self._last.generation:
                return
            self.writes += 1
            self.moved += moved_replicas(self._last, current)
            for store, per_partition in current.stores.items():
                for p, replicas in enumerate(per_partition):
                    if set(replicas) != set(self._last.replicas(store, p)):
                        self.changed.add((store, p))
            self._last = current


def markers(work: Path, nodes: list[str]) -> dict[Path, tuple[int, int]]:
    """Every partition marker in the nodes' data directories: (inode, mtime); written anew on each (re)load."""
    found = {}
    for node_id in nodes:
        for marker in (work / f"data-{node_id}").rglob(MARKER):
            st = marker.stat()
            found[marker] = (st.st_ino, st.st_mtime_ns)
    return found


def run_restart(build: Build, work: Path, zk_server: EmbeddedZooKeeper, args: argparse.Namespace) -> dict[str, Any]:
    label = re.sub(r"[^a-z0-9]+", "-", build.label.lower()).strip("-")
    work = work / label
    work.mkdir(parents=True)
    settings = ZkSettings(hosts=zk_server.connect_string, chroot=f"/rolling-{label}", session_timeout_s=10.0)
    client = zk.connect(settings)
    cluster = Cluster(build, work, settings, args)
    try:
        for store, snapshot in write_stores(work / "snapshots", args).items():
            record = StoreRecord(
                store, args.partitions, Partitioner.MURMUR2, KeyFormat.STRING, 1, snapshot, ("v",), args.rf, time.time()
            )
            client.create(zk_layout.store_path(store), record.to_json(), makepath=True)
        cluster.start()
        harness.wait(cluster.settled, 180, f"{build.label}: the cluster to settle")
        placements = Placements(client)
        harness.wait(lambda: placements.first is not None, 30, "the assignment")
        before = markers(work, list(cluster.nodes))
        reads = Reads(cluster.router_url, store_names(args.stores), args.keys)
        restarts_s = []
        started = time.monotonic()
        with reads.running(args.readers):
            harness.wait(lambda: sum(reads.counts.values()) >= 200, 60, "reads under way")
            for node_id, (proc, _) in cluster.nodes.items():
                began = time.monotonic()
                code = proc.sigterm()
                if code != 0:
                    raise SystemExit(f"{build.label}: {node_id} exited {code} on SIGTERM; see {proc.log}")
                proc.start()  # same node id, data directory and port
                harness.wait(cluster.settled, 300, f"{build.label}: {node_id} back and the cluster settled")
                restarts_s.append(time.monotonic() - began)
            harness.wait(lambda: sum(reads.counts.values()) >= 200, 60, "reads after the restarts")
        elapsed_s = time.monotonic() - started
        after = markers(work, list(cluster.nodes))
        reloaded = [m for m, identity in after.items() if before.get(m) != identity]
        copied = sum((m.parent / DATA_FILE).stat().st_size for m in reloaded if (m.parent / DATA_FILE).exists())
        total = sum(reads.counts.values())
        return {
            "label": build.label,
            "subject": build.subject or "this work tree",
            "partitions_reloaded": len(reloaded),
            "bytes_copied": copied,
            "replicas_moved": placements.moved,
            "partitions_reassigned": len(placements.changed),
            "assignment_writes": placements.writes,
            "reads": total,
            "failed": total - reads.counts.get(200, 0),
            "statuses": dict(sorted(reads.counts.items())),
            "examples": reads.examples,
            "restart_s_median": statistics.median(restarts_s),
            "seconds": elapsed_s,
        }
    finally:
        cluster.close()
        zk.close(client)


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    partitions = args.stores * args.partitions
    replicas = partitions * min(args.rf, args.nodes)
    lines = [
        "| code | partitions reassigned | replicas moved | partitions (re)loaded | bytes copied into data dirs "
        "| reads failed | restart, median s | whole roll s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        code = r["label"] if r["label"] == r["subject"] else f"{r['label']} ({r['subject']})"
        lines.append(
            f"| {code} | {r['partitions_reassigned']} of {partitions} | {r['replicas_moved']} "
            f"| {r['partitions_reloaded']} of {replicas} | {r['bytes_copied']:,} | {r['failed']} of {r['reads']:,} "
            f"| {r['restart_s_median']:.1f} | {r['seconds']:.1f} |"
        )
    return "\n".join(lines)


def section(results: list[dict[str, Any]], args: argparse.Namespace, command: str) -> str:
    today = datetime.date.today().isoformat()
    return (
        f"{SECTION}\n\n`{command}` on {today}: {args.nodes} nodes, {args.stores} stores of {args.partitions} "
        f"partitions at replication factor {args.rf}, {args.keys:,} keys per store (snapshot format 1: a load "
        f"writes every row), {args.readers} threads reading random keys through the router throughout; every "
        "node in turn gets SIGTERM and is started again on its data directory, the next one once every node is "
        "ready and every partition served by its assigned replicas. Both revisions run in the same run on the "
        "same ZooKeeper (a chroot each); measured from outside: partition markers written anew, the "
        "assignment's writes (a watch on its root), every read's status.\n"
        f"Machine: {os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}.\n\n"
        f"{table(results, args)}\n"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    given = list(sys.argv[1:] if argv is None else argv)
    if "--keep" in given:  # where the files were kept is not part of what was measured
        at = given.index("--keep")
        del given[at : at + 2]
    command = ".venv/bin/python benchmarks/rolling_restart.py " + shlex.join(given)
    with ExitStack() as stack:
        if args.keep is not None:
            args.keep.mkdir(parents=True)
            work = args.keep.resolve()
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="keyroute-rolling-")))
        zk_server = stack.enter_context(harness.zookeeper(work))
        builds = [THIS_TREE]
        if args.previous:
            builds.append(stack.enter_context(revision_build(args.previous, work)))
        results = []
        for build in builds:
            print(f"rolling restart: {build.label}", file=sys.stderr, flush=True)
            results.append(run_restart(build, work / "runs", zk_server, args))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
        text = section(results, args, command.strip())
        harness.record(SECTION, text, args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
