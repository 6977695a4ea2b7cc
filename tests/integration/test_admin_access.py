"""Admin access on a real cluster (two `keyroute node` processes, a `keyroute router` with two workers): the admin
port serves /admin/* and /metrics, the data port only reads and probes."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest

from keyroute.core.settings import ZkSettings
from keyroute.core.zookeeper_server import EmbeddedZooKeeper
from tests.integration.small_cluster import ADMIN_TOKEN, ROWS, SmallCluster, expected, key_path, small_cluster

pytestmark = pytest.mark.integration

BEARER = {"authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="module")
def cluster(zk_server: EmbeddedZooKeeper, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SmallCluster]:
    zk_settings = ZkSettings(hosts=zk_server.connect_string, chroot=f"/t-{uuid.uuid4().hex[:12]}", session_timeout_s=4)
    tmp_path = tmp_path_factory.mktemp("admin-access")
    args = ["--admin-token", ADMIN_TOKEN]
    with small_cluster(tmp_path, zk_settings, extra_args=args, router_args=["--workers", "2"], admin_ports=True) as c:
        yield c


def test_admin_and_metrics_are_on_the_admin_port_and_the_data_port_serves_reads_and_probes(
    cluster: SmallCluster,
) -> None:
    with httpx.Client(timeout=10, trust_env=False) as http:
        members = {"router": cluster.router_url, **cluster.node_urls}
        for name, data_url in members.items():
            admin_url = cluster.admin_urls[name]
            assert admin_url != data_url
            for path in ("/admin/partition-map", "/admin/route?store=bookings&key=C001", "/metrics"):
                # Several requests: the router's workers share the admin port as they share the data port.
                for _ in range(4):
                    r = http.get(admin_url + path, headers=BEARER)
                    assert r.status_code == 200, (name, path, r.text)
                r = http.get(data_url + path, headers=BEARER)
                assert r.status_code == 404, (name, path, r.text)
                assert r.json()["error"] == "not_found" and "admin port" in r.json()["message"], (name, r.text)
            for path in ("/healthz", "/readyz"):
                assert http.get(data_url + path).status_code == 200, (name, path)
                assert http.get(admin_url + path).status_code == 200, (name, path)
            # Reads are the data port's alone.
            key = "C001"
            r = http.get(admin_url + key_path(key))
            assert r.status_code == 404, (name, r.text)
            r = http.get(data_url + key_path(key))
            assert r.status_code == 200 and r.json() == expected(key), (name, r.text)
        assert http.get(cluster.router_url + "/openapi.json").status_code == 200
        assert http.get(cluster.router_admin_url + "/openapi.json").status_code == 200
        # Nodes forward to each other on the data port: every key answers through each node.
        for url in cluster.node_urls.values():
            for key in ROWS:
                r = http.get(url + key_path(key))
                assert r.status_code == 200 and r.json() == expected(key), (url, key, r.text)
        cluster.check_every_key(http)
