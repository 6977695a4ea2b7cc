"""The router's zone gauges: partitions whose replicas share a zone, and nodes without a zone, from the
installed partition map at scrape time."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from keyroute.cluster.partition_map import Assignment, NodeRecord, PartitionMap
from keyroute.router.metrics import RouterMetrics
from keyroute.runtime.metrics import WorkerSnapshots
from tests.unit.router.fakes import node_url, store_record

SHARING = "keyroute_router_partitions_sharing_zone"
WITHOUT = "keyroute_router_nodes_without_zone"


def zoned_map(zones: dict[str, str], stores: dict[str, tuple[int, list[tuple[str, ...]]]]) -> PartitionMap:
    """Nodes by zone; stores[name] = (replication factor, assigned replicas per partition)."""
    records = {
        name: replace(store_record(name, len(per_partition)), replication_factor=rf)
        for name, (rf, per_partition) in stores.items()
    }
    assignment = Assignment(generation=1, stores={name: tuple(reps) for name, (_, reps) in stores.items()})
    nodes = {n: NodeRecord(n, node_url(n), zone=z) for n, z in zones.items()}
    return PartitionMap.build(records, nodes, assignment, {})


def gauges(m: RouterMetrics) -> dict[str, float]:
    return {
        s.name: s.value
        for family in text_string_to_metric_families(m.render())
        if family.name in (SHARING, WITHOUT)
        for s in family.samples
    }


def test_partitions_whose_replicas_share_a_zone_are_counted_over_every_store() -> None:
    zones = {"a1": "a", "a2": "a", "b1": "b", "x": ""}
    m = RouterMetrics()
    m.map_installed(
        zoned_map(
            zones,
            {
                # p0 shares zone a; p1 spans a and b; p2 has a replica without a zone (no known zone shared).
                "s": (2, [("a1", "a2"), ("a1", "b1"), ("a2", "x")]),
                # rf 3: all three in a would count, two zones do not.
                "t": (3, [("a1", "a2", "b1"), ("a2", "a1", "a1")]),
                # rf 1: one replica shares nothing.
                "u": (1, [("a1",), ("a2",)]),
            },
        )
    )
    assert gauges(m) == {SHARING: 2, WITHOUT: 1}


def test_one_zone_shares_nothing_and_no_map_shows_zero() -> None:
    m = RouterMetrics()
    assert gauges(m) == {SHARING: 0, WITHOUT: 0}
    m.map_installed(zoned_map({"a1": "a", "a2": "a"}, {"s": (2, [("a1", "a2")] * 4)}))
    assert gauges(m) == {SHARING: 0, WITHOUT: 0}
    # The map is read at scrape time: a new map with a second zone changes the gauge.
    m.map_installed(zoned_map({"a1": "a", "a2": "a", "b1": "b"}, {"s": (2, [("a1", "a2")] * 4)}))
    assert gauges(m) == {SHARING: 4, WITHOUT: 0}
    m.map_installed(zoned_map({"a1": "", "a2": "", "b1": ""}, {"s": (2, [("a1", "a2")] * 4)}))
    assert gauges(m) == {SHARING: 0, WITHOUT: 3}


def test_with_workers_the_gauges_show_the_worst_map(tmp_path: Path) -> None:
    first, second = RouterMetrics(), RouterMetrics()
    snapshots = [WorkerSnapshots(tmp_path, index, pid=1000 + index) for index in (1, 2)]
    for m, shared in zip((first, second), snapshots, strict=True):
        m.share(shared)
    zones = {"a1": "a", "a2": "a", "b1": "b"}
    first.map_installed(zoned_map(zones, {"s": (2, [("a1", "b1"), ("a2", "b1")])}))
    second.map_installed(zoned_map({**zones, "x": ""}, {"s": (2, [("a1", "a2"), ("a2", "b1")])}))
    for shared in snapshots:
        shared.publish()
    assert gauges(first) == {SHARING: 1, WITHOUT: 1}
