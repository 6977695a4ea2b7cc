"""What access control costs a router per proxied read: the same router without it, with a static token, with a
JWT, side by side in one run.

Run from the repository root: `.venv/bin/python benchmarks/router_access.py [--write] [--rounds 5]`
(`--quick`: a smoke run of the plumbing, not figures). It builds a store without Spark, starts ZooKeeper,
two nodes (a cluster secret, the token file) and three routers against them, all on 127.0.0.1: one without
access control, one with `--access-tokens`, one with `--jwt-issuer` (a JWKS file); wrk reads random keys
through each in turn (the order alternating by round), sending the token or the JWT on kept-alive
connections, and the CPU time of each router's process tree is read from /proc. --write records the figures
in benchmarks/RESULTS.md ("Router with access control").

Target (issue 34): the router's CPU per proxied read with access control on at most 1.2x the same router's
without it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import harness  # benchmarks/harness.py: ports, ZooKeeper, waiting, RESULTS.md
import jwt
from cryptography.hazmat.primitives.asymmetric import rsa

from router import (  # benchmarks/router.py: the store, processes, wrk and /proc readings
    STORE,
    WRK_SCRIPT,
    Figures,
    Run,
    Service,
    find_tool,
    http_json,
    key_text,
    published_store,
    start_service,
    tree_cpu_s,
    wait_until,
    wrk_run,
)

SECTION = "## Router with access control (benchmarks/router_access.py)"
OPEN, TOKENS, JWTS = "router, access control off", "router, static token", "router, JWT"
SCENARIOS = (OPEN, TOKENS, JWTS)
SECRET = "bench-cluster-secret"
TOKEN = "bench-reader-token"
ISSUER = "https://issuer.bench"
# wrk sends the caller's credentials, from the environment, with every request.
AUTH_SCRIPT = (
    'local auth = os.getenv("BENCH_AUTHORIZATION")\nif auth ~= "" then wrk.headers["Authorization"] = auth end\n'
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="record the figures in benchmarks/RESULTS.md")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--partitions", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="a smoke run: few keys, short rounds")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.duration, args.keys = 1, 1.0, 2_000
    wrk = find_tool("wrk")
    if wrk is None:
        raise SystemExit("missing wrk: run `sudo apt-get install -y wrk`")
    with tempfile.TemporaryDirectory(prefix="keyroute-access-") as folder:
        figures = measure(args, wrk, Path(folder))
    command = ".venv/bin/python benchmarks/router_access.py" + (" --write" if args.write else "")
    text = section(figures, args, command)
    print(text)
    if args.write and not args.quick:
        harness.write_section(SECTION, text)
    return 0


def measure(args: argparse.Namespace, wrk: str, work: Path) -> dict[str, Figures]:
    figures: dict[str, Figures] = {}
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = {**json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key())), "kid": "k1"}
    (work / "jwks.json").write_text(json.dumps({"keys": [jwk]}))
    (work / "tokens.toml").write_text(f'[[tokens]]\nname = "reader"\ntoken = "{TOKEN}"\nstores = ["{STORE}"]\n')
    claims = {"iss": ISSUER, "sub": "reader", "exp": int(time.time()) + 24 * 3600, "keyroute_stores": [STORE]}
    credentials = {
        OPEN: "",
        TOKENS: f"Bearer {TOKEN}",
        JWTS: "Bearer " + jwt.encode(claims, key, "RS256", {"kid": "k1"}),
    }
    with ExitStack() as stack:
        zk_settings, _ = published_store(stack, work, args.keys, args.partitions)
        connect = zk_settings.connect_string
        keyroute = [sys.executable, "-m", "keyroute"]
        common = ["--cluster-secret", SECRET]
        services: list[Service] = []
        for n in (1, 2):
            name, port = f"n{n}", harness.free_port()
            node = start_service(
                name,
                [*keyroute, "node", "--zk", connect, "--node-id", name, "--port", str(port), *common]
                + ["--access-tokens", str(work / "tokens.toml"), "--data-dir", str(work / f"data-{name}")],
                work,
                f"http://127.0.0.1:{port}",
            )
            stack.callback(node.stop)
            services.append(node)
        own = {
            OPEN: [],
            TOKENS: ["--access-tokens", str(work / "tokens.toml")],
            JWTS: ["--jwt-issuer", ISSUER, "--jwt-jwks-file", str(work / "jwks.json")],
        }
        routers: dict[str, Service] = {}
        for scenario in SCENARIOS:
            port = harness.free_port()
            router = start_service(
                f"router-{SCENARIOS.index(scenario)}",
                [*keyroute, "router", "--zk", connect, "--port", str(port), *common, *own[scenario]],
                work,
                f"http://127.0.0.1:{port}",
            )
            stack.callback(router.stop)
            routers[scenario] = router
        everything = [*services, *routers.values()]
        for router in routers.values():
            wait_until(lambda r=router: _complete(r.url), 180, "every partition served", everything)
        paths = work / "paths.txt"
        paths.write_text("".join(f"/stores/{STORE}/keys/{key_text(i)}\n" for i in range(args.keys)))
        script = work / "random-paths.lua"
        script.write_text(AUTH_SCRIPT + WRK_SCRIPT)
        for round_ in range(args.rounds):
            for scenario in SCENARIOS if round_ % 2 == 0 else SCENARIOS[::-1]:
                router = routers[scenario]
                os.environ["BENCH_AUTHORIZATION"] = credentials[scenario]
                before = tree_cpu_s(router.popen.pid)
                run: Run = wrk_run(wrk, script, router.url, paths, args.concurrency, args.duration, seed=round_)
                run.proxy_cpu_s = tree_cpu_s(router.popen.pid) - before
                figures.setdefault(scenario, Figures()).runs.append(run)
                print(
                    f"round {round_ + 1} {scenario}: {run.requests / run.duration_s:,.0f}/s p50 {run.p50_us:,.0f} µs,"
                    f" {run.proxy_cpu_s / max(run.requests, 1) * 1e6:,.0f} µs CPU/read, errors {run.errors}",
                    file=sys.stderr,
                )
    return figures


def _complete(url: str) -> bool:
    status, body = http_json(url + "/readyz")
    return status == 200 and isinstance(body, dict) and body.get("complete") is True


def section(figures: dict[str, Figures], args: argparse.Namespace, command: str) -> str:
    rows = [
        "| setup | requests/s | p50 µs | p99 µs | router CPU µs/read | errors |",
        "|---|---|---|---|---|---|",
        *(
            f"| {s} | {f.per_s:,.0f} | {f.p50_us:,.0f} | {f.p99_us:,.0f} | {f.proxy_us:,.0f} | {f.errors} |"
            for s, f in ((s, figures[s]) for s in SCENARIOS)
        ),
    ]
    base = figures[OPEN].proxy_us
    verdicts = [
        f"- Router CPU per proxied read with {name}: {figures[s].proxy_us:,.0f} µs against {base:,.0f} µs without"
        f" access control, {figures[s].proxy_us / base:.2f}x, target <= 1.2x:"
        f" **{'met' if figures[s].proxy_us <= 1.2 * base else 'not met'}**."
        for s, name in ((TOKENS, "a static token"), (JWTS, "a JWT"))
    ]
    return "\n".join(
        [
            SECTION,
            "",
            f"`{command}`",
            "",
            f"{os.cpu_count()} cores shared with other work, load average {os.getloadavg()[0]:.1f} at the end. Two"
            f" nodes, {args.keys:,} keys in {args.partitions} partitions, three routers against them (one process"
            " each): without access control, with a token file, with a JWT issuer. wrk, one thread, concurrency"
            f" {args.concurrency}, random keys, each request carrying the caller's credentials on kept-alive"
            f" connections, {args.duration:g} s per measurement, medians of {args.rounds} rounds (the order"
            " alternating).",
            "",
            *rows,
            "",
            *verdicts,
            "",
        ]
    )


if __name__ == "__main__":
    raise SystemExit(main())
