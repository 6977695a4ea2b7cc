"""The partitioner audit on real Spark and ZooKeeper: sources whose records carry the partition a producer
sent them to, computed here in plain Python with the scalar partitioners.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient
from pyspark.sql import SparkSession

from keyroute.cluster import zk_layout
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.pipeline.build import build
from keyroute.pipeline.errors import PartitionAuditError
from keyroute.runtime.settings import ZkSettings
from keyroute.storage.snapshot import existing_versions, read_manifest
from tests.integration.test_pipeline import partition_rows

pytestmark = pytest.mark.integration

Row = dict[str, Any]
Producer = Callable[[str, random.Random], int]


def producer(partitioner: Partitioner, partitions: int) -> Producer:
    return lambda key, _rng: partition_for(partitioner, key.encode("utf-8"), partitions)


def events(produce: Producer, count: int = 3000, keys: int = 400, seed: int = 7) -> list[Row]:
    rng = random.Random(seed)
    rows = []
    for ts in range(count):
        key = f"cust-{rng.randrange(keys):04d}"
        rows.append({"customer_id": key, "ts": ts, "fare": rng.randrange(100, 900), "partition": produce(key, rng)})
    return rows


def write_source(folder: Path, rows: list[Row]) -> str:
    folder.mkdir(parents=True)
    with open(folder / "part-0.json", "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(row) + "\n" for row in rows)
    return str(folder)


def write_spec(path: Path, stores: Mapping[str, Mapping[str, Any]]) -> Path:
    lines = []
    for name, fields in stores.items():
        lines.append(f"[stores.{name}]")
        lines.extend(f"{field} = {json.dumps(value)}" for field, value in fields.items())
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def store(source: str, partitions: int, partitioner: str = "murmur2") -> dict[str, Any]:
    return {
        "source": source,
        "format": "json",
        "key": "customer_id",
        "partitions": partitions,
        "partitioner": partitioner,
        "mode": "latest",
        "order_by": "ts",
        "source_partition_column": "partition",
    }


def published_stores(zk: ZkSettings) -> list[str]:
    client = KazooClient(hosts=zk.connect_string)
    client.start(timeout=10)
    try:
        return sorted(client.get_children(zk_layout.STORES)) if client.exists(zk_layout.STORES) else []
    finally:
        client.stop()
        client.close()


def failed_build(spark: SparkSession, zk: ZkSettings, tmp_path: Path, stores: Mapping[str, Any]) -> str:
    """Build, expect the audit to fail, check that nothing was published or left behind; the message."""
    output = tmp_path / "out"
    with pytest.raises(PartitionAuditError) as failure:
        build(write_spec(tmp_path / "stores.toml", stores), zk, str(output), spark=spark)
    assert published_stores(zk) == []
    for name in stores:
        assert existing_versions(str(output), name) == []
    return str(failure.value)


def test_a_source_placed_by_the_stores_partitioner_passes_and_is_published(
    spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path
) -> None:
    rows = events(producer(Partitioner.MURMUR2, 8))
    source = write_source(tmp_path / "bookings", rows)
    spec = write_spec(tmp_path / "stores.toml", {"bookings": store(source, 8)})

    [published] = build(spec, zk_settings, str(tmp_path / "out"), spark=spark)

    assert published_stores(zk_settings) == ["bookings"]
    manifest = read_manifest(Path(published.snapshot))
    # The Kafka partition is where a record was, not part of its value.
    assert manifest.value_columns == ("fare", "ts")
    seen = set()
    for partition in range(8):
        for key, _ in partition_rows(Path(published.snapshot), manifest, partition):
            assert all(row["partition"] == partition for row in rows if row["customer_id"] == key)
            seen.add(key)
    assert seen == {row["customer_id"] for row in rows}


def test_a_crc32_source_in_a_murmur2_store_fails_naming_crc32_and_publishes_nothing(
    spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path
) -> None:
    good = write_source(tmp_path / "good", events(producer(Partitioner.MURMUR2, 4)))
    source = write_source(tmp_path / "bookings", events(producer(Partitioner.CRC32, 6)))
    # The good store is written first: its version must be removed again when bookings fails.
    message = failed_build(spark, zk_settings, tmp_path, {"good": store(good, 4), "bookings": store(source, 6)})

    assert message.startswith("store 'bookings': partitioner audit: ")
    assert " of 3,000 records are not in the partition murmur2 assigns" in message
    assert 'they match crc32 (librdkafka\'s default consistent_random) — set partitioner = "crc32"' in message


def test_a_wrong_partition_count_is_named(spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path) -> None:
    source = write_source(tmp_path / "bookings", events(producer(Partitioner.MURMUR2, 12)))
    message = failed_build(spark, zk_settings, tmp_path, {"bookings": store(source, 6)})

    assert "source partitions go up to 11 but the store has 6 partitions" in message
    assert "they match murmur2 (the Java client's default) over 12 partitions — set partitions = 12" in message


def test_empty_keys_spread_by_consistent_random_in_a_crc32_store_are_reported(
    spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path
) -> None:
    def consistent_random(key: str, rng: random.Random) -> int:
        # librdkafka's default: crc32 for a key, a random partition for an empty (or null) one.
        return rng.randrange(5) if key == "" else partition_for(Partitioner.CRC32, key.encode("utf-8"), 5)

    rows = events(consistent_random)
    rng = random.Random(11)
    for row in rng.sample(rows, 60):
        row["customer_id"] = ""
        row["partition"] = consistent_random("", rng)
    empty_elsewhere = sum(1 for row in rows if row["customer_id"] == "" and row["partition"] != 0)
    assert empty_elsewhere
    source = write_source(tmp_path / "bookings", rows)

    message = failed_build(spark, zk_settings, tmp_path, {"bookings": store(source, 5, "crc32")})

    assert f"{empty_elsewhere:,} of 3,000 records are not in the partition crc32 assigns" in message
    assert (
        f"{empty_elsewhere:,} records with an empty key are not in partition 0, where crc32 puts it: "
        "empty keys are spread at random by consistent_random (librdkafka's default) and cannot be looked up"
    ) in message
    assert "they match" not in message


def test_int64_keys_produced_as_strings_and_null_partitions(
    spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path
) -> None:
    rng = random.Random(13)
    rows: list[Row] = []
    for ts in range(2000):
        account = rng.randrange(-(2**40), 2**40)
        # The producer's StringSerializer wrote the decimal text, not LongSerializer's 8 bytes.
        produced = partition_for(Partitioner.MURMUR2, str(account).encode("ascii"), 6)
        rows.append({"account": account, "ts": ts, "partition": None if ts < 3 else produced})
    source = write_source(tmp_path / "accounts", rows)
    spec = {**store(source, 6), "key": "account", "key_format": "int64"}

    message = failed_build(spark, zk_settings, tmp_path, {"accounts": spec})

    assert "records are not in the partition murmur2 assigns their key over 6 partitions" in message
    assert "; 3 have no source partition (null in column 'partition'); " in message
    assert message.endswith(
        "they match murmur2 (the Java client's default) of keys serialized as string (UTF-8 text, Kafka's "
        'StringSerializer) — set key_format = "string"'
    )
