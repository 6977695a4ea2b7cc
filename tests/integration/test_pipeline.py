"""The pipeline end to end on real Spark and a real ZooKeeper: events in, snapshots and store records out.

Expected state is computed independently in plain Python from the same events. A format-2 version is read
back as a node reads it: every partition's data.mdb opened read-only with LMDB, its size and checksum
against the manifest, every entry against the LMDB key and value bytes of the expected rows (the bytes
format 1 gives a node, see test_format_2_holds_exactly_what_format_1_held).
"""

from __future__ import annotations

import csv
import json
import math
import os
import random
import subprocess
import sys
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import lmdb
import pytest
from kazoo.client import KazooClient
from pyspark.sql import SparkSession

from keyroute.cluster import zk_layout
from keyroute.cluster.partition_map import StoreRecord
from keyroute.keys.key_format import KeyFormat, key_from_data, key_from_value, parse_key
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.pipeline import lmdb_files, writer
from keyroute.pipeline.build import PublishedVersion, build
from keyroute.pipeline.errors import DataError, PipelineError, PublishError, SpecError
from keyroute.runtime.settings import ZkSettings
from keyroute.storage.lmdb_layout import db_key
from keyroute.storage.snapshot import (
    FORMAT_1,
    FORMAT_2,
    Manifest,
    checksum_file,
    compact_json,
    data_file,
    existing_versions,
    iter_partition,
    read_manifest,
)

pytestmark = pytest.mark.integration

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
AWKWARD_KEYS = [
    "a/b",
    "100%",
    "%2F",
    "a+b",
    "what?",
    "#frag",
    " spaced out ",
    "ü",
    "日本",
    "😀",
    "a b/c?d#e%20",
]

Row = dict[str, Any]


# --- events, and what the stores should hold, in plain Python ------------------------------------------


def maybe(rng: random.Random, value: Any, null_share: float = 0.15) -> Any:
    return None if rng.random() < null_share else value


def booking_events(rng: random.Random, count: int) -> list[Row]:
    customers = AWKWARD_KEYS + [f"cust-{i:03d}" for i in range(60)]
    return [
        {
            "customer_id": rng.choice(customers),
            # few distinct timestamps per key, so the latest row often ties and the tie-break is exercised
            "ts": rng.randrange(40),
            "route": maybe(rng, rng.choice(["LIS-OPO", "OPO-FAO", "FAO-LIS", "LIS-Ponta Delgada"])),
            "fare": maybe(rng, rng.uniform(-50.0, 900.0)),  # full-precision doubles must survive exactly
            "seats": maybe(rng, rng.randrange(1, 9)),
        }
        for _ in range(count)
    ]


def trade_events(rng: random.Random, count: int) -> list[Row]:
    accounts = [INT64_MIN, INT64_MAX, 0, -1, 1] + [rng.randrange(INT64_MIN, INT64_MAX) for _ in range(35)]
    return [
        {
            "account": rng.choice(accounts),
            "ts": i,  # unique, so max_by(price, ts) has one answer
            "qty": maybe(rng, rng.randrange(-1000, 1000)),
            # multiples of 1/4: sums are exact in any order, so Spark's and Python's totals agree to the bit
            "price": maybe(rng, rng.randrange(-4000, 40000) / 4),
            "note": maybe(rng, rng.choice(["block", "odd lot"]), null_share=0.97),
        }
        for i in range(count)
    ]


def session_events(rng: random.Random, count: int) -> list[Row]:
    sessions = [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(30)]
    return [
        {
            "session": rng.choice(sessions),
            "ts": rng.randrange(10_000),
            "device": maybe(rng, rng.choice(["ios", "android", "web"])),
            "score": maybe(rng, rng.random() * 100),
        }
        for _ in range(count)
    ]


def _nulls_lowest(value: Any) -> tuple[int, Any]:
    return (0, 0) if value is None else (1, value)


def expected_latest(events: Iterable[Row], key: str, order_by: str, columns: Sequence[str]) -> dict[Any, Row]:
    """The documented rule: greatest order_by; ties go to the greatest value columns in order, null lowest."""
    best: dict[Any, Row] = {}

    def rank(row: Row) -> tuple[Any, ...]:
        return (_nulls_lowest(row[order_by]), *[_nulls_lowest(row[c]) for c in columns])

    for row in events:
        current = best.get(row[key])
        if current is None or rank(row) > rank(current):
            best[row[key]] = row
    return {k: {c: row[c] for c in columns} for k, row in best.items()}


def expected_trades(events: Iterable[Row]) -> dict[int, Row]:
    """count(*), sum(qty), sum(price), min(price), max_by(price, ts), max(note): SQL semantics by hand."""
    by_key: dict[int, list[Row]] = defaultdict(list)
    for row in events:
        by_key[row["account"]].append(row)

    def total(values: list[Any]) -> Any:
        present = [v for v in values if v is not None]
        return sum(present) if present else None

    def smallest(values: list[Any]) -> Any:
        present = [v for v in values if v is not None]
        return min(present) if present else None

    result = {}
    for account, rows in by_key.items():
        latest = max(rows, key=lambda r: r["ts"])
        notes = [r["note"] for r in rows if r["note"] is not None]
        result[account] = {
            "trades": len(rows),
            "volume": total([r["qty"] for r in rows]),
            "notional": total([r["price"] for r in rows]),
            "low": smallest([r["price"] for r in rows]),
            "last_price": latest["price"],
            "note": max(notes) if notes else None,
        }
    return result


# --- files, specs and ZooKeeper --------------------------------------------------------------------------


def write_jsonl(path: Path, rows: Iterable[Row]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def write_csv(path: Path, rows: Sequence[Row]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            # repr() of a float is its shortest exact spelling; empty cells are nulls to Spark's CSV reader.
            writer.writerow({k: "" if v is None else (repr(v) if isinstance(v, float) else v) for k, v in row.items()})


def toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    return json.dumps(value)  # strings, ints and lists of strings are spelled alike in JSON and TOML


def write_spec(path: Path, stores: Mapping[str, Mapping[str, Any]]) -> Path:
    lines = []
    for name, fields in stores.items():
        lines.append(f'[stores."{name}"]')
        lines.extend(f"{field} = {toml_value(value)}" for field, value in fields.items())
        lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def store_record(zk_settings: ZkSettings, store: str) -> StoreRecord | None:
    client = KazooClient(hosts=zk_settings.connect_string)
    client.start(timeout=10)
    try:
        if client.exists(zk_layout.store_path(store)) is None:
            return None
        raw, _ = client.get(zk_layout.store_path(store))
        return StoreRecord.from_json(raw)
    finally:
        client.stop()
        client.close()


def publish_record(zk_settings: ZkSettings, record: StoreRecord) -> None:
    client = KazooClient(hosts=zk_settings.hosts)
    client.start(timeout=10)
    try:
        client.create(zk_settings.chroot + zk_layout.store_path(record.name), record.to_json(), makepath=True)
    finally:
        client.stop()
        client.close()


def assert_same_typed(actual: Row, expected: Row, where: str) -> None:
    assert actual == expected, where
    for column, value in expected.items():
        # 1 == 1.0 in Python: the type is what tells whether Spark kept an int an int.
        assert type(actual[column]) is type(value), f"{where}: {column} is {actual[column]!r}, expected {value!r}"


def read_partition_file(snapshot: Path, partition: int) -> list[tuple[bytes, bytes]]:
    """Every (LMDB key, value) of one format-2 partition file, in LMDB's order, opened read-only as a node
    opens it (no lock file: nothing is written into the snapshot)."""
    folder = snapshot / data_file(partition)
    env = lmdb.open(str(folder.parent), readonly=True, lock=False, subdir=True, max_dbs=0)
    try:
        with env.begin() as txn:
            return [(bytes(key), bytes(value)) for key, value in txn.cursor()]
    finally:
        env.close()


def assert_files_match_manifest(snapshot: Path, manifest: Manifest) -> None:
    """Format 2: one data.mdb per partition, empty ones included, with the manifest's size and checksum."""
    assert manifest.format == FORMAT_2
    for partition in range(manifest.partitions):
        path = snapshot / data_file(partition)
        assert manifest.files[partition] == (f"partition={partition}/data.mdb",)
        assert sorted(os.listdir(path.parent)) == ["data.mdb"], "only the data file: no lock or temporary file"
        checksum = checksum_file(path)
        assert (manifest.bytes[partition], manifest.checksums[partition]) == (checksum.size, checksum.value)
        assert manifest.checksums[partition].startswith("crc32:")


def partition_rows(snapshot: Path, manifest: Manifest, partition: int) -> list[tuple[str, bytes]]:
    """(key text, value bytes) of one partition of either format (format 2: keys that are not hashed)."""
    if manifest.format == FORMAT_1:
        return list(iter_partition(snapshot, manifest, partition))
    rows = read_partition_file(snapshot, partition)
    assert len(rows) == manifest.rows[partition]
    return [(key_from_data(manifest.key_format, key[1:]).text, value) for key, value in rows if key[:1] == b"="]


def assert_snapshot(
    published: PublishedVersion,
    *,
    partitioner: Partitioner,
    key_format: KeyFormat,
    partitions: int,
    value_columns: Sequence[str],
    expected: Mapping[Any, Row],
    text_of: Callable[[Any], str] = str,
) -> None:
    """Read the version as a node would and check placement, order, values and manifest against `expected`."""
    snapshot = Path(published.snapshot)
    manifest = read_manifest(snapshot)
    assert (manifest.store, manifest.version) == (published.store, published.version)
    assert (manifest.partitions, manifest.partitioner, manifest.key_format) == (
        partitions,
        partitioner,
        key_format,
    )
    assert manifest.value_columns == tuple(value_columns)
    assert manifest.total_rows == published.rows == len(expected)
    expected_by_text = {text_of(k): v for k, v in expected.items()}
    if manifest.format == FORMAT_1:
        assert_format_1(snapshot, manifest, expected_by_text, published.store)
        return
    assert_files_match_manifest(snapshot, manifest)
    # What each partition's file must hold: the LMDB key of every expected key, in the partition its
    # serialized bytes hash to, and the value as compact JSON.
    wanted: dict[int, dict[bytes, str]] = defaultdict(dict)
    for text in expected_by_text:
        data = parse_key(key_format, text).data
        wanted[partition_for(partitioner, data, partitions)][db_key(data)] = text
    for partition in range(partitions):
        entries = read_partition_file(snapshot, partition)
        assert len(entries) == manifest.rows[partition] == len(wanted[partition])
        assert [key for key, _ in entries] == sorted(wanted[partition]), f"partition {partition}: keys differ"
        for key, value in entries:
            text = wanted[partition][key]
            assert value == compact_json(json.loads(value)), "values are stored as compact JSON"
            assert_same_typed(json.loads(value), expected_by_text[text], f"{published.store}[{text!r}]")


def assert_format_1(snapshot: Path, manifest: Manifest, expected_by_text: Mapping[str, Row], store: str) -> None:
    seen: dict[str, int] = {}
    for partition in range(manifest.partitions):
        files = manifest.files[partition]
        assert len(files) == (1 if manifest.rows[partition] else 0), f"one file per partition: {files}"
        assert all(name.startswith(f"partition={partition}/part-") for name in files)
        # iter_partition itself fails when the rows found differ from the manifest's count.
        rows = list(iter_partition(snapshot, manifest, partition))
        keys = [key for key, _ in rows]
        assert keys == sorted(keys) and len(set(keys)) == len(keys), f"partition {partition} not sorted by key"
        for key, value in rows:
            owner = partition_for(manifest.partitioner, parse_key(manifest.key_format, key).data, manifest.partitions)
            assert owner == partition, key
            assert key not in seen
            seen[key] = partition
            assert_same_typed(json.loads(value), expected_by_text[key], f"{store}[{key!r}]")
    assert set(seen) == set(expected_by_text)


# --- a build that works ----------------------------------------------------------------------------------


@pytest.fixture
def events(tmp_path: Path) -> dict[str, list[Row]]:
    rng = random.Random(20240611)
    data = {
        "bookings": booking_events(rng, 2500),
        "trades": trade_events(rng, 1500),
        "sessions": session_events(rng, 600),
    }
    write_jsonl(tmp_path / "data" / "bookings" / "part-1.json", data["bookings"][:1200])
    write_jsonl(tmp_path / "data" / "bookings" / "part-2.json", data["bookings"][1200:])
    write_jsonl(tmp_path / "data" / "trades.json", data["trades"])
    write_csv(tmp_path / "data" / "sessions.csv", data["sessions"])
    return data


STORES: dict[str, dict[str, Any]] = {
    "bookings": {
        "source": "data/bookings",
        "format": "json",
        "key": "customer_id",
        "partitions": 7,
        "replication_factor": 2,
        "mode": "latest",
        "order_by": "ts",
    },
    "trades": {
        "source": "data/trades.json",
        "format": "json",
        "key": "account",
        "key_format": "int64",
        "partitions": 5,
        "partitioner": "crc32",
        "mode": "aggregate",
        "aggregations": {
            "trades": "count(*)",
            "volume": "sum(qty)",
            "notional": "sum(price)",
            "low": "min(price)",
            "last_price": "max_by(price, ts)",
            "note": "max(note)",
        },
    },
    "sessions": {
        "source": "data/sessions.csv",
        "format": "csv",
        "key": "session",
        "key_format": "uuid",
        "partitions": 3,
        "partitioner": "fnv1a",
        "mode": "latest",
        "order_by": "ts",
        "columns": ["score", "device", "ts"],
    },
}


def test_build_writes_and_publishes_every_store(
    spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path, events: dict[str, list[Row]]
) -> None:
    spec = write_spec(tmp_path / "stores.toml", STORES)
    output = tmp_path / "snap shots %41"  # taken literally: no URI decoding on the way to Spark
    published = build(spec, zk_settings, str(output), spark=spark)

    assert [(p.store, p.version, p.partitions) for p in published] == [
        ("bookings", 1, 7),
        ("trades", 1, 5),
        ("sessions", 1, 3),
    ]
    by_store = {p.store: p for p in published}
    # JSON schema inference lists columns alphabetically; by default every column but the key is a value.
    booking_columns = ["fare", "route", "seats", "ts"]
    assert_snapshot(
        by_store["bookings"],
        partitioner=Partitioner.MURMUR2,
        key_format=KeyFormat.STRING,
        partitions=7,
        value_columns=booking_columns,
        expected=expected_latest(events["bookings"], "customer_id", "ts", booking_columns),
    )
    assert_snapshot(
        by_store["trades"],
        partitioner=Partitioner.CRC32,
        key_format=KeyFormat.INT64,
        partitions=5,
        value_columns=["trades", "volume", "notional", "low", "last_price", "note"],
        expected=expected_trades(events["trades"]),
    )
    assert_snapshot(
        by_store["sessions"],
        partitioner=Partitioner.FNV1A,
        key_format=KeyFormat.UUID,
        partitions=3,
        value_columns=["score", "device", "ts"],
        expected=expected_latest(events["sessions"], "session", "ts", ["score", "device", "ts"]),
    )

    for p in published:
        assert Path(p.snapshot) == output / p.store / "v000001"
        record = store_record(zk_settings, p.store)
        assert record is not None
        assert (record.version, record.snapshot, record.partitions) == (1, p.snapshot, p.partitions)
        assert record.value_columns == read_manifest(Path(p.snapshot)).value_columns
    assert store_record(zk_settings, "bookings").replication_factor == 2  # type: ignore[union-attr]
    assert store_record(zk_settings, "trades").key_format is KeyFormat.INT64  # type: ignore[union-attr]

    # A second build is version 2, beside version 1, which stays intact for nodes still serving it.
    again = build(spec, zk_settings, str(output), spark=spark)
    assert [(p.store, p.version) for p in again] == [("bookings", 2), ("trades", 2), ("sessions", 2)]
    for p in again:
        assert existing_versions(str(output), p.store) == [1, 2]
        assert read_manifest(output / p.store / "v000001").version == 1
        assert store_record(zk_settings, p.store).version == 2  # type: ignore[union-attr]
    assert_snapshot(
        again[0],
        partitioner=Partitioner.MURMUR2,
        key_format=KeyFormat.STRING,
        partitions=7,
        value_columns=booking_columns,
        expected=expected_latest(events["bookings"], "customer_id", "ts", booking_columns),
    )


def test_latest_ties_are_broken_by_the_value_columns(
    spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path
) -> None:
    rows: list[Row] = [
        {"k": "a", "ts": 5, "v": 1.5, "w": None},
        {"k": "a", "ts": 5, "v": 2.5, "w": None},  # same ts, greater first value column: wins
        {"k": "a", "ts": 4, "v": 9.5, "w": "x"},
        {"k": "b", "ts": 1, "v": None, "w": "late"},
        {"k": "b", "ts": 1, "v": 0.5, "w": None},  # a null loses to any value
        {"k": "c", "ts": None, "v": 7.0, "w": "no ts"},
        {"k": "c", "ts": 0, "v": 0.0, "w": "ts 0"},  # a null order_by is lowest
    ]
    write_jsonl(tmp_path / "ties.json", rows)
    spec = write_spec(
        tmp_path / "stores.toml",
        {
            "ties": {
                "source": "ties.json",
                "format": "json",
                "key": "k",
                "partitions": 2,
                "mode": "latest",
                "order_by": "ts",
                "columns": ["v", "w"],
            }
        },
    )
    [published] = build(spec, zk_settings, str(tmp_path / "out"), spark=spark)
    assert_snapshot(
        published,
        partitioner=Partitioner.MURMUR2,
        key_format=KeyFormat.STRING,
        partitions=2,
        value_columns=["v", "w"],
        expected={"a": {"v": 2.5, "w": None}, "b": {"v": 0.5, "w": None}, "c": {"v": 0.0, "w": "ts 0"}},
    )


def test_version_continues_after_the_one_published_in_zookeeper(
    spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path
) -> None:
    write_jsonl(tmp_path / "e.json", [{"k": 1, "n": 2}, {"k": -7, "n": 3}])
    spec = write_spec(
        tmp_path / "stores.toml",
        {
            "counts": {
                "source": "e.json",
                "format": "json",
                "key": "k",
                "key_format": "int32",
                "partitions": 3,
                "mode": "aggregate",
                "aggregations": {"n": "sum(n)"},
            }
        },
    )
    # Published from another output directory (or one since cleaned up): numbering must still move forward.
    publish_record(
        zk_settings,
        StoreRecord("counts", 3, Partitioner.MURMUR2, KeyFormat.INT32, version=41, snapshot="/elsewhere/v000041"),
    )
    output = tmp_path.as_uri() + "/out"  # file:// URIs are accepted as output too
    [published] = build(spec, zk_settings, output, spark=spark)
    assert published.version == 42
    assert Path(published.snapshot) == tmp_path / "out" / "counts" / "v000042"
    assert store_record(zk_settings, "counts").version == 42  # type: ignore[union-attr]
    assert_snapshot(
        published,
        partitioner=Partitioner.MURMUR2,
        key_format=KeyFormat.INT32,
        partitions=3,
        value_columns=["n"],
        expected={1: {"n": 2}, -7: {"n": 3}},
    )


# --- format 2: ready-to-serve files -----------------------------------------------------------------------

SMALL_STORE = {"source": "e.json", "format": "json", "key": "k", "partitions": 6, "mode": "latest", "order_by": "ts"}


def value_events(rng: random.Random, keys: Sequence[Any]) -> list[Row]:
    """Rows whose values exercise the JSON path: nested objects, arrays, nulls, escapes, big and tiny numbers."""
    rows = []
    for ts, key in enumerate([*keys, *(rng.choice(keys) for _ in range(len(keys) * 2))]):  # every key, some often
        rows.append(
            {
                "k": key,
                "ts": ts,
                "fare": maybe(rng, rng.uniform(-1e-300, 1e300) if rng.random() < 0.2 else rng.random() * 100),
                "text": maybe(rng, rng.choice(["plain", "line\nbreak", 'quote " and \\', "ü 日本 😀", "\u0001"])),
                "nested": {"a": rng.randrange(-(2**62), 2**62), "b": [rng.random(), None]},
                "flag": rng.random() < 0.5,
                # Short decimals, written by Spark as they are; tiny and huge ones in Java's E notation.
                "price": round(rng.uniform(-1000, 1000) * 10 ** rng.choice([-7, -3, 0, 0, 0, 6]), rng.randrange(0, 4)),
            }
        )
    return rows


def format_pair(name: str, key_format: str, partitions: int, partitioner: str) -> dict[str, dict[str, Any]]:
    fields = {
        "source": f"{name}.json",
        "format": "json",
        "key": "k",
        "key_format": key_format,
        "partitions": partitions,
        "partitioner": partitioner,
        "mode": "latest",
        "order_by": "ts",
    }
    return {f"{name}-1": {**fields, "snapshot_format": 1}, f"{name}-2": fields}


def test_format_2_holds_exactly_what_format_1_held(
    spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path
) -> None:
    """The same rows written in both formats: every format-2 file holds, in LMDB's order, exactly the LMDB
    keys and value bytes a node makes of format 1's rows. Keys are chosen where Spark's order of the key
    text, of the key bytes and LMDB's order of its keys all differ: long (hashed) keys, which LMDB sorts
    first, bytes above 0x7f, negative integers (big-endian two's complement), keys that prefix others.
    String and uuid keys get their LMDB keys from the JVM (the text's bytes), the others from the route UDF;
    string keys none of which is hashed ("texts") and uuid keys are sorted by their text, the others by
    their LMDB key."""
    rng = random.Random(99)
    string_keys = [*AWKWARD_KEYS, "", "a", "ab", "a" * 510, "b" * 511, "c" * 700, "ç" * 300, "Z", "é"]
    byte_keys = [bytes([0x80]), b"\xff", b"\x00", b"\x00\x00", b"\x7f", b"\xff" * 600, b"a", b"ab"]
    byte_keys += [rng.randbytes(rng.randrange(1, 12)) for _ in range(40)]
    int_keys = [INT64_MIN, -1, 0, 1, 255, 256, -256, INT64_MAX]
    int_keys += [rng.randrange(INT64_MIN, INT64_MAX) for _ in range(30)]
    # uuid keys as a source may spell them (upper case too): stored under Kafka's lowercase text.
    uuid_keys = [str(uuid.UUID(int=rng.getrandbits(128))) for _ in range(20)]
    uuid_keys = [k.upper() if i % 3 == 0 else k for i, k in enumerate(uuid_keys)]
    sources = {
        "strings": ("string", 5, "murmur2", string_keys),
        # No key too long for LMDB: sorted by the key text (see keyroute.pipeline.writer._ordered_rows).
        "texts": ("string", 5, "murmur2", [key for key in string_keys if len(key.encode("utf-8")) < 511]),
        "bytes": ("bytes", 4, "crc32", [key_from_value(KeyFormat.BYTES, k).text for k in byte_keys]),
        "ints": ("int64", 3, "fnv1a", int_keys),
        "uuids": ("uuid", 3, "murmur2", uuid_keys),
    }
    for name, (key_format, partitions, partitioner, keys) in sources.items():
        write_jsonl(tmp_path / f"{name}.json", value_events(rng, keys))
        spec = write_spec(tmp_path / f"{name}.toml", format_pair(name, key_format, partitions, partitioner))
        f1, f2 = build(spec, zk_settings, str(tmp_path / "out" / name), spark=spark)
        one, two = read_manifest(Path(f1.snapshot)), read_manifest(Path(f2.snapshot))
        assert (one.format, two.format) == (FORMAT_1, FORMAT_2)
        assert (one.rows, one.value_columns) == (two.rows, two.value_columns)
        assert two.total_rows == len(set(keys))
        assert_files_match_manifest(Path(f2.snapshot), two)
        for partition in range(partitions):
            format_1 = {
                db_key(parse_key(one.key_format, key).data): value
                for key, value in iter_partition(Path(f1.snapshot), one, partition)
            }
            format_2 = read_partition_file(Path(f2.snapshot), partition)
            assert [key for key, _ in format_2] == sorted(format_1), f"{name} p{partition}: LMDB keys differ"
            assert dict(format_2) == format_1, f"{name} p{partition}: values differ"
        entries = [key for p in range(partitions) for key, _ in read_partition_file(Path(f2.snapshot), p)]
        hashed = sum(1 for key in entries if key[:1] == b"#")
        assert hashed == {"strings": 3, "texts": 0, "bytes": 1, "ints": 0, "uuids": 0}[name]


# Doubles and strings where Java's, Arrow's and Python's spellings part (see keyroute.pipeline.lmdb_files).
FLAT_DOUBLES = [
    0.0, -0.0, 1.0, 100.0, 0.1, 1e-4, 9.9999e-5, 1e-5, 1e-7, 5e-324, 1e15, 123456789012345.6, 9999999999999998.0,
    1e16, 1e21, 1e23, 1.7976931348623157e308, 0.30000000000000004, 12345678.125, 1e7, 1e-3,
    float("nan"), float("inf"), float("-inf"),
]  # fmt: skip
FLAT_TEXTS = [b"plain", "ü 日本 😀".encode(), b'quote " and \\', b"line\nbreak\x01", b"\x7f", b""]
FLAT_TEXTS += [b"bad \xff utf-8", b"\xe2\x82"]  # not UTF-8: Spark's JSON has U+FFFD for them


@pytest.mark.parametrize("large_var_types", [False, True])
def test_format_2_spells_flat_values_from_their_struct_as_format_1_holds_them(
    spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path, large_var_types: bool
) -> None:
    """A value of booleans, integers of every width, doubles and strings reaches the tasks as its struct,
    whose JSON they spell (keyroute.pipeline.lmdb_files.struct_texts) instead of Spark's to_json: the files
    hold exactly the value bytes a node makes of format 1's rows, for doubles where Java's, Arrow's and
    Python's spellings part, strings Python escapes, invalid UTF-8 (Spark writes U+FFFD) and nulls; also
    when Spark hands strings over as Arrow's large strings (spark.sql.execution.arrow.useLargeVarTypes)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(5)
    rows = 600
    doubles = [
        rng.choice(FLAT_DOUBLES) if rng.random() < 0.3 else round(rng.uniform(-1e4, 1e4), rng.randrange(4))
        for _ in range(rows)
    ]
    notes = pa.array([maybe(rng, rng.choice(FLAT_TEXTS)) for _ in range(rows)], pa.binary())
    longs = [maybe(rng, rng.randrange(INT64_MIN, INT64_MAX)) for _ in range(rows)]
    table = pa.table(
        {
            "k": pa.array([f"key-{i:04d}" for i in range(rows)], pa.string()),
            "ts": pa.array(range(rows), pa.int64()),
            "fare": pa.array([maybe(rng, d) for d in doubles], pa.float64()),
            "note": notes.cast(pa.string(), safe=False),
            "ok": pa.array([maybe(rng, rng.random() < 0.5) for _ in range(rows)], pa.bool_()),
            "b": pa.array([maybe(rng, rng.randrange(-128, 128)) for _ in range(rows)], pa.int8()),
            "h": pa.array([maybe(rng, rng.randrange(-(2**15), 2**15)) for _ in range(rows)], pa.int16()),
            "i": pa.array([maybe(rng, rng.randrange(-(2**31), 2**31)) for _ in range(rows)], pa.int32()),
            "a field \"named\" oddly": pa.array(longs, pa.int64()),
        }
    )
    (tmp_path / "flat").mkdir()
    pq.write_table(table, tmp_path / "flat" / "part-0.parquet")
    fields = {"source": "flat", "format": "parquet", "key": "k", "partitions": 3, "mode": "latest", "order_by": "ts"}
    spec = write_spec(tmp_path / "flat.toml", {"flat-1": {**fields, "snapshot_format": 1}, "flat-2": fields})
    value_type = spark.read.parquet(str(tmp_path / "flat")).drop("k").schema
    assert lmdb_files.VALUE_STRUCT in str(writer._value_column(value_type))  # the struct path is the one taken
    setting = "spark.sql.execution.arrow.useLargeVarTypes"
    before = spark.conf.get(setting, None)
    spark.conf.set(setting, str(large_var_types).lower())
    try:
        f1, f2 = build(spec, zk_settings, str(tmp_path / "out"), spark=spark)
    finally:
        spark.conf.unset(setting) if before is None else spark.conf.set(setting, before)
    one, two = read_manifest(Path(f1.snapshot)), read_manifest(Path(f2.snapshot))
    assert (one.format, two.format, two.total_rows) == (FORMAT_1, FORMAT_2, rows)
    for partition in range(3):
        format_1 = {
            db_key(parse_key(one.key_format, key).data): value
            for key, value in iter_partition(Path(f1.snapshot), one, partition)
        }
        assert dict(read_partition_file(Path(f2.snapshot), partition)) == format_1, f"p{partition}: values differ"
    stored = [v for p in range(3) for _, v in read_partition_file(Path(f2.snapshot), p)]
    assert any(b'"NaN"' in v for v in stored) and any("\ufffd".encode() in v for v in stored)  # redone rows are in


def test_empty_partitions_get_an_empty_file(spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "e.json", [{"k": "only", "ts": 1, "v": 1}, {"k": "two", "ts": 2, "v": None}])
    spec = write_spec(
        tmp_path / "stores.toml",
        {"sparse": {**SMALL_STORE, "partitions": 12}},
    )
    [published] = build(spec, zk_settings, str(tmp_path / "out"), spark=spark)
    snapshot = Path(published.snapshot)
    manifest = read_manifest(snapshot)
    assert_files_match_manifest(snapshot, manifest)
    empty = [p for p in range(12) if not manifest.rows[p]]
    assert len(empty) >= 10
    for p in empty:
        assert read_partition_file(snapshot, p) == []
        assert (manifest.bytes[p], manifest.checksums[p]) == (manifest.bytes[empty[0]], manifest.checksums[empty[0]])
    assert_snapshot(
        published,
        partitioner=Partitioner.MURMUR2,
        key_format=KeyFormat.STRING,
        partitions=12,
        value_columns=["ts", "v"],
        expected={"only": {"ts": 1, "v": 1}, "two": {"ts": 2, "v": None}},
    )


# --- builds that fail: nothing published, nothing left behind --------------------------------------------


def assert_nothing_published(zk_settings: ZkSettings, output: Path, stores: Iterable[str]) -> None:
    for store in stores:
        assert store_record(zk_settings, store) is None, f"{store} was published"
        assert existing_versions(str(output), store) == [], f"a version of {store} was left behind"


BAD_STORES: list[tuple[str, list[Row], dict[str, Any], type[PipelineError], list[str]]] = [
    (
        "missing key column",
        [{"customer": "a", "ts": 1}],
        {"key": "customer_id", "mode": "latest", "order_by": "ts"},
        DataError,
        ["key column 'customer_id' is not in the source (did you mean 'customer'?); available: 'customer', 'ts'"],
    ),
    (
        "key column differs in case",
        [{"Customer_ID": "a", "ts": 1}],
        {"key": "customer_id", "mode": "latest", "order_by": "ts"},
        DataError,
        ["did you mean 'Customer_ID'?"],
    ),
    (
        "missing order_by column",
        [{"k": "a", "t": 1}],
        {"key": "k", "mode": "latest", "order_by": "ts"},
        DataError,
        ["order_by column 'ts' is not in the source"],
    ),
    (
        "missing value column",
        [{"k": "a", "ts": 1}],
        {"key": "k", "mode": "latest", "order_by": "ts", "columns": ["ts", "fare"]},
        DataError,
        ["value column 'fare' is not in the source"],
    ),
    (
        "null keys",
        [{"k": "a", "ts": 1}, {"k": None, "ts": 2}, {"ts": 3}, {"k": "b", "ts": 4}],
        {"key": "k", "mode": "latest", "order_by": "ts"},
        DataError,
        ["2 source row(s) have a null key (column 'k')"],
    ),
    (
        "text that is no int64",
        [
            {"k": "12", "n": 1},
            {"k": "abc", "n": 1},
            {"k": "abc", "n": 2},
            {"k": " 7", "n": 1},
            {"k": 5, "n": 1},
        ],
        {"key": "k", "key_format": "int64", "mode": "aggregate", "aggregations": {"n": "sum(n)"}},
        DataError,
        ["2 key(s) in column 'k' do not fit key format int64", "'abc'", "' 7'"],
    ),
    (
        "int16 out of range",
        [{"k": 70000, "n": 1}, {"k": -32768, "n": 1}],
        {"key": "k", "key_format": "int16", "mode": "aggregate", "aggregations": {"n": "count(*)"}},
        DataError,
        ["1 key(s) in column 'k' do not fit key format int16", "key 70000 does not fit int16"],
    ),
    (
        "beyond 64 bits",
        [{"k": 9223372036854775808, "n": 1}],
        {"key": "k", "key_format": "int64", "mode": "aggregate", "aggregations": {"n": "count(*)"}},
        DataError,
        ["do not fit key format int64", "9223372036854775808"],
    ),
    (
        "fractional keys in an int store",
        [{"k": 1.5, "n": 1}],
        {"key": "k", "key_format": "int64", "mode": "aggregate", "aggregations": {"n": "count(*)"}},
        DataError,
        ["key column 'k' has type double, which cannot hold int64 keys"],
    ),
    (
        "not a uuid",
        [{"k": "5e0b6a52-4c52-4bd8-9b8e-3a2f4c9d1e7f", "n": 1}, {"k": "5e0b6a52", "n": 1}],
        {"key": "k", "key_format": "uuid", "mode": "aggregate", "aggregations": {"n": "count(*)"}},
        DataError,
        ["1 key(s) in column 'k' do not fit key format uuid", "'5e0b6a52' is not a valid uuid"],
    ),
    (
        "one uuid spelled two ways",
        [
            {"k": "5e0b6a52-4c52-4bd8-9b8e-3a2f4c9d1e7f", "n": 1},
            {"k": "5E0B6A52-4C52-4BD8-9B8E-3A2F4C9D1E7F", "n": 1},
        ],
        {"key": "k", "key_format": "uuid", "mode": "aggregate", "aggregations": {"n": "count(*)"}},
        DataError,
        ["1 key(s) in column 'k' are spelled several ways", "'5e0b6a52-4c52-4bd8-9b8e-3a2f4c9d1e7f' from"],
    ),
    (
        "aggregate over a missing column",
        [{"k": "a", "qty": 1}],
        {"key": "k", "mode": "aggregate", "aggregations": {"n": "count(*)", "volume": "sum(qtyy)"}},
        SpecError,
        ["aggregation 'volume' = 'sum(qtyy)' is not a valid Spark SQL aggregate"],
    ),
    (
        "not an aggregate",
        [{"k": "a", "qty": 1}],
        {"key": "k", "mode": "aggregate", "aggregations": {"next": "qty + 1"}},
        SpecError,
        ["aggregation 'next' = 'qty + 1' is not a valid Spark SQL aggregate"],
    ),
    (
        "unparsable expression",
        [{"k": "a", "qty": 1}],
        {"key": "k", "mode": "aggregate", "aggregations": {"volume": "sum(qty"}},
        SpecError,
        ["aggregation 'volume' = 'sum(qty' is not a valid Spark SQL aggregate"],
    ),
]


@pytest.mark.parametrize(
    ("rows", "fields", "error", "fragments"),
    [case[1:] for case in BAD_STORES],
    ids=[case[0] for case in BAD_STORES],
)
def test_a_bad_store_fails_the_build_and_publishes_nothing(
    spark: SparkSession,
    zk_settings: ZkSettings,
    tmp_path: Path,
    rows: list[Row],
    fields: dict[str, Any],
    error: type[PipelineError],
    fragments: list[str],
) -> None:
    write_jsonl(tmp_path / "bad.json", rows)
    spec = write_spec(
        tmp_path / "stores.toml", {"bad": {"source": "bad.json", "format": "json", "partitions": 4, **fields}}
    )
    output = tmp_path / "out"
    with pytest.raises(error) as err:
        build(spec, zk_settings, str(output), spark=spark)
    message = str(err.value)
    assert message.startswith("store 'bad': ")
    for fragment in fragments:
        assert fragment in message
    assert_nothing_published(zk_settings, output, ["bad"])


def test_a_failing_store_unwinds_the_stores_written_before_it(
    spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path
) -> None:
    write_jsonl(tmp_path / "good.json", [{"id": "x", "ts": 1}, {"id": "y", "ts": 2}])
    write_jsonl(tmp_path / "bad.json", [{"id": "12", "n": 1}, {"id": "twelve", "n": 1}])
    good = {
        "source": "good.json",
        "format": "json",
        "key": "id",
        "partitions": 2,
        "mode": "latest",
        "order_by": "ts",
    }
    bad = {
        "source": "bad.json",
        "format": "json",
        "key": "id",
        "key_format": "int32",
        "partitions": 2,
        "mode": "aggregate",
        "aggregations": {"n": "sum(n)"},
    }
    # Both good stores are computed and written before the bad one fails; their versions must go again.
    spec = write_spec(tmp_path / "stores.toml", {"good": good, "also_good": good, "bad": bad})
    output = tmp_path / "out"
    with pytest.raises(DataError, match="^store 'bad': 1 key\\(s\\) in column 'id' do not fit key format int32"):
        build(spec, zk_settings, str(output), spark=spark)
    assert_nothing_published(zk_settings, output, ["good", "also_good", "bad"])
    assert (output / "good").is_dir()  # the store directory may stay; no version inside it does


LATE_MISTAKES = [
    (
        "missing column",
        {"key": "id", "mode": "latest", "order_by": "when"},
        DataError,
        "store 'bad': order_by column 'when' is not in the source",
    ),
    (
        "key of the wrong type",
        {"key": "n", "key_format": "int64", "mode": "aggregate", "aggregations": {"rows": "count(*)"}},
        DataError,
        "store 'bad': key column 'n' has type double, which cannot hold int64 keys",
    ),
    (
        "time of the wrong type",
        {"key": "id", "mode": "history", "order_by": "n"},
        DataError,
        "store 'bad': order_by column 'n' is double: a history store orders by a timestamp, date or integer",
    ),
    (
        "window aggregate over a missing column",
        {"key": "id", "mode": "windowed", "order_by": "ts", "window": "1 minute", "aggregations": {"m": "max(nn)"}},
        SpecError,
        "store 'bad': aggregation 'm' = 'max(nn)' is not a valid Spark SQL aggregate",
    ),
]


@pytest.mark.parametrize(
    ("fields", "error", "message"), [case[1:] for case in LATE_MISTAKES], ids=[case[0] for case in LATE_MISTAKES]
)
def test_a_store_whose_columns_do_not_fit_fails_the_build_before_any_store_is_computed(
    spark: SparkSession,
    zk_settings: ZkSettings,
    tmp_path: Path,
    fields: dict[str, Any],
    error: type[PipelineError],
    message: str,
) -> None:
    write_jsonl(tmp_path / "events.json", [{"id": "x", "ts": 1, "n": 1.5}, {"id": "y", "ts": 2, "n": 2.5}])
    good = {"source": "events.json", "format": "json", "key": "id", "partitions": 2, "mode": "latest", "order_by": "ts"}
    bad = {"source": "events.json", "format": "json", "partitions": 2, **fields}
    spec = write_spec(tmp_path / "stores.toml", {"good": good, "also_good": good, "bad": bad})
    output = tmp_path / "out"
    with pytest.raises(error) as err:
        build(spec, zk_settings, str(output), spark=spark)
    assert str(err.value).startswith(message)
    assert_nothing_published(zk_settings, output, ["good", "also_good", "bad"])
    # The stores listed before it were never computed: no version of them was ever claimed.
    assert not output.exists() or not any(output.iterdir()), sorted(p.name for p in output.iterdir())


def test_missing_source_is_a_data_error(spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path) -> None:
    spec = write_spec(
        tmp_path / "stores.toml",
        {
            "gone": {
                "source": "nowhere.json",
                "format": "json",
                "key": "k",
                "partitions": 2,
                "mode": "latest",
                "order_by": "ts",
            }
        },
    )
    with pytest.raises(DataError) as err:
        build(spec, zk_settings, str(tmp_path / "out"), spark=spark)
    assert str(err.value) == f"store 'gone': source {str(tmp_path / 'nowhere.json')!r} does not exist"
    assert_nothing_published(zk_settings, tmp_path / "out", ["gone"])


def test_an_empty_source_directory_says_it_holds_no_data(
    spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path
) -> None:
    (tmp_path / "events").mkdir()
    (tmp_path / "only-empty").mkdir()
    (tmp_path / "only-empty" / "part-0.json").write_bytes(b"")
    for folder in ("events", "only-empty"):
        store = {"source": folder, "format": "json", "key": "k", "partitions": 2, "mode": "latest", "order_by": "ts"}
        spec = write_spec(tmp_path / "stores.toml", {"quiet": store})
        with pytest.raises(DataError) as err:
            build(spec, zk_settings, str(tmp_path / "out"), spark=spark)
        where = str(tmp_path / folder)
        assert str(err.value) == f"store 'quiet': source {where!r} holds no json data (no files, or only empty ones)"
        assert_nothing_published(zk_settings, tmp_path / "out", ["quiet"])


def test_changing_the_routing_shape_of_a_published_store_is_refused(
    spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path
) -> None:
    write_jsonl(tmp_path / "e.json", [{"k": "a", "ts": 1}, {"k": "b", "ts": 2}])
    fields = {
        "source": "e.json",
        "format": "json",
        "key": "k",
        "partitions": 4,
        "mode": "latest",
        "order_by": "ts",
    }
    output = tmp_path / "out"
    build(write_spec(tmp_path / "v1.toml", {"shape": fields}), zk_settings, str(output), spark=spark)

    changed = write_spec(tmp_path / "v2.toml", {"shape": {**fields, "partitions": 6, "partitioner": "crc32"}})
    with pytest.raises(PublishError) as err:
        build(changed, zk_settings, str(output), spark=spark)
    assert str(err.value).startswith(
        "store 'shape': cannot publish: partitions is 4 in ZooKeeper but 6 in the spec; "
        "partitioner is 'murmur2' in ZooKeeper but 'crc32' in the spec."
    )
    assert store_record(zk_settings, "shape").version == 1  # type: ignore[union-attr]
    assert existing_versions(str(output), "shape") == [1]


def small_source(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "e.json", [{"k": f"key-{i}", "ts": i, "v": i * 0.5} for i in range(200)])


def test_a_task_failing_after_writing_files_removes_the_version(
    spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An executor fails after it published a partition file: the build fails naming the store, the
    version (files already written included) is removed, nothing is published."""
    real_task = lmdb_files.partition_task

    def failing_task(destination: str) -> lmdb_files.BatchTask:
        task = real_task(destination)

        def write_then_fail(batches: Any) -> Any:
            for result in task(batches):
                yield result
                raise RuntimeError("injected: the executor died after one partition file")

        return write_then_fail

    monkeypatch.setattr(lmdb_files, "partition_task", failing_task)
    small_source(tmp_path)
    output = tmp_path / "out"
    with pytest.raises(PublishError) as err:
        build(write_spec(tmp_path / "stores.toml", {"dies": SMALL_STORE}), zk_settings, str(output), spark=spark)
    assert str(err.value).startswith("store 'dies': Spark failed while writing the partition files of ")
    assert_nothing_published(zk_settings, output, ["dies"])
    assert list((output / "dies").iterdir()) == []


def test_a_failure_before_the_manifest_removes_the_version(
    spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written: list[Path] = []

    def full_disk(location: Any, manifest: Manifest) -> None:
        written.extend(sorted(Path(location).rglob("data.mdb")))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer, "write_manifest", full_disk)
    small_source(tmp_path)
    output = tmp_path / "out"
    with pytest.raises(PublishError, match="^store 'full': writing version 1 to .* failed: .*No space left"):
        build(write_spec(tmp_path / "stores.toml", {"full": SMALL_STORE}), zk_settings, str(output), spark=spark)
    assert len(written) == 6  # every partition's file was in place when the manifest failed
    assert not any(path.exists() for path in written)
    assert_nothing_published(zk_settings, output, ["full"])


def test_format_1_stays_writable_for_older_nodes(spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path) -> None:
    small_source(tmp_path)
    spec = write_spec(tmp_path / "stores.toml", {"old": {**SMALL_STORE, "snapshot_format": 1}})
    [published] = build(spec, zk_settings, str(tmp_path / "out"), spark=spark)
    assert read_manifest(Path(published.snapshot)).format == FORMAT_1
    assert_snapshot(
        published,
        partitioner=Partitioner.MURMUR2,
        key_format=KeyFormat.STRING,
        partitions=6,
        value_columns=["ts", "v"],
        expected={f"key-{i}": {"ts": i, "v": i * 0.5} for i in range(200)},
    )


def download(filesystem: Any, path: str, target: Path) -> None:
    """Copy every object under `path` (pyarrow syntax) into the local directory `target`."""
    from pyarrow import fs as arrow_fs

    for info in filesystem.get_file_info(arrow_fs.FileSelector(path, recursive=True)):
        if info.type == arrow_fs.FileType.File:
            local = target / info.path[len(path) + 1 :]
            local.parent.mkdir(parents=True, exist_ok=True)
            with filesystem.open_input_stream(info.path) as stream:
                local.write_bytes(stream.read())


def test_a_build_to_object_storage(
    spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path, s3_bucket: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--output s3://bucket/prefix` (an S3-API server: see tests/integration/s3.py): versions are numbered,
    claimed, written, listed, removed after a failure, and dropped when no longer retained, all through
    pyarrow. The endpoint and credentials ride in the URI so that this session's executors, started before
    the server, reach it too (a real deployment gives them AWS_* environment variables)."""
    from keyroute.pipeline.publish import retaining

    server = s3_bucket.server
    query = f"endpoint_override={server.host}:{server.port}&scheme=http&region={server.region}"
    output = f"s3://{server.access_key}:{server.secret_key}@{s3_bucket.name}/{s3_bucket.prefix}?{query}"
    small_source(tmp_path)
    spec = write_spec(tmp_path / "stores.toml", {"objs": SMALL_STORE})
    expected = {f"key-{i}": {"ts": i, "v": i * 0.5} for i in range(200)}

    [first] = build(spec, zk_settings, output, spark=spark)
    assert first.snapshot == output.replace(f"?{query}", f"/objs/v000001?{query}")
    assert store_record(zk_settings, "objs").snapshot == first.snapshot  # type: ignore[union-attr]
    objects = s3_bucket.objects()
    assert [name for name in objects if "_claim-" in name] == [next(n for n in objects if "_claim-" in n)]
    assert sorted(name for name in objects if "_claim-" not in name) == sorted(
        ["objs/v000001/manifest.json", *[f"objs/v000001/partition={p}/data.mdb" for p in range(6)]]
    )
    manifest = read_manifest(first.snapshot)  # through pyarrow, as a node reads it
    assert manifest.format == FORMAT_2 and manifest.total_rows == 200
    local = tmp_path / "copy" / "v000001"
    download(s3_bucket.filesystem(), s3_bucket.path("objs", "v000001"), local)
    assert_files_match_manifest(local, manifest)
    value_columns = ["ts", "v"]
    copy = PublishedVersion("objs", 1, str(local), 200, 6)
    assert_snapshot(
        copy,
        partitioner=Partitioner.MURMUR2,
        key_format=KeyFormat.STRING,
        partitions=6,
        value_columns=value_columns,
        expected=expected,
    )

    # A failure before the manifest: version 2 is removed from the bucket, nothing is published.
    real_write_manifest = writer.write_manifest

    def failing(location: Any, manifest: Manifest) -> None:
        raise OSError("injected: the manifest upload failed")

    monkeypatch.setattr(writer, "write_manifest", failing)
    with pytest.raises(PublishError, match="^store 'objs': writing version 2 to s3://.* failed: injected"):
        build(spec, zk_settings, output, spark=spark)
    assert existing_versions(output, "objs") == [1]
    assert not [name for name in s3_bucket.objects() if name.startswith("objs/v000002")]
    assert store_record(zk_settings, "objs").version == 1  # type: ignore[union-attr]

    # The next build numbers past the versions in the bucket; retaining only it drops version 1 there.
    monkeypatch.setattr(writer, "write_manifest", real_write_manifest)
    with retaining(1):
        [second] = build(spec, zk_settings, output, spark=spark)
    assert second.version == 2
    assert existing_versions(output, "objs") == [2]
    assert not [name for name in s3_bucket.objects() if name.startswith("objs/v000001")]
    assert read_manifest(second.snapshot).rows == manifest.rows


# --- the CLI: `keyroute pipeline build` in its own process -----------------------------------------------


def run_cli(spec: Path, zk_settings: ZkSettings, output: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "keyroute",
            "pipeline",
            "build",
            "--spec",
            str(spec),
            "--zk",
            zk_settings.connect_string,
            "--output",
            output,
            "--master",
            "local[1]",
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_cli_builds_and_prints_each_published_version(zk_settings: ZkSettings, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "e.json", [{"k": "日本", "ts": 1, "v": 1.25}, {"k": "a/b", "ts": 2, "v": None}])
    spec = write_spec(
        tmp_path / "stores.toml",
        {
            "cli": {
                "source": "e.json",
                "format": "json",
                "key": "k",
                "partitions": 3,
                "mode": "latest",
                "order_by": "ts",
            }
        },
    )
    elsewhere = tmp_path / "elsewhere"  # sources are relative to the spec file, not the working directory
    elsewhere.mkdir()
    done = run_cli(spec, zk_settings, str(tmp_path / "out"), cwd=elsewhere)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    snapshot = str(tmp_path / "out" / "cli" / "v000001")
    assert lines == [{"store": "cli", "version": 1, "snapshot": snapshot, "rows": 2, "partitions": 3, "live": False}]
    assert store_record(zk_settings, "cli").snapshot == snapshot  # type: ignore[union-attr]


def test_cli_exits_non_zero_and_names_the_store(zk_settings: ZkSettings, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "e.json", [{"k": "a", "ts": 1}, {"k": None, "ts": 2}])
    spec = write_spec(
        tmp_path / "stores.toml",
        {
            "cli": {
                "source": "e.json",
                "format": "json",
                "key": "k",
                "partitions": 3,
                "mode": "latest",
                "order_by": "ts",
            }
        },
    )
    done = run_cli(spec, zk_settings, str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 1
    assert "keyroute pipeline build: store 'cli': 1 source row(s) have a null key (column 'k')" in done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout == ""
    assert_nothing_published(zk_settings, tmp_path / "out", ["cli"])


def test_session_settings(spark: SparkSession) -> None:
    conf = spark.sparkContext.getConf()
    assert conf.get("spark.ui.enabled") == "false"
    assert spark.conf.get("spark.sql.session.timeZone") == "UTC"
    assert spark.conf.get("spark.sql.execution.arrow.pyspark.enabled") == "true"
    assert spark.sparkContext.pythonExec == sys.executable


def test_a_failed_build_prints_one_line_without_sparks_start_up_notes_or_traces(
    zk_settings: ZkSettings, tmp_path: Path
) -> None:
    """The whole output of `keyroute pipeline build` in its own process (its own Spark driver JVM)."""
    write_jsonl(tmp_path / "events.json", [{"id": "a", "qty": 1}])
    store = {
        "source": "events.json",
        "format": "json",
        "key": "id",
        "partitions": 2,
        "mode": "aggregate",
        "aggregations": {"volume": "sum(qtyy)"},
    }
    spec = write_spec(tmp_path / "stores.toml", {"totals": store})
    done = subprocess.run(
        [sys.executable, "-m", "keyroute", "pipeline", "build", "--spec", str(spec), "--output", str(tmp_path / "out")]
        + ["--zk", zk_settings.connect_string, "--master", "local[1]"],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    lines = [line for line in done.stderr.splitlines() if " INFO keyroute.pipeline." not in line]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(
        "keyroute pipeline build: store 'totals': aggregation 'volume' = 'sum(qtyy)' is not a valid Spark SQL aggregate"
    )


# --- the bound on a row's JSON that sizes the write job's Arrow batches -----------------------------------


def test_a_rows_json_is_never_longer_than_the_bound_its_batches_are_sized_by(
    spark: SparkSession, tmp_path: Path
) -> None:
    """`json_bytes` bounds Spark's `to_json` of every value (the write job's Arrow batches hold as many rows
    as fit Spark's byte limit at that size): every scalar type at its widest, strings that escape to six
    bytes per byte, non-ASCII, base64 binary; a nested value has no bound."""
    import datetime
    import decimal

    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyspark.sql import functions as F

    from keyroute.pipeline.compute import compute_store
    from keyroute.pipeline.spec import parse_spec

    rng = random.Random(7)
    # The longest string (in bytes) is one that escapes to 6 bytes per byte: the bound is tight there.
    control = "\u0001" * 80
    widest = {
        "s": control,
        "b": b"\x00\xff" * 50,
        "l": -(2**63),
        "i": -(2**31),
        "h": -(2**15),
        "y": -128,
        "d": -1.2345678901234567e-308,
        "f": -1.1754944e-38,
        "m": decimal.Decimal("-1234567890123456789012345678.0123456789"),
        "day": datetime.date(9999, 12, 31),
        "at": datetime.datetime(1, 1, 1, 0, 0, 0, 1),
        "ok": False,
    }
    others = {
        "s": ["", "plain", '"\\' * 30, "ü 日本 😀" * 5, "\u2028\x7f\u0000", None],
        "b": [b"", rng.randbytes(7), None],
        "l": [2**63 - 1, 0, None],
        "i": [7, None],
        "h": [3, None],
        "y": [1, None],
        "d": [-math.inf, math.nan, -1.7976931348623157e308, None],
        "f": [-3.4028235e38, None],
        "m": [decimal.Decimal("1.5"), None],
        "day": [datetime.date(1, 1, 1), None],
        "at": [datetime.datetime(2026, 11, 26), None],
        "ok": [True, None],
    }
    rows = 200
    columns: dict[str, list[Any]] = {
        name: [value] + [rng.choice(others[name]) for _ in range(rows - 1)] for name, value in widest.items()
    }
    types = {"i": pa.int32(), "h": pa.int16(), "y": pa.int8(), "f": pa.float32(), "m": pa.decimal128(38, 10)}
    table = pa.table(
        {
            "k": [f"key-{i}" for i in range(rows)],
            "ts": list(range(rows)),
            **{name: pa.array(values, types.get(name)) for name, values in columns.items()},
            "nested": [{"a": [1, 2]} for _ in range(rows)],
        }
    )
    (tmp_path / "src").mkdir()
    pq.write_table(table, tmp_path / "src" / "part-0.parquet")
    flat = [c for c in table.column_names if c not in ("k", "ts", "nested")]
    spec = parse_spec(
        {
            "stores": {
                name: {"source": str(tmp_path / "src"), "format": "parquet", "key": "k", "partitions": 3,
                       "mode": "latest", "order_by": "ts", "columns": columns}
                for name, columns in {"flat": flat, "s": ["s"], "b": ["b"], "nested": ["s", "nested"]}.items()
            }
        },
        tmp_path,
    )  # fmt: skip
    slack = {}
    for store in spec.stores:
        computed = compute_store(spark, store)
        try:
            assert computed.key_bytes == len("key-199")  # the longest key's UTF-8
            if store.name == "nested":
                assert computed.json_bytes is None
                continue
            assert computed.json_bytes is not None
            longest = computed.frame.select(
                F.max(F.octet_length(F.to_json(F.col("value"), {"ignoreNullFields": "false"}))).alias("n")
            ).collect()[0]["n"]
            assert 0 < longest <= computed.json_bytes, store.name
            slack[store.name] = computed.json_bytes - longest
        finally:
            computed.release()
    # One string or binary field: the bound is the widest value's JSON but for the name's escaping and a comma.
    assert slack["s"] < 10 and slack["b"] < 10


def test_a_source_without_rows_builds_an_empty_version(
    spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path
) -> None:
    """A parquet source with its schema but no rows: every partition gets the empty file (format 2, whose
    Arrow batches are sized by the widest row: here there is none) or none (format 1)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "none").mkdir()
    schema = pa.schema([("k", pa.string()), ("ts", pa.int64()), ("note", pa.string())])
    pq.write_table(pa.table({"k": [], "ts": [], "note": []}, schema=schema), tmp_path / "none" / "part-0.parquet")
    fields = {"source": "none", "format": "parquet", "key": "k", "partitions": 3, "mode": "latest", "order_by": "ts"}
    spec = write_spec(tmp_path / "none.toml", {"none-1": {**fields, "snapshot_format": 1}, "none-2": fields})
    f1, f2 = build(spec, zk_settings, str(tmp_path / "out"), spark=spark)
    one, two = read_manifest(Path(f1.snapshot)), read_manifest(Path(f2.snapshot))
    assert (one.total_rows, two.total_rows) == (0, 0)
    assert_files_match_manifest(Path(f2.snapshot), two)
    assert all(read_partition_file(Path(f2.snapshot), p) == [] for p in range(3))
