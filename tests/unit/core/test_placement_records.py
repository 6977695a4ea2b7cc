"""The assignment's records: one per store, small at any cluster size, and a root that names which generation
of each belongs together."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from keyroute.cluster import placement_records as records
from keyroute.cluster.partition_map import Assignment, RecordError


def test_a_placement_record_round_trips_and_stays_small_whatever_the_cluster() -> None:
    nodes = [f"keyroute-node-{i:04d}" for i in range(1000)]
    replicas = tuple(tuple(nodes[(p * 7 + k * 331) % 1000] for k in range(3)) for p in range(1000))
    raw = records.placement_record(12, replicas)
    assert records.parse_placement_record(raw) == (12, replicas)
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
    a5 = records.placement_record(5, (("n1",),))
    b4 = records.placement_record(4, (("n2",),))
    assert records.assemble(root, {"a": a5, "b": b4}) == Assignment(5, {"a": (("n1",),), "b": (("n2",),)})
    # The controller has written b's next record but not yet the root: b is ahead of what the root names.
    with pytest.raises(records.InProgress, match="store b: placement record at assignment generation 6"):
        records.assemble(root, {"a": a5, "b": records.placement_record(6, (("n1",),))})
    with pytest.raises(records.InProgress, match="store b: no record yet"):
        records.assemble(root, {"a": a5, "b": None})
    with pytest.raises(RecordError):
        records.assemble(root, {"a": b"{not json", "b": b4})


def test_a_nodes_share_round_trips_and_stays_small_at_the_target_size() -> None:
    # 1,000 nodes, 100 stores x 1,000 partitions, rf 3: about 300 replicas per node, 3 per store.
    share = {f"store-{s:03d}": (1000, frozenset((s * 7 + k * 333) % 1000 for k in range(3))) for s in range(100)}
    raw = records.share_record(9, share)
    assert records.parse_share_record(raw) == (9, share)
    assert len(raw) < 8 * 1024  # a node reads this, not 100 placement records of ~35 KB each
    with pytest.raises(RecordError, match="outside"):
        records.parse_share_record(records.share_record(9, {"a": (4, frozenset({4}))}))
    with pytest.raises(RecordError):
        records.parse_share_record(b'{"generation": 1, "stores": {"a": {"partitions": 2}}}')


def test_the_root_says_whether_share_records_are_written() -> None:
    assert records.parse_root(records.root_record(3, {"a": 2})) == (3, {"a": 2}, True)
    # A controller from before share records: readers then read every placement record.
    assert records.parse_root(b'{"generation": 3, "stores": {"a": 2}}') == (3, {"a": 2}, False)
    assert records.parse_root(records.root_record(3, {"a": 2}, share_records=False)).share_records is False


_NODES = st.sampled_from(["n1", "n2", "n3", "n4", "n5"])
_REPLICAS = st.lists(_NODES, min_size=0, max_size=3, unique=True).map(tuple)
_STORE = st.integers(1, 6).flatmap(lambda n: st.lists(_REPLICAS, min_size=n, max_size=n).map(tuple))
_ASSIGNMENT = st.dictionaries(st.sampled_from(["a", "b", "c"]), _STORE, max_size=3)


@given(before=_ASSIGNMENT, after=_ASSIGNMENT, keep=st.sets(st.sampled_from(["a", "b", "c"])))
def test_shares_updated_from_the_difference_equal_shares_computed_whole(
    before: dict[str, tuple[tuple[str, ...], ...]],
    after: dict[str, tuple[tuple[str, ...], ...]],
    keep: set[str],
) -> None:
    # Some stores keep the very same replica lists (the controller's placement reuses unchanged ones).
    after = {**after, **{s: before[s] for s in keep if s in before}}
    old, new = Assignment(1, before), Assignment(2, after)
    was = records.shares(old)
    held = records.shares(old)
    touched = records.update_shares(old, new, held)
    whole = records.shares(new)
    assert held == whole
    # Exactly the nodes whose share differs are rewritten (a change of replica order alone is none).
    assert touched >= {n for n in was.keys() | whole.keys() if was.get(n) != whole.get(n)}
    assert all(was.get(n) != whole.get(n) or _reshaped(old, new, n) for n in touched)


def _reshaped(old: Assignment, new: Assignment, node: str) -> bool:
    """A store the node is in changed its partition count (or came or went): its record is rewritten whole."""
    return any(
        len(old.stores.get(s, ())) != len(new.stores.get(s, ()))
        and any(node in reps for reps in old.stores.get(s, ()) + new.stores.get(s, ()))
        for s in old.stores.keys() | new.stores.keys()
    )
