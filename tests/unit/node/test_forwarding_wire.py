"""A node forwards over the members' own wire (keyroute.http.fast_upstream): the request target passed on as
the client sent it, the membership proof and hop count the next node gets, and a peer that breaks its reply
off counted as a forwarding failure."""

from __future__ import annotations

import socket

import httpx

from keyroute.runtime.settings import AccessSettings
from keyroute.state_node.reads import forward_headers
from tests.unit.node.fakes import HELD, REMOTE_P, SERVING, Nodes, key_in


def raw_get(port: int, target: bytes) -> bytes:
    """The status line of the answer to a GET of `target` sent byte for byte (no client encodes it)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET " + target + b" HTTP/1.1\r\nhost: node\r\nconnection: close\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer.split(b"\r\n", 1)[0]


def test_a_percent_encoded_target_reaches_the_next_node_byte_for_byte(client_for: Nodes) -> None:
    key = key_in("s", REMOTE_P, prefix="東京/")
    # Lower-case hex, as some clients send it: passed on as it came, never decoded and encoded again.
    target = "/stores/s/keys/" + "".join(
        c if c.isalnum() and c.isascii() else "".join(f"%{b:02x}" for b in c.encode()) for c in key
    )

    def peer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"from": "n2"})

    client, seen = client_for(SERVING, HELD, peer)
    assert raw_get(client.port, target.encode("ascii")).startswith(b"HTTP/1.1 200")
    [sent] = seen
    assert sent.url.raw_path == target.encode("ascii")


def test_a_target_with_raw_non_ascii_bytes_is_refused_and_never_forwarded(client_for: Nodes) -> None:
    key = key_in("s", REMOTE_P, prefix="東京")

    def peer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"from": "n2"})

    client, seen = client_for(SERVING, HELD, peer)
    assert raw_get(client.port, b"/stores/s/keys/" + key.encode("utf-8")).startswith(b"HTTP/1.1 400")
    assert seen == []


def test_the_next_node_gets_the_hop_count_and_the_membership_proof(client_for: Nodes) -> None:
    access = AccessSettings(cluster_secret="s3cret")
    key = key_in("s", REMOTE_P)

    def peer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"from": "n2"})

    client, seen = client_for(SERVING, HELD, peer, access=access)
    r = client.get(f"/stores/s/keys/{key}", headers={"x-request-id": "req-9"})
    assert r.status_code == 200 and r.json() == {"from": "n2"}
    [sent] = seen
    for name, value in forward_headers("req-9", client.node.members).items():
        assert sent.headers[name] == value, name
    assert sent.headers["x-keyroute-hops"] == "1"
    assert "s3cret" not in str(sent.headers)  # a proof derived from the secret, never the secret itself


def test_a_peer_breaking_its_reply_off_is_a_forwarding_failure_and_the_next_replica_answers(
    client_for: Nodes,
) -> None:
    key = key_in("s", REMOTE_P)

    def peer(request: httpx.Request) -> httpx.Response:
        if request.url.host == "n2.test":
            raise RuntimeError("breaks off mid-reply")
        return httpx.Response(200, json={"from": "n3"})

    client, seen = client_for(SERVING, HELD, peer)
    r = client.get(f"/stores/s/keys/{key}")
    assert r.status_code == 200 and r.json() == {"from": "n3"}
    assert [s.url.host for s in seen] == ["n2.test", "n3.test"]
    assert client.node.metrics.forward_failures == 1 and client.node.metrics.forwards == 2
