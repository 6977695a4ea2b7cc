"""One partition's part of a key range (keyroute.storage.ranges.scan_partition, as a node answers it, over a real
LMDB file, both layouts) against a model: the partition's keys in the store's key order (bytes; integers
numerically), page by page."""

from __future__ import annotations

from pathlib import Path

import lmdb
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keyroute.keys.key_format import KeyFormat
from keyroute.replica.store import PartitionId, PartitionStore
from keyroute.storage.lmdb_layout import db_key
from keyroute.storage.ranges import order_of, prefix_end, scan_partition, scan_segments
from keyroute.storage.timeline import StoreKind, Timeline, TimeType, entry_key, key_part

STRINGS = [b"", b"a", b"a\x00", b"a\x00b", b"ab", b"b", b"\xc3\xa9", b"x" * 509, b"x" * 510, b"y" * 700, b"\x7f"]
INTS = [-(2**15), -300, -256, -1, 0, 1, 255, 256, 2**15 - 1]


def int16(n: int) -> bytes:
    return n.to_bytes(2, "big", signed=True)


def write(folder: Path, keys: list[bytes], timeline: bool) -> PartitionStore:
    env = lmdb.open(str(folder), map_size=1 << 24, subdir=True, max_dbs=0)
    with env.begin(write=True) as txn:
        for key in keys:
            if timeline:
                for time in (5, 1, 3):
                    txn.put(entry_key(key_part(key), time, 0), b'{"t":%d}' % time)
            else:
                txn.put(db_key(key), b'{"k":"%s"}' % key.hex().encode())
    kind = Timeline(StoreKind.HISTORY, "t", TimeType.INTEGER) if timeline else None
    return PartitionStore(PartitionId("s", 1, 0), folder, len(keys), env, timeline=kind)


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[KeyFormat, bool], PartitionStore]:
    made = {}
    for key_format, keys in ((KeyFormat.STRING, STRINGS), (KeyFormat.INT16, [int16(n) for n in INTS])):
        for timeline in (False, True):
            made[(key_format, timeline)] = write(tmp_path_factory.mktemp("p"), keys, timeline)
    yield made
    for store in made.values():
        store.close()


def read_all(
    store: PartitionStore, key_format: KeyFormat, low: bytes | None, high: bytes | None, limit: int
) -> list[bytes]:
    """Every key of the range, `limit` a page, continuing after the last key of each page."""
    keys: list[bytes] = []
    after = None
    for _ in range(40):
        found: list[tuple[bytes, bytes]] = []
        for start, end in scan_segments(key_format, low, high, after):
            scan_partition(store, key_format, start, end, low, high, after, limit + 1, found)
            if len(found) > limit:
                break
        keys += [data for data, _ in found[:limit]]
        if len(found) <= limit:
            return keys
        after = found[limit - 1][0]
    raise AssertionError("the range did not end")


def expected(
    keys: list[bytes], key_format: KeyFormat, low: bytes | None, high: bytes | None, timeline: bool
) -> list[bytes]:
    # Keys too long for LMDB are stored hashed: never in a range.
    stored = [k for k in keys if (key_part(k) if timeline else db_key(k))[:1] == b"="]
    kept = [
        k
        for k in stored
        if (low is None or order_of(key_format, k) >= order_of(key_format, low))
        and (high is None or order_of(key_format, k) < order_of(key_format, high))
    ]
    return sorted(kept, key=lambda k: order_of(key_format, k))


string_bounds = st.none() | st.sampled_from([*STRINGS, b"a\x00a", b"x" * 600, b"z", b"\xff"])
int_bounds = st.none() | st.sampled_from([int16(n) for n in (-(2**15), -257, -1, 0, 2, 256, 2**15 - 1)])


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(low=string_bounds, high=string_bounds, limit=st.integers(1, 4), timeline=st.booleans())
def test_string_ranges_are_in_byte_order(
    stores: dict[tuple[KeyFormat, bool], PartitionStore], low: bytes | None, high: bytes | None, limit: int,
    timeline: bool,
) -> None:  # fmt: skip
    store = stores[(KeyFormat.STRING, timeline)]
    assert read_all(store, KeyFormat.STRING, low, high, limit) == expected(
        STRINGS, KeyFormat.STRING, low, high, timeline
    )


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(low=int_bounds, high=int_bounds, limit=st.integers(1, 4), timeline=st.booleans())
def test_integer_ranges_are_in_numeric_order(
    stores: dict[tuple[KeyFormat, bool], PartitionStore], low: bytes | None, high: bytes | None, limit: int,
    timeline: bool,
) -> None:  # fmt: skip
    store = stores[(KeyFormat.INT16, timeline)]
    ints = [int16(n) for n in INTS]
    assert read_all(store, KeyFormat.INT16, low, high, limit) == expected(ints, KeyFormat.INT16, low, high, timeline)


def test_a_timeline_key_in_a_range_is_its_latest_entry(stores: dict[tuple[KeyFormat, bool], PartitionStore]) -> None:
    items, more, _ = stores[(KeyFormat.STRING, True)].key_range(b"=", b">", 100)
    assert not more and {value for _, value in items} == {b'{"t":5}'}


def test_prefix_ends() -> None:
    assert prefix_end(b"ab") == b"ac"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") is None
    assert prefix_end(b"") is None
