"""Zone-aware placement with real nodes: each partition's replicas land in different zones (zones given
directly or read from a file), the map shows each node's zone, the router's gauges show no partition
sharing a zone, a zone losing a node keeps every partition served from the other zone, and a node that
requires a zone refuses to start without one."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from keyroute.cluster import placement_records, zk, zk_layout
from keyroute.cluster.partition_map import Assignment, StoreRecord
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.runtime.settings import ZkSettings
from keyroute.zone import write_zone
from tests.integration.small_cluster import ROWS, STORE
from tests.integration.test_node import write_snapshot
from tests.util import Proc, free_port, wait_for

pytestmark = pytest.mark.integration

PARTITIONS = 8
ZONES = {"n1": "zone-a", "n2": "zone-a", "n3": "zone-b", "n4": "zone-b"}
SHARING = "keyroute_router_partitions_sharing_zone"
WITHOUT = "keyroute_router_nodes_without_zone"


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
            # zone-a's nodes are told their zone directly; zone-b's read it from the file the Kubernetes
            # manifests' init container writes (`keyroute zone-from-node`), and require one.
            env = {"KEYROUTE_ZONE": zone}
            if zone == "zone-b":
                write_zone(tmp_path / f"{node_id}.zone", zone)
                env = {"KEYROUTE_ZONE_FILE": str(tmp_path / f"{node_id}.zone"), "KEYROUTE_REQUIRE_ZONE": "true"}
            procs[node_id] = Proc(args, tmp_path / f"{node_id}.log", env=env).start()
        router_port = free_port()
        router = Proc(["router", "--zk", zk_settings.connect_string, "--port", str(router_port)], tmp_path / "r.log")
        procs["router"] = router.start()

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

        def zone_gauges() -> dict[str, float] | None:
            text = httpx.get(f"http://127.0.0.1:{router_port}/metrics", timeout=5).text
            found = {
                s.name: s.value
                for family in text_string_to_metric_families(text)
                for s in family.samples
                if s.name in (SHARING, WITHOUT)
            }
            # Once the router's map holds the spread assignment and all four nodes.
            return found if len(found) == 2 and found[SHARING] == 0 and found[WITHOUT] == 0 else None

        wait_for(zone_gauges, timeout_s=30, message="the router to see no partition sharing a zone")

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


def test_a_node_that_requires_a_zone_and_has_none_refuses_to_start(tmp_path: Path) -> None:
    """The Node had no zone label: the init container left an empty file. Nothing is bound, created or
    joined; one line says how to give a zone."""
    zone_file = tmp_path / "zone"
    write_zone(zone_file, "")
    port = free_port()
    args = ["node", "--zk", f"127.0.0.1:{free_port()}/x", "--node-id", "n1", "--port", str(port)]
    args += ["--data-dir", str(tmp_path / "data"), "--zone-file", str(zone_file), "--require-zone"]
    proc = Proc(args, tmp_path / "node.log").start()
    assert proc.popen is not None
    assert proc.popen.wait(timeout=30) == 1
    [line] = proc.output().splitlines()
    assert line.startswith("keyroute node: --require-zone: this node has no zone"), line
    assert "--zone (KEYROUTE_ZONE)" in line and "--zone-file (KEYROUTE_ZONE_FILE" in line, line
    assert not (tmp_path / "data").exists()
