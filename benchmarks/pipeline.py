"""Pipeline build time with and without the partition step, and with the partitioner audit, on 1M events.

Run from the repository root: `.venv/bin/python benchmarks/pipeline.py [--write]`; --write records them.
Wall-clock time is what the target is about; CPU time (Spark's JVM and Python workers, and this process)
is reported beside it because the machines are shared, and another job's load stretches wall-clock time.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import harness  # benchmarks/harness.py: ports, ZooKeeper, waiting, RESULTS.md

# Run as a script, this file's folder comes first on sys.path, where this file's name hides the `pipeline`
# package it measures: the folder goes before anything is imported from there (hence E402 off, file-wide).
# ruff: noqa: E402
_HERE = str(Path(__file__).resolve().parent)
while _HERE in sys.path:
    sys.path.remove(_HERE)

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pyspark
from pyspark.sql import Column, SparkSession

from keyroute.dev.zookeeper_server import EmbeddedZooKeeper
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.pipeline import keys as pipeline_keys
from keyroute.pipeline.build import build
from keyroute.pipeline.keys import key_partitions
from keyroute.pipeline.session import create_session
from keyroute.pipeline.spec import StoreSpec
from keyroute.runtime.settings import ZkSettings

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SECTION = "## Pipeline"
TARGET_OVERHEAD = 0.15
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
STORE = "bookings"
SOURCE_FILES = 8  # several files, so Spark reads the source with every core
ROUTES = ["LIS-OPO", "OPO-FAO", "FAO-LIS", "LIS-Ponta Delgada", "OPO-Funchal"]


@dataclass(frozen=True)
class Variant:
    """One way of building the same store: the spec file, and how compute routes keys."""

    name: str
    spec: Path
    route_step: Callable[[StoreSpec, Column], Column]


KEY_SHAPES = {
    KeyFormat.STRING: "string keys (`CNNNNNNN`)",
    KeyFormat.INT64: "int64 keys (random 64-bit ids)",
}


def generate_events(folder: Path, events: int, keys: int, partitions: int, key_format: KeyFormat, seed: int) -> None:
    """Bookings-like events as parquet, with the partition a murmur2 producer sent each one to."""
    rng = np.random.default_rng(seed)
    customer = rng.integers(0, keys, size=events)
    if key_format is KeyFormat.INT64:
        ids = pa.array(rng.integers(-(2**63), 2**63 - 1, size=keys, dtype=np.int64)[customer])
    else:
        ids = pa.array(np.char.add("C", np.char.zfill(customer.astype("U7"), 7)), pa.string())
    table = pa.table(
        {
            "customer_id": ids,
            "ts": rng.integers(1_700_000_000_000, 1_800_000_000_000, size=events),
            "route": pa.array(np.array(ROUTES)[rng.integers(0, len(ROUTES), size=events)], pa.string()),
            "fare": np.round(rng.uniform(20.0, 900.0, size=events), 2),
            "seats": rng.integers(1, 9, size=events, dtype=np.int32),
            "partition": key_partitions(ids, key_format, Partitioner.MURMUR2, partitions),
        }
    )
    folder.mkdir(parents=True)
    step = -(-events // SOURCE_FILES)
    for index, first in enumerate(range(0, events, step)):
        pq.write_table(table.slice(first, step), folder / f"part-{index:03d}.parquet")


def write_spec(path: Path, source: Path, args: argparse.Namespace, audit: bool) -> Path:
    lines = [
        f"[stores.{STORE}]",
        f'source = "{source.as_posix()}"',
        'format = "parquet"',
        'key = "customer_id"',
        f'key_format = "{args.key_format}"',
        f"partitions = {args.partitions}",
        'mode = "latest"',
        'order_by = "ts"',
        'columns = ["ts", "route", "fare", "seats"]',
    ]
    if audit:
        lines.append('source_partition_column = "partition"')
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@contextmanager
def routed_by(step: Callable[[StoreSpec, Column], Column]) -> Iterator[None]:
    saved = pipeline_keys.route_step
    pipeline_keys.route_step = step
    try:
        yield
    finally:
        pipeline_keys.route_step = saved


@dataclass(frozen=True)
class Timings:
    """Every timed build of one variant: wall-clock and CPU seconds, round by round."""

    variant: Variant
    wall: list[float]
    cpu: list[float]


def process_tree_cpu_s(root: int) -> float:
    """CPU seconds used so far by process `root` and its descendants (Linux /proc; reaped children included).

    For the Spark JVM, that is the executors' threads and the Python workers its daemon forks.
    """
    stats: dict[int, list[str]] = {}
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # exited meanwhile
        fields = text[text.rindex(")") + 2 :].split()  # from field 3 (state) on: comm may hold spaces
        stats[int(entry)] = fields
        children.setdefault(int(fields[1]), []).append(int(entry))
    ticks, pending = 0, [root]
    while pending:
        pid = pending.pop()
        if pid in stats:
            ticks += sum(int(field) for field in stats[pid][11:15])  # utime stime cutime cstime
            pending.extend(children.get(pid, []))
    return ticks / CLOCK_TICKS


def cpu_now(spark: SparkSession) -> float:
    """CPU seconds used so far by this process and the Spark JVM's process tree."""
    own = os.times()
    jvm = spark.sparkContext._gateway.proc.pid  # type: ignore[union-attr]
    return own.user + own.system + process_tree_cpu_s(jvm)


def run_build(
    spark: SparkSession, zk: EmbeddedZooKeeper, variant: Variant, work: Path, expected_keys: int
) -> tuple[float, float]:
    """Wall-clock and CPU seconds of one whole build() into a fresh output and a fresh ZooKeeper chroot."""
    output = work / f"out-{uuid.uuid4().hex[:8]}"
    settings = ZkSettings(hosts=zk.connect_string, chroot=f"/bench-{uuid.uuid4().hex[:12]}")
    with routed_by(variant.route_step):
        cpu_start, start = cpu_now(spark), time.perf_counter()
        published = build(variant.spec, settings, str(output), spark=spark)
        wall, cpu = time.perf_counter() - start, cpu_now(spark) - cpu_start
    shutil.rmtree(output)
    if [p.rows for p in published] != [expected_keys]:
        raise SystemExit(f"{variant.name}: published {published}, expected {expected_keys} keys")
    return wall, cpu


def settle(max_load: float, max_wait_s: float) -> float:
    """Wait (up to max_wait_s) until the 1-minute load average is at most max_load; return it."""
    deadline = time.monotonic() + max_wait_s
    while (load := os.getloadavg()[0]) > max_load and time.monotonic() < deadline:
        time.sleep(5)
    return load


def measure(
    spark: SparkSession,
    zk: EmbeddedZooKeeper,
    variants: list[Variant],
    work: Path,
    keys: int,
    args: argparse.Namespace,
) -> tuple[list[Timings], list[float]]:
    """Every variant once untimed (JIT, caches), then `args.rounds` rounds, each in a rotated order.

    Each round first waits a while for the machine to quieten; the load average it started at is returned.
    """
    for variant in variants:
        run_build(spark, zk, variant, work, keys)
    print("warm-up done", file=sys.stderr, flush=True)
    wall: dict[str, list[float]] = {v.name: [] for v in variants}
    cpu: dict[str, list[float]] = {v.name: [] for v in variants}
    loads = []
    for round_index in range(args.rounds):
        loads.append(settle(args.settle_load, args.settle_wait_s))
        shift = round_index % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            wall_s, cpu_s = run_build(spark, zk, variant, work, keys)
            wall[variant.name].append(wall_s)
            cpu[variant.name].append(cpu_s)
        shown = ", ".join(f"{v.name} {wall[v.name][-1]:.2f}s ({cpu[v.name][-1]:.2f}s CPU)" for v in variants)
        print(
            f"round {round_index + 1}/{args.rounds} (load {loads[-1]:.1f}): {shown}",
            file=sys.stderr,
            flush=True,
        )
    return [Timings(v, wall[v.name], cpu[v.name]) for v in variants], loads


@dataclass(frozen=True)
class Overhead:
    """How much longer `slower` builds took than `faster`: on the medians, and the median of round pairs."""

    medians: float
    pairs: float

    @classmethod
    def of(cls, slower: list[float], faster: list[float]) -> Overhead:
        # Each round's builds ran back to back, under much the same noise: their ratio is steadier.
        pairs = statistics.median(s / f for s, f in zip(slower, faster, strict=True)) - 1
        return cls(statistics.median(slower) / statistics.median(faster) - 1, pairs)

    def __str__(self) -> str:
        return f"{self.medians:+.1%} (round pairs: {self.pairs:+.1%})"


def _listed(values: list[float]) -> str:
    return ", ".join(f"{value:.1f}" for value in values)


def section(timings: list[Timings], loads: list[float], args: argparse.Namespace, keys: int, command: str) -> str:
    unhashed, hashed, audited = timings
    step_wall, step_cpu = Overhead.of(hashed.wall, unhashed.wall), Overhead.of(hashed.cpu, unhashed.cpu)
    audit_wall, audit_cpu = Overhead.of(audited.wall, hashed.wall), Overhead.of(audited.cpu, hashed.cpu)
    verdict = "met" if step_wall.medians <= TARGET_OVERHEAD else "MISSED"
    versions = (
        f"Python {platform.python_version()}, PySpark {pyspark.__version__}, NumPy {np.__version__}, "
        f"pyarrow {pa.__version__}"
    )
    rows = [
        "| build | wall s, median | CPU s, median | wall s, rounds | CPU s, rounds |",
        "| --- | ---: | ---: | --- | --- |",
        *[
            f"| {t.variant.name} | {statistics.median(t.wall):.2f} | {statistics.median(t.cpu):.2f}"
            f" | {_listed(t.wall)} | {_listed(t.cpu)} |"
            for t in timings
        ],
    ]
    return "\n".join(
        [
            SECTION,
            "",
            f"`{command}` on {datetime.date.today().isoformat()}: {args.events:,} bookings-like events"
            f" (parquet, {SOURCE_FILES} files, seed {args.seed}) over {keys:,} {KEY_SHAPES[args.key_format]},"
            f" mode latest, {args.partitions} partitions, murmur2; one SparkSession ({args.master}),"
            " each build() into a fresh output and a fresh chroot of one embedded ZooKeeper;"
            f" one warm-up build of each kind, then {args.rounds} interleaved rounds.",
            f"Machine: {os.cpu_count()} CPUs, {platform.machine()}, {versions}. The machine is shared:"
            f" 1-minute load average {min(loads):.1f}-{max(loads):.1f} at the start of the rounds, so"
            " wall-clock times are noisy; CPU time (Spark's JVM with its Python workers, and the driver)"
            " is steadier.",
            '"No partition step" swaps `keyroute.pipeline.keys.route_step` for `unhashed_route_column` (no Python',
            "UDF, no Kafka hash: keys spread by Spark's JVM hash, so the write stays as parallel).",
            "",
            *rows,
            "",
            f"- Partition step: wall **{step_wall}**, CPU {step_cpu};"
            f" target <= +{TARGET_OVERHEAD:.0%} (wall, medians): {verdict}.",
            f"- Partitioner audit (`source_partition_column`) on top of it: wall **{audit_wall}**, CPU {audit_cpu}.",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000, help="source records (default: 1,000,000)")
    parser.add_argument("--keys", type=int, default=250_000, help="distinct keys (default: 250,000)")
    parser.add_argument("--partitions", type=int, default=12, help="store partitions (default: 12)")
    parser.add_argument("--rounds", type=int, default=11, help="timed rounds per build kind (default: 11)")
    parser.add_argument("--master", default="local[*]", help="Spark master (default: local[*])")
    parser.add_argument(
        "--key-format",
        type=KeyFormat,
        choices=list(KEY_SHAPES),
        default=KeyFormat.STRING,
        help="the keys' format (default: string)",
    )
    parser.add_argument("--seed", type=int, default=20240611)
    parser.add_argument(
        "--settle-load",
        type=float,
        default=float(os.cpu_count() or 1),
        help="before a round, wait for the 1-minute load average to drop to this (default: the CPU count)",
    )
    parser.add_argument("--settle-wait-s", type=float, default=30.0, help="...but at most this long (default: 30)")
    parser.add_argument("--write", action="store_true", help=f"record the figures in {RESULTS.name}")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="keyroute-bench-") as tmp:
        work = Path(tmp)
        source = work / "events"
        start = time.perf_counter()
        generate_events(source, args.events, args.keys, args.partitions, args.key_format, args.seed)
        keys = len(pq.read_table(source, columns=["customer_id"]).column(0).unique())
        took = time.perf_counter() - start
        print(f"generated {args.events:,} events ({keys:,} keys) in {took:.1f}s", file=sys.stderr, flush=True)
        plain = write_spec(work / "plain.toml", source, args, audit=False)
        audited = write_spec(work / "audited.toml", source, args, audit=True)
        variants = [
            Variant("no partition step", plain, pipeline_keys.unhashed_route_column),
            Variant("partition step (murmur2, Arrow UDF)", plain, pipeline_keys.route_column),
            Variant("partition step + audit", audited, pipeline_keys.route_column),
        ]
        with harness.zookeeper(work) as zk:
            spark = create_session(args.master, local_dir=work / "spark")
            try:
                timings, loads = measure(spark, zk, variants, work, keys, args)
            finally:
                spark.stop()
    text = section(timings, loads, args, keys, harness.command(argv))
    print(text)
    if args.write:
        harness.write_section(SECTION, text)  # RESULTS.md is read right here: other benchmarks write their own sections
        print(f"wrote {SECTION!r} to {RESULTS}", file=sys.stderr)
    overhead = Overhead.of(timings[1].wall, timings[0].wall).medians
    if overhead > TARGET_OVERHEAD:
        print(f"above target: the partition step adds {overhead:.1%} to the build", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
