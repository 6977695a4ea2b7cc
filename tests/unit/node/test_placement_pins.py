"""The placement's exact output on a handful of inputs, pinned: a change to keyroute.state_node.placement that
is meant to keep its behaviour must keep these (they were recorded from the placement before it became a
package, and the package gave the same assignments on some 8,500 recorded calls of the property tests and of
random histories). A deliberate change of placement updates them, and says why."""

from __future__ import annotations

import hashlib
import json

from keyroute.cluster.partition_map import Assignment
from keyroute.state_node.placement import assign, assign_exact


def _lists(a: Assignment) -> dict[str, list[list[str]]]:
    return {store: [list(reps) for reps in per] for store, per in a.stores.items()}


def _digest(a: Assignment) -> str:
    body = {"generation": a.generation, "stores": {s: [list(r) for r in per] for s, per in sorted(a.stores.items())}}
    return hashlib.sha256(json.dumps(body).encode()).hexdigest()[:16]


def test_a_small_cluster_and_a_leave_the_seats_alone_could_not_balance() -> None:
    # The recorded example of tests/property/test_assignment_props.py: the exact placement takes the leave.
    nodes = ["node-0", "node-1", "node-2", "node-8", "node-9", "node-3", "node-4", "ä"]
    stores = {"a": (3, 3), "b": (2, 4), "aa": (1, 4)}
    fresh = assign(stores, nodes, None, 1)
    assert _lists(fresh) == {
        "a": [["node-0", "node-1", "node-2"], ["node-3", "node-0", "node-4"], ["node-8", "node-9", "ä"]],
        "aa": [["node-1", "node-2", "node-4", "node-9"]],
        "b": [["node-2", "node-0", "node-1", "node-3"], ["node-4", "node-8", "node-9", "ä"]],
    }
    after = assign(stores, [n for n in nodes if n != "node-8"], fresh, 2)
    assert _lists(after) == {
        "a": [["node-0", "node-1", "node-2"], ["node-3", "node-0", "node-4"], ["node-9", "ä", "node-3"]],
        "aa": [["node-1", "node-2", "node-4", "node-9"]],
        "b": [["node-2", "node-1", "node-3", "ä"], ["node-4", "node-9", "ä", "node-0"]],
    }


def test_zones_in_a_small_cluster_with_both_engines() -> None:
    zones = {"n0": "a", "n1": "a", "n2": "b", "n3": "b", "n4": "c", "n5": ""}
    stores = {"s0": (7, 2), "s1": (5, 3)}
    fresh = assign(stores, sorted(zones), None, 1, zones=zones)
    assert _lists(fresh) == {
        "s0": [["n0", "n2"], ["n0", "n2"], ["n1", "n3"], ["n4", "n5"], ["n2", "n0"], ["n3", "n1"], ["n5", "n4"]],
        "s1": [["n1", "n3", "n4"], ["n2", "n0", "n4"], ["n3", "n1", "n5"], ["n4", "n0", "n2"], ["n5", "n1", "n3"]],
    }
    left = assign(stores, ["n0", "n1", "n3", "n4", "n5"], fresh, 2, zones=zones)
    assert _lists(left) == {
        "s0": [["n0", "n3"], ["n0", "n5"], ["n1", "n3"], ["n4", "n5"], ["n1", "n4"], ["n3", "n1"], ["n5", "n4"]],
        "s1": [["n0", "n3", "n4"], ["n4", "n0", "n5"], ["n3", "n1", "n5"], ["n1", "n4", "n0"], ["n5", "n1", "n3"]],
    }
    exact = assign_exact(stores, sorted(zones), left, 3, zones=zones)
    assert _lists(exact) == {
        "s0": [["n3", "n0"], ["n0", "n5"], ["n1", "n3"], ["n4", "n5"], ["n1", "n4"], ["n2", "n1"], ["n5", "n2"]],
        "s1": [["n0", "n3", "n4"], ["n4", "n0", "n2"], ["n3", "n1", "n5"], ["n2", "n4", "n0"], ["n5", "n1", "n3"]],
    }


def test_a_zoned_cluster_beyond_the_exact_placement_through_a_leave_and_a_return() -> None:
    nodes = [f"n{i:03d}" for i in range(30)]
    zones = {n: f"z{i % 3}" for i, n in enumerate(nodes)}
    stores = {f"s{i}": (300, 3) for i in range(6)}  # 5,400 replicas: the seats alone, and the bounded zone pass
    fresh = assign(stores, nodes, None, 1, zones=zones)
    left = assign(stores, [n for n in nodes if n != "n007"], fresh, 2, zones=zones)
    back = assign(stores, nodes, left, 3, zones=zones)
    assert [_digest(a) for a in (fresh, left, back)] == ["177ae24c284cc2ac", "6bcf981902bf8b48", "063852ba7b78b7a3"]


def test_mixed_replication_factors_through_a_leave_and_a_new_store() -> None:
    nodes = [f"n{i:03d}" for i in range(37)]
    stores = {"a": (900, 1), "b": (1100, 2), "c": (1300, 3)}
    fresh = assign(stores, nodes, None, 1)
    left = assign(stores, nodes[1:], fresh, 2)
    grown = assign({**stores, "d": (50, 2)}, nodes[1:], left, 3)
    assert [_digest(a) for a in (fresh, left, grown)] == ["16106fb211a6706b", "46879e1e37f514a6", "8c9f2f1735d1cc1d"]
