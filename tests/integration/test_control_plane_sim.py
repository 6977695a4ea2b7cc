"""The control plane with a few hundred simulated nodes (records only, over a few ZooKeeper sessions), the
real controller and a router's map watcher: correct placement and small records at a size the other tests
do not reach. How fast is for benchmarks/control_plane.py."""

from __future__ import annotations

from collections import Counter

import pytest

from keyroute.cluster import placement_records, zk, zk_layout
from keyroute.cluster.map_watcher import MapWatcher
from keyroute.cluster.partition_map import Assignment, NodeRecord, PartitionMap, StoreRecord
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.runtime.settings import ZkSettings
from keyroute.state_node.controller import Controller
from keyroute.state_node.placement import moved_replicas
from tests.util import wait_for

pytestmark = pytest.mark.integration

NODES = 240
STORES = {f"store-{i}": (64 * (i + 1), 1 + i % 3) for i in range(6)}
SESSIONS = 4


def balanced(a: Assignment, nodes: list[str]) -> bool:
    totals, leaders = Counter(dict.fromkeys(nodes, 0)), Counter(dict.fromkeys(nodes, 0))
    for name, (partitions, rf) in STORES.items():
        per = a.stores.get(name, ())
        if len(per) != partitions or any(len(set(r)) != min(rf, len(nodes)) for r in per):
            return False
        counts = Counter(dict.fromkeys(nodes, 0))
        for reps in per:
            counts.update(reps)
            leaders[reps[0]] += 1
        if max(counts.values()) - min(counts.values()) > 1:
            return False
        totals.update(counts)
    spread = max(totals.values()) - min(totals.values())
    return set(totals) == set(nodes) and spread <= 1 and max(leaders.values()) - min(leaders.values()) <= 1


def test_hundreds_of_simulated_nodes_are_placed_balanced_in_small_records(zk_settings: ZkSettings) -> None:
    admin = zk.connect(zk_settings)
    fleet = [zk.connect(zk_settings) for _ in range(SESSIONS)]
    nodes = [f"node-{i:03d}" for i in range(NODES)]
    session_of = {n: fleet[i % SESSIONS] for i, n in enumerate(nodes)}
    router_client = zk.connect(zk_settings, ensure_layout=False)
    maps: list[PartitionMap] = []
    watcher = MapWatcher(router_client, maps.append)
    # Two nodes' own watchers (each reads its share, /assigned/{node}): one that leaves and comes back.
    gone = nodes[NODES // 2]
    node_client = zk.connect(zk_settings, ensure_layout=False)
    own = {n: MapWatcher(node_client, lambda _m: None, node_id=n) for n in (gone, nodes[7])}
    controller = Controller(admin, nodes[0])
    try:
        for name, (partitions, rf) in STORES.items():
            record = StoreRecord(name, partitions, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/snap", ("v",), rf, 1.0)
            admin.create(zk_layout.store_path(name), record.to_json())

        def register(node: str) -> None:
            record = NodeRecord(node, f"http://{node}:8080", zone=f"zone-{int(node[-3:]) % 3}")
            session_of[node].create(zk_layout.node_path(node), record.to_json(), ephemeral=True)

        for node in nodes:
            register(node)
        controller.start()
        watcher.start()
        for w in own.values():
            w.start()

        def shares_in_line(whole: Assignment) -> None:
            """Every node's share record holds its share of `whole`, and each node's own watcher has it."""

            def written() -> dict[str, placement_records.Share]:
                return {
                    name: placement_records.parse_share_record(admin.get(zk_layout.assigned_path(name))[0])[1]
                    for name in admin.get_children(zk_layout.ASSIGNED)
                }

            wanted = placement_records.shares(whole)
            wait_for(lambda: written() == wanted, message="every node's share record to hold its share")
            for node, w in own.items():
                wait_for(
                    lambda node=node, w=w: w.current.assignment.generation == whole.generation
                    and w.current.assignment.partitions_of(node) == whole.partitions_of(node),
                    message=f"{node}'s own share",
                )

        def settled(members: list[str]) -> Assignment | None:
            a = watcher.current.assignment
            return a if balanced(a, members) else None

        first = wait_for(lambda: settled(nodes), timeout_s=60, message="a balanced assignment of every node")
        # Small records: one per store, and a root naming them.
        for name in STORES:
            raw, _ = admin.get(zk_layout.placement_path(name))
            assert len(raw) < 16 * 1024, (name, len(raw))
        assert len(admin.get(zk_layout.PLACEMENT)[0]) < 1024
        assert placement_records.read(admin)[0] == first
        shares_in_line(first)

        # One node leaves: the router's map follows, and what moves is about what the node held.
        held = sum(1 for per in first.stores.values() for reps in per if gone in reps)
        session_of[gone].delete(zk_layout.node_path(gone))
        survivors = [n for n in nodes if n != gone]
        after = wait_for(lambda: settled(survivors), timeout_s=60, message="the assignment without the node")
        assert held <= moved_replicas(first, after) <= 3 * held
        wait_for(lambda: placement_records.read(admin)[0] == after, message="the root to name that assignment")
        shares_in_line(after)
        assert not admin.exists(zk_layout.assigned_path(gone))  # no share, no record
        # It comes back: it takes a share again.
        register(gone)
        back = wait_for(lambda: settled(nodes), timeout_s=60, message="the node back in the assignment")
        assert any(gone in reps for per in back.stores.values() for reps in per)
        wait_for(lambda: placement_records.read(admin)[0] == back, message="the root to name that assignment")
        shares_in_line(back)
        # Every map the router saw named a whole assignment: each store's partitions all placed.
        for seen in maps:
            for name, per in seen.assignment.stores.items():
                assert len(per) == STORES[name][0]
    finally:
        watcher.stop()
        for w in own.values():
            w.stop()
        controller.stop()
        for client in (*fleet, router_client, node_client, admin):
            zk.close(client)
