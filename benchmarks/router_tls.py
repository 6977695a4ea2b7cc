"""What a proxied read costs over TLS: keyroute's router against nginx as a TLS proxy hop, side by side.

Run from the repository root: `.venv/bin/python benchmarks/router_tls.py [--write] [--rounds 5]` (`--quick`:
a smoke run of the plumbing, not figures). It makes a CA and certificates (trustme), builds a store without
Spark, starts ZooKeeper, two nodes serving HTTPS with mutual TLS between members (--member-ca), a router
serving HTTPS and reaching the nodes over mutual TLS, and nginx terminating the client's TLS and speaking
TLS to the owning node (presenting a member certificate, verifying the node's, keep-alive upstream
connections, sessions reused), all on 127.0.0.1; wrk reads random keys over HTTPS on kept-alive connections
through each in turn (the order alternating by round) and the CPU time of the router's and nginx's process
trees is read from /proc. --write records the figures in benchmarks/RESULTS.md ("Router over TLS").

`--build compiled` (the default) measures the router as it ships: this work tree built with mypyc as the image
builds it (`KEYROUTE_COMPILE=1 python -m pip install --no-deps --target DIR`, about 1.5 min; router.py's
helpers, which check that the read path's modules are DIR's C extensions), run from DIR; the editable install
(pure Python) is measured beside it at the highest concurrency. `--build pure`: the editable install only.
The nodes are the editable install either way.

Targets (issue 33): the router's CPU per proxied read at most 3x nginx's TLS hop's, and its p50 at
concurrency 1 at most nginx's TLS hop's plus 150 µs (both reach the same node for the same keys, so the
difference of their p50s is the difference of what each adds to a direct read).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import json
import os
import shutil
import signal
import ssl
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import harness  # benchmarks/harness.py: ports, ZooKeeper, waiting, RESULTS.md
import trustme

from keyroute.http.fast_upstream import FastUpstream
from keyroute.http.tls import MemberTls
from keyroute.runtime.settings import TlsSettings
from router import (  # benchmarks/router.py: the store, builds, processes, wrk and /proc readings
    RESULTS,
    STORE,
    THIS_TREE,
    WRK_SCRIPT,
    Build,
    Figures,
    Run,
    Service,
    copy_work_tree,
    ensure_tools,
    installed_build,
    published_store,
    start_service,
    tool_versions,
    tree_cpu_s,
    wait_until,
    write_key_files,
    wrk_run,
)

SECTION = "## Router over TLS (benchmarks/router_tls.py)"
ROUTER = "keyroute router (HTTPS in, mutual TLS to the owner)"
NGINX = "nginx TLS hop (HTTPS in, TLS with a client certificate to the owner)"
# With --build compiled: this work tree pure (the editable install), at the highest concurrency only.
PURE = "keyroute router, this work tree pure Python (HTTPS in, mutual TLS to the owner)"
SCENARIOS = (ROUTER, PURE, NGINX)
TARGET_VS_NGINX = 3.0
TARGET_P50_OVER_NGINX_US = 150.0

NGINX_TLS_CONF = """
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
  proxy_ssl_certificate {member_cert};
  proxy_ssl_certificate_key {member_key};
  proxy_ssl_trusted_certificate {ca};
  proxy_ssl_verify on;
  proxy_ssl_name localhost;
  proxy_ssl_session_reuse on;
  proxy_ssl_protocols TLSv1.2 TLSv1.3;
{upstreams}
  # The client put the owner in the path prefix; nginx strips it and passes the read on over TLS.
  server {{
    listen 127.0.0.1:{port} ssl;
    ssl_certificate {cert};
    ssl_certificate_key {key};
    ssl_protocols TLSv1.2 TLSv1.3;
    ssl_session_cache shared:tls:1m;
{locations}
  }}
}}
"""


class Pki:
    """The cluster's CA and the certificates of the run, as files in `work`."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.ca = trustme.CA()
        self.ca_file = str(work / "ca.pem")
        self.ca.cert_pem.write_to_path(self.ca_file)

    def issue(self, name: str, *identities: str) -> tuple[str, str]:
        issued = self.ca.issue_cert(*identities)
        cert, key = self.work / f"{name}.crt", self.work / f"{name}.key"
        issued.cert_chain_pems[0].write_to_path(str(cert))
        issued.private_key_pem.write_to_path(str(key))
        return str(cert), str(key)


def https_json(url: str, ca: str, cert: tuple[str, str]) -> tuple[int, Any]:
    """GET over HTTPS (the cluster's CA trusted, `cert` presented): the status and the JSON body."""
    context = ssl.create_default_context(cafile=ca)
    context.load_cert_chain(*cert)
    try:
        with urllib.request.urlopen(url, timeout=5, context=context) as response:
            return int(response.status), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, None


def https_status(url: str, ca: str, cert: tuple[str, str]) -> int:
    return https_json(url, ca, cert)[0]


def start_nginx(nginx: str, work: Path, pki: Pki, nodes: dict[str, Service], port: int) -> Service:
    for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (work / "nginx-tmp" / sub).mkdir(parents=True, exist_ok=True)
    cert, key = pki.issue("nginx", "127.0.0.1", "localhost")
    member_cert, member_key = pki.issue("nginx-member", "keyroute-router.nginx.bench")
    address = {name: node.url.removeprefix("https://") for name, node in nodes.items()}
    conf = NGINX_TLS_CONF.format(
        # As root, nginx would run its worker as `nobody`, who cannot read our temporary directory.
        user="user root;" if os.geteuid() == 0 else "",
        work=work,
        member_cert=member_cert,
        member_key=member_key,
        ca=pki.ca_file,
        cert=cert,
        key=key,
        port=port,
        upstreams="\n".join(f"  upstream owner_{n} {{ server {a}; keepalive 64; }}" for n, a in address.items()),
        locations="\n".join(f"    location /{n}/ {{ proxy_pass https://owner_{n}/; }}" for n in address),
    )
    path = work / "nginx.conf"
    path.write_text(conf)
    command = [nginx, "-p", str(work), "-e", str(work / "nginx-error.log"), "-c", str(path)]
    command += ["-g", "daemon off; master_process on;"]
    return start_service("nginx", command, work, f"https://127.0.0.1:{port}")


def measure(
    args: argparse.Namespace, wrk: str, nginx: str, work: Path
) -> tuple[dict[tuple[str, int], Figures], dict[str, list[tuple[float, float, float]]], Build]:
    """Figures per (scenario, concurrency), what new member connections cost, and the router's build."""
    figures: dict[tuple[str, int], Figures] = {}
    with ExitStack() as stack:
        build = THIS_TREE
        if args.build == "compiled":
            build = installed_build(
                copy_work_tree(work / "build-new" / "source"), work / "build-new" / "site", "mypyc", "this work tree"
            )
        pki = Pki(work)
        print(f"writing {args.keys:,} keys in {args.partitions} partitions to {work}", file=sys.stderr)
        zk_settings, partitions_of = published_store(stack, work, args.keys, args.partitions)

        connect = zk_settings.connect_string
        keyroute = [sys.executable, "-m", "keyroute"]
        nodes: dict[str, Service] = {}
        for n in range(1, args.nodes + 1):
            name, port = f"n{n}", harness.free_port()
            cert, key = pki.issue(name, "127.0.0.1", "localhost", f"keyroute-node.{name}.bench")
            tls = ["--tls-cert", cert, "--tls-key", key, "--member-ca", pki.ca_file]
            node = start_service(
                name,
                [*keyroute, "node", "--zk", connect, "--node-id", name, "--port", str(port), *tls]
                + ["--data-dir", str(work / f"data-{name}")],
                work,
                f"https://127.0.0.1:{port}",
            )
            stack.callback(node.stop)
            nodes[name] = node
        cert, key = pki.issue("router", "127.0.0.1", "localhost", "keyroute-router.r1.bench")
        tls = ["--tls-cert", cert, "--tls-key", key, "--member-ca", pki.ca_file, "--router-id", "r1"]

        def start_router(name: str, of: Build) -> Service:
            port = harness.free_port()
            service = of.start(
                name, ["router", "--zk", connect, "--port", str(port), *tls], work, f"https://127.0.0.1:{port}"
            )
            stack.callback(service.stop)
            return service

        router = start_router("router", build)
        routers = [router]
        if build is not THIS_TREE:
            routers.append(start_router("router-pure", THIS_TREE))
        probe = pki.issue("probe", "probe.example")
        services = [*nodes.values(), *routers]
        wait_until(
            lambda: all(https_status(n.url + "/readyz", pki.ca_file, probe) == 200 for n in nodes.values()),
            180,
            "the nodes to load their partitions",
            services,
        )
        wait_until(
            lambda: all(https_status(r.url + "/readyz", pki.ca_file, probe) == 200 for r in routers),
            60,
            "the routers",
            services,
        )
        # Owners as the router sees them; with one replica each partition has exactly one.
        _, described = https_json(router.url + "/admin/partition-map?detail=all", pki.ca_file, probe)
        owner_of = [entry["serving"][0]["node"] for entry in described["stores"][STORE]["partition_map"]]
        files = write_key_files(work, args.keys, partitions_of, owner_of, list(nodes))
        nginx_port = harness.free_port()
        proxy = start_nginx(nginx, work, pki, nodes, nginx_port)
        stack.callback(proxy.stop, signal.SIGQUIT)
        sample = files["prefixed"].read_text().splitlines()[0]
        wait_until(lambda: https_status(proxy.url + sample, pki.ca_file, probe) == 200, 30, "nginx", [proxy])
        script = work / "random-paths.lua"
        script.write_text(WRK_SCRIPT)
        targets = {ROUTER: (router, router.url, files["all"]), NGINX: (proxy, proxy.url, files["prefixed"])}
        if len(routers) > 1:
            targets[PURE] = (routers[1], routers[1].url, files["all"])
            # Measured at the highest concurrency only, it would otherwise meet its first client connections,
            # and open its first member connections, inside a measurement: one warm-up run, not counted.
            wrk_run(wrk, script, routers[1].url, files["all"], max(args.concurrency), 1.0, seed=0)
        for round_ in range(args.rounds):
            for concurrency in args.concurrency:
                present = [s for s in SCENARIOS if s in targets and (s != PURE or concurrency == max(args.concurrency))]
                order = present if round_ % 2 == 0 else present[::-1]
                for scenario in order:
                    service, url, paths = targets[scenario]
                    before = tree_cpu_s(service.popen.pid)
                    run: Run = wrk_run(wrk, script, url, paths, concurrency, args.duration, seed=round_)
                    run.proxy_cpu_s = tree_cpu_s(service.popen.pid) - before
                    figures.setdefault((scenario, concurrency), Figures()).runs.append(run)
                    print(
                        f"round {round_ + 1} c={concurrency} {scenario[:14]}: {run.requests / run.duration_s:,.0f}/s"
                        f" p50 {run.p50_us:,.0f} µs, {run.proxy_cpu_s / max(run.requests, 1) * 1e6:,.0f} µs CPU/read"
                        f", errors {run.errors}",
                        file=sys.stderr,
                    )
        first = next(iter(nodes))
        own_key = files[first].read_text().splitlines()[0]
        figures_of_connections = connections(nodes[first], own_key, pki, args)
    return figures, figures_of_connections, build


FULL = "full handshake (no session offered)"
RESUMED = "resumed session (what members do)"


def connections(
    node: Service, path: str, pki: Pki, args: argparse.Namespace
) -> dict[str, list[tuple[float, float, float]]]:
    """What a new member connection to a node costs, a full handshake against a resumed one: per round and
    way, (this process's CPU s, the node's CPU s, the median of connect + one read of `path` in s) over
    `args.connections` connections made one after another, each by a new FastUpstream."""
    cert, key = pki.issue("member-client", "keyroute-router.bench.bench")
    resuming = MemberTls(TlsSettings(cert=cert, key=key, member_ca=pki.ca_file), "benchmark")
    plain = ssl.create_default_context(cafile=pki.ca_file)
    plain.load_cert_chain(cert, key)
    ways: dict[str, Callable[[str], ssl.SSLContext]] = {FULL: lambda origin: plain, RESUMED: resuming}

    async def connect_and_read(tls: Callable[[str], ssl.SSLContext]) -> tuple[float, float, float]:
        walls = []
        cpu, node_cpu = time.process_time(), tree_cpu_s(node.popen.pid)
        for _ in range(args.connections):
            wire = FastUpstream(5.0, 5.0, tls=tls)
            started = time.perf_counter()
            reply = await wire.get(node.url + path, {})
            walls.append(time.perf_counter() - started)
            await wire.aclose()
            assert reply.status == 200, reply.status
        return time.process_time() - cpu, tree_cpu_s(node.popen.pid) - node_cpu, statistics.median(walls)

    run_loop: Callable[..., tuple[float, float, float]] = asyncio.run
    if importlib.util.find_spec("uvloop") is not None:  # what routers and nodes run on
        run_loop = importlib.import_module("uvloop").run
    results: dict[str, list[tuple[float, float, float]]] = {FULL: [], RESUMED: []}
    for round_ in range(args.rounds):
        for way in (FULL, RESUMED) if round_ % 2 == 0 else (RESUMED, FULL):
            results[way].append(run_loop(connect_and_read(ways[way])))
            cpu, node_cpu, wall = results[way][-1]
            print(
                f"round {round_ + 1} {way[:14]}: {cpu / args.connections * 1e6:,.0f} µs CPU here,"
                f" {node_cpu / args.connections * 1e6:,.0f} µs on the node, p50 {wall * 1e6:,.0f} µs",
                file=sys.stderr,
            )
    return results


def section(
    figures: dict[tuple[str, int], Figures],
    made: dict[str, list[tuple[float, float, float]]],
    args: argparse.Namespace,
    command: str,
    versions: str,
    build: Build = THIS_TREE,
) -> str:
    low, high = min(args.concurrency), max(args.concurrency)
    names = {ROUTER: "keyroute router, compiled (mypyc) (HTTPS in, mutual TLS to the owner)"} if build.compiled else {}
    rows = [
        "| setup | concurrency | requests/s | p50 µs | p99 µs | proxy CPU µs/read | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for concurrency in args.concurrency:
        for scenario in SCENARIOS:
            if (scenario, concurrency) not in figures:
                continue
            f = figures[(scenario, concurrency)]
            rows.append(
                f"| {names.get(scenario, scenario)} | {concurrency} | {f.per_s:,.0f} | {f.p50_us:,.0f} |"
                f" {f.p99_us:,.0f} | {f.proxy_us:,.0f} | {f.errors} |"
            )
    if build.compiled:
        built = (
            f"The router is this work tree as it ships, {build.how}; beside it, at concurrency {high} only, the"
            " same tree pure Python (the venv's editable install), which the nodes also run."
        )
    else:
        built = "The router and the nodes are this work tree's pure Python build (the venv's editable install)."
    router, nginx = figures[(ROUTER, high)], figures[(NGINX, high)]
    ratio = router.proxy_us / nginx.proxy_us
    p50_router, p50_nginx = figures[(ROUTER, low)].p50_us, figures[(NGINX, low)].p50_us

    def verdict(ok: bool) -> str:
        return "**met**" if ok else "**not met**"

    shipped = ", compiled (mypyc) as it ships" if build.compiled else ""
    pure_line = []
    if (PURE, high) in figures:
        pure = figures[(PURE, high)]
        pure_line = [
            f"- This work tree pure Python at concurrency {high}: {pure.proxy_us:,.0f} µs CPU per proxied read"
            f" ({pure.proxy_us / nginx.proxy_us:.1f}x nginx's TLS hop), {pure.per_s:,.0f} requests/s; compiled:"
            f" {router.proxy_us:,.0f} µs ({router.proxy_us / pure.proxy_us - 1:+.0%}), {router.per_s:,.0f} requests/s."
        ]

    n = args.connections
    connection_rows = [
        "| a new connection from a member to a node | member CPU µs | node CPU µs | p50 µs (connect + one read) |",
        "|---|---|---|---|",
        *(
            f"| {way} | {statistics.median(r[0] for r in runs) / n * 1e6:,.0f} |"
            f" {statistics.median(r[1] for r in runs) / n * 1e6:,.0f} |"
            f" {statistics.median(r[2] for r in runs) * 1e6:,.0f} |"
            for way, runs in made.items()
        ),
    ]

    return "\n".join(
        [
            SECTION,
            "",
            f"`{command}`",
            "",
            f"{versions}; {os.cpu_count()} cores shared with other work, load average {os.getloadavg()[0]:.1f}"
            f" at the end. Two nodes serving HTTPS with mutual TLS between members, {args.keys:,} keys in"
            f" {args.partitions} partitions; the router and nginx (one worker) terminate the client's TLS and"
            " speak TLS to the owning node presenting a member certificate, on kept-alive connections with"
            f" sessions reused. wrk, one thread, HTTPS, random keys, {args.duration:g} s per measurement,"
            f" medians of {args.rounds} rounds (the order alternating). {built}",
            "",
            *rows,
            "",
            f"- Router CPU per proxied read at concurrency {high}{shipped}: {router.proxy_us:,.0f} µs against"
            f" nginx's TLS hop's {nginx.proxy_us:,.0f} µs, {ratio:.1f}x, target <= {TARGET_VS_NGINX:g}x:"
            f" {verdict(ratio <= TARGET_VS_NGINX)}.",
            *pure_line,
            f"- p50 at concurrency {low}: through the router {p50_router:,.0f} µs, through nginx's TLS hop"
            f" {p50_nginx:,.0f} µs (the same node and keys behind both): the router adds"
            f" {p50_router - p50_nginx:,.0f} µs more, target <= {TARGET_P50_OVER_NGINX_US:g} µs:"
            f" {verdict(p50_router - p50_nginx <= TARGET_P50_OVER_NGINX_US)}.",
            "",
            f"What a member pays for a new connection to a node (after an idle expiry, or the node's keep-alive"
            f" close): {n} connections one after another, each a new FastUpstream reading one key the node owns, the"
            " member CPU being this benchmark process's (uvloop), medians of the rounds. Members offer the"
            " session of their last connection to the node (keyroute.http.tls.ResumingContext):",
            "",
            *connection_rows,
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--keys", type=int, help="keys in the store (default: 100,000; --quick: 20,000)")
    parser.add_argument("--partitions", type=int, default=12, help="partitions (default: 12)")
    parser.add_argument("--nodes", type=int, default=2, help="state nodes (default: 2)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32], help="wrk connections (1 32)")
    parser.add_argument("--duration", type=float, help="seconds per measurement (default: 5; --quick: 1)")
    parser.add_argument("--rounds", type=int, help="rounds; medians are reported (default: 5; --quick: 1)")
    parser.add_argument(
        "--connections", type=int, help="member connections per way and round (default: 300; --quick: 30)"
    )
    parser.add_argument(
        "--build",
        choices=("compiled", "pure"),
        default="compiled",
        help="compiled (the default): the router as it ships, this work tree built with `KEYROUTE_COMPILE=1 pip"
        " install --target` into a directory of its own, the editable install beside it at the highest concurrency;"
        " pure: the editable install only",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run of the plumbing, not figures")
    parser.add_argument("--write", action="store_true", help=f"record the figures in {RESULTS.name}")
    parser.add_argument("--keep", action="store_true", help="keep the working directory (logs, configs)")
    args = parser.parse_args(argv)
    if args.write and args.quick:
        parser.error("--write records figures: not with --quick")
    args.keys = args.keys if args.keys is not None else 20_000 if args.quick else 100_000
    args.duration = args.duration if args.duration is not None else 1.0 if args.quick else 5.0
    args.rounds = args.rounds if args.rounds is not None else 1 if args.quick else 5
    args.connections = args.connections if args.connections is not None else 30 if args.quick else 300
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
    wrk, nginx = ensure_tools()
    work = Path(tempfile.mkdtemp(prefix="keyroute-router-tls-bench-"))
    started = time.monotonic()
    try:
        figures, made, build = measure(args, wrk, nginx, work)
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    text = section(figures, made, args, harness.command(argv), tool_versions(wrk, nginx), build)
    harness.record(SECTION, text, args.write)
    print(f"took {time.monotonic() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
