"""A real router process against a real ZooKeeper and two small real HTTP "nodes" started by the test.

The nodes answer the node data API with known values and record what reached them, so every routing
decision the router makes is visible; serving records are written to ZooKeeper by the test itself.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from kazoo.client import KazooClient
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from keyroute.api import found_body, key_path_segment
from keyroute.cluster import zk_layout
from keyroute.cluster.partition_map import ServingRecord, StoreRecord
from keyroute.cluster.zk import close, connect
from keyroute.dev.zookeeper_server import EmbeddedZooKeeper
from keyroute.http.server import HttpServer
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.runtime.settings import ZkSettings
from tests.util import Proc, free_port, serve_in_thread, wait_for

pytestmark = pytest.mark.integration

STORE = "bookings"
PARTITIONS = 4
MISSING = "no-such-key"
WEIRD_KEYS = ["a/b", "100%", "50%2F", "a+b", "what?", "#tag", "with space", "東京", "😀 ok", "..", "a%20b"]
PLAIN_KEYS = [f"customer-{i}" for i in range(24)]
KEYS = PLAIN_KEYS + WEIRD_KEYS


def partition(key: str) -> int:
    return partition_for(Partitioner.MURMUR2, key.encode("utf-8"), PARTITIONS)


def key_url(base: str, key: str, store: str = STORE) -> str:
    segment = quote(key, safe="") if key not in (".", "..") else key.replace(".", "%2E")
    return f"{base}/stores/{store}/keys/{segment}"


@dataclass
class FakeNode:
    """A tiny real node: keyroute's HTTP server in a thread, answering every key of STORE except MISSING."""

    node_id: str
    port: int = 0
    received: list[str] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    running: ExitStack | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _answer(self, store: str, key: str) -> tuple[int, bytes]:
        if store != STORE or key == MISSING:
            return 404, json.dumps({"error": "key_not_found", "message": f"no key {key!r}"}).encode()
        value = json.dumps({"node": self.node_id, "key": key}, ensure_ascii=False).encode()
        return 200, found_body(store, key, partition(key), 1, value)

    async def get(self, request: Request) -> Response:
        located = key_path_segment(request.scope["raw_path"])
        assert located is not None
        store, key = located
        self.received.append(key)
        self.headers.append(dict(request.headers))
        status, body = self._answer(store, key)
        return Response(
            body,
            status_code=status,
            media_type="application/json",
            headers={
                "x-keyroute-node": self.node_id,
                "x-keyroute-partition": str(partition(key)),
                "x-keyroute-version": "1",
                "x-keyroute-hops": "0",
            },
        )

    async def batch(self, request: Request) -> Response:
        keys = (await request.json())["keys"]
        self.received.extend(keys)
        results = []
        for key in keys:
            status, body = self._answer(request.path_params["store"], key)
            entry = json.loads(body)
            results.append(
                {
                    "key": key,
                    "status": status,
                    **({"partition": partition(key)} if status == 200 else {}),
                    **entry,
                }
            )
        return JSONResponse({"results": results})

    def start(self) -> FakeNode:
        app = Starlette(
            routes=[
                Route("/stores/{store}/keys/{key:path}", self.get, methods=["GET"]),
                Route("/stores/{store}/batch-get", self.batch, methods=["POST"]),
            ]
        )
        self.running = ExitStack()
        self.port = self.running.enter_context(serve_in_thread(HttpServer(app)))
        return self

    def stop(self) -> None:
        if self.running is not None:
            self.running.close()
        self.running = None

    def refuses_connections(self) -> bool:
        try:
            httpx.get(self.url + "/", timeout=2)
        except httpx.ConnectError:
            return True
        return False


@dataclass
class Cluster:
    zk: KazooClient
    router: Proc
    router_url: str
    nodes: dict[str, FakeNode]
    http: httpx.Client

    def publish_store(self) -> None:
        record = StoreRecord(STORE, PARTITIONS, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/snapshots/bookings/v1")
        self.zk.create(zk_layout.store_path(STORE), record.to_json())

    def serve(self, node_id: str, partitions: list[int]) -> None:
        """Create or replace the node's serving record (ephemeral, as a real node writes it)."""
        node = self.nodes[node_id]
        data = ServingRecord(node_id, node.url, {STORE: dict.fromkeys(partitions, 1)}).to_json()
        path = zk_layout.serving_path(node_id)
        if self.zk.exists(path):
            self.zk.set(path, data)
        else:
            self.zk.create(path, data, ephemeral=True)

    def withdraw(self, node_id: str) -> None:
        self.zk.delete(zk_layout.serving_path(node_id))

    def get(self, key: str, store: str = STORE) -> httpx.Response:
        return self.http.get(key_url(self.router_url, key, store))

    def readyz(self) -> httpx.Response:
        return self.http.get(self.router_url + "/readyz")

    def serving_seen(self, node_id: str, partition_no: int) -> bool:
        pmap = self.http.get(self.router_url + "/admin/partition-map?detail=all").json()
        if STORE not in pmap["stores"]:
            return False
        serving = pmap["stores"][STORE]["partition_map"][partition_no]["serving"]
        return any(s["node"] == node_id for s in serving)


@contextmanager
def running_cluster(zk_settings: ZkSettings, tmp_path: Path) -> Iterator[Cluster]:
    nodes = {node_id: FakeNode(node_id).start() for node_id in ("node-a", "node-b")}
    zk = connect(zk_settings)
    port = free_port()
    router = Proc(["router", "--zk", zk_settings.connect_string, "--port", str(port)], tmp_path / "router.log")
    router.start()
    http = httpx.Client(timeout=10)
    router_url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: http.get(router_url + "/healthz").status_code == 200, timeout_s=30, message="router up")
        yield Cluster(zk, router, router_url, nodes, http)
    finally:
        http.close()
        code = router.stop()
        for node in nodes.values():
            node.stop()
        close(zk)
        if code != 0:
            print(router.output()[-4000:])
    # SIGTERM is the orchestrator's normal way to stop a router: a clean exit, not a crash.
    assert code == 0, f"router exited with {code}"


@pytest.fixture
def cluster(zk_settings: ZkSettings, tmp_path: Path) -> Iterator[Cluster]:
    with running_cluster(zk_settings, tmp_path) as running:
        yield running


def test_routes_each_key_to_the_node_serving_its_partition_once_the_map_is_complete(cluster: Cluster) -> None:
    # Ready once it has read the map (nothing published yet): it can proxy, and says so.
    empty = wait_for(lambda: (r := cluster.readyz()).status_code == 200 and r, message="router has a map")
    assert empty.json()["ready"] is True and empty.json()["stores_loading"] == []

    cluster.publish_store()
    cluster.serve("node-a", [0, 1])
    wait_for(lambda: cluster.serving_seen("node-a", 0), message="router sees node-a's serving record")
    # Partitions 2 and 3 are served by no one yet: still ready (partitions 0 and 1 answer), the store is
    # loading, and the unserved partitions' keys are 503 with Retry-After.
    loading = cluster.readyz()
    assert loading.status_code == 200 and loading.json()["stores_loading"] == [STORE]
    unserved = next(k for k in KEYS if partition(k) >= 2)
    resp = cluster.get(unserved)
    assert resp.status_code == 503 and resp.json()["error"] == "partition_unavailable"
    assert resp.headers["retry-after"] == "1"

    cluster.serve("node-b", [2, 3])
    ready = wait_for(
        lambda: (r := cluster.readyz()).status_code == 200 and r.json()["complete"] and r, message="map complete"
    )
    assert ready.json()["ready"] is True and ready.json()["stale"] is False
    assert isinstance(ready.json()["generation"], int) and ready.json()["generation"] > 0

    for key in KEYS:
        resp = cluster.get(key)
        expected_node = "node-a" if partition(key) < 2 else "node-b"
        assert resp.status_code == 200, (key, resp.text)
        body = resp.json()
        assert body["key"] == key and body["value"] == {"node": expected_node, "key": key}
        assert body["partition"] == partition(key)
        assert resp.headers["x-keyroute-node"] == expected_node
        assert resp.headers["x-keyroute-partition"] == str(partition(key))
        assert resp.headers["x-keyroute-hops"] == "0"
    # Every key reached exactly the node that serves it, exactly as sent (percent-encoding undone once).
    for node_id, node in cluster.nodes.items():
        assert node.received == [k for k in KEYS if (partition(k) < 2) == (node_id == "node-a")]
        # Marked as coming from a router, but not as forwarded: the node may still forward once.
        assert all(h.get("x-keyroute-router") == "1" and "x-keyroute-hops" not in h for h in node.headers)
    assert {partition(k) for k in WEIRD_KEYS} & {0, 1} and {partition(k) for k in WEIRD_KEYS} & {2, 3}

    batch_keys = [KEYS[5], MISSING, *WEIRD_KEYS, KEYS[0]]
    resp = cluster.http.post(cluster.router_url + f"/stores/{STORE}/batch-get", json={"keys": batch_keys})
    assert resp.status_code == 200
    results = resp.json()["results"]
    assert [r["key"] for r in results] == batch_keys
    assert [r["status"] for r in results] == [404 if k == MISSING else 200 for k in batch_keys]
    for key, result in zip(batch_keys, results, strict=True):
        if key != MISSING:
            assert result["value"]["node"] == ("node-a" if partition(key) < 2 else "node-b")


def test_errors_are_json_objects_with_a_code_and_a_message(cluster: Cluster) -> None:
    cluster.publish_store()
    cluster.serve("node-a", [0, 1, 2, 3])
    wait_for(lambda: cluster.readyz().json().get("complete") is True, message="router ready")
    base = cluster.router_url
    cases = [
        ("GET", key_url(base, "k", store="nope"), None, 404, "store_not_found"),
        ("GET", key_url(base, MISSING), None, 404, "key_not_found"),
        ("GET", base + f"/stores/{STORE}/keys/%FF", None, 400, "bad_key"),
        ("GET", base + "/no/such/route", None, 404, "not_found"),
        ("PUT", key_url(base, "k"), None, 405, "method_not_allowed"),
        ("POST", base + f"/stores/{STORE}/batch-get", b"{not json", 400, "bad_request"),
        (
            "POST",
            base + f"/stores/{STORE}/batch-get",
            json.dumps({"keys": ["k"] * 1001}).encode(),
            413,
            "too_many_keys",
        ),
    ]
    for method, url, body, status, code in cases:
        resp = cluster.http.request(method, url, content=body)
        assert resp.status_code == status, (url, resp.text)
        assert resp.headers["content-type"].startswith("application/json"), url
        assert resp.json()["error"] == code and resp.json()["message"], url
        assert "Traceback" not in resp.text


def test_a_stopped_node_is_retried_on_the_other_serving_replica(cluster: Cluster) -> None:
    cluster.publish_store()
    cluster.serve("node-a", list(range(PARTITIONS)))
    cluster.serve("node-b", list(range(PARTITIONS)))
    wait_for(
        lambda: cluster.readyz().json().get("complete") is True and cluster.serving_seen("node-b", 3), message="ready"
    )
    # Reads are spread over both serving replicas (power of two choices on requests in flight).
    assert {cluster.get(k).headers["x-keyroute-node"] for k in PLAIN_KEYS} == {"node-a", "node-b"}

    node_a = cluster.nodes["node-a"]
    node_a.stop()  # its serving record stays: the router learns of the death only by trying
    assert node_a.refuses_connections()
    before = len(cluster.nodes["node-b"].received)
    for key in KEYS:
        resp = cluster.get(key)
        assert resp.status_code == 200, (key, resp.text)
        assert resp.json()["value"] == {"node": "node-b", "key": key}
        assert resp.headers["x-keyroute-hops"] == "0"
    assert cluster.nodes["node-b"].received[before:] == KEYS

    resp = cluster.http.post(cluster.router_url + f"/stores/{STORE}/batch-get", json={"keys": PLAIN_KEYS[:6]})
    assert [r["status"] for r in resp.json()["results"]] == [200] * 6
    metrics = cluster.http.get(cluster.router_url + "/metrics").text
    assert "keyroute_router_upstream_failures_total 0" not in metrics


def test_follows_a_moved_serving_record_without_restart(cluster: Cluster) -> None:
    cluster.publish_store()
    cluster.serve("node-a", list(range(PARTITIONS)))
    wait_for(lambda: cluster.readyz().json().get("complete") is True, message="router ready")
    assert {cluster.get(k).json()["value"]["node"] for k in PLAIN_KEYS} == {"node-a"}

    # Make before break, as a real hand-over does: node-b announces, then node-a lets go.
    cluster.serve("node-b", list(range(PARTITIONS)))
    cluster.withdraw("node-a")
    wait_for(lambda: not cluster.serving_seen("node-a", 0), message="router sees node-a gone")
    a_before = len(cluster.nodes["node-a"].received)
    assert {cluster.get(k).json()["value"]["node"] for k in PLAIN_KEYS} == {"node-b"}
    assert len(cluster.nodes["node-a"].received) == a_before
    route = cluster.http.get(cluster.router_url + "/admin/route", params={"store": STORE, "key": "a/b"}).json()
    assert route["partition"] == partition("a/b")
    assert [s["node"] for s in route["serving"]] == ["node-b"]

    # Partition 0 moves back to node-a alone: only its keys go there.
    cluster.serve("node-a", [0])
    cluster.serve("node-b", [1, 2, 3])
    wait_for(lambda: not cluster.serving_seen("node-b", 0), message="router sees partition 0 move")
    for key in PLAIN_KEYS:
        assert cluster.get(key).json()["value"]["node"] == ("node-a" if partition(key) == 0 else "node-b")

    # Nobody announces partition 0 any more: the store is degraded, the router stays ready (the other
    # partitions answer). Its keys still go to the node that served it last (a node whose ZooKeeper session
    # expired still holds its data), and are 503 once it is gone.
    cluster.withdraw("node-a")
    wait_for(
        lambda: (r := cluster.readyz()).status_code == 200 and r.json()["stores_degraded"] == [STORE],
        message="the store degraded, the router still ready",
    )
    key0 = next(k for k in PLAIN_KEYS if partition(k) == 0)
    still = cluster.get(key0)
    assert still.status_code == 200 and still.json()["value"]["node"] == "node-a"
    route = cluster.http.get(cluster.router_url + "/admin/route", params={"store": STORE, "key": key0}).json()
    assert route["serving"] == [] and [e["node"] for e in route["last_known"]] == ["node-a"]
    cluster.nodes["node-a"].stop()
    gone = cluster.get(key0)
    assert gone.status_code == 503 and gone.json()["error"] == "partition_unavailable"
    cluster.serve("node-b", [0, 1, 2, 3])
    wait_for(lambda: cluster.readyz().json().get("complete") is True, message="router ready again")
    assert cluster.get(key0).json()["value"]["node"] == "node-b"


def test_keeps_serving_the_last_map_marked_stale_while_zookeeper_is_down(tmp_path: Path) -> None:
    # A ZooKeeper of its own: stopping the shared one would disturb every other test.
    zk_server = EmbeddedZooKeeper(port=free_port(), data_dir=tmp_path / "zookeeper").start()
    settings = ZkSettings(hosts=zk_server.connect_string, chroot="/outage", session_timeout_s=30.0)
    try:
        with running_cluster(settings, tmp_path) as cluster:
            cluster.publish_store()
            cluster.serve("node-a", list(range(PARTITIONS)))
            wait_for(lambda: cluster.readyz().json().get("complete") is True, message="router ready")

            zk_server.stop()
            stale = wait_for(lambda: (r := cluster.readyz()).json()["stale"] and r, message="map marked stale")
            assert stale.status_code == 200 and stale.json()["ready"] is True
            for key in PLAIN_KEYS[:5]:
                assert cluster.get(key).json()["value"]["node"] == "node-a"
            assert cluster.http.get(cluster.router_url + "/admin/partition-map?detail=all").json()["stale"] is True

            zk_server.start()
            wait_for(lambda: not cluster.readyz().json()["stale"], timeout_s=60, message="map fresh again")
            assert cluster.readyz().json().get("complete") is True
    finally:
        zk_server.stop()
