"""What serving a key read costs on each data-plane server keyroute could run on: ours, granian's, uvicorn.

Run from the repository root: `.venv/bin/python benchmarks/servers.py [--rounds 5] [--duration-s 5] [--only a,c]
[--write]`.
It installs wrk with apt-get when missing (benchmarks/router.py's `ensure_tools`) and granian into the venv
with pip when missing (for this benchmark only: granian is no dependency of keyroute), then starts, on
127.0.0.1, one process per server, every one answering `GET /stores/s/keys/<k>` with the same fixed answer
(benchmarks/baselines/servers_answer.py: 120-byte JSON body, the six headers of a node's key read, date,
content-length, x-request-id):

- (a) keyroute.http.server.HttpServer, a DataPlane answering synchronously, on uvloop (`run()`);
- (b1) granian, RSGI interface (`proto.response_bytes`), 1 worker, one single-threaded Rust runtime, uvloop;
- (b2) granian, ASGI interface (a raw ASGI callable, no framework), the same settings;
- (c) uvicorn (today's server) with httptools and uvloop, the same raw ASGI callable.

Each round measures every server in turn (round-robin, the first server moving on by one each round, so
machine noise spreads over all of them): wrk -t1 -c32 (keep-alive) for --duration-s at saturation, where
the CPU seconds of the server's process tree (user + system, from /proc) per request are the cost of
serving; then wrk -t1 -c1 for the p50 latency of one request at a time. The figures are medians over the
rounds; the ratio is to (a). Every process started is stopped at the end, on errors and Ctrl-C too.
--only measures some of the servers (say `a,c`: ours against uvicorn, without installing granian; (a) is
always measured, as the ratios' base). --write (all four servers only) replaces (or adds) the section
"## Data-plane server (benchmarks/servers.py)" in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import harness  # benchmarks/harness.py: ports, ZooKeeper, waiting, RESULTS.md

bench = harness.script("router.py")

SECTION = "## Data-plane server (benchmarks/servers.py)"
ANSWER_SERVER = bench.BASELINES / "servers_answer.py"
GRANIAN_REQUIREMENT = "granian>=2.8,<3"
SATURATION_CONNECTIONS = 32
KEYS = 5_000


@dataclass(frozen=True)
class Server:
    label: str
    mode: str  # servers_answer.py's MODE
    what: str


SERVERS = (
    Server("a", "keyroute", "keyroute.http.server (asyncio.Protocol + httptools, sync DataPlane, uvloop)"),
    Server("b1", "granian-rsgi", "granian RSGI (`proto.response_bytes`)"),
    Server("b2", "granian-asgi", "granian ASGI (raw ASGI callable)"),
    Server("c", "uvicorn", "uvicorn + httptools + uvloop (raw ASGI callable)"),
)


@dataclass
class Measured:
    saturated: list[bench.Run] = field(default_factory=list)  # proxy_cpu_s: the server tree's CPU seconds
    single: list[bench.Run] = field(default_factory=list)
    answer_bytes: int = 0
    threads: int = 0

    def cpu_us(self, runs: list[bench.Run]) -> float:
        return statistics.median(r.proxy_cpu_s / r.requests * 1e6 for r in runs)

    def rate(self, runs: list[bench.Run]) -> float:
        return statistics.median(r.requests / r.duration_s for r in runs)

    def cores(self, runs: list[bench.Run]) -> float:
        """CPU seconds per second of wall time: how many cores the server's tree kept busy."""
        return statistics.median(r.proxy_cpu_s / r.duration_s for r in runs)

    def p50_us(self, runs: list[bench.Run]) -> float:
        return statistics.median(r.p50_us for r in runs)

    def errors(self) -> int:
        return sum(r.errors for r in (*self.saturated, *self.single))


# -- tools ----------------------------------------------------------------------------------------------------


def ensure_granian() -> None:
    """granian in this venv, for this benchmark only (never a project dependency)."""
    if importlib.util.find_spec("granian") is not None:
        return
    command = [sys.executable, "-m", "pip", "install", "--quiet", GRANIAN_REQUIREMENT]
    print(f"installing for this benchmark only: {' '.join(command)}", file=sys.stderr, flush=True)
    subprocess.run(command, check=True)
    importlib.invalidate_caches()


def versions() -> dict[str, str]:
    """Installed versions of the servers' packages (granian only when installed)."""
    found = {}
    for name in ("granian", "uvicorn", "httptools", "uvloop"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    return found


def wrk_version(wrk: str) -> str:
    out = subprocess.run([wrk, "-v"], capture_output=True, text=True).stdout.split()
    return out[1] if len(out) > 1 else "?"


# -- processes -------------------------------------------------------------------------------------------------


def start(server: Server, work: Path) -> bench.Service:
    port = harness.free_port()
    command = [sys.executable, str(ANSWER_SERVER), server.mode, str(port)]
    return bench.start_service(server.mode, command, work, f"http://127.0.0.1:{port}")


def stop_all(services: list[bench.Service]) -> None:
    """SIGTERM to each server, SIGKILL after 15 s; then SIGKILL to any process of its tree still alive
    (granian's worker, should its parent have been killed)."""
    trees = {}
    for service in services:
        tree, stats = bench._tree(service.popen.pid)
        trees[service.popen.pid] = {pid for pid in tree if pid in stats and pid != service.popen.pid}
    for service in services:
        try:
            service.stop()
        except Exception as exc:  # stop the others all the same
            print(f"stopping {service.name}: {exc}", file=sys.stderr)
    for children in trees.values():
        for pid in children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def raw_answer(url: str) -> bytes:
    """The whole answer to one key read on a fresh connection (headers and body), as the server wrote it."""
    host, _, port = url.removeprefix("http://").partition(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"GET /stores/s/keys/K000123 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                raise SystemExit(f"{url} closed the connection after {data!r}")
            data += chunk
            head, sep, body = data.partition(b"\r\n\r\n")
            if sep:
                length = next(
                    (
                        int(line.split(b":", 1)[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    None,
                )
                if length is not None and len(body) >= length:
                    return data


def check_answer(server: Server, url: str) -> int:
    """The answer's size in bytes, after checking it is the fixed answer (status, body, headers)."""
    sys.path.insert(0, str(ANSWER_SERVER.parent))
    try:
        import servers_answer
    finally:
        sys.path.pop(0)
    data = raw_answer(url)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    names = {line.split(b":", 1)[0].lower() for line in lines[1:]}
    wanted = {name for name, _ in servers_answer.HEADERS} | {b"content-length", b"date", b"x-request-id"}
    if not lines[0].startswith(b"HTTP/1.1 200") or body != servers_answer.BODY or not wanted <= names:
        raise SystemExit(f"{server.mode} answered something else:\n{data.decode('latin-1')}")
    return len(data)


def measure(
    wrk: str, script: Path, paths: Path, service: bench.Service, connections: int, duration_s: float, seed: int
) -> bench.Run:
    before = bench.tree_cpu_s(service.popen.pid)
    popen = bench.wrk_start(wrk, script, service.url, paths, connections, duration_s, seed)
    try:
        run = bench.wrk_result(popen)
    finally:
        if popen.poll() is None:
            popen.kill()
            popen.wait()
    run.proxy_cpu_s = bench.tree_cpu_s(service.popen.pid) - before
    if service.popen.poll() is not None:
        raise SystemExit(f"{service.name} exited; see {service.log}:\n{service.log.read_text()[-3000:]}")
    return run


# -- the run ---------------------------------------------------------------------------------------------------


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM unwinds like Ctrl-C: every server is stopped on the way out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default: 5)")
    parser.add_argument("--duration-s", type=float, default=5.0, help="seconds per wrk run (default: 5)")
    parser.add_argument(
        "--only",
        default=",".join(s.label for s in SERVERS),
        help="the servers to measure, by label, comma-separated (default: all; (a) is always measured)",
    )
    parser.add_argument("--write", action="store_true", help="record the figures in benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.duration_s <= 0:
        parser.error("--rounds must be >= 1 and --duration-s > 0")
    labels = {label.strip() for label in args.only.split(",") if label.strip()} | {SERVERS[0].label}
    unknown = labels - {s.label for s in SERVERS}
    if unknown:
        parser.error(f"--only: no server labelled {', '.join(sorted(unknown))}")
    servers = tuple(s for s in SERVERS if s.label in labels)
    if args.write and servers != SERVERS:
        parser.error("--write records all four servers: drop --only")

    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored
    started = time.monotonic()
    wrk, _nginx = bench.ensure_tools()
    if any(s.mode.startswith("granian") for s in servers):
        ensure_granian()
    work = Path(tempfile.mkdtemp(prefix="keyroute-servers-bench-"))
    script = work / "keyroute.lua"
    script.write_text(bench.WRK_SCRIPT)
    paths = work / "paths.txt"
    paths.write_text("".join(f"/stores/s/keys/{bench.key_text(i)}\n" for i in range(KEYS)))
    load_before = os.getloadavg()[0]
    measured = {server.mode: Measured() for server in servers}
    services: list[bench.Service] = []
    try:
        for server in servers:
            services.append(start(server, work))
        by_mode = {service.name: service for service in services}
        bench.wait_until(lambda: all(bench._listening(s.url) for s in services), 60, "every server to listen", services)
        for server in servers:
            service = by_mode[server.mode]
            measured[server.mode].answer_bytes = check_answer(server, service.url)
            measure(wrk, script, paths, service, SATURATION_CONNECTIONS, 1, 1)  # warm up
            measured[server.mode].threads = sum(
                len(os.listdir(f"/proc/{pid}/task"))
                for pid in bench._tree(service.popen.pid)[0]
                if os.path.isdir(f"/proc/{pid}/task")
            )
        for round_index in range(args.rounds):
            order = servers[round_index % len(servers) :] + servers[: round_index % len(servers)]
            for server in order:
                service = by_mode[server.mode]
                seed = 1 + round_index * 100 + servers.index(server)
                figures = measured[server.mode]
                figures.saturated.append(
                    measure(wrk, script, paths, service, SATURATION_CONNECTIONS, args.duration_s, seed)
                )
                figures.single.append(measure(wrk, script, paths, service, 1, args.duration_s, seed))
            print(
                f"round {round_index + 1}/{args.rounds}: "
                + ", ".join(
                    f"{s.label} {measured[s.mode].cpu_us(measured[s.mode].saturated[-1:]):.1f} µs" for s in servers
                ),
                file=sys.stderr,
                flush=True,
            )
    finally:
        stop_all(services)
        shutil.rmtree(work, ignore_errors=True)
    load = f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    text = section(servers, measured, args, harness.command(argv), wrk_version(wrk), load)
    print(text)
    print(f"took {time.monotonic() - started:.0f} s", file=sys.stderr)
    if args.write:
        harness.write_section(SECTION, text)
    return 0


# -- the report ------------------------------------------------------------------------------------------------


def section(
    servers: tuple[Server, ...],
    measured: dict[str, Measured],
    args: argparse.Namespace,
    command: str,
    wrk: str,
    load: str,
) -> str:
    v = versions()
    base = measured[SERVERS[0].mode]
    base_cpu = base.cpu_us(base.saturated)
    base_p50 = base.p50_us(base.single)
    lines = [
        SECTION,
        "",
        f"`{command}` on {datetime.date.today().isoformat()}. Machine: {platform.platform()}, {os.cpu_count()} CPUs,"
        f" Python {platform.python_version()}; granian {v.get('granian', 'not installed')}, uvicorn {v['uvicorn']},"
        f" httptools {v['httptools']}, uvloop {v['uvloop']}, wrk {wrk}; load average {load} (other work ran on the"
        " machine).",
        "",
        "Every server answers `GET /stores/s/keys/<k>` on 127.0.0.1 with the same fixed answer"
        " (benchmarks/baselines/servers_answer.py: 120-byte JSON body, content-type and five x-keyroute-*"
        " headers, plus content-length, date and x-request-id; granian adds `server: granian`). granian: 1"
        " worker, `--runtime-threads 1 --runtime-mode st --loop uvloop --http 1 --no-ws`. CPU = user + system"
        " seconds of the server's process tree (all its threads and workers) per request, with wrk -t1"
        f" -c{SATURATION_CONNECTIONS} keep-alive for {args.duration_s:g} s at saturation; p50 with wrk -t1 -c1"
        f" for {args.duration_s:g} s. Medians of {args.rounds} rounds, the servers round-robin within each round.",
        "",
        f"| server | CPU µs/request (c{SATURATION_CONNECTIONS}) | ratio to (a) | requests/s (c{SATURATION_CONNECTIONS})"
        f" | cores busy (c{SATURATION_CONNECTIONS}) | p50 µs (c1) | ratio to (a) | requests/s (c1)"
        " | CPU µs/request (c1) | answer bytes | threads | errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for server in servers:
        m = measured[server.mode]
        cpu, p50 = m.cpu_us(m.saturated), m.p50_us(m.single)
        lines.append(
            f"| ({server.label}) {server.what} | {cpu:.1f} | {cpu / base_cpu:.2f} | {m.rate(m.saturated):,.0f}"
            f" | {m.cores(m.saturated):.2f} | {p50:.0f} | {p50 / base_p50:.2f} | {m.rate(m.single):,.0f}"
            f" | {m.cpu_us(m.single):.1f}"
            f" | {m.answer_bytes} | {m.threads} | {m.errors()} |"
        )
    if servers == SERVERS:
        lines += ["", *reading(measured)]
    lines.append("")
    return "\n".join(lines)


def reading(measured: dict[str, Measured]) -> list[str]:
    cpu = {s.mode: measured[s.mode].cpu_us(measured[s.mode].saturated) for s in SERVERS}
    cores = {s.mode: measured[s.mode].cores(measured[s.mode].saturated) for s in SERVERS}
    p50 = {s.mode: measured[s.mode].p50_us(measured[s.mode].single) for s in SERVERS}
    label = {s.mode: f"({s.label}) {s.what.split(' (')[0]}" for s in SERVERS}
    ours, cheapest = SERVERS[0].mode, min(cpu, key=cpu.__getitem__)
    lines = []
    if cheapest == ours:
        runner_up = min((m for m in cpu if m != ours), key=cpu.__getitem__)
        lines.append(
            f"- Cheapest per request at saturation: {label[ours]}, {cpu[ours]:.1f} µs; the next, {label[runner_up]},"
            f" costs {cpu[runner_up]:.1f} µs ({cpu[runner_up] / cpu[ours]:.2f}x, {cpu[runner_up] - cpu[ours]:.1f} µs"
            " more per request)."
        )
    else:
        lines.append(
            f"- Cheapest per request at saturation: {label[cheapest]}, {cpu[cheapest]:.1f} µs,"
            f" {cpu[cheapest] / cpu[ours]:.2f}x {label[ours]} ({cpu[ours]:.1f} µs): {cpu[ours] - cpu[cheapest]:.1f} µs"
            " less per request."
        )
    lines.append(
        f"- granian RSGI costs {cpu['granian-rsgi'] / cpu[ours]:.2f}x (a), granian ASGI"
        f" {cpu['granian-asgi'] / cpu[ours]:.2f}x, today's uvicorn {cpu['uvicorn'] / cpu[ours]:.2f}x. Requests/s at"
        " saturation follow the CPU each server got on this shared machine (cores busy: (a)"
        f" {cores[ours]:.2f}, (b1) {cores['granian-rsgi']:.2f}, (b2) {cores['granian-asgi']:.2f}, (c)"
        f" {cores['uvicorn']:.2f}; granian's Rust I/O thread lets one process use more than one core), so CPU per"
        " request is the figure to compare."
    )
    fastest = min(p50, key=p50.__getitem__)
    lines.append(
        f"- One request at a time, p50: (a) {p50[ours]:.0f} µs, (b1) {p50['granian-rsgi']:.0f}, (b2)"
        f" {p50['granian-asgi']:.0f}, (c) {p50['uvicorn']:.0f}; the lowest is {label[fastest]}."
    )
    gap = cpu[ours] / cpu[cheapest] - 1
    if cheapest == ours:
        lines.append(
            "- For the choice: no server tried serves this answer for less CPU than our own, so the data plane"
            " stays on keyroute.http.server: a synchronous hand-off with no ASGI message, no task and no extra"
            " (compiled) dependency, its behaviour under our own tests."
        )
    elif gap <= 0.10:
        lines.append(
            f"- For the choice: {label[cheapest]} saves {gap:.0%} per request, within this machine's noise;"
            " that does not pay for a compiled dependency and an interface in place of our synchronous DataPlane"
            " hand-off, so the data plane stays on keyroute.http.server."
        )
    else:
        lines.append(
            f"- For the choice: {label[cheapest]} serves this answer for {gap:.0%} less CPU than our server;"
            " weigh that saving against a compiled dependency, its interface in place of our synchronous"
            " DataPlane hand-off, and its behaviour (limits, errors, pipelining) that our tests do not cover,"
            " before moving the data plane onto it."
        )
    return lines


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:
        print("interrupted: every server stopped", file=sys.stderr)
        raise SystemExit(130) from None
