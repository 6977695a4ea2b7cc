"""Taking on a partition: snapshot format 2 (ready-to-serve LMDB files) versus format 1 (JSON lines).

Run from the repository root: `.venv/bin/python benchmarks/load.py [--rows 1000000,10000000] [--rounds 3]
[--write]` (`--quick` for a small smoke run); --write records the figures in the "## Taking on a partition
(benchmarks/load.py)" section of benchmarks/RESULTS.md (other sections are left as they are).

Three measurements, in one run, on data the pipeline builds here from one generated source per size (one
store partition, so the partition a node takes holds every row):

1. Pipeline: the same build with `snapshot_format = 1` and `= 2`, wall-clock and CPU time, and bytes per row
   on disk.
2. Node: from "assigned" (a partition map placing the partition on the node handed to its `Ownership`) to
   "serving" (the partition in the node's view, a read answered), for the format 2 file by hard link and by
   copy, and for format 1 (row by row); next to `cp` (and `cp` + `sync`) of the same data.mdb, with the
   snapshot's pages dropped from the page cache first (cold) or read just before (warm).
3. Rebalance: two real nodes (`python -m keyroute node`) on an embedded ZooKeeper; the owner of the
   partition is stopped (SIGTERM, a graceful leave) and the time from the controller's assignment change
   until the new owner's serving record shows the partition is read from the two znodes' mtimes.

Every file lives in one temporary directory on the repository's filesystem (and /dev/shm for the "other
filesystem" rows), removed at the end; every process started here is stopped, on errors too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import dataclasses
import datetime
import functools
import json
import mmap
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness  # benchmarks/harness.py: ports, ZooKeeper, waiting, RESULTS.md

# Run as a script, this file's folder comes first on sys.path, where benchmarks/pipeline.py's name hides the
# `pipeline` folder keyroute.pipeline is mapped from: the folder goes before anything is imported from there
# (hence E402 off, file-wide).
# ruff: noqa: E402
_HERE = str(Path(__file__).resolve().parent)
while _HERE in sys.path:
    sys.path.remove(_HERE)

import httpx
import lmdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pyspark
from kazoo.client import KazooClient
from pyspark.sql import SparkSession

from keyroute.cluster import placement_records, zk, zk_layout
from keyroute.cluster.partition_map import Assignment, NodeRecord, PartitionMap, ServingRecord, StoreRecord
from keyroute.dev.zookeeper_server import EmbeddedZooKeeper
from keyroute.pipeline import build as build_module
from keyroute.pipeline import lmdb_files
from keyroute.pipeline.build import build
from keyroute.pipeline.session import create_session
from keyroute.replica.store import load_partition
from keyroute.runtime.settings import NodeSettings, ZkSettings
from keyroute.state_node.ownership import Loader, Ownership
from keyroute.storage.lmdb_layout import db_keys
from keyroute.storage.snapshot import (
    FORMAT_1,
    FORMAT_2,
    data_file,
    read_manifest,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SECTION = "## Taking on a partition (benchmarks/load.py)"
PIPELINE_HEADING = "### Pipeline: build time, format 2 vs format 1"
STORE = "bookings"
PARTITION = 0
NODE = "bench-node"
SOURCE_FILES = 8
ROUTES = ["LIS-OPO", "OPO-FAO", "FAO-LIS", "LIS-Ponta Delgada", "OPO-Funchal"]
# Targets of the issue.
TARGET_VS_FORMAT_1 = 50.0  # format 2's rows/s at least this many times format 1's
TARGET_VS_CP = 2.0  # format 2 within this factor of `cp` of the same bytes
TARGET_BUILD_OVERHEAD = 0.10  # format 2's build at most this much slower than format 1's
# From this many rows on, a pipeline build and a format-1 load take minutes: they run --large-rounds times.
LARGE_ROWS = 5_000_000
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
SHM = Path("/dev/shm")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- the page cache ------------------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_fraction(path: Path) -> float:
    """How much of a file is in the page cache (mincore(2) over a read-only mapping of it)."""
    size = path.stat().st_size
    if not size:
        return 0.0
    fd = os.open(path, os.O_RDONLY)
    try:
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            pages = -(-size // mmap.PAGESIZE)
            vector = (ctypes.c_ubyte * pages)()
            if _libc.mincore(address, size, vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            return sum(byte & 1 for byte in bytes(vector)) / pages
        finally:
            _libc.munmap(address, size)
    finally:
        os.close(fd)


@dataclass
class PageCache:
    """Cold runs: everything written is synced, the whole page cache dropped (when this process may write
    /proc/sys/vm/drop_caches) and the snapshot's files evicted with posix_fadvise(DONTNEED) (which needs no
    privilege); warm runs: the snapshot's files are read just before. What was found is kept for the report."""

    drop_caches_works: bool | None = None
    cold_resident: dict[str, list[float]] = field(default_factory=dict)  # by what was measured
    warm_resident: list[float] = field(default_factory=list)

    def cold(self, files: list[Path], context: str = "node") -> None:
        os.sync()
        try:
            DROP_CACHES.write_text("3\n")
            dropped = True
        except OSError:
            dropped = False
        if self.drop_caches_works is None or not dropped:
            self.drop_caches_works = dropped
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        self.cold_resident.setdefault(context, []).append(max(resident_fraction(path) for path in files))

    def warm(self, files: list[Path]) -> None:
        os.sync()
        buffer = bytearray(8 << 20)
        for path in files:
            with open(path, "rb", buffering=0) as fh:
                while fh.readinto(buffer):
                    pass
        self.warm_resident.append(min(resident_fraction(path) for path in files))


# -- plumbing ------------------------------------------------------------------------------------------------


# Process-tree CPU from /proc: the same measure as benchmarks/pipeline.py, taken from there.
process_tree_cpu_s = harness.script("pipeline.py").process_tree_cpu_s


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return usage.ru_utime + usage.ru_stime


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def files_under(folder: Path) -> list[Path]:
    return sorted(path for path in folder.rglob("*") if path.is_file())


def work_root() -> Path:
    """A folder for the temporary directory on the repository's own filesystem: the system's temporary
    directory when it is on the same device (not a tmpfs), else the repository's parent folder."""
    system = Path(tempfile.gettempdir())
    if system.stat().st_dev == ROOT.stat().st_dev:
        return system
    return ROOT.parent if os.access(ROOT.parent, os.W_OK) else ROOT


def filesystem_of(path: Path) -> str:
    """`device (type) on mountpoint` of the filesystem holding `path`, from /proc/mounts."""
    best = ("", "", "")
    resolved = str(path.resolve())
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            device, mountpoint, kind = line.split()[:3]
            inside = resolved == mountpoint or resolved.startswith(mountpoint.rstrip("/") + "/")
            if inside and len(mountpoint) >= len(best[1]):
                best = (device, mountpoint, kind)
    return f"{best[0]} ({best[2]}) on {best[1]}"


# -- 1. the pipeline -----------------------------------------------------------------------------------------


def generate_source(folder: Path, rows: int, seed: int) -> None:
    """`rows` bookings-like events as parquet, one per key (`customer-NNNNNNNN`), in shuffled key order."""
    rng = np.random.default_rng(seed)
    ids = rng.permutation(rows)
    keys = np.char.add("customer-", np.char.zfill(ids.astype("U8"), 8))
    table = pa.table(
        {
            "customer_id": pa.array(keys, pa.string()),
            "ts": rng.integers(1_700_000_000_000, 1_800_000_000_000, size=rows),
            "route": pa.array(np.array(ROUTES)[rng.integers(0, len(ROUTES), size=rows)], pa.string()),
            "fare": np.round(rng.uniform(20.0, 900.0, size=rows), 2),
            "seats": rng.integers(1, 9, size=rows, dtype=np.int32),
        }
    )
    folder.mkdir(parents=True)
    step = -(-rows // SOURCE_FILES)
    for index, first in enumerate(range(0, rows, step)):
        pq.write_table(table.slice(first, step), folder / f"part-{index:03d}.parquet")


def write_spec(path: Path, source: Path, snapshot_format: int, partitions: int = 1) -> Path:
    lines = [
        f"[stores.{STORE}]",
        f'source = "{source.as_posix()}"',
        'format = "parquet"',
        'key = "customer_id"',
        f"partitions = {partitions}",
        'mode = "latest"',
        'order_by = "ts"',
        'columns = ["ts", "route", "fare", "seats"]',
        f"snapshot_format = {snapshot_format}",
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@dataclass
class Built:
    """One size's builds of both formats: timings per round, and the last build of each kept for the nodes."""

    rows: int
    partitions: int = 1
    wall: dict[int, list[float]] = field(default_factory=lambda: {1: [], 2: []})
    write: dict[int, list[float]] = field(default_factory=lambda: {1: [], 2: []})
    spark_cpu: dict[int, list[float]] = field(default_factory=lambda: {1: [], 2: []})
    driver_cpu: dict[int, list[float]] = field(default_factory=lambda: {1: [], 2: []})
    records: dict[int, StoreRecord] = field(default_factory=dict)
    disk_bytes: dict[int, int] = field(default_factory=dict)
    data_bytes: dict[int, int] = field(default_factory=dict)
    files: dict[int, list[Path]] = field(default_factory=dict)


@contextlib.contextmanager
def write_phase_timed(seconds: list[float]) -> Iterator[None]:
    """While open, every `write_version` a build calls (the snapshot's write: the Spark job writing the files,
    and the manifest) appends its wall-clock seconds to `seconds`; the rest of a build is the same for both
    formats (compute, check, claim, publish)."""
    original = build_module.write_version

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    build_module.write_version = timed  # type: ignore[assignment]
    try:
        yield
    finally:
        build_module.write_version = original


def run_build(
    spark: SparkSession, zk_server: EmbeddedZooKeeper, reader: KazooClient, spec: Path, output: Path, rows: int
) -> tuple[float, float, float, float, StoreRecord]:
    """Wall-clock, write-phase, Spark CPU and driver CPU seconds of one whole build() (fresh output, fresh
    chroot), and the store record it published."""
    chroot = f"/build-{uuid.uuid4().hex[:12]}"
    settings = ZkSettings(hosts=zk_server.connect_string, chroot=chroot)
    jvm = spark.sparkContext._gateway.proc.pid  # type: ignore[union-attr]
    os.sync()  # the previous build's or load's writes are not flushed on this one's time
    written: list[float] = []
    spark_start, driver_start, start = process_tree_cpu_s(jvm), own_cpu_s(), time.perf_counter()
    with write_phase_timed(written):
        published = build(spec, settings, str(output), spark=spark)
    wall = time.perf_counter() - start
    spark_cpu, driver_cpu = process_tree_cpu_s(jvm) - spark_start, own_cpu_s() - driver_start
    if [p.rows for p in published] != [rows]:
        raise RuntimeError(f"{spec.name}: published {published}, expected {rows} rows")
    raw, _ = reader.get(chroot + zk_layout.store_path(STORE))
    return wall, sum(written), spark_cpu, driver_cpu, StoreRecord.from_json(raw)


def measure_pipeline(
    spark: SparkSession,
    zk_server: EmbeddedZooKeeper,
    reader: KazooClient,
    work: Path,
    rows: int,
    rounds: int,
    warm_up: bool,
    seed: int,
    partitions: int = 1,
) -> Built:
    source = work / f"source-{rows}-{partitions}"
    start = time.perf_counter()
    generate_source(source, rows, seed)
    log(f"{rows:,} rows: source generated in {time.perf_counter() - start:.1f}s")
    specs = {f: write_spec(work / f"spec-{rows}-{partitions}-f{f}.toml", source, f, partitions) for f in (1, 2)}
    built = Built(rows, partitions)
    if warm_up:  # the JVM's JIT and Spark's caches, once per run
        for f in (1, 2):
            output = work / f"warm-up-f{f}"
            run_build(spark, zk_server, reader, specs[f], output, rows)
            shutil.rmtree(output)
        log("pipeline warm-up done")
    kept: dict[int, Path] = {}
    for round_index in range(rounds):
        order = (1, 2) if round_index % 2 == 0 else (2, 1)
        for f in order:
            output = work / f"out-{rows}-{partitions}-f{f}-r{round_index}"
            wall, write, spark_cpu, driver_cpu, record = run_build(spark, zk_server, reader, specs[f], output, rows)
            built.wall[f].append(wall)
            built.write[f].append(write)
            built.spark_cpu[f].append(spark_cpu)
            built.driver_cpu[f].append(driver_cpu)
            if f in kept:
                shutil.rmtree(kept[f])
            kept[f], built.records[f] = output, record
        shown = ", ".join(f"format {f} {built.wall[f][-1]:.1f}s ({built.spark_cpu[f][-1]:.1f}s CPU)" for f in (1, 2))
        log(f"{rows:,} rows: build round {round_index + 1}/{rounds}: {shown}")
    shutil.rmtree(source)  # the snapshots are what the nodes need now
    for f, record in built.records.items():
        version = Path(record.snapshot)
        manifest = read_manifest(record.snapshot)
        assert manifest.format == (FORMAT_1 if f == 1 else FORMAT_2)
        built.files[f] = [version / name for p in range(partitions) for name in manifest.files[p]]
        built.disk_bytes[f] = sum(path.stat().st_size for path in files_under(version))
        built.data_bytes[f] = sum(path.stat().st_size for path in built.files[f])
    return built


# -- 1b. where format 2's executor time goes -------------------------------------------------------------------


# The value's fields as the write job hands them to a task (the store's value struct, as Spark types it).
VALUE_TYPE = pa.struct(
    [
        pa.field("ts", pa.int64()),
        pa.field("route", pa.string()),
        pa.field("fare", pa.float64()),
        pa.field("seats", pa.int32()),
    ]
)


def executor_breakdown(data_mdb: Path, work: Path, batch_rows: int = 10_000) -> tuple[dict[str, float], float]:
    """The Python work a format-2 task does for one partition (keyroute.pipeline.lmdb_files), step by step,
    in this process on the partition's own rows, fed as Spark feeds it (Arrow batches of `batch_rows`, the
    key text, whose LMDB key the task makes, and the value's struct, whose JSON the task spells): seconds
    per step, and the values' mean size in bytes."""
    keys: list[bytes] = []
    values: list[bytes] = []
    env = lmdb.open(str(data_mdb), subdir=False, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            for key, value in txn.cursor():
                keys.append(bytes(key))
                values.append(bytes(value))
    finally:
        env.close()
    batches = [
        pa.RecordBatch.from_pydict(
            {
                lmdb_files.KEY_TEXT: pa.array([k[1:].decode("utf-8") for k in keys[i : i + batch_rows]], pa.string()),
                lmdb_files.VALUE_STRUCT: pa.array([json.loads(v) for v in values[i : i + batch_rows]], VALUE_TYPE),
            }
        )
        for i in range(0, len(keys), batch_rows)
    ]
    value_bytes = sum(map(len, values)) / max(1, len(values))
    del keys, values
    scratch = work / "breakdown"
    scratch.mkdir()
    out: dict[str, float] = {}
    try:
        start = time.perf_counter()
        keys_lists = [db_keys(b.column(0)).to_numpy(zero_copy_only=False).tolist() for b in batches]
        out["LMDB keys: key texts tagged (one Arrow kernel a batch), to Python lists"] = time.perf_counter() - start
        start = time.perf_counter()
        for b in batches:  # as a task does: each batch's spelling dropped once written (memory reused)
            lmdb_files.spell_values(b)
        out["values: JSON spelled from the struct by Arrow kernels"] = time.perf_counter() - start
        spelled = [lmdb_files.spell_values(b) for b in batches]
        redone = sum(s.redo.true_count for s in spelled) / max(1, sum(b.num_rows for b in batches))
        start = time.perf_counter()
        stored = [s.stored() for s in spelled]
        out[f"values: to Python bytes (one by one for the {redone:.1%} the kernels cannot vouch for)"] = (
            time.perf_counter() - start
        )
        destination = lmdb_files.Destination(str(scratch / "published"))
        builder = destination.builder(data_file(PARTITION), scratch)
        try:
            start = time.perf_counter()
            for k, vs in zip(keys_lists, stored, strict=True):
                builder.add(zip(k, vs, strict=True))
            out["LMDB putmulti(append=True) into the file in place"] = time.perf_counter() - start
            start = time.perf_counter()
            destination.publish(builder, data_file(PARTITION))
            out["commit, checksum read back while fsyncing, rename"] = time.perf_counter() - start
        finally:
            builder.discard()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out, value_bytes


# -- 2. a node takes the partition -------------------------------------------------------------------------------


class _NoZooKeeper:
    """The node's registration, without ZooKeeper: the node measured here announces to nobody."""

    def publish_serving(self, stores: Any) -> None:
        pass

    def register_node(self) -> None:
        pass

    def withdraw(self) -> None:
        pass

    def withdraw_serving(self) -> None:
        pass


async def _assigned_to_serving(
    record: StoreRecord, data_dir: Path, loader: Loader, probe: bytes
) -> tuple[float, float]:
    """Seconds from handing the node's Ownership a map that assigns it the partition until the partition is in
    its view (what reads are answered from), and this process's CPU seconds meanwhile (every thread)."""
    settings = NodeSettings(node_id=NODE, data_dir=data_dir, version_grace_s=0.0)
    ownership = Ownership(settings, _NoZooKeeper(), drop_grace_s=0.0, loader=loader)  # type: ignore[arg-type]
    assigned = PartitionMap.build(
        {record.name: record},
        {NODE: NodeRecord(NODE, "http://127.0.0.1:1")},
        Assignment(1, {record.name: ((NODE,),)}),
        {},
        generation=1,
    )
    try:
        cpu_start, start = own_cpu_s(), time.perf_counter()
        ownership.on_map(assigned)
        while (held := ownership.local(record.name, PARTITION)) is None:
            failed = ownership.readiness().failed
            if failed:
                raise RuntimeError(f"the load failed: {failed}")
            await asyncio.sleep(0.0005)
        took, cpu = time.perf_counter() - start, own_cpu_s() - cpu_start
        if held.get(probe) is None:
            raise RuntimeError(f"{probe!r} is not answered from the loaded partition")
        return took, cpu
    finally:
        await ownership.stop()


def node_load(record: StoreRecord, data_dir: Path, link: bool, probe: bytes) -> tuple[float, float]:
    loader: Loader = load_partition if link else functools.partial(load_partition, link=False)  # type: ignore[assignment]
    return asyncio.run(_assigned_to_serving(record, data_dir, loader, probe))


def cp(source: Path, data_dir: Path, sync: bool) -> tuple[float, float]:
    """`cp` of the data file to where the node keeps it (and `sync FILE`, an fsync of it): seconds and the
    child processes' CPU seconds."""
    target = data_dir / "stores" / STORE / "v1" / f"p{PARTITION}"
    target.mkdir(parents=True)
    cpu_start, start = children_cpu_s(), time.perf_counter()
    subprocess.run(["cp", str(source), str(target / "data.mdb")], check=True)
    if sync:
        subprocess.run(["sync", str(target / "data.mdb")], check=True)
    return time.perf_counter() - start, children_cpu_s() - cpu_start


def on_shm(record: StoreRecord) -> StoreRecord | None:
    """The format-2 version copied to /dev/shm (a tmpfs: another filesystem than the nodes' disk), if there is
    room: its record, pointing there. Remove it with `remove_shm`."""
    mdb = Path(record.snapshot) / data_file(PARTITION)
    if not SHM.is_dir():
        return None
    room = os.statvfs(SHM)
    if room.f_bavail * room.f_frsize < 2 * mdb.stat().st_size + (256 << 20):
        return None
    version = Path(tempfile.mkdtemp(prefix="keyroute-load-bench-", dir=SHM)) / Path(record.snapshot).name
    (version / f"partition={PARTITION}").mkdir(parents=True)
    shutil.copyfile(mdb, version / data_file(PARTITION))
    shutil.copyfile(Path(record.snapshot) / "manifest.json", version / "manifest.json")
    return dataclasses.replace(record, snapshot=str(version))


def remove_shm(record: StoreRecord | None) -> None:
    if record is not None:
        shutil.rmtree(Path(record.snapshot).parent, ignore_errors=True)


@dataclass(frozen=True)
class Way:
    """One way of taking the partition: a label, the cache state, the bytes it moves, and how."""

    name: str
    cache: str  # "cold", "warm" or "RAM (tmpfs)"
    format: int  # the snapshot format whose bytes it takes (for rows/s and MB/s)
    files: tuple[Path, ...]  # what the page cache is prepared for
    run: Callable[[Path], tuple[float, float]]  # data_dir -> (seconds, CPU seconds)
    reference: bool = False  # `cp`, not the node


@dataclass
class Loads:
    rows: int
    ways: list[Way]
    seconds: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)


def key_of(way: Way) -> str:
    return f"{way.name}|{way.cache}"


def measure_node(
    built: Built, work: Path, rounds: int, format_1_rounds: int, warm_format_1: bool, cache: PageCache
) -> Loads:
    rows = built.rows
    probe = b"customer-00000000"
    f1, f2 = built.records[1], built.records[2]
    mdb = built.files[2][0]
    json_files = tuple(built.files[1])
    shm_record = on_shm(f2)
    shm_mdb = None if shm_record is None else Path(shm_record.snapshot) / data_file(PARTITION)
    ways: list[Way] = []
    for temperature in ("cold", "warm"):
        ways += [
            Way("`cp` data.mdb", temperature, 2, (mdb,), functools.partial(cp, mdb, sync=False), True),
            Way("`cp` + `sync` data.mdb", temperature, 2, (mdb,), functools.partial(cp, mdb, sync=True), True),
            Way(
                "format 2, hard link (+ checksum read)",
                temperature,
                2,
                (mdb,),
                lambda d: node_load(f2, d, True, probe),
            ),
            Way(
                "format 2, copy (`link=False`, checksummed, fsynced)",
                temperature,
                2,
                (mdb,),
                lambda d: node_load(f2, d, False, probe),
            ),
        ]
        if temperature == "cold" or warm_format_1:
            ways.append(
                Way(
                    "format 1, JSON lines row by row",
                    temperature,
                    1,
                    json_files,
                    lambda d: node_load(f1, d, True, probe),
                )
            )
    if shm_record is not None and shm_mdb is not None:
        record = shm_record
        ways += [
            Way(
                "`cp` + `sync` from /dev/shm",
                "RAM (tmpfs)",
                2,
                (shm_mdb,),
                functools.partial(cp, shm_mdb, sync=True),
                True,
            ),
            Way(
                "format 2 from /dev/shm (other filesystem: copied)",
                "RAM (tmpfs)",
                2,
                (shm_mdb,),
                lambda d: node_load(record, d, True, probe),
            ),
        ]
    loads = Loads(rows, ways)

    def once(way: Way) -> tuple[float, float]:
        data_dir = work / f"node-{uuid.uuid4().hex[:8]}"
        data_dir.mkdir()
        try:
            if way.cache == "cold":
                cache.cold(list(way.files))
            elif way.cache == "warm":
                cache.warm(list(way.files))
            else:
                os.sync()
            return way.run(data_dir)
        finally:
            shutil.rmtree(data_dir, ignore_errors=True)

    try:
        for way in ways:  # untimed: the first run of each way pays one-off costs (imports, first-touch memory)
            if way.format == 2:
                once(way)
        for round_index in range(rounds):
            shift = round_index % len(ways)
            for way in ways[shift:] + ways[:shift]:
                if way.format == 1 and round_index >= format_1_rounds:
                    continue
                seconds, cpu = once(way)
                loads.seconds.setdefault(key_of(way), []).append(seconds)
                loads.cpu.setdefault(key_of(way), []).append(cpu)
            log(f"{rows:,} rows: node round {round_index + 1}/{rounds} done")
    finally:
        remove_shm(shm_record)
    return loads


# -- 3. a partition moves during a rebalance ------------------------------------------------------------------


Proc = harness.Proc  # `python -m keyroute ...` of this tree, its output in a log file


@dataclass
class Cluster:
    """Node processes on one chroot of the embedded ZooKeeper."""

    work: Path
    settings: ZkSettings
    session_timeout_s: float
    client: KazooClient = field(init=False)
    nodes: dict[str, tuple[Proc, str]] = field(default_factory=dict)
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=10.0, trust_env=False))

    def __post_init__(self) -> None:
        self.client = zk.connect(self.settings)

    def data_dir(self, node_id: str) -> Path:
        return self.work / f"data-{node_id}"

    def start_node(self, node_id: str) -> None:
        port = harness.free_port()
        args = ["node", "--zk", self.settings.connect_string, "--node-id", node_id, "--port", str(port)]
        args += ["--data-dir", str(self.data_dir(node_id)), "--zk-session-timeout-s", str(self.session_timeout_s)]
        args += ["--version-grace-s", "0"]
        self.nodes[node_id] = (Proc(args, self.work / f"{node_id}.log"), f"http://127.0.0.1:{port}")
        harness.wait(lambda: self.registered(node_id), 60, f"{node_id} registered")
        harness.wait(lambda: self.answers(node_id), 60, f"{node_id} answering HTTP")

    def answers(self, node_id: str) -> bool:
        try:
            return self.http.get(self.nodes[node_id][1] + "/healthz").status_code == 200
        except httpx.HTTPError:
            return False

    def registered(self, node_id: str) -> bool:
        raw, _ = self.client.get(zk_layout.node_path(node_id))
        return not NodeRecord.from_json(raw).leaving

    def serving(self, node_id: str, version: int) -> bool:
        raw, _ = self.client.get(zk_layout.serving_path(node_id))
        return ServingRecord.from_json(raw).stores.get(STORE, {}).get(PARTITION) == version

    def owner(self) -> str:
        current = placement_records.read(self.client)[0]
        assert current is not None, "no assignment yet"
        return current.replicas(STORE, PARTITION)[0]

    def loaded_seconds(self, node_id: str) -> float:
        """The node's total time spent in loads that ended loaded (its /metrics histogram's sum)."""
        text = self.http.get(self.nodes[node_id][1] + "/metrics").text
        for line in text.splitlines():
            if line.startswith('keyroute_node_partition_load_seconds_sum{outcome="loaded"}'):
                return float(line.split()[-1])
        return 0.0

    def close(self) -> None:
        for proc, _ in self.nodes.values():
            proc.terminate()
        for proc, _ in self.nodes.values():
            proc.stop()
        self.http.close()
        zk.close(self.client)


@dataclass
class Move:
    stop_to_assignment_s: float
    assignment_to_serving_s: float
    load_s: float


def _one_move(cluster: Cluster, owner: str, other: str, version: int) -> Move:
    """Stop `owner` (SIGTERM) and time the partition's move to `other` from the znodes' mtimes."""
    loaded_before = cluster.loaded_seconds(other)
    seen: dict[str, float] = {}
    done = threading.Event()

    def on_assignment(data: bytes | None, stat: Any) -> bool | None:
        # The store's own record (written before the root that names it, moments apart).
        if data and placement_records.parse_placement_record(data)[1][PARTITION] == (other,):
            seen.setdefault("assignment", stat.mtime / 1000)
            return False
        return None

    def on_serving(data: bytes | None, stat: Any) -> bool | None:
        if data and ServingRecord.from_json(data).stores.get(STORE, {}).get(PARTITION) == version:
            seen.setdefault("serving", stat.mtime / 1000)
            done.set()
            return False
        return None

    cluster.client.DataWatch(zk_layout.placement_path(STORE), on_assignment)
    cluster.client.DataWatch(zk_layout.serving_path(other), on_serving)
    stopped = time.time()
    cluster.nodes[owner][0].terminate()
    if not done.wait(600):
        raise RuntimeError(f"{other} did not serve the partition after {owner} left")
    harness.wait(lambda: "assignment" in seen, 10, "the assignment's mtime")
    load_s = cluster.loaded_seconds(other) - loaded_before
    return Move(seen["assignment"] - stopped, seen["serving"] - seen["assignment"], load_s)


def measure_rebalance(
    work: Path,
    zk_server: EmbeddedZooKeeper,
    label: str,
    record: StoreRecord,
    cold_files: list[Path] | None,
    rounds: int,
    cache: PageCache,
) -> list[Move]:
    """Two nodes; the partition's owner leaves (SIGTERM) `rounds` times, each time restarted afterwards with
    an empty data directory, so every move is a real fetch by the other node. `cold_files`: the snapshot's
    files, evicted from the page cache before each move (None: the snapshot is in RAM anyway)."""
    settings = ZkSettings(hosts=zk_server.connect_string, chroot=f"/rebalance-{label}", session_timeout_s=4.0)
    folder = work / f"rebalance-{label}"
    folder.mkdir()
    cluster = Cluster(folder, settings, 4.0)
    moves: list[Move] = []
    try:
        for node_id in ("n1", "n2"):
            cluster.start_node(node_id)
        cluster.client.create(zk_layout.store_path(STORE), record.to_json(), makepath=True)
        harness.wait(lambda: any(cluster.serving(n, record.version) for n in ("n1", "n2")), 600, "the first load", 0.05)
        for round_index in range(rounds):
            owner = cluster.owner()
            harness.wait(lambda o=owner: cluster.serving(o, record.version), 600, f"{owner} serving", 0.05)  # type: ignore[misc]
            other = "n2" if owner == "n1" else "n1"
            if cold_files is None:
                os.sync()
            else:
                cache.cold(cold_files, f"rebalance-{label}")
            moves.append(_one_move(cluster, owner, other, record.version))
            log(
                f"rebalance {label} round {round_index + 1}/{rounds}: {owner} -> {other}:"
                f" assignment {moves[-1].stop_to_assignment_s:.2f}s after the stop,"
                f" served {moves[-1].assignment_to_serving_s:.2f}s after it (load {moves[-1].load_s:.2f}s)"
            )
            cluster.nodes[owner][0].stop(120)
            shutil.rmtree(cluster.data_dir(owner), ignore_errors=True)
            if round_index + 1 < rounds:
                cluster.start_node(owner)
    finally:
        cluster.close()
    return moves


# -- report ------------------------------------------------------------------------------------------------------


def median(values: list[float]) -> float:
    return statistics.median(values)


def _listed(values: list[float], digits: int = 2) -> str:
    return ", ".join(f"{value:.{digits}f}" for value in values)


def _ratio(value: float) -> str:
    return f"{value:.2f}x" if value < 10 else f"{value:,.0f}x"


def node_table(all_loads: list[Loads], builds: dict[int, Built]) -> tuple[list[str], list[str]]:
    """The node table, and the findings against the targets."""
    lines = [
        "| rows | how | page cache | s, median | rows/s | MB/s | CPU s | vs `cp` | vs `cp` + `sync`"
        " | rows/s vs format 1 | s, rounds |",
        "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    findings: list[str] = []
    for loads in all_loads:
        built = builds[loads.rows]
        med = {key: median(values) for key, values in loads.seconds.items()}
        f1_cold = med["format 1, JSON lines row by row|cold"]
        for way in loads.ways:
            key = key_of(way)
            if key not in med:
                continue
            seconds = med[key]
            moved = built.data_bytes[way.format]
            cp_key = f"`cp` data.mdb|{way.cache}"
            sync_key = f"`cp` + `sync` data.mdb|{way.cache}"
            if way.cache == "RAM (tmpfs)":
                cp_key = sync_key = "`cp` + `sync` from /dev/shm|RAM (tmpfs)"
            vs_cp = _ratio(seconds / med[cp_key]) if cp_key in med and way.format == 2 else "—"
            vs_sync = _ratio(seconds / med[sync_key]) if sync_key in med and way.format == 2 else "—"
            f1_here = med.get(f"format 1, JSON lines row by row|{way.cache}", f1_cold)
            vs_f1 = "—" if way.reference else _ratio(f1_here / seconds)
            lines.append(
                f"| {loads.rows:,} | {way.name} | {way.cache} | {seconds:.3f} | {loads.rows / seconds:,.0f}"
                f" | {moved / seconds / 1e6:,.0f} | {median(loads.cpu[key]):.2f} | {vs_cp} | {vs_sync} | {vs_f1}"
                f" | {_listed(loads.seconds[key], 3)} |"
            )
        for cache_state in ("cold", "warm"):
            link = med.get(f"format 2, hard link (+ checksum read)|{cache_state}")
            copy = med.get(f"format 2, copy (`link=False`, checksummed, fsynced)|{cache_state}")
            plain = med.get(f"`cp` data.mdb|{cache_state}")
            synced = med.get(f"`cp` + `sync` data.mdb|{cache_state}")
            f1 = med.get(f"format 1, JSON lines row by row|{cache_state}")
            if None in (link, copy, plain, synced):
                continue
            assert link and copy and plain and synced
            f1_here = f1 if f1 is not None else med["format 1, JSON lines row by row|cold"]
            against = "" if f1 is not None else " (format 1 cold)"
            fast = min(f1_here / link, f1_here / copy)
            findings.append(
                f"{loads.rows:,} rows, {cache_state}: hard link {f1_here / link:,.0f}x and copy {f1_here / copy:,.0f}x"
                f" format 1's rows/s{against} (target >= {TARGET_VS_FORMAT_1:.0f}x:"
                f" {'met' if fast >= TARGET_VS_FORMAT_1 else 'MISSED'}); hard link {link / plain:.2f}x `cp`,"
                f" copy {copy / synced:.2f}x `cp` + `sync` ({copy / plain:.2f}x plain `cp`)"
                f" (target <= {TARGET_VS_CP:.0f}x: "
                f"{'met' if max(link / plain, copy / synced) <= TARGET_VS_CP else 'MISSED'})."
            )
        shm_copy = med.get("format 2 from /dev/shm (other filesystem: copied)|RAM (tmpfs)")
        shm_cp = med.get("`cp` + `sync` from /dev/shm|RAM (tmpfs)")
        if shm_copy and shm_cp:
            findings.append(
                f"{loads.rows:,} rows, from /dev/shm: the node's copy {f1_cold / shm_copy:,.0f}x format 1's rows/s"
                f" (cold), {shm_copy / shm_cp:.2f}x `cp` + `sync` of the same file."
            )
    return lines, findings


def pipeline_table(builds: dict[int, Built], spread: Built | None = None) -> tuple[list[str], list[str]]:
    lines = [
        "| rows | format | wall s, median | of which writing, median | Spark CPU s, median | driver CPU s, median"
        " | on disk | bytes/row (data files / all files) | wall s, rounds | Spark CPU s, rounds |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |",
    ]
    findings = []
    for built in [*(b for _, b in sorted(builds.items())), *([spread] if spread is not None else [])]:
        rows = built.rows
        where = f" in {built.partitions} partitions" if built.partitions > 1 else ""
        shown = f"{rows:,}{where}"
        for f in (1, 2):
            kind = "1 (JSON lines)" if f == 1 else "2 (LMDB data.mdb)"
            lines.append(
                f"| {shown} | {kind} | {median(built.wall[f]):.1f} | {median(built.write[f]):.1f}"
                f" | {median(built.spark_cpu[f]):.1f} | {median(built.driver_cpu[f]):.2f}"
                f" | {built.disk_bytes[f] / 1e6:,.1f} MB"
                f" | {built.data_bytes[f] / rows:.1f} / {built.disk_bytes[f] / rows:.1f}"
                f" | {_listed(built.wall[f], 1)} | {_listed(built.spark_cpu[f], 1)} |"
            )
        wall = median(built.wall[2]) / median(built.wall[1]) - 1
        pairs = median([b / a for a, b in zip(built.wall[1], built.wall[2], strict=True)]) - 1
        cpu = median(built.spark_cpu[2]) / median(built.spark_cpu[1]) - 1
        extra_s = median(built.wall[2]) - median(built.wall[1])
        write_extra = median(built.write[2]) - median(built.write[1])
        verdict = "met" if wall <= TARGET_BUILD_OVERHEAD else "MISSED"
        findings.append(
            f"{rows:,} rows{where} ({_rounds(len(built.wall[1]))}): format 2's build wall **{wall:+.1%}** (round pairs"
            f" {pairs:+.1%}; {extra_s:+.1f} s, {extra_s / rows * 1e6:+.1f} µs/row, of which the write phase"
            f" {write_extra:+.1f} s), Spark CPU {cpu:+.1%}; target <= +{TARGET_BUILD_OVERHEAD:.0%} (wall, medians):"
            f" {verdict}."
        )
    return lines, findings


def _rounds(count: int) -> str:
    return f"{count} round{'' if count == 1 else 's'}"


def pipeline_section(
    args: argparse.Namespace,
    builds: dict[int, Built],
    breakdown: dict[str, float],
    spread: Built | None = None,
    run_note: str = "",
) -> list[str]:
    """The section's "### Pipeline" part (`run_note`: which run it is from, when not the section's own)."""
    large = [rows for rows in sorted(builds) if rows >= LARGE_ROWS]
    small = [rows for rows in sorted(builds) if rows < LARGE_ROWS]
    build_rounds = f"{_rounds(args.rounds)} at {', '.join(f'{r:,}' for r in small)} rows" if small else ""
    if large:
        build_rounds += (", " if build_rounds else "") + (
            f"{_rounds(args.large_rounds)} at {', '.join(f'{r:,}' for r in large)} rows (a build takes minutes there;"
            " fewer rounds keep the run near 20 minutes)"
        )
    pipe_lines, pipe_findings = pipeline_table(builds, spread)
    smallest = builds[min(builds)]
    extra = median(smallest.wall[2]) - median(smallest.wall[1])
    write_extra = median(smallest.write[2]) - median(smallest.write[1])
    python_work = sum(breakdown.values())
    steps = "; ".join(f"{name} {seconds:.2f} s" for name, seconds in breakdown.items())
    return [
        PIPELINE_HEADING,
        "",
        *([run_note, ""] if run_note else []),
        "Whole `build()` calls (compute, write, manifest, publish to a fresh ZooKeeper chroot) into a fresh output"
        " on the same disk, one SparkSession, one untimed warm-up build of each format first, then"
        f" {build_rounds}, formats alternating. Writing = `write_version` (the Spark job writing the partition's"
        " files, and the manifest); the rest of a build is the same code for both formats. Spark CPU = the JVM's"
        " process tree (in local mode the driver and the executors are its threads, the Python workers its"
        " children); driver CPU = this Python process. With ONE store partition the write stage is one task:"
        " format 2's per-row work there runs on one core while the other idles, the worst case for wall-clock"
        " time; with several partitions it spreads over the executors like the rest of the build (CPU time"
        " does not depend on that)."
        + (
            f" The row 'in {spread.partitions} partitions' is the same source built into a store of"
            f" {spread.partitions} partitions ({_rounds(len(spread.wall[1]))}, in the same session, after the others)."
            if spread is not None
            else ""
        ),
        "",
        *pipe_lines,
        "",
        *(f"- {line}" for line in pipe_findings),
        f"- Where format 2's time goes ({min(builds):,} rows: {extra:+.1f} s of build, {write_extra:+.1f} s of"
        " it in the write phase): the Python work of the task that builds the file (keyroute.pipeline.lmdb_files),"
        " repeated step by step in this process on the same rows, fed as Spark feeds it (Arrow batches of"
        f" 10,000 rows): {steps}; **{python_work:.2f} s** of CPU in all, in the task's own thread. The rest of the"
        " write phase is Spark's side: sorting by the key text (a string store none of whose keys is too long"
        " for LMDB, as this one: the task tags the text into its LMDB key; other stores sort by the binary LMDB"
        " key), the value handed over as its struct of four fields (the task spells its JSON; a value of other"
        " types would be Spark's `to_json` text), and the Arrow"
        " hand-over of every row to the Python worker, in batches of as many rows as fit Spark's byte limit at the"
        " store's widest row (bounded from the widest row's strings, counted while the compute phase checks the"
        " keys), so that"
        " Spark does not size each batch after every row; format 1 spends its write phase in Spark's JSON writer"
        " instead. With ONE store partition all of it is one task: the same per-row work spreads over the"
        " executors when a store has several partitions.",
        "",
    ]


def section(
    args: argparse.Namespace,
    command: str,
    builds: dict[int, Built],
    all_loads: list[Loads],
    breakdown: dict[str, float],
    value_bytes: float,
    moves: dict[str, list[Move]],
    cache: PageCache,
    work_fs: str,
    load_average: tuple[float, float],
    spread: Built | None = None,
) -> str:
    versions = (
        f"Python {platform.python_version()}, PySpark {pyspark.__version__}, pyarrow {pa.__version__},"
        f" py-lmdb {lmdb.__version__} (LMDB {'.'.join(map(str, lmdb.version()))})"
    )
    sizes = " and ".join(f"{rows:,}" for rows in sorted(builds))
    large = [rows for rows in sorted(builds) if rows >= LARGE_ROWS]
    if cache.drop_caches_works:
        dropped = "`echo 3 > /proc/sys/vm/drop_caches` (it worked: this run is root)"
    else:
        dropped = "no global drop (`/proc/sys/vm/drop_caches` refused the write)"
    node_cold = max(cache.cold_resident.get("node", [0.0]))
    rebalance_cold = cache.cold_resident.get("rebalance-f2-link", [])
    warm_min = min(cache.warm_resident, default=1.0)
    node_lines, node_findings = node_table(all_loads, builds)
    rebalance_rows = args.rebalance_rows
    move_lines = [
        "| snapshot, how the new owner takes it | rows | stop -> assignment changed, median"
        " | **assignment -> new owner's serving record**, median | of which the load (node's own histogram), median"
        " | assignment -> serving, rounds |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for label, runs in moves.items():
        move_lines.append(
            f"| {REBALANCE_LABELS[label]} | {rebalance_rows:,} | {median([m.stop_to_assignment_s for m in runs]):.2f} s"
            f" | **{median([m.assignment_to_serving_s for m in runs]):.2f} s**"
            f" | {median([m.load_s for m in runs]):.2f} s | {_listed([m.assignment_to_serving_s for m in runs])} |"
        )
    move_notes = []
    if "f1" in moves:
        f1 = median([m.assignment_to_serving_s for m in moves["f1"]])
        for label in ("f2-link", "f2-shm"):
            if label in moves:
                f2 = median([m.assignment_to_serving_s for m in moves[label]])
                move_notes.append(f"{REBALANCE_WHERE[label]} {f1 / f2:.0f}x as fast ({f2:.2f} s vs {f1:.2f} s)")
    vm_note = ""
    if work_fs.startswith("/dev/vd"):
        vm_note = (
            " The disk is a virtio block device of a virtual machine: cold means not in this machine's page cache;"
            " the host may still hold the bytes, and new page-cache pages may cost the guest a first touch of"
            " its memory (the first run of each way is untimed for that reason; the spread across rounds shows"
            " what is left)."
        )
    lines = [
        SECTION,
        "",
        f"`{command}` on {datetime.date.today().isoformat()}; every figure below is from this one run. Data: per size"
        f" ({sizes} rows) one generated parquet source of bookings-like events, one per string key"
        " `customer-NNNNNNNN` in shuffled order, values `{ts, route, fare, seats}`"
        f" ({value_bytes:.0f} bytes of compact JSON on average), built by `keyroute.pipeline.build` into a store"
        " of ONE partition (so the partition a node takes holds every row), with `snapshot_format = 1` and"
        " with `= 2`. Node and rebalance runs take the last build of each.",
        f"Machine: {os.cpu_count()} CPUs, {platform.machine()}, {platform.release()}, {versions}; Spark"
        f" {args.master} with driver memory {args.driver_memory} (at 10,000,000 rows the default 1 GB heap runs out"
        " of memory while computing the store, whatever the format); 1-minute load average"
        f" {load_average[0]:.1f} at the start, {load_average[1]:.1f} at the end (other work shares the machine:"
        f" wall-clock figures are noisy). Files on {work_fs}.",
        f"Page cache: before every **cold** run, `sync`, {dropped}, and `posix_fadvise(DONTNEED)` on the"
        f" snapshot's files; mincore(2) then found at most {node_cold:.1%} of them resident at the start of a"
        f" node run. **Warm** runs read the snapshot's files just before (at least {warm_min:.0%} resident)."
        f"{vm_note}",
        "",
        "### Node: assigned -> serving",
        "",
        "From handing the node's `Ownership` (keyroute.state_node.ownership, as in a node; no ZooKeeper, the map is"
        " built here) a partition map that assigns it the partition, to the partition being in its view (what"
        " reads are answered from; one read is then checked): the load in the node's load thread (format 2:"
        " hard link, then one checksum read (crc32); or a copy by the kernel (copy_file_range on one filesystem,"
        " sendfile between two), each chunk checksummed as read back from the page cache, fsynced; then size,"
        " open read-only, entry count,"
        " 64 sampled keys against the partitioner, `loaded.json` fsynced; format 1: parse, hash and put every row"
        " in one LMDB write transaction, synced) and the hand-over to the event loop. `cp` rows: `cp data.mdb"
        " <node's partition dir>` (and `sync <file>`, an fsync, since the node's copy fsyncs) of the same bytes."
        " MB/s: the partition's own files (format 2: data.mdb; format 1: its JSON lines) / s, MB = 10^6 bytes."
        " CPU s: this process (every thread), or `cp`'s and `sync`'s. Ratios: time vs `cp` in the same cache"
        " state; rows/s vs format 1 in the same cache state (cold where format 1 ran cold only)."
        f" {_rounds(args.node_rounds)} for format 2 and `cp` (after one untimed run of each), format 1"
        f" {_rounds(args.rounds)}"
        + (
            f" ({_rounds(args.large_rounds)} at {', '.join(f'{r:,}' for r in large)} rows: about 2 minutes each)"
            if large
            else ""
        )
        + "; ways in a rotated order per round.",
        "",
        *node_lines,
        "",
        *(f"- {line}" for line in node_findings),
        "",
        *pipeline_section(args, builds, breakdown, spread),
        "### Rebalance: a partition moving to another node",
        "",
        "Embedded ZooKeeper, two nodes (`python -m keyroute node`, session timeout 4 s, version grace 0 s) on a"
        " fresh chroot per row; the store record the pipeline published (one partition of"
        f" {rebalance_rows:,} rows) is written there and one node loads it. Per round its owner is stopped with"
        " SIGTERM (a graceful leave: it keeps serving until another node does); the controller writes an"
        " assignment placing the partition on the other node, which fetches and serves it. **Assignment ->"
        " serving** = the new owner's `/serving` znode mtime (the write that shows the partition) minus the"
        " `/assignment` znode mtime (the write that moved it), both stamped by ZooKeeper. The stopped node"
        " comes back with an empty data directory before the next round, so every move is a full fetch."
        f" {_rounds(args.rebalance_rounds)} per row. The snapshot on the nodes' disk is hard-linked: the leaving"
        " owner serves the same inode through its LMDB map, so pages it touched stay resident however the"
        " cache is dropped (mincore: "
        + _share_range(rebalance_cold)
        + " resident at the stop); the /dev/shm row is the fetch of a node whose snapshot is on another"
        " filesystem (a kernel copy with sendfile, checksummed as read back, fsynced, from RAM).",
        "",
        *move_lines,
        "",
        "Between the load and assignment -> serving: the new owner's map watch (it re-reads the records), the"
        " hand-over to its event loop, and the serving record's write."
        + (" Format 2's move against format 1's: " + "; ".join(move_notes) + "." if move_notes else ""),
        "",
    ]
    return "\n".join(lines)


REBALANCE_WHERE = {"f2-link": "hard-linked on the same disk", "f2-shm": "copied from /dev/shm"}
REBALANCE_LABELS = {
    "f2-link": "format 2, same disk (hard link)",
    "f2-shm": "format 2 on /dev/shm (copied)",
    "f1": "format 1 (row by row)",
}


def _sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(part.replace("_", "")) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated row counts, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError("row counts must be positive")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=_sizes, default=[1_000_000, 10_000_000], help="partition sizes")
    parser.add_argument(
        "--rounds", type=int, default=3, help="timed pipeline builds and format-1 loads per size (default: 3)"
    )
    parser.add_argument(
        "--large-rounds",
        type=int,
        default=1,
        help=f"the same from {LARGE_ROWS:,} rows on, where each takes minutes (default: 1)",
    )
    parser.add_argument(
        "--node-rounds", type=int, default=5, help="timed format-2 loads and `cp`s per way and size (default: 5)"
    )
    parser.add_argument(
        "--spread-partitions",
        type=int,
        default=8,
        help="also build the smallest size into a store of this many partitions, both formats (0: skip)",
    )
    parser.add_argument("--rebalance-rows", type=int, help="the size the rebalance moves (default: the smallest)")
    parser.add_argument("--rebalance-rounds", type=int, help="moves timed per row (default: --rounds)")
    parser.add_argument("--master", default="local[*]", help="Spark master (default: local[*])")
    parser.add_argument("--driver-memory", default="6g", help="Spark driver (local mode: all) memory (default: 6g)")
    parser.add_argument("--seed", type=int, default=20261123)
    parser.add_argument(
        "--pipeline-only",
        action="store_true",
        help="only the pipeline builds (and the executor breakdown); --write then replaces only the"
        f" '{PIPELINE_HEADING[4:]}' part of the section",
    )
    parser.add_argument("--quick", action="store_true", help="a small smoke run (not for --write)")
    parser.add_argument("--write", action="store_true", help=f"record the figures in {RESULTS.name}")
    args = parser.parse_args(argv)
    if args.quick:
        if args.write:
            parser.error("--quick figures are a smoke test: not written to RESULTS.md")
        args.rows, args.rounds, args.large_rounds, args.node_rounds = [20_000, 60_000], 1, 1, 2
    args.rebalance_rows = args.rebalance_rows or min(args.rows)
    args.rebalance_rounds = args.rebalance_rounds or args.rounds
    if args.rebalance_rows not in args.rows:
        parser.error("--rebalance-rows must be one of --rows")
    # Before the JVM starts: the only way to size the local-mode heap.
    os.environ.setdefault("PYSPARK_SUBMIT_ARGS", f"--driver-memory {args.driver_memory} pyspark-shell")

    load_before = os.getloadavg()[0]
    cache = PageCache()
    work = Path(tempfile.mkdtemp(prefix="keyroute-load-bench-", dir=work_root()))
    work_fs = filesystem_of(work)
    log(f"working in {work} ({work_fs})")
    builds: dict[int, Built] = {}
    spread: Built | None = None
    all_loads: list[Loads] = []
    moves: dict[str, list[Move]] = {}
    breakdown: dict[str, float] = {}
    value_bytes = 0.0
    try:
        with harness.zookeeper(work) as zk_server:
            reader = zk.connect(ZkSettings(hosts=zk_server.connect_string), ensure_layout=False)
            try:
                spark = create_session(args.master, local_dir=work / "spark")
                try:
                    for index, rows in enumerate(args.rows):
                        rounds = args.rounds if rows < LARGE_ROWS else args.large_rounds
                        builds[rows] = measure_pipeline(
                            spark, zk_server, reader, work, rows, rounds, index == 0, args.seed + index
                        )
                    if args.spread_partitions > 1:
                        smallest = min(args.rows)
                        spread = measure_pipeline(
                            spark, zk_server, reader, work, smallest, args.rounds, False, args.seed,
                            partitions=args.spread_partitions,
                        )  # fmt: skip
                        for f in (1, 2):  # only the figures are needed
                            shutil.rmtree(Path(spread.records[f].snapshot).parent, ignore_errors=True)
                finally:
                    spark.stop()
                breakdown, value_bytes = executor_breakdown(builds[min(args.rows)].files[2][0], work)
                log(f"executor breakdown: {json.dumps(breakdown)}")
                if args.pipeline_only:
                    return _pipeline_only(args, argv, builds, breakdown, spread, load_before)
                for rows in args.rows:
                    large = rows >= LARGE_ROWS
                    format_1_rounds = args.large_rounds if large else args.rounds
                    all_loads.append(
                        measure_node(builds[rows], work, args.node_rounds, format_1_rounds, not large, cache)
                    )
                moved = builds[args.rebalance_rows]
                shm = on_shm(moved.records[2])
                try:
                    plan: list[tuple[str, StoreRecord, list[Path] | None]] = [
                        ("f2-link", moved.records[2], moved.files[2])
                    ]
                    if shm is not None:
                        plan.append(("f2-shm", shm, None))
                    plan.append(("f1", moved.records[1], moved.files[1]))
                    for label, record, cold_files in plan:
                        moves[label] = measure_rebalance(
                            work, zk_server, label, record, cold_files, args.rebalance_rounds, cache
                        )
                finally:
                    remove_shm(shm)
            finally:
                zk.close(reader)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = section(
        args,
        harness.command(argv),
        builds,
        all_loads,
        breakdown,
        value_bytes,
        moves,
        cache,
        work_fs,
        (load_before, os.getloadavg()[0]),
        spread,
    )
    print(text)
    if args.write:
        harness.write_section(SECTION, text)  # RESULTS.md is read right here: other benchmarks write their own sections
        log(f"wrote {SECTION!r} to {RESULTS}")
    return 0


def _pipeline_only(
    args: argparse.Namespace,
    argv: list[str] | None,
    builds: dict[int, Built],
    breakdown: dict[str, float],
    spread: Built | None,
    load_before: float,
) -> int:
    """Print (and with --write, put in place of the section's pipeline part) the figures of a builds-only run."""
    versions = (
        f"Python {platform.python_version()}, PySpark {pyspark.__version__}, pyarrow {pa.__version__},"
        f" py-lmdb {lmdb.__version__} (LMDB {'.'.join(map(str, lmdb.version()))})"
    )
    note = (
        f"`{harness.command(argv)}` on {datetime.date.today().isoformat()}: this part only, from a run of the builds"
        " alone"
        " (the data and the rest of the section as above). Machine: the same"
        f" ({os.cpu_count()} CPUs, {versions}; Spark {args.master}, driver memory {args.driver_memory}); 1-minute"
        f" load average {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end."
    )
    text = "\n".join(pipeline_section(args, builds, breakdown, spread, run_note=note))
    print(text)
    if args.write:
        write_pipeline_section(text)
        log(f"wrote {PIPELINE_HEADING!r} of {SECTION!r} to {RESULTS}")
    return 0


def write_pipeline_section(text: str) -> None:
    """Replace the pipeline part of this script's section of RESULTS.md, leaving everything else as it is."""
    current = RESULTS.read_text(encoding="utf-8")
    section = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL).search(current)
    if section is None:
        raise SystemExit(f"{RESULTS.name} has no {SECTION!r} yet: run without --pipeline-only first")
    part = re.compile(rf"^{re.escape(PIPELINE_HEADING)}\n.*?(?=^### |^## |\Z)", re.MULTILINE | re.DOTALL)
    found = part.search(current, section.start(), section.end())
    if found is None:
        raise SystemExit(f"no {PIPELINE_HEADING!r} in {SECTION!r}")
    RESULTS.write_text(current[: found.start()] + text + "\n" + current[found.end() :], encoding="utf-8")


def _share_range(shares: list[float]) -> str:
    """ "87%" when every round saw the same share, "80%-87%" otherwise."""
    if not shares:
        return "n/a"
    low, high = f"{min(shares):.0%}", f"{max(shares):.0%}"
    return low if low == high else f"{low}-{high}"


if __name__ == "__main__":
    raise SystemExit(main())
