"""Projections on a node: a read of 2 of 20 fields vs the whole value, CPU and bytes per read, in one run.

Run from the repository root: `.venv/bin/python benchmarks/multi_store.py [--write]` (`--quick`: a smoke
run of the plumbing, not figures). It writes a store of values of 20 fields without Spark, starts one
ZooKeeper and one node that serves every partition, and reads it with wrk (single keys, as
benchmarks/router.py's paths): whole values, and `?fields=f00,f01`, in a shuffled order per round. `--values`
names the values' sizes, a node each (benchmarks/projection_cpu.py's: small, texts, arrays).
Reported, medians of the rounds: the node process's CPU per read (/proc, user + system) and reads/s, and the
answer's body bytes (mean over sampled reads). --write records the table in benchmarks/RESULTS.md.

`--stores`: multi-store reads instead (`stores_main`): three co-located stores on two nodes behind a router, a
read of one key's three values in one request (`GET /stores/a,b,c/read/{key}`) against three single reads of
it, side by side: the nodes' and the router's CPU per key (wrk), and the latency of one key's three values from
the Python client (`get_stores` against three `get`s one after another, and three at once from AsyncClient).
Its table goes to its own section of RESULTS.md. `--site DIR`: the nodes and the router run from a compiled
build installed with `KEYROUTE_COMPILE=1 pip install --no-deps --target DIR` (as the image ships them; `make
compiled` puts one in build/compiled/site), first on PYTHONPATH; without it, from the venv's editable install.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import harness  # benchmarks/harness.py: ports, ZooKeeper, waiting, RESULTS.md

bench = harness.script("router.py")

from keyroute.cluster import zk, zk_layout  # noqa: E402
from keyroute.cluster.partition_map import StoreRecord  # noqa: E402
from keyroute.dev.zookeeper_server import EmbeddedZooKeeper  # noqa: E402
from keyroute.keys.key_format import KeyFormat  # noqa: E402
from keyroute.keys.partitioner import Partitioner, partition_for  # noqa: E402
from keyroute.runtime.settings import ZkSettings  # noqa: E402
from keyroute.storage.snapshot import Manifest, partition_dir, version_dir, write_manifest  # noqa: E402

SECTION = "## Projections on a node (benchmarks/multi_store.py)"
FIELDS = tuple(f"f{i:02d}" for i in range(20))
WAYS = {"whole value": "", "fields=f00,f01": "?fields=f00,f01"}


def value_of(i: int, size: str = "small") -> dict[str, Any]:
    """Twenty fields of the kinds feature stores hold: integers, fractions, short texts (`small`), some of them
    long texts or arrays of numbers (benchmarks/projection_cpu.py's `value_of`)."""
    if size != "small":
        from projection_cpu import value_of as sized  # benchmarks/ is the script's folder

        return sized(i, size)
    return {
        name: (i * (k + 1) if k % 3 == 0 else round(i / (k + 1), 4) if k % 3 == 1 else f"{name}-{i % 97:02d}")
        for k, name in enumerate(FIELDS)
    }


def write_store(root: Path, keys: int, partitions: int, size: str = "small", store: str = bench.STORE) -> str:
    snapshot = version_dir(str(root), store, 1)
    counts = [0] * partitions
    with ExitStack() as stack:
        files = []
        for p in range(partitions):
            folder = partition_dir(snapshot, p)
            folder.mkdir(parents=True)
            files.append(stack.enter_context(open(folder / "part-00000.json", "w")))
        for i in range(keys):
            p = partition_for(Partitioner.MURMUR2, bench.key_text(i).encode(), partitions)
            files[p].write(json.dumps({"key": bench.key_text(i), "value": value_of(i, size)}) + "\n")
            counts[p] += 1
    write_manifest(
        snapshot, Manifest(store, 1, partitions, Partitioner.MURMUR2, KeyFormat.STRING, FIELDS, tuple(counts))
    )
    return str(snapshot)


@contextmanager
def running(args: argparse.Namespace, work: Path, size: str = "small") -> Iterator[Any]:
    with ExitStack() as stack:
        snapshot = write_store(work / "snapshots", args.keys, args.partitions, size)
        zk_server = EmbeddedZooKeeper(port=harness.free_port(), data_dir=work / "zookeeper")
        zk_server.start()
        stack.callback(zk_server.stop)
        settings = ZkSettings(hosts=zk_server.connect_string, chroot="/keyroute-projections")
        client = zk.connect(settings)
        stack.callback(zk.close, client)
        record = StoreRecord(
            bench.STORE, args.partitions, Partitioner.MURMUR2, KeyFormat.STRING, 1, snapshot, FIELDS, 1, time.time()
        )
        client.create(zk_layout.store_path(bench.STORE), record.to_json(), makepath=True)
        port = harness.free_port()
        node = bench.THIS_TREE.start(
            "node",
            ["node", "--zk", settings.connect_string, "--node-id", "n1", "--port", str(port)]
            + ["--data-dir", str(work / "data-n1")],
            work,
            f"http://127.0.0.1:{port}",
        )
        stack.callback(node.stop)
        bench.wait_until(lambda: bench.http_json(node.url + "/readyz")[0] == 200, 180, "the node to load", [node])
        yield node


def body_bytes(node: Any, args: argparse.Namespace) -> dict[str, float]:
    rng = random.Random(3)
    keys = [bench.key_text(rng.randrange(args.keys)) for _ in range(args.samples)]
    out = {}
    for way, query in WAYS.items():
        sizes = []
        for key in keys:
            with urllib.request.urlopen(f"{node.url}/stores/{bench.STORE}/keys/{key}{query}", timeout=10) as r:
                body = r.read()
            value = json.loads(body)["value"]
            assert len(value) == (2 if query else 20), value
            sizes.append(len(body))
        out[way] = statistics.mean(sizes)
    return out


def measure(wrk: str, work: Path, node: Any, args: argparse.Namespace) -> dict[str, list[tuple[float, float, int]]]:
    """(reads/s, node CPU µs per read, errors) per way and round."""
    paths = {}
    for way, query in WAYS.items():
        paths[way] = work / f"paths-{len(paths)}.txt"
        lines = (f"/stores/{bench.STORE}/keys/{bench.key_text(i)}{query}" for i in range(args.keys))
        paths[way].write_text("\n".join(lines) + "\n")
    script = work / "key.lua"
    script.write_text(bench.WRK_SCRIPT)

    def run_way(way: str, duration: float, seed: int) -> tuple[float, float, int]:
        before = bench.tree_cpu_s(node.popen.pid)
        run = bench.wrk_result(bench.wrk_start(wrk, script, node.url, paths[way], args.concurrency, duration, seed))
        cpu = bench.tree_cpu_s(node.popen.pid) - before
        return run.requests / run.duration_s, cpu * 1e6 / max(1, run.requests), run.errors

    for way in WAYS:  # warm-up, not counted
        run_way(way, 1.0, 0)
    results: dict[str, list[tuple[float, float, int]]] = {way: [] for way in WAYS}
    rng = random.Random(11)
    for round_number in range(args.rounds):
        order = list(WAYS)
        rng.shuffle(order)
        for way in order:
            results[way].append(run_way(way, args.duration, round_number + 1))
    return results


VALUES = {
    "small": "20 fields: integers, fractions, short texts",
    "texts": "the same, 4 of them texts of 1,000 characters",
    "arrays": "the same, 4 of them arrays of 200 numbers and 2 texts of 2,000 characters",
}


def section(
    by_size: dict[str, tuple[dict[str, list[tuple[float, float, int]]], dict[str, float]]], args: Any, load: str
) -> str:
    command = "`.venv/bin/python benchmarks/multi_store.py" + (f" --rounds {args.rounds}" if args.rounds != 5 else "")
    if list(by_size) != ["small"]:
        command += f" --values {','.join(by_size)}"
    values = "; ".join(f"{size}: {VALUES[size]}" for size in by_size)
    lines = [
        SECTION,
        "",
        f"{command} --write` on {datetime.date.today().isoformat()}, {platform.machine()}, {os.cpu_count()} CPUs,"
        f" Python {platform.python_version()}; {load}. {args.keys:,} keys (values of {values}) in"
        f" {args.partitions} partitions on one node (a node per value size); wrk, {args.concurrency}"
        f" connections, {args.duration:g} s per measurement, medians of {args.rounds} rounds (ways in a shuffled"
        " order per round). Node CPU: user + system of the node process, from /proc, per read. Bytes: the"
        f" answer's body, mean over {args.samples} sampled reads.",
        "",
        "| values | read | reads/s | node CPU µs/read | vs whole | body bytes | vs whole |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    errors = 0
    for size, (results, sizes) in by_size.items():

        def median(way: str, index: int, results: dict[str, list[tuple[float, float, int]]] = results) -> float:
            return statistics.median(r[index] for r in results[way])

        base_cpu, base_bytes = median("whole value", 1), sizes["whole value"]
        for way in WAYS:
            cpu = median(way, 1)
            lines.append(
                f"| {size} | {way} | {median(way, 0):,.0f} | {cpu:,.0f} | {cpu / base_cpu:.2f}x | {sizes[way]:,.0f}"
                f" | {sizes[way] / base_bytes:.2f}x |"
            )
        errors += sum(r[2] for rs in results.values() for r in rs)
    if errors:
        lines += ["", f"wrk counted {errors} errors."]
    return "\n".join(lines) + "\n"


def write_section(text: str) -> None:
    path = Path(__file__).resolve().parent / "RESULTS.md"
    current = path.read_text(encoding="utf-8")
    pattern = re.compile(re.escape(SECTION) + r"\n.*?(?=\n## |\Z)", re.S)
    if pattern.search(current):
        current = pattern.sub(lambda _: text.rstrip("\n") + "\n", current)
    else:
        current = current.rstrip("\n") + "\n\n" + text
    path.write_text(current, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=50_000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=500)
    parser.add_argument("--values", default="small", help="value sizes, a node each: small, texts, arrays")
    parser.add_argument("--quick", action="store_true", help="a smoke run of the plumbing, not figures")
    parser.add_argument("--write", action="store_true", help="record the table in benchmarks/RESULTS.md")
    parser.add_argument("--stores", action="store_true", help="measure multi-store reads instead (stores_main)")
    parser.add_argument("--key-rate", type=int, default=500, help="--stores: keys/s both ways are paced to")
    parser.add_argument("--site", help="--stores: run the servers from this compiled build (pip install --target DIR)")
    args = parser.parse_args(argv)
    if args.stores:
        return stores_main(args)
    if args.quick:
        args.keys, args.duration, args.rounds, args.samples = 2000, 1.0, 1, 50
    wrk = shutil.which("wrk")
    if wrk is None:
        print("wrk is not installed", file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="keyroute-projections-"))
    try:
        load_before = os.getloadavg()[0]
        by_size = {}
        for size in args.values.split(","):
            if size not in VALUES:
                print(f"--values: {size!r} is not one of {', '.join(VALUES)}", file=sys.stderr)
                return 1
            with running(args, work / size, size) as node:
                by_size[size] = (body_bytes(node, args), measure(wrk, work / size, node, args))
        load = f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
        text = section({size: (r, b) for size, (b, r) in by_size.items()}, args, load)
        print(text)
        if args.write and not args.quick:
            write_section(text)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


# -- multi-store reads: one key's three values in one request, against three single reads ---------------------

STORES_SECTION = "## Multi-store reads through a router (benchmarks/multi_store.py --stores)"
THREE = ("features", "profile", "balance")
ONE_REQUEST = "one request: GET /stores/features,profile,balance/read/{key}"
THREE_REQUESTS = "three single reads: GET /stores/{store}/keys/{key} x 3"
# The single reads again, paced to the requests/s of the one-request way (a third of its keys/s): each
# request shares the node's wake-ups with as many others as a multi-store request does.
SAME_REQUESTS = "three single reads, at the one request's requests/s"
STORE_WAYS = (ONE_REQUEST, THREE_REQUESTS, SAME_REQUESTS)
# Latency of one key's three values from the Python client, by how it asks.
CLIENT_WAYS = {
    "Client.get_stores (one request)": "stores",
    "Client.get x 3, one after another": "sequential",
    "AsyncClient.get x 3, at once": "gather",
}


@contextmanager
def stores_cluster(args: argparse.Namespace, work: Path, build: Any) -> Iterator[tuple[Any, list[Any]]]:
    """ZooKeeper, two nodes serving three co-located stores (partition p of each on the same node), a router,
    run from `build`."""
    with ExitStack() as stack:
        zk_server = stack.enter_context(harness.zookeeper(work))
        settings = ZkSettings(hosts=zk_server.connect_string, chroot="/keyroute-multi-store")
        client = zk.connect(settings)
        stack.callback(zk.close, client)
        for store in THREE:
            snapshot = write_store(work / "snapshots", args.keys, args.partitions, store=store)
            record = StoreRecord(
                store,
                args.partitions,
                Partitioner.MURMUR2,
                KeyFormat.STRING,
                1,
                snapshot,
                FIELDS,
                1,
                time.time(),
                colocate_with=None if store == THREE[0] else THREE[0],
            )
            client.create(zk_layout.store_path(store), record.to_json(), makepath=True)
        nodes = []
        for node_id in ("n1", "n2"):
            port = harness.free_port()
            node = build.start(
                node_id,
                ["node", "--zk", settings.connect_string, "--node-id", node_id, "--port", str(port)]
                + ["--data-dir", str(work / f"data-{node_id}")],
                work,
                f"http://127.0.0.1:{port}",
            )
            stack.callback(node.stop)
            nodes.append(node)
        port = harness.free_port()
        router = build.start(
            "router", ["router", "--zk", settings.connect_string, "--port", str(port)], work, f"http://127.0.0.1:{port}"
        )
        stack.callback(router.stop)
        every = [router, *nodes]

        def served() -> bool:
            status, body = bench.http_json(router.url + "/readyz")
            return status == 200 and isinstance(body, dict) and body.get("complete") is True

        bench.wait_until(served, 180, "every store to be served", every)
        yield router, nodes


# The modules a multi-store read runs through that a compiled build must hold as C extensions.
STORES_PROBES = (*bench.COMPILED_PROBES, "keyroute.state_node.reads")


def servers_build(site: str | None) -> Any:
    """The build the servers run from: the venv's editable install, or the compiled one installed in `site`
    (stops unless the read paths' modules are its C extensions)."""
    if site is None:
        return bench.THIS_TREE
    folder = Path(site).resolve()
    if not (folder / "keyroute").is_dir():
        raise SystemExit(f"--site {site}: no keyroute installed there (KEYROUTE_COMPILE=1 pip install --target DIR)")
    env = {"PYTHONPATH": str(folder)}
    where = bench.where_from(sys.executable, ["keyroute", *STORES_PROBES], folder, env)
    astray = {
        name: found
        for name, found in where.items()
        if not found.startswith(str(folder) + os.sep) or (name in STORES_PROBES and not found.endswith(".so"))
    }
    if astray:
        raise SystemExit(f"--site {site}: not imported from a compiled build there: {astray}")
    return bench.Build("compiled", folder, env, how=f"compiled with mypyc, installed in {site}", compiled=True)


def stores_measure(
    wrk: str, work: Path, router: Any, nodes: list[Any], args: argparse.Namespace
) -> dict[str, list[tuple[float, float, float, float, int]]]:
    """Per way and round: (keys/s, nodes' CPU µs per key, router CPU µs per key, wrk p50 µs, errors)."""
    paths = {ONE_REQUEST: work / "paths-stores.txt", THREE_REQUESTS: work / "paths-singles.txt"}
    paths[SAME_REQUESTS] = paths[THREE_REQUESTS]
    joined = ",".join(THREE)
    paths[ONE_REQUEST].write_text("".join(f"/stores/{joined}/read/{bench.key_text(i)}\n" for i in range(args.keys)))
    paths[THREE_REQUESTS].write_text(
        "".join(f"/stores/{store}/keys/{bench.key_text(i)}\n" for i in range(args.keys) for store in THREE)
    )
    requests_per_key = {ONE_REQUEST: 1, THREE_REQUESTS: len(THREE), SAME_REQUESTS: len(THREE)}
    # Requests/s per way: the keys/s asked, in its requests; the third way at the first one's requests/s.
    rates = {ONE_REQUEST: args.key_rate, THREE_REQUESTS: args.key_rate * len(THREE), SAME_REQUESTS: args.key_rate}
    script = work / "paced-key.lua"
    script.write_text(bench.WRK_SCRIPT + bench.WRK_PACING)

    def run_way(way: str, duration: float, seed: int) -> tuple[float, float, float, float, int]:
        before = [bench.tree_cpu_s(node.popen.pid) for node in nodes], bench.tree_cpu_s(router.popen.pid)
        # Both ways at the same rate of keys (a page's reads of three stores, so many pages a second): the
        # CPU a key costs at that load, not how many keys each way could squeeze through a busy machine.
        rate = rates[way]
        run = bench.wrk_result(
            bench.wrk_start(wrk, script, router.url, paths[way], args.concurrency, duration, seed, rate)
        )
        node_cpu = sum(bench.tree_cpu_s(node.popen.pid) for node in nodes) - sum(before[0])
        router_cpu = bench.tree_cpu_s(router.popen.pid) - before[1]
        keys = max(1, run.requests) / requests_per_key[way]
        return keys / run.duration_s, node_cpu * 1e6 / keys, router_cpu * 1e6 / keys, run.p50_us, run.errors

    for way in STORE_WAYS:  # warm-up, not counted
        run_way(way, 1.0, 0)
    results: dict[str, list[tuple[float, float, float, float, int]]] = {way: [] for way in STORE_WAYS}
    rng = random.Random(11)
    for round_number in range(args.rounds):
        order = list(STORE_WAYS)
        rng.shuffle(order)
        for way in order:
            results[way].append(run_way(way, args.duration, round_number + 1))
    return results


def client_latency(router: Any, args: argparse.Namespace) -> dict[str, list[float]]:
    """µs to get one key's three values from the Python client through the router, per way (one client call
    at a time; the ways in a shuffled order per round)."""
    import asyncio

    from keyroute.client import AsyncClient, Client

    rng = random.Random(5)
    keys = [bench.key_text(rng.randrange(args.keys)) for _ in range(args.samples)]
    out: dict[str, list[float]] = {way: [] for way in CLIENT_WAYS}

    async def gathered(client: AsyncClient, key: str) -> float:
        started = time.perf_counter()
        values = await asyncio.gather(*(client.get(store, key) for store in THREE))
        assert len(values) == len(THREE)
        return time.perf_counter() - started

    async def run_async(keys_: list[str]) -> list[float]:
        async with AsyncClient(router.url) as client:
            await client.get(THREE[0], keys_[0])
            return [await gathered(client, key) for key in keys_]

    with Client(router.url) as client:
        client.get_stores(keys[0], THREE)
        for _ in range(args.rounds):
            order = list(CLIENT_WAYS)
            rng.shuffle(order)
            for way in order:
                kind = CLIENT_WAYS[way]
                if kind == "gather":
                    out[way] += asyncio.run(run_async(keys))
                    continue
                for key in keys:
                    started = time.perf_counter()
                    if kind == "stores":
                        values = client.get_stores(key, THREE)
                        assert all(v.value for v in values.values()), values  # type: ignore[union-attr]
                    else:
                        for store in THREE:
                            client.get(store, key)
                    out[way].append(time.perf_counter() - started)
    return {way: [s * 1e6 for s in seconds] for way, seconds in out.items()}


def stores_section(
    results: dict[str, list[tuple[float, float, float, float, int]]],
    latency: dict[str, list[float]],
    args: Any,
    load: str,
) -> str:
    def median(way: str, index: int) -> float:
        return statistics.median(r[index] for r in results[way])

    def quantile(values: list[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    command = "`.venv/bin/python benchmarks/multi_store.py --stores" + (
        f" --rounds {args.rounds}" if args.rounds != 5 else ""
    )
    command += f" --key-rate {args.key_rate}" if args.key_rate != 500 else ""
    command += f" --site {args.site}" if args.site else ""
    servers = (
        "the nodes and the router compiled with mypyc as the image ships them (`make compiled`: setup.py's"
        " COMPILED list, `KEYROUTE_COMPILE=1 pip install --no-deps --target`), run from that directory"
        if args.site
        else "the nodes and the router pure Python (the venv's editable install)"
    )
    base = median(THREE_REQUESTS, 1)
    lines = [
        STORES_SECTION,
        "",
        f"{command} --write` on {datetime.date.today().isoformat()}, {platform.machine()}, {os.cpu_count()} CPUs,"
        f" Python {platform.python_version()}; {load}. Three co-located stores of {args.keys:,} keys each (values"
        f" of 20 fields) in {args.partitions} partitions on two nodes (partition p of each on the same node),"
        f" behind one router. wrk through the router, {args.concurrency} connections, paced to"
        f" {args.key_rate:,} keys/s for the first two ways (three requests per key for single reads; the last row"
        f" at {args.key_rate:,} requests/s), {args.duration:g} s per"
        f" measurement, medians of {args.rounds} rounds (ways in a shuffled order per round), counted per key"
        f" (three values): CPU is user + system of the node processes (summed) and of the router, from /proc;"
        f" {servers}.",
        "",
        "| one key's three values | keys/s | nodes' CPU µs/key | vs three reads | router CPU µs/key"
        " | wrk p50 µs/request |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for way in STORE_WAYS:
        cpu = median(way, 1)
        lines.append(
            f"| {way} | {median(way, 0):,.0f} | {cpu:,.0f} | {cpu / base:.2f}x | {median(way, 2):,.0f}"
            f" | {median(way, 3):,.0f} |"
        )
    one, three, same = median(ONE_REQUEST, 1), base / len(THREE), median(SAME_REQUESTS, 1)
    lines += [
        "",
        f"At the same rate of keys, a node spent {one:,.0f} µs on a request for the three stores and {three:,.0f}"
        f" µs on a single read's: a key's three values cost {base / one:.2f}x fewer node CPU µs in one request"
        f" (the target was 2x). The single reads then come three times as often, so each of their wake-ups of a"
        f" node is shared by more requests; at the one request's rate of requests (the last row) a key's three"
        f" single reads cost {same:,.0f} µs, {same / one:.2f}x the one request: what the three reads cost with"
        " the same share of wake-ups.",
    ]
    lines += [
        "",
        f"Latency of one key's three values from the Python client through the router (one call at a time,"
        f" {args.samples} keys x {args.rounds} rounds):",
        "",
        "| client | p50 µs | p99 µs |",
        "|---|---:|---:|",
    ]
    for way, values in latency.items():
        lines.append(f"| {way} | {quantile(values, 0.5):,.0f} | {quantile(values, 0.99):,.0f} |")
    errors = sum(r[4] for rs in results.values() for r in rs)
    if errors:
        lines += ["", f"wrk counted {errors} errors."]
    return "\n".join(lines) + "\n"


def stores_main(args: argparse.Namespace) -> int:
    if args.quick:
        args.keys, args.duration, args.rounds, args.samples = 2000, 1.0, 1, 50
    wrk = shutil.which("wrk")
    if wrk is None:
        print("wrk is not installed", file=sys.stderr)
        return 1
    build = servers_build(args.site)
    work = Path(tempfile.mkdtemp(prefix="keyroute-multi-store-"))
    try:
        load_before = os.getloadavg()[0]
        with stores_cluster(args, work, build) as (router, nodes):
            results = stores_measure(wrk, work, router, nodes, args)
            latency = client_latency(router, args)
        load = f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
        text = stores_section(results, latency, args, load)
        print(text)
        if args.write and not args.quick:
            harness.write_section(STORES_SECTION, text)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
