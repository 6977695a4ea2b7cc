"""Which replica a read goes to, with one slow node: the router's p99 with least outstanding requests against
the previous choice (power of two choices) and against no load information at all (a random replica), in one
run.

Run from the repository root: `.venv/bin/python benchmarks/least_loaded.py [--write]` (`--quick`: a smoke run of
the plumbing, not figures). It writes a store without Spark (benchmarks/cluster.py), starts one ZooKeeper and,
in turn, two clusters on it: replication factor 2 on two nodes, and 3 on three nodes. One node of each is slow:
it advertises an address of a proxy in this process that holds every request `--delay-ms` before passing it on
(a node that is behind: a long GC pause, a noisy neighbour, a cold disk). Three routers read from each cluster,
identical but for the replica choice (the two others patched into router/balancer.py at start-up), hedging off
so that the choice alone is measured. wrk sends random keys at a fixed concurrency to each router in turn, in a
shuffled order per round; p50 and p99 are wrk's, medians of the rounds. --write records the table in
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import harness  # benchmarks/harness.py: ports, ZooKeeper, waiting, RESULTS.md

bench = harness.script("router.py")  # wrk and its script
clusters = harness.script("cluster.py")  # processes, the store, waiting

from keyroute.dev.zookeeper_server import EmbeddedZooKeeper  # noqa: E402
from keyroute.runtime.settings import ZkSettings  # noqa: E402

SECTION = "## Replica choice with a slow node (benchmarks/least_loaded.py)"
LEAST, TWO, RANDOM = "least outstanding requests (this work tree)", "power of two choices (previous)", "random replica"
VARIANTS = {LEAST: "least", TWO: "two", RANDOM: "random"}

# A router whose Balancer picks as `sys.argv[1]` says, then `keyroute` with the remaining arguments.
LAUNCH = """
import random, sys
from keyroute.router import balancer

def two(self, endpoints):  # power of two choices, as router/balancer.py chose before least outstanding requests
    n = len(endpoints)
    if n < 2:
        return endpoints
    load = self.in_flight
    rand = self._random
    i = int(rand() * n)
    j = int(rand() * (n - 1))
    if j >= i:
        j += 1
    first, second = endpoints[i], endpoints[j]
    a, b = load.get(first.url, 0), load.get(second.url, 0)
    if b < a or (a == b and rand() >= 0.5):
        first, second = second, first
    return (first, second, *(ep for ep in endpoints if ep is not first and ep is not second))

def shuffled(self, endpoints):  # no load information at all
    order = list(endpoints)
    random.shuffle(order)
    return tuple(order)

variant = sys.argv[1]
if variant == "two":
    balancer.Balancer._pick = two
elif variant == "random":
    balancer.Balancer._pick = shuffled
from keyroute.cli import main
raise SystemExit(main(sys.argv[2:]))
"""


class DelayProxy:
    """A TCP proxy on 127.0.0.1 that holds every chunk a client sends `delay_s` before passing it to `target`
    (one chunk per request on a keep-alive connection: each request is late by `delay_s`). Its own thread
    and event loop."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        self.target_port = target_port
        self.delay_s = delay_s
        self.port = harness.free_port()
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        threading.Thread(target=self._run, args=(started,), daemon=True).start()
        started.wait(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        started.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter, delay_s: float) -> None:
            try:
                while chunk := await source.read(65536):
                    if delay_s:
                        await asyncio.sleep(delay_s)
                    sink.write(chunk)
                    await sink.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                sink.close()

        await asyncio.gather(pipe(reader, up_writer, self.delay_s), pipe(up_reader, writer, 0.0))

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)


def start_router(cluster: Any, variant: str) -> tuple[str, subprocess.Popen[bytes]]:
    port = harness.free_port()
    args = ["router", "--zk", cluster.zk_settings.connect_string, "--port", str(port)]
    args += ["--zk-session-timeout-s", str(cluster.session_timeout_s), "--hedge-after-ms", "0"]
    log = open(cluster.work / f"router-{variant}.log", "ab")  # noqa: SIM115 (open for the process's life)
    popen = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, variant, *args], stdout=log, stderr=subprocess.STDOUT, cwd=clusters.ROOT
    )
    url = f"http://127.0.0.1:{port}"
    harness.wait(lambda: cluster.http.get(url + "/healthz").status_code == 200, 30, f"router {variant} up")
    return url, popen


def measure(zk_server: EmbeddedZooKeeper, work: Path, rf: int, args: argparse.Namespace) -> dict[str, list[Any]]:
    """rf nodes (n2 slow), one router per variant; {variant: [Run per round]}."""
    settings = ZkSettings(hosts=zk_server.connect_string, chroot=f"/least-loaded-{rf}", session_timeout_s=10)
    cluster = clusters.Cluster(work / f"rf{rf}", settings, 10.0)
    cluster.work.mkdir()
    nodes = [f"n{i}" for i in range(1, rf + 1)]
    runs: dict[str, list[Any]] = {variant: [] for variant in VARIANTS}
    with ExitStack() as stack:
        stack.callback(cluster.close)
        snapshot = clusters.write_store(cluster.work / "snapshots", args.keys, args.partitions)
        clusters.publish(cluster.client, snapshot, args.partitions, rf)
        for node_id in nodes:
            port = harness.free_port()
            extra: list[str] = []
            if node_id == "n2":
                proxy = DelayProxy(port, args.delay_ms / 1000)
                stack.callback(proxy.close)
                extra = ["--advertise-url", f"http://127.0.0.1:{proxy.port}"]
            data = cluster.work / f"data-{node_id}"
            node_args = ["node", "--zk", settings.connect_string, "--node-id", node_id, "--port", str(port)]
            node_args += ["--data-dir", str(data), "--zk-session-timeout-s", "10", *extra]
            cluster.nodes[node_id] = (clusters.Proc(node_args, cluster.work / f"{node_id}.log"), "")
        routers: dict[str, str] = {}
        for variant, name in VARIANTS.items():
            url, popen = start_router(cluster, name)
            stack.callback(_stop, popen)
            routers[variant] = url
        first = routers[LEAST]
        harness.wait(lambda: cluster.settled(first, set(nodes), rf), 300, f"rf {rf} settled", 0.05)
        paths = cluster.work / "paths.txt"
        rng = random.Random(rf)
        paths.write_text(
            "".join(f"/stores/{clusters.STORE}/keys/customer-{rng.randrange(args.keys):08d}\n" for _ in range(20000))
        )
        script = cluster.work / "wrk.lua"
        script.write_text(bench.WRK_SCRIPT)
        wrk = bench.find_tool("wrk")
        if wrk is None:
            raise SystemExit("benchmark: wrk is needed (apt-get install wrk)")
        for url in routers.values():  # warm: connections to every node, the automatic hedge state unused
            bench.wrk_run(wrk, script, url, paths, args.concurrency, 1, 1)
        for round_ in range(args.rounds):
            order = list(routers)
            random.Random(round_).shuffle(order)
            for variant in order:
                run = bench.wrk_run(wrk, script, routers[variant], paths, args.concurrency, args.duration, round_)
                runs[variant].append(run)
                print(f"rf {rf} round {round_ + 1} {variant}: p50 {run.p50_us:.0f} µs, p99 {run.p99_us:.0f} µs")
    return runs


def _stop(popen: subprocess.Popen[bytes]) -> None:
    popen.terminate()
    try:
        popen.wait(timeout=30)
    except subprocess.TimeoutExpired:
        popen.kill()


def section(results: dict[int, dict[str, list[Any]]], args: argparse.Namespace, load: tuple[float, float]) -> str:
    command = "`.venv/bin/python benchmarks/least_loaded.py --write`"
    lines = [
        SECTION,
        "",
        f"{command} on {datetime.date.today()}, {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}; load average {load[0]:.1f} before, {load[1]:.1f} after. "
        f"{args.keys:,} keys in {args.partitions} partitions; node n2 is slow: every request to it waits "
        f"{args.delay_ms:g} ms in a proxy. Three routers per cluster, identical but for the replica choice, "
        f"hedging off; wrk, {args.concurrency} connections, {args.duration:g} s per measurement, medians of "
        f"{args.rounds} rounds (routers in a shuffled order per round).",
        "",
        "| replicas | replica choice | reads/s | p50 µs | p99 µs | errors |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for rf, runs in results.items():
        for variant, measured in runs.items():
            rate = statistics.median(r.requests / r.duration_s for r in measured)
            p50 = statistics.median(r.p50_us for r in measured)
            p99 = statistics.median(r.p99_us for r in measured)
            errors = sum(r.errors for r in measured)
            lines.append(f"| {rf} (one slow) | {variant} | {rate:,.0f} | {p50:,.0f} | {p99:,.0f} | {errors} |")
    lines.append("")
    for rf, runs in results.items():
        p99 = {variant: statistics.median(r.p99_us for r in measured) for variant, measured in runs.items()}
        lines.append(
            f"rf {rf}: p99 with least outstanding requests is {p99[LEAST] / p99[TWO]:.2f}x that of power of two "
            f"choices and {p99[LEAST] / p99[RANDOM]:.2f}x that of a random replica."
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=20_000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--delay-ms", type=float, default=5.0, help="how late the slow node answers")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a smoke run of the plumbing, not figures")
    parser.add_argument("--write", action="store_true", help="record the table in benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.keys, args.duration, args.rounds = 2000, 1.0, 1
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="keyroute-least-loaded-") as tmp:
        work = Path(tmp)
        with harness.zookeeper(work) as zk_server:
            results = {rf: measure(zk_server, work, rf, args) for rf in (2, 3)}
    text = section(results, args, (load_before, os.getloadavg()[0]))
    print(text)
    if args.write and not args.quick:
        harness.write_section(SECTION, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
