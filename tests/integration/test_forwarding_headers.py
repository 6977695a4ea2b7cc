"""Forwarding is never client-steerable: on a real cluster of two nodes and a router sharing a cluster secret,
a client's forged hop, router, partition, generation and auth headers neither stop a node from forwarding,
nor make it forward twice, nor send anything to an address the client names."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from keyroute.auth.security import member_token
from keyroute.runtime.settings import ZkSettings
from tests.integration.small_cluster import ROWS, SECRET, SmallCluster, expected, key_path, partition, small_cluster

pytestmark = pytest.mark.integration


class Canary:
    """A listening socket that counts every connection made to it: no request may ever reach it."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


@pytest.fixture
def cluster(tmp_path: Path, zk_settings: ZkSettings) -> Iterator[SmallCluster]:
    with small_cluster(tmp_path, zk_settings, extra_args=["--cluster-secret", SECRET]) as c:
        yield c


def test_a_clients_forwarding_headers_cannot_stop_repeat_or_redirect_a_forward(cluster: SmallCluster) -> None:
    canary = Canary()
    elsewhere = f"http://127.0.0.1:{canary.port}"
    serving = cluster.serving()
    try:
        with httpx.Client(timeout=10, trust_env=False) as http:
            checked = 0
            for key in ROWS:
                owner = serving[partition(key)][0]
                outsider = next(n for n in cluster.node_urls if n != owner)
                forged = {
                    "x-keyroute-hops": "1",
                    "x-keyroute-router": "1",
                    "x-keyroute-partition": str((partition(key) + 1) % 4),
                    "x-keyroute-generation": "999999",
                    "x-keyroute-forwarded-by": elsewhere,
                    "x-keyroute-auth": member_token("not the secret"),
                    "x-keyroute-node": elsewhere,
                    "forwarded": f"for=127.0.0.1;host=127.0.0.1:{canary.port}",
                    "x-forwarded-host": f"127.0.0.1:{canary.port}",
                }
                # The node that does not serve the key forwards it exactly once, to the member that does.
                r = http.get(cluster.node_urls[outsider] + key_path(key), headers=forged)
                assert r.status_code == 200, (key, r.text)
                assert r.json() == expected(key)
                if r.headers["x-keyroute-hops"] == "0":
                    # A node that just handed the partition over may still answer from its own copy.
                    assert r.headers["x-keyroute-node"] == outsider
                    continue
                checked += 1
                assert r.headers["x-keyroute-forwarded-by"] == outsider
                assert r.headers["x-keyroute-node"] == owner
                assert r.headers["x-keyroute-hops"] == "1"

                # The same through the router: it routes on its own map, in one hop.
                r = http.get(cluster.router_url + key_path(key), headers=forged)
                assert r.status_code == 200 and r.json() == expected(key)
                assert r.headers["x-keyroute-hops"] == "0" and r.headers["x-keyroute-node"] == owner

                # A batch-get with the same forged headers: forwarded once per key too.
                r = http.post(
                    cluster.node_urls[outsider] + "/stores/bookings/batch-get", json={"keys": [key]}, headers=forged
                )
                entry = r.json()["results"][0]
                assert entry["status"] == 200 and entry["value"] == ROWS[key]
            assert checked >= len(ROWS) // 4, "too few reads were forwarded to prove anything"

            # A real member's hop count is still honoured: a forwarded request is never forwarded again.
            key = next(k for k in ROWS if serving[partition(k)][0] == "n2")
            member = {"x-keyroute-hops": "1", "x-keyroute-auth": member_token(SECRET)}
            r = http.get(cluster.node_urls["n1"] + key_path(key), headers=member)
            assert r.status_code == 503 and r.json()["error"] == "partition_unavailable"
            assert "retry-after" in r.headers
        assert canary.connections == 0
    finally:
        canary.close()
