"""What the router's data plane buys: the router as built against itself with key reads through its app.

Run from the repository root: `.venv/bin/python benchmarks/router_variants.py [--write]`. It starts the
cluster of benchmarks/router.py (store without Spark, ZooKeeper, two nodes, the router), then one more
router per variant on the same map, each with one part of today's data plane undone:

- "key reads through Starlette": no data plane (router/dataplane.py). keyroute's HTTP server hands every
  request to the router's Starlette app through its ASGI bridge, and single-key reads go through
  Starlette's middleware, exception handling and routing to a route that asks the same `Proxy.read`,
  as any endpoint of the app would.

wrk measures each router in turn, in a shuffled order per round; --write records the table in
benchmarks/RESULTS.md under "Router".
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import harness  # benchmarks/harness.py: ports, ZooKeeper, waiting, RESULTS.md

bench = harness.script("router.py")

SUBSECTION = "### Router variants"
AS_BUILT = "today's data plane (router/dataplane.py)"
STARLETTE = "key reads through Starlette (no data plane)"
VARIANTS = ((STARLETTE, "starlette"),)

# Runs `keyroute router` with one part of the data plane undone (the first argument names which).
VARIANT_ROUTER = """
import sys

import keyroute.router.service

variant = sys.argv.pop(1)
if variant == "starlette":
    import asyncio

    from keyroute.api import NotFound, key_path_segment
    from keyroute.runtime.logs import bind_request_id
    from keyroute.http.server import HttpServer
    from keyroute.router.app import create_app
    from keyroute.router.limits import server_limits
    from starlette.responses import Response
    from starlette.routing import Route

    def server(settings):
        max_key_bytes = settings.limits.max_key_bytes

        async def get_key(request):
            located = key_path_segment(request.scope["raw_path"], max_key_bytes)  # an ApiError: the app's answer
            if located is None:
                raise NotFound("not a key path")
            request_id = bind_request_id(request.scope, request.headers.get("x-request-id"))
            result = asyncio.get_running_loop().create_future()
            request.app.state.proxy.read(*located, request_id, result.set_result)
            reply = await result
            if isinstance(reply, Exception):
                raise reply
            response = Response(reply.body, status_code=reply.status)
            response.raw_headers.extend(reply.headers)
            return response

        app = create_app(settings)
        app.router.routes.insert(0, Route("/stores/{store}/keys/{key:path}", get_key, methods=["GET"]))
        return HttpServer(app, server_limits(settings))  # no data plane: everything goes to the app

    keyroute.router.service.server = server
from keyroute.cli import main
sys.exit(main(sys.argv[1:]))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--keys", type=int, default=20_000, help="keys in the store (default: 20,000)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32], help="wrk connections (1 32)")
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per measurement (default: 4)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default: 5)")
    parser.add_argument("--write", action="store_true", help="record the figures in RESULTS.md")
    args = parser.parse_args(argv)
    cluster_args = argparse.Namespace(keys=args.keys, partitions=12, nodes=2)

    wrk, nginx = bench.ensure_tools()
    work = Path(tempfile.mkdtemp(prefix="keyroute-variants-bench-"))
    load_before = os.getloadavg()[0]
    runs: dict[tuple[str, int], list[bench.Run]] = {}
    try:
        with bench.running_cluster(cluster_args, wrk, nginx, work) as cluster:
            connect = cluster.router.popen.args[cluster.router.popen.args.index("--zk") + 1]
            routers = {AS_BUILT: cluster.router}
            for name, variant in VARIANTS:
                port = harness.free_port()
                command = [sys.executable, "-c", VARIANT_ROUTER, variant, "router", "--zk", connect]
                service = bench.start_service(
                    variant, [*command, "--port", str(port)], work, f"http://127.0.0.1:{port}"
                )
                routers[name] = service
            try:
                bench.wait_until(
                    lambda: all(bench.http_json(r.url + "/readyz")[0] == 200 for r in routers.values()),
                    60,
                    "every router to be ready",
                    list(routers.values()),
                )
                for service in routers.values():  # warm up: connections to the nodes, caches
                    bench.wrk_run(wrk, cluster.script, service.url, cluster.files["all"], max(args.concurrency), 1, 1)
                rng = random.Random(20241121)
                for round_index in range(args.rounds):
                    for concurrency in args.concurrency:
                        order = list(routers)
                        rng.shuffle(order)
                        for name in order:
                            service = routers[name]
                            nodes_before = sum(bench.tree_cpu_s(n.popen.pid) for n in cluster.nodes.values())
                            proxy_before = bench.tree_cpu_s(service.popen.pid)
                            run = bench.wrk_run(
                                wrk,
                                cluster.script,
                                service.url,
                                cluster.files["all"],
                                concurrency,
                                args.duration,
                                rng.randrange(1, 1 << 30),
                            )
                            run.proxy_cpu_s = bench.tree_cpu_s(service.popen.pid) - proxy_before
                            run.node_cpu_s = (
                                sum(bench.tree_cpu_s(n.popen.pid) for n in cluster.nodes.values()) - nodes_before
                            )
                            runs.setdefault((name, concurrency), []).append(run)
                    print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr, flush=True)
            finally:
                for name, service in routers.items():
                    if name != AS_BUILT:
                        service.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load = f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    text = section(runs, args, harness.command(argv), bench.tool_versions(wrk, nginx), load)
    print(text)
    if args.write:
        harness.write_subsection(bench.SECTION, SUBSECTION, text)
        print(f"wrote {SUBSECTION!r} under {bench.SECTION!r} in {bench.RESULTS}", file=sys.stderr)
    return 0


def section(
    runs: dict[tuple[str, int], list[bench.Run]], args: argparse.Namespace, command: str, versions: str, load: str
) -> str:
    lines = [
        SUBSECTION,
        "",
        f"`{command}` on {datetime.date.today().isoformat()}: the cluster of the table above ({args.keys:,} keys,"
        f" 12 partitions, 2 nodes) with {1 + len(VARIANTS)} routers on the same map, measured in turn (order"
        f" shuffled per round), {args.duration:g} s each, median of {args.rounds} rounds."
        " Router CPU µs/request as above.",
        f"Machine: {os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}, {versions};"
        f" load average {load}.",
        "",
        "| router | concurrency | requests/s | p50 ms | p99 ms | router CPU µs/request | node CPU µs/request"
        " | errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    order = (AS_BUILT, *(name for name, _ in VARIANTS))
    for (name, concurrency), measured in sorted(runs.items(), key=lambda i: (i[0][1], order.index(i[0][0]))):
        lines.append(
            f"| {name} | {concurrency} | {statistics.median(r.requests / r.duration_s for r in measured):,.0f}"
            f" | {statistics.median(r.p50_us for r in measured) / 1000:.2f}"
            f" | {statistics.median(r.p99_us for r in measured) / 1000:.2f}"
            f" | {_median_us(measured, 'proxy_cpu_s'):,.0f} | {_median_us(measured, 'node_cpu_s'):,.0f}"
            f" | {sum(r.errors for r in measured)} |"
        )
    lines.append("")
    for concurrency in args.concurrency:
        built = _median_us(runs[(AS_BUILT, concurrency)], "proxy_cpu_s")
        for name, _ in VARIANTS:
            other = _median_us(runs[(name, concurrency)], "proxy_cpu_s")
            lines.append(
                f"- Concurrency {concurrency}: {name}: {other:,.0f} µs/request, {other / built:.2f}x the router"
                f" as built ({built:,.0f} µs)."
            )
    lines.append("")
    return "\n".join(lines)


def _median_us(runs: list[bench.Run], attribute: str) -> float:
    return statistics.median(getattr(r, attribute) / r.requests * 1e6 for r in runs)


if __name__ == "__main__":
    raise SystemExit(main())
