"""A build leaves out what a store's `ttl` says is expired at the build's clock (real Spark local mode, embedded
ZooKeeper): a latest store's keys whose latest row is expired, a history store's expired rows, each at the
boundary a node serves by (keyroute.storage.ttl), one millisecond either side of it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql import SparkSession

from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.pipeline.build import build
from keyroute.runtime.settings import ZkSettings
from keyroute.storage.timeline import key_part
from keyroute.storage.ttl import Ttl
from tests.integration.test_pipeline import assert_snapshot, write_spec
from tests.integration.test_timeline_pipeline import entries_by_key, write_parquet

pytestmark = pytest.mark.integration

NOW_S = 1_800_000_000.0  # the build's clock (injected)
TTL = "1 hour"
CUTOFF_US = int(NOW_S * 1_000_000) - 3_600_000_000  # a time no later than this is expired
CUTOFF_MS = CUTOFF_US // 1000

LATEST = pa.schema([("customer", pa.string()), ("at_ms", pa.int64()), ("n", pa.int64())])
HISTORY = pa.schema([("customer", pa.string()), ("ts", pa.timestamp("us", tz="UTC")), ("n", pa.int64())])


def latest_rows() -> list[dict[str, Any]]:
    times = {
        "fresh": [CUTOFF_MS + 1],  # one ms younger than the ttl: served
        "boundary": [CUTOFF_MS],  # exactly the ttl old: expired
        "stale": [CUTOFF_MS - 1],
        "newer": [CUTOFF_MS - 5_000, CUTOFF_MS + 1],  # the latest row is fresh: the key keeps it
        "untimed": [None],  # no time: a node cannot age it, it is served
        "untimed_and_old": [None, CUTOFF_MS - 1],  # its latest row is expired
        "untimed_and_new": [None, CUTOFF_MS + 1],
    }
    return [{"customer": k, "at_ms": t, "n": i} for k, ts in times.items() for i, t in enumerate(ts)]


def history_rows() -> list[dict[str, Any]]:
    offsets_us = [-1_000, 0, 1_000, 3_600_000_000]  # a ms before, at, a ms after the boundary, and now
    rows = [{"customer": "k1", "ts": CUTOFF_US + d, "n": i} for i, d in enumerate(offsets_us)]
    rows += [{"customer": "k2", "ts": CUTOFF_US - 1_000 * i, "n": i} for i in range(3)]  # all expired
    return rows


def test_a_build_leaves_out_what_is_expired_at_its_clock(
    spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path
) -> None:
    latest, history = latest_rows(), history_rows()
    spec = write_spec(
        tmp_path / "stores.toml",
        {
            "profiles": {
                "source": str(write_parquet(tmp_path / "latest", latest, LATEST)),
                "format": "parquet",
                "key": "customer",
                "partitions": 2,
                "mode": "latest",
                "order_by": "at_ms",
                "columns": ["at_ms", "n"],
                "ttl": TTL,
            },
            "visits": {
                "source": str(write_parquet(tmp_path / "history", history, HISTORY)),
                "format": "parquet",
                "key": "customer",
                "partitions": 2,
                "mode": "history",
                "order_by": "ts",
                "columns": ["n"],
                "ttl": TTL,
            },
        },
    )
    published = {p.store: p for p in build(spec, zk_settings, str(tmp_path / "out"), spark=spark, clock=lambda: NOW_S)}

    # What a node serving every key's latest row at the same "now" would answer (its own rule, not the build's).
    ttl = Ttl.parse(TTL, "at_ms")
    newest: dict[str, dict[str, Any]] = {}
    for row in latest:
        held = newest.get(row["customer"])
        if held is None or (row["at_ms"] is not None and (held["at_ms"] is None or row["at_ms"] > held["at_ms"])):
            newest[row["customer"]] = {"at_ms": row["at_ms"], "n": row["n"]}
    served = {k: v for k, v in newest.items() if not ttl.expired(json.dumps(v).encode(), NOW_S)}
    assert set(served) == {"fresh", "newer", "untimed", "untimed_and_new"}  # the boundary as the node draws it
    assert_snapshot(
        published["profiles"],
        partitioner=Partitioner.MURMUR2,
        key_format=KeyFormat.STRING,
        partitions=2,
        value_columns=["at_ms", "n"],
        expected=served,
    )

    found = entries_by_key(Path(published["visits"].snapshot), 2, KeyFormat.STRING)
    assert set(found) == {key_part(b"k1")}  # every row of k2 expired
    assert [t for t, _ in found[key_part(b"k1")]] == [CUTOFF_US + 1_000, CUTOFF_US + 3_600_000_000]
    assert [json.loads(v)["n"] for _, v in found[key_part(b"k1")]] == [2, 3]
    assert published["visits"].rows == 2
