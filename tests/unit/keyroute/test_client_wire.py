"""The client's own wire against a scripted HTTP server on a real socket: keep-alive reuse, the keep-alive race,
answers the common-case reader leaves to httptools (chunked, gzip, informational, no length), answers that
break the connection's step, and failures as httpx's transport exceptions under `ConnectionFailed`; for
`Client` (its socket wire) and `AsyncClient` (keyroute.http's member wire)."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import trustme

from keyroute.client import AsyncClient, Client, ConnectionFailed, KeyNotFound, Value
from tests.util import free_port

FOUND = {"store": "s", "key": "k", "partition": 3, "version": 7, "value": {"n": 1}}
Reply = bytes | Callable[[socket.socket], None]  # bytes to send, or what to do with the connection instead


def answer(body: Any = FOUND, status: str = "200 OK", *headers: str) -> bytes:
    data = json.dumps(body).encode()
    head = [f"HTTP/1.1 {status}", "content-type: application/json", f"content-length: {len(data)}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + data


def close(conn: socket.socket) -> None:
    conn.close()


def hang(conn: socket.socket) -> None:
    """Say nothing until the client gives up (it closes the connection)."""
    conn.recv(1)


class Server:
    """Answers each request with the next of `replies`, in order, on whatever connection it came; records
    the requests (head and body) and how many connections were accepted."""

    def __init__(
        self, replies: list[Reply], tls: ssl.SSLContext | None = None, echo: Callable[[bytes], bytes] | None = None
    ) -> None:
        self.replies = list(replies)
        self.echo = echo  # when given, what answers each request (its head), instead of `replies`
        self.tls = tls
        self.peers: list[dict[str, Any] | None] = []  # the client certificate of each TLS connection
        self.requests: list[tuple[bytes, bytes]] = []
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.sock.getsockname()[1]}"
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        data = b""
        if self.tls is not None:
            try:
                conn = self.tls.wrap_socket(conn, server_side=True)
            except (ssl.SSLError, OSError):
                conn.close()
                return
            self.peers.append(conn.getpeercert())
        with conn:
            while True:
                while b"\r\n\r\n" not in data:
                    more = conn.recv(65536)
                    if not more:
                        return
                    data += more
                head, _, data = data.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                while len(data) < length:
                    data += conn.recv(65536)
                body, data = data[:length], data[length:]
                with self.lock:
                    self.requests.append((head, body))
                    reply = self.echo(head) if self.echo is not None else self.replies.pop(0)
                if callable(reply):
                    reply(conn)
                    return
                conn.sendall(reply)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def serve() -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def start(replies: list[Reply], tls: ssl.SSLContext | None = None, **options: Any) -> Server:
        servers.append(Server(replies, tls, **options))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def test_reads_share_one_kept_alive_connection_and_send_the_clients_headers(serve: Any) -> None:
    server = serve([answer(), answer({"error": "key_not_found", "message": "no"}, "404 Not Found"), answer()])
    with Client(server.url, token="t0k") as client:
        assert client.get("s", "k") == Value("s", "k", 3, 7, {"n": 1})
        with pytest.raises(KeyNotFound):
            client.get("s", "a/b")
        assert client.get("s", "k", answer_format="json").value == {"n": 1}
    assert server.connections == 1
    heads = [head.split(b"\r\n") for head, _ in server.requests]
    assert [lines[0] for lines in heads] == [
        b"GET /stores/s/keys/k HTTP/1.1",
        b"GET /stores/s/keys/a%2Fb HTTP/1.1",
        b"GET /stores/s/keys/k HTTP/1.1",
    ]
    for lines in heads:
        assert {b"accept: application/json", b"authorization: Bearer t0k", b"host: " + server.url[7:].encode()} <= set(
            lines
        )


def test_a_batch_is_one_post_of_json(serve: Any) -> None:
    entries = [{"key": "a", "status": 200, "partition": 0, "version": 1, "value": 1, "node": "n1"}]
    server = serve([answer({"results": entries})])
    with Client(server.url) as client:
        [found] = client.get_many("s", ["a"])
    assert found == Value("s", "a", 0, 1, 1, node="n1")
    head, body = server.requests[0]
    assert head.startswith(b"POST /stores/s/batch-get HTTP/1.1\r\n")
    assert b"content-type: application/json" in head.split(b"\r\n") and json.loads(body) == {"keys": ["a"]}


def test_a_connection_the_server_closed_while_idle_is_replaced_and_the_read_sent_again(serve: Any) -> None:
    def answer_then_close(conn: socket.socket) -> None:
        conn.sendall(answer())
        conn.shutdown(socket.SHUT_WR)

    server = serve([answer_then_close, answer()])
    with Client(server.url, retries=0) as client:
        client.get("s", "k")
        assert client.get("s", "k").value == {"n": 1}  # no retry left: the wire itself sent it again
    assert server.connections == 2 and len(server.requests) == 2


def test_answers_the_common_reader_leaves_to_the_parser(serve: Any) -> None:
    data = gzip.compress(json.dumps(FOUND).encode())
    chunked = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
        + b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (data[:10], data[10:]))
        + b"0\r\n\r\n"
    )

    def without_length(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n" + json.dumps(FOUND).encode())
        conn.close()

    server = serve([chunked, without_length, answer()])
    with Client(server.url) as client:
        assert [client.get("s", "k").value for _ in range(3)] == [{"n": 1}] * 3
    # the answer that ended with its connection: the next read on a new one
    assert server.connections == 2


def test_an_answer_with_bytes_beyond_it_or_saying_close_leaves_its_connection(serve: Any) -> None:
    server = serve([answer() + b"HTTP/1.1 200 OK\r\n", answer(FOUND, "200 OK", "Connection: close"), answer()])
    with Client(server.url) as client:
        for _ in range(3):
            assert client.get("s", "k").value == {"n": 1}
    assert server.connections == 3


def test_no_answer_is_connection_failed_with_httpxs_exception_of_its_kind(serve: Any) -> None:
    server = serve([b"NOT HTTP AT ALL\r\n\r\n", close, hang, hang])
    with Client(server.url, retries=0, timeout=0.3) as client:
        with pytest.raises(ConnectionFailed) as malformed:
            client.get("s", "k")
        assert isinstance(malformed.value.__cause__, httpx.RemoteProtocolError)
        with pytest.raises(ConnectionFailed) as closed:
            client.get("s", "k")
        assert isinstance(closed.value.__cause__, httpx.RemoteProtocolError)
        with pytest.raises(ConnectionFailed) as silent:
            client.get("s", "k")
        assert isinstance(silent.value.__cause__, httpx.ReadTimeout)
        assert str(silent.value).startswith(f"connection_failed: no answer from {server.url}: ReadTimeout")

    async def main() -> None:
        async with AsyncClient(server.url, retries=0, timeout=0.3) as client:
            with pytest.raises(ConnectionFailed) as silent:
                await client.get("s", "k")
            assert isinstance(silent.value.__cause__, httpx.ReadTimeout)

    asyncio.run(main())


def test_the_async_client_reads_over_the_member_wire(serve: Any) -> None:
    entries = [{"key": "b", "status": 404, "error": "key_not_found", "message": "no"}]
    server = serve([answer(), answer({"results": entries}), answer()])

    async def main() -> None:
        async with AsyncClient(server.url, token="t0k") as client:
            assert await client.get("s", "k") == Value("s", "k", 3, 7, {"n": 1})
            [missing] = await client.get_many("s", ["b"])
            assert isinstance(missing, KeyNotFound)
            assert (await client.get("s", "k")).value == {"n": 1}

    asyncio.run(main())
    assert server.connections == 1
    head, body = server.requests[1]
    assert head.startswith(b"POST /stores/s/batch-get HTTP/1.1\r\n") and json.loads(body) == {"keys": ["b"]}
    assert b"authorization: Bearer t0k" in server.requests[0][0].split(b"\r\n")


def test_a_url_the_wire_cannot_reach_is_connection_failed_and_a_header_it_cannot_send_a_value_error() -> None:
    with Client("ftp://kr", retries=0) as client, pytest.raises(ConnectionFailed) as raised:
        client.get("s", "k")
    assert isinstance(raised.value.__cause__, httpx.UnsupportedProtocol)
    with Client(f"http://127.0.0.1:{free_port()}", token="a\r\nb") as client, pytest.raises(ValueError, match="header"):
        client.get("s", "k")


def test_both_clients_verify_the_server_and_present_their_certificate_over_tls(serve: Any, tmp_path: Any) -> None:
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_context)
    ca.configure_trust(server_context)
    server_context.verify_mode = ssl.CERT_REQUIRED  # a client certificate from the CA, or no handshake
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    client_cert = ca.issue_cert("client@example")
    cert_file = tmp_path / "client.pem"
    client_cert.private_key_and_cert_chain_pem.write_to_path(str(cert_file))
    server = serve([answer(), answer(), answer()], server_context)

    with Client(server.url, verify=str(ca_file), cert=str(cert_file)) as client:
        assert client.get("s", "k").value == {"n": 1}
        assert client.get("s", "k").value == {"n": 1}

    async def main() -> None:
        async with AsyncClient(server.url, verify=str(ca_file), cert=str(cert_file)) as client:
            assert (await client.get("s", "k")).value == {"n": 1}

    asyncio.run(main())
    assert server.connections == 2 and len(server.peers) == 2  # kept alive over TLS too
    assert [peer["subjectAltName"] for peer in server.peers] == [(("email", "client@example"),)] * 2  # type: ignore[index]
    # A server the CA does not vouch for: no answer, on either client.
    with Client(server.url, retries=0) as client, pytest.raises(ConnectionFailed) as refused:
        client.get("s", "k")
    assert isinstance(refused.value.__cause__, httpx.ConnectError)

    async def unverified() -> None:
        async with AsyncClient(server.url, retries=0) as client:
            with pytest.raises(ConnectionFailed) as refused:
                await client.get("s", "k")
            assert isinstance(refused.value.__cause__, httpx.ConnectError)

    asyncio.run(unverified())


def test_threads_sharing_a_client_each_get_the_answer_to_their_own_read(serve: Any) -> None:
    def echo(head: bytes) -> bytes:
        key = head.split(b" ")[1].rsplit(b"/", 1)[1].decode()
        return answer({**FOUND, "key": key, "value": key})

    server = serve([], echo=echo)
    with Client(server.url) as client:

        def reads(thread: int) -> list[bool]:
            return [client.get("s", f"t{thread}k{i}").value == f"t{thread}k{i}" for i in range(150)]

        with ThreadPoolExecutor(max_workers=6) as pool:
            results = [ok for oks in pool.map(reads, range(6)) for ok in oks]
    assert len(results) == 900 and all(results)
    assert server.connections <= 6  # 900 reads: connections kept and shared out, one exchange at a time on each
