"""The node's quotas on the reads callers make to it directly (keyroute.state_node.dataplane with
keyroute.http.quotas), on a node behind keyroute's HTTP server, with an injected clock: this node's share is
the rate divided by the nodes serving the store; past it, 429 quota_exceeded with Retry-After and the node's
header; a member's read (proven by the cluster secret's token) is not counted, a client claiming to be one
is; batches cost their keys, pages their limit."""

from __future__ import annotations

import re

import httpx
import pytest

from keyroute.auth.security import member_token
from keyroute.http.quotas import QuotaConfig, Quotas
from keyroute.runtime.settings import AccessSettings
from tests.unit.node.fakes import HELD, KEY_LOCAL, ME, SERVING, Client, Nodes, unreachable

SECRET = "s3cret"
# Three nodes serve store "s" (tests/unit/node/fakes.py): this one admits a third of 30/s, 10 a second.
QUOTAS = "[identities.anonymous]\nrate = 30\n"
MEMBER = {"x-keyroute-auth": member_token(SECRET), "x-keyroute-router": "1"}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def node(client_for: Nodes, clock: Clock) -> Client:
    quotas = Quotas(QuotaConfig.parse(QUOTAS), clock=clock, process="node")
    client, _ = client_for(SERVING, HELD, unreachable, access=AccessSettings(cluster_secret=SECRET), quotas=quotas)
    return client


def statuses(node: Client, n: int, headers: dict[str, str] | None = None) -> list[int]:
    return [node.get(f"/stores/s/keys/{KEY_LOCAL}", headers=headers or {}).status_code for _ in range(n)]


def test_direct_reads_are_held_to_this_nodes_share(node: Client, clock: Clock) -> None:
    assert statuses(node, 15) == [200] * 10 + [429] * 5
    refused = node.get(f"/stores/s/keys/{KEY_LOCAL}")
    assert refused.status_code == 429
    body = refused.json()
    assert body["error"] == "quota_exceeded"
    assert body["message"] == "identity 'anonymous' is over its quota of 10 reads/s on store 's' on this node"
    assert refused.headers["retry-after"] == "1" and refused.headers["x-keyroute-node"] == ME
    clock.now += 0.5
    assert statuses(node, 10) == [200] * 5 + [429] * 5
    (bucket,) = node.get("/admin/quotas").json()["buckets"]
    assert (bucket["share"], bucket["nodes"], bucket["reads"], bucket["rejected"]) == (10, 3, 15, 11)
    metrics = node.get("/metrics").text
    for name, n in (("reads", 15), ("rejections", 11)):
        assert re.search(rf'^keyroute_node_quota_{name}_total{{identity="anonymous",store="s"}} {n}\.0$', metrics, re.M)


def test_a_members_read_is_not_counted_and_a_claim_without_proof_is(node: Client) -> None:
    assert statuses(node, 10) == [200] * 10
    # The bucket is empty: a router's reads (proven) still pass, and take nothing from it.
    assert statuses(node, 20, MEMBER) == [200] * 20
    assert statuses(node, 3, {**MEMBER, "x-keyroute-auth": "forged"}) == [429] * 3
    assert statuses(node, 3, {"x-keyroute-router": "1", "x-keyroute-hops": "1"}) == [429] * 3


def test_batches_cost_their_keys_and_pages_their_limit(node: Client, clock: Clock) -> None:
    batch = {"keys": [KEY_LOCAL] * 4}

    def post() -> httpx.Response:
        return node.post("/stores/s/batch-get", json=batch)

    # 10 tokens: 6, 2, then a batch of 4 waits for 4.
    assert [post().status_code for _ in range(3)] == [200, 200, 429]
    clock.now += 1.0  # full again: 10
    history = f"/stores/s/keys/{KEY_LOCAL}/history"
    # A page costs its limit (the store keeps no history: a read admitted is then refused for that, not 429).
    assert node.get(history + "?limit=8").status_code not in (200, 429)
    assert node.get(history + "?limit=3").status_code == 429
    assert node.get(history + "?limit=2").status_code not in (200, 429)
    assert statuses(node, 1) == [429]
