"""What reading a few keys of a memory-mapped partition brings into a process: LMDB's map, read-ahead and the
kernel's fault-around, measured.

    .venv/bin/python benchmarks/replica_memory.py [--rows 1000000] [--write]

One LMDB file of `--rows` keys (~100-byte JSON values; keys and values as a partition stores them) in a
temporary folder of this machine's disk. Each measurement runs in a fresh process that opens it read-only as a
replica does (keyroute.replica.store: `readahead=False`, which makes LMDB `madvise(MADV_RANDOM)` its map; or
`readahead=True`, LMDB's default, for contrast), reads 1% of the keys (in key order, or at random) in one read
transaction each, and reports what grew: the process's file-backed resident memory (RssFile: the file's
pages mapped into it), the file's pages in the page cache (mincore, by util-linux's `fincore`) and the page
faults taken (getrusage). Two page-cache states: cold (the file's pages dropped with
`posix_fadvise(DONTNEED)` first: as after a reboot, or a file nobody read) and warm (the whole file read
first: as when the node or another worker of the host reads the same partition, or right after a load's
checksum pass).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import re
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import lmdb

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import write_section  # noqa: E402

from keyroute.storage.lmdb_layout import db_key  # noqa: E402

SECTION = "## Local replica: what a random read maps in (benchmarks/replica_memory.py)"
PAGE = 4096


def key_of(i: int) -> bytes:
    return b"C%09d" % i


def write_store(folder: Path, rows: int) -> Path:
    env = lmdb.open(str(folder), map_size=1 << 34, sync=False, metasync=False, readahead=False)
    try:
        with env.begin(write=True) as txn:
            cursor = txn.cursor()
            for i in range(rows):  # keys in order: LMDB fills its leaf pages as a build does (append)
                value = {"customer": i, "fare": round(10 + i % 997 * 0.37, 2), "city": "Lisbon", "seats": [1, i % 5]}
                value["booked"] = f"2024-06-{i % 28 + 1:02d}T{i % 24:02d}:00:00Z"
                cursor.put(db_key(key_of(i)), json.dumps(value, separators=(",", ":")).encode(), append=True)
        env.sync(True)  # clean pages: posix_fadvise(DONTNEED) leaves dirty ones in the page cache
    finally:
        env.close()
    return folder / "data.mdb"


def resident_kb() -> dict[str, int]:
    text = Path("/proc/self/status").read_text()
    return {name: int(re.search(rf"{name}:\s+(\d+) kB", text).group(1)) for name in ("VmRSS", "RssFile", "RssAnon")}  # type: ignore[union-attr]


def cached_mb(path: Path) -> float | None:
    """The file's bytes in the page cache (util-linux's fincore), or None without it."""
    if shutil.which("fincore") is None:
        return None
    done = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)], capture_output=True)
    return int(done.stdout.split()[0]) / 2**20 if done.returncode == 0 else None


def one(folder: Path, rows: int, order: str, readahead: bool) -> dict[str, float]:
    """In this process: open the store, read 1% of its keys, and say what grew."""
    path = folder / "data.mdb"
    env = lmdb.open(str(folder), readonly=True, lock=True, readahead=readahead, max_dbs=0, map_size=1 << 34)
    count = max(1, rows // 100)
    picked = range(count) if order == "key order" else random.Random(1).sample(range(rows), count)
    before, cache_before, faults = resident_kb(), cached_mb(path), resource.getrusage(resource.RUSAGE_SELF)
    for i in picked:
        with env.begin(buffers=False) as txn:
            if txn.get(db_key(key_of(i))) is None:
                raise SystemExit(f"key {i} missing")
    after, cache_after, faults_after = resident_kb(), cached_mb(path), resource.getrusage(resource.RUSAGE_SELF)
    env.close()
    return {
        "reads": count,
        "rss_file_mb": (after["RssFile"] - before["RssFile"]) / 1024,
        "rss_anon_mb": (after["RssAnon"] - before["RssAnon"]) / 1024,
        "cache_mb": -1.0 if cache_after is None or cache_before is None else cache_after - cache_before,
        "minor_faults": faults_after.ru_minflt - faults.ru_minflt,
        "major_faults": faults_after.ru_majflt - faults.ru_majflt,
    }


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm_cache(path: Path) -> None:
    with open(path, "rb") as fh:
        while fh.read(1 << 20):
            pass


def leaf_pages(folder: Path) -> int:
    env = lmdb.open(str(folder), readonly=True, lock=True, max_dbs=0)
    try:
        return int(env.stat()["leaf_pages"])
    finally:
        env.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--write", action="store_true", help="record the figures in RESULTS.md")
    parser.add_argument("--child", nargs=4, metavar=("FOLDER", "ROWS", "ORDER", "READAHEAD"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        folder, rows, order, readahead = args.child
        print(json.dumps(one(Path(folder), int(rows), order, readahead == "1")))
        return 0
    if args.rows < 1000:
        print("--rows must be at least 1000", file=sys.stderr)
        return 1
    command = ".venv/bin/python benchmarks/replica_memory.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    work = Path(tempfile.mkdtemp(prefix="keyroute-replica-memory-", dir=os.environ.get("TMPDIR")))
    try:
        path = write_store(work, args.rows)
        size_mb = path.stat().st_size / 2**20
        leaves = leaf_pages(work)
        results = []
        for cache in ("cold", "warm"):
            for order in ("key order", "random"):
                for readahead in (False, True):
                    drop_cache(path) if cache == "cold" else warm_cache(path)
                    child = [sys.executable, __file__, "--child", str(work), str(args.rows), order, str(int(readahead))]
                    done = subprocess.run(child, capture_output=True, text=True, check=True)
                    results.append((cache, order, readahead, json.loads(done.stdout)))
                    print(cache, order, readahead, results[-1][3], file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = section(command, args.rows, size_mb, leaves, results)
    print(text)
    if args.write:
        write_section(SECTION, text)
    return 0


def section(command: str, rows: int, size_mb: float, leaves: int, results: list) -> str:
    per_leaf = rows / leaves
    reads = max(1, rows // 100)
    # Leaf pages that 1% of the keys at random fall on: each leaf holds `per_leaf` keys.
    expected_random = leaves * (1 - (1 - reads / rows) ** per_leaf) * PAGE / 2**20
    lines = [
        SECTION,
        "",
        f"`{command}` on {dt.date.today().isoformat()}, {platform.machine()}, {os.cpu_count()} CPUs, Linux "
        f"{platform.release()}, Python {platform.python_version()}, py-lmdb {lmdb.__version__} (LMDB "
        f"{'.'.join(map(str, lmdb.version()))}); 1-minute load average {os.getloadavg()[0]:.1f}. One LMDB file of "
        f"{rows:,} keys (~100-byte JSON values), {size_mb:.0f} MB, {leaves:,} leaf pages of {PAGE:,} bytes "
        f"(~{per_leaf:.0f} keys each); {reads:,} reads (1% of the keys), one read transaction each, in a fresh "
        "process per row. RssFile: the file's pages mapped into the process; page cache: the file's pages the "
        "kernel holds (fincore); faults: the process's page faults (minor: the page was in the page cache; "
        "major: read from disk).",
        "",
        "| page cache before | keys read | open with | RssFile grew | page cache grew | minor faults | major faults |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for cache, order, readahead, r in results:
        opened = "`readahead=True` (LMDB's default)" if readahead else "`readahead=False` (MADV_RANDOM, as shipped)"
        grew = "—" if r["cache_mb"] < 0 else f"{r['cache_mb']:.1f} MB"
        lines.append(
            f"| {cache} | {order} | {opened} | {r['rss_file_mb']:.1f} MB | {grew} | "
            f"{r['minor_faults']:,} | {r['major_faults']:,} |"
        )
    by = {(cache, order, readahead): r for cache, order, readahead, r in results}
    cold = by[("cold", "random", False)]
    warm = by[("warm", "random", False)]
    lines += [
        "",
        f"Reading the figures: 1% of the keys at random fall on {expected_random:.0f} MB of leaf pages (each of "
        f"the {leaves:,} leaves holds ~{per_leaf:.0f} keys, so a fraction 1 - 0.99^{per_leaf:.0f} of them is "
        f"touched), in key order on {leaves / 100 * PAGE / 2**20:.1f} MB. From a cold page cache, opened as "
        f"shipped, a random read maps in its own pages and nothing else: {cold['rss_file_mb']:.1f} MB mapped, "
        f"{cold['major_faults']:,} pages read from disk, one per fault. That is the floor for random keys: LMDB "
        "pages are the operating system's (4 KiB), and a key's value is on its leaf page. With LMDB's default "
        "read-ahead the kernel reads around each fault, and 1% of the keys bring in the whole file. From a warm "
        f"page cache, the same reads map {warm['rss_file_mb']:.1f} MB, with {warm['minor_faults']:,} faults: the "
        f"kernel's fault-around maps up to 16 neighbouring pages (64 KiB) already in the page cache with each "
        "fault, whatever the map's advice (MADV_RANDOM does not turn it off on this kernel); only the system-wide "
        "`fault_around_bytes` (debugfs) does. Neither py-lmdb nor LMDB exposes its map for another `madvise`, and "
        "no opening option changes what a fault maps. Those pages are in memory either way (the page cache's, "
        "shared with every process of the host and reclaimable: the process's own memory, RssAnon, does not "
        "grow); mapping them costs no memory, it only shows in RssFile. What costs memory is what the page cache "
        "holds: a replica's load reads each partition once for its checksum, which leaves the file in the page "
        "cache until the kernel needs the memory.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
