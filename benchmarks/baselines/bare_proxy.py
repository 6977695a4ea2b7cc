"""The least a Python proxy hop can cost: the floor under keyroute's router, for benchmarks/router.py.

`python benchmarks/baselines/bare_proxy.py ROUTES_JSON PORT` serves `GET /stores/{store}/keys/{key}` on
127.0.0.1:PORT by hashing the key as keyroute does (Kafka's murmur2) and relaying the owner's answer, on
uvloop, with httptools parsing both sides and nothing but callbacks: no ASGI, no tasks, no metrics, no
request ids, no admission checks, no failover, no timeouts. ROUTES_JSON is `{"partitions": N, "owners":
[url of partition 0's owner, ...]}`. It is a measuring stick, not a server: anything unexpected closes the
connection.
"""

from __future__ import annotations

import asyncio
import json
import sys
from urllib.parse import unquote_to_bytes

import httptools
import uvloop

from keyroute.keys.partitioner import murmur2, to_positive


class Upstream(asyncio.Protocol):
    """One kept-alive connection to a node; one exchange at a time."""

    def __init__(self, idle: list[Upstream]) -> None:
        self.idle = idle
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.client: Client | None = None
        self.head: list[bytes] = []
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, request: bytes, client: Client) -> None:
        self.client = client
        assert self.transport is not None
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_begin(self) -> None:
        self.head = []
        self.body = []

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() not in (b"content-length", b"date", b"server", b"connection"):
            self.head += (name, b": ", value, b"\r\n")

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        client, self.client = self.client, None
        self.idle.append(self)
        if client is not None:
            client.answer(self.parser.get_status_code(), self.head, b"".join(self.body))

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.idle:
            self.idle.remove(self)
        if self.client is not None:
            self.client.transport.close()


class Client(asyncio.Protocol):
    routes: list[tuple[str, int, list[Upstream]]] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_message_complete(self) -> None:
        parts = self.url.split(b"/", 4)
        if len(parts) != 5 or parts[1] != b"stores" or parts[3] != b"keys":
            self.transport.close()
            return
        host, port, idle = self.routes[to_positive(murmur2(unquote_to_bytes(parts[4]))) % len(self.routes)]
        request = b"GET " + self.url + b" HTTP/1.1\r\nhost: " + host.encode() + b"\r\n\r\n"
        self.transport.pause_reading()  # one exchange at a time: pipelined requests wait their turn
        if idle:
            idle.pop().send(request, self)
        else:
            asyncio.get_running_loop().create_task(self._connect(host, port, idle, request))

    async def _connect(self, host: str, port: int, idle: list[Upstream], request: bytes) -> None:
        try:
            _, upstream = await asyncio.get_running_loop().create_connection(lambda: Upstream(idle), host, port)
        except OSError:
            self.transport.close()
            return
        upstream.send(request, self)

    def answer(self, status: int, head: list[bytes], body: bytes) -> None:
        out = [b"HTTP/1.1 %d OK\r\n" % status, *head, b"content-length: %d\r\n\r\n" % len(body), body]
        self.transport.write(b"".join(out))
        self.transport.resume_reading()


async def serve(routes_file: str, port: int) -> None:
    spec = json.loads(open(routes_file, encoding="utf-8").read())
    pools: dict[str, list[Upstream]] = {}
    routes = []
    for url in spec["owners"]:
        host, _, node_port = url.removeprefix("http://").partition(":")
        routes.append((host, int(node_port), pools.setdefault(url, [])))
    assert len(routes) == spec["partitions"]
    Client.routes = routes
    server = await asyncio.get_running_loop().create_server(Client, "127.0.0.1", port)
    await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(serve(sys.argv[1], int(sys.argv[2])))
