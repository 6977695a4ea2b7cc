"""The placement's `holds` hint (keyroute.state_node.placement.assign): a replica the controller must place goes
to a node that already has the partition's files when balance and zones allow, and changes nothing else."""

from __future__ import annotations

import random

from keyroute.cluster.partition_map import Assignment, NodeRecord
from keyroute.state_node.placement import assign, moved_replicas
from tests.property.test_assignment_props import check_invariants

STORES = {"a": (24, 2), "b": (10, 2)}
NODES = ["n1", "n2", "n3"]


def _held_by(a: Assignment, node: str) -> dict[str, list[int]]:
    return {s: [p for p, reps in enumerate(per) if node in reps] for s, per in a.stores.items()}


def _new_on(before: Assignment, after: Assignment, node: str) -> dict[str, set[int]]:
    return {
        s: {p for p, reps in enumerate(per) if node in reps and node not in before.replicas(s, p)}
        for s, per in after.stores.items()
    }


def test_a_node_back_after_its_partitions_moved_away_gets_the_ones_on_its_disk() -> None:
    first = assign(STORES, NODES, None, 1)
    on_disk = _held_by(first, "n3")
    gone = assign(STORES, ["n1", "n2"], first, 2)  # n3 away past its grace: its partitions moved
    assert all("n3" not in reps for per in gone.stores.values() for reps in per)

    back = assign(STORES, NODES, gone, 3, holds={s: {"n3": parts} for s, parts in on_disk.items()})
    check_invariants(STORES, NODES, back)
    taken = _new_on(gone, back, "n3")
    assert sum(map(len, taken.values())) == sum(map(len, on_disk.values()))  # its full share again
    assert all(taken[s] <= set(on_disk[s]) for s in STORES)  # ...all of it from its own disk
    # Without the hint the same return takes partitions n3 would have to fetch: the hint decided.
    blind = _new_on(gone, assign(STORES, NODES, gone, 3), "n3")
    assert any(not blind[s] <= set(on_disk[s]) for s in STORES)
    # And it moves no more than without it.
    assert moved_replicas(gone, back) <= moved_replicas(gone, assign(STORES, NODES, gone, 3))


def test_the_hint_never_breaks_a_guarantee_and_an_unchanged_cluster_keeps_its_assignment() -> None:
    rng = random.Random(29)
    for _ in range(60):
        nodes = [f"n{i}" for i in range(rng.randint(2, 7))]
        stores = {f"s{i}": (rng.randint(1, 20), rng.randint(1, 3)) for i in range(rng.randint(1, 3))}
        zones = {n: rng.choice("xyz") for n in nodes} if rng.random() < 0.5 else None
        holds = {s: {n: rng.sample(range(p), rng.randint(0, p)) for n in nodes} for s, (p, _) in stores.items()}
        before = assign(stores, nodes[:-1], None, 1, zones=zones)
        after = assign(stores, nodes, before, 2, zones=zones, holds=holds)
        check_invariants(stores, nodes, after)
        assert assign(stores, nodes, after, 3, zones=zones, holds=holds).stores == after.stores


def test_a_node_record_lists_what_its_disk_holds() -> None:
    record = NodeRecord("n3", "http://n3:1", zone="z", holds=(("a", 1, (0, 4, 7)), ("b", 2, (1,))))
    read = NodeRecord.from_json(record.to_json())
    assert read == record
    assert read.held_at("a", 1) == (0, 4, 7) and read.held_at("a", 2) == () and read.held_at("c", 1) == ()
    assert NodeRecord.from_json(NodeRecord("n1", "u").to_json()).holds == ()
    odd = b'{"node_id": "n1", "url": "u", "holds": {"a": {"1": [2, -1, "x", true, 2]}, "b": [], "c": {"v": [1]}}}'
    assert NodeRecord.from_json(odd).holds == (("a", 1, (2,)),)  # what cannot be read is left out
