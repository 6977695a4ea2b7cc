"""JSON vs Avro answers on a node: CPU and bytes per read, side by side in one run.

Run from the repository root: `.venv/bin/python benchmarks/answer_formats.py [--write]` (`--quick`: a smoke
run of the plumbing, not figures). It writes a store without Spark (benchmarks/router.py's: small values of
three columns), starts one ZooKeeper and one node that serves every partition, and reads it with wrk: single
keys, and batch-gets of `--batch` random keys, each asked as JSON (`Accept: application/json`) and as Avro
(`Accept: application/avro`), in a shuffled order per round. Reported, medians of the rounds: the node
process's CPU per read (/proc, user + system) and reads/s; the answer's body bytes (mean over sampled
reads); and, in this process, the CPU of the Avro encoding step alone (keyroute.formats.avro_answers.encode_body
or found_avro over the node's own answers) per answer. --write records the table in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import signal
import statistics
import sys
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
from keyroute.formats.avro_answers import encode_body, found_avro, found_entry_avro, results_avro  # noqa: E402
from keyroute.keys.key_format import KeyFormat  # noqa: E402
from keyroute.keys.partitioner import Partitioner  # noqa: E402
from keyroute.runtime.settings import ZkSettings  # noqa: E402

SECTION = "## Answer formats: JSON vs Avro on a node (benchmarks/answer_formats.py)"
FORMATS = {"json": "application/json", "avro": "application/avro"}
KEY, BATCH = "key", "batch"

# wrk: a batch-get of args[3] random keys of the paths file's keys per request.
BATCH_SCRIPT = """
local keys = {}
local size = 1
function init(args)
  for line in io.lines(args[1]) do keys[#keys + 1] = line end
  math.randomseed(tonumber(args[2]))
  size = tonumber(args[3])
end
wrk.headers["Content-Type"] = "application/json"
function request()
  local picked = {}
  for i = 1, size do picked[i] = '"' .. keys[math.random(#keys)] .. '"' end
  -- nil headers: wrk.headers, with the Accept the script starts with
  return wrk.format("POST", "/stores/STORE/batch-get", nil, '{"keys":[' .. table.concat(picked, ",") .. ']}')
end
"""


def script_text(kind: str, media_type: str) -> str:
    """The wrk script of one way: the key paths (router.py's) or batch-gets, asking for `media_type`."""
    done = bench.WRK_SCRIPT[bench.WRK_SCRIPT.index("function done") :]
    body = bench.WRK_SCRIPT if kind == KEY else BATCH_SCRIPT.replace("STORE", bench.STORE) + done
    return f'wrk.headers["Accept"] = "{media_type}"\n' + body


@contextmanager
def running(args: argparse.Namespace, work: Path) -> Iterator[Any]:
    with ExitStack() as stack:
        snapshot, _ = bench.write_store(work / "snapshots", args.keys, args.partitions)
        zk_server = stack.enter_context(harness.zookeeper(work))
        settings = ZkSettings(hosts=zk_server.connect_string, chroot="/keyroute-answers")
        client = zk.connect(settings)
        stack.callback(zk.close, client)
        record = StoreRecord(
            bench.STORE, args.partitions, Partitioner.MURMUR2, KeyFormat.STRING, 1, snapshot, ("v",), 1, time.time()
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


def fetch(url: str, media_type: str, body: bytes | None = None) -> bytes:
    headers = {"accept": media_type}
    if body is not None:
        headers["content-type"] = "application/json"
    request = urllib.request.Request(url, data=body, headers=headers, method="POST" if body else "GET")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.headers["content-type"] == media_type, response.headers["content-type"]
        return response.read()


def sizes_and_encoding(node: Any, args: argparse.Namespace) -> dict[tuple[str, str], float]:
    """Mean body bytes per way over sampled reads; the Avro encoding step's CPU µs per answer (this process,
    over the node's own JSON answers), as ("encode", kind)."""
    rng = random.Random(3)
    keys = [bench.key_text(rng.randrange(args.keys)) for _ in range(args.samples)]
    batches = [
        json.dumps({"keys": [bench.key_text(rng.randrange(args.keys)) for _ in range(args.batch)]}).encode()
        for _ in range(max(1, args.samples // 10))
    ]
    out: dict[tuple[str, str], float] = {}
    bodies: dict[tuple[str, str], list[bytes]] = {}
    for fmt, media_type in FORMATS.items():
        bodies[(KEY, fmt)] = [fetch(f"{node.url}/stores/{bench.STORE}/keys/{k}", media_type) for k in keys]
        batch_url = f"{node.url}/stores/{bench.STORE}/batch-get"
        bodies[(BATCH, fmt)] = [fetch(batch_url, media_type, b) for b in batches]
    for (kind, fmt), got in bodies.items():
        out[(kind, fmt)] = statistics.mean(len(b) for b in got)

    # What the node does per answer, from the stored values: a key's Avro (found_avro), a batch-get's (its
    # entries by found_entry_avro, joined by results_avro); and, for reference, both converted from their
    # JSON answers (encode_body).
    def stored(value: Any) -> bytes:
        return json.dumps(value, separators=(",", ":")).encode()

    found = []
    for body in bodies[(KEY, "json")]:
        answer = json.loads(body)
        found.append((answer["store"], answer["key"], answer["partition"], answer["version"], stored(answer["value"])))
    batches = [
        [
            (e["key"], e["partition"], e["version"], stored(e["value"]), e.get("offset"), e.get("node"))
            for e in json.loads(body)["results"]
        ]
        for body in bodies[(BATCH, "json")]
    ]

    def batch_avro(entries: list[tuple[Any, ...]]) -> bytes:
        return results_avro([found_entry_avro(*entry) for entry in entries])

    steps: dict[str, tuple[Any, list[Any]]] = {
        "found": (found_avro, found),
        "batch found": (batch_avro, [(b,) for b in batches]),
        KEY: (encode_body, [(b,) for b in bodies[(KEY, "json")]]),
        BATCH: (encode_body, [(b,) for b in bodies[(BATCH, "json")]]),
    }
    assert [found_avro(*f) for f in found] == bodies[(KEY, "avro")], "the node's Avro is not found_avro's"
    assert [batch_avro(b) for b in batches] == bodies[(BATCH, "avro")], "nor found_entry_avro's"
    for name, (step, calls) in steps.items():
        repeat = max(1, 20_000 // len(calls))
        started = time.process_time()
        for _ in range(repeat):
            for call in calls:
                step(*call)
        out[("encode", name)] = (time.process_time() - started) * 1e6 / (repeat * len(calls))
    return out


def measure(
    wrk: str, work: Path, node: Any, args: argparse.Namespace
) -> dict[tuple[str, str], list[tuple[float, float, int]]]:
    """(reads/s, node CPU µs per read, errors) per (kind, format) and round."""
    paths = work / "paths.txt"
    paths.write_text("\n".join(f"/stores/{bench.STORE}/keys/{bench.key_text(i)}" for i in range(args.keys)) + "\n")
    keys = work / "keys.txt"
    keys.write_text("\n".join(bench.key_text(i) for i in range(args.keys)) + "\n")
    scripts = {}
    for kind in (KEY, BATCH):
        for fmt, media_type in FORMATS.items():
            scripts[(kind, fmt)] = work / f"{kind}-{fmt}.lua"
            scripts[(kind, fmt)].write_text(script_text(kind, media_type))

    def run_way(kind: str, fmt: str, duration: float, seed: int) -> tuple[float, float, int]:
        before = bench.tree_cpu_s(node.popen.pid)
        if kind == KEY:
            popen = bench.wrk_start(wrk, scripts[(kind, fmt)], node.url, paths, args.concurrency, duration, seed)
        else:  # the batch size goes to the script as its third argument, where a paced run has its rate
            popen = bench.wrk_start(
                wrk, scripts[(kind, fmt)], node.url, keys, args.concurrency, duration, seed, rate_per_s=args.batch
            )
        run = bench.wrk_result(popen)
        cpu = bench.tree_cpu_s(node.popen.pid) - before
        return run.requests / run.duration_s, cpu * 1e6 / max(1, run.requests), run.errors

    ways = [(kind, fmt) for kind in (KEY, BATCH) for fmt in FORMATS]
    for kind, fmt in ways:  # warm-up: connections opened, code paths hot; not counted
        run_way(kind, fmt, 1.0, 0)
    samples: dict[tuple[str, str], list[tuple[float, float, int]]] = {}
    rng = random.Random(7)
    for round_number in range(args.rounds):
        rng.shuffle(ways)
        for kind, fmt in ways:
            sample = run_way(kind, fmt, args.duration, round_number + 1)
            samples.setdefault((kind, fmt), []).append(sample)
            print(
                f"round {round_number + 1} {kind:5} {fmt:4} {sample[0]:8.0f}/s node {sample[1]:6.0f} µs/read,"
                f" errors {sample[2]}",
                file=sys.stderr,
                flush=True,
            )
    return samples


def section(
    samples: dict[tuple[str, str], list[tuple[float, float, int]]],
    sizes: dict[tuple[str, str], float],
    args: argparse.Namespace,
    command: str,
    load: str,
) -> str:
    def median(kind: str, fmt: str, index: int) -> float:
        return statistics.median(s[index] for s in samples[(kind, fmt)])

    lines = [
        SECTION,
        "",
        f"`{command}` on {datetime.date.today().isoformat()}, {platform.machine()}, {os.cpu_count()} CPUs,"
        f" Python {platform.python_version()}; load average {load}. {args.keys:,} keys (values of three"
        f" columns: an integer, a short string, a fraction) in {args.partitions} partitions on one node; wrk,"
        f" {args.concurrency} connections, {args.duration:g} s per measurement, medians of {args.rounds} rounds"
        f" (ways in a shuffled order per round). A batch-get asks for {args.batch} random keys. Node CPU: user +"
        " system of the node process, from /proc, per request. Bytes: the answer's body, mean over"
        f" {args.samples} sampled reads (batch-gets: a tenth as many).",
        "",
        "| read | answer | requests/s | node CPU µs/request | vs JSON | body bytes | vs JSON |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for kind, what in ((KEY, "one key"), (BATCH, f"batch-get of {args.batch}")):
        json_cpu, json_bytes = median(kind, "json", 1), sizes[(kind, "json")]
        for fmt in FORMATS:
            errors = sum(s[2] for s in samples[(kind, fmt)])
            cpu, size = median(kind, fmt, 1), sizes[(kind, fmt)]
            lines.append(
                f"| {what} | {fmt}{f' ({errors} errors)' if errors else ''} | {median(kind, fmt, 0):,.0f}"
                f" | {cpu:,.0f} | {cpu / json_cpu:.2f}x | {size:,.0f} | {size / json_bytes:.2f}x |"
            )
    lines += [
        "",
        "The Avro encoding step alone, in this process, written from the stored values' JSON as the node does:"
        f" {sizes[('encode', 'found')]:,.1f} µs per key answer (`found_avro`) and"
        f" {sizes[('encode', 'batch found')]:,.1f} µs per batch-get answer of {args.batch} keys"
        " (`found_entry_avro` per key, `results_avro`); converting the whole JSON answer instead (`encode_body`,"
        f" what a forwarded or timeline read takes): {sizes[('encode', KEY)]:,.1f} µs and"
        f" {sizes[('encode', BATCH)]:,.1f} µs.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--keys", type=int, help="keys in the store (default: 50,000; --quick: 5,000)")
    parser.add_argument("--partitions", type=int, default=8, help="partitions (default: 8)")
    parser.add_argument("--batch", type=int, default=50, help="keys per batch-get (default: 50)")
    parser.add_argument("--concurrency", type=int, default=8, help="wrk connections (default: 8)")
    parser.add_argument("--duration", type=float, help="seconds per measurement (default: 5; --quick: 1)")
    parser.add_argument("--rounds", type=int, help="rounds; medians are reported (default: 3; --quick: 1)")
    parser.add_argument("--samples", type=int, default=1000, help="reads sampled for bytes (default: 1,000)")
    parser.add_argument("--quick", action="store_true", help="a smoke run of the plumbing, not figures")
    parser.add_argument("--write", action="store_true", help=f"record the table in {bench.RESULTS.name}")
    parser.add_argument("--keep", action="store_true", help="keep the working directory (logs)")
    args = parser.parse_args(argv)
    if args.write and args.quick:
        parser.error("--write records figures: not with --quick")
    args.keys = args.keys if args.keys is not None else 5_000 if args.quick else 50_000
    args.duration = args.duration if args.duration is not None else 1.0 if args.quick else 5.0
    args.rounds = args.rounds if args.rounds is not None else 1 if args.quick else 3
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))

    wrk = bench.find_tool("wrk")
    if wrk is None:
        raise SystemExit("wrk is missing: `sudo apt-get install -y wrk`")
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    with harness.work_dir("keyroute-answers-bench-", args.keep) as work, running(args, work) as node:
        sizes = sizes_and_encoding(node, args)
        samples = measure(wrk, work, node, args)
    load = f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    text = section(samples, sizes, args, harness.command(argv), load)
    harness.record(SECTION, text, args.write)
    print(f"took {time.monotonic() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
