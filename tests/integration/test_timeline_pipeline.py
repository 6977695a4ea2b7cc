"""History and windowed stores built by the real pipeline (Spark local mode, embedded ZooKeeper): every file
holds exactly the entries a plain-Python computation over the same events expects, in LMDB order, under the
timeline layout (keyroute.storage.timeline)."""

from __future__ import annotations

import datetime as dt
import json
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.sql import SparkSession

from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.pipeline.build import build
from keyroute.pipeline.errors import DataError, SpecError
from keyroute.runtime.settings import ZkSettings
from keyroute.storage.snapshot import read_manifest
from keyroute.storage.timeline import StoreKind, TimeType, key_of_entry, key_part, split_entry
from tests.integration.test_pipeline import read_partition_file, store_record, write_spec

pytestmark = pytest.mark.integration

EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
BASE_US = 1_718_100_000_000_000  # 2024-06-11T10:00:00Z


def micros(text: str) -> int:
    """A timestamp as the answers spell it (ISO 8601), in microseconds since the epoch."""
    delta = dt.datetime.fromisoformat(text) - EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


BOOKINGS = pa.schema(
    [
        ("customer", pa.string()),
        ("ts", pa.timestamp("us", tz="UTC")),
        ("seq", pa.int64()),
        ("fare", pa.int64()),
        ("route", pa.string()),
    ]
)


def bookings(rng: random.Random, keys: list[Any], count: int) -> list[dict[str, Any]]:
    """Events with `ts` as microseconds since the epoch (written as a timestamp column)."""
    rows = []
    for n in range(count):
        rows.append(
            {
                "customer": rng.choice(keys),
                "ts": BASE_US + rng.randrange(0, 3_600) * 1_000_000 + rng.choice([0, 250_000]),
                "seq": n,
                "fare": rng.randrange(10, 500),
                "route": rng.choice(["LHR-JFK", "CDG-NRT", None]),
            }
        )
    return rows


def write_parquet(path: Path, rows: list[dict[str, Any]], schema: pa.Schema = BOOKINGS) -> Path:
    path.mkdir(parents=True)
    half = len(rows) // 2
    for index, part in enumerate((rows[:half], rows[half:])):
        table = pa.Table.from_pylist(part, schema=schema)
        pq.write_table(table, path / f"part-{index}.parquet")
    return path


def entries_by_key(snapshot: Path, partitions: int, key_format: KeyFormat) -> dict[bytes, list[tuple[int, bytes]]]:
    """key part -> [(time, value)] from every partition file, checking their order and (keys that are not
    hashed) their partition."""
    found: dict[bytes, list[tuple[int, bytes]]] = defaultdict(list)
    for partition in range(partitions):
        entries = read_partition_file(snapshot, partition)
        assert [k for k, _ in entries] == sorted(k for k, _ in entries)
        for lmdb_key, value in entries:
            part, time, _ = split_entry(lmdb_key)
            data = key_of_entry(lmdb_key)
            if data is not None:
                assert partition_for(Partitioner.MURMUR2, data, partitions) == partition
            found[part].append((time, value))
    return found


def test_a_history_store_keeps_every_row_of_a_key_in_time_order(
    spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path
) -> None:
    rng = random.Random(5)
    keys = [f"C{i:03d}" for i in range(30)] + ["a\x00b", "a", "é" * 300]
    rows = bookings(rng, keys, 600)
    source = write_parquet(tmp_path / "events", rows)
    spec = write_spec(
        tmp_path / "stores.toml",
        {
            "trips": {
                "source": str(source),
                "format": "parquet",
                "key": "customer",
                "partitions": 4,
                "mode": "history",
                "order_by": "ts",
                "columns": ["fare", "route"],
            },
            "recent": {
                "source": str(source),
                "format": "parquet",
                "key": "customer",
                "partitions": 3,
                "mode": "history",
                "order_by": "seq",
                "retention": "5 rows",
            },
        },
    )
    published = build(spec, zk_settings, str(tmp_path / "out"), spark=spark)
    by_store = {p.store: p for p in published}

    trips = read_manifest(Path(by_store["trips"].snapshot))
    assert trips.timeline is not None and trips.timeline.kind is StoreKind.HISTORY
    assert trips.total_rows == len(rows)
    found = entries_by_key(Path(by_store["trips"].snapshot), 4, KeyFormat.STRING)
    expected: dict[bytes, list[tuple[int, dict[str, Any]]]] = defaultdict(list)
    for row in rows:
        expected[key_part(row["customer"].encode())].append(
            (row["ts"], {"ts": row["ts"], "fare": row["fare"], "route": row["route"]})
        )
    assert set(found) == set(expected)
    for key, entries in expected.items():
        got = [(t, {**json.loads(v), "ts": micros(json.loads(v)["ts"])}) for t, v in found[key]]
        assert [t for t, _ in got] == sorted(t for t, _ in entries)
        assert sorted(got, key=lambda e: (e[0], json.dumps(e[1]))) == sorted(
            entries, key=lambda e: (e[0], json.dumps(e[1]))
        )
    record = store_record(zk_settings, "trips")
    assert record is not None and record.timeline == trips.timeline
    assert record.timeline.time_type is TimeType.TIMESTAMP and record.timeline.column == "ts"

    recent = entries_by_key(Path(by_store["recent"].snapshot), 3, KeyFormat.STRING)
    for key in expected:
        seqs = sorted(r["seq"] for r in rows if key_part(r["customer"].encode()) == key)[-5:]
        assert [t for t, _ in recent[key]] == seqs
        assert [json.loads(v)["seq"] for _, v in recent[key]] == seqs  # the row carries its order_by


def expected_windows(
    rows: list[dict[str, Any]], time_of: Any, size: int, advance: int
) -> dict[bytes, list[tuple[int, dict[str, int]]]]:
    """key part -> [(start, {"n", "total"})] in start order: count(*) and sum(fare) per window a row is in."""
    windows: dict[bytes, dict[int, dict[str, int]]] = defaultdict(dict)
    for row in rows:
        t = time_of(row)
        start = t - t % advance
        while start > t - size:
            agg = windows[key_part(row["customer"].encode())].setdefault(start, {"n": 0, "total": 0})
            agg["n"] += 1
            agg["total"] += row["fare"]
            start -= advance
    return {part: sorted(found.items()) for part, found in windows.items()}


def test_a_windowed_store_keeps_one_aggregate_per_key_and_window(
    spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path
) -> None:
    rng = random.Random(8)
    keys = [f"C{i:03d}" for i in range(20)]
    rows = bookings(rng, keys, 500)
    for row in rows:
        row["ms"] = row["ts"] // 1000 - 10**12 * rng.choice([0, 2])  # integer times, negative ones too
    schema = BOOKINGS.append(pa.field("ms", pa.int64()))
    source = write_parquet(tmp_path / "events", rows, schema)
    common = {"source": str(source), "format": "parquet", "key": "customer", "partitions": 3, "mode": "windowed"}
    aggregations = {"n": "count(*)", "total": "sum(fare)"}
    spec = write_spec(
        tmp_path / "stores.toml",
        {
            "tumbling": {**common, "order_by": "ts", "window": "10 minutes", "aggregations": aggregations},
            "hopping": {
                **common,
                "order_by": "ts",
                "window": "10 minutes",
                "advance": "4 minutes",
                "aggregations": aggregations,
            },
            "by_ms": {**common, "order_by": "ms", "window": "90 seconds", "aggregations": aggregations},
        },
    )
    published = {p.store: p for p in build(spec, zk_settings, str(tmp_path / "out"), spark=spark)}
    minute = 60_000_000
    cases = {
        "tumbling": (lambda r: r["ts"], 10 * minute, 10 * minute, TimeType.TIMESTAMP),
        "hopping": (lambda r: r["ts"], 10 * minute, 4 * minute, TimeType.TIMESTAMP),
        "by_ms": (lambda r: r["ms"], 90_000, 90_000, TimeType.INTEGER),
    }
    for name, (time_of, size, advance, time_type) in cases.items():
        manifest = read_manifest(Path(published[name].snapshot))
        timeline = manifest.timeline
        assert timeline is not None and timeline.kind is StoreKind.WINDOWED
        assert (timeline.window, timeline.advance, timeline.time_type) == (size, advance, time_type)
        expected = expected_windows(rows, time_of, size, advance)
        assert manifest.total_rows == sum(len(w) for w in expected.values())
        found = entries_by_key(Path(published[name].snapshot), 3, KeyFormat.STRING)
        assert set(found) == set(expected), name
        for part, windows in expected.items():
            got = [json.loads(v) for _, v in found[part]]
            assert [t for t, _ in found[part]] == [start for start, _ in windows], name
            assert [g["value"] for g in got] == [agg for _, agg in windows], name
            if time_type is TimeType.TIMESTAMP:
                assert [(micros(g["start"]), micros(g["end"])) for g in got] == [(s, s + size) for s, _ in windows]
            else:
                assert [(g["start"], g["end"]) for g in got] == [(s, s + size) for s, _ in windows]


def test_history_retention_by_duration_keeps_the_recent_rows(
    spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path
) -> None:
    rng = random.Random(9)
    rows = bookings(rng, ["A", "B", "C"], 200)
    source = write_parquet(tmp_path / "events", rows)
    spec = write_spec(
        tmp_path / "stores.toml",
        {
            "recent": {
                "source": str(source),
                "format": "parquet",
                "key": "customer",
                "partitions": 2,
                "mode": "history",
                "order_by": "ts",
                "retention": "20 minutes",
            }
        },
    )
    [published] = build(spec, zk_settings, str(tmp_path / "out"), spark=spark)
    latest = max(r["ts"] for r in rows)
    kept = [r for r in rows if r["ts"] > latest - 20 * 60_000_000]
    assert 0 < len(kept) < len(rows)
    found = entries_by_key(Path(published.snapshot), 2, KeyFormat.STRING)
    assert sorted(t for entries in found.values() for t, _ in entries) == sorted(r["ts"] for r in kept)


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"mode": "history"}, SpecError, "needs 'order_by'"),
        ({"mode": "history", "order_by": "ts", "snapshot_format": 1}, SpecError, "needs 'snapshot_format' 2"),
        ({"mode": "history", "order_by": "ts", "retention": "forever"}, SpecError, "'retention'"),
        (
            {"mode": "history", "order_by": "route"},
            DataError,
            "order_by column 'route' holds '(LHR-JFK|CDG-NRT)' .*, which is not an ISO 8601 timestamp",
        ),
        (
            {"mode": "history", "order_by": "seq", "order_by_type": "date"},
            DataError,
            "order_by_type is 'date' but column 'seq' of the source is bigint",
        ),
        ({"mode": "windowed", "order_by": "ts", "aggregations": {"n": "count(*)"}}, SpecError, "needs 'window'"),
        (
            {"mode": "windowed", "order_by": "ts", "window": "1 minute", "advance": "2 minutes",
             "aggregations": {"n": "count(*)"}},
            SpecError,
            "longer than 'window'",
        ),
        ({"mode": "latest", "order_by": "ts", "window": "1 minute"}, SpecError, "only applies to mode 'windowed'"),
        ({"mode": "latest", "order_by": "ts", "retention": "5 rows"}, SpecError, "'retention' only applies"),
        (
            {"mode": "windowed", "order_by": "seq", "window": "1500 us", "aggregations": {"n": "count(*)"}},
            SpecError,
            "'window'",
        ),
    ],
)  # fmt: skip
def test_bad_timeline_specs_are_refused_before_anything_is_published(
    spark: SparkSession,
    zk_settings: ZkSettings,
    tmp_path: Path,
    fields: dict[str, Any],
    error: type[Exception],
    message: str,
) -> None:
    source = write_parquet(tmp_path / "events", bookings(random.Random(1), ["A"], 4))
    spec = write_spec(
        tmp_path / "stores.toml",
        {"s": {"source": str(source), "format": "parquet", "key": "customer", "partitions": 2, **fields}},
    )
    with pytest.raises(error, match=message):
        build(spec, zk_settings, str(tmp_path / "out"), spark=spark)
    assert not list((tmp_path / "out").glob("s/v*")), "a version was left behind"
