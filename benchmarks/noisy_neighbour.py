"""Quotas on a real cluster: a noisy neighbour held to its quota, and what quotas cost a router.

Run from the repository root: `.venv/bin/python benchmarks/noisy_neighbour.py [--write] [--rounds 2]`.
It builds a store without Spark, starts ZooKeeper, two nodes and two routers on 127.0.0.1 (both with the
cluster secret; one with nothing else, one with access tokens and a quota file), then measures with wrk:

1. Noisy neighbour, through the router with quotas: the steady caller (token `web`, quota far above its
   rate) reads single keys at a steady moderate rate, alone, then with the noisy caller (token `batch-job`)
   sending batch-gets of 20 keys at 10x its quota. Both routers are registered in ZooKeeper, so the router
   measured enforces half of the cluster-wide quota: "its quota" here is that share. Wanted: the steady
   caller's p99 with the noisy one present within 1.5x of its p99 alone, and the noisy one admitted at its
   quota (+-10%: reads counted by the router's `keyroute_router_quota_reads_total`, after the first
   seconds, when its burst is spent).
2. Router CPU per proxied read at one equal paced rate, through the router without authentication or
   quotas and through the one with both (a token with a quota it stays under), in alternation: wanted
   <= 1.2x.

Medians over `--rounds`; --write records the figures in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import harness  # benchmarks/harness.py: ports, ZooKeeper, waiting, RESULTS.md

from router import (  # benchmarks/router.py: the store, processes, wrk and /proc readings
    STORE,
    THIS_TREE,
    WRK_PACING,
    WRK_SCRIPT,
    http_json,
    key_text,
    published_store,
    tree_cpu_s,
    wait_until,
    wrk_result,
)

# wrk's summary as one line, as benchmarks/router.py prints it (its `done`).
WRK_DONE = WRK_SCRIPT[WRK_SCRIPT.index("function done(") :]
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SECTION = "## Quotas: noisy neighbour and router CPU (benchmarks/noisy_neighbour.py)"
CHROOT = "/keyroute-quotas-bench"
SECRET = "bench-cluster-secret"
WEB, JOB, OPS = "web-t0ken", "job-t0ken", "ops-t0ken"
NOISY_QUOTA = 200.0  # reads/s of the noisy caller (a batch-get counts its keys), cluster-wide
NOISY_SHARE = NOISY_QUOTA / 2  # what the router measured enforces of it: two routers are up
BATCH_KEYS = 20
STEADY_RATE = 400.0  # reads/s of the steady caller
CPU_RATE = 1500.0  # reads/s of the CPU comparison
TARGET_P99_RATIO = 1.5
TARGET_QUOTA_ERROR = 0.10
TARGET_CPU_RATIO = 1.2

TOKENS = f"""
[[tokens]]
name = "web"
token = "{WEB}"
stores = "*"

[[tokens]]
name = "ops"
token = "{OPS}"
stores = "*"
admin = true

[[tokens]]
name = "batch-job"
token = "{JOB}"
stores = "*"
"""
QUOTAS = f"""
[identities.web]
rate = 100000

[identities.batch-job]
rate = {NOISY_QUOTA:g}
"""

# Batch-gets of BATCH_KEYS random keys, paced as WRK_PACING paces (args: keys file, seed, rate).
BATCH_SCRIPT = """
local keys = {}
local size = %d
function init(args)
  for line in io.lines(args[1]) do keys[#keys + 1] = line end
  math.randomseed(tonumber(args[2]))
end
function request()
  local picked = {}
  for i = 1, size do picked[i] = '"' .. keys[math.random(#keys)] .. '"' end
  local body = '{"keys": [' .. table.concat(picked, ",") .. ']}'
  -- Headers given to wrk.format replace wrk's own (-H): copied, with the body's type.
  local headers = {["Content-Type"] = "application/json"}
  for name, value in pairs(wrk.headers) do headers[name] = value end
  return wrk.format("POST", "/stores/%s/batch-get", headers, body)
end
"""


def quota_counts(router_url: str, identity: str) -> tuple[float, float]:
    """The router's counts of reads admitted under `identity`'s quota, and of its requests refused 429."""
    with urllib.request.urlopen(router_url + "/metrics", timeout=10) as answer:
        text = answer.read().decode()

    def value(family: str) -> float:
        found = re.search(rf'^{family}{{identity="{identity}",store="{STORE}"}} (\S+)$', text, re.M)
        return float(found.group(1)) if found else 0.0

    return value("keyroute_router_quota_reads_total"), value("keyroute_router_quota_rejections_total")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--keys", type=int, default=20_000)
    parser.add_argument("--write", action="store_true", help="record the figures in benchmarks/RESULTS.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="keyroute-quotas-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        zk_settings, _ = published_store(stack, work, args.keys, 8)
        connect = zk_settings.connect_string
        (work / "tokens.toml").write_text(TOKENS)
        (work / "quotas.toml").write_text(QUOTAS)
        services = []
        for name in ("n1", "n2"):
            port = harness.free_port()
            node_args = ["node", "--zk", connect, "--node-id", name, "--port", str(port), "--cluster-secret", SECRET]
            node = THIS_TREE.start(
                name, [*node_args, "--data-dir", str(work / f"data-{name}")], work, f"http://127.0.0.1:{port}"
            )
            stack.callback(node.stop)
            services.append(node)
        routers = {}
        for name, extra in (
            ("plain", []),
            ("quotas", ["--access-tokens", str(work / "tokens.toml"), "--quota-file", str(work / "quotas.toml")]),
        ):
            port = harness.free_port()
            router_args = ["router", "--zk", connect, "--port", str(port), "--cluster-secret", SECRET, *extra]
            routers[name] = THIS_TREE.start(f"router-{name}", router_args, work, f"http://127.0.0.1:{port}")
            stack.callback(routers[name].stop)
            services.append(routers[name])
        wait_until(lambda: all(http_json(s.url + "/readyz")[0] == 200 for s in services), 180, "the cluster", services)
        keys_file = work / "keys.txt"
        keys_file.write_text("\n".join(key_text(i) for i in range(args.keys)) + "\n")
        paths_file = work / "paths.txt"
        paths_file.write_text("\n".join(f"/stores/{STORE}/keys/{key_text(i)}" for i in range(args.keys)) + "\n")
        paced = work / "paced.lua"
        paced.write_text(WRK_SCRIPT + WRK_PACING)
        batches = work / "batches.lua"
        batches.write_text(BATCH_SCRIPT % (BATCH_KEYS, STORE) + WRK_DONE + WRK_PACING)
        guarded, plain = routers["quotas"], routers["plain"]

        def wrk(
            script: Path, url: str, lines: Path, seed: int, rate: float, token: str | None, lead_s: float = 0.0
        ) -> subprocess.Popen[str]:
            """wrk for args.seconds (plus `lead_s` before and after), paced to `rate`, with `token`."""
            seconds = args.seconds + 2 * lead_s
            command = ["wrk", "-t1", "-c8", f"-d{seconds:g}s", "--timeout", "5s", "--latency"]
            command += ["-H", f"Authorization: Bearer {token}"] if token else []
            command += ["-s", str(script), url, "--", str(lines), str(seed), f"{rate:g}"]
            return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        alone_p99, with_p99, admitted_rates, noisy_refused, noisy_sent = [], [], [], [], []
        cpu_plain, cpu_quotas = [], []
        for r in range(args.rounds):
            print(f"round {r + 1}: steady caller alone", file=sys.stderr)
            run = wrk_result(wrk(paced, guarded.url, paths_file, 100 + r, STEADY_RATE, WEB))
            assert run.errors == 0, run
            alone_p99.append(run.p99_us)
            print(f"round {r + 1}: steady caller beside the noisy one", file=sys.stderr)
            # The noisy caller runs 2 s before and after the steady one: its burst (1 s of quota) is spent when
            # the count starts, and it is still sending when the count ends.
            noisy = wrk(batches, guarded.url, keys_file, 200 + r, 10 * NOISY_SHARE / BATCH_KEYS, JOB, lead_s=2.0)
            time.sleep(2.0)
            (before, _), at = quota_counts(guarded.url, "batch-job"), time.monotonic()
            run = wrk_result(wrk(paced, guarded.url, paths_file, 300 + r, STEADY_RATE, WEB))
            (after, _), until = quota_counts(guarded.url, "batch-job"), time.monotonic()
            noisy_run = wrk_result(noisy)
            assert run.errors == 0, run
            with_p99.append(run.p99_us)
            admitted_rates.append((after - before) / (until - at))
            # Every batch-get not answered 200 was a 429: the router counted as many.
            refused = quota_counts(guarded.url, "batch-job")[1] - sum(noisy_refused)
            assert noisy_run.errors == refused, (noisy_run, refused)
            noisy_refused.append(refused)
            noisy_sent.append(noisy_run.requests)
            for name, router, token, out in (("plain", plain, None, cpu_plain), ("quotas", guarded, WEB, cpu_quotas)):
                print(f"round {r + 1}: router CPU, {name}", file=sys.stderr)
                cpu_before = tree_cpu_s(router.popen.pid)
                run = wrk_result(wrk(paced, router.url, paths_file, 400 + r, CPU_RATE, token))
                assert run.errors == 0, run
                out.append((tree_cpu_s(router.popen.pid) - cpu_before) / run.requests * 1e6)
        # Both routers are up (registered in ZooKeeper): each enforces its share of the quota.
        request = urllib.request.Request(guarded.url + "/admin/quotas", headers={"Authorization": f"Bearer {OPS}"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            routers_up = json.load(answer)["routers"]
        figures = {
            "routers": routers_up,
            "alone_p99_us": statistics.median(alone_p99),
            "with_p99_us": statistics.median(with_p99),
            "admitted_per_s": statistics.median(admitted_rates),
            "noisy_refused": statistics.median(noisy_refused),
            "noisy_sent": statistics.median(noisy_sent),
            "cpu_plain_us": statistics.median(cpu_plain),
            "cpu_quotas_us": statistics.median(cpu_quotas),
        }
        report = render(figures, args)
        print(report)
        if args.write:
            harness.write_section(SECTION, report)
    return 0


def render(f: dict[str, float], args: argparse.Namespace) -> str:
    p99_ratio = f["with_p99_us"] / f["alone_p99_us"]
    share = NOISY_QUOTA / f["routers"]
    quota_error = f["admitted_per_s"] / share - 1
    cpu_ratio = f["cpu_quotas_us"] / f["cpu_plain_us"]

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    return "\n".join(
        [
            SECTION,
            "",
            f"Measured {datetime.date.today().isoformat()} on {platform.machine()}, {os.cpu_count()} cores shared"
            f" with other work, medians of {args.rounds} rounds of {args.seconds:g} s, wrk paced, one connection"
            " pool of 8 per caller; two nodes, one router with access tokens and a quota file. Command:"
            f" `.venv/bin/python benchmarks/noisy_neighbour.py --rounds {args.rounds} --seconds {args.seconds:g}"
            " --write`.",
            "",
            "| figure | value | target |",
            "|---|---|---|",
            f"| steady caller (key reads, {STEADY_RATE:g}/s) p99 alone | {f['alone_p99_us'] / 1000:.2f} ms | |",
            f"| the same, beside the noisy caller | {f['with_p99_us'] / 1000:.2f} ms ({p99_ratio:.2f}x) |"
            f" <= {TARGET_P99_RATIO}x: {verdict(p99_ratio <= TARGET_P99_RATIO)} |",
            f"| noisy caller: batch-gets of {BATCH_KEYS} keys at 10x its quota, {NOISY_QUOTA:g} keys/s"
            f" (cluster-wide: {share:g}/s on this router, {f['routers']:g} routers up), keys admitted per second"
            f" | {f['admitted_per_s']:.1f} ({quota_error:+.1%} of the share) |"
            f" within 10%: {verdict(abs(quota_error) <= TARGET_QUOTA_ERROR)} |",
            f"| noisy caller: batch-gets sent, refused 429 | {f['noisy_sent']:.0f}, {f['noisy_refused']:.0f} | |",
            f"| router CPU per proxied read at {CPU_RATE:g}/s, no authentication, no quotas |"
            f" {f['cpu_plain_us']:.1f} µs | |",
            f"| the same, with access tokens and quotas | {f['cpu_quotas_us']:.1f} µs ({cpu_ratio:.2f}x) |"
            f" <= {TARGET_CPU_RATIO}x: {verdict(cpu_ratio <= TARGET_CPU_RATIO)} |",
            "",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
