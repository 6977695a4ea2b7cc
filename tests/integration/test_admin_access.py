"""Admin access on a real cluster (two `keyroute node` processes, a `keyroute router` with two workers): the admin
port serves /admin/* and /metrics, the data port only reads and probes; a cluster in the middle of rotating its
cluster secret and admin token (nodes already on [new, old], the router still on old) keeps working."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest

from keyroute.auth.security import member_token
from keyroute.dev.zookeeper_server import EmbeddedZooKeeper
from keyroute.runtime.settings import ZkSettings
from tests.integration.small_cluster import (
    ADMIN_TOKEN,
    ROWS,
    SmallCluster,
    expected,
    key_path,
    partition,
    small_cluster,
)

pytestmark = pytest.mark.integration

BEARER = {"authorization": f"Bearer {ADMIN_TOKEN}"}
OLD_SECRET, NEW_SECRET = "old-cluster-s3cret", "new-cluster-s3cret"
NEW_TOKEN = "new-admin-t0ken"


@pytest.fixture(scope="module")
def cluster(zk_server: EmbeddedZooKeeper, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SmallCluster]:
    zk_settings = ZkSettings(hosts=zk_server.connect_string, chroot=f"/t-{uuid.uuid4().hex[:12]}", session_timeout_s=4)
    tmp_path = tmp_path_factory.mktemp("admin-access")
    # Half-way through a rotation: the nodes already send the new cluster secret and accept both, the router
    # still sends the old one; either admin token is accepted everywhere.
    args = ["--admin-token", f"{NEW_TOKEN},{ADMIN_TOKEN}", "--cluster-secret", f"{NEW_SECRET},{OLD_SECRET}"]
    router_args = ["--workers", "2", "--cluster-secret", OLD_SECRET]
    with small_cluster(tmp_path, zk_settings, extra_args=args, router_args=router_args, admin_ports=True) as c:
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


def test_mid_rotation_nodes_honour_members_sending_either_secret_and_take_either_admin_token(
    cluster: SmallCluster,
) -> None:
    serving = cluster.serving()
    with httpx.Client(timeout=10, trust_env=False) as http:
        for node, url in cluster.node_urls.items():
            admin_map = cluster.admin_urls[node] + "/admin/partition-map"
            for token in (NEW_TOKEN, ADMIN_TOKEN):
                r = http.get(admin_map, headers={"authorization": f"Bearer {token}"})
                assert r.status_code == 200, (node, r.text)
            assert http.get(admin_map).status_code == 401
            elsewhere = [k for k in ROWS if node not in serving[partition(k)]]
            assert elsewhere, serving
            key = elsewhere[0]
            # What a router or node still on the old secret sends, and one already on the new: a member's
            # hop count, honoured (a forwarded read is never forwarded again).
            for secret in (OLD_SECRET, NEW_SECRET):
                member = {"x-keyroute-hops": "1", "x-keyroute-auth": member_token(secret)}
                r = http.get(url + key_path(key), headers=member)
                assert r.status_code == 503 and r.json()["error"] == "partition_unavailable", (node, secret, r.text)
            # Anyone else's hop count is ignored: the node forwards, with the new secret, and the owner takes it.
            outsider = {"x-keyroute-hops": "1", "x-keyroute-auth": member_token("not a secret of this cluster")}
            r = http.get(url + key_path(key), headers=outsider)
            assert r.status_code == 200 and r.json() == expected(key), (node, r.text)
            assert r.headers["x-keyroute-hops"] == "1" and r.headers["x-keyroute-forwarded-by"] == node
        # The router, still on the old secret, reads everything.
        cluster.check_every_key(http)


def test_a_browser_logs_in_on_the_admin_port_of_routers_and_nodes_and_no_url_takes_a_token(
    cluster: SmallCluster,
) -> None:
    for name, admin_url in cluster.admin_urls.items():
        with httpx.Client(base_url=admin_url, timeout=10, trust_env=False) as browser:
            assert browser.get("/admin/partition-map").status_code == 401
            sent_away = browser.get(f"/admin/ui?token={ADMIN_TOKEN}")
            assert sent_away.status_code == 303 and sent_away.headers["location"] == "/admin/login"
            assert ADMIN_TOKEN not in sent_away.text
            form = browser.get("/admin/login")
            assert form.status_code == 200 and 'name="token"' in form.text
            assert browser.post("/admin/login", data={"token": "wrong"}).status_code == 401
            login = browser.post("/admin/login", data={"token": NEW_TOKEN})
            assert login.status_code == 303 and "keyroute_admin" in browser.cookies, (name, login.text)
            assert ADMIN_TOKEN not in login.headers["set-cookie"] and NEW_TOKEN not in login.headers["set-cookie"]
            # The client sends the cookie on its own, as a browser does.
            r = browser.get("/admin/partition-map")
            assert r.status_code == 200, (name, r.text)
            assert browser.post("/admin/logout").status_code == 303
            assert browser.get("/admin/partition-map").status_code == 401
        # The data port has no login: it is the admin port's.
        data_url = cluster.router_url if name == "router" else cluster.node_urls[name]
        assert httpx.get(data_url + "/admin/login", timeout=10).status_code == 404
