"""What a node's multi-store read costs it in itself, against single reads: instructions (or time) per request of
the node's data plane, from the parsed request to the answer's bytes, in one process without sockets.

Run from the repository root:

    .venv/bin/python benchmarks/multi_store_node.py [--mode time|callgrind] [--requests N] [--site DIR]

One node's data plane (keyroute.state_node.dataplane.NodeDataPlane over a hand-made partition map) holds
partition p of three co-located stores (values of 20 fields); each way is the data plane's `handle` of one
request, answered at once from the node's copy:

    multi    GET /stores/features,profile,balance/read/{key}   one key's three values in one request
    single   GET /stores/{store}/keys/{key}                     one store's value (x3 for a key's three)

    time       wall time per request (median of 5 runs of `--requests` each)
    callgrind  this script again under `valgrind --tool=callgrind` for N and 2N requests of each way: the
               difference of their instruction counts / N, instructions per request (start-up cancels out)

`--site DIR`: a compiled build installed with `KEYROUTE_COMPILE=1 pip install --no-deps --target DIR`
(`make compiled` puts one in build/compiled/site), first on the path. Figures only: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STORES = ("features", "profile", "balance")
PARTITIONS = 8
KEYS = 512


def value(store: str, i: int) -> bytes:
    return json.dumps(
        {f"f{n}": f"{store}-{i}-{n}" if n % 2 else i * n for n in range(20)}, separators=(",", ":")
    ).encode()


class Held:
    """A loaded batch partition as the read path sees it."""

    live: Any = None

    def __init__(self, version: int, rows: dict[bytes, bytes]) -> None:
        self.version = version
        self.rows = rows

    def get(self, key: bytes) -> bytes | None:
        return self.rows.get(key)


class Ownership:
    def __init__(self, m: Any, held: dict[tuple[str, int], Held]) -> None:
        self.map = m
        self.held = held
        self.leaving = False

    def local(self, store: str, partition: int) -> Held | None:
        return self.held.get((store, partition))


class Exchange:
    """What the data plane uses of a server's exchange: the request, and the answer kept."""

    def __init__(self, request: Any) -> None:
        self.request = request
        self._on_done: Any = None
        self.answered: tuple[int, Any, bytes] | None = None
        self.gone = False
        self.transport = None

    def on_done(self, callback: Any) -> None:
        self._on_done = callback

    def answer(self, status: int, headers: Any, body: bytes) -> None:
        self.answered = (status, headers, body)
        if self._on_done is not None:
            self._on_done()


def plane_and_keys() -> tuple[Any, list[str]]:
    from keyroute.cluster.partition_map import Assignment, NodeRecord, PartitionMap, ServingRecord, StoreRecord
    from keyroute.http.admission import Admission
    from keyroute.keys.key_format import KeyFormat, parse_key
    from keyroute.keys.partitioner import Partitioner
    from keyroute.runtime.settings import NodeSettings
    from keyroute.state_node.app import Node
    from keyroute.state_node.dataplane import NodeDataPlane

    columns = tuple(f"f{n}" for n in range(20))
    records = {
        s: StoreRecord(s, PARTITIONS, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/nowhere", columns, 1) for s in STORES
    }
    url = "http://n1.test:1"
    serving = {s: dict.fromkeys(range(PARTITIONS), 1) for s in STORES}
    m = PartitionMap.build(
        records,
        {"n1": NodeRecord("n1", url)},
        Assignment(1, {}),
        {"n1": ServingRecord("n1", url, serving)},
        generation=7,
    )
    held: dict[tuple[str, int], Held] = {(s, p): Held(1, {}) for s in STORES for p in range(PARTITIONS)}
    keys = [f"key-{i}" for i in range(KEYS)]
    for s in STORES:
        for i, text in enumerate(keys):
            p = m.locate(records[s], parse_key(KeyFormat.STRING, text)).partition
            held[(s, p)].rows[text.encode()] = value(s, i)
    settings = NodeSettings(node_id="n1", data_dir=None)  # type: ignore[arg-type]
    node = Node(settings, Ownership(m, held), None)  # type: ignore[arg-type]
    return NodeDataPlane(node, Admission()), keys


def requests_of(way: str, keys: list[str], count: int) -> list[Any]:
    from keyroute.http.exchange import Request

    made = []
    for i in range(count):
        key = keys[i % len(keys)]
        if way == "multi":
            path = f"/stores/{','.join(STORES)}/read/{key}"
        else:
            path = f"/stores/{STORES[i % 3]}/keys/{key}"
        made.append(Request("GET", path.encode(), b"", [(b"host", b"n1")], b"", str(i), "1.1"))
    return made


def run(way: str, count: int) -> float:
    """`count` requests of `way` through the data plane; seconds taken."""
    plane, keys = plane_and_keys()
    made = requests_of(way, keys, count)
    exchanges = [Exchange(request) for request in made]
    for exchange in exchanges[:50]:  # warm: the map's locators, the route table's first look-ups
        plane.handle(Exchange(exchange.request))
    started = time.perf_counter()
    for exchange in exchanges:
        plane.handle(exchange)
    taken = time.perf_counter() - started
    for exchange in exchanges:
        assert exchange.answered is not None and exchange.answered[0] == 200, exchange.answered
    return taken


def callgrind_instructions(way: str, count: int, site: str | None) -> int:
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "callgrind.out"
        env = dict(os.environ)
        if site:
            env["PYTHONPATH"] = site
        subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                sys.executable,
                __file__,
                "--child",
                way,
                str(count),
            ],
            check=True,
            capture_output=True,
            env=env,
        )
        text = out.read_text()
    found = re.search(r"^summary:\s+(\d+)", text, re.M) or re.search(r"^totals:\s+(\d+)", text, re.M)
    assert found, "no totals in the callgrind output"
    return int(found.group(1))


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        run(sys.argv[2], int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("time", "callgrind"), default="time")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--site", default=None, help="a compiled build's --target DIR, first on the path")
    args = parser.parse_args()
    if args.site and os.environ.get("PYTHONPATH") != args.site:  # imported from the site, here and in children
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONPATH": args.site})
    import keyroute.state_node.multi_read as multi_read
    import keyroute.state_node.reads as reads

    print(f"reads: {Path(reads.__file__).name}, multi_read: {Path(multi_read.__file__).name}")
    rows = {}
    if args.mode == "time":
        count = args.requests or 20000
        for way in ("multi", "single"):
            rows[way] = statistics.median(run(way, count) for _ in range(5)) / count * 1e6
        unit = "µs/request"
    else:
        count = args.requests or 2000
        for way in ("multi", "single"):
            rows[way] = (
                callgrind_instructions(way, 2 * count, args.site) - callgrind_instructions(way, count, args.site)
            ) / count
        unit = "instructions/request"
    print(f"| way | {unit} | per key (three values) |")
    print(f"| multi: one 3-store request | {rows['multi']:,.0f} | {rows['multi']:,.0f} |")
    print(f"| single: one store's read | {rows['single']:,.0f} | {3 * rows['single']:,.0f} (x3) |")
    print(f"three single reads / one 3-store request: {3 * rows['single'] / rows['multi']:.2f}x")


if __name__ == "__main__":
    main()
