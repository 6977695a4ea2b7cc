"""How fast one node applies a live store's backlog: records/s folded into LMDB by `keyroute.replica.live`'s
applier (one consumer, one thread, one write transaction per partition and batch, the offset in it), next to
a bare confluent-kafka consume loop over the same records (the client's own ceiling on this machine), and
the same records as Avro values (confluent-kafka's AvroSerializer, keyroute's development Schema Registry)
next to them as JSON values.

    .venv/bin/python benchmarks/live_apply.py [--records 200000] [--partitions 4] [--keys 20000] [--rounds 3]

A librdkafka mock cluster in this process is the broker; the records are produced first (their partition
by the store's partitioner), once as JSON and once as Avro to a second topic, then each mode (`latest`,
`aggregate`) applies the whole backlog of each topic into fresh environments, timed from the first assignment
to the last offset applied; JSON and Avro runs alternate, `--rounds` times, and the medians are reported.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import lmdb
from confluent_kafka import Consumer, Producer, TopicPartition

from keyroute.dev.kafka_mock import MockKafka
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.keys.schema_registry import RegistrySettings
from keyroute.replica.live import DEFAULT_BATCH_RECORDS, ApplierSettings, LiveApplier, LivePartition, LiveVersion
from keyroute.replica.store import LivePartitionStore, PartitionId
from keyroute.storage.live import OFFSET_KEY, Aggregate, LiveConfig, Merge

MERGES = {
    "latest": Merge("latest", "user", order_by="ts", columns=("ts", "page", "amount")),
    "aggregate": Merge(
        "aggregate",
        "user",
        aggregates=(
            Aggregate("events", "count", None),
            Aggregate("total", "sum", "amount"),
            Aggregate("last_ts", "max", "ts"),
            Aggregate("last_page", "max_by", "page", "ts"),
        ),
    ),
}


# The records' Avro schema (the same fields as the JSON records).
AVRO_SCHEMA = {
    "type": "record",
    "name": "Click",
    "namespace": "bench",
    "fields": [
        {"name": "user", "type": "string"},
        {"name": "ts", "type": "long"},
        {"name": "page", "type": "string"},
        {"name": "amount", "type": "long"},
    ],
}


def json_value(record: dict) -> bytes:
    return json.dumps(record).encode()


def avro_values(registry_url: str, topic: str) -> Callable[[dict], bytes]:
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroSerializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    serializer = AvroSerializer(SchemaRegistryClient({"url": registry_url}), json.dumps(AVRO_SCHEMA))
    ctx = SerializationContext(topic, MessageField.VALUE)
    return lambda record: serializer(record, ctx)


def start_registry(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """keyroute's development Schema Registry as a process on a free port."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(workdir / "registry.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "keyroute", "schema-registry", "--port", str(port)], stdout=log, stderr=log
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(f"{url}/subjects", timeout=1).raise_for_status()
            return proc, url
        except httpx.HTTPError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("the development schema registry did not start (see registry.log)") from None
            time.sleep(0.1)


def produce(
    kafka: MockKafka,
    topic: str,
    records: int,
    partitions: int,
    keys: int,
    encode: Callable[[dict], bytes] = json_value,
) -> list[int]:
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers, "log_level": 3, "linger.ms": 20})
    rng = random.Random(7)
    ends = [0] * partitions
    for i in range(records):
        user = f"user-{rng.randrange(keys):06d}".encode()
        value = encode({"user": user.decode(), "ts": i, "page": f"/p/{i % 97}", "amount": i % 13})
        p = partition_for(Partitioner.MURMUR2, user, partitions)
        ends[p] += 1
        while True:
            try:
                producer.produce(topic, key=user, value=value, partition=p)
                break
            except BufferError:
                producer.poll(0.05)
        if i % 5000 == 0:
            producer.poll(0)
    producer.flush(60)
    return ends


def bare_consume(kafka: MockKafka, topic: str, ends: list[int]) -> float:
    consumer = Consumer(
        {"bootstrap.servers": kafka.bootstrap_servers, "group.id": "bench", "enable.auto.commit": False,
         "auto.offset.reset": "error", "log_level": 2}
    )  # fmt: skip
    consumer.assign([TopicPartition(topic, p, 0) for p in range(len(ends))])
    total, seen = sum(ends), 0
    started = time.perf_counter()
    while seen < total:
        for message in consumer.consume(num_messages=2000, timeout=0.05):
            if message.error() is None:
                message.key()
                message.value()
                seen += 1
    elapsed = time.perf_counter() - started
    consumer.close()
    return total / elapsed


def apply_backlog(
    kafka: MockKafka,
    topic: str,
    ends: list[int],
    mode: str,
    workdir: Path,
    batch: int,
    registry: RegistrySettings | None = None,
) -> tuple[float, float]:
    """Records/s, and the process's CPU microseconds per record (every thread: the applier, librdkafka's and
    the mock broker's, which serve both value formats alike; less sensitive than wall time to a busy machine)."""
    partitions = len(ends)
    config = LiveConfig(
        topic,
        kafka.bootstrap_servers,
        MERGES[mode],
        (0,) * partitions,
        catch_up_records=0,
        value_format="json" if registry is None else "avro",
        schema_registry=registry,
    )
    stores = []
    for p in range(partitions):
        path = workdir / f"{mode}-p{p}"
        path.mkdir(parents=True)
        env = lmdb.open(str(path), map_size=1 << 32, subdir=True, max_dbs=0, readahead=False)
        with env.begin(write=True) as txn:
            txn.put(OFFSET_KEY, b"0")
        live = LivePartition("bench", 1, p, config, 0)
        stores.append(LivePartitionStore(PartitionId("bench", 1, p), path, 0, env, live=live))
    source = LiveVersion("bench", 1, config, KeyFormat.STRING, Partitioner.MURMUR2, partitions)
    applier = LiveApplier(source, node_id="bench", settings=ApplierSettings(batch_records=batch))
    started, cpu = time.perf_counter(), time.process_time()
    for held in stores:
        applier.add(held)
    while any(held.live.offset < ends[i] - 1 for i, held in enumerate(stores)):  # type: ignore[union-attr]
        time.sleep(0.005)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    applier.close()
    applied = sum(held.live.applied for held in stores)  # type: ignore[union-attr]
    for held in stores:
        held.close()
    assert applied == sum(ends), (applied, sum(ends))
    return sum(ends) / elapsed, cpu / sum(ends) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--keys", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=DEFAULT_BATCH_RECORDS, help="records per consume call")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each mode and value format (medians)")
    args = parser.parse_args(argv)
    with MockKafka() as kafka, tempfile.TemporaryDirectory(prefix="keyroute-live-apply-") as scratch:
        registry_proc, registry_url = start_registry(Path(scratch))
        try:
            topic, avro_topic = "bench", "bench-avro"
            kafka.create_topic(topic, args.partitions)
            kafka.create_topic(avro_topic, args.partitions)
            started = time.perf_counter()
            ends = produce(kafka, topic, args.records, args.partitions, args.keys)
            avro_ends = produce(
                kafka, avro_topic, args.records, args.partitions, args.keys, avro_values(registry_url, avro_topic)
            )
            assert avro_ends == ends
            took = time.perf_counter() - started
            print(f"produced {args.records} records (JSON and Avro) to {args.partitions} partitions in {took:.1f}s")
            print(f"bare consume loop: {bare_consume(kafka, topic, ends):,.0f} records/s")
            registry = RegistrySettings(registry_url)
            for mode in MERGES:
                runs: dict[str, list[tuple[float, float]]] = {"json": [], "avro": []}
                for n in range(args.rounds):
                    work = Path(scratch) / f"batch-{args.batch}-{n}"
                    runs["json"].append(apply_backlog(kafka, topic, ends, mode, work / "json", args.batch))
                    runs["avro"].append(
                        apply_backlog(kafka, avro_topic, ends, mode, work / "avro", args.batch, registry)
                    )
                rate = {fmt: statistics.median(r[0] for r in done) for fmt, done in runs.items()}
                cpu = {fmt: statistics.median(r[1] for r in done) for fmt, done in runs.items()}
                for fmt in runs:
                    each = ", ".join(f"{r[0]:,.0f}" for r in runs[fmt])
                    print(
                        f"apply ({mode}, {fmt} values): {rate[fmt]:,.0f} records/s (median of {each}), "
                        f"{cpu[fmt]:.1f} CPU us/record"
                    )
                print(
                    f"apply ({mode}): avro / json = {rate['avro'] / rate['json']:.2f} in records/s, "
                    f"{cpu['json'] / cpu['avro']:.2f} in CPU per record"
                )
        finally:
            registry_proc.terminate()
            registry_proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
