"""keyroute.local.shared: one process of a host applies (the lock), the others read what its view file says."""

from __future__ import annotations

from pathlib import Path

from keyroute.cluster.partition_map import StoreRecord
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.local.shared import ApplyLock, HeldStore, read_view, view_stamp, write_view


def test_one_holder_at_a_time_and_the_next_takes_over_once_it_lets_go(tmp_path: Path) -> None:
    first, second = ApplyLock(tmp_path), ApplyLock(tmp_path)
    assert first.try_take() and first.held
    assert not second.try_take() and not second.held  # flock: another open file description is refused
    assert first.try_take()  # already held: still true
    first.release()
    assert second.try_take() and second.held
    second.release()


def test_the_view_file_round_trips_and_its_stamp_changes_on_every_write(tmp_path: Path) -> None:
    assert view_stamp(tmp_path) is None and read_view(tmp_path) is None
    record = StoreRecord("bookings", 4, Partitioner.MURMUR2, KeyFormat.STRING, 3, "/snapshots/bookings/v3", live=True)
    write_view(tmp_path, {"bookings": HeldStore(record, 3, (0, 2))}, generation=1)
    stamp = view_stamp(tmp_path)
    assert read_view(tmp_path) == (1, {"bookings": HeldStore(record, 3, (0, 2))})
    write_view(tmp_path, {}, generation=2)
    assert view_stamp(tmp_path) != stamp and read_view(tmp_path) == (2, {})
    (tmp_path / "local-view.json").write_text("{not json")
    assert read_view(tmp_path) is None  # being replaced or damaged: the reader keeps what it has
