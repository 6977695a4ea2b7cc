"""The nodes a router saw leave or die (router/departures.py), and how the partition-map summary names them:
by name, how they went, when last seen, what they held, until they are back or what they held is served as
asked again, and a while after (an injected clock)."""

from __future__ import annotations

import json

from keyroute.cluster.live_status import LiveStatusReader
from keyroute.cluster.partition_map import Assignment, NodeRecord, PartitionMap, ServingRecord
from keyroute.router.departures import LINGER_S, Departures
from keyroute.router.map_views import MapViews
from tests.unit.router.fakes import node_url
from tests.unit.router.test_map_views import store


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def a_map(generation: int, serving: dict[str, dict[int, int]], leaving: frozenset[str] = frozenset(),
          assigned: dict[str, tuple[tuple[str, ...], ...]] | None = None, registered: set[str] | None = None,
          ) -> PartitionMap:
    """Store `s`: 4 partitions, rf 2, version 2; `serving` is node -> {partition: version}."""
    names = set(serving) if registered is None else registered
    nodes = {n: NodeRecord(n, node_url(n), leaving=n in leaving, zone="z-" + n) for n in sorted(names)}
    records = {n: ServingRecord(n, node_url(n), {"s": parts}) for n, parts in serving.items() if parts}
    assignment = Assignment(generation, assigned or {})
    return PartitionMap.build({"s": store("s", 4, rf=2)}, nodes, assignment, records, generation=generation,
                              built_at=900.0)


BOTH = {"n1": {0: 2, 1: 2, 2: 2, 3: 2}, "n2": {0: 2, 1: 2}, "n3": {2: 2, 3: 2}}


def test_a_node_that_dies_is_named_with_what_it_held_until_that_is_served_again_and_a_while_after() -> None:
    clock = Clock()
    departures = Departures(clock)
    first = a_map(1, BOTH)
    departures.observe(None, first)
    assert departures.describe(first) == []
    clock.now = 1010.0
    without_n3 = a_map(2, {"n1": BOTH["n1"], "n2": BOTH["n2"]})
    departures.observe(first, without_n3)
    [n3] = departures.describe(without_n3)
    assert n3["node"] == "n3" and n3["state"] == "gone" and n3["zone"] == "z-n3" and n3["url"] == node_url("n3")
    assert n3["last_seen"] == 1010.0 and n3["held"] == {"s": 2} and n3["held_partitions"] == 2
    assert n3["served_again"] == 0 and n3["recovered_at"] is None and n3["back_at"] is None

    # n2 takes n3's partitions: everything n3 held is served by two replicas at the current version again.
    clock.now = 1030.0
    healed = a_map(3, {"n1": BOTH["n1"], "n2": {0: 2, 1: 2, 2: 2, 3: 2}})
    departures.observe(without_n3, healed)
    [n3] = departures.describe(healed)
    assert n3["served_again"] == 2 and n3["recovered_at"] == 1030.0 and n3["state"] == "gone"
    clock.now = 1030.0 + LINGER_S
    assert [d["node"] for d in departures.describe(healed)] == ["n3"]
    clock.now = 1031.0 + LINGER_S
    assert departures.describe(healed) == []


def test_a_node_that_leaves_is_left_one_that_comes_back_is_back_and_one_without_serving_held_its_assignment() -> None:
    clock = Clock()
    departures = Departures(clock)
    assigned = {"s": (("n1", "n2"), ("n1", "n2"), ("n1", "n3"), ("n1", "n3"))}
    # n2 drained (leaving) and n3 withdrew its serving record first (a planned restart does).
    first = a_map(1, {"n1": BOTH["n1"], "n2": BOTH["n2"]}, leaving=frozenset({"n2"}), assigned=assigned,
                  registered={"n1", "n2", "n3"})
    departures.observe(None, first)
    clock.now = 1005.0
    second = a_map(2, {"n1": BOTH["n1"]}, assigned=assigned, registered={"n1"})
    departures.observe(first, second)
    listed = {d["node"]: d for d in departures.describe(second)}
    assert listed["n2"]["state"] == "left" and listed["n2"]["held"] == {"s": 2}
    assert listed["n3"]["state"] == "gone" and listed["n3"]["held"] == {"s": 2}  # from the assignment
    clock.now = 1020.0
    third = a_map(3, {"n1": BOTH["n1"], "n3": BOTH["n3"]}, assigned=assigned)
    departures.observe(second, third)
    listed = {d["node"]: d for d in departures.describe(third)}
    assert listed["n3"]["state"] == "back" and listed["n3"]["back_at"] == 1020.0
    assert listed["n3"]["last_seen"] == 1005.0
    clock.now = 1021.0 + LINGER_S
    # n3 is back long enough ago; n2's partitions 0 and 1 still have one replica of two: n2 stays listed.
    assert [(d["node"], d["served_again"]) for d in departures.describe(third)] == [("n2", 0)]


def test_the_summary_lists_a_dead_node_in_its_nodes_problems_and_departed() -> None:
    clock = Clock()
    views = MapViews(LiveStatusReader(lambda: None), clock=clock)
    first = a_map(1, BOTH)
    views.observe(first)
    clock.now = 1010.0
    second = a_map(2, {"n1": BOTH["n1"], "n2": BOTH["n2"]})
    views.observe(second)
    summary = json.loads(views.views(second).summary())
    assert summary["nodes"]["n3"]["state"] == "gone"
    assert {"node": "n3", "state": "gone"} in summary["problems"]
    assert summary["totals"]["nodes"] == 2 and summary["totals"]["nodes_gone"] == 1
    [departed] = summary["departed"]
    assert departed["node"] == "n3" and departed["held_partitions"] == 2 and departed["last_seen"] == 1010.0
