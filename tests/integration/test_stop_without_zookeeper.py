"""A node and a router stop on SIGTERM whatever ZooKeeper's state: real `keyroute node` and `keyroute router`
processes reach the session's ZooKeeper through a TCP relay the test cuts (the server itself keeps running),
then get SIGTERM. Each exits 0, having said it stopped: the node once its drain timeout is over, or at a second
SIGTERM (its drain timeout then too long to be what ended it). Before, the node hung in its graceful leave
(kazoo's calls wait for ZooKeeper), and after a second signal in its shutdown, until killed.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from keyroute.cluster import zk, zk_layout
from keyroute.cluster.partition_map import StoreRecord
from keyroute.dev.zookeeper_server import EmbeddedZooKeeper
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.runtime.settings import ZkSettings
from tests.integration.test_node import key_url, write_snapshot
from tests.util import Proc, TcpProxy, free_port, wait_for

pytestmark = pytest.mark.integration

STORE = "fares"
ROWS = {f"k{i}": {"fare": i} for i in range(20)}
DRAIN_TIMEOUT_S = 3
# How long the test waits for a process to exit: generous (a loaded machine), and no bound on the product.
EXIT_DEADLINE_S = 90


@pytest.fixture
def relay(zk_server: EmbeddedZooKeeper) -> Iterator[TcpProxy]:
    proxy = TcpProxy((zk_server.host, zk_server.port))
    yield proxy
    proxy.close()


def exited(proc: Proc) -> int:
    """The exit code of `proc`, polled until it has exited (no signal sent but the test's own)."""
    assert proc.popen is not None
    wait_for(
        lambda: proc.popen is not None and proc.popen.poll() is not None,
        timeout_s=EXIT_DEADLINE_S,
        interval_s=0.2,
        message=f"{proc.args[0]} to exit after SIGTERM:\n{proc.output()[-3000:]}",
    )
    return int(proc.popen.returncode)


@pytest.mark.parametrize("second_signal", [False, True], ids=["drain timeout", "second signal"])
def test_a_node_and_a_router_cut_off_from_zookeeper_stop_on_sigterm(
    tmp_path: Path, zk_settings: ZkSettings, relay: TcpProxy, second_signal: bool
) -> None:
    writer = zk.connect(zk_settings)
    try:
        snapshot = write_snapshot(tmp_path / "snapshots", STORE, ROWS, KeyFormat.STRING, 2)
        record = StoreRecord(STORE, 2, Partitioner.MURMUR2, KeyFormat.STRING, 1, snapshot)
        writer.create(zk_layout.store_path(STORE), record.to_json(), makepath=True)
    finally:
        zk.close(writer)
    connect = relay.address + zk_settings.chroot
    node_port, router_port = free_port(), free_port()
    common = ["--zk", connect, "--zk-session-timeout-s", "4"]
    node_args = ["--node-id", "n1", "--port", str(node_port), "--data-dir", str(tmp_path / "n1")]
    node_args += ["--drain-timeout-s", str(3600 if second_signal else DRAIN_TIMEOUT_S)]
    node = Proc(["node", *common, *node_args], tmp_path / "n1.log").start()
    router = Proc(["router", *common, "--port", str(router_port)], tmp_path / "router.log").start()
    procs = [node, router]
    try:
        router_url = f"http://127.0.0.1:{router_port}"

        def answers() -> bool:
            r = httpx.get(router_url + key_url(STORE, "k1"), timeout=5)
            return r.status_code == 200 and r.json()["value"] == ROWS["k1"]

        wait_for(answers, timeout_s=90, interval_s=0.2, message="the router answering through the node")
        relay.cut()

        def stale(url: str) -> bool:
            return bool(httpx.get(url + "/readyz", timeout=5).json().get("stale"))

        wait_for(lambda: stale(router_url), timeout_s=60, message="the router's map marked stale")
        assert answers()  # still serving the last known map

        for proc, said in ((node, "node n1 stopped"), (router, "router stopped")):
            assert proc.popen is not None
            proc.popen.send_signal(signal.SIGTERM)
            if second_signal and proc is node:
                wait_for(lambda: "stopping" in node.output(), message="the node stopping")
                proc.popen.send_signal(signal.SIGTERM)
            assert exited(proc) == 0, proc.output()[-3000:]
            assert said in proc.output(), proc.output()[-3000:]
            assert "Traceback" not in proc.output(), proc.output()[-3000:]
        cut_short = "a second stop signal came" if second_signal else "did not end within 8s"
        assert cut_short in node.output()
    finally:
        for proc in procs:
            proc.stop(timeout_s=5)
        for proc in procs:
            print(f"----- {proc.args[0]}\n{proc.output()[-4000:]}")  # shown only when the test failed
