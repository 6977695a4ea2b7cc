"""Where a proxied read's CPU goes in the router, this work tree's against a previous revision's, per read.

Run from the repository root:

    .venv/bin/python benchmarks/router_profile.py --previous 0fb0755 [--mode cpu|calls|callgrind]
    .venv/bin/python benchmarks/router_profile.py --compiled /path/to/venv/bin/python [--mode ...]
    .venv/bin/python benchmarks/router_profile.py --previous REV --shipped [--mode ...]

One ZooKeeper, one node (`--nodes`; this work tree's) holding a small store, and two routers in front: this work
tree's and REV's (a `git worktree`, run as benchmarks/router.py runs it; with `--shipped` both compiled with
mypyc as the image builds them, as benchmarks/router.py's default build does). A load generator in this process
sends exactly `--requests` key reads over `--concurrency` keep-alive connections to each router in turn
(after a warm-up), the same keys in the same order for both, so that every figure is per read:

    cpu        user+system CPU of the router process per read (/proc), median of `--rounds` rounds
    syscalls   the router under `strace -c -f`: system calls per read, by kind
    calls      the router under cProfile: Python calls per read, function by function (deterministic),
               and the functions whose count per read differs between the two routers
    callgrind  the router under `valgrind --tool=callgrind`, instrumented only while the reads run:
               instructions per read (deterministic to a few per cent), and the C functions that differ

Figures only: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pstats
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import harness  # benchmarks/harness.py: ports, ZooKeeper, waiting, RESULTS.md

sys.path.insert(0, str(Path(__file__).resolve().parent))

from router import (  # noqa: E402
    STORE,
    THIS_TREE,
    WRK_SCRIPT,
    Build,
    Service,
    compiled_build,
    http_json,
    key_text,
    published_store,
    revision_build,
    shipped_builds,
    wait_until,
    wrk_run,
)

# Under valgrind a router runs some fifty times slower: time-outs that a read would never reach otherwise.
SLOW_ROUTER_ENV = {"KEYROUTE_UPSTREAM_TIMEOUT_S": "120", "KEYROUTE_UPSTREAM_CONNECT_TIMEOUT_S": "30"}


def start(
    build: Build,
    name: str,
    args: list[str],
    work: Path,
    url: str,
    wrapper: list[str],
    env: dict[str, str] | None = None,
) -> Service:
    """`WRAPPER -m keyroute ARGS` of `build` (WRAPPER: the interpreter, maybe under a profiler)."""
    log = work / f"{name}.log"
    with open(log, "ab") as out:
        popen = subprocess.Popen(
            [*wrapper, "-m", "keyroute", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=build.cwd,
            env={**os.environ, **build.env, "KEYROUTE_LOG_LEVEL": "WARNING", **(env or {})},
        )
    return Service(name, popen, url, log)


# -- the load: exactly N reads over C keep-alive connections ---------------------------------------------------


async def _connection(port: int, requests: list[bytes]) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    bad = 0
    try:
        for request in requests:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200 "):
                bad += 1
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            await reader.readexactly(length)
    finally:
        writer.close()
    return bad


def load(port: int, paths: list[str], concurrency: int, tolerated: float = 0.0) -> None:
    """Every path read once, spread over `concurrency` connections; SystemExit if more than `tolerated` of
    the answers are not 200 (under valgrind, on a busy machine, a read may outlast the router's time-out)."""
    requests = [f"GET {p} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode() for p in paths]
    shares = [requests[i::concurrency] for i in range(concurrency)]

    async def main() -> int:
        return sum(await asyncio.gather(*(_connection(port, share) for share in shares)))

    bad = asyncio.run(main())
    if bad > tolerated * len(paths):
        raise SystemExit(f"{bad} of {len(paths)} reads through port {port} were not answered 200")
    if bad:
        print(f"warning: {bad} of {len(paths)} reads through port {port} were not answered 200", file=sys.stderr)


# -- the three ways to look ------------------------------------------------------------------------------------


def wrapper_of(mode: str, out: Path, python: str = sys.executable) -> list[str]:
    """The command line before `-m keyroute ...`: the interpreter, behind a profiler or under one."""
    if mode == "calls":
        return [python, "-m", "cProfile", "-o", str(out)]  # cProfile runs `-m keyroute` itself
    if mode == "syscalls":
        return ["strace", "-c", "-f", "-o", str(out), python]
    if mode == "callgrind":
        return ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}", python]
    return [python]


def callgrind(pid: int, *options: str) -> None:
    subprocess.run(["callgrind_control", *options, str(pid)], check=True, capture_output=True)


def callgrind_functions(path: Path) -> dict[str, int]:
    """Inclusive-free (self) instructions per function, from callgrind_annotate."""
    out = subprocess.run(
        ["callgrind_annotate", "--auto=no", "--threshold=100", str(path)], check=True, capture_output=True, text=True
    ).stdout
    functions: dict[str, int] = {}
    for line in out.splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2 and parts[0].replace(",", "").isdigit() and ":" in parts[1]:
            count = int(parts[0].replace(",", ""))
            where = parts[1].split(")", 1)[-1] if parts[1].startswith("(") else parts[1]
            file, _, function = where.split(" [")[0].strip().rpartition(":")
            name = f"{function} ({Path(file).name})"
            functions[name] = functions.get(name, 0) + count
    return functions


def profile_calls(path: Path, requests: int) -> dict[str, tuple[float, float]]:
    """Per read: (calls, own seconds) of every Python function, from a cProfile dump."""
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    table: dict[str, tuple[float, float]] = {}
    for (_file, _line, name), (_, calls, own, _, _) in stats.items():
        # By function name only: modules moved between revisions (the core package into keyroute/core/, one
        # server.py into protocol.py, ...), functions mostly kept their names.
        key = name
        previous = table.get(key, (0.0, 0.0))
        table[key] = (previous[0] + calls / requests, previous[1] + own / requests)
    return table


def user_system_s(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of one process (its threads included), from /proc."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2 :].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / ticks, int(fields[12]) / ticks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--previous", default="0fb0755", help="the revision whose router is compared")
    parser.add_argument(
        "--compiled",
        metavar="PYTHON",
        help="compare this work tree with itself compiled by mypyc (the interpreter of a venv holding"
        " `KEYROUTE_COMPILE=1 pip install .`) instead of with --previous",
    )
    parser.add_argument(
        "--shipped",
        action="store_true",
        help="both routers as the image ships them: this work tree and --previous each compiled with mypyc"
        " (`KEYROUTE_COMPILE=1 pip install --target`, about 1.5 min each on a quiet machine)",
    )
    parser.add_argument("--mode", choices=("cpu", "calls", "callgrind", "syscalls"), default="cpu")
    parser.add_argument("--requests", type=int, default=0, help="reads per measurement (default by mode)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5, help="rounds (cpu mode)")
    parser.add_argument("--keys", type=int, default=20000)
    parser.add_argument("--nodes", type=int, default=1, help="nodes holding the store's partitions")
    parser.add_argument("--wrk", action="store_true", help="cpu mode: load with wrk (5 s) instead of N reads")
    parser.add_argument("--top", type=int, default=40, help="rows of the per-function comparison")
    args = parser.parse_args()
    requests = args.requests or {"cpu": 40000, "calls": 20000, "callgrind": 4000, "syscalls": 20000}[args.mode]
    if args.mode == "callgrind" and shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed: apt-get install valgrind")

    work = Path(tempfile.mkdtemp(prefix="keyroute-router-profile-"))
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, work, True)
        settings, _ = published_store(stack, work, args.keys, 12)
        connect = settings.connect_string
        this, this_label = THIS_TREE, "this tree"
        if args.compiled:
            other, other_label = compiled_build(args.compiled, work), "compiled (mypyc)"
        elif args.shipped:
            pure = lambda rev: stack.enter_context(revision_build(rev, work))  # noqa: E731 (a REV with no COMPILED list)
            this, other = shipped_builds(args.previous, work, pure)
            this_label, other_label = "this tree (mypyc)", f"previous ({other.label})"
        else:
            other = stack.enter_context(revision_build(args.previous, work))
            other_label = f"previous ({other.label})"

        nodes = []
        for n in range(1, args.nodes + 1):
            port, name = harness.free_port(), f"n{n}"
            node = start(
                THIS_TREE,
                name,
                ["node", "--zk", connect, "--node-id", name, "--port", str(port), "--data-dir", str(work / name)],
                work,
                f"http://127.0.0.1:{port}",
                [sys.executable],
            )
            stack.callback(node.stop)
            nodes.append(node)
        routers: dict[str, tuple[Service, Path]] = {}
        for label, build in ((this_label, this), (other_label, other)):
            port, out = harness.free_port(), work / f"profile-{len(routers)}.out"
            router = start(
                build,
                f"router-{len(routers)}",
                ["router", "--zk", connect, "--port", str(port)],
                work,
                f"http://127.0.0.1:{port}",
                wrapper_of(args.mode, out, build.python),
                SLOW_ROUTER_ENV if args.mode == "callgrind" else None,
            )
            stack.callback(router.stop)
            routers[label] = (router, out)
        services = [*nodes, *(r for r, _ in routers.values())]
        wait_until(lambda: all(http_json(n.url + "/readyz")[0] == 200 for n in nodes), 180, "the nodes", services)
        wait_until(
            lambda: all(http_json(r.url + "/admin/partition-map")[1].get("complete") for r, _ in routers.values()),
            300,
            "the routers' maps",
            services,
        )
        rng = random.Random(20261127)
        paths = [f"/stores/{STORE}/keys/{key_text(rng.randrange(args.keys))}" for _ in range(requests)]
        warm = paths[: min(2000, requests)]
        for router, _ in routers.values():
            load(int(router.url.rsplit(":", 1)[1]), warm, args.concurrency, tolerated=0.01)

        print(f"{requests:,} reads per measurement, concurrency {args.concurrency}, mode {args.mode}")
        if args.mode == "cpu":
            wrk = shutil.which("wrk") or "wrk"
            script, path_file = work / "random-paths.lua", work / "paths.txt"
            script.write_text(WRK_SCRIPT)
            path_file.write_text("\n".join(paths) + "\n")
            # What each router spends with nothing to do (its threads and timers), per second.
            idle_before = {label: user_system_s(r.popen.pid) for label, (r, _) in routers.items()}
            time.sleep(10)
            for label, (r, _) in routers.items():
                now = user_system_s(r.popen.pid)
                spent = sum(now) - sum(idle_before[label])
                print(f"{label:24} idle: {spent / 10 * 1e3:.1f} ms CPU per second")
            figures: dict[str, list[tuple[float, float]]] = {label: [] for label in routers}
            for _ in range(args.rounds):
                order = list(routers)
                rng.shuffle(order)
                for label in order:
                    router = routers[label][0]
                    before = user_system_s(router.popen.pid)
                    if args.wrk:  # wrk as fast as it can for 5 s: reads per event-loop wakeup as in router.py
                        sent = wrk_run(wrk, script, router.url, path_file, args.concurrency, 5, 7).requests
                    else:
                        load(int(router.url.rsplit(":", 1)[1]), paths, args.concurrency)
                        sent = requests
                    after = user_system_s(router.popen.pid)
                    figures[label].append(((after[0] - before[0]) / sent * 1e6, (after[1] - before[1]) / sent * 1e6))
            for label, values in figures.items():
                totals = [u + s for u, s in values]
                print(
                    f"{label:24} {statistics.median(totals):7.1f} µs/read,"
                    f" user {statistics.median(u for u, _ in values):.1f},"
                    f" system {statistics.median(s for _, s in values):.1f} (rounds: "
                    + ", ".join(f"{v:.1f}" for v in totals)
                    + ")"
                )
            return

        if args.mode == "callgrind":
            totals: dict[str, int] = {}
            functions: dict[str, dict[str, int]] = {}
            for label, (router, out) in routers.items():
                callgrind(router.popen.pid, "-z")
                callgrind(router.popen.pid, "-i", "on")
                load(int(router.url.rsplit(":", 1)[1]), paths, args.concurrency, tolerated=0.01)
                callgrind(router.popen.pid, "-i", "off")
                callgrind(router.popen.pid, "-d")
                dumps = sorted(work.glob(out.name + "*"), key=lambda p: p.stat().st_mtime)
                functions[label] = callgrind_functions(dumps[-1])
                totals[label] = sum(functions[label].values())
            for label, total in totals.items():
                print(f"{label:24} {total / requests:10,.0f} instructions/read")
            compare(
                {k: {f: (n / requests, 0.0) for f, n in v.items()} for k, v in functions.items()},
                args.top,
                "instructions/read",
            )
            for label, table in functions.items():
                print(f"\n{label}: the heaviest functions, own instructions/read")
                for name in sorted(table, key=lambda n: -table[n])[: args.top]:
                    print(f"{name[:70]:70} {table[name] / requests:12,.0f}")
            return

        if args.mode == "syscalls":
            for label, (router, out) in routers.items():
                load(int(router.url.rsplit(":", 1)[1]), paths, args.concurrency)
                # strace writes its summary once the traced router (its child) has exited.
                children = Path(f"/proc/{router.popen.pid}/task/{router.popen.pid}/children").read_text().split()
                for child in children:
                    os.kill(int(child), signal.SIGTERM)
                router.popen.wait(timeout=60)
                print(f"\n{label}: system calls per read (strace -c -f, startup included)")
                for line in out.read_text().splitlines():
                    fields = line.split()
                    if len(fields) >= 5 and fields[3].isdigit() and fields[-1] != "total":
                        print(f"  {fields[-1]:24} {int(fields[3]) / (requests + len(warm)):8.2f}")
            return

        # calls: stop the routers so that cProfile writes its dumps. Startup and the warm-up are in them:
        # counts are divided by every read sent (warm-up included); startup's calls are few beside them.
        for router, _ in routers.values():
            load(int(router.url.rsplit(":", 1)[1]), paths, args.concurrency)
            router.stop(signal.SIGINT)
        sent = requests + len(warm)
        tables = {label: profile_calls(out, sent) for label, (_, out) in routers.items()}
        compare(tables, args.top, "calls/read")
        for label, (_, out) in routers.items():
            print(f"\n{label}: every function called at least once per two reads, by calls/read")
            stats = pstats.Stats(str(out)).stats  # type: ignore[attr-defined]
            for (file, line, name), (_, calls, _, _, _) in sorted(stats.items(), key=lambda kv: -kv[1][1]):
                if calls / sent >= 0.5:
                    print(f"  {calls / sent:6.2f}  {Path(file).parent.name}/{Path(file).name}:{line} {name}")


def compare(tables: dict[str, dict[str, tuple[float, float]]], top: int, unit: str) -> None:
    (new_label, new), (old_label, old) = tables.items()
    names = set(new) | set(old)
    per_read_new = sum(v[0] for v in new.values())
    per_read_old = sum(v[0] for v in old.values())
    print(f"\n{unit}: {new_label} {per_read_new:,.1f}, {old_label} {per_read_old:,.1f}")
    rows = sorted(names, key=lambda n: -abs(new.get(n, (0, 0))[0] - old.get(n, (0, 0))[0]))
    print(f"{'function':70} {new_label:>12} {old_label[:12]:>12} {'diff':>9}")
    for name in rows[:top]:
        a, b = new.get(name, (0.0, 0.0))[0], old.get(name, (0.0, 0.0))[0]
        if abs(a - b) < 0.05:
            break
        print(f"{name[:70]:70} {a:12.2f} {b:12.2f} {a - b:+9.2f}")
    if unit == "calls/read":
        print(f"\nown µs/read under cProfile (heaviest in {new_label}):")
        for name in sorted(new, key=lambda n: -new[n][1])[:top]:
            print(f"{name[:70]:70} {new[name][1] * 1e6:8.2f} {old.get(name, (0, 0))[1] * 1e6:8.2f}")


if __name__ == "__main__":
    main()
