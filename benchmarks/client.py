"""The Python client, measured: direct routing vs through the router vs plain httpx with hand-built URLs.

    .venv/bin/python benchmarks/client.py [--write]

One pipeline build (Spark local mode, embedded ZooKeeper) of a latest store of 20,000 keys over 8
partitions; two node processes, one router process. Side by side in one run, reading random keys:
- concurrency 1: `Client` (routing "router" and "direct") and `httpx.Client` getting
  router_url + "/stores/s/keys/" + quote(key) and parsing the JSON;
- concurrency 32: `AsyncClient` (both routings) and `httpx.AsyncClient`, 32 reads in flight.
Reported: latency p50/p99 per read, and the client's own CPU per read (this process; the cluster runs in
other processes), with its ratio to plain httpx's.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import platform
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import harness  # benchmarks/harness.py: ports, ZooKeeper, waiting, RESULTS.md
import httpx
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timeline import Proc, log, start_router  # noqa: E402

from keyroute.client import AsyncClient, Client  # noqa: E402
from keyroute.pipeline.build import build  # noqa: E402
from keyroute.pipeline.session import create_session  # noqa: E402
from keyroute.runtime.settings import ZkSettings  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SECTION = "## Python client: direct routing vs the router (benchmarks/client.py)"
KEYS = 20_000
PARTITIONS = 8


def write_store(work: Path) -> Path:
    source = work / "source"
    source.mkdir(parents=True)
    table = pa.table(
        {
            "customer": pa.array([f"C{n:06d}" for n in range(KEYS)], pa.string()),
            "seq": pa.array(range(KEYS), pa.int64()),
            "fare": pa.array([n % 997 for n in range(KEYS)], pa.int64()),
        }
    )
    pq.write_table(table, source / "part-0.parquet")
    spec = work / "stores.toml"
    spec.write_text(
        f'[stores.s]\nsource = "{source.as_posix()}"\nformat = "parquet"\nkey = "customer"\n'
        f'partitions = {PARTITIONS}\nmode = "latest"\norder_by = "seq"\ncolumns = ["fare"]\n',
        encoding="utf-8",
    )
    return spec


def measure_sync(read: Callable[[str], Any], keys: list[str]) -> dict[str, float]:
    latencies = []
    cpu = time.process_time()
    for key in keys:
        start = time.perf_counter()
        read(key)
        latencies.append(time.perf_counter() - start)
    cpu = time.process_time() - cpu
    return _figures(latencies, cpu, len(keys))


async def measure_async(read: Callable[[str], Awaitable[Any]], keys: list[str], concurrency: int) -> dict[str, float]:
    latencies: list[float] = []
    queue = iter(keys)

    async def worker() -> None:
        for key in queue:
            start = time.perf_counter()
            await read(key)
            latencies.append(time.perf_counter() - start)

    cpu = time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    cpu = time.process_time() - cpu
    return _figures(latencies, cpu, len(keys))


def _figures(latencies: list[float], cpu: float, reads: int) -> dict[str, float]:
    ordered = sorted(latencies)
    return {
        "p50_ms": statistics.median(ordered) * 1000,
        "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000,
        "cpu_us": cpu / reads * 1e6,
    }


def run(url: str, reads: int, rounds: int, seed: int) -> dict[str, dict[str, list[dict[str, float]]]]:
    rng = random.Random(seed)
    results: dict[str, dict[str, list[dict[str, float]]]] = {"1": {}, "32": {}}
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)  # as the client keeps
    plain = httpx.Client(base_url=url, timeout=10, trust_env=False, limits=limits)
    router = Client(url, timeout=10)
    direct = Client(url, timeout=10, routing="direct")

    def plain_get(key: str) -> Any:
        response = plain.get("/stores/s/keys/" + quote(key, safe=""))
        assert response.status_code == 200
        return response.json()

    sync_ways: dict[str, Callable[[str], Any]] = {
        "plain httpx": plain_get,
        "client via router": lambda key: router.get("s", key),
        "client direct": lambda key: direct.get("s", key),
    }

    async def async_rounds() -> None:
        aplain = httpx.AsyncClient(base_url=url, timeout=10, trust_env=False, limits=limits)
        arouter = AsyncClient(url, timeout=10)
        adirect = AsyncClient(url, timeout=10, routing="direct")

        async def aplain_get(key: str) -> Any:
            response = await aplain.get("/stores/s/keys/" + quote(key, safe=""))
            assert response.status_code == 200
            return response.json()

        ways: dict[str, Callable[[str], Awaitable[Any]]] = {
            "plain httpx": aplain_get,
            "client via router": lambda key: arouter.get("s", key),
            "client direct": lambda key: adirect.get("s", key),
        }
        for read in ways.values():  # warm-up: connections, the direct client's map
            await measure_async(read, [f"C{rng.randrange(KEYS):06d}" for _ in range(200)], 32)
        for round_index in range(rounds):
            order = list(ways) if round_index % 2 == 0 else list(reversed(ways))
            for way in order:
                keys = [f"C{rng.randrange(KEYS):06d}" for _ in range(reads)]
                results["32"].setdefault(way, []).append(await measure_async(ways[way], keys, 32))
        await aplain.aclose()
        await arouter.aclose()
        await adirect.aclose()

    try:
        for read in sync_ways.values():  # warm-up
            measure_sync(read, [f"C{rng.randrange(KEYS):06d}" for _ in range(200)])
        for round_index in range(rounds):
            order = list(sync_ways) if round_index % 2 == 0 else list(reversed(sync_ways))
            for way in order:
                keys = [f"C{rng.randrange(KEYS):06d}" for _ in range(reads)]
                results["1"].setdefault(way, []).append(measure_sync(sync_ways[way], keys))
        asyncio.run(async_rounds())
        log(f"direct client stats: {direct.stats}")
    finally:
        plain.close()
        router.close()
        direct.close()
    return results


def section(command: str, results: dict[str, dict[str, list[dict[str, float]]]], reads: int, rounds: int) -> str:
    lines = [
        SECTION,
        "",
        f"`{command}` on {dt.date.today().isoformat()}. Machine: {os.cpu_count()} CPUs, {platform.machine()}, "
        f"Python {platform.python_version()}; 1-minute load average {os.getloadavg()[0]:.1f} at the end. A latest "
        f"store of {KEYS:,} keys over {PARTITIONS} partitions, two node processes, one router process (one "
        f"worker), all on this machine; {rounds} rounds of {reads:,} reads of random keys per way, ways "
        "interleaved; figures are medians over rounds. Plain httpx = `httpx.Client`/`AsyncClient` getting the "
        "router's URL built by hand and parsing the JSON, with the client's connection limits (256 kept alive). "
        "Client CPU = this process's CPU time per read (the "
        "cluster runs in other processes). Concurrency 32 = 32 reads in flight on one event loop.",
        "",
        "| concurrency | way | p50 ms | p99 ms | client CPU µs/read | CPU vs plain httpx |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    verdicts = []
    for concurrency, ways in results.items():
        plain_cpu = statistics.median(r["cpu_us"] for r in ways["plain httpx"])
        medians = {}
        for way, rounds_of in ways.items():
            p50 = statistics.median(r["p50_ms"] for r in rounds_of)
            p99 = statistics.median(r["p99_ms"] for r in rounds_of)
            cpu = statistics.median(r["cpu_us"] for r in rounds_of)
            medians[way] = (p50, p99, cpu)
            lines.append(f"| {concurrency} | {way} | {p50:.3f} | {p99:.3f} | {cpu:.0f} | {cpu / plain_cpu:.2f}x |")
        direct, router = medians["client direct"], medians["client via router"]
        verdicts.append(
            f"- concurrency {concurrency}: direct p50 {direct[0]:.3f} ms vs via the router {router[0]:.3f} ms "
            f"({router[0] / direct[0]:.2f}x; p99 {direct[1]:.3f} vs {router[1]:.3f}): lower latency "
            f"{'met' if direct[0] < router[0] else 'MISSED'}; client CPU {direct[2] / plain_cpu:.2f}x plain "
            f"httpx's (direct) and {router[2] / plain_cpu:.2f}x (via the router), target <= 1.5x: "
            f"{'met' if max(direct[2], router[2]) <= 1.5 * plain_cpu else 'MISSED'}."
        )
    return "\n".join([*lines, "", *verdicts, ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reads", type=int, default=3000, help="reads per way and round (default: 3000)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default: 5)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--write", action="store_true", help=f"record the figures in {RESULTS.name}")
    args = parser.parse_args(argv)
    command = ".venv/bin/python benchmarks/client.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    work = Path(tempfile.mkdtemp(prefix="keyroute-client-bench-"))
    procs: list[Proc] = []
    try:
        with harness.zookeeper(work) as zk_server:
            settings = ZkSettings(hosts=zk_server.connect_string, chroot="/bench")
            spark = create_session("local[*]", local_dir=work / "spark")
            try:
                build(write_store(work), settings, str(work / "out"), spark=spark)
            finally:
                spark.stop()
            zk = settings.connect_string
            for node_id in ("n1", "n2"):
                node = ["node", "--zk", zk, "--node-id", node_id, "--port", str(harness.free_port())]
                procs.append(Proc([*node, "--data-dir", str(work / node_id)], work / f"{node_id}.log"))
            router, url = start_router(work, zk, "router")
            procs.append(router)

            def served() -> bool:
                body = httpx.get(url + "/admin/partition-map?detail=all").json()
                placed = {s["node"] for e in body["stores"]["s"]["partition_map"] for s in e["serving"]}
                return placed == {"n1", "n2"} and all(e["serving"] for e in body["stores"]["s"]["partition_map"])

            harness.wait(served, 120, "both nodes serving")
            results = run(url, args.reads, args.rounds, args.seed)
    finally:
        for proc in reversed(procs):
            proc.stop()
        shutil.rmtree(work, ignore_errors=True)
    text = section(command.strip(), results, args.reads, args.rounds)
    print(text)
    if args.write:
        harness.write_section(SECTION, text)
        log(f"wrote {SECTION!r} to {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
