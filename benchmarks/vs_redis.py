"""keyroute's Python client against Redis, read for read, in one run on this machine.

    .venv/bin/python benchmarks/vs_redis.py [--reads N] [--rounds N] [--write]

Needs redis-server and redis-cli (Debian: `apt-get install -y redis-server`) and redis-py (the `bench` extra:
`pip install -e '.[bench]'`). The benchmark starts everything itself on free ports of 127.0.0.1 and stops it:
one redis-server; three redis-server in cluster mode, made one cluster of 3 masters with redis-cli; an
embedded ZooKeeper, two `keyroute node` processes and one `keyroute router` process serving a latest store
written by hand in the snapshot format (no Spark). Every server holds the same 5,000 keys with the same
~100-byte JSON values.

One Python process reads sequentially, one read at a time, random keys (the same keys for every way of a
round); ways interleaved, rounds alternate the order; the figures are medians over rounds:
- redis-py `GET` + `json.loads`, one redis-server;
- redis-py `RedisCluster` `GET` + `json.loads`, 3 masters (the client routes by slot, as keyroute's direct mode
  routes by partition);
- keyroute `Client(routing="direct")`: straight to the node serving the key, from the routing view;
- keyroute `Client` through the router;
- keyroute.local's `LocalReplica.get` (in the process, no hop): the hook `local_ways` below (no row yet);
- with `--floor`: a bare socket with a prebuilt request per key, to the key's node and to the router (what the
  servers alone take: the floor under any client);
- with `--httpx`: keyroute's `Client` in direct mode with an httpx transport (every read through httpx, as
  before the client had a wire of its own).
Per way: latency p50 and p99 of one read, and the client's CPU per read (`time.process_time` around the loop:
this process only; the servers run in other processes).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import free_port, wait  # noqa: E402
from timeline import cpu_s, log  # noqa: E402

from keyroute.client import Client  # noqa: E402
from keyroute.cluster import zk, zk_layout  # noqa: E402
from keyroute.cluster.partition_map import StoreRecord  # noqa: E402
from keyroute.dev.zookeeper_server import EmbeddedZooKeeper  # noqa: E402
from keyroute.keys.key_format import KeyFormat, parse_key  # noqa: E402
from keyroute.keys.partitioner import Partitioner, partition_for  # noqa: E402
from keyroute.runtime.settings import ZkSettings  # noqa: E402
from keyroute.storage.snapshot import Manifest, partition_dir, version_dir, write_manifest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SECTION = "## Reads from Python: keyroute's client against Redis (benchmarks/vs_redis.py)"
STORE = "bookings"
KEYS = 5_000
PARTITIONS = 8
CITIES = ("Lisbon", "Porto", "Braga", "Faro", "Coimbra", "Aveiro", "Evora")

Read = Callable[[str], Any]  # one read of a key, returning its value

# The server processes of each kind ("redis", "redis cluster", "nodes", "router"), by the context managers
# that start them: the CPU they spend while a way reads is that way's server CPU per read.
SERVER_PIDS: dict[str, list[int]] = {}


def rows() -> dict[str, dict[str, Any]]:
    """The data set: 5,000 keys, each a JSON object of about 100 bytes."""
    out = {}
    for n in range(KEYS):
        out[f"C{n:06d}"] = {
            "customer": n,
            "fare": round(10 + (n % 997) * 0.37, 2),
            "city": CITIES[n % len(CITIES)],
            "seats": [n % 3 + 1, n % 5],
            "vip": n % 11 == 0,
            "booked": f"2024-06-{n % 28 + 1:02d}T{n % 24:02d}:00:00Z",
        }
    return out


# -- Redis ----------------------------------------------------------------------------------------------


def redis_server(work: Path, name: str, *extra: str) -> tuple[subprocess.Popen[bytes], int]:
    """One redis-server on a free port, no persistence; its port once it answers PING."""
    port = free_port()
    folder = work / name
    folder.mkdir()
    args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    args += ["--dir", str(folder), *extra]
    with open(work / f"{name}.log", "ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait(lambda: proc.poll() is None and _redis_cli(port, "ping") == "PONG", 30, f"{name} answering")
    except SystemExit:
        stop(proc)
        raise RuntimeError(f"{name} did not start: {(work / f'{name}.log').read_text()[-2000:]}") from None
    return proc, port


def _redis_cli(port: int, *command: str) -> str:
    done = subprocess.run(
        ["redis-cli", "-h", "127.0.0.1", "-p", str(port), *command], capture_output=True, text=True, check=False
    )
    return done.stdout.strip()


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def one_redis(work: Path, data: dict[str, bytes]) -> Iterator[Read]:
    import redis

    proc, port = redis_server(work, "redis")
    client = redis.Redis(host="127.0.0.1", port=port)
    SERVER_PIDS["redis"] = [proc.pid]
    try:
        pipe = client.pipeline(transaction=False)
        for key, value in data.items():
            pipe.set(key, value)
        pipe.execute()
        get, loads = client.get, json.loads
        yield lambda key: loads(get(key))
    finally:
        client.close()
        stop(proc)


@contextmanager
def redis_cluster(work: Path, data: dict[str, bytes]) -> Iterator[Read]:
    """Three masters, slots split by redis-cli --cluster create, no replicas."""
    from redis.cluster import RedisCluster

    procs: list[subprocess.Popen[bytes]] = []
    try:
        ports = []
        for i in range(3):
            # The cluster bus on a free port of its own (by default the port + 10,000, which may be taken or
            # beyond 65,535).
            conf = ("--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{i}.conf")
            conf += ("--cluster-port", str(free_port()), "--cluster-node-timeout", "5000")
            proc, port = redis_server(work, f"redis-cluster-{i}", *conf)
            procs.append(proc)
            ports.append(port)
        create = ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports)]
        subprocess.run([*create, "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, check=True)
        wait(lambda: all("cluster_state:ok" in _redis_cli(p, "cluster", "info") for p in ports), 60, "cluster ok")
        client = RedisCluster(host="127.0.0.1", port=ports[0])
        SERVER_PIDS["redis cluster"] = [proc.pid for proc in procs]
        try:
            for key, value in data.items():
                client.set(key, value)
            get, loads = client.get, json.loads
            yield lambda key: loads(get(key))
        finally:
            client.close()
    finally:
        for proc in procs:
            stop(proc)


# -- keyroute -------------------------------------------------------------------------------------------


class Servers:
    """How keyroute's server processes (nodes, router) are run: `python -m keyroute` from this work tree (the
    venv's editable install, pure Python), or from a build installed with `pip install --target SITE` (the
    image's build: `KEYROUTE_COMPILE=1`, the read path compiled with mypyc), run from SITE with SITE first on
    PYTHONPATH, so that the work tree's sources do not shadow it. The client is this process's in both."""

    def __init__(self, site: Path | None = None, built: bool = False) -> None:
        self.site = site
        self.built = built  # the site was built by this run (--compiled), not given (--site)
        self.cwd = ROOT if site is None else site
        self.env = {**os.environ}
        if site is not None:
            self.env["PYTHONPATH"] = str(site)

    def describe(self) -> str:
        if self.site is None:
            return "this work tree's pure Python build (the venv's editable install)"
        where = "built by this run" if self.built else "as make test-compiled builds build/compiled/site"
        return (
            "this work tree compiled with mypyc as the image builds it, installed in SITE (`KEYROUTE_COMPILE=1 pip "
            f"install --no-deps --target SITE .`, {where})"
        )

    def start(self, args: list[str], log_path: Path) -> subprocess.Popen[bytes]:
        with open(log_path, "ab") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "keyroute", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.cwd,
                env=self.env,
            )

    def compiled_modules(self) -> list[str]:
        """The read path's modules the servers import as C extensions (none in the pure build)."""
        probe = (
            "import importlib, sys; "
            "print(' '.join(m for m in sys.argv[1:] if importlib.import_module(m).__file__.endswith('.so')))"
        )
        done = subprocess.run(
            [sys.executable, "-c", probe, *READ_PATH], cwd=self.cwd, env=self.env, capture_output=True, text=True
        )
        if done.returncode != 0:
            raise SystemExit(f"keyroute does not import from {self.cwd}: {done.stderr.strip()[-500:]}")
        return done.stdout.split()


# The modules of a read, from the socket to the answer, on the node and on the router (setup.py's COMPILED).
READ_PATH = ("keyroute.http.protocol", "keyroute.state_node.reads", "keyroute.router.proxy")


def write_snapshot(root: Path, data: dict[str, dict[str, Any]]) -> str:
    """The store's snapshot, written by hand in the snapshot format (JSON lines per partition)."""
    snapshot = version_dir(str(root), STORE, 1)
    per_partition: dict[int, list[tuple[str, Any]]] = {p: [] for p in range(PARTITIONS)}
    for text, value in data.items():
        key = parse_key(KeyFormat.STRING, text)
        per_partition[partition_for(Partitioner.MURMUR2, key.data, PARTITIONS)].append((key.text, value))
    for p, items in per_partition.items():
        folder = partition_dir(snapshot, p)
        folder.mkdir(parents=True)
        with open(folder / "part-00000.json", "w", encoding="utf-8") as fh:
            for text, value in sorted(items):
                fh.write(json.dumps({"key": text, "value": value}) + "\n")
    counts = tuple(len(per_partition[p]) for p in range(PARTITIONS))
    manifest = Manifest(STORE, 1, PARTITIONS, Partitioner.MURMUR2, KeyFormat.STRING, ("v",), counts)
    write_manifest(snapshot, manifest)
    return str(snapshot)


@contextmanager
def keyroute_cluster(
    work: Path, data: dict[str, dict[str, Any]], servers: Servers, nodes: int = 2
) -> Iterator[tuple[str, str]]:
    """ZooKeeper, `nodes` nodes and a router serving the store; yields ZooKeeper's connect string and the
    router's URL once every node serves."""
    procs: list[subprocess.Popen[bytes]] = []
    with EmbeddedZooKeeper(port=free_port(), data_dir=work / "zookeeper") as zk_server:
        settings = ZkSettings(hosts=zk_server.connect_string, chroot="/bench")
        record = StoreRecord(
            STORE, PARTITIONS, Partitioner.MURMUR2, KeyFormat.STRING, 1, write_snapshot(work / "snapshots", data)
        )
        client = zk.connect(settings)
        try:
            client.create(zk_layout.store_path(STORE), record.to_json(), makepath=True)
        finally:
            zk.close(client)
        connect = settings.connect_string
        try:
            node_ids = {f"n{i + 1}" for i in range(nodes)}
            for node_id in sorted(node_ids):
                node = ["node", "--zk", connect, "--node-id", node_id, "--port", str(free_port())]
                procs.append(servers.start([*node, "--data-dir", str(work / node_id)], work / f"{node_id}.log"))
            port = free_port()
            procs.append(servers.start(["router", "--zk", connect, "--port", str(port)], work / "router.log"))
            url = f"http://127.0.0.1:{port}"

            def served() -> bool:
                for proc in procs:
                    if proc.poll() is not None:
                        logs = "".join(p.read_text()[-1500:] for p in sorted(work.glob("*.log")))
                        raise SystemExit(f"a keyroute process exited with {proc.returncode}:\n{logs}")
                body = httpx.get(url + "/admin/partition-map?detail=all").json()
                placement = body["stores"][STORE]["partition_map"]
                placed = {s["node"] for e in placement for s in e["serving"]}
                return placed == node_ids and all(e["serving"] for e in placement)

            wait(served, 120, "every node serving", not_yet=(httpx.HTTPError, KeyError, ValueError))
            SERVER_PIDS["nodes"] = [proc.pid for proc in procs[:-1]]
            SERVER_PIDS["router"] = [procs[-1].pid]
            yield connect, url
        finally:
            for proc in reversed(procs):
                stop(proc)


@contextmanager
def keyroute_client(url: str, routing: str, transport: httpx.BaseTransport | None = None) -> Iterator[Read]:
    with Client(url, routing=routing, transport=transport) as client:
        get = client.get
        yield lambda key: get(STORE, key).value


@contextmanager
def bare_socket(url: str, routing: str) -> Iterator[Read]:
    """The floor under any HTTP client: a request prebuilt per key, one `sendall` and `recv`s on one kept-alive
    socket per server (to the key's node from the partition map, or to the router), the body found by its
    Content-Length and given to `json.loads`. What the servers alone take, with next to nothing of a client.
    A socket the server closed while other ways read (its keep-alive timeout) is opened again."""
    placement = httpx.get(url + "/admin/partition-map?detail=all").json()["stores"][STORE]["partition_map"]
    node_of = {entry["partition"]: entry["serving"][0]["url"] for entry in placement}
    socks: dict[str, socket.socket] = {}
    requests: dict[str, tuple[str, bytes]] = {}
    for key in rows():
        base = node_of[partition_for(Partitioner.MURMUR2, key.encode(), PARTITIONS)] if routing == "direct" else url
        requests[key] = (base, f"GET /stores/{STORE}/keys/{key} HTTP/1.1\r\nhost: {base[7:]}\r\n\r\n".encode())
    loads = json.loads

    def connect(base: str) -> socket.socket:
        host, port = base.removeprefix("http://").split(":")
        sock = socks[base] = socket.create_connection((host, int(port)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def read(key: str) -> Any:
        base, request = requests[key]
        sock = socks.get(base) or connect(base)
        try:
            sock.sendall(request)
            data = sock.recv(65536)
        except ConnectionError:
            data = b""
        if not data:  # closed while idle: once more on a new socket
            sock.close()
            sock = connect(base)
            sock.sendall(request)
            data = sock.recv(65536)
        while (end := data.find(b"\r\n\r\n")) < 0:
            data += _more(sock)
        at = data.find(b"content-length:")
        length = int(data[at + 15 : data.find(b"\r\n", at)])
        while len(data) < end + 4 + length:
            data += _more(sock)
        return loads(data[end + 4 :])["value"]

    try:
        yield read
    finally:
        for sock in socks.values():
            sock.close()


def _more(sock: socket.socket) -> bytes:
    data = sock.recv(65536)
    if not data:
        raise ConnectionError("the server closed the connection mid-answer")
    return data


# -- keyroute.local -------------------------------------------------------------------------------------
#
# The in-process replica's row: a context manager yielding a `Read` (say `replica.get(STORE, key).value`),
# made from the work folder, ZooKeeper's connect string (with the cluster's chroot) and the router's URL.
# Return it from `local_ways` under its row's name; `main` reads every way it returns, interleaved with the
# others, and `section` writes its row.


def local_ways(work: Path, zk_connect: str, router_url: str) -> dict[str, Callable[[], AbstractContextManager[Read]]]:
    """Ways of reading in the process itself (keyroute.local), by row name; none yet."""
    return {}


# -- measuring ------------------------------------------------------------------------------------------


def servers_cpu_s(kinds: tuple[str, ...]) -> list[float]:
    """CPU seconds so far of the server processes of each kind."""
    return [sum(cpu_s(pid) for pid in SERVER_PIDS.get(kind, ())) for kind in kinds]


class Tally:
    """One way's reads of one round: latencies, this process's CPU and its servers' CPU, added up over the
    round's slices."""

    def __init__(self, servers: tuple[str, ...]) -> None:
        self.servers = servers
        self.latencies: list[float] = []
        self.cpu_s = 0.0
        self.spent = [0.0] * len(servers)

    def measure(self, read: Read, keys: list[str]) -> None:
        latencies = self.latencies
        append = latencies.append
        clock = time.perf_counter
        before = servers_cpu_s(self.servers)
        cpu = time.process_time()
        for key in keys:
            start = clock()
            read(key)
            append(clock() - start)
        self.cpu_s += time.process_time() - cpu
        for i, (after, then) in enumerate(zip(servers_cpu_s(self.servers), before, strict=True)):
            self.spent[i] += after - then

    def figures(self) -> dict[str, float]:
        ordered = sorted(self.latencies)
        n = len(ordered)
        spent = self.spent
        return {
            "p50_us": statistics.median(ordered) * 1e6,
            "p99_us": ordered[min(n - 1, int(0.99 * n))] * 1e6,
            "cpu_us": self.cpu_s / n * 1e6,
            # the first server kind of the way (redis-server, the nodes) and the second (the router), per read
            "server_us": spent[0] / n * 1e6 if spent else 0.0,
            "router_us": spent[1] / n * 1e6 if len(spent) > 1 else 0.0,
        }


FIGURES = ("p50_us", "p99_us", "cpu_us", "server_us", "router_us")


def run(
    ways: dict[str, Read], data: dict[str, dict[str, Any]], reads: int, rounds: int, seed: int, slice_reads: int
) -> dict:
    """Every way reads the round's keys, slice by slice: each slice of `slice_reads` keys is read by every
    way in turn (the order rotating from slice to slice), so that what else the machine does meanwhile (a
    shared machine's load comes in bursts) falls on every way alike, not on whichever way was reading."""
    rng = random.Random(seed)
    names = sorted(data)
    results: dict[str, list[dict[str, float]]] = {way: [] for way in ways}
    warm = [rng.choice(names) for _ in range(300)]
    for read in ways.values():  # warm-up: connections, the direct client's map; the answers are the data
        for key in warm:
            assert read(key) == data[key], key
    names_of = list(ways)
    for _ in range(rounds):
        keys = [rng.choice(names) for _ in range(reads)]
        tallies = {way: Tally(WAY_SERVERS.get(way, ())) for way in ways}
        for n, at in enumerate(range(0, reads, slice_reads)):
            chunk = keys[at : at + slice_reads]
            shift = n % len(names_of)
            for way in names_of[shift:] + names_of[:shift]:
                tallies[way].measure(ways[way], chunk)
        for way, tally in tallies.items():
            results[way].append(tally.figures())
    for way, read in ways.items():  # the answers are still the data (outside the timed loops)
        for key in warm[:50]:
            assert read(key) == data[key], (way, key)
    return {
        way: {figure: statistics.median(r[figure] for r in rounds_of) for figure in FIGURES}
        for way, rounds_of in results.items()
    }


REDIS = "redis-py `GET` + `json.loads`, one redis-server"
CLUSTER = "redis-py `RedisCluster` `GET` + `json.loads`, 3 masters"
DIRECT = "keyroute `Client`, direct mode"
ROUTER = "keyroute `Client`, through a router"
# The same client with an httpx transport: every request through httpx, as every read went before the client
# had a wire of its own.
OVER_HTTPX = "keyroute `Client`, direct mode, over httpx (`transport=`)"
BARE_NODE = "bare socket to the key's node (a prebuilt request, no client)"
BARE_ROUTER = "bare socket to the router (a prebuilt request, no client)"
# Whose CPU each way's reads spend besides this process's: (the servers answering, the router in between).
WAY_SERVERS: dict[str, tuple[str, ...]] = {
    REDIS: ("redis",),
    CLUSTER: ("redis cluster",),
    DIRECT: ("nodes",),
    ROUTER: ("nodes", "router"),
    OVER_HTTPX: ("nodes",),
    BARE_NODE: ("nodes",),
    BARE_ROUTER: ("nodes", "router"),
}


def section(
    command: str,
    medians: dict[str, dict[str, float]],
    reads: int,
    rounds: int,
    servers: Servers,
    compiled: list[str],
    nodes: int,
    slice_reads: int,
) -> str:
    redis_version = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.split()
    import redis

    lines = [
        SECTION,
        "",
        f"`{command}` on {dt.date.today().isoformat()}. Machine: {os.cpu_count()} CPUs, {platform.machine()}, "
        f"Python {platform.python_version()}, Redis {redis_version[2].removeprefix('v=')} (Debian's "
        f"redis-server), redis-py {redis.__version__}; 1-minute load average {os.getloadavg()[0]:.1f} at the end. "
        f"{KEYS:,} keys with ~100-byte JSON values in every server; one Python process reading one key at a time; "
        f"{rounds} rounds of {reads:,} reads of random keys per way (the same keys for every way of a round), ways "
        f"interleaved every {slice_reads:,} reads (the order rotating); figures are medians over rounds. "
        f"keyroute: {nodes} node process{'es' if nodes > 1 else ''} and "
        f"one router process (a latest store of {PARTITIONS} partitions), {servers.describe()}"
        f"{' (C extensions: ' + ', '.join(compiled) + ')' if compiled else ''}. Client CPU = this process's CPU "
        "time per read (`time.process_time` around the loop; the servers run in other processes). Server CPU = "
        "the CPU time of the processes that answer (redis-server, the Redis Cluster's three, or the keyroute "
        "nodes) while the way reads, per read, from /proc (schedstat); router CPU the same of the router process.",
        "",
        "| read from Python | p50 µs | p99 µs | client CPU µs per get | p50 vs redis-py GET | CPU vs redis-py GET "
        "| server CPU µs per get | router CPU µs per get |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = medians[REDIS]
    for way, m in medians.items():
        router = f"{m['router_us']:,.1f}" if len(WAY_SERVERS.get(way, ())) > 1 else "—"
        server = f"{m['server_us']:,.1f}" if WAY_SERVERS.get(way) else "—"
        lines.append(
            f"| {way} | {m['p50_us']:,.0f} | {m['p99_us']:,.0f} | {m['cpu_us']:,.1f} | "
            f"{m['p50_us'] / base['p50_us']:.2f}x | {m['cpu_us'] / base['cpu_us']:.2f}x | {server} | {router} |"
        )
    verdicts = []
    if DIRECT in medians:
        d = medians[DIRECT]
        p50, cpu = d["p50_us"] / base["p50_us"], d["cpu_us"] / base["cpu_us"]
        verdicts.append(
            f"- direct mode: client CPU {cpu:.2f}x redis-py's GET (target <= 1.5x): "
            f"{'met' if cpu <= 1.5 else 'MISSED'}; p50 {p50:.2f}x (target <= 1.5x): "
            f"{'met' if p50 <= 1.5 else 'MISSED'}."
        )
    if BARE_NODE in medians and BARE_ROUTER in medians:
        node, router = medians[BARE_NODE]["p50_us"], medians[BARE_ROUTER]["p50_us"]
        verdicts.append(
            f"- the servers' floor: a bare socket with prebuilt requests reads in p50 {node:,.0f} µs from the key's "
            f"node ({node / base['p50_us']:.2f}x redis-py's GET) and {router:,.0f} µs through the router "
            f"({router / base['p50_us']:.2f}x): what no client can go below; the client adds "
            f"{medians[DIRECT]['p50_us'] - node:,.0f} µs to the first and {medians[ROUTER]['p50_us'] - router:,.0f} µs "
            "to the second."
        )
    if ROUTER in medians:
        p50 = medians[ROUTER]["p50_us"] / base["p50_us"]
        verdicts.append(
            f"- through a router: p50 {p50:.2f}x redis-py's GET (target <= 2x): {'met' if p50 <= 2 else 'MISSED'}."
        )
    return "\n".join([*lines, "", *verdicts, ""])


def write_section(text: str) -> None:
    import re

    current = RESULTS.read_text(encoding="utf-8") if RESULTS.exists() else "# Benchmark results\n"
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
    if pattern.search(current):
        updated = pattern.sub(lambda _: text + "\n", current, count=1).rstrip("\n") + "\n"
    else:
        updated = current.rstrip("\n") + "\n\n" + text
    RESULTS.write_text(updated, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reads", type=int, default=5000, help="reads per way and round (default: 5000)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default: 5)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--slice", type=int, default=100, help="reads each way makes before the next way reads (default: 100)"
    )
    parser.add_argument("--no-cluster", action="store_true", help="leave out the Redis Cluster row")
    parser.add_argument("--floor", action="store_true", help="add rows of bare sockets (what the servers take)")
    parser.add_argument("--httpx", action="store_true", help="add a row of the client over httpx, as before its wire")
    parser.add_argument(
        "--site",
        type=Path,
        help="run the nodes and the router from this installed build (say make test-compiled's build/compiled/site)",
    )
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="build this work tree as the image does (mypyc, a few minutes) and run the nodes and the router from it",
    )
    parser.add_argument("--nodes", type=int, default=2, help="keyroute nodes (default: 2)")
    parser.add_argument("--quick", action="store_true", help="3 rounds of 2,000 reads, no Redis Cluster row")
    parser.add_argument("--write", action="store_true", help=f"record the figures in {RESULTS.name}")
    args = parser.parse_args(argv)
    if args.quick:
        args.reads, args.rounds, args.no_cluster = min(args.reads, 2000), min(args.rounds, 3), True
    if args.reads < 100 or args.rounds < 1 or args.nodes < 1 or args.slice < 1:
        print("--reads must be at least 100, --rounds, --nodes and --slice at least 1", file=sys.stderr)
        return 1
    if args.site is not None and not (args.site / "keyroute").is_dir():
        print(f"--site {args.site}: no keyroute package installed there", file=sys.stderr)
        return 1
    given = list(sys.argv[1:] if argv is None else argv)
    for i, arg in enumerate(given):  # the site's folder is this machine's: SITE in what is recorded
        if arg == "--site" and i + 1 < len(given):
            given[i + 1] = "SITE"
        elif arg.startswith("--site="):
            given[i] = "--site=SITE"
    command = ".venv/bin/python benchmarks/vs_redis.py " + shlex.join(given)
    for tool in ("redis-server", "redis-cli"):
        if shutil.which(tool) is None:
            print(f"{tool} is not installed (Debian: apt-get install -y redis-server)", file=sys.stderr)
            return 1
    try:
        import redis  # noqa: F401
    except ImportError:
        print("redis-py is not installed: pip install -e '.[bench]'", file=sys.stderr)
        return 1
    data = rows()
    encoded = {key: json.dumps(value, separators=(",", ":")).encode() for key, value in data.items()}
    log(f"mean value size {statistics.mean(map(len, encoded.values())):.0f} bytes")
    work = Path(tempfile.mkdtemp(prefix="keyroute-vs-redis-"))
    try:
        site = args.site.resolve() if args.site is not None else None
        if args.compiled:
            from router import copy_work_tree, installed_build

            site = installed_build(
                copy_work_tree(work / "build" / "source"), work / "build" / "site", "compiled", "this work tree"
            ).cwd
        servers = Servers(site, built=args.compiled)
        compiled = servers.compiled_modules()
        log(f"servers: {servers.describe()}; compiled: {', '.join(compiled) or 'none'}")
        with ExitStack() as stack:
            ways: dict[str, Read] = {REDIS: stack.enter_context(one_redis(work, encoded))}
            if not args.no_cluster:
                ways[CLUSTER] = stack.enter_context(redis_cluster(work, encoded))
            connect, url = stack.enter_context(keyroute_cluster(work, data, servers, args.nodes))
            ways[DIRECT] = stack.enter_context(keyroute_client(url, "direct"))
            ways[ROUTER] = stack.enter_context(keyroute_client(url, "router"))
            if args.floor:
                ways[BARE_NODE] = stack.enter_context(bare_socket(url, "direct"))
                ways[BARE_ROUTER] = stack.enter_context(bare_socket(url, "router"))
            if args.httpx:
                ways[OVER_HTTPX] = stack.enter_context(keyroute_client(url, "direct", httpx.HTTPTransport()))
            for name, way in local_ways(work, connect, url).items():
                ways[name] = stack.enter_context(way())
            log("reading")
            medians = run(ways, data, args.reads, args.rounds, args.seed, args.slice)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = section(command.strip(), medians, args.reads, args.rounds, servers, compiled, args.nodes, args.slice)
    print(text)
    if args.write:
        write_section(text)
        log(f"wrote {SECTION!r} to {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
