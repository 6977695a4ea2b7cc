"""A timeline partition's reads (`PartitionStore.entries`, and `get` = the latest entry) against a model:
every range, order, limit and continuation of a real LMDB file holding the timeline layout."""

from __future__ import annotations

import random
from pathlib import Path

import lmdb
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keyroute.replica.store import PartitionId, PartitionStore
from keyroute.storage.timeline import StoreKind, Timeline, TimeType, entry_key, key_part

KEYS = [b"", b"a", b"a\x00", b"a\x00b", b"ab", b"b", b"\xff" * 3, b"x" * 600]
Entries = dict[bytes, list[tuple[int, int, bytes]]]


def write_partition(folder: Path, entries: Entries) -> PartitionStore:
    folder.mkdir(parents=True, exist_ok=True)
    env = lmdb.open(str(folder), map_size=1 << 26, subdir=True, max_dbs=0)
    with env.begin(write=True) as txn:
        for key, rows in entries.items():
            for time, sequence, value in rows:
                txn.put(entry_key(key_part(key), time, sequence), value)
    timeline = Timeline(StoreKind.HISTORY, "ts", TimeType.INTEGER)
    count = sum(len(rows) for rows in entries.values())
    return PartitionStore(PartitionId("s", 1, 0), folder, count, env, timeline=timeline)


def model(
    rows: list[tuple[int, int, bytes]], low: int | None, high: int | None, descending: bool
) -> list[tuple[int, int, bytes]]:
    kept = sorted(r for r in rows if (low is None or r[0] >= low) and (high is None or r[0] < high))
    return kept[::-1] if descending else kept


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> tuple[PartitionStore, Entries]:
    rng = random.Random(3)
    entries: Entries = {}
    for key in KEYS:
        times = [rng.choice([-(2**63), -5, 0, 1, 2, 7, 7, 7, 40, 2**63 - 1]) for _ in range(rng.randrange(0, 25))]
        rows: dict[tuple[int, int], bytes] = {}
        for time in times:
            sequence = sum(1 for t, _ in rows if t == time)
            rows[(time, sequence)] = b'{"k":"%s","t":%d,"s":%d}' % (key.hex().encode(), time, sequence)
        entries[key] = [(t, s, v) for (t, s), v in rows.items()]
    # The greatest time and sequence: an entry key ending in 12 0xff bytes (what "after every entry" is).
    entries[b"edge"] = [(2**63 - 1, 2**32 - 1, b'{"last":1}'), (2**63 - 1, 0, b'{"t":0}'), (-1, 0, b'{"t":-1}')]
    store = write_partition(tmp_path_factory.mktemp("timeline"), entries)
    yield store, entries
    store.close()


bounds = st.none() | st.sampled_from([-(2**63), -6, -5, 0, 1, 3, 7, 8, 41, 2**63 - 1])


@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from([*KEYS, b"missing", b"a\x00\x00", b"edge"]), low=bounds, high=bounds,
       descending=st.booleans(), limit=st.integers(1, 6))  # fmt: skip
def test_pages_of_entries_are_the_model_s_range_in_order(
    stored: tuple[PartitionStore, Entries], key: bytes, low: int | None, high: int | None, descending: bool, limit: int
) -> None:
    store, entries = stored
    expected = model(entries.get(key, []), low, high, descending)
    got: list[tuple[int, int, bytes]] = []
    after = None
    for _ in range(len(expected) + 2):
        page, more = store.entries(key, low, high, limit, descending, after)
        assert len(page) <= limit
        got += page
        if not more:
            break
        assert len(page) == limit
        after = page[-1][:2]
    assert got == expected


def test_a_get_is_the_latest_entry_of_the_key(stored: tuple[PartitionStore, Entries]) -> None:
    store, entries = stored
    for key in [*KEYS, b"edge"]:
        rows = sorted(entries[key])
        assert store.get(key) == (rows[-1][2] if rows else None)
    assert store.get(b"missing") is None
