"""A planned restart moves nothing: three real `keyroute node` processes (replication factor 2) on a real
ZooKeeper. A node stopped with SIGTERM and started again on its data directory keeps its partitions (the
assignment is never rewritten), its partitions' other replicas answer meanwhile, and it takes them back from
disk (no partition fetched anywhere); a node that does not come back within its grace is replaced."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from kazoo.client import KazooClient

from keyroute.cluster import placement_records, zk, zk_layout
from keyroute.cluster.partition_map import Assignment, NodeRecord, ServingRecord, StoreRecord
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.runtime.settings import ZkSettings
from tests.integration.test_node import key_url, write_snapshot
from tests.util import Proc, free_port, wait_for

STORE = "bookings"
PARTITIONS = 6
RF = 2
ROWS = {f"C{i:03d}": {"customer": i} for i in range(60)}
NODES = ("n1", "n2", "n3")


class Nodes:
    def __init__(self, tmp: Path, zk_settings: ZkSettings, client: KazooClient) -> None:
        self.tmp, self.client = tmp, client
        self.connect = f"{zk_settings.hosts}{zk_settings.chroot}"
        self.procs: dict[str, Proc] = {}
        self.urls: dict[str, str] = {}
        self.http = httpx.Client(timeout=10.0, trust_env=False)

    def start(self, node_id: str, restart_grace_s: float) -> None:
        port = free_port()
        args = ["node", "--zk", self.connect, "--node-id", node_id, "--port", str(port)]
        args += ["--data-dir", str(self.tmp / f"data-{node_id}"), "--zk-session-timeout-s", "4"]
        args += ["--restart-grace-s", str(restart_grace_s)]
        self.procs[node_id] = Proc(args, self.tmp / f"{node_id}.log").start()
        self.urls[node_id] = f"http://127.0.0.1:{port}"

    def sigterm(self, node_id: str) -> None:
        proc = self.procs[node_id]
        assert proc.popen is not None
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(timeout=30) == 0

    def assignment(self) -> Assignment:
        current = placement_records.read(self.client)[0]
        assert current is not None
        return current

    def serving(self) -> dict[str, dict[int, int]]:
        """node -> {partition: version} as the nodes announce it."""
        out = {}
        for node_id in self.client.get_children(zk_layout.SERVING):
            raw, _ = self.client.get(zk_layout.serving_path(node_id))
            out[node_id] = dict(ServingRecord.from_json(raw).stores.get(STORE, {}))
        return out

    def settled(self, nodes: set[str]) -> bool:
        """Every partition assigned to RF of `nodes`, each of them serving it, and every node ready."""
        assignment = self.assignment()
        serving = self.serving()
        for p in range(PARTITIONS):
            replicas = assignment.replicas(STORE, p)
            if len(replicas) != RF or not set(replicas) <= nodes:
                return False
            if any(serving.get(n, {}).get(p) != 1 for n in replicas):
                return False
        return all(self.http.get(self.urls[n] + "/readyz").status_code == 200 for n in nodes)

    def counter(self, node_id: str, name: str) -> float:
        text = self.http.get(self.urls[node_id] + "/metrics").text
        values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")]
        assert len(values) == 1, (name, text[:2000])
        return values[0]

    def every_key_answers(self, via: str) -> bool:
        for text in ROWS:
            r = self.http.get(self.urls[via] + key_url(STORE, text))
            assert r.status_code == 200, (via, text, r.status_code, r.text)
        return True

    def logs(self) -> str:
        return "\n".join(f"----- {n} -----\n{p.output()[-6000:]}" for n, p in self.procs.items())

    def close(self) -> None:
        for proc in self.procs.values():
            proc.stop()
        self.http.close()


@pytest.fixture
def nodes(tmp_path: Path, zk_settings: ZkSettings) -> Iterator[Nodes]:
    client = zk.connect(zk_settings)
    snapshot = write_snapshot(tmp_path / "snapshots", STORE, ROWS, KeyFormat.STRING, PARTITIONS)
    record = StoreRecord(STORE, PARTITIONS, Partitioner.MURMUR2, KeyFormat.STRING, 1, snapshot, ("v",), RF, 1.0)
    client.create(zk_layout.store_path(STORE), record.to_json())
    c = Nodes(tmp_path, zk_settings, client)
    try:
        yield c
    finally:
        c.close()
        print(c.logs())  # pytest shows captured output only when the test failed
        zk.close(client)


def test_a_restarted_node_takes_its_partitions_back_from_disk_and_one_that_stays_away_is_replaced(
    nodes: Nodes,
) -> None:
    c = nodes
    for node_id in NODES:
        c.start(node_id, restart_grace_s=60)
    wait_for(lambda: c.settled(set(NODES)), timeout_s=60, interval_s=0.2, message="every partition served")
    before = c.assignment()
    mine = [p for p in range(PARTITIONS) if "n3" in before.replicas(STORE, p)]
    assert mine
    fetched = {n: c.counter(n, "keyroute_node_partitions_fetched_total") for n in ("n1", "n2")}

    # SIGTERM: n3 records its restart, de-announces and exits; its partitions stay assigned to it.
    c.sigterm("n3")
    assert c.client.exists(zk_layout.restarting_path("n3")) is not None
    assert "n3" not in c.client.get_children(zk_layout.NODES)
    serving = c.serving()
    assert "n3" not in serving
    # Every partition still has a replica that serves it, and every key answers (forwarded where needed).
    assert all(any(p in parts for parts in serving.values()) for p in range(PARTITIONS))
    c.every_key_answers("n1")
    assert c.assignment() == before

    # Started again on the same data directory, it serves its partitions from its files: none fetched.
    c.start("n3", restart_grace_s=1)
    wait_for(lambda: c.settled(set(NODES)), timeout_s=60, interval_s=0.2, message="n3 back")
    assert c.assignment() == before  # never rewritten: not even its generation moved
    assert c.client.exists(zk_layout.restarting_path("n3")) is None
    assert c.counter("n3", "keyroute_node_partitions_fetched_total") == 0
    assert c.counter("n3", "keyroute_node_fetched_bytes_total") == 0
    assert c.counter("n3", "keyroute_node_partitions_reused_total") == len(mine)
    assert {n: c.counter(n, "keyroute_node_partitions_fetched_total") for n in ("n1", "n2")} == fetched
    # Its node record offers what its disk held at start to the controller, for when placement must choose (its
    # own partitions, and any it had handed over but not yet removed when it stopped).
    held = NodeRecord.from_json(c.client.get(zk_layout.node_path("n3"))[0]).held_at(STORE, 1)
    assert set(mine) <= set(held)

    # Stopped again with a 1 s grace and not started: the controller reassigns its partitions once it ends.
    c.sigterm("n3")
    wait_for(
        lambda: c.settled({"n1", "n2"}), timeout_s=60, interval_s=0.2, message="n3's partitions on n1 and n2"
    )
    after = c.assignment()
    assert after.generation > before.generation
    assert c.client.exists(zk_layout.restarting_path("n3")) is None
    c.every_key_answers("n2")
