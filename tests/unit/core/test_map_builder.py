"""MapBuilder and RoutingTable follow changes incrementally: after any sequence of record changes, the
derived map and table are exactly what a whole build from the same records gives."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from keyroute.cluster.partition_map import (
    EMPTY_ASSIGNMENT,
    Assignment,
    MapBuilder,
    NodeRecord,
    PartitionMap,
    ServingRecord,
    StoreRecord,
)
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.router.routing_table import RoutingTable

NODES = ("n1", "n2", "n3", "n4")
STORES = ("a", "b")


def store(name: str, partitions: int, version: int, key_format: KeyFormat = KeyFormat.STRING) -> StoreRecord:
    return StoreRecord(
        name=name,
        partitions=partitions,
        partitioner=Partitioner.MURMUR2,
        key_format=key_format,
        version=version,
        snapshot=f"/snap/{name}/v{version}",
    )


stores_st = st.builds(
    store,
    st.sampled_from(STORES),
    st.integers(1, 4),
    st.integers(1, 2),
    st.sampled_from((KeyFormat.STRING, KeyFormat.INT32)),
)
serving_st = st.builds(
    lambda node_id, port, stores: ServingRecord(node_id, f"http://127.0.0.1:{port}", stores),
    st.sampled_from(NODES),
    st.sampled_from((9001, 9002)),
    st.dictionaries(
        st.sampled_from((*STORES, "unknown")),
        st.dictionaries(st.integers(-1, 3), st.sampled_from((1, 1, 2)), min_size=2, max_size=5),
        min_size=1,
        max_size=3,
    ),
)
assignment_st = st.builds(
    lambda generation, stores: Assignment(generation, stores),
    st.integers(1, 5),
    st.dictionaries(
        st.sampled_from(STORES),
        st.lists(st.permutations(NODES).map(lambda nodes: tuple(nodes[:3])), min_size=3, max_size=4).map(tuple),
        max_size=2,
    ),
)
serving_change_st = st.tuples(st.just("serving"), st.sampled_from(NODES), serving_st)
serving_gone_st = st.tuples(st.just("serving"), st.sampled_from(NODES), st.none())
assignment_change_st = st.tuples(st.just("assignment"), st.just(""), assignment_st)
change_st = st.one_of(
    st.tuples(st.just("store"), st.sampled_from(STORES), st.none() | stores_st),
    st.tuples(st.just("node"), st.sampled_from(NODES), st.none() | st.booleans()),
    serving_change_st,
    serving_change_st,
    serving_change_st,
    serving_gone_st,
    assignment_change_st,
    assignment_change_st,
    st.tuples(st.just("stale"), st.just(""), st.booleans()),
)


def apply(builder: MapBuilder, change: tuple[str, str, object]) -> None:
    kind, name, value = change
    if kind == "store":
        record = None if value is None else store(name, value.partitions, value.version, value.key_format)  # type: ignore[attr-defined]
        builder.set_store(name, record)
    elif kind == "node":
        builder.set_node(name, None if value is None else NodeRecord(name, f"http://{name}", leaving=bool(value)))
    elif kind == "serving":
        builder.set_serving(name, None if value is None else ServingRecord(name, value.url, value.stores))  # type: ignore[attr-defined]
    elif kind == "assignment":
        builder.set_assignment(value)  # type: ignore[arg-type]


def table_view(table: RoutingTable) -> tuple[object, ...]:
    return (
        table.complete,
        dict(table.last_known),
        table.ever_complete,
        table.ready,
        dict(table.reads),
        table.complete_stores,
        dict(table.map.routes),
    )


@settings(max_examples=400, deadline=None)
@given(st.lists(st.lists(change_st, min_size=1, max_size=4), min_size=1, max_size=12))
def test_incremental_maps_and_tables_equal_whole_builds_after_any_changes(batches: list) -> None:
    builder = MapBuilder()
    for name in STORES:  # both stores exist from the start (changes may remove or reshape them)
        builder.set_store(name, store(name, 4, 1))
    derived: RoutingTable | None = None
    whole: RoutingTable | None = None
    current: PartitionMap | None = None
    for batch in batches:
        stale = None
        for change in batch:
            if change[0] == "stale":
                stale = change[2]
            else:
                apply(builder, change)
        new_map = builder.build(generation=len(batch), built_at=1.0)
        expected = PartitionMap.build(
            builder.stores, builder.nodes, builder.assignment, builder.serving, generation=len(batch), built_at=1.0
        )
        assert dict(new_map.routes) == dict(expected.routes)
        assert new_map.complete == expected.complete
        assert new_map.live_nodes() == expected.live_nodes()
        if current is not None:
            # What the delta does not name routes exactly as before (the very same values).
            assert new_map.delta is not None and new_map.delta.parent == current.seq
            for name, routes in new_map.routes.items():
                if name not in new_map.delta.stores and name in current.routes:
                    assert routes is current.routes[name]
        current = new_map
        for published in (new_map,) if stale is None else (new_map, new_map.marked_stale(stale)):
            derived = RoutingTable.of(published, derived)
            whole_next = RoutingTable.of(expected if published is new_map else expected.marked_stale(stale), whole)
            assert table_view(derived) == table_view(whole_next)
            whole = whole_next


def test_one_nodes_serving_change_recomputes_only_its_partitions() -> None:
    builder = MapBuilder()
    builder.set_store("a", store("a", 100, 1))
    builder.set_store("b", store("b", 100, 1))
    for i, node_id in enumerate(NODES):
        mine = {p: 1 for p in range(100) if p % 4 == i}
        builder.set_serving(node_id, ServingRecord(node_id, f"http://{node_id}", {"a": mine, "b": mine}))
    builder.set_assignment(EMPTY_ASSIGNMENT)
    first = builder.build()
    assert first.complete and first.delta is None
    builder.set_serving("n2", ServingRecord("n2", "http://n2", {"a": {p: 1 for p in range(100) if p % 4 == 1}}))
    second = builder.build()
    assert second.delta is not None and second.delta.parent == first.seq
    assert dict(second.delta.stores) == {"b": frozenset(p for p in range(100) if p % 4 == 1)}
    assert second.routes["a"] is first.routes["a"]
    assert not second.complete and second.store_complete("a") and not second.store_complete("b")
    table = RoutingTable.of(second, RoutingTable.of(first))
    assert table.reads["a"] is RoutingTable.of(first).reads["a"] or table.reads["a"].serving is first.routes["a"]
    assert table.last_known_endpoints("b", 1) == first.routes["b"][1]


def test_a_new_preferred_replica_reorders_that_partition_only() -> None:
    builder = MapBuilder()
    builder.set_store("a", store("a", 3, 1))
    for node_id in ("n1", "n2"):
        builder.set_serving(node_id, ServingRecord(node_id, f"http://{node_id}", {"a": {0: 1, 1: 1, 2: 1}}))
    builder.set_assignment(Assignment(1, {"a": (("n1", "n2"), ("n1", "n2"), ("n2", "n1"))}))
    first = builder.build()
    assert [ep.node_id for ep in first.routes["a"][0]] == ["n1", "n2"]
    builder.set_assignment(Assignment(2, {"a": (("n2", "n1"), ("n1", "n2"), ("n2", "n1"))}))
    second = builder.build()
    assert second.delta is not None and dict(second.delta.stores) == {"a": frozenset({0})}
    assert [ep.node_id for ep in second.routes["a"][0]] == ["n2", "n1"]
    assert second.routes["a"][1:] == first.routes["a"][1:]
    table = RoutingTable.of(second, RoutingTable.of(first))
    location = table.locate("a", "k")
    assert location.serving is second.routes["a"][location.partition]


def test_a_store_record_gone_without_a_tombstone_stays_orphaned_until_one_comes() -> None:
    builder = MapBuilder()
    a, b = store("a", 2, 1), store("b", 2, 1)
    builder.set_store("a", a)
    builder.set_store("b", b)
    builder.set_serving("n1", ServingRecord("n1", "http://127.0.0.1:9001", {"a": {0: 1, 1: 1}}))
    builder.build(1)
    # Gone from ZooKeeper, no tombstone: the last record read stays and still routes.
    builder.set_store("a", None, keep=True)
    kept = builder.build(2)
    assert kept.stores["a"] is a and kept.orphaned == frozenset({"a"}) and kept.deleted == {}
    assert kept.serving_endpoints("a", 0) and RoutingTable.of(kept).has_store("a")
    assert kept.describe()["stores"]["a"]["orphaned"] is True and "orphaned" not in kept.describe()["stores"]["b"]
    # Published again: no longer orphaned.
    builder.set_store("a", store("a", 2, 2))
    assert builder.build(3).orphaned == frozenset()
    builder.set_store("a", None, keep=True)
    # A tombstone of an earlier deletion (a ZooKeeper restored from an old backup) does not cover version 2.
    builder.set_deleted({"a": 1})
    assert builder.build(4).orphaned == frozenset({"a"})
    # Its own tombstone comes (after the record's removal was read, or before): the store goes.
    builder.set_deleted({"a": 2})
    deleted = builder.build(4)
    assert "a" not in deleted.stores and deleted.orphaned == frozenset() and deleted.deleted == {"a": 2}
    assert deleted.deletes("a", 1) and deleted.deletes("a", 2) and not deleted.deletes("a", 3)
    assert "a" not in deleted.routes and not RoutingTable.of(deleted).has_store("a")
    builder.set_store("b", None, keep=True)  # "b" has no tombstone
    builder.set_deleted({"a": 2})
    assert builder.build(5).orphaned == frozenset({"b"})
    # Without `keep` (a whole build from records) a missing record is simply absent.
    builder.set_store("b", None)
    assert "b" not in builder.build(6).stores
