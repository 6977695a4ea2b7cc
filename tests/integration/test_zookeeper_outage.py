"""A ZooKeeper outage is said once per change by keyroute, not once per kazoo retry: a real `keyroute router`
reaches the session's ZooKeeper through a TCP relay the test cuts (the server itself keeps running)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from keyroute.cluster import zk, zk_layout
from keyroute.cluster.partition_map import StoreRecord
from keyroute.dev.zookeeper_server import EmbeddedZooKeeper
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.runtime.settings import ZkSettings
from tests.util import Proc, TcpProxy, free_port, wait_for

pytestmark = pytest.mark.integration

LOST = "ZooKeeper connection lost ("
BACK = "ZooKeeper connection back after "


def test_each_zookeeper_outage_is_said_once_when_lost_and_once_when_back(
    zk_server: EmbeddedZooKeeper, zk_settings: ZkSettings, tmp_path: Path
) -> None:
    writer = zk.connect(zk_settings)
    try:
        record = StoreRecord("s", 1, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/snap/s/v1")
        writer.create(zk_layout.store_path("s"), record.to_json())
    finally:
        zk.close(writer)
    relay = TcpProxy((zk_server.host, zk_server.port))
    port = free_port()
    connect = relay.address + zk_settings.chroot
    args = ["router", "--zk", connect, "--port", str(port), "--zk-session-timeout-s", "4"]
    router = Proc(args, tmp_path / "router.log").start()
    url = f"http://127.0.0.1:{port}/readyz"

    def stale() -> bool:
        return bool(httpx.get(url, timeout=2).json()["stale"])

    try:
        wait_for(lambda: httpx.get(url, timeout=2).json()["generation"] > 0 and not stale(), message="a fresh map")
        # A short outage (the session survives) and one longer than the session timeout (a new session).
        for outage, retries in enumerate((3, 5), start=1):
            relay.cut()
            wait_for(stale, message="the map marked stale")
            refused = relay.refused
            wait_for(lambda: relay.refused >= refused + retries, message=f"{retries} reconnect attempts")  # noqa: B023
            assert router.output().count(LOST) == outage
            relay.restore()
            wait_for(lambda: not stale(), message="a fresh map again")
            wait_for(lambda: router.output().count(BACK) == outage, message="the return said")  # noqa: B023
    finally:
        assert router.stop(timeout_s=20) == 0
        relay.close()
    output = router.output()
    lost = [line for line in output.splitlines() if LOST in line]
    back = [line for line in output.splitlines() if BACK in line]
    assert len(lost) == 2 and len(back) == 2, output
    assert all(f"({connect}): serving the last partition map, stale since " in line for line in lost), lost
    assert all(": partition map refreshed, generation " in line for line in back), back
    assert "Connection dropped" not in output and "Transition to CONNECTING" not in output, output
