"""History and windowed stores whose time column is text (JSON lines, CSV) or epoch milliseconds, built by the
real pipeline (the session's SparkSession and ZooKeeper): the same events as JSON lines with ISO 8601 times in
every spelling, as CSV and as parquet with a timestamp column give the same files and, read through a real
`keyroute node` process, the same history and windows answers; a text that is no time fails the build naming
the value and its line."""

from __future__ import annotations

import datetime as dt
import json
import random
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pytest
from pyspark.sql import SparkSession

from keyroute.keys.key_format import KeyFormat
from keyroute.pipeline.build import build
from keyroute.pipeline.errors import DataError
from keyroute.runtime.settings import ZkSettings
from keyroute.storage.snapshot import read_manifest
from keyroute.storage.timeline import TimeType, key_part
from tests.integration.test_pipeline import assert_nothing_published, write_csv, write_jsonl, write_spec
from tests.integration.test_timeline_pipeline import BOOKINGS, EPOCH, bookings, entries_by_key, micros, write_parquet
from tests.integration.test_timeline_reads import iso, path
from tests.util import Proc, free_port, wait_for

pytestmark = pytest.mark.integration

PARTITIONS = 3
KEYS = [f"C{i:03d}" for i in range(15)] + ["東京"]
FORMATS = ("json", "csv", "parquet")


def iso_text(us: int, form: int) -> str:
    """The time `us` (microseconds since the epoch) in one of six ISO 8601 spellings, all the same instant."""
    moment = EPOCH + dt.timedelta(microseconds=us)
    form %= 6
    if form == 0:
        return moment.isoformat().replace("+00:00", "Z")  # 2024-06-11T10:00:00.250000Z
    if form == 1:
        return moment.astimezone(dt.timezone(dt.timedelta(hours=2))).isoformat()  # ...12:00:00+02:00
    if form == 2:
        text = moment.astimezone(dt.timezone(-dt.timedelta(hours=5, minutes=30))).isoformat()
        return text[:-3] + text[-2:]  # ...04:30:00-0530
    if form == 3:
        return moment.replace(tzinfo=None).isoformat(sep=" ")  # no offset: UTC
    if form == 4:
        return moment.strftime("%Y-%m-%dT%H:%M:%S") + f".{moment.microsecond:06d}999Z"  # nanoseconds, cut
    return moment.isoformat(timespec="milliseconds")  # ...10:00:00.250+00:00


def test_json_lines_with_iso_times_answer_as_csv_and_parquet_do(
    spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path
) -> None:
    rows = bookings(random.Random(30), KEYS, 400)
    for n, row in enumerate(rows):
        row["ms"] = row["ts"] // 1000
        row["day"] = (EPOCH + dt.timedelta(microseconds=row["ts"] + n * 86_400_000_000)).date().isoformat()
    texts = [{**row, "ts": iso_text(row["ts"], n)} for n, row in enumerate(rows)]
    write_jsonl(tmp_path / "events.json", texts)
    write_csv(tmp_path / "events.csv", texts)
    write_parquet(
        tmp_path / "events.parquet",
        rows,
        BOOKINGS.append(pa.field("ms", pa.int64())).append(pa.field("day", pa.string())),
    )
    stores: dict[str, dict[str, Any]] = {}
    for fmt in FORMATS:
        common = {"source": f"events.{fmt}", "format": fmt, "key": "customer", "partitions": PARTITIONS}
        stores[f"trips_{fmt}"] = {**common, "mode": "history", "order_by": "ts", "columns": ["seq", "fare", "route"]}
        stores[f"per10_{fmt}"] = {
            **common,
            "mode": "windowed",
            "order_by": "ts",
            "window": "10 minutes",
            "aggregations": {"n": "count(*)", "total": "sum(fare)", "last": "max(ts)"},
        }
    parquet = {"source": "events.parquet", "format": "parquet", "key": "customer", "partitions": PARTITIONS}
    stores["trips_ms"] = {**parquet, "mode": "history", "order_by": "ms", "order_by_type": "timestamp"}
    stores["days_json"] = {
        "source": "events.json",
        "format": "json",
        "key": "customer",
        "partitions": PARTITIONS,
        "mode": "history",
        "order_by": "day",
        "order_by_type": "date",
        "columns": ["seq"],
    }
    spec = write_spec(tmp_path / "stores.toml", stores)
    published = {p.store: p for p in build(spec, zk_settings, str(tmp_path / "out"), spark=spark)}

    # The files: every key's entries (time, JSON text) the same, byte for byte.
    files = {name: entries_by_key(Path(p.snapshot), PARTITIONS, KeyFormat.STRING) for name, p in published.items()}
    assert len(files["trips_parquet"]) == len(KEYS)
    for kind in ("trips", "per10"):
        manifest = read_manifest(Path(published[f"{kind}_json"].snapshot))
        assert manifest.timeline is not None and manifest.timeline.time_type is TimeType.TIMESTAMP
        for fmt in ("json", "csv"):
            assert set(files[f"{kind}_{fmt}"]) == set(files[f"{kind}_parquet"])
            for key, entries in files[f"{kind}_parquet"].items():
                assert files[f"{kind}_{fmt}"][key] == entries, (kind, fmt, key)
    # Epoch milliseconds are the same instants; a history row carries them as its time column.
    for key, entries in files["trips_parquet"].items():
        by_ms = files["trips_ms"][key]
        assert [t for t, _ in by_ms] == [t for t, _ in entries]
        assert sorted(micros(json.loads(v)["ms"]) for _, v in by_ms) == [t for t, _ in entries]
    # Dates from text: days since the epoch.
    days = read_manifest(Path(published["days_json"].snapshot)).timeline
    assert days is not None and days.time_type is TimeType.DATE
    for key in KEYS:
        expected_days = sorted(
            (dt.date.fromisoformat(r["day"]) - EPOCH.date()).days for r in rows if r["customer"] == key
        )
        assert [t for t, _ in files["days_json"][key_part(key.encode())]] == expected_days

    # The answers, read through a node that serves every partition.
    port = free_port()
    node = Proc(
        ["node", "--zk", zk_settings.connect_string, "--node-id", "node-0", "--port", str(port),
         "--data-dir", str(tmp_path / "node-0"), "--zk-session-timeout-s", "4"],
        tmp_path / "node-0.log",
    ).start()  # fmt: skip
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:

            def answers(store: str, key: str, read: str, params: dict[str, str] | None = None) -> dict[str, Any]:
                resp = client.get(path(store, key, read), params=params)
                assert resp.status_code == 200, (store, key, resp.text)
                body = resp.json()
                assert body.pop("store") == store
                return body

            def served() -> bool:
                return all(
                    client.get(path(f"{kind}_{fmt}", key, read)).status_code == 200
                    for kind, read in (("trips", "history"), ("per10", "windows"))
                    for fmt in FORMATS
                    for key in (KEYS[0], KEYS[-1])
                )

            wait_for(served, timeout_s=120, message="the node to serve every store")
            for key in KEYS:
                times = sorted(r["ts"] for r in rows if r["customer"] == key)
                window = {"from": iso(times[len(times) // 4]), "to": iso(times[3 * len(times) // 4]), "limit": "10000"}
                history = answers("trips_parquet", key, "history", {"limit": "10000"})
                assert [micros(r["ts"]) for r in history["rows"]] == times
                ranged = answers("trips_parquet", key, "history", window)
                assert 0 < len(ranged["rows"]) < len(times)
                windows = answers("per10_parquet", key, "windows")
                assert sum(w["value"]["n"] for w in windows["windows"]) == len(times)
                for fmt in ("json", "csv"):
                    assert answers(f"trips_{fmt}", key, "history", {"limit": "10000"}) == history, (fmt, key)
                    assert answers(f"trips_{fmt}", key, "history", window) == ranged, (fmt, key)
                    assert answers(f"per10_{fmt}", key, "windows") == windows, (fmt, key)
    finally:
        node.stop()


@pytest.mark.parametrize(
    ("fmt", "where"),
    [("json", "events.json/part-a.json line 4"), ("csv", "events.csv line 5"), ("parquet", "key 'c'")],
)
def test_a_time_text_that_does_not_parse_names_the_value_and_where_it_is(
    spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path, fmt: str, where: str
) -> None:
    rows = [
        {"k": "a", "ts": "2024-06-11T10:00:00Z", "n": 1},
        {"k": "b", "ts": "2024-06-11 12:00:00+02:00", "n": 2},
        {"k": "a", "ts": None, "n": 3},
        {"k": "c", "ts": "11/06/2024 10:00", "n": 4},
        {"k": "b", "ts": "2024-13-01T00:00:00Z", "n": 5},
    ]
    source = tmp_path / f"events.{fmt}"
    if fmt == "json":  # two files, each with a bad text: the first file's first one is named
        write_jsonl(source / "part-b.json", [{"k": "z", "ts": "now", "n": 0}])
        write_jsonl(source / "part-a.json", rows)
    elif fmt == "csv":
        write_csv(source, rows)
    else:
        schema = pa.schema([("k", pa.string()), ("ts", pa.string()), ("n", pa.int64())])
        write_parquet(source, rows[:2] + rows[3:] + rows[2:3], schema)  # the bad texts in the first file
    spec = write_spec(
        tmp_path / "stores.toml",
        {"trips": {"source": source.name, "format": fmt, "key": "k", "partitions": 2, "mode": "history",
                   "order_by": "ts"}},
    )  # fmt: skip
    with pytest.raises(DataError) as err:
        build(spec, zk_settings, str(tmp_path / "out"), spark=spark)
    message = str(err.value)
    assert message.startswith("store 'trips': order_by column 'ts' holds '11/06/2024 10:00' (")
    assert f"{where}), which is not an ISO 8601 timestamp such as 2024-06-11T10:00:00Z" in message
    assert "\n" not in message
    assert_nothing_published(zk_settings, tmp_path / "out", ["trips"])
