"""A node's read of one key it holds, whole value vs a projection of 2 of its 20 fields: the instructions the
read path executes per read (callgrind), and its time per read, in-process, for values of several sizes.

    .venv/bin/python benchmarks/projection_cpu.py [--reads 20000] [--no-callgrind]
    PYTHONPATH=SITE .venv/bin/python -P benchmarks/projection_cpu.py   # the keyroute installed in SITE

What is measured is what a node runs for `GET /stores/{store}/keys/{key}[?fields=f00,f01]` from the decoded
request to the answer's body: the query's projection (`json_projection`, as the data plane calls it) and
`keyroute.state_node.reads.read_key` on a partition map and a partition held in memory. The HTTP server's
parsing and writing are left out (they are the same code for both, apart from the bytes written:
benchmarks/multi_store.py measures the whole node process, sockets included). Instruction counts come from
valgrind's callgrind, collecting only inside one call of `functools.reduce` that makes the reads (its
`--toggle-collect`), after a warm-up: they do not move with the machine's load, as times do.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if "PYTHONPATH" not in os.environ:  # else the keyroute on it (say, a compiled build's site) is measured
    sys.path.insert(0, str(ROOT))

import orjson  # noqa: E402

from keyroute.cluster.partition_map import Assignment, NodeRecord, PartitionMap, ServingRecord, StoreRecord  # noqa: E402
from keyroute.keys.key_format import KeyFormat  # noqa: E402
from keyroute.keys.partitioner import Partitioner, partition_for  # noqa: E402
from keyroute.storage.projection import json_projection  # noqa: E402

STORE = "features"
PARTITIONS = 8
KEYS = 1000
FIELDS = tuple(f"f{i:02d}" for i in range(20))
QUERY = b"fields=f00,f01"


def value_of(i: int, size: str) -> dict[str, Any]:
    """Twenty fields; f00 and f01 (the projected ones) are always a number and a short text. `small`: numbers,
    fractions and short texts (about 350 bytes, as benchmarks/multi_store.py's); `texts`: four of the fields
    are texts of 1,000 characters (about 4.5 KB); `arrays`: four are arrays of 200 numbers and two texts of
    2,000 characters (about 11 KB)."""
    value: dict[str, Any] = {
        name: (i * (k + 1) if k % 3 == 0 else round(i / (k + 1), 4) if k % 3 == 1 else f"{name}-{i % 97:02d}")
        for k, name in enumerate(FIELDS)
    }
    value["f01"] = f"segment-{i % 7}"
    if size == "texts":
        for name in FIELDS[16:]:
            value[name] = (f"{name} of {i}: " + "lorem ipsum dolor sit amet " * 40)[:1000]
    elif size == "arrays":
        for k, name in enumerate(FIELDS[14:18]):
            value[name] = [round((i + j) * 0.37 + k, 3) for j in range(200)]
        for name in FIELDS[18:]:
            value[name] = (f"{name} of {i}: " + "lorem ipsum dolor sit amet " * 80)[:2000]
    return value


SIZES = ("small", "texts", "arrays")


class Held:
    """A loaded partition as the read path sees it (keyroute.replica.store.PartitionStore): rows in memory."""

    live = None
    timeline = None

    def __init__(self, rows: dict[bytes, bytes]) -> None:
        self.version = 1
        self.rows = rows

    def get(self, key: bytes) -> bytes | None:
        return self.rows.get(key)


def node_of(size: str) -> tuple[Any, list[str]]:
    """A node that holds every partition of STORE, its values of `size`, and the keys it holds."""
    keys = [f"customer-{i:06d}" for i in range(KEYS)]
    rows: dict[int, dict[bytes, bytes]] = {p: {} for p in range(PARTITIONS)}
    for i, key in enumerate(keys):
        rows[partition_for(Partitioner.MURMUR2, key.encode(), PARTITIONS)][key.encode()] = orjson.dumps(
            value_of(i, size)
        )
    record = StoreRecord(STORE, PARTITIONS, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/nowhere", FIELDS)
    url = "http://127.0.0.1:1"
    m = PartitionMap.build(
        {STORE: record},
        {"n1": NodeRecord("n1", url)},
        Assignment(1, {}),
        {"n1": ServingRecord("n1", url, {STORE: dict.fromkeys(range(PARTITIONS), 1)})},
        generation=7,
    )
    held = {p: Held(r) for p, r in rows.items()}
    ownership = SimpleNamespace(map=m, local=lambda store, p: held.get(p) if store == STORE else None)
    node = SimpleNamespace(
        ownership=ownership,
        node_id="n1",
        node_header=(b"x-keyroute-node", b"n1"),
        metrics=SimpleNamespace(local_answers=0),
        clock=time.time,
        settings=SimpleNamespace(min_offset_wait_ms=0),
    )
    return node, keys


def reader(size: str, projected: bool) -> tuple[Any, list[str], int]:
    """One read as the node's data plane makes it (a function of a key), the keys, and a 200 body's size."""
    from keyroute.state_node.reads import read_key

    node, keys = node_of(size)
    query = QUERY if projected else b""

    def read(key: str) -> Any:
        fields = json_projection(query, None) if query else None
        return read_key(node, STORE, key, False, None, fields=fields)

    answer = read(keys[0])
    assert answer[0] == 200, answer
    body = json.loads(answer[2])
    assert len(body["value"]) == (2 if projected else 20)
    return read, keys, len(answer[2])


def run_reads(size: str, projected: bool, reads: int) -> None:
    """`reads` reads inside one functools.reduce (callgrind collects inside it only), after a warm-up."""
    read, keys, _ = reader(size, projected)
    for key in keys:
        read(key)
    n = len(keys)
    functools.reduce(lambda _, i: read(keys[i % n]), range(reads), None)


def time_reads(size: str, projected: bool, reads: int, repeats: int) -> float:
    """µs per read: the least of `repeats` timings of `reads` reads."""
    read, keys, _ = reader(size, projected)
    n = len(keys)
    best = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(reads):
            read(keys[i % n])
        best.append((time.perf_counter() - t0) * 1e6 / reads)
    return min(best)


def callgrind_per_read(size: str, projected: bool, reads: int) -> float:
    """Instructions per read, as callgrind counts them inside the reads' functools.reduce."""
    with tempfile.TemporaryDirectory(prefix="keyroute-callgrind-") as work:
        out = Path(work) / "callgrind.out"
        command = [
            "valgrind",
            "--tool=callgrind",
            "--collect-atstart=no",
            "--toggle-collect=functools_reduce",
            f"--callgrind-out-file={out}",
            sys.executable,
            str(Path(__file__).resolve()),
            "--child",
            size,
            "projected" if projected else "whole",
            str(reads),
        ]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"callgrind failed: {done.stderr.strip().splitlines()[-1:]}")
        found = re.search(r"^(?:summary|totals): (\d+)", out.read_text(errors="replace"), re.M)
        if found is None:
            raise SystemExit("callgrind wrote no totals")
        return int(found.group(1)) / reads


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reads", type=int, default=20_000, help="reads per measurement")
    parser.add_argument("--repeats", type=int, default=5, help="timings per way (the least is kept)")
    parser.add_argument("--no-callgrind", action="store_true", help="times only")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        size, way, reads = args.child
        run_reads(size, way == "projected", int(reads))
        return 0
    callgrind = not args.no_callgrind and shutil.which("valgrind") is not None
    print(
        f"{'value':8} {'way':10} {'body bytes':>10} {'µs/read':>8}"
        + (f" {'instructions/read':>18}" if callgrind else "")
    )
    for size in SIZES:
        rows = {}
        for projected in (False, True):
            _, _, body = reader(size, projected)
            us = time_reads(size, projected, args.reads, args.repeats)
            ir = callgrind_per_read(size, projected, max(1000, args.reads // 4)) if callgrind else None
            rows[projected] = (body, us, ir)
            way = "fields=f00,f01" if projected else "whole"
            print(
                f"{size:8} {way:10} {body:10,} {us:8.2f}" + (f" {ir:18,.0f}" if ir is not None else ""),
                flush=True,
            )
        (wb, wus, wir), (pb, pus, pir) = rows[False], rows[True]
        ratio = f"projected/whole: bytes {pb / wb:.2f}x, time {pus / wus:.2f}x"
        print(f"{'':8} {ratio}" + (f", instructions {pir / wir:.2f}x" if wir else ""), flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}; timings: least of {args.repeats} x {args.reads:,} reads")

    return 0


if __name__ == "__main__":
    raise SystemExit(main())
