"""History, windows and key ranges, measured end to end: a client, a router process, a node process.

    .venv/bin/python benchmarks/timeline.py [--write]

One pipeline build (Spark local mode, embedded ZooKeeper) of three stores from one generated source:
`trips`, a history store holding one key (`hot`) with 10,000 rows among 2,000 other keys; `rows`, the same
rows as a latest store keyed by key and row number (`hot#00042`), so the same rows can be read as single
gets; `accounts`, 10,000 keys over 32 partitions, for ranges. One node serves every partition, one router
routes; the client reads through the router on one keep-alive connection, one request at a time.

Measured, side by side in one run:
- a history read of 100 and of 10,000 rows of `hot`: time to the answer's first byte (headers) and to its
  last, and node and router CPU per returned row; against the same rows read as single gets.
- the range of all 10,000 keys of `accounts`, page by page with limit 100, 1,000 and 10,000: wall time,
  router and node CPU per returned key, and the router's peak memory (a fresh router per limit) next to a
  range of 1,000 keys at the same limit (memory follows the limit, not the range).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness  # benchmarks/harness.py: ports, ZooKeeper, waiting, RESULTS.md
import httpx
import pyarrow as pa
import pyarrow.parquet as pq

from keyroute.pipeline.build import build
from keyroute.pipeline.session import create_session
from keyroute.runtime.settings import ZkSettings

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SECTION = "## History, windows and key ranges (benchmarks/timeline.py)"
HOT_ROWS = 10_000
OTHER_KEYS = 2_000
RANGE_KEYS = 10_000
RANGE_PARTITIONS = 32
BASE_US = 1_718_100_000_000_000


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def cpu_s(pid: int) -> float:
    """CPU seconds of process `pid` so far: the time its threads ran (schedstat, nanoseconds; the clock-tick
    counters of /proc/PID/stat are too coarse for a few milliseconds of reads)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    return total / 1e9


def peak_rss_mb(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", text).group(1)) / 1024  # type: ignore[union-attr]


Proc = harness.Proc  # `python -m keyroute ...` of this tree, its output in a log file


def write_sources(folder: Path) -> tuple[Path, Path]:
    """The events (hot key and the others) and the accounts, as parquet."""
    customers, stamps, seqs, fares = [], [], [], []
    for n in range(HOT_ROWS):
        customers.append("hot")
        stamps.append(BASE_US + n * 1_000_000)
        seqs.append(n)
        fares.append(10 + n % 490)
    for k in range(OTHER_KEYS):
        for n in range(5):
            customers.append(f"C{k:05d}")
            stamps.append(BASE_US + n * 60_000_000 + k)
            seqs.append(n)
            fares.append(10 + (k + n) % 490)
    events = pa.table(
        {
            "customer": pa.array(customers, pa.string()),
            "row": pa.array([f"{c}#{s:05d}" for c, s in zip(customers, seqs, strict=True)], pa.string()),
            "ts": pa.array(stamps, pa.timestamp("us", tz="UTC")),
            "seq": pa.array(seqs, pa.int64()),
            "fare": pa.array(fares, pa.int64()),
            "route": pa.array(["LHR-JFK"] * len(customers), pa.string()),
        }
    )
    (folder / "events").mkdir(parents=True)
    pq.write_table(events, folder / "events" / "part-0.parquet")
    accounts = pa.table(
        {
            "acct": pa.array([f"A{n:06d}" for n in range(RANGE_KEYS)], pa.string()),
            "seq": pa.array(range(RANGE_KEYS), pa.int64()),
            "balance": pa.array([n * 7 % 10_000 for n in range(RANGE_KEYS)], pa.int64()),
        }
    )
    (folder / "accounts").mkdir()
    pq.write_table(accounts, folder / "accounts" / "part-0.parquet")
    return folder / "events", folder / "accounts"


def write_spec(path: Path, events: Path, accounts: Path) -> Path:
    path.write_text(
        f"""
[stores.trips]
source = "{events.as_posix()}"
format = "parquet"
key = "customer"
partitions = 4
mode = "history"
order_by = "ts"
columns = ["seq", "fare", "route"]

[stores.rows]
source = "{events.as_posix()}"
format = "parquet"
key = "row"
partitions = 4
mode = "latest"
order_by = "ts"
columns = ["ts", "seq", "fare", "route"]

[stores.accounts]
source = "{accounts.as_posix()}"
format = "parquet"
key = "acct"
partitions = {RANGE_PARTITIONS}
mode = "latest"
order_by = "seq"
columns = ["balance"]
""",
        encoding="utf-8",
    )
    return path


def timed_get(client: httpx.Client, url: str, params: dict[str, str] | None = None) -> tuple[float, float, bytes]:
    """(seconds to the headers, seconds to the last byte, body) of one GET."""
    start = time.perf_counter()
    with client.stream("GET", url, params=params) as resp:
        first = time.perf_counter() - start
        body = resp.read()
        assert resp.status_code == 200, body[:300]
    return first, time.perf_counter() - start, body


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure_history(client: httpx.Client, router: Proc, node: Proc, rows: int, rounds: int) -> dict[str, float]:
    firsts, lasts = [], []
    node_start, router_start = cpu_s(node.pid), cpu_s(router.pid)
    for _ in range(rounds):
        first, last, body = timed_get(client, "/stores/trips/keys/hot/history", {"limit": str(rows)})
        assert body.count(b'"seq"') == rows
        firsts.append(first)
        lasts.append(last)
    returned = rounds * rows
    return {
        "first_ms": statistics.median(firsts) * 1000,
        "last_ms": statistics.median(lasts) * 1000,
        "last_p99_ms": quantile(lasts, 0.99) * 1000,
        "node_us_per_row": (cpu_s(node.pid) - node_start) / returned * 1e6,
        "router_us_per_row": (cpu_s(router.pid) - router_start) / returned * 1e6,
    }


def measure_gets(client: httpx.Client, router: Proc, node: Proc, rows: int, rounds: int) -> dict[str, float]:
    """The same rows of `hot` as single gets of the `rows` store, one after the other."""
    firsts, lasts = [], []
    node_start, router_start = cpu_s(node.pid), cpu_s(router.pid)
    for _ in range(rounds):
        start = time.perf_counter()
        first = None
        for n in range(rows):
            resp = client.get(f"/stores/rows/keys/hot%23{n:05d}")
            assert resp.status_code == 200, resp.text
            if first is None:
                first = time.perf_counter() - start
        firsts.append(first or 0.0)
        lasts.append(time.perf_counter() - start)
    returned = rounds * rows
    return {
        "first_ms": statistics.median(firsts) * 1000,
        "last_ms": statistics.median(lasts) * 1000,
        "last_p99_ms": quantile(lasts, 0.99) * 1000,
        "node_us_per_row": (cpu_s(node.pid) - node_start) / returned * 1e6,
        "router_us_per_row": (cpu_s(router.pid) - router_start) / returned * 1e6,
    }


def start_router(work: Path, zk: str, name: str) -> tuple[Proc, str]:
    port = harness.free_port()
    router = Proc(["router", "--zk", zk, "--port", str(port)], work / f"{name}.log")
    url = f"http://127.0.0.1:{port}"
    harness.wait(lambda: httpx.get(url + "/readyz").status_code == 200, 60, f"{name} ready")
    return router, url


def measure_range(work: Path, zk: str, node: Proc, limit: int, keys: int, rounds: int) -> dict[str, float]:
    """A fresh router reads a range of `keys` keys `rounds` times, `limit` a page."""
    router, url = start_router(work, zk, f"router-range-{limit}-{keys}")
    try:
        params = {} if keys == RANGE_KEYS else {"from_key": "A000000", "to_key": f"A{keys:06d}"}
        with httpx.Client(base_url=url, timeout=60) as client:
            client.get("/stores/accounts/range", params={"limit": "1"})  # warm: connections to the node
            baseline_mb = peak_rss_mb(router.pid)
            walls = []
            node_start, router_start = cpu_s(node.pid), cpu_s(router.pid)
            for _ in range(rounds):
                start = time.perf_counter()
                got = 0
                query = {**params, "limit": str(limit)}
                while True:
                    resp = client.get("/stores/accounts/range", params=query)
                    assert resp.status_code == 200, resp.text
                    body = resp.json()
                    got += len(body["keys"])
                    if "next" not in body:
                        break
                    query = {**params, "limit": str(limit), "cursor": body["next"]}
                assert got == keys, (got, keys)
                walls.append(time.perf_counter() - start)
            returned = rounds * keys
            return {
                "wall_ms": statistics.median(walls) * 1000,
                "pages": -(-keys // limit),
                "router_us_per_key": (cpu_s(router.pid) - router_start) / returned * 1e6,
                "node_us_per_key": (cpu_s(node.pid) - node_start) / returned * 1e6,
                "router_peak_mb": peak_rss_mb(router.pid),
                "router_growth_mb": peak_rss_mb(router.pid) - baseline_mb,
            }
    finally:
        router.stop()


def section(command: str, history: dict[str, dict[str, float]], ranges: dict[str, dict[str, float]]) -> str:
    load = os.getloadavg()[0]
    lines = [
        SECTION,
        "",
        f"`{command}` on {dt.date.today().isoformat()}. Machine: {os.cpu_count()} CPUs, {platform.machine()}, "
        f"Python {platform.python_version()}; 1-minute load average {load:.1f} at the end. One pipeline build "
        f"(Spark local mode, embedded ZooKeeper) of: `trips`, a history store where key `hot` has "
        f"{HOT_ROWS:,} rows ({{ts, seq, fare, route}}) among {OTHER_KEYS:,} other keys of 5 rows; `rows`, the "
        "same rows as a latest store keyed by key and row number (`hot#00042`); `accounts`, "
        f"{RANGE_KEYS:,} keys over {RANGE_PARTITIONS} partitions. One node process serves every partition, "
        "one router process routes (one worker); the client (httpx, one keep-alive connection, one request at "
        "a time) reads through the router. CPU = the process's user + system time over the reads divided by "
        "the rows or keys returned (threads' run time from /proc/PID/task/*/schedstat). First byte = the "
        "answer's headers received; last = its body read whole.",
        "",
        "### History of one key vs the same rows as single gets",
        "",
        "| read | rows | first byte ms, median | last row ms, median | last row ms, p99 | node CPU µs/row | "
        "router CPU µs/row |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, figures in history.items():
        kind, rows = label.rsplit(" ", 1)
        lines.append(
            f"| {kind} | {int(rows):,} | {figures['first_ms']:.2f} | {figures['last_ms']:.1f} | "
            f"{figures['last_p99_ms']:.1f} | {figures['node_us_per_row']:.2f} | {figures['router_us_per_row']:.2f} |"
        )
    lines.append("")
    for rows in (100, HOT_ROWS):
        one, gets = history[f"history {rows}"], history[f"single gets {rows}"]
        lines.append(
            f"- {rows:,} rows: one history read is {gets['last_ms'] / one['last_ms']:.0f}x as fast to the last "
            f"row as {rows:,} single gets, at {gets['node_us_per_row'] / max(one['node_us_per_row'], 1e-9):.0f}x "
            f"less node CPU and {gets['router_us_per_row'] / max(one['router_us_per_row'], 1e-9):.0f}x less "
            "router CPU per row."
        )
    lines += [
        "",
        f"### A range of keys over {RANGE_PARTITIONS} partitions",
        "",
        "Each row: a fresh router process reads the whole range page by page (every page asks all "
        f"{RANGE_PARTITIONS} partitions for twice their share of `limit` keys, asks again the ones whose keys "
        "might still be among the page's, and merges them); router peak = its peak resident memory (VmHWM), "
        "growth = above its peak after one warm-up read of 1 key.",
        "",
        "| range | limit | pages | wall ms, median | router CPU µs/key | node CPU µs/key | router peak MB | "
        "router growth MB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, figures in ranges.items():
        keys, limit = label.split("/")
        lines.append(
            f"| {int(keys):,} keys | {int(limit):,} | {int(figures['pages']):,} | {figures['wall_ms']:.0f} | "
            f"{figures['router_us_per_key']:.1f} | {figures['node_us_per_key']:.1f} | "
            f"{figures['router_peak_mb']:.1f} | {figures['router_growth_mb']:.1f} |"
        )
    small, large = ranges[f"1000/{100}"], ranges[f"{RANGE_KEYS}/{100}"]
    lines += [
        "",
        f"- Memory follows the limit, not the range: at limit 100 the router grew {small['router_growth_mb']:.1f} "
        f"MB for 1,000 keys and {large['router_growth_mb']:.1f} MB for {RANGE_KEYS:,}; at limit 10,000 "
        f"(one page of every key) {ranges[f'{RANGE_KEYS}/10000']['router_growth_mb']:.1f} MB.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="timed reads per small case (default: 20)")
    parser.add_argument("--write", action="store_true", help=f"record the figures in {RESULTS.name}")
    args = parser.parse_args(argv)
    command = ".venv/bin/python benchmarks/timeline.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    work = Path(tempfile.mkdtemp(prefix="keyroute-timeline-bench-"))
    procs: list[Proc] = []
    try:
        with harness.zookeeper(work) as zk_server:
            settings = ZkSettings(hosts=zk_server.connect_string, chroot="/bench")
            events, accounts = write_sources(work / "source")
            spark = create_session("local[*]", local_dir=work / "spark")
            try:
                start = time.perf_counter()
                build(write_spec(work / "stores.toml", events, accounts), settings, str(work / "out"), spark=spark)
                log(f"built in {time.perf_counter() - start:.1f}s")
            finally:
                spark.stop()
            zk = settings.connect_string
            node_port = harness.free_port()
            node = Proc(
                ["node", "--zk", zk, "--node-id", "n1", "--port", str(node_port), "--data-dir", str(work / "n1")],
                work / "node.log",
            )
            procs.append(node)
            router, url = start_router(work, zk, "router")
            procs.append(router)
            history: dict[str, dict[str, float]] = {}
            with httpx.Client(base_url=url, timeout=60) as client:
                history_path = "/stores/trips/keys/hot/history?limit=1"
                harness.wait(lambda: client.get(history_path).status_code == 200, 60, "served")
                harness.wait(lambda: client.get("/stores/rows/keys/hot%2300000").status_code == 200, 60, "served")
                for _ in range(3):  # warm-up
                    timed_get(client, "/stores/trips/keys/hot/history", {"limit": str(HOT_ROWS)})
                history["history 100"] = measure_history(client, router, node, 100, args.rounds * 25)
                history["single gets 100"] = measure_gets(client, router, node, 100, args.rounds)
                history[f"history {HOT_ROWS}"] = measure_history(client, router, node, HOT_ROWS, args.rounds)
                history[f"single gets {HOT_ROWS}"] = measure_gets(client, router, node, HOT_ROWS, 2)
                log(f"history: {history}")
            ranges: dict[str, dict[str, float]] = {}
            for keys, limit in ((1000, 100), (RANGE_KEYS, 100), (RANGE_KEYS, 1000), (RANGE_KEYS, 10_000)):
                rounds = 3 if limit == 100 else 5
                ranges[f"{keys}/{limit}"] = measure_range(work, zk, node, limit, keys, rounds)
                log(f"range {keys} keys, limit {limit}: {ranges[f'{keys}/{limit}']}")
    finally:
        for proc in reversed(procs):
            proc.stop()
        shutil.rmtree(work, ignore_errors=True)
    text = section(command.strip(), history, ranges)
    harness.record(SECTION, text, args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
