"""Partitioning throughput: per-key Python hashing (ours, kafka-python's) against the vectorised batch path.

Run from the repository root: `.venv/bin/python benchmarks/hashing.py [--write]`; --write records the table.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import harness  # benchmarks/harness.py: ports, ZooKeeper, waiting, RESULTS.md
import numpy as np
import pyarrow as pa

from keyroute.keys.partition_vectorized import partitions
from keyroute.keys.partitioner import Partitioner, partition_for

with warnings.catch_warnings():
    # kafka-python 3.0 loads its protocol schemas through importlib.resources' legacy API, deprecated since
    # Python 3.11.
    warnings.filterwarnings("ignore", r"\w+ is deprecated\. Use files\(\) instead", DeprecationWarning)
    import kafka
    from kafka.partitioner.default import murmur2 as kafka_python_murmur2

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SECTION = "## Partitioning"
TARGET_SPEEDUP = 30.0

KAFKA_PYTHON = "kafka-python `murmur2`, per key"
PER_KEY = "keyroute `partition_for`, per key"
ARROW = "keyroute `partitions()`, pyarrow string array"
BYTES_LIST = "keyroute `partitions()`, list of bytes"


@dataclass(frozen=True)
class Contender:
    partitioner: Partitioner
    name: str
    run: Callable[[], Sequence[int] | np.ndarray]


@dataclass(frozen=True)
class Result:
    contender: Contender
    keys_per_s: float


def generate_keys(count: int, seed: int) -> list[str]:
    """Keys shaped like a keyed topic's: mostly customer ids, some UUIDs, a few longer composite keys."""
    rng = random.Random(seed)
    keys = []
    for _ in range(count):
        roll = rng.random()
        if roll < 0.80:
            keys.append(f"customer-{rng.randrange(10**8):08d}")
        elif roll < 0.95:
            keys.append(str(uuid.UUID(int=rng.getrandbits(128), version=4)))
        else:
            keys.append(
                f"tenant-{rng.randrange(500)}/order/{rng.randrange(10**12)}/line/{rng.randrange(100)}"
            )
    return keys


def contenders(texts: list[str], n: int) -> list[Contender]:
    data = [text.encode() for text in texts]  # what StringSerializer writes
    batch = pa.array(texts, type=pa.string())  # what Spark hands an Arrow UDF

    def kafka_python() -> list[int]:
        # DefaultPartitioner.partition's arithmetic, without its cluster-metadata lookups.
        return [(kafka_python_murmur2(key) & 0x7FFFFFFF) % n for key in data]

    def per_key(partitioner: Partitioner) -> Callable[[], list[int]]:
        return lambda: [partition_for(partitioner, key, n) for key in data]

    def vectorised(partitioner: Partitioner, keys: pa.Array | list[bytes]) -> Callable[[], np.ndarray]:
        return lambda: partitions(partitioner, keys, n)

    murmur2 = Partitioner.MURMUR2
    found = [
        Contender(murmur2, KAFKA_PYTHON, kafka_python),
        Contender(murmur2, PER_KEY, per_key(murmur2)),
        Contender(murmur2, ARROW, vectorised(murmur2, batch)),
        Contender(murmur2, BYTES_LIST, vectorised(murmur2, data)),
    ]
    for partitioner in (Partitioner.CRC32, Partitioner.FNV1A):
        found += [
            Contender(partitioner, PER_KEY, per_key(partitioner)),
            Contender(partitioner, ARROW, vectorised(partitioner, batch)),
        ]
    return found


def measure(found: list[Contender], key_count: int, repeats: int) -> list[Result]:
    """Median keys/s of each contender; rounds interleave the contenders so machine noise hits all alike.

    The first round's answers are compared: contenders for one hash must place every key alike, or their
    speeds mean nothing.
    """
    seconds: list[list[float]] = [[] for _ in found]
    for round_index in range(repeats):
        answers: dict[Partitioner, list[int]] = {}
        for contender, timings in zip(found, seconds, strict=True):
            start = time.perf_counter()
            answer = contender.run()
            timings.append(time.perf_counter() - start)
            if round_index == 0 and answers.setdefault(contender.partitioner, list(answer)) != list(answer):
                raise SystemExit(f"{contender.partitioner}: {contender.name} places keys differently")
        print(f"round {round_index + 1}/{repeats} done", file=sys.stderr, flush=True)
    return [Result(c, key_count / statistics.median(t)) for c, t in zip(found, seconds, strict=True)]


def kafka_python_rate(results: list[Result]) -> float:
    return next(r.keys_per_s for r in results if r.contender.name == KAFKA_PYTHON)


def table(results: list[Result]) -> str:
    baseline = kafka_python_rate(results)
    per_key = {r.contender.partitioner: r.keys_per_s for r in results if r.contender.name == PER_KEY}
    lines = [
        "| hash | implementation | keys/s (median) | vs kafka-python | vs our per-key |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for r in results:
        partitioner = r.contender.partitioner
        lines.append(
            f"| {partitioner} | {r.contender.name} | {r.keys_per_s:,.0f} | {r.keys_per_s / baseline:.1f}x"
            f" | {r.keys_per_s / per_key[partitioner]:.1f}x |"
        )
    return "\n".join(lines)


def section(results: list[Result], args: argparse.Namespace, keys: list[str], command: str) -> str:
    lengths = [len(key.encode()) for key in keys]
    versions = (
        f"Python {platform.python_version()}, NumPy {np.__version__}, pyarrow {pa.__version__}, "
        f"kafka-python {kafka.__version__}"
    )
    return "\n".join(
        [
            SECTION,
            "",
            f"`{command}` on {datetime.date.today().isoformat()}: {args.keys:,} string keys, seed {args.seed}"
            " (80% `customer-NNNNNNNN`, 15% UUIDs, 5% composite `tenant-N/order/N/line/N`;"
            f" {statistics.mean(lengths):.1f} bytes on average, {min(lengths)}-{max(lengths)}),"
            f" {args.partitions} partitions, median of {args.repeats} interleaved rounds.",
            f"Machine: {os.cpu_count()} CPUs, {platform.machine()}, {versions}.",
            "Per-key rows loop over pre-encoded `bytes`. Arrow rows time `partitions()` on a built array",
            "(Spark hands its UDFs Arrow batches); the list-of-bytes row includes building the Arrow array.",
            "",
            table(results),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000, help="how many keys (default: 1,000,000)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per contender (default: 5)")
    parser.add_argument("--partitions", type=int, default=100, help="partition count (default: 100)")
    parser.add_argument("--seed", type=int, default=20240229)
    parser.add_argument("--write", action="store_true", help=f"record the table in {RESULTS.name}")
    args = parser.parse_args(argv)

    keys = generate_keys(args.keys, args.seed)
    results = measure(contenders(keys, args.partitions), args.keys, args.repeats)
    text = section(results, args, keys, harness.command(argv))
    print(text)
    if args.write:
        harness.write_section(SECTION, text)
        print(f"wrote {SECTION!r} to {RESULTS}", file=sys.stderr)

    arrow = next(
        r for r in results if r.contender.partitioner is Partitioner.MURMUR2 and r.contender.name == ARROW
    )
    speedup = arrow.keys_per_s / kafka_python_rate(results)
    if speedup < TARGET_SPEEDUP:
        print(f"below target: murmur2 vectorised is {speedup:.1f}x kafka-python", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
