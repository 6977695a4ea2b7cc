"""What tests/harness.py does to a member is what the member lives through: a node whose ZooKeeper session
expired while it was frozen registers again under a new session, and a restarted one comes back on the same
port; through both the cluster answers every key."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from keyroute.cluster import zk, zk_layout
from keyroute.runtime.settings import ZkSettings
from tests.integration.small_cluster import ROWS, expected, key_path, small_cluster
from tests.util import wait_for

pytestmark = pytest.mark.integration


def test_an_expired_member_registers_again_and_a_restarted_one_serves_on_its_port(
    tmp_path: Path, zk_settings: ZkSettings
) -> None:
    client = zk.connect(zk_settings)
    try:
        with small_cluster(tmp_path, zk_settings) as cluster, httpx.Client(timeout=10, trust_env=False) as http:
            node = cluster.members["n1"]
            record = zk_layout.node_path("n1")
            stat = client.exists(record)
            assert stat is not None and stat.ephemeralOwner
            first = stat.ephemeralOwner

            node.expire(client, record)

            def registered_again() -> bool:
                now = client.exists(record)
                return now is not None and now.ephemeralOwner not in (0, first)

            wait_for(registered_again, timeout_s=60, message="n1 registered under a new session")
            assert node.alive

            def every_key_answers() -> bool:
                return all(http.get(cluster.router_url + key_path(key)).json() == expected(key) for key in ROWS)

            wait_for(every_key_answers, timeout_s=60, message="every key answering after the expiry")

            pid = node.pid
            node.restart()
            assert node.pid != pid
            wait_for(
                lambda: http.get(node.url + "/readyz").status_code == 200, timeout_s=60, message="n1 ready again"
            )
            wait_for(every_key_answers, timeout_s=60, message="every key answering after the restart")
    finally:
        zk.close(client)
