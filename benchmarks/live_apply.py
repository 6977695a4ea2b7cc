"""How fast one node applies a live store's backlog: records/s folded into LMDB by `keyroute.state_node.live`'s
applier (one consumer, one thread, one write transaction per partition and batch, the offset in it), next to
a bare confluent-kafka consume loop over the same records (the client's own ceiling on this machine).

    .venv/bin/python benchmarks/live_apply.py [--records 200000] [--partitions 4] [--keys 20000]

A librdkafka mock cluster in this process is the broker; the records are produced first (their partition
by the store's partitioner), then each mode (`latest`, `aggregate`) applies the whole backlog into fresh
environments, timed from the first assignment to the last offset applied.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import lmdb
from confluent_kafka import Consumer, Producer, TopicPartition

from keyroute.core.key_format import KeyFormat
from keyroute.core.live import OFFSET_KEY, Aggregate, LiveConfig, Merge
from keyroute.core.partitioner import Partitioner, partition_for
from keyroute.kafka_mock import MockKafka
from keyroute.state_node.live import DEFAULT_BATCH_RECORDS, ApplierSettings, LiveApplier, LivePartition, LiveVersion
from keyroute.state_node.store import LivePartitionStore, PartitionId

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


def produce(kafka: MockKafka, topic: str, records: int, partitions: int, keys: int) -> list[int]:
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers, "log_level": 3, "linger.ms": 20})
    rng = random.Random(7)
    ends = [0] * partitions
    for i in range(records):
        user = f"user-{rng.randrange(keys):06d}".encode()
        value = json.dumps({"user": user.decode(), "ts": i, "page": f"/p/{i % 97}", "amount": i % 13}).encode()
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


def apply_backlog(kafka: MockKafka, topic: str, ends: list[int], mode: str, workdir: Path, batch: int) -> float:
    partitions = len(ends)
    config = LiveConfig(topic, kafka.bootstrap_servers, MERGES[mode], (0,) * partitions, catch_up_records=0)
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
    started = time.perf_counter()
    for held in stores:
        applier.add(held)
    while any(held.live.offset < ends[i] - 1 for i, held in enumerate(stores)):  # type: ignore[union-attr]
        time.sleep(0.005)
    elapsed = time.perf_counter() - started
    applier.close()
    applied = sum(held.live.applied for held in stores)  # type: ignore[union-attr]
    for held in stores:
        held.close()
    assert applied == sum(ends), (applied, sum(ends))
    return sum(ends) / elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--keys", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=DEFAULT_BATCH_RECORDS, help="records per consume call")
    args = parser.parse_args(argv)
    with MockKafka() as kafka, tempfile.TemporaryDirectory(prefix="keyroute-live-apply-") as scratch:
        topic = "bench"
        kafka.create_topic(topic, args.partitions)
        started = time.perf_counter()
        ends = produce(kafka, topic, args.records, args.partitions, args.keys)
        print(
            f"produced {args.records} records to {args.partitions} partitions in {time.perf_counter() - started:.1f}s"
        )
        print(f"bare consume loop: {bare_consume(kafka, topic, ends):,.0f} records/s")
        for mode in MERGES:
            rate = apply_backlog(kafka, topic, ends, mode, Path(scratch) / f"batch-{args.batch}", args.batch)
            print(f"apply ({mode}): {rate:,.0f} records/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
