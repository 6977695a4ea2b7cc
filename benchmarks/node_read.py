"""What one key read costs a node, against what one GET costs redis-server, in the same run.

Run from the repository root:

    .venv/bin/python benchmarks/node_read.py [--mode cpu|callgrind] [--builds pure,compiled] [--site DIR]

One ZooKeeper; per build of this work tree, one node in a chroot of its own holding a one-partition store
(the same small JSON values benchmarks/router.py writes); beside them one redis-server (Debian's package) on a
free port holding the same value under redis-benchmark's fixed key. Builds: `pure`, the venv's editable
install; `compiled`, this work tree as the image builds it (`KEYROUTE_COMPILE=1 pip install --no-deps --target
DIR`, about 2 min; `--site DIR` runs an earlier such DIR instead); `--other LABEL=DIR` adds a keyroute
installed with `--target DIR` (another revision, pure or compiled), measured in the same run.

    cpu        one fixed key over 32 keep-alive connections for `--duration` s: wrk against each node,
               `redis-benchmark -c 32 -t get` against redis-server, in a shuffled order per round; the
               server's user+system CPU (/proc, its whole process tree) per read answered, median of
               `--rounds` rounds, and each node's ratio to redis-server's
    callgrind  each node under `valgrind --tool=callgrind`, instrumented only while `--requests` reads of the
               fixed key run (concurrency 32): instructions per read, and the heaviest functions

Figures only: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import free_port  # noqa: E402
from router_profile import callgrind, callgrind_functions, load  # noqa: E402

from keyroute.cluster import zk, zk_layout  # noqa: E402
from keyroute.cluster.partition_map import StoreRecord  # noqa: E402
from keyroute.dev.zookeeper_server import EmbeddedZooKeeper  # noqa: E402
from keyroute.keys.key_format import KeyFormat  # noqa: E402
from keyroute.keys.partitioner import Partitioner  # noqa: E402
from keyroute.runtime.settings import ZkSettings  # noqa: E402
from router import (  # noqa: E402
    STORE,
    THIS_TREE,
    WRK_SCRIPT,
    Build,
    Service,
    copy_work_tree,
    http_json,
    installed_build,
    key_text,
    start_service,
    tree_cpu_s,
    wait_until,
    write_store,
    wrk_run,
)

KEY = 42  # the fixed key: key_text(KEY)
REDIS_KEY = "key:__rand_int__"  # what redis-benchmark's GET asks for without -r


def node_build(site: Path, label: str = "compiled") -> Build:
    """A build already installed in `site` (`--site`, `--other`), run from it with it first on PYTHONPATH."""
    return Build(label, site, {"PYTHONPATH": str(site)}, how=f"installed in {site}")


def start_node(build: Build, name: str, connect: str, work: Path, wrapper: list[str] | None = None) -> Service:
    port = free_port()
    args = ["node", "--zk", connect, "--node-id", name, "--port", str(port), "--data-dir", str(work / name)]
    command = [*(wrapper or []), build.python, "-m", "keyroute", *args]
    env = dict(build.env)
    if wrapper:  # under valgrind a node runs some fifty times slower
        env["KEYROUTE_ZK_SESSION_TIMEOUT_S"] = "60"
    return start_service(name, command, work, f"http://127.0.0.1:{port}", cwd=build.cwd, env=env)


def stored_value(snapshot: str) -> bytes:
    """The value of the fixed key as the node answers it (compact JSON), for redis-server to hold too."""
    import json

    for line in Path(snapshot).rglob("part-*.json"):
        for row in line.read_text().splitlines():
            record = json.loads(row)
            if record["key"] == key_text(KEY):
                return json.dumps(record["value"], separators=(",", ":")).encode()
    raise SystemExit("the fixed key is not in the store")


def start_redis(work: Path, value: bytes) -> tuple[subprocess.Popen[bytes], int]:
    server = shutil.which("redis-server")
    if server is None or shutil.which("redis-benchmark") is None:
        raise SystemExit("redis-server is not installed: apt-get install -y redis-server")
    port = free_port()
    popen = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(work)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).stdout.strip() != b"PONG":
        if time.monotonic() > deadline or popen.poll() is not None:
            raise SystemExit("redis-server did not start")
        time.sleep(0.1)
    subprocess.run(["redis-cli", "-p", str(port), "-x", "set", REDIS_KEY], input=value, check=True, capture_output=True)
    return popen, port


def redis_run(port: int, requests: int, concurrency: int) -> int:
    subprocess.run(
        ["redis-benchmark", "-p", str(port), "-c", str(concurrency), "-n", str(requests), "-t", "get", "-q"],
        check=True,
        capture_output=True,
    )
    return requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("cpu", "callgrind"), default="cpu")
    parser.add_argument("--builds", default="pure,compiled", help="comma-separated: pure, compiled")
    parser.add_argument("--site", help="a compiled build installed with --target DIR, instead of building one")
    parser.add_argument(
        "--other",
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="also measure the keyroute installed with --target DIR (another revision, pure or compiled) as LABEL",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds of wrk per node measurement")
    parser.add_argument("--redis-requests", type=int, default=300000, help="GETs per redis-server measurement")
    parser.add_argument("--requests", type=int, default=4000, help="reads per callgrind measurement")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    wanted = [b.strip() for b in args.builds.split(",") if b.strip()]
    if args.mode == "callgrind" and shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed: apt-get install valgrind")

    work = Path(tempfile.mkdtemp(prefix="keyroute-node-read-"))
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, work, True)
        builds: dict[str, Build] = {}
        for name in wanted:
            if name == "pure":
                builds[name] = THIS_TREE
            elif name == "compiled" and args.site:
                builds[name] = node_build(Path(args.site).resolve())
            elif name == "compiled":
                source = copy_work_tree(work / "build" / "source")
                builds[name] = installed_build(source, work / "build" / "site", "compiled", "this work tree")
            else:
                raise SystemExit(f"unknown build {name!r}")
        for other in args.other:
            label, _, site = other.partition("=")
            if not label or not site:
                raise SystemExit(f"--other {other!r}: LABEL=DIR")
            builds[label] = node_build(Path(site).resolve(), label)
        snapshot, _ = write_store(work / "snapshots", 1000, 1)
        zk_server = EmbeddedZooKeeper(port=free_port(), data_dir=work / "zookeeper")
        zk_server.start()
        stack.callback(zk_server.stop)
        nodes: dict[str, Service] = {}
        outs: dict[str, Path] = {}
        for name, build in builds.items():
            chroot = "/keyroute-node-read-" + "".join(c if c.isalnum() else "-" for c in name)
            settings = ZkSettings(hosts=zk_server.connect_string, chroot=chroot)
            client = zk.connect(settings)
            stack.callback(zk.close, client)
            record = StoreRecord(STORE, 1, Partitioner.MURMUR2, KeyFormat.STRING, 1, snapshot, ("v",), 1, time.time())
            client.create(zk_layout.store_path(STORE), record.to_json(), makepath=True)
            wrapper = None
            if args.mode == "callgrind":
                outs[name] = work / f"callgrind-{len(outs)}.out"
                wrapper = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={outs[name]}"]
            nodes[name] = start_node(build, f"node-{len(nodes)}", settings.connect_string, work, wrapper)
            stack.callback(nodes[name].stop)
        path = f"/stores/{STORE}/keys/{key_text(KEY)}"
        services = list(nodes.values())
        wait_until(
            lambda: all(http_json(n.url + path)[0] == 200 for n in nodes.values()), 900, "the nodes' reads", services
        )
        for node in nodes.values():
            load(int(node.url.rsplit(":", 1)[1]), [path] * 2000, args.concurrency)

        if args.mode == "callgrind":
            print(f"{args.requests:,} reads of one key per measurement, concurrency {args.concurrency}")
            tables: dict[str, dict[str, int]] = {}
            for name, node in nodes.items():
                pid = node.popen.pid
                callgrind(pid, "-z")
                callgrind(pid, "-i", "on")
                load(int(node.url.rsplit(":", 1)[1]), [path] * args.requests, args.concurrency)
                callgrind(pid, "-i", "off")
                callgrind(pid, "-d")
                dumps = sorted(work.glob(outs[name].name + "*"), key=lambda p: p.stat().st_mtime)
                tables[name] = callgrind_functions(dumps[-1])
            for name, table in tables.items():
                print(f"node, {name:24} {sum(table.values()) / args.requests:10,.0f} instructions/read")
            for name, table in tables.items():
                print(f"\n{name}: the heaviest functions, own instructions/read")
                for function in sorted(table, key=lambda f: -table[f])[: args.top]:
                    print(f"  {function[:76]:76} {table[function] / args.requests:9,.0f}")
            return

        value = stored_value(snapshot)
        redis, redis_port = start_redis(work, value)
        stack.callback(redis.wait)
        stack.callback(redis.terminate)
        script, path_file = work / "one-key.lua", work / "paths.txt"
        script.write_text(WRK_SCRIPT)
        path_file.write_text(path + "\n")
        wrk = shutil.which("wrk")
        if wrk is None:
            raise SystemExit("wrk is not installed: apt-get install -y wrk")
        figures: dict[str, list[tuple[float, float]]] = {name: [] for name in [*nodes, "redis-server"]}
        rng = random.Random(20261129)
        for _ in range(args.rounds):
            order = list(figures)
            rng.shuffle(order)
            for name in order:
                pid = redis.pid if name == "redis-server" else nodes[name].popen.pid
                before, started = tree_cpu_s(pid), time.monotonic()
                if name == "redis-server":
                    answered = redis_run(redis_port, args.redis_requests, args.concurrency)
                else:
                    run = wrk_run(wrk, script, nodes[name].url, path_file, args.concurrency, args.duration, 7)
                    if run.errors:
                        raise SystemExit(f"{run.errors} errors reading from the {name} node")
                    answered = run.requests
                spent, elapsed = tree_cpu_s(pid) - before, time.monotonic() - started
                figures[name].append((spent / answered * 1e6, answered / elapsed))
        redis_us = statistics.median(cpu for cpu, _ in figures["redis-server"])
        print(f"one fixed key, concurrency {args.concurrency}, {args.rounds} rounds (medians)")
        print(f"{'server':30} {'CPU µs/read':>12} {'reads/s':>10} {'vs redis':>9}  rounds (µs/read)")
        for name, values in figures.items():
            cpu = statistics.median(v for v, _ in values)
            rate = statistics.median(r for _, r in values)
            label = name if name == "redis-server" else f"node, {name}"
            rounds = ", ".join(f"{v:.1f}" for v, _ in values)
            print(f"{label:30} {cpu:12.1f} {rate:10,.0f} {cpu / redis_us:8.2f}x  {rounds}")


if __name__ == "__main__":
    main()
