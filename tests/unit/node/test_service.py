"""keyroute.state_node.service: the node process around keyroute's HTTP server. A stop first leaves the cluster
(reads still answered meanwhile), a second stop signal cuts the leave short, a node that cannot start
exits 1 with the reason logged, the server's limits follow the node's settings, and the requests the server
refuses itself show in the node's metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path

import httpx
import pytest

from keyroute.runtime.settings import HttpSettings, NodeSettings, RequestLimits, ZkSettings
from keyroute.state_node.app import Node, create_app
from keyroute.state_node.service import NodeServer, body_limit, run, server_limits
from tests.unit.node.fakes import HELD, KEY_LOCAL, SERVING, FakeOwnership, WithoutLifespan, build, node_settings
from tests.util import free_port, serve_in_thread, wait_until

EVENTS: list[str] = []


class LeavingNode(Node):
    """A node whose graceful leave reads a key through its own server, then takes `leave_s`."""

    __slots__ = ()
    port = 0
    leave_s = 0.0

    async def leave(self) -> None:
        EVENTS.append("leaving")
        async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
            r = await http.get(f"http://127.0.0.1:{LeavingNode.port}/stores/s/keys/{KEY_LOCAL}")
        EVENTS.append(f"read {r.status_code}")
        try:
            await asyncio.sleep(LeavingNode.leave_s)
        except asyncio.CancelledError:
            EVENTS.append("cut short")
            raise
        EVENTS.append("left")


def serve_and_stop(stop_signals: int) -> None:
    """A node on a NodeServer in a new event loop on this (the main) thread, stopped; `stop_signals`
    SIGTERMs sent to this process while it leaves."""
    EVENTS.clear()
    settings = node_settings()
    app = create_app(settings)
    node = LeavingNode(settings, FakeOwnership(build(SERVING), HELD), httpx.AsyncClient())  # type: ignore[arg-type]
    app.state.node = node

    async def scenario() -> None:
        server = NodeServer(WithoutLifespan(app), settings)
        await server.start(port=0)
        LeavingNode.port = server.port
        stopping = asyncio.get_running_loop().create_task(server.stop())
        await wait_until(lambda: "read 200" in EVENTS, message="the read under way answered")
        for _ in range(stop_signals):
            os.kill(os.getpid(), signal.SIGTERM)  # handled by the server: it is leaving
        await stopping
        EVENTS.append("stopped")
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient(trust_env=False) as http:
                await http.get(f"http://127.0.0.1:{LeavingNode.port}/healthz")
        await node.http.aclose()

    assert threading.current_thread() is threading.main_thread()  # where the stop signals are handled
    asyncio.run(scenario())


def test_a_stop_first_leaves_the_cluster_while_reads_are_still_answered() -> None:
    LeavingNode.leave_s = 0.05
    serve_and_stop(stop_signals=0)
    assert EVENTS == ["leaving", "read 200", "left", "stopped"]


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_a_second_stop_signal_cuts_the_leave_short(caplog: pytest.LogCaptureFixture) -> None:
    LeavingNode.leave_s = 60.0
    with caplog.at_level(logging.WARNING, logger="keyroute.state_node.service"):
        serve_and_stop(stop_signals=1)
    assert EVENTS == ["leaving", "read 200", "cut short", "stopped"]
    assert "stops at once" in caplog.text
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # nothing of the server's left behind


def test_a_node_that_cannot_reach_zookeeper_exits_1_with_the_reason_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    zk = ZkSettings(hosts=f"127.0.0.1:{free_port()}", connect_timeout_s=0.5)
    # A free port of its own: the default one (8080) may be another program's.
    settings = NodeSettings(node_id="lonely", data_dir=tmp_path, zk=zk, http=HttpSettings(port=free_port()))
    with caplog.at_level(logging.INFO):
        assert run(settings) == 1
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in errors] == [
        f"node lonely did not start: cannot reach ZooKeeper at {zk.hosts} within 0.5 s (connection refused)"
    ]
    assert all(r.exc_info is None for r in caplog.records)  # one line, no traceback
    assert "Connection dropped" not in caplog.text  # kazoo's retries are held back


def test_the_servers_limits_follow_the_nodes_settings() -> None:
    given = RequestLimits(max_header_bytes=4000, max_body_bytes=1000, body_timeout_s=2.5)
    limits = server_limits(node_settings(limits=given))
    # A batch-get body a router re-encoded (integers as strings, ", " separators) must still fit.
    assert (limits.max_header_bytes, limits.max_body_bytes) == (4000, body_limit(1000, 5)) == (4000, 1040)
    assert limits.body_timeout_s == 2.5
    unlimited = server_limits(
        node_settings(limits=RequestLimits(max_header_bytes=0, max_body_bytes=0, body_timeout_s=0))
    )
    assert unlimited.max_header_bytes == unlimited.max_body_bytes == sys.maxsize
    assert unlimited.body_timeout_s == 0


class StayingNode(Node):
    """A node whose graceful leave has nothing to hand over."""

    __slots__ = ()

    async def leave(self) -> None:
        return None


def _refusal(port: int, request: bytes) -> tuple[int, dict[str, str]]:
    """(status, JSON body) of the answer to `request`, read until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def test_the_nodes_metrics_count_the_requests_its_server_refuses() -> None:
    settings = node_settings(limits=RequestLimits(max_header_bytes=4000, max_body_bytes=1000))
    app = create_app(settings)
    node = StayingNode(settings, FakeOwnership(build(SERVING), HELD), httpx.AsyncClient())  # type: ignore[arg-type]
    node.metrics.admission = app.state.admission  # as the lifespan's node shares create_app's metrics
    app.state.node = node
    with serve_in_thread(NodeServer(WithoutLifespan(app), settings)) as port:
        # Refused by the server while the head arrives / from the body's declared length (the node takes
        # body_limit(1000, 5) = 1040 bytes): neither the data plane nor the admission checks see them.
        big_head = f"GET /stores/s/keys/{KEY_LOCAL} HTTP/1.1\r\nhost: n1\r\nx-padding: {'p' * 4001}\r\n\r\n"
        big_body = "POST /stores/s/batch-get HTTP/1.1\r\nhost: n1\r\ncontent-length: 1041\r\n\r\n"
        status, body = _refusal(port, big_head.encode())
        assert status == 431 and body["error"] == "headers_too_large"
        status, body = _refusal(port, big_body.encode() + b"x" * 1041)
        assert status == 413 and body["error"] == "body_too_large"
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=10) as http:
            assert http.get(f"/stores/s/keys/{KEY_LOCAL}").status_code == 200
            metrics = http.get("/metrics").text
    admission = app.state.admission
    assert (admission.headers_too_large, admission.body_too_large, admission.active) == (1, 1, 0)
    assert node.metrics.requests.total() == 1  # the read served; the refused ones never reached the node
    for reason, count in [("headers_too_large", 1), ("body_too_large", 1), ("body_timeout", 0), ("overloaded", 0)]:
        assert f'keyroute_node_refused_requests_total{{reason="{reason}"}} {count}.0' in metrics
    with pytest.raises(ValueError, match="teapot"):
        admission.refused("teapot")  # a reason no metric would show
