"""Co-location groups: after any history of nodes joining and leaving (with zones) and stores being added to
groups or alone, every store of a group has the same replica list, preferred replica first, for every
partition; the group's partitions get min(largest replication factor, nodes) distinct replicas; stores
outside groups are placed as `assign` places them; an unchanged cluster keeps its assignment."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keyroute.cluster.colocation import colocation_groups
from keyroute.cluster.partition_map import Assignment
from keyroute.state_node.placement import StoreShape, assign
from keyroute.state_node.placement.groups import assign_grouped

EXAMPLES = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ZONES = ("zone-a", "zone-b", "zone-c", "")


def check_groups(stores: dict[str, StoreShape], links: dict[str, str | None], nodes: list[str], a: Assignment) -> None:
    groups = colocation_groups(links, list(stores))
    by_group: dict[str, list[str]] = {}
    for name, group in groups.items():
        by_group.setdefault(group, []).append(name)
    for names in by_group.values():
        first = a.stores[names[0]]
        rf = max(stores[name][1] for name in names)
        for name in names:
            assert a.stores[name] == first, (name, names[0])
        for replicas in first:
            assert len(set(replicas)) == len(replicas) == min(rf, len(nodes))
            assert set(replicas) <= set(nodes)
    for name, (partitions, rf) in stores.items():
        assert len(a.stores[name]) == partitions
        for replicas in a.stores[name]:
            assert len(set(replicas)) == len(replicas) == min(rf, len(nodes)) or name in groups


# A step of a cluster's history: a node joins (with a zone), a node leaves, or a store is published, alone
# or co-located with an existing one.
steps = st.one_of(
    st.tuples(st.just("join"), st.sampled_from(ZONES)),
    st.tuples(st.just("leave"), st.integers(0, 50)),
    st.tuples(st.just("store"), st.integers(1, 3), st.one_of(st.none(), st.integers(0, 50))),
)


@EXAMPLES
@given(st.integers(1, 6), st.integers(1, 8), st.lists(steps, min_size=1, max_size=12))
def test_grouped_stores_share_replicas_through_any_history(start_nodes: int, partitions: int, history: list) -> None:  # type: ignore[type-arg]
    zones = {f"n{i}": ZONES[i % len(ZONES)] for i in range(start_nodes)}
    stores: dict[str, StoreShape] = {"s0": StoreShape(partitions, 2)}
    links: dict[str, str | None] = {"s0": None}
    previous: Assignment | None = None
    joined = start_nodes
    for generation, step in enumerate(history, start=1):
        if step[0] == "join":
            zones[f"n{joined}"] = step[1]
            joined += 1
        elif step[0] == "leave" and len(zones) > 1:
            del zones[sorted(zones)[step[1] % len(zones)]]
        elif step[0] == "store":
            name = f"s{len(stores)}"
            target = None if step[2] is None else sorted(stores)[step[2] % len(stores)]
            # A co-located store has its group's partition count (the build refuses any other).
            count = stores[target][0] if target is not None else (partitions + len(stores)) % 9 + 1
            stores[name] = StoreShape(count, step[1])
            links[name] = target
        nodes = sorted(zones)
        groups = colocation_groups(links, list(stores))
        a = assign_grouped(stores, groups, nodes, previous, generation, zones=zones)
        check_groups(stores, links, nodes, a)
        # Nothing changed: nothing moves.
        again = assign_grouped(stores, groups, nodes, a, generation + 1, zones=zones)
        assert dict(again.stores) == dict(a.stores)
        previous = a


@EXAMPLES
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(1, 3)), min_size=1, max_size=4), st.integers(1, 7))
def test_without_groups_the_placement_is_assigns(shapes: list[tuple[int, int]], count: int) -> None:
    stores = {f"s{i}": StoreShape(*shape) for i, shape in enumerate(shapes)}
    nodes = [f"n{i}" for i in range(count)]
    assert assign_grouped(stores, {}, nodes, None, 1) == assign(stores, nodes, None, 1)


def test_groups_are_the_connected_stores() -> None:
    links: dict[str, str | None] = {"a": None, "b": "a", "c": "b", "d": None, "e": "gone", "f": "d"}
    assert colocation_groups(links) == {"a": "a", "b": "a", "c": "a", "d": "d", "f": "d"}
    # A store not among those placed joins nothing.
    assert colocation_groups(links, ["b", "c", "e"]) == {"b": "b", "c": "b"}
