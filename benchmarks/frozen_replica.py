"""A frozen replica (SIGSTOP) under steady reads: what the reads in flight wait, with and without the stall delay.

Run from the repository root: `.venv/bin/python benchmarks/frozen_replica.py [--write]`.
In one run, on one embedded ZooKeeper: two node processes serve one store at replication factor 2 (written in
the snapshot format by this script, no Spark), and two routers read it side by side, each with its own reader
threads: one as shipped (`--stall-after-ms` 250) and one with the stall delay off (`--stall-after-ms 0`: a
read waits for the upstream timeout, 5 s, when hedging is refused). Node n1 is frozen with SIGSTOP for each of
`--freezes` seconds in turn (resumed with SIGCONT, then a quiet spell), while readers send one read after
another. Reported per router and freeze: reads sent while the node was frozen, failed reads, the median, p99
and slowest read, and reads slower than 1 s.

`--write` records the table in the "## Frozen replica" section of benchmarks/RESULTS.md with the command.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import harness  # benchmarks/harness.py: ports, ZooKeeper, waiting, RESULTS.md

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from benchmarks.cluster import (  # noqa: E402
    STORE,
    Proc,
    Reads,
    percentile,
    publish,
    write_store,
)
from keyroute.cluster import zk  # noqa: E402
from keyroute.runtime.settings import ZkSettings  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SECTION = "## Frozen replica (benchmarks/frozen_replica.py)"
ROUTERS = {"shipped (stall 250 ms)": "250", "stall off (previous behaviour)": "0"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=20_000, help="keys in the store (default 20,000)")
    parser.add_argument("--partitions", type=int, default=8, help="partitions (default 8)")
    parser.add_argument("--freezes", type=float, nargs="+", default=[6.0, 30.0], help="seconds frozen (6 30)")
    parser.add_argument("--readers", type=int, default=2, help="reader threads per router (default 2)")
    parser.add_argument("--quiet-s", type=float, default=8.0, help="seconds between freezes (default 8)")
    parser.add_argument("--write", action="store_true", help=f"record the table in {RESULTS.name}")
    return parser.parse_args(argv)


def run(work: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    server = harness.zookeeper_server(work).start()
    settings = ZkSettings(hosts=server.connect_string, chroot="/frozen", session_timeout_s=10.0)
    client = zk.connect(settings)
    procs: list[Proc] = []
    http = httpx.Client(timeout=10.0, trust_env=False)
    readers: dict[str, list[Reads]] = {}
    threads: list[threading.Thread] = []
    try:
        publish(client, write_store(work / "snapshots", args.keys, args.partitions), args.partitions, 2)
        nodes: dict[str, Proc] = {}
        for node_id in ("n1", "n2"):
            argv = ["node", "--zk", settings.connect_string, "--node-id", node_id, "--port", str(harness.free_port())]
            argv += ["--data-dir", str(work / f"data-{node_id}"), "--zk-session-timeout-s", "10"]
            nodes[node_id] = Proc(argv, work / f"{node_id}.log")
            procs.append(nodes[node_id])
        urls: dict[str, str] = {}
        for name, stall in ROUTERS.items():
            port = harness.free_port()
            argv = ["router", "--zk", settings.connect_string, "--port", str(port), "--stall-after-ms", stall]
            procs.append(Proc(argv, work / f"router-{stall}.log"))
            urls[name] = f"http://127.0.0.1:{port}"

        def settled(url: str) -> bool:
            m = http.get(url + "/admin/partition-map?detail=all").json()
            entries = m["stores"][STORE]["partition_map"]
            return not m["stale"] and all(len(e["serving"]) == 2 for e in entries)

        for url in urls.values():
            harness.wait(lambda url=url: settled(url), 120, "both nodes serving every partition", 0.1)
        for name, url in urls.items():
            readers[name] = [Reads(url, args.keys) for _ in range(args.readers)]
            for r in readers[name]:
                threads.append(threading.Thread(target=r.run, daemon=True))
        for thread in threads:
            thread.start()
        time.sleep(args.quiet_s)  # warm: the automatic hedge delay needs recent latencies
        frozen = nodes["n1"].popen
        windows: list[tuple[float, float, float]] = []
        for seconds in args.freezes:
            start = time.monotonic()
            frozen.send_signal(signal.SIGSTOP)
            time.sleep(seconds)
            frozen.send_signal(signal.SIGCONT)
            windows.append((seconds, start, time.monotonic()))
            time.sleep(args.quiet_s)
        rows = []
        for seconds, start, end in windows:
            for name, rs in readers.items():
                samples = [s for r in rs for s in r.between(start, end)]
                latencies_ms = [s[1] * 1000 for s in samples]
                rows.append(
                    {
                        "freeze_s": seconds,
                        "router": name,
                        "reads": len(samples),
                        "failed": sum(1 for s in samples if s[2] != 200),
                        "p50_ms": statistics.median(latencies_ms) if latencies_ms else 0.0,
                        "p99_ms": percentile(latencies_ms, 99) if latencies_ms else 0.0,
                        "max_ms": max(latencies_ms, default=0.0),
                        "over_1s": sum(1 for ms in latencies_ms if ms > 1000),
                    }
                )
        return rows
    finally:
        for rs in readers.values():
            for r in rs:
                r.stop.set()
        for thread in threads:
            thread.join(timeout=30)
        for proc in procs:
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGCONT)
            proc.stop()
        http.close()
        zk.close(client)
        server.stop()


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| freeze | router | reads while frozen | failed | p50 | p99 | slowest | reads > 1 s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['freeze_s']:g} s | {r['router']} | {r['reads']:,} | {r['failed']} | {r['p50_ms']:.1f} ms "
            f"| {r['p99_ms']:.1f} ms | {r['max_ms']:,.0f} ms | {r['over_1s']} |"
        )
    return "\n".join(lines)


def section(rows: list[dict[str, Any]], command: str) -> str:
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    return "\n".join(
        [
            SECTION,
            "",
            f"`{command}` ({when}; {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}).",
            "",
            table(rows),
            "",
            "Node n1 is stopped with SIGSTOP (connections are accepted by the kernel, nothing answers) under steady",
            "reads through two routers side by side. With the stall delay off, a read in flight to the frozen node",
            "whose hedge the retry budget or back-off refused waits for the upstream timeout (5 s); as shipped, a",
            "read none of whose requests replied within 250 ms goes to the other replica whatever the budget, and the",
            "node is backed off, so new reads go to the other replica first.",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="keyroute-frozen-bench-"))
    try:
        rows = run(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    given = sys.argv[1:] if argv is None else argv
    command = shlex.join([".venv/bin/python", "benchmarks/frozen_replica.py", *given])
    text = section(rows, command)
    harness.record(SECTION, text, args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
