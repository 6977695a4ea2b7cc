"""Locating Schema Registry keys: a router's per-read cost of turning a key's text into the producer's bytes.

Side by side in one run, per key through `StoreLocator.locate` (what the router, the node and the direct
client call on every read): a plain string store (the reference), and stores of Avro, Protobuf and JSON
Schema keys (string, long, record); plus, for Avro string keys, the same bytes made by fastavro's
schemaless writer per key (what going through the serializer's library on every read would cost).

Run from the repository root: `.venv/bin/python benchmarks/schema_keys.py [--write]`; --write records the
table in RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import io
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import fastavro
import harness  # benchmarks/harness.py: ports, ZooKeeper, waiting, RESULTS.md
import orjson

from keyroute.keys.key_format import KeyFormat
from keyroute.keys.key_location import StoreLocator
from keyroute.keys.key_schema import KeySchema, wire_prefix
from keyroute.keys.partitioner import Partitioner, murmur2

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SECTION = "## Schema Registry keys (benchmarks/schema_keys.py)"
PARTITIONS = 100

AVRO_RECORD = orjson.dumps(
    {"type": "record", "name": "K", "fields": [{"name": "region", "type": "string"}, {"name": "id", "type": "long"}]}
).decode()


def _proto_schema(field_type: str) -> str:
    import base64

    from google.protobuf import descriptor_pb2

    proto = descriptor_pb2.FileDescriptorProto(name="k.proto", package="keys", syntax="proto3")
    message = proto.message_type.add(name="K")
    message.field.add(name="id", number=1, type=getattr(descriptor_pb2.FieldDescriptorProto, field_type), label=1)
    return base64.standard_b64encode(proto.SerializeToString()).decode()


def _locator(fmt: KeyFormat, schema: str | None) -> StoreLocator:
    key_schema = None if schema is None else KeySchema(fmt, 7, schema)
    return StoreLocator("s", PARTITIONS, Partitioner.MURMUR2, fmt, (), (), key_schema)


def contenders(count: int) -> list[tuple[str, Callable[[], object]]]:
    strings = [f"customer-{i * 7919 % 10**8:08d}" for i in range(count)]
    longs = [str(i * 104729 - count) for i in range(count)]
    records = [orjson.dumps({"region": ("eu", "us", "ap")[i % 3], "id": i}).decode() for i in range(count)]
    cases = [
        ("plain string (reference)", KeyFormat.STRING, None, strings),
        ("Avro string", KeyFormat.AVRO, '"string"', strings),
        ("Avro long", KeyFormat.AVRO, '"long"', longs),
        ("Avro record {region, id}", KeyFormat.AVRO, AVRO_RECORD, records),
        ("Protobuf {string id}", KeyFormat.PROTOBUF, _proto_schema("TYPE_STRING"), strings),
        ("Protobuf {int64 id}", KeyFormat.PROTOBUF, _proto_schema("TYPE_INT64"), longs),
        ("JSON Schema string", KeyFormat.JSON_SCHEMA, '{"type": "string"}', strings),
        ("JSON Schema integer", KeyFormat.JSON_SCHEMA, '{"type": "integer"}', longs),
    ]
    runs: list[tuple[str, Callable[[], object]]] = []
    for name, fmt, schema, keys in cases:
        locate = _locator(fmt, schema).locate
        runs.append((name, lambda locate=locate, keys=keys: [locate(k).partition for k in keys]))
    parsed = fastavro.parse_schema("string")
    prefix = wire_prefix(7)

    def through_fastavro() -> list[int]:
        out = []
        for key in strings:
            buf = io.BytesIO()
            buf.write(prefix)
            fastavro.schemaless_writer(buf, parsed, key)
            out.append((murmur2(buf.getvalue()) & 0x7FFFFFFF) % PARTITIONS)
        return out

    codec = KeySchema(KeyFormat.AVRO, 7, '"string"').codec

    def through_codec() -> list[int]:
        return [(murmur2(codec.parse(key).data) & 0x7FFFFFFF) % PARTITIONS for key in strings]

    # Bytes and partition only (no KeyLocation): keyroute's codec against fastavro's writer.
    runs.insert(2, ("Avro string, bytes + partition only: keyroute's codec", through_codec))
    runs.insert(3, ("Avro string, bytes + partition only: fastavro's writer per key (reference)", through_fastavro))
    return runs


def measure(runs: list[tuple[str, Callable[[], object]]], count: int, repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name, _ in runs}
    for _ in range(repeats):  # interleaved: a slow moment of a shared machine hits every contender alike
        for name, run in runs:
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: count / statistics.median(t) for name, t in times.items()}


def section(rates: dict[str, float], count: int, repeats: int, command: str) -> str:
    reference = rates["plain string (reference)"]
    rows = [f"| {name} | {rate:,.0f} | {1e6 / rate:.2f} | {rate / reference:.2f}x |" for name, rate in rates.items()]
    load = os.getloadavg()[0]
    return "\n".join(
        [
            SECTION,
            "",
            f"`{command}` on {datetime.date.today().isoformat()}: {count:,} keys per contender, "
            f"`StoreLocator.locate` per key (text -> the producer's bytes -> murmur2 -> partition of {PARTITIONS}), "
            f"median of {repeats} interleaved rounds.",
            f"Machine: {os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}, "
            f"fastavro {fastavro.__version__}, load average {load:.1f} at the end (other work shares the cores).",
            "",
            "| keys | keys/s (median) | µs/key | vs plain string |",
            "| --- | ---: | ---: | ---: |",
            *rows,
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=100_000, help="keys per contender (default: 100,000)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per contender (default: 5)")
    parser.add_argument("--write", action="store_true", help=f"record the table in {RESULTS.name}")
    args = parser.parse_args(argv)
    rates = measure(contenders(args.keys), args.keys, args.repeats)
    command = shlex.join([".venv/bin/python", "benchmarks/schema_keys.py", *(sys.argv[1:] if argv is None else argv)])
    text = section(rates, args.keys, args.repeats, command)
    harness.record(SECTION, text, args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
