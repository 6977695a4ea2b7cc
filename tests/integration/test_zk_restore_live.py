"""ZooKeeper restored from a `keyroute zk dump` into an empty ensemble while a router, three nodes and readers run.

The ensemble comes back with no data, so its transaction count restarts behind every process's session, and
ZooKeeper refuses their reconnects for good. Expected: no failed or wrong read at any time; nobody restarts a
process; once the dump is restored, every process starts a new session on its own (one line in its log),
the nodes register again, and the router's partition map is current again (not stale, its generation equal
to what a fresh reader of ZooKeeper computes) within a minute.

Real processes and a ZooKeeper of the test's own (it is wiped), as tests/integration/test_chaos.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from keyroute.cluster import zk
from keyroute.cluster.map_watcher import MapWatcher
from keyroute.cluster.partition_map import PartitionMap
from keyroute.dev.zookeeper_server import EmbeddedZooKeeper
from keyroute.runtime.settings import ZkSettings
from tests.integration.test_chaos import CLIENT_THREADS, ChaosCluster, Tally, client_loop, publish
from tests.util import free_port, wait_for

pytestmark = pytest.mark.integration

NODES = ("n1", "n2", "n3")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[ChaosCluster]:
    server = EmbeddedZooKeeper(port=free_port(), data_dir=tmp_path / "zookeeper").start()
    settings = ZkSettings(hosts=server.connect_string, chroot="/restored", session_timeout_s=4.0)
    c = ChaosCluster(tmp_path, server, settings)
    try:
        yield c
    finally:
        c.close()
        c.zk_server.stop()
        print(c.logs())  # shown only when the test failed


def fresh_generation(settings: ZkSettings) -> int | None:
    """The generation a new reader of ZooKeeper computes now (None: it could not read a whole map)."""
    client = zk.connect(settings, ensure_layout=False)
    maps: list[PartitionMap] = []
    got = threading.Event()

    def on_map(new_map: PartitionMap) -> None:
        if not new_map.stale:
            maps.append(new_map)
            got.set()

    watcher = MapWatcher(client, on_map)
    watcher.start()
    try:
        return maps[0].generation if got.wait(10) else None
    finally:
        watcher.stop()
        zk.close(client)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "keyroute", *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_a_zookeeper_restored_from_a_dump_under_load_is_followed_without_a_restart(cluster: ChaosCluster) -> None:
    c = cluster
    client = zk.connect(c.settings)
    try:
        publish(client, c.tmp, 1, {})
    finally:
        zk.close(client)
    for node_id in NODES:
        c.start_node(node_id)
    c.start_router()
    c.wait_settled(1, set(NODES), "three nodes settled", timeout_s=60)
    pids = {name: proc.popen.pid for name, proc in {**c.nodes, "router": c.router}.items() if proc and proc.popen}

    dump = c.tmp / "backup.json"
    dumped = cli("zk", "dump", "--zk", c.connect, "--out", str(dump))
    assert dumped.returncode == 0, dumped.stderr

    tally = Tally()
    stop = threading.Event()
    readers = [
        threading.Thread(target=client_loop, args=(c.router_url, tally, stop, seed), daemon=True)
        for seed in range(CLIENT_THREADS)
    ]
    for thread in readers:
        thread.start()
    try:
        wait_for(lambda: tally.requests >= 50, timeout_s=30, message="reads under way")
        # The ensemble is lost and rebuilt empty on the same address.
        c.zk_server.stop()
        shutil.rmtree(c.zk_server.data_dir)
        c.zk_server = EmbeddedZooKeeper(port=c.zk_server.port, data_dir=c.tmp / "zookeeper-rebuilt").start()
        wait_for(lambda: c.pmap()["stale"], timeout_s=30, message="router map marked stale")
        before_restore = tally.keys
        wait_for(lambda: tally.keys > before_restore + 50, timeout_s=30, message="reads go on, stale map")

        restored = cli("zk", "restore", "--zk", c.connect, "--in", str(dump))
        assert restored.returncode == 0, restored.stderr
        assert json.loads(restored.stdout)["created"] > 0

        c.wait_settled(1, set(NODES), "every node registered and serving again", timeout_s=60)

        def current() -> bool:
            m = c.pmap()
            return not m["stale"] and m["generation"] == fresh_generation(c.settings)

        wait_for(current, timeout_s=60, interval_s=0.5, message="router's generation equal to ZooKeeper's")
        after = tally.keys
        wait_for(lambda: tally.keys > after + 50, timeout_s=30, message="reads after the restore")
    finally:
        stop.set()
        for thread in readers:
            thread.join(timeout=30)

    assert not tally.failed, tally.failed[:20]
    assert not tally.wrong, tally.wrong[:20]
    # Nobody was restarted: the same processes, each of which said what happened once.
    for name, proc in {**c.nodes, "router": c.router}.items():
        assert proc is not None and proc.alive and proc.popen is not None and proc.popen.pid == pids[name], name
        said = [line for line in proc.output().splitlines() if "was restored or rebuilt" in line]
        assert len(said) == 1, (name, said)
