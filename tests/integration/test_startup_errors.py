"""A process that cannot start says why in one line and leaves the cluster as it was; one that can start but
has no ZooKeeper yet (a router) listens and answers 503 meanwhile.

Real `keyroute node` / `keyroute router` processes against the session's ZooKeeper server.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import httpx
import pytest
from kazoo.client import KazooClient

from keyroute.cluster import zk, zk_layout
from keyroute.cluster.partition_map import StoreRecord
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.runtime.settings import ZkSettings
from tests.integration.small_cluster import ROWS, STORE
from tests.integration.test_node import write_snapshot
from tests.util import Proc, free_port, wait_for

pytestmark = pytest.mark.integration


def _node_args(zk_settings: ZkSettings, node_id: str, port: int, data_dir: Path) -> list[str]:
    return [
        "node",
        "--zk",
        zk_settings.connect_string,
        "--node-id",
        node_id,
        "--port",
        str(port),
        "--data-dir",
        str(data_dir),
        "--zk-session-timeout-s",
        "2",
    ]


def _error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if " ERROR " in line]


def _no_trace(output: str) -> None:
    assert "Traceback" not in output, output
    assert "Connection dropped" not in output, output  # kazoo's retry noise is held back


@pytest.fixture
def client(zk_settings: ZkSettings):  # type: ignore[no-untyped-def]
    c = zk.connect(zk_settings)
    yield c
    zk.close(c)


def test_a_second_process_with_a_running_nodes_id_refuses_to_start(
    zk_settings: ZkSettings, client: KazooClient, tmp_path: Path
) -> None:
    first_port = free_port()
    first = Proc(_node_args(zk_settings, "twin", first_port, tmp_path / "a"), tmp_path / "first.log").start()
    try:
        path = zk_layout.node_path("twin")
        wait_for(lambda: client.exists(path) is not None, timeout_s=30, message="the first node's registration")
        owner = client.exists(path).ephemeralOwner
        second_port = free_port()
        second = Proc(_node_args(zk_settings, "twin", second_port, tmp_path / "b"), tmp_path / "second.log")
        second.start()
        assert second.popen is not None
        code = second.popen.wait(timeout=30)
        output = second.output()
        assert code == 1, output
        errors = _error_lines(output)
        assert len(errors) == 1, output
        assert "node twin did not start: node id 'twin' is in use by a running node at" in errors[0]
        assert f"http://127.0.0.1:{first_port}" in errors[0] and "--node-id" in errors[0]
        _no_trace(output)
        # The first node's registration was never touched, and it still answers.
        stat = client.exists(path)
        assert stat is not None and stat.ephemeralOwner == owner
        assert httpx.get(f"http://127.0.0.1:{first_port}/healthz", timeout=5).status_code == 200
    finally:
        first.stop()


def test_a_restart_with_the_same_address_takes_over_its_previous_sessions_registration_at_once(
    zk_settings: ZkSettings, client: KazooClient, tmp_path: Path
) -> None:
    port = free_port()
    args = _node_args(zk_settings, "phoenix", port, tmp_path / "data")
    args[args.index("--zk-session-timeout-s") + 1] = "30"  # the dead session would linger for 30 s
    first = Proc(args, tmp_path / "first.log").start()
    path = zk_layout.node_path("phoenix")
    wait_for(lambda: client.exists(path) is not None, timeout_s=30, message="the first node's registration")
    owner = client.exists(path).ephemeralOwner
    first.kill9()
    second = Proc(args, tmp_path / "second.log").start()
    try:

        def taken_over() -> bool:
            stat = client.exists(path)
            return stat is not None and stat.ephemeralOwner != owner

        wait_for(taken_over, timeout_s=20, message="the restarted node's own registration")
        assert second.alive
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
    finally:
        second.stop()


def test_a_node_whose_port_is_taken_exits_without_ever_registering(
    zk_settings: ZkSettings, client: KazooClient, tmp_path: Path
) -> None:
    seen: list[str] = []
    seen_lock = threading.Lock()

    def on_children(children: list[str]) -> None:
        with seen_lock:
            seen.extend(children)

    client.ensure_path(zk_layout.NODES)
    client.ChildrenWatch(zk_layout.NODES, on_children)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = Proc(_node_args(zk_settings, "squatted", port, tmp_path / "data"), tmp_path / "node.log").start()
        assert proc.popen is not None
        code = proc.popen.wait(timeout=30)
    output = proc.output()
    assert code == 1, output
    errors = _error_lines(output)
    assert len(errors) == 1, output
    assert f"node squatted did not start: cannot listen on 127.0.0.1 port {port}: address already in use" in errors[0]
    _no_trace(output)
    # A registration would have been seen by the watch (it fires on every change of /nodes' children).
    client.sync(zk_layout.NODES)
    assert client.exists(zk_layout.node_path("squatted")) is None
    with seen_lock:
        assert "squatted" not in seen


def test_a_router_without_zookeeper_listens_and_answers_503_until_it_has_a_map(tmp_path: Path) -> None:
    port = free_port()
    unreachable = f"127.0.0.1:{free_port()}"
    router = Proc(["router", "--zk", unreachable, "--port", str(port)], tmp_path / "router.log").start()
    url = f"http://127.0.0.1:{port}"
    try:

        def listening() -> bool:
            try:
                httpx.get(url + "/healthz", timeout=1)
            except httpx.TransportError:
                return False
            return True

        wait_for(listening, timeout_s=15, message="the router to listen without ZooKeeper")
        read = httpx.get(url + "/stores/orders/keys/k1", timeout=5)
        assert read.status_code == 503 and read.json()["error"] == "no_partition_map"
        assert read.headers["retry-after"] == "1"
        ready = httpx.get(url + "/readyz", timeout=5)
        assert ready.status_code == 503
        assert router.alive
        output = router.output()
        assert "no partition map within 5 s of starting: answering 503 until one arrives" in output
        assert output.count("router is listening on") == 1 and f"http://127.0.0.1:{port}" in output
        _no_trace(output)
    finally:
        assert router.stop(timeout_s=20) == 0


def test_the_only_node_stopping_says_its_partitions_are_served_by_nobody(
    zk_settings: ZkSettings, client: KazooClient, tmp_path: Path
) -> None:
    snapshot = write_snapshot(tmp_path / "snapshots", STORE, ROWS, KeyFormat.STRING, 2)
    record = StoreRecord(STORE, 2, Partitioner.MURMUR2, KeyFormat.STRING, 1, snapshot, ("v",), 1, 1.0)
    client.create(zk_layout.store_path(STORE), record.to_json(), makepath=True)
    port = free_port()
    node = Proc(_node_args(zk_settings, "solo", port, tmp_path / "data"), tmp_path / "node.log").start()
    try:
        wait_for(
            lambda: httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200,
            timeout_s=30,
            message="the node serving both partitions",
        )
    finally:
        assert node.stop(timeout_s=30) == 0
    output = node.output()
    assert "node solo stops as the only live node: its 2 partition(s) are served by no node" in output
    assert "served elsewhere" not in output
