"""Malformed and odd paths under /stores/, sent to a real router and to a real node (each its app and data
plane on keyroute's HTTP server, 127.0.0.1): both answer each with the same status, the same JSON body and,
for a 405, the same `Allow`, because both answer through one skeleton (keyroute.http.dataplane).

The router reads the node's partition map from a stand-in map source and asks the node over real sockets,
so a path the router takes for a key read is answered by the node: what it passes on must be what the
node says to the same path sent directly. Routes only one of the two has (the router's /range, the node's
/partitions/{p}/range) are not among the paths."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from keyroute.cluster.partition_map import Assignment, NodeRecord, PartitionMap, ServingRecord
from keyroute.router import service
from keyroute.router.app import create_app
from keyroute.runtime.settings import RouterSettings
from tests.unit.node.fakes import ME, Held, Nodes, P, records, unreachable
from tests.unit.router.fakes import StaticMapSource
from tests.util import serve_in_thread

# Every partition of store "s" held (empty) and served by the node: every key read is answered there.
SERVING = {ME: {"s": dict.fromkeys(range(P), 1)}}
HELD = {("s", p): Held(1, {}) for p in range(P)}
LONG_KEY = "k" * 1025  # one byte over the default max_key_bytes of both


@dataclass
class Pair:
    router: int  # ports
    node: int


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    nodes = Nodes()
    try:
        node, _ = nodes(SERVING, HELD, unreachable)
        url = node.url
        m = PartitionMap.build(
            records(),  # the stores the node knows: an unknown store's answer names them
            {ME: NodeRecord(ME, url)},
            Assignment(1, {}),
            {ME: ServingRecord(ME, url, {"s": dict.fromkeys(range(P), 1)})},
            generation=1,
        )
        settings = RouterSettings()
        app = create_app(settings, map_source=StaticMapSource(m))
        with serve_in_thread(service.server(settings, app)) as port:
            yield Pair(port, node.port)
    finally:
        nodes.close()


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def send(port: int, method: str, raw_path: str) -> Answer:
    """`raw_path` sent exactly as written: http.client, unlike httpx, leaves dot segments alone."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request(method, raw_path, body=b'{"keys": []}' if method == "POST" else None)
        response = connection.getresponse()
        return Answer(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
    finally:
        connection.close()


@pytest.mark.parametrize(
    ("method", "path", "status", "error"),
    [
        # No route: the same 404, whatever the method.
        ("GET", "/stores/", 404, "not_found"),
        ("GET", "/stores", 404, "not_found"),
        ("GET", "/stores/s", 404, "not_found"),
        ("GET", "/stores/s/keys", 404, "not_found"),
        ("GET", "/stores//keys/k", 404, "not_found"),
        ("DELETE", "/stores//keys/k", 404, "not_found"),
        ("GET", "/stores/s/nope", 404, "not_found"),
        ("GET", "/stores/s/range/x", 404, "not_found"),
        ("POST", "/stores/s/batch-get/more", 404, "not_found"),
        ("GET", "/stores/s/../keys/k", 404, "not_found"),
        ("GET", "/stores/s/./keys/k", 404, "not_found"),
        # Under /stores/{store}/keys/ but no key's path: a GET is told why, another method is a 405.
        ("GET", "/stores/s/keys/k/extra", 404, "not_found"),
        ("GET", "/stores/s/keys/a/b/history", 404, "not_found"),
        ("GET", "/stores/s/keys/k/..", 404, "not_found"),
        ("GET", "/stores/s/keys//", 404, "not_found"),
        ("PUT", "/stores/s/keys/a/b", 405, "method_not_allowed"),
        # A route's path with a method it does not take: 405 with Allow.
        ("DELETE", "/stores/s/keys/k", 405, "method_not_allowed"),
        ("POST", "/stores/s/keys/k", 405, "method_not_allowed"),
        ("POST", "/stores/s/keys/k/history", 405, "method_not_allowed"),
        ("GET", "/stores/s/batch-get", 405, "method_not_allowed"),
        ("HEAD", "/stores/s/batch-get", 405, "method_not_allowed"),
        ("PUT", "/stores/s/batch-get", 405, "method_not_allowed"),
        # Path parameters that do not decode: one rule (strict UTF-8 after percent-decoding each segment).
        ("GET", "/stores/s/keys/%C3%28", 400, "bad_key"),
        ("GET", "/stores/s/keys/%FF", 400, "bad_key"),
        ("GET", "/stores/s/keys/%ED%A0%80", 400, "bad_key"),  # an encoded surrogate is not UTF-8
        ("GET", "/stores/s/keys/%C3%28/history", 400, "bad_key"),
        ("GET", "/stores/%FF/keys/k", 400, "bad_request"),
        # A % that starts no escape: a client's encoding slip, refused rather than read as another key.
        ("GET", "/stores/s/keys/%ZZ", 400, "bad_key"),
        ("GET", "/stores/s/keys/%", 400, "bad_key"),
        ("GET", "/stores/s/keys/%ZZ/history", 400, "bad_key"),
        ("GET", "/stores/s%G1/keys/k", 400, "bad_request"),
        ("POST", "/stores/%FF/batch-get", 400, "bad_request"),
        ("GET", f"/stores/s/keys/{LONG_KEY}", 414, "key_too_long"),
        ("GET", "/stores/s/keys/" + "%E6%9D%B1" * 342, 414, "key_too_long"),
        # Odd but well-formed: keys and stores like any other, answered (by the node) for what they are.
        ("GET", "/stores/s/keys/", 404, "key_not_found"),  # the empty key
        ("GET", "/stores/s/keys/..", 404, "key_not_found"),
        ("GET", "/stores/s/keys/%2E%2E", 404, "key_not_found"),
        ("GET", "/stores/s/keys/a%2Fb", 404, "key_not_found"),  # an encoded slash is part of the key
        ("GET", "/stores/s/keys/a%2Fb/history", 400, "wrong_store_kind"),
        ("GET", "/stores/s%2Fx/keys/k", 404, "store_not_found"),
        ("GET", "/stores/../keys/k", 404, "store_not_found"),
        ("GET", "/stores/%2E%2E/keys/k", 404, "store_not_found"),
        ("POST", "/stores/nope/batch-get", 404, "store_not_found"),
    ],
)
def test_a_router_and_a_node_answer_an_odd_path_alike(
    pair: Pair, method: str, path: str, status: int, error: str
) -> None:
    from_router, from_node = send(pair.router, method, path), send(pair.node, method, path)
    for response in (from_router, from_node):
        assert response.status == status, response
        assert response.headers["content-type"] == "application/json"
        if method != "HEAD":
            assert response.json()["error"] == error and response.json()["message"], response
    assert from_router.body == from_node.body  # the same JSON, message included
    assert from_router.headers.get("allow") == from_node.headers.get("allow")
    if status == 405:
        assert from_router.headers["allow"] in ("GET, HEAD", "POST")


def test_a_key_path_with_an_unencoded_slash_says_how_to_send_it(pair: Pair) -> None:
    for client in (pair.router, pair.node):
        r = send(client, "GET", "/stores/s/keys/a/b")
        assert r.status == 404 and r.json() == {
            "error": "not_found",
            "message": "not a key path: a key containing '/' must be percent-encoded as %2F",
        }
        assert send(client, "DELETE", "/stores/s/keys/a/b").headers["allow"] == "GET, HEAD"
        assert send(client, "GET", "/stores/s/batch-get").headers["allow"] == "POST"
