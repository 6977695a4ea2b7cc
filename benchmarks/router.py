"""What a proxied read costs on a real cluster: direct, through keyroute's router, through nginx both ways.

Run from the repository root: `.venv/bin/python benchmarks/router.py [--write]`. It installs wrk and nginx
with apt-get when they are missing, builds a store without Spark, starts ZooKeeper, two nodes, a router,
nginx and two references (benchmarks/baselines/) on 127.0.0.1, measures with wrk, stops everything;
--write records the figures in benchmarks/RESULTS.md. Two tables: every setup at saturation, and every
setup at one equal, moderate rate (wrk paced), where the CPU a node spends per read compares like with like.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from keyroute.core import zk, zk_layout
from keyroute.core.key_format import KeyFormat
from keyroute.core.partition_map import StoreRecord
from keyroute.core.partitioner import Partitioner, partition_for
from keyroute.core.settings import ZkSettings
from keyroute.core.snapshot import Manifest, partition_dir, version_dir, write_manifest
from keyroute.core.zookeeper_server import EmbeddedZooKeeper

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SECTION = "## Router"
SUBSECTION = "### Cluster (wrk)"
STORE = "bench"
CHROOT = "/keyroute-bench"

# The targets (issue 5, "Done when").
TARGET_ROUTER_US = 120.0
TARGET_NODE_RATIO = 1.1
TARGET_ADDED_P50_US = 150.0
# What nginx's plain proxy hop, and a Starlette app's answer to a read, cost where the targets were set.
NGINX_REFERENCE_US = 20.0
STARLETTE_REFERENCE_US = 32.0

DIRECT = "a. direct to the owning node"
ROUTER = "b. keyroute router -> owner"
NGINX_RR = "c. nginx round-robin, nodes forward"
NGINX_OWNER = "d. nginx -> owner (client-side routing)"
BARE = "e. bare Python proxy -> owner (the floor for a Python hop)"
FRAMEWORK = "f. Starlette app, one fixed answer (no node, no store)"
# The equal-rate table compares (a) to (d); (e) and (f) are references measured at saturation only.
SCENARIOS = (DIRECT, ROUTER, NGINX_RR, NGINX_OWNER)
SATURATED_SCENARIOS = (*SCENARIOS, BARE, FRAMEWORK)
BASELINES = Path(__file__).resolve().parent / "baselines"

# Picks a random path from a file for every request, and prints wrk's summary as one parseable line.
WRK_SCRIPT = """
local paths = {}
function init(args)
  for line in io.lines(args[1]) do paths[#paths + 1] = line end
  math.randomseed(tonumber(args[2]))
end
function request()
  return wrk.format("GET", paths[math.random(#paths)])
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("KEYROUTE-WRK %d %d %d %d %d %d %d %d %d\\n", summary.requests, summary.duration,
    e.connect, e.read, e.write, e.status, e.timeout, latency:percentile(50), latency:percentile(99)))
end
"""

# Added to WRK_SCRIPT for a paced run: the thread sends args[3] requests per second over all its connections.
# Every request takes the next free slot of one schedule (wrk calls delay() before each request and waits
# that many ms), so the rate holds whatever the latency, as long as a connection is free for every slot;
# slots missed while all connections were busy are dropped, never made up in a burst.
WRK_PACING = """
local ffi = require("ffi")
ffi.cdef[[
typedef struct { long tv_sec; long tv_nsec; } keyroute_timespec;
int clock_gettime(int clock, keyroute_timespec *now);
]]
local now, interval_ms, next_ms = ffi.new("keyroute_timespec"), 0, 0
local function clock_ms()
  ffi.C.clock_gettime(1, now)  -- CLOCK_MONOTONIC
  return tonumber(now.tv_sec) * 1000 + tonumber(now.tv_nsec) / 1e6
end
local load_paths = init
function init(args)
  load_paths(args)
  interval_ms = 1000 / tonumber(args[3])
end
function delay()
  local t = clock_ms()
  local slot = math.max(next_ms, t)
  next_ms = slot + interval_ms
  return math.floor(slot - t + 0.5)
end
"""

NGINX_CONF = """
worker_processes 1;
{user}
pid {work}/nginx.pid;
error_log {work}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {work}/nginx-tmp/body;
  proxy_temp_path {work}/nginx-tmp/proxy;
  fastcgi_temp_path {work}/nginx-tmp/fastcgi;
  uwsgi_temp_path {work}/nginx-tmp/uwsgi;
  scgi_temp_path {work}/nginx-tmp/scgi;
  proxy_http_version 1.1;
  proxy_set_header Connection "";
  upstream every_node {{
{every_node}
    keepalive 64;
  }}
{per_node_upstreams}
  # (c) the seeds' architecture: any node, which forwards what it does not own.
  server {{
    listen 127.0.0.1:{rr_port};
    location / {{ proxy_pass http://every_node; }}
  }}
  # (d) the client put the owner in the path prefix; nginx strips it and passes the read on.
  server {{
    listen 127.0.0.1:{owner_port};
{per_node_locations}
  }}
}}
"""


# -- tools ----------------------------------------------------------------------------------------------


def find_tool(name: str) -> str | None:
    return shutil.which(name) or next(
        (str(p) for p in (Path("/usr/sbin") / name, Path("/usr/bin") / name) if p.exists()), None
    )


def ensure_tools() -> tuple[str, str]:
    """wrk and nginx, installed from Debian's packages when missing (a benchmark machine, not CI)."""
    missing = [name for name in ("wrk", "nginx") if find_tool(name) is None]
    if missing:
        if os.geteuid() != 0:
            raise SystemExit(f"missing {', '.join(missing)}: run `sudo apt-get install -y {' '.join(missing)}`")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for command in (
            ["apt-get", "update"],
            ["apt-get", "install", "-y", "--no-install-recommends", *missing],
        ):
            print(f"installing: {shlex.join(command)}", file=sys.stderr, flush=True)
            subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    wrk, nginx = find_tool("wrk"), find_tool("nginx")
    assert wrk is not None and nginx is not None
    return wrk, nginx


def tool_versions(wrk: str, nginx: str) -> str:
    nginx_v = subprocess.run([nginx, "-v"], capture_output=True, text=True).stderr.strip().split("/")[-1]
    wrk_v = subprocess.run([wrk, "-v"], capture_output=True, text=True).stdout.split()[1]
    return f"wrk {wrk_v}, nginx {nginx_v}"


# -- the store, written by hand in the snapshot format (no Spark) ----------------------------------------


def key_text(i: int) -> str:
    return f"K{i:06d}"


def write_store(root: Path, keys: int, partitions: int) -> tuple[str, list[int]]:
    """A snapshot of `keys` small JSON values; returns its location and each key's partition."""
    snapshot = version_dir(str(root), STORE, 1)
    owners = [partition_for(Partitioner.MURMUR2, key_text(i).encode(), partitions) for i in range(keys)]
    counts = [0] * partitions
    with ExitStack() as stack:
        files = []
        for p in range(partitions):
            folder = partition_dir(snapshot, p)
            folder.mkdir(parents=True)
            files.append(stack.enter_context(open(folder / "part-00000.json", "w")))
        for i, p in enumerate(owners):  # keys in ascending order, so each partition's file is sorted
            value = {"customer": i, "route": f"R{i % 7}", "fare": round(10 + (i % 1000) * 1.5, 2)}
            files[p].write(json.dumps({"key": key_text(i), "value": value}) + "\n")
            counts[p] += 1
    manifest = Manifest(STORE, 1, partitions, Partitioner.MURMUR2, KeyFormat.STRING, ("v",), tuple(counts))
    write_manifest(snapshot, manifest)
    return str(snapshot), owners


# -- processes --------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Service:
    name: str
    popen: subprocess.Popen[bytes]
    url: str
    log: Path

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def start_service(name: str, args: Sequence[str], work: Path, url: str) -> Service:
    log = work / f"{name}.log"
    with open(log, "ab") as out:
        popen = subprocess.Popen(
            list(args),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=ROOT,
            # Per-request logging would be measured as router/node CPU.
            env={**os.environ, "KEYROUTE_LOG_LEVEL": "WARNING"},
        )
    return Service(name, popen, url, log)


def _listening(url: str) -> bool:
    host, _, port = url.removeprefix("http://").partition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def http_json(url: str) -> tuple[int, object]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, None


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str, services: list[Service]) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        for service in services:
            if service.popen.poll() is not None:
                raise SystemExit(f"{service.name} exited; see {service.log}:\n{service.log.read_text()[-3000:]}")
        try:
            if predicate():
                return
        except OSError:
            pass
        if time.monotonic() >= deadline:
            raise SystemExit(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.2)


# -- CPU time of a process tree, from /proc ---------------------------------------------------------------

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()  # fields from the 3rd on: state, ppid, ...


def tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system, also of reaped children) of `root` and every live descendant."""
    parents: dict[int, int] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))) is not None:
            parents[int(entry)] = int(fields[1])
            stats[int(entry)] = fields
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier += children
    ticks = 0
    for pid in tree:
        fields = stats.get(pid)
        if fields is not None:  # utime, stime, cutime, cstime are the 14th-17th fields
            ticks += sum(int(v) for v in fields[11:15])
    return ticks / CLOCK_TICKS


# -- one wrk run ---------------------------------------------------------------------------------------------


@dataclass
class Run:
    requests: int = 0
    duration_s: float = 0.0
    errors: int = 0
    p50_us: float = 0.0
    p99_us: float = 0.0
    proxy_cpu_s: float = 0.0
    node_cpu_s: float = 0.0


def wrk_start(
    wrk: str,
    script: Path,
    url: str,
    paths: Path,
    concurrency: int,
    duration_s: float,
    seed: int,
    rate_per_s: float | None = None,
) -> subprocess.Popen[str]:
    """wrk as fast as it can, or paced to `rate_per_s` (then `script` must hold WRK_PACING)."""
    command = [wrk, "-t1", f"-c{concurrency}", f"-d{duration_s:g}s", "--timeout", "5s", "--latency"]
    command += ["-s", str(script), url, "--", str(paths), str(seed)]
    if rate_per_s is not None:
        command.append(f"{rate_per_s:g}")
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wrk_result(popen: subprocess.Popen[str]) -> Run:
    out, err = popen.communicate()
    if popen.returncode != 0:
        raise SystemExit(f"wrk failed ({popen.returncode}):\n{out}{err}")
    line = next((ln for ln in out.splitlines() if ln.startswith("KEYROUTE-WRK ")), None)
    if line is None:
        raise SystemExit(f"wrk printed no summary:\n{out}")
    requests, duration_us, *errors, p50, p99 = (int(v) for v in line.split()[1:])
    return Run(requests, duration_us / 1e6, sum(errors), float(p50), float(p99))


def wrk_run(
    wrk: str,
    script: Path,
    url: str,
    paths: Path,
    concurrency: int,
    duration_s: float,
    seed: int,
    rate_per_s: float | None = None,
) -> Run:
    return wrk_result(wrk_start(wrk, script, url, paths, concurrency, duration_s, seed, rate_per_s))


@dataclass
class Cluster:
    wrk: str
    script: Path
    nodes: dict[str, Service]
    router: Service
    nginx: Service
    rr_url: str
    owner_url: str
    files: dict[str, Path]
    paced_script: Path
    bare: Service
    framework: Service

    def measure(
        self, scenario: str, concurrency: int, duration_s: float, seed: int, rate_per_s: float | None = None
    ) -> Run:
        """One measurement. Unpaced, (a) runs one wrk per node in turn and adds the figures up; paced to a
        total `rate_per_s` over `concurrency` connections, it runs them at once, each with its share of
        both, so that every node sees the rate it sees behind a proxy."""
        if scenario == DIRECT:
            legs = [(node.url, self.files[name]) for name, node in self.nodes.items()]
        elif scenario == ROUTER:
            legs = [(self.router.url, self.files["all"])]
        elif scenario == NGINX_RR:
            legs = [(self.rr_url, self.files["all"])]
        elif scenario == BARE:
            legs = [(self.bare.url, self.files["all"])]
        elif scenario == FRAMEWORK:
            legs = [(self.framework.url, self.files["all"])]
        else:
            legs = [(self.owner_url, self.files["prefixed"])]
        proxies = {ROUTER: self.router, NGINX_RR: self.nginx, NGINX_OWNER: self.nginx, BARE: self.bare}
        proxy = proxies.get(scenario)
        # (f) answers by itself: its CPU is the "node" CPU of its row.
        nodes = [self.framework] if scenario == FRAMEWORK else list(self.nodes.values())
        total = Run()
        weighted_p50 = weighted_p99 = 0.0
        batches: list[list[tuple[str, Path, int, float | None]]]
        if rate_per_s is None:
            batches = [[(url, paths, concurrency, None)] for url, paths in legs]
        else:
            share = len(legs)
            batches = [[(url, paths, max(1, concurrency // share), rate_per_s / share) for url, paths in legs]]
        for batch in batches:
            before_nodes = sum(tree_cpu_s(n.popen.pid) for n in nodes)
            before_proxy = tree_cpu_s(proxy.popen.pid) if proxy else 0.0
            script = self.script if rate_per_s is None else self.paced_script
            started = [
                wrk_start(self.wrk, script, url, paths, connections, duration_s, seed + i, rate)
                for i, (url, paths, connections, rate) in enumerate(batch)
            ]
            runs = [wrk_result(popen) for popen in started]
            total.node_cpu_s += sum(tree_cpu_s(n.popen.pid) for n in nodes) - before_nodes
            total.proxy_cpu_s += (tree_cpu_s(proxy.popen.pid) - before_proxy) if proxy else 0.0
            total.duration_s += max(run.duration_s for run in runs)  # the legs of a batch run at the same time
            for run in runs:
                total.requests += run.requests
                total.errors += run.errors
                weighted_p50 += run.p50_us * run.requests
                weighted_p99 += run.p99_us * run.requests
        total.p50_us = weighted_p50 / max(1, total.requests)
        total.p99_us = weighted_p99 / max(1, total.requests)
        return total


@contextmanager
def running_cluster(args: argparse.Namespace, wrk: str, nginx: str, work: Path) -> Iterator[Cluster]:
    with ExitStack() as stack:
        print(f"writing {args.keys:,} keys in {args.partitions} partitions to {work}", file=sys.stderr)
        snapshot, partitions_of = write_store(work / "snapshots", args.keys, args.partitions)

        zk_server = EmbeddedZooKeeper(port=free_port(), data_dir=work / "zookeeper")
        zk_server.start()
        stack.callback(zk_server.stop)
        zk_settings = ZkSettings(hosts=zk_server.connect_string, chroot=CHROOT)
        client = zk.connect(zk_settings)
        stack.callback(zk.close, client)
        record = StoreRecord(
            STORE, args.partitions, Partitioner.MURMUR2, KeyFormat.STRING, 1, snapshot, ("v",), 1, time.time()
        )
        client.create(zk_layout.store_path(STORE), record.to_json())

        connect = zk_settings.connect_string
        keyroute = [sys.executable, "-m", "keyroute"]
        nodes: dict[str, Service] = {}
        for n in range(1, args.nodes + 1):
            name, port = f"n{n}", free_port()
            node = start_service(
                name,
                [*keyroute, "node", "--zk", connect, "--node-id", name, "--port", str(port)]
                + ["--data-dir", str(work / f"data-{name}")],
                work,
                f"http://127.0.0.1:{port}",
            )
            stack.callback(node.stop)
            nodes[name] = node
        port = free_port()
        router = start_service(
            "router",
            [*keyroute, "router", "--zk", connect, "--port", str(port)],
            work,
            f"http://127.0.0.1:{port}",
        )
        stack.callback(router.stop)
        services = [*nodes.values(), router]
        routers = [router]

        def router_map_complete() -> bool:
            for r in routers:
                status, body = http_json(r.url + "/admin/partition-map")
                if status != 200 or not isinstance(body, dict) or not body.get("complete"):
                    return False
            return True

        wait_until(
            lambda: all(http_json(n.url + "/readyz")[0] == 200 for n in nodes.values()),
            180,
            "the nodes to load their partitions",
            services,
        )
        wait_until(router_map_complete, 60, "the router's partition map to be complete", services)

        # Owners as the router sees them; with rf=1 each partition has exactly one.
        _, described = http_json(router.url + "/admin/partition-map")
        assert isinstance(described, dict)
        owner_of = [entry["serving"][0]["node"] for entry in described["stores"][STORE]["partition_map"]]
        print(
            "partitions per node: "
            + ", ".join(f"{n}: {owner_of.count(n)}" for n in nodes)
            + f"; load average {os.getloadavg()[0]:.1f}",
            file=sys.stderr,
        )

        files = write_key_files(work, args.keys, partitions_of, owner_of, list(nodes))
        rr_port, owner_port = free_port(), free_port()
        nginx_service = start_nginx(nginx, work, nodes, rr_port, owner_port)
        stack.callback(nginx_service.stop, signal.SIGQUIT)
        rr_url, owner_url = f"http://127.0.0.1:{rr_port}", f"http://127.0.0.1:{owner_port}"
        wait_until(lambda: http_json(rr_url + "/healthz")[0] == 200, 30, "nginx", [nginx_service])
        script, paced_script = work / "random-paths.lua", work / "paced-random-paths.lua"
        script.write_text(WRK_SCRIPT)
        paced_script.write_text(WRK_SCRIPT + WRK_PACING)
        routes = work / "bare-proxy-routes.json"
        routes.write_text(json.dumps({"partitions": args.partitions, "owners": [nodes[n].url for n in owner_of]}))
        bare_port, framework_port = free_port(), free_port()
        bare = start_service(
            "bare-proxy",
            [sys.executable, str(BASELINES / "bare_proxy.py"), str(routes), str(bare_port)],
            work,
            f"http://127.0.0.1:{bare_port}",
        )
        stack.callback(bare.stop)
        framework = start_service(
            "starlette-answer",
            [sys.executable, str(BASELINES / "starlette_answer.py"), str(framework_port)],
            work,
            f"http://127.0.0.1:{framework_port}",
        )
        stack.callback(framework.stop)
        wait_until(lambda: all(_listening(s.url) for s in (bare, framework)), 30, "the baselines", [bare, framework])
        cluster = Cluster(
            wrk, script, nodes, router, nginx_service, rr_url, owner_url, files, paced_script, bare, framework
        )
        check_answers(cluster)
        yield cluster


def write_key_files(
    work: Path, keys: int, partitions_of: list[int], owner_of: list[str], nodes: list[str]
) -> dict[str, Path]:
    """Request paths, one a line: all keys, each node's own keys, and all keys with the owner as prefix."""
    lines: dict[str, list[str]] = {"all": [], "prefixed": [], **{n: [] for n in nodes}}
    for i in range(keys):
        path = f"/stores/{STORE}/keys/{key_text(i)}"
        owner = owner_of[partitions_of[i]]
        lines["all"].append(path)
        lines[owner].append(path)
        lines["prefixed"].append(f"/{owner}{path}")
    files = {}
    for name, found in lines.items():
        files[name] = work / f"paths-{name}.txt"
        files[name].write_text("\n".join(found) + "\n")
    return files


def start_nginx(nginx: str, work: Path, nodes: dict[str, Service], rr_port: int, owner_port: int) -> Service:
    for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (work / "nginx-tmp" / sub).mkdir(parents=True, exist_ok=True)
    address = {name: node.url.removeprefix("http://") for name, node in nodes.items()}
    conf = NGINX_CONF.format(
        # As root, nginx would run its worker as `nobody`, who cannot read our temporary directory.
        user="user root;" if os.geteuid() == 0 else "",
        work=work,
        every_node="\n".join(f"    server {a};" for a in address.values()),
        per_node_upstreams="\n".join(
            f"  upstream owner_{name} {{ server {a}; keepalive 64; }}" for name, a in address.items()
        ),
        rr_port=rr_port,
        owner_port=owner_port,
        per_node_locations="\n".join(
            f"    location /{name}/ {{ proxy_pass http://owner_{name}/; }}" for name in address
        ),
    )
    path = work / "nginx.conf"
    path.write_text(conf)
    command = [nginx, "-p", str(work), "-e", str(work / "nginx-error.log"), "-c", str(path)]
    command += ["-g", "daemon off; master_process on;"]
    return start_service("nginx", command, work, f"http://127.0.0.1:{rr_port}")


def check_answers(cluster: Cluster) -> None:
    """Every way in gives the same answer for a few keys, so the timings compare like with like."""
    for path in cluster.files["prefixed"].read_text().splitlines()[::9973]:
        owner, plain = path.split("/", 2)[1], "/" + path.split("/", 2)[2]
        bodies = set()
        routers = [cluster.router.url]
        for url in (cluster.nodes[owner].url, *routers, cluster.rr_url, cluster.owner_url, cluster.bare.url):
            target = url + (path if url == cluster.owner_url else plain)
            status, body = http_json(target)
            if status != 200:
                raise SystemExit(f"GET {target} answered {status}")
            assert isinstance(body, dict)
            bodies.add(json.dumps(body["value"], sort_keys=True))
        if len(bodies) != 1:
            raise SystemExit(f"different answers for {plain}: {bodies}")


# -- measuring and reporting -------------------------------------------------------------------------------


@dataclass
class Figures:
    runs: list[Run] = field(default_factory=list)

    def median(self, what: Callable[[Run], float]) -> float:
        return statistics.median(what(r) for r in self.runs)

    @property
    def per_s(self) -> float:
        return self.median(lambda r: r.requests / r.duration_s)

    @property
    def p50_us(self) -> float:
        return self.median(lambda r: r.p50_us)

    @property
    def p99_us(self) -> float:
        return self.median(lambda r: r.p99_us)

    @property
    def proxy_us(self) -> float:
        return self.median(lambda r: r.proxy_cpu_s / r.requests * 1e6)

    @property
    def node_us(self) -> float:
        return self.median(lambda r: r.node_cpu_s / r.requests * 1e6)

    @property
    def errors(self) -> int:
        return sum(r.errors for r in self.runs)


def paced_rates(args: argparse.Namespace) -> dict[str, float]:
    """The total rate each scenario is paced to in the equal-rate table; (c) serves far fewer reads."""
    rates = {scenario: args.rate for scenario in SCENARIOS if scenario != NGINX_RR}
    if args.rr_rate > 0:
        rates[NGINX_RR] = args.rr_rate
    return {scenario: rates[scenario] for scenario in SCENARIOS if scenario in rates}


def measure(cluster: Cluster, args: argparse.Namespace) -> tuple[dict[tuple[str, int], Figures], dict[str, Figures]]:
    """Figures at saturation, per (scenario, concurrency), and at an equal rate, per scenario."""
    figures: dict[tuple[str, int], Figures] = {}
    paced: dict[str, Figures] = {}
    scenarios = list(SATURATED_SCENARIOS)
    rates = paced_rates(args)
    for scenario in scenarios:  # warm up every path: connections, caches, the nodes' LMDB pages
        cluster.measure(scenario, max(args.concurrency), 1.0, seed=1)
    rng = random.Random(20240229)
    for round_index in range(args.rounds):
        for concurrency in args.concurrency:
            order = list(scenarios)
            rng.shuffle(order)  # so slow drifts of the machine's load do not always hit the same scenario
            for scenario in order:
                run = cluster.measure(scenario, concurrency, args.duration, seed=rng.randrange(1, 1 << 30))
                figures.setdefault((scenario, concurrency), Figures()).runs.append(run)
        order = list(rates)
        rng.shuffle(order)
        for scenario in order:
            seed = rng.randrange(1, 1 << 30)
            run = cluster.measure(scenario, args.paced_connections, args.duration, seed, rates[scenario])
            paced.setdefault(scenario, Figures()).runs.append(run)
        print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    return figures, paced


def table(figures: dict[tuple[str, int], Figures]) -> str:
    lines = [
        "| setup | concurrency | requests/s | p50 ms | p99 ms | proxy CPU µs/request | node CPU µs/request | errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    order = SATURATED_SCENARIOS.index
    for (scenario, concurrency), f in sorted(figures.items(), key=lambda i: (i[0][1], order(i[0][0]))):
        proxy = "—" if scenario in (DIRECT, FRAMEWORK) else f"{f.proxy_us:,.0f}"
        lines.append(
            f"| {scenario} | {concurrency} | {f.per_s:,.0f} | {f.p50_us / 1000:.2f} | {f.p99_us / 1000:.2f}"
            f" | {proxy} | {f.node_us:,.0f} | {f.errors} |"
        )
    return "\n".join(lines)


def paced_table(paced: dict[str, Figures], rates: dict[str, float]) -> str:
    lines = [
        "| setup | target requests/s | requests/s | p50 ms | p99 ms | proxy CPU µs/request | node CPU µs/request"
        " | errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for scenario, f in sorted(paced.items(), key=lambda i: SCENARIOS.index(i[0])):
        proxy = "—" if scenario == DIRECT else f"{f.proxy_us:,.0f}"
        lines.append(
            f"| {scenario} | {rates[scenario]:,.0f} | {f.per_s:,.0f} | {f.p50_us / 1000:.2f} | {f.p99_us / 1000:.2f}"
            f" | {proxy} | {f.node_us:,.0f} | {f.errors} |"
        )
    return "\n".join(lines)


def rates_check(paced: dict[str, Figures], rates: dict[str, float], tolerance: float = 0.1) -> str:
    """One sentence: did every paced scenario reach its target rate, so that the CPU figures compare?"""
    deviation = {scenario: f.per_s / rates[scenario] - 1 for scenario, f in paced.items()}
    off = [scenario for scenario, d in deviation.items() if abs(d) > tolerance]
    if not off:
        largest = max(deviation.values(), key=abs)
        return f"Every setup reached its target rate within {tolerance:.0%} (largest deviation {largest:+.1%})."
    listed = "; ".join(f"{s}: {paced[s].per_s:,.0f} of {rates[s]:,.0f} requests/s" for s in off)
    return (
        f"**Off the target rate by more than {tolerance:.0%}**: {listed}. These do not compare with the"
        " others at an equal rate (a setup that cannot keep up is saturated, or the machine was busy)."
    )


def verdicts(
    figures: dict[tuple[str, int], Figures], concurrencies: list[int], paced: dict[str, Figures], rate: float
) -> list[str]:
    def verdict(ok: bool) -> str:
        return "**met**" if ok else "**missed**"

    low, high = min(concurrencies), max(concurrencies)
    direct, rr, nginx = figures[(DIRECT, high)], figures[(NGINX_RR, high)], figures[(NGINX_OWNER, high)]
    router = figures[(ROUTER, high)]
    ratio = paced[ROUTER].node_us / paced[DIRECT].node_us
    saturated_ratio = router.node_us / direct.node_us
    added = figures[(ROUTER, low)].p50_us - figures[(DIRECT, low)].p50_us
    beats = router.p99_us < rr.p99_us and router.node_us < rr.node_us
    bare, framework = figures[(BARE, high)], figures[(FRAMEWORK, high)]
    # How much dearer this machine is than the one the targets were set on, by two measures taken in
    # this run: nginx's plain hop, and a Starlette app's answer (the framework the nodes use).
    nginx_factor = nginx.proxy_us / NGINX_REFERENCE_US
    framework_factor = framework.node_us / STARLETTE_REFERENCE_US
    factor = min(nginx_factor, framework_factor)
    # The targets were set on a machine where nginx's plain proxy hop costs ~20 µs: the same ratio to (d)
    # measured in this run is the figure that does not depend on how busy this machine is.
    relative = router.proxy_us / nginx.proxy_us
    return [
        f"- Router CPU per proxied read (concurrency {high}): {router.proxy_us:,.0f} µs, target <="
        f" {TARGET_ROUTER_US:.0f}: {verdict(router.proxy_us <= TARGET_ROUTER_US)} (concurrency {low}:"
        f" {figures[(ROUTER, low)].proxy_us:,.0f} µs). Relative to nginx's plain proxy hop in the same run"
        f" (d, {nginx.proxy_us:,.0f} µs): {relative:.1f}x, where the target is {TARGET_ROUTER_US:.0f} /"
        f" {NGINX_REFERENCE_US:.0f} = {TARGET_ROUTER_US / NGINX_REFERENCE_US:.0f}x:"
        f" {verdict(relative <= TARGET_ROUTER_US / NGINX_REFERENCE_US)}.",
        f"- Node CPU per read via the router / direct at an equal {rate:,.0f} requests/s:"
        f" {ratio:.2f}x ({paced[ROUTER].node_us:,.0f} vs {paced[DIRECT].node_us:,.0f} µs), target"
        f" <= {TARGET_NODE_RATIO}x: {verdict(ratio <= TARGET_NODE_RATIO)}. Via nginx's plain hop (d) the same"
        f" ratio is {paced[NGINX_OWNER].node_us / paced[DIRECT].node_us:.2f}x. At saturation (concurrency"
        f" {high}) these ratios are {saturated_ratio:.2f}x and {nginx.node_us / direct.node_us:.2f}x, because"
        " there (a) floods one node at a time, which then serves many reads per event-loop wakeup, while"
        " behind a proxy each node gets reads at the proxy's pace, fewer per wakeup and so dearer each:"
        " that ratio measures the shape of the load, not the work a node does per read.",
        f"- Added p50 latency through the router at concurrency {low} over a direct read:"
        f" {added:,.0f} µs, target <= {TARGET_ADDED_P50_US:.0f}: {verdict(added <= TARGET_ADDED_P50_US)}"
        f" (nginx's plain hop: {figures[(NGINX_OWNER, low)].p50_us - figures[(DIRECT, low)].p50_us:,.0f} µs).",
        f"- keyroute (router) vs nginx round-robin with forwarding nodes (concurrency {high}): p99"
        f" {router.p99_us / 1000:.2f} vs {rr.p99_us / 1000:.2f} ms, node CPU {router.node_us:,.0f} vs"
        f" {rr.node_us:,.0f} µs/read: {verdict(beats)}.",
        f"- This machine against the one the targets were set on (concurrency {high}): nginx's plain hop costs"
        f" {nginx.proxy_us:,.0f} µs here against {NGINX_REFERENCE_US:.0f} there ({nginx_factor:.1f}x), a"
        f" Starlette app's answer (f) {framework.node_us:,.0f} µs against {STARLETTE_REFERENCE_US:.0f}"
        f" ({framework_factor:.1f}x). Divided by the smaller factor, the router's {router.proxy_us:,.0f} µs"
        f" would be ~{router.proxy_us / factor:,.0f} µs there (target {TARGET_ROUTER_US:.0f}).",
        f"- The floor for a proxy hop in Python on this machine (e: uvloop, httptools, callbacks only, no"
        f" metrics, request ids, admission, failover or timeouts): {bare.proxy_us:,.0f} µs/read; the router"
        f" costs {router.proxy_us / bare.proxy_us:.1f}x that.",
    ]


def router_client() -> str:
    """Which HTTP client the measured router uses for its data path, read from its source."""
    source = (ROOT / "router" / "app.py").read_text(encoding="utf-8")
    return "`FastUpstream`" if "FastUpstream" in source else "`HttpxUpstream` (httpx)"


def section(
    figures: dict[tuple[str, int], Figures],
    paced: dict[str, Figures],
    args: argparse.Namespace,
    command: str,
    versions: str,
    load: str,
) -> str:
    rates = paced_rates(args)
    own_rate = (
        f" ((c) at its own {args.rr_rate:,.0f} requests/s, as it serves far fewer)"
        if NGINX_RR in rates
        else " ((c), which serves far fewer, is left out)"
    )
    return "\n".join(
        [
            SUBSECTION,
            "",
            f"`{command}` on {datetime.date.today().isoformat()}: store of {args.keys:,} keys (~90-byte JSON"
            f" values) in {args.partitions} partitions, replication 1, on {args.nodes} nodes; one router"
            f" (data path: {router_client()}); one nginx worker. wrk, one thread, random keys over all"
            f" partitions, {args.duration:g} s per measurement, median of {args.rounds} rounds (scenario"
            " order shuffled per round). Every process, wrk included, shares the machine's cores.",
            f"Machine: {os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()},"
            f" {versions}; load average {load} (other work on the machine makes figures noisy).",
            "CPU µs/request = the process tree's user+system CPU time (/proc) during the run / requests;"
            " node CPU adds up every node. (a) and (d) need the owner of each key: (a) runs one wrk per node"
            " with that node's keys (figures summed, latencies request-weighted); in (d) the wrk"
            " script puts the owner in the path prefix (`/n1/stores/...`) and nginx strips it, so nginx"
            " does a plain proxy hop: the C-language reference for what a proxy hop costs. In (c) nginx"
            " spreads reads over every node and a node forwards what it does not own (one hop). A node"
            " that a slow proxy leaves half idle pays the event loop's per-wakeup costs for each read, so"
            " its CPU per read also rises with the proxy's slowness, not only with forwarding. Two references,"
            " at saturation only: (e) a bare Python proxy hop to the owner with nothing else"
            " (benchmarks/baselines/bare_proxy.py), the floor a Python hop does not go below; (f) a Starlette"
            " app answering every read with one fixed body (benchmarks/baselines/starlette_answer.py), which"
            " with (d) says how much dearer this machine is than the one the targets were set on.",
            "",
            "At saturation (wrk as fast as it can; (a) loads one node at a time):",
            "",
            table(figures),
            "",
            f"At an equal rate: wrk paced by its Lua `delay()` to {args.rate:,.0f} requests/s in all over"
            f" {args.paced_connections} connections{own_rate}, well below what each setup serves, so that"
            " nothing saturates; (a) loads both nodes at once, each with half the rate and half the"
            " connections, so every node sees the rate it sees behind a proxy. " + rates_check(paced, rates),
            "",
            paced_table(paced, rates),
            "",
            *verdicts(figures, args.concurrency, paced, args.rate),
            "",
        ]
    )


def write_subsection(text: str) -> None:
    """Replace this table inside the Router section of RESULTS.md, leaving everything else as it is."""
    current = RESULTS.read_text(encoding="utf-8") if RESULTS.exists() else "# Benchmark results\n"
    section_re = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
    found = section_re.search(current)
    body = found.group(0) if found else f"{SECTION}\n\n"
    sub_re = re.compile(rf"^{re.escape(SUBSECTION)}\n.*?(?=^### |\Z)", re.MULTILINE | re.DOTALL)
    if sub_re.search(body):
        body = sub_re.sub(lambda _: text.rstrip("\n") + "\n\n", body, count=1)
    else:
        body = body.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n\n"
    if found:
        updated = current[: found.start()] + body + current[found.end() :]
    else:
        updated = current.rstrip("\n") + "\n\n" + body
    RESULTS.write_text(updated.rstrip("\n") + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--keys", type=int, default=100_000, help="keys in the store (default: 100,000)")
    parser.add_argument("--partitions", type=int, default=12, help="partitions (default: 12)")
    parser.add_argument("--nodes", type=int, default=2, help="state nodes (default: 2)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32], help="wrk connections (1 32)")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement (default: 5)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default: 3)")
    parser.add_argument(
        "--rate", type=float, default=1000.0, help="requests/s in all for the equal-rate table (default: 1,000)"
    )
    parser.add_argument(
        "--rr-rate",
        type=float,
        default=200.0,
        help="requests/s for (c) in the equal-rate table, 0 to leave it out (default: 200)",
    )
    parser.add_argument(
        "--paced-connections", type=int, default=32, help="wrk connections in the equal-rate table (default: 32)"
    )
    parser.add_argument("--write", action="store_true", help=f"record the figures in {RESULTS.name}")
    parser.add_argument("--keep", action="store_true", help="keep the working directory (logs, configs)")
    args = parser.parse_args(argv)

    wrk, nginx = ensure_tools()
    versions = tool_versions(wrk, nginx)
    work = Path(tempfile.mkdtemp(prefix="keyroute-router-bench-"))
    load_before = os.getloadavg()[0]
    try:
        with running_cluster(args, wrk, nginx, work) as cluster:
            figures, paced = measure(cluster, args)
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    load = f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    text = section(figures, paced, args, _command(argv), versions, load)
    print(text)
    if args.write:
        write_subsection(text)
        print(f"wrote {SUBSECTION!r} under {SECTION!r} in {RESULTS}", file=sys.stderr)
    return 0


def _command(argv: list[str] | None) -> str:
    python = Path(sys.executable)
    if python.is_relative_to(Path.cwd()):
        python = python.relative_to(Path.cwd())
    script = Path(sys.argv[0])
    return shlex.join([str(python), str(script), *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
