"""The pipeline end to end on real Spark and a real ZooKeeper: events in, snapshots and store records out.

Expected state is computed independently in plain Python from the same events, and the snapshot is read
back with keyroute_core.snapshot, the way a node reads it.
"""

from __future__ import annotations

import csv
import json
import random
import subprocess
import sys
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient
from keyroute.core import zk_layout
from keyroute.core.key_format import KeyFormat, parse_key
from keyroute.core.partition_map import StoreRecord
from keyroute.core.partitioner import Partitioner, partition_for
from keyroute.core.settings import ZkSettings
from keyroute.core.snapshot import existing_versions, iter_partition, read_manifest
from keyroute.pipeline.build import PublishedVersion, build
from keyroute.pipeline.errors import DataError, PipelineError, PublishError, SpecError
from pyspark.sql import SparkSession

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
            writer.writerow(
                {k: "" if v is None else (repr(v) if isinstance(v, float) else v) for k, v in row.items()}
            )


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
        assert type(actual[column]) is type(value), (
            f"{where}: {column} is {actual[column]!r}, expected {value!r}"
        )


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
    seen: dict[str, int] = {}
    for partition in range(partitions):
        files = manifest.files[partition]
        assert len(files) == (1 if manifest.rows[partition] else 0), f"one file per partition: {files}"
        assert all(name.startswith(f"partition={partition}/part-") for name in files)
        # iter_partition itself fails when the rows found differ from the manifest's count.
        rows = list(iter_partition(snapshot, manifest, partition))
        keys = [key for key, _ in rows]
        assert keys == sorted(keys) and len(set(keys)) == len(keys), (
            f"partition {partition} not sorted by key"
        )
        for key, value in rows:
            assert partition_for(partitioner, parse_key(key_format, key).data, partitions) == partition, key
            assert key not in seen
            seen[key] = partition
            assert_same_typed(json.loads(value), expected_by_text[key], f"{published.store}[{key!r}]")
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
        StoreRecord(
            "counts", 3, Partitioner.MURMUR2, KeyFormat.INT32, version=41, snapshot="/elsewhere/v000041"
        ),
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
        ["key column 'customer_id' is not in the source; available: 'customer', 'ts'"],
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
    with pytest.raises(
        DataError, match="^store 'bad': 1 key\\(s\\) in column 'id' do not fit key format int32"
    ):
        build(spec, zk_settings, str(output), spark=spark)
    assert_nothing_published(zk_settings, output, ["good", "also_good", "bad"])
    assert (output / "good").is_dir()  # the store directory may stay; no version inside it does


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
    assert str(err.value).startswith(
        f"store 'gone': cannot read json source {str(tmp_path / 'nowhere.json')!r}"
    )
    assert_nothing_published(zk_settings, tmp_path / "out", ["gone"])


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
    assert lines == [{"store": "cli", "version": 1, "snapshot": snapshot, "rows": 2, "partitions": 3}]
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
