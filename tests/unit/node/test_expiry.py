"""The sweep of a live partition's expired values (keyroute.replica.expiry) on a real LMDB environment, with an
injected clock: values (and history rows) one millisecond either side of the boundary, merge state, long keys,
metadata, a newer value written while a sweep waits for the write lock, and a partition closed meanwhile."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import lmdb
import orjson
import pytest

from keyroute.replica.expiry import sweep_expired
from keyroute.replica.live import LivePartition
from keyroute.replica.store import LivePartitionStore, PartitionId
from keyroute.storage.live import OFFSET_KEY, STATE_SEPARATOR
from keyroute.storage.lmdb_layout import db_key
from keyroute.storage.timeline import StoreKind, Timeline, TimeType, entry_key, key_part
from keyroute.storage.ttl import Ttl

NOW_S = 1_800_000_000.0
TTL = Ttl.parse("1 hour", "at")
CUTOFF_MS = int(NOW_S * 1000) - 3_600_000  # a time no later than this is expired at NOW_S


def value(at: object, n: int = 0) -> bytes:
    return orjson.dumps({"at": at, "n": n})


def live_partition(path: Path, timeline: Timeline | None = None) -> LivePartitionStore:
    env = lmdb.open(str(path), map_size=1 << 24, subdir=True)
    live = LivePartition("s", 1, 0, None, 0)  # type: ignore[arg-type]
    return LivePartitionStore(PartitionId("s", 1, 0), path, 0, env, timeline, live=live)


@pytest.fixture
def held(tmp_path: Path) -> Iterator[LivePartitionStore]:
    store = live_partition(tmp_path / "p0")
    yield store
    store.close()


def put(held: LivePartitionStore, rows: dict[bytes, bytes]) -> None:
    with held.write_lock:
        txn = held.write_txn()
        for key, stored in rows.items():
            txn.put(key, stored)
        txn.commit()


def stored(held: LivePartitionStore) -> dict[bytes, bytes]:
    with held.write_lock:
        txn = held.write_txn()
        try:
            return {bytes(k): bytes(v) for k, v in txn.cursor()}
        finally:
            txn.abort()


def test_values_a_millisecond_past_the_boundary_go_and_the_others_stay(held: LivePartitionStore) -> None:
    long_key = b"x" * 600  # kept under its SHA-256 (a '#' key)
    rows = {
        db_key(b"before"): value(CUTOFF_MS - 1),  # a ms older than the ttl
        db_key(b"at"): value(CUTOFF_MS),  # exactly the ttl old: expired
        db_key(b"after"): value(CUTOFF_MS + 1),  # a ms younger: served, kept
        db_key(b"text-after"): value("2027-01-15T07:00:00.001Z"),  # CUTOFF as text, plus a ms
        db_key(b"text-at"): value("2027-01-15T07:00:00.000Z"),
        db_key(b"untimed"): value(None),
        db_key(b"state"): value(CUTOFF_MS - 1) + STATE_SEPARATOR + b"[1,2]",  # a live fold's merge state
        db_key(long_key): value(CUTOFF_MS - 1),
        OFFSET_KEY: b"42",
    }
    assert TTL.cutoff_us(NOW_S) == CUTOFF_MS * 1000 == 1_799_996_400_000_000
    put(held, rows)
    calls: list[bool] = []

    def clock() -> float:
        calls.append(held.write_lock.locked())  # "now" is read inside the sweep's write transaction
        return NOW_S

    assert sweep_expired(held, TTL, clock, batch=2) == 5
    assert set(stored(held)) == {db_key(b"after"), db_key(b"text-after"), db_key(b"untimed"), OFFSET_KEY}
    assert calls and all(calls) and len(calls) >= 4  # one "now" per transaction of at most 2 keys
    assert sweep_expired(held, TTL, lambda: NOW_S) == 0
    # A millisecond later, the values that were a millisecond young are exactly ttl old.
    assert sweep_expired(held, TTL, lambda: NOW_S + 0.001) == 2
    assert set(stored(held)) == {db_key(b"untimed"), OFFSET_KEY}


def test_a_newer_value_written_while_the_sweep_waits_is_not_deleted(held: LivePartitionStore) -> None:
    put(held, {db_key(b"k"): value(CUTOFF_MS - 1), db_key(b"old"): value(CUTOFF_MS - 1)})
    counted: list[int] = []
    with held.write_lock:  # the applier is writing
        sweeper = threading.Thread(target=lambda: counted.append(sweep_expired(held, TTL, lambda: NOW_S)))
        sweeper.start()
        sweeper.join(0.05)
        assert sweeper.is_alive()  # waiting for the write lock
        txn = held.write_txn()
        txn.put(db_key(b"k"), value(CUTOFF_MS + 60_000, 1))  # the key's newer value
        txn.commit()
    sweeper.join(10)
    assert counted == [1]
    assert stored(held) == {db_key(b"k"): value(CUTOFF_MS + 60_000, 1)}


def test_a_closed_partition_is_left_alone(held: LivePartitionStore) -> None:
    put(held, {db_key(b"k"): value(CUTOFF_MS - 1)})
    held.close()
    assert sweep_expired(held, TTL, lambda: NOW_S) == 0


def test_a_history_partition_loses_the_rows_a_read_would_not_serve(tmp_path: Path) -> None:
    held = live_partition(tmp_path / "history", Timeline(StoreKind.HISTORY, "at", TimeType.TIMESTAMP))
    try:
        cutoff_us = CUTOFF_MS * 1000
        times = {"a": [cutoff_us - 1_000, cutoff_us, cutoff_us + 1_000, cutoff_us + 60_000_000], "b": [cutoff_us - 5]}
        rows = {
            entry_key(key_part(k.encode()), t, i): orjson.dumps({"at": t, "n": i})
            for k, ts in times.items()
            for i, t in enumerate(ts)
        }
        put(held, {**rows, OFFSET_KEY: b"9"})
        assert TTL.timeline_low(NOW_S, TimeType.TIMESTAMP) == cutoff_us + 1  # what a read of the history starts at
        assert sweep_expired(held, TTL, lambda: NOW_S, batch=2) == 3
        kept = {entry_key(key_part(b"a"), t, i) for i, t in enumerate(times["a"]) if t > cutoff_us}
        assert set(stored(held)) == {*kept, OFFSET_KEY}
    finally:
        held.close()
