"""LocalReadProtocol on a real uvicorn server (127.0.0.1): a read of a key held here is answered by the
protocol itself, byte for byte as the application answers it (same status, body and headers); every other
request (forwarded, held elsewhere, missing, bad) still gets the application's answer."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import keyroute.node.app
import pytest
from keyroute.core.http_server import CoalescingHttpToolsProtocol
from keyroute.node.app import LocalReadProtocol, local_read_protocol

from tests.unit.node.test_node_app import (
    HELD,
    KEY_LOCAL,
    KEY_REMOTE,
    LOCAL_P,
    ME,
    SERVING,
    Client,
    client_for,
    key_in,
    unreachable,
)
from tests.util import uvicorn_in_thread

# Differ between any two answers, whoever gives them.
_VOLATILE = {"date", "server", "x-request-id"}


@dataclass
class Server:
    port: int
    answered: list[str]  # raw paths the protocol answered itself


@pytest.fixture
def pair() -> Iterator[tuple[Client, Server]]:
    client, _ = client_for(SERVING, HELD, unreachable)
    app = client._transport.app  # type: ignore[attr-defined]
    answered: list[str] = []

    class Spy(local_read_protocol(app, ME, CoalescingHttpToolsProtocol)):  # type: ignore[misc]
        def express(self, cycle: Any, raw_path: bytes, target_bytes: int, headers: Any) -> Any:
            result = super().express(cycle, raw_path, target_bytes, headers)
            if result is not None:
                answered.append(f"express {raw_path.decode()}")
            return result

        async def answer(self, scope: Any, raw_path: bytes) -> Any:
            result = await super().answer(scope, raw_path)
            if result is not None:
                answered.append(f"task {raw_path.decode()}")
            return result

    with uvicorn_in_thread(app, Spy) as port:
        yield client, Server(port, answered)


def comparable(r: httpx.Response) -> tuple[int, bytes, dict[str, str]]:
    return r.status_code, r.content, {k: v for k, v in r.headers.items() if k not in _VOLATILE}


def test_a_held_key_is_answered_by_the_protocol_exactly_as_the_application_answers_it(
    pair: tuple[Client, Server],
) -> None:
    client, server = pair
    url = f"http://127.0.0.1:{server.port}"
    with httpx.Client(base_url=url, trust_env=False, timeout=10) as http:
        for method in ("GET", "HEAD"):
            direct = http.request(method, f"/stores/s/keys/{KEY_LOCAL}", headers={"x-request-id": "rid-1"})
            via_app = client.request(method, f"/stores/s/keys/{KEY_LOCAL}", headers={"x-request-id": "rid-1"})
            assert direct.status_code == 200
            assert comparable(direct) == comparable(via_app)
            assert direct.headers["x-request-id"] == "rid-1" == via_app.headers["x-request-id"]
        generated = http.get(f"/stores/s/keys/{KEY_LOCAL}")
        assert generated.headers["x-request-id"] not in ("", "rid-1")
    assert server.answered == [f"express /stores/s/keys/{KEY_LOCAL}"] * 3


def test_pipelined_reads_are_answered_in_order_by_the_protocol_or_the_application(
    pair: tuple[Client, Server],
) -> None:
    client, server = pair
    path = f"/stores/s/keys/{KEY_LOCAL}"
    missing = f"/stores/s/keys/{key_in('s', LOCAL_P, prefix='zz')}"
    raw = (
        f"GET {path} HTTP/1.1\r\nHost: x\r\nX-Request-ID: one\r\n\r\n"
        f"GET {missing} HTTP/1.1\r\nHost: x\r\n\r\n"
        f"GET {path} HTTP/1.1\r\nHost: x\r\nX-Request-ID: three\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(raw)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    first, second, third = received.split(b"HTTP/1.1 ")[1:]
    body = client.get(path).content
    assert second.startswith(b"404 ") and b"key_not_found" in second
    for answer, request_id in ((first, b"one"), (third, b"three")):
        assert answer.startswith(b"200 ") and answer.endswith(body)
        assert b"\r\nx-request-id: " + request_id + b"\r\n" in answer
    # The first is answered at once, the express way; the missing key goes to the application, and the
    # read behind it waits for that answer, so goes the way of uvicorn's cycle.
    assert server.answered == [f"express {path}", f"task {path}"]


def test_everything_else_is_answered_by_the_application(pair: tuple[Client, Server]) -> None:
    client, server = pair
    missing = key_in("s", LOCAL_P, prefix="zz")
    requests: list[tuple[str, dict[str, str]]] = [
        (f"/stores/s/keys/{missing}", {}),  # held here, not in it: 404
        (f"/stores/s/keys/{KEY_REMOTE}", {}),  # held elsewhere: forwarded (the peers refuse: 503)
        (f"/stores/s/keys/{KEY_LOCAL}", {"x-keyroute-hops": "1"}),  # forwarded to us: hops 1
        ("/stores/nope/keys/k", {}),
        ("/stores/s/keys/" + "k" * 5000, {}),  # over the key limit
        ("/stores/s/deeper/keys/k", {}),
        ("/healthz", {}),
    ]
    with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", trust_env=False, timeout=10) as http:
        for path, headers in requests:
            direct, via_app = http.get(path, headers=headers), client.get(path, headers=headers)
            assert comparable(direct) == comparable(via_app), path
            assert path == "/healthz" or direct.headers["x-request-id"]
    statuses = [client.get(path, headers=headers).status_code for path, headers in requests]
    assert statuses[:5] == [404, 503, 200, 404, 414]
    assert server.answered == []


def test_the_node_protocol_is_a_direct_answer_protocol() -> None:
    from keyroute.core.http_server import DirectAnswerProtocol

    assert issubclass(LocalReadProtocol, DirectAnswerProtocol)


def test_a_held_key_read_is_refused_by_the_admission_checks_before_it_is_answered(
    pair: tuple[Client, Server],
) -> None:
    client, server = pair
    admission = client._transport.app.state.admission  # type: ignore[attr-defined]
    path = f"/stores/s/keys/{KEY_LOCAL}"
    with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", trust_env=False, timeout=10) as http:
        admission.active = admission.max_concurrent_requests  # as many reads in progress as allowed
        try:
            busy = http.get(path, headers={"x-request-id": "busy-1"})
        finally:
            admission.active = 0
        oversized = http.get(path, headers={"x-padding": "p" * (admission.max_header_bytes + 1)})
        after = http.get(path)
    assert busy.status_code == 503 and busy.json()["error"] == "overloaded"
    assert busy.headers["x-request-id"] == "busy-1" and busy.headers["x-keyroute-node"] == ME
    assert busy.headers["retry-after"]
    assert oversized.status_code == 431 and oversized.json()["error"] == "headers_too_large"
    assert (admission.overloaded, admission.headers_too_large) == (1, 1)
    assert after.status_code == 200 and admission.active == 0
    assert server.answered == [f"express {path}"] * 3  # the refusals too, without the application


def test_a_local_answer_that_fails_is_a_json_500_and_the_connection_goes_on(
    pair: tuple[Client, Server], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    client, server = pair
    path = f"/stores/s/keys/{KEY_LOCAL}"
    working = keyroute.node.app.answer_local_read

    def broken(*args: Any) -> Any:
        raise RuntimeError("a bug in the local answer")

    with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", trust_env=False, timeout=10) as http:
        monkeypatch.setattr(keyroute.node.app, "answer_local_read", broken)
        failed = http.get(path, headers={"x-request-id": "oops-1"})
        monkeypatch.setattr(keyroute.node.app, "answer_local_read", working)
        after = http.get(path)  # on the same kept-alive connection
    assert failed.status_code == 500
    assert failed.json() == {"error": "internal_error", "message": "internal error"}
    assert failed.headers["x-request-id"] == "oops-1" and failed.headers["x-keyroute-node"] == ME
    assert b"Traceback" not in failed.content
    assert comparable(after) == comparable(client.get(path)) and after.status_code == 200
    assert client._transport.app.state.admission.active == 0  # type: ignore[attr-defined]
    assert any("a bug in the local answer" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)
