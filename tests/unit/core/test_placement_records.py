"""The assignment's records: one per store, small at any cluster size, and a root that names which generation
of each belongs together."""

from __future__ import annotations

import pytest

from keyroute.core import placement_records as records
from keyroute.core.partition_map import Assignment, RecordError


def test_a_store_record_round_trips_and_stays_small_whatever_the_cluster() -> None:
    nodes = [f"keyroute-node-{i:04d}" for i in range(1000)]
    replicas = tuple(tuple(nodes[(p * 7 + k * 331) % 1000] for k in range(3)) for p in range(1000))
    raw = records.store_record(12, replicas)
    assert records.parse_store_record(raw) == (12, replicas)
    # 1,000 partitions x 3 replicas: far below ZooKeeper's 1 MB record limit, however many stores exist.
    assert len(raw) < 64 * 1024


def test_only_changed_stores_are_rewritten_and_the_root_names_each_stores_generation() -> None:
    before = Assignment(3, {"a": (("n1", "n2"),), "b": (("n2", "n1"),), "old": (("n1",),)})
    wanted = Assignment(4, {"a": (("n1", "n2"),), "b": (("n1", "n2"),), "new": (("n2",),)})
    writes, named, gone = records.changes(wanted, before, {"a": 2, "b": 3, "old": 1})
    assert sorted(writes) == ["b", "new"]
    assert named == {"a": 2, "b": 4, "new": 4}
    assert gone == ["old"]
    # Without a previous assignment (a new controller with nothing to start from), every store is written.
    writes, named, _ = records.changes(wanted, None, {})
    assert sorted(writes) == ["a", "b", "new"] and set(named.values()) == {4}


def test_a_reader_never_takes_a_half_written_assignment() -> None:
    root = records.root_record(5, {"a": 5, "b": 4})
    a5 = records.store_record(5, (("n1",),))
    b4 = records.store_record(4, (("n2",),))
    assert records.assemble(root, {"a": a5, "b": b4}) == Assignment(5, {"a": (("n1",),), "b": (("n2",),)})
    # The controller has written b's next record but not yet the root: b is ahead of what the root names.
    with pytest.raises(records.InProgress, match="store b: record at generation 6"):
        records.assemble(root, {"a": a5, "b": records.store_record(6, (("n1",),))})
    with pytest.raises(records.InProgress, match="store b: no record yet"):
        records.assemble(root, {"a": a5, "b": None})
    with pytest.raises(RecordError):
        records.assemble(root, {"a": b"{not json", "b": b4})
