"""Zone-aware placement with real nodes: each partition's replicas land in different zones, the map shows
each node's zone, and a zone losing a node keeps every partition served from the other zone."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from keyroute.core import placement_records, zk, zk_layout
from keyroute.core.key_format import KeyFormat
from keyroute.core.partition_map import Assignment, StoreRecord
from keyroute.core.partitioner import Partitioner
from keyroute.core.settings import ZkSettings
from tests.integration.small_cluster import ROWS, STORE
from tests.integration.test_node import write_snapshot
from tests.util import Proc, free_port, wait_for

pytestmark = pytest.mark.integration

PARTITIONS = 8
ZONES = {"n1": "zone-a", "n2": "zone-a", "n3": "zone-b", "n4": "zone-b"}


def test_replicas_of_each_partition_are_placed_in_different_zones(zk_settings: ZkSettings, tmp_path: Path) -> None:
    client = zk.connect(zk_settings)
    procs: dict[str, Proc] = {}
    try:
        snapshot = write_snapshot(tmp_path / "snapshots", STORE, ROWS, KeyFormat.STRING, PARTITIONS)
        record = StoreRecord(STORE, PARTITIONS, Partitioner.MURMUR2, KeyFormat.STRING, 1, snapshot, ("v",), 2, 1.0)
        client.create(zk_layout.store_path(STORE), record.to_json(), makepath=True)
        ports = {node_id: free_port() for node_id in ZONES}
        for node_id, zone in ZONES.items():
            args = ["node", "--zk", zk_settings.connect_string, "--node-id", node_id, "--port", str(ports[node_id])]
            args += ["--data-dir", str(tmp_path / node_id), "--zk-session-timeout-s", "4", "--drain-timeout-s", "5"]
            # The zone from the environment, as the Kubernetes manifests give it.
            procs[node_id] = Proc(args, tmp_path / f"{node_id}.log", env={"KEYROUTE_ZONE": zone}).start()

        def spread() -> Assignment | None:
            a = placement_records.read(client)[0]
            if a is None:
                return None
            replicas = a.stores.get(STORE, ())
            # Every node registered and counted: 8 partitions x 2 replicas over 4 nodes.
            if sum(len(r) for r in replicas) != 2 * PARTITIONS or len({n for r in replicas for n in r}) != 4:
                return None
            return a

        assignment = wait_for(spread, timeout_s=60, message="an assignment over all four nodes")
        for p, replicas in enumerate(assignment.stores[STORE]):
            assert {ZONES[n] for n in replicas} == {"zone-a", "zone-b"}, f"partition {p}: {replicas}"
        view = httpx.get(f"http://127.0.0.1:{ports['n1']}/admin/partition-map", timeout=5).json()
        assert {n: v["zone"] for n, v in view["nodes"].items()} == ZONES

        # zone-a loses both its nodes at once: every partition still has a replica in zone-b.
        for node_id in ("n1", "n2"):
            procs[node_id].kill9()

        def served_from_b() -> bool:
            m = httpx.get(f"http://127.0.0.1:{ports['n3']}/admin/partition-map", timeout=5).json()
            parts = m["stores"][STORE]["partition_map"]
            return all(any(s["node"] in ("n3", "n4") for s in part["serving"]) for part in parts)

        wait_for(served_from_b, timeout_s=60, message="every partition served from zone-b")
    finally:
        for proc in procs.values():
            proc.stop()
        zk.close(client)
