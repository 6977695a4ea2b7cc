"""What a read a node forwards costs that node: this work tree's nodes beside a previous revision's, in one run.

Run from the repository root: `.venv/bin/python benchmarks/node_forwarding.py [--write] [--previous REV]`
(`--quick`: a smoke run of the plumbing, not figures). It writes a store without Spark (benchmarks/router.py),
starts one ZooKeeper and two clusters of two nodes on it, each in its own chroot: this work tree's, and the
revision REV's (a `git worktree`, removed at the end; default 01a1c60, whose nodes forward over httpx).
Every partition has one replica, so a read sent to the node that does not serve its key is forwarded one
hop. wrk sends reads at a fixed concurrency to node n1: its own keys (answered locally) and n2's keys
(forwarded to n2), each cluster in turn, in a shuffled order per round; the CPU time of each node process
(/proc/<pid>/stat) per read, medians of the rounds. --write records the table in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness  # benchmarks/harness.py: ports, ZooKeeper, waiting, RESULTS.md

bench = harness.script("router.py")

from keyroute.cluster import zk, zk_layout  # noqa: E402
from keyroute.cluster.partition_map import StoreRecord  # noqa: E402
from keyroute.dev.zookeeper_server import EmbeddedZooKeeper  # noqa: E402
from keyroute.keys.key_format import KeyFormat  # noqa: E402
from keyroute.keys.partitioner import Partitioner  # noqa: E402
from keyroute.runtime.settings import ZkSettings  # noqa: E402

SECTION = "## Node forwarding (benchmarks/node_forwarding.py)"
# The last commit before node-to-node forwarding moved to FastUpstream: its nodes forward over httpx.
DEFAULT_PREVIOUS = "01a1c60"
LOCAL, FORWARDED = "local", "forwarded"


@dataclass
class NodeCluster:
    label: str
    build: Any
    n1: Any
    n2: Any
    files: dict[str, Path]


@dataclass
class Sample:
    reads_per_s: float
    n1_us: float  # CPU of n1 (the node asked) per read
    n2_us: float  # CPU of n2 per read (for forwarded reads: the node that answers)
    p50_us: float
    p99_us: float
    errors: int


def start_cluster(
    label: str, build: Any, zk_server: EmbeddedZooKeeper, chroot: str, snapshot: str, args: argparse.Namespace,
    work: Path, stack: ExitStack,
) -> tuple[Any, Any, str]:  # fmt: skip
    settings = ZkSettings(hosts=zk_server.connect_string, chroot=chroot)
    client = zk.connect(settings)
    stack.callback(zk.close, client)
    record = StoreRecord(
        bench.STORE, args.partitions, Partitioner.MURMUR2, KeyFormat.STRING, 1, snapshot, ("v",), 1, time.time()
    )
    client.create(zk_layout.store_path(bench.STORE), record.to_json(), makepath=True)
    nodes = []
    for name in ("n1", "n2"):
        port = harness.free_port()
        node = build.start(
            f"{label}-{name}",
            ["node", "--zk", settings.connect_string, "--node-id", name, "--port", str(port)]
            + ["--data-dir", str(work / f"data-{label}-{name}")],
            work,
            f"http://127.0.0.1:{port}",
        )
        stack.callback(node.stop)
        nodes.append(node)
    return nodes[0], nodes[1], settings.connect_string


@contextmanager
def running(args: argparse.Namespace, work: Path) -> Iterator[list[NodeCluster]]:
    with ExitStack() as stack:
        snapshot, partitions_of = bench.write_store(work / "snapshots", args.keys, args.partitions)
        zk_server = stack.enter_context(harness.zookeeper(work))
        previous = stack.enter_context(bench.revision_build(args.previous, work))
        started = []
        for label, build in (("new", bench.THIS_TREE), ("previous", previous)):
            n1, n2, _ = start_cluster(label, build, zk_server, f"/keyroute-fwd-{label}", snapshot, args, work, stack)
            started.append((label, build, n1, n2))
        services = [s for _, _, n1, n2 in started for s in (n1, n2)]
        bench.wait_until(
            lambda: all(bench.http_json(s.url + "/readyz")[0] == 200 for s in services),
            180,
            "the nodes to load their partitions",
            services,
        )
        clusters = []
        for label, build, n1, n2 in started:

            def owners_known(n1: Any = n1) -> bool:
                status, body = bench.http_json(n1.url + "/admin/partition-map")
                return status == 200 and isinstance(body, dict) and bool(body.get("complete"))

            bench.wait_until(owners_known, 60, f"{label}'s partition map to be complete", services)
            _, described = bench.http_json(n1.url + "/admin/partition-map")
            assert isinstance(described, dict)
            owner_of = [entry["serving"][0]["node"] for entry in described["stores"][bench.STORE]["partition_map"]]
            files = {}
            for kind, owner in ((LOCAL, "n1"), (FORWARDED, "n2")):
                paths = [
                    f"/stores/{bench.STORE}/keys/{bench.key_text(i)}"
                    for i in range(args.keys)
                    if owner_of[partitions_of[i]] == owner
                ]
                files[kind] = work / f"paths-{label}-{kind}.txt"
                files[kind].write_text("\n".join(paths) + "\n")
            cluster = NodeCluster(label, build, n1, n2, files)
            check(cluster)
            clusters.append(cluster)
        yield clusters


def check(cluster: NodeCluster) -> None:
    """A forwarded read is answered by n2 through n1, one hop; a local one by n1 itself."""
    import urllib.request

    for kind, node, hops in ((FORWARDED, "n2", "1"), (LOCAL, "n1", "0")):
        path = cluster.files[kind].read_text().split("\n", 1)[0]
        with urllib.request.urlopen(cluster.n1.url + path, timeout=5) as response:
            answered_by, hop_count = response.headers["x-keyroute-node"], response.headers["x-keyroute-hops"]
        if (answered_by, hop_count) != (node, hops):
            raise SystemExit(f"{cluster.label}: a {kind} read was answered by {answered_by} with {hop_count} hops")


def measure_once(
    wrk: str, script: Path, cluster: NodeCluster, kind: str, args: argparse.Namespace, seed: int
) -> Sample:
    before = [bench.tree_cpu_s(n.popen.pid) for n in (cluster.n1, cluster.n2)]
    run = bench.wrk_run(wrk, script, cluster.n1.url, cluster.files[kind], args.concurrency, args.duration, seed)
    after = [bench.tree_cpu_s(n.popen.pid) for n in (cluster.n1, cluster.n2)]
    reads = max(1, run.requests)
    return Sample(
        run.requests / run.duration_s,
        (after[0] - before[0]) * 1e6 / reads,
        (after[1] - before[1]) * 1e6 / reads,
        run.p50_us,
        run.p99_us,
        run.errors,
    )


def measure(
    wrk: str, work: Path, clusters: list[NodeCluster], args: argparse.Namespace
) -> dict[tuple[str, str], list[Sample]]:
    script = work / "random-paths.lua"
    script.write_text(bench.WRK_SCRIPT)
    samples: dict[tuple[str, str], list[Sample]] = {}
    order = [(c, kind) for c in clusters for kind in (LOCAL, FORWARDED)]
    for cluster, kind in order:  # warm-up: connections opened, code paths hot; not counted
        measure_once(wrk, script, cluster, kind, argparse.Namespace(**{**vars(args), "duration": 1.0}), 0)
    rng = random.Random(7)
    for round_number in range(args.rounds):
        rng.shuffle(order)
        for cluster, kind in order:
            sample = measure_once(wrk, script, cluster, kind, args, round_number + 1)
            samples.setdefault((cluster.label, kind), []).append(sample)
            print(
                f"round {round_number + 1} {cluster.label:8} {kind:9} {sample.reads_per_s:8.0f}/s "
                f"n1 {sample.n1_us:6.0f} us/read, n2 {sample.n2_us:6.0f} us/read, errors {sample.errors}",
                file=sys.stderr,
                flush=True,
            )
    return samples


def section(
    samples: dict[tuple[str, str], list[Sample]], clusters: list[NodeCluster], args: argparse.Namespace,
    command: str, load: str,
) -> str:  # fmt: skip
    def median(label: str, kind: str, field: str) -> float:
        return statistics.median(getattr(s, field) for s in samples[(label, kind)])

    names = {c.label: _name(c) for c in clusters}
    lines = [
        SECTION,
        "",
        f"`{command}` on {datetime.date.today().isoformat()}, {platform.machine()}, {os.cpu_count()} CPUs,"
        f" Python {platform.python_version()}; load average {load}. {args.keys:,} keys in {args.partitions}"
        f" partitions, one replica each, on two nodes (n1, n2) per cluster; wrk, {args.concurrency} connections"
        f" to n1, {args.duration:g} s per measurement, medians of {args.rounds} rounds (clusters and read kinds"
        " in a shuffled order per round). CPU: user + system of each node process, from /proc, per read.",
        "",
        "| nodes | reads sent to n1 | reads/s | n1 CPU µs/read | n2 CPU µs/read | p50 µs | p99 µs | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for cluster in clusters:
        for kind, what in (
            (LOCAL, "its own keys (answered by n1)"),
            (FORWARDED, "n2's keys (n1 forwards, n2 answers)"),
        ):
            errors = sum(s.errors for s in samples[(cluster.label, kind)])
            lines.append(
                f"| {names[cluster.label]} | {what} | {median(cluster.label, kind, 'reads_per_s'):,.0f}"
                f" | {median(cluster.label, kind, 'n1_us'):,.0f} | {median(cluster.label, kind, 'n2_us'):,.0f}"
                f" | {median(cluster.label, kind, 'p50_us'):,.0f} | {median(cluster.label, kind, 'p99_us'):,.0f}"
                f" | {errors} |"
            )
    new_fwd, old_fwd = median("new", FORWARDED, "n1_us"), median("previous", FORWARDED, "n1_us")
    new_extra = new_fwd - median("new", LOCAL, "n1_us")
    old_extra = old_fwd - median("previous", LOCAL, "n1_us")
    lines += [
        "",
        f"A forwarded read costs the forwarding node {new_fwd:,.0f} µs of CPU here against {old_fwd:,.0f} µs with"
        f" httpx ({old_fwd / max(new_fwd, 1e-9):.1f}x); beyond what answering a read of its own costs, forwarding"
        f" adds {new_extra:,.0f} µs against {old_extra:,.0f} µs.",
    ]
    return "\n".join(lines) + "\n"


def _name(cluster: NodeCluster) -> str:
    if cluster.label == "new":
        return "this work tree: forwarding over FastUpstream"
    return f"{cluster.build.label}: forwarding over httpx"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--keys", type=int, help="keys in the store (default: 50,000; --quick: 5,000)")
    parser.add_argument("--partitions", type=int, default=12, help="partitions (default: 12)")
    parser.add_argument("--concurrency", type=int, default=16, help="wrk connections (default: 16)")
    parser.add_argument("--duration", type=float, help="seconds per measurement (default: 5; --quick: 1)")
    parser.add_argument("--rounds", type=int, help="rounds; medians are reported (default: 3; --quick: 1)")
    parser.add_argument(
        "--previous", metavar="REV", default=DEFAULT_PREVIOUS, help=f"the other nodes' revision ({DEFAULT_PREVIOUS})"
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run of the plumbing, not figures")
    parser.add_argument("--write", action="store_true", help=f"record the table in {bench.RESULTS.name}")
    parser.add_argument("--keep", action="store_true", help="keep the working directory (logs)")
    args = parser.parse_args(argv)
    if args.write and args.quick:
        parser.error("--write records figures: not with --quick")
    args.keys = args.keys if args.keys is not None else 5_000 if args.quick else 50_000
    args.duration = args.duration if args.duration is not None else 1.0 if args.quick else 5.0
    args.rounds = args.rounds if args.rounds is not None else 1 if args.quick else 3
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))

    wrk = bench.find_tool("wrk")
    if wrk is None:
        raise SystemExit("wrk is missing: `sudo apt-get install -y wrk`")
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    with harness.work_dir("keyroute-forwarding-bench-", args.keep) as work, running(args, work) as clusters:
        samples = measure(wrk, work, clusters, args)
    load = f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    text = section(samples, clusters, args, harness.command(argv), load)
    harness.record(SECTION, text, args.write)
    print(f"took {time.monotonic() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
