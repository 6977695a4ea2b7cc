"""The router and `min_offset` (keyroute.router.proxy, keyroute.http.forwarding): bounds parsed and checked,
passed to the nodes (a query string, a batch's per-partition "min_offsets"), the offsets nodes answer with
remembered per (node, store, partition), replicas known to have applied a bound asked first, and a replica
that has not applied it (503 not_up_to_bound) followed by the next one, each once, without a map refresh."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from keyroute.api import BadRequest, key_path_segment
from keyroute.http.forwarding import OffsetBounds, batch_body, parse_batch_request
from keyroute.router.proxy import MAX_REMEMBERED_OFFSETS, HedgeSettings, Proxy
from keyroute.router.routing_table import RoutingTable
from tests.unit.router.fakes import FakeCluster, get, node_url
from tests.unit.router.test_proxy import PARTITIONS, MapOrderOnTies, keys_in, partition, replicated_map, run


class LiveNode:
    """A node of a live store "s": every key's value is {"v": key}; the partition's applied offset is
    `offsets[p]` (default `offset`); a bound not applied is 503 not_up_to_bound at once."""

    def __init__(self, node_id: str, offset: int) -> None:
        self.node_id = node_id
        self.offset = offset
        self.offsets: dict[int, int] = {}
        self.down = False
        self.fault = None
        self.paths: list[bytes] = []
        self.bodies: list[dict[str, Any]] = []
        self.app = Starlette(
            routes=[
                Route("/stores/{store}/keys/{key:path}", self._get, methods=["GET"]),
                Route("/stores/{store}/batch-get", self._batch, methods=["POST"]),
            ]
        )

    def applied(self, key: str) -> int:
        return self.offsets.get(partition(key), self.offset)

    async def _get(self, request: Request) -> Response:
        raw = request.scope["raw_path"]
        query = request.scope["query_string"]
        self.paths.append(raw + (b"?" + query if query else b""))
        located = key_path_segment(raw)
        assert located is not None
        _, key = located
        offset = self.applied(key)
        headers = {"x-keyroute-node": self.node_id, "x-keyroute-offset": str(offset), "x-keyroute-lag": "0"}
        bound = request.query_params.get("min_offset")
        if bound is not None and offset < int(bound):
            body = {"error": "not_up_to_bound", "message": f"{self.node_id} is at {offset}"}
            return Response(json.dumps(body), 503, {**headers, "retry-after": "1"}, media_type="application/json")
        return Response(json.dumps({"value": {"v": key}}), 200, headers, media_type="application/json")

    async def _batch(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.bodies.append(body)
        bounds = body.get("min_offsets", {})
        results = []
        for key in body["keys"]:
            offset = self.applied(key)
            bound = bounds.get(str(partition(key)))
            if bound is not None and offset < bound:
                results.append({"key": key, "status": 503, "error": "not_up_to_bound", "message": "", "offset": offset})
            else:
                results.append(
                    {"key": key, "status": 200, "partition": partition(key), "version": 1, "offset": offset,
                     "value": {"v": key, "node": self.node_id}}
                )  # fmt: skip
        return Response(json.dumps({"results": results}), media_type="application/json")


class Router:
    def __init__(self, *nodes: LiveNode) -> None:
        self.refreshes = 0
        self.proxy = Proxy(
            FakeCluster(*nodes).upstream(),
            on_stale_map=self._refresh,
            hedge=HedgeSettings(after_s=0),
            rng=MapOrderOnTies(),
        )
        self.proxy.install(RoutingTable.of(replicated_map(("a", "b"))))

    def _refresh(self) -> None:
        self.refreshes += 1

    async def read(self, key: str, min_offset: int | None = None) -> tuple[int, dict[bytes, bytes], Any]:
        if min_offset is None:
            reply = await get(self.proxy, "s", key)
        else:
            reply = await bounded(self.proxy, key, min_offset)
        return reply.status, dict(reply.headers), json.loads(reply.body)


async def bounded(proxy: Proxy, key: str, min_offset: int) -> Any:
    result: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    proxy.read("s", key, "rid", lambda outcome: result.done() or result.set_result(outcome), min_offset)
    outcome = await result
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


KEY = keys_in(0)[0]


# -- parsing --------------------------------------------------------------------------------------------


def test_batch_bounds_are_parsed_and_the_larger_applies() -> None:
    parsed = parse_batch_request(b'{"keys": ["a"], "min_offset": 5, "min_offsets": {"0": 9, "2": 1}}', 10)
    assert parsed.keys == ["a"]
    bounds = parsed.bounds
    assert bounds is not None
    assert [bounds.bound(p) for p in range(4)] == [9, 5, 5, 5]
    assert bounds.wire([0, 2, 3]) == {"0": 9, "2": 5, "3": 5}
    assert parse_batch_request(b'{"keys": []}', 10).bounds is None
    assert parse_batch_request(b'{"keys": [], "min_offset": null, "min_offsets": {}}', 10).bounds is None
    only = OffsetBounds(None, {1: 4})
    assert [only.bound(p) for p in range(3)] == [None, 4, None] and only.wire(range(3)) == {"1": 4}


@pytest.mark.parametrize(
    "body",
    [b'{"keys": [], "min_offset": -1}', b'{"keys": [], "min_offset": 1e-3}', b'{"keys": [], "min_offset": false}',
     b'{"keys": [], "min_offsets": {"-1": 3}}', b'{"keys": [], "min_offsets": {"1": "3"}}',
     b'{"keys": [], "min_offset": 9223372036854775808}'],
)  # fmt: skip
def test_malformed_batch_bounds_are_bad_requests(body: bytes) -> None:
    with pytest.raises(BadRequest):
        parse_batch_request(body, 10)


def test_a_bound_on_a_partition_the_store_lacks_is_a_bad_request() -> None:
    OffsetBounds(None, {3: 1}).check("s", 4)
    with pytest.raises(BadRequest, match="names partition 4; store 's' has 4 partitions"):
        OffsetBounds(None, {4: 1}).check("s", 4)


def test_the_batch_body_sent_to_a_node_carries_bounds_only_when_there_are_some() -> None:
    assert json.loads(batch_body(["a"])) == {"keys": ["a"]}
    assert json.loads(batch_body(["a"], {})) == {"keys": ["a"]}
    assert json.loads(batch_body(["a"], {"1": 3})) == {"keys": ["a"], "min_offsets": {"1": 3}}


# -- one key --------------------------------------------------------------------------------------------


def test_the_bound_goes_to_the_node_and_an_unbounded_read_sends_no_query() -> None:
    a, b = LiveNode("a", 10), LiveNode("b", 10)
    router = Router(a, b)

    async def scenario() -> None:
        status, headers, _ = await router.read(KEY, 7)
        assert status == 200 and headers[b"x-keyroute-offset"] == b"10" and headers[b"x-keyroute-lag"] == b"0"
        assert (await router.read(KEY))[0] == 200

    run(scenario)
    assert a.paths == [f"/stores/s/keys/{KEY}?min_offset=7".encode(), f"/stores/s/keys/{KEY}".encode()]


def test_a_replica_behind_the_bound_hands_over_to_the_next_without_a_map_refresh() -> None:
    a, b = LiveNode("a", 5), LiveNode("b", 10)
    router = Router(a, b)
    status, headers, body = run(lambda: router.read(KEY, 8))
    assert status == 200 and headers[b"x-keyroute-node"] == b"b" and headers[b"x-keyroute-offset"] == b"10"
    assert len(a.paths) == 1 and len(b.paths) == 1
    assert router.refreshes == 0


def test_no_replica_up_to_the_bound_is_503_not_up_to_bound_with_retry_after_each_asked_once() -> None:
    a, b = LiveNode("a", 5), LiveNode("b", 6)
    router = Router(a, b)
    status, headers, body = run(lambda: router.read(KEY, 8))
    assert status == 503 and body["error"] == "not_up_to_bound"
    assert headers[b"retry-after"] == b"1" and headers[b"x-keyroute-offset"] == b"6"
    assert len(a.paths) == 1 and len(b.paths) == 1
    assert router.refreshes == 0


def test_replicas_known_to_have_applied_the_bound_are_asked_first() -> None:
    a, b = LiveNode("a", 5), LiveNode("b", 10)
    router = Router(a, b)

    async def scenario() -> None:
        assert (await router.read(KEY, 8))[0] == 200  # a (preferred) refuses, b answers: both remembered
        assert router.proxy.remembered_offset(node_url("a"), "s", 0) == 5
        assert router.proxy.remembered_offset(node_url("b"), "s", 0) == 10
        for _ in range(3):
            status, headers, _ = await router.read(KEY, 9)
            assert status == 200 and headers[b"x-keyroute-node"] == b"b"
        # A bound both are known to have applied keeps the balancer's order.
        assert (await router.read(KEY, 2))[1][b"x-keyroute-node"] == b"a"
        # What is remembered is the highest offset seen.
        a.offset = 3
        assert (await router.read(KEY, 2))[1][b"x-keyroute-offset"] == b"3"
        assert router.proxy.remembered_offset(node_url("a"), "s", 0) == 5

    run(scenario)
    assert len(a.paths) == 3  # the first bounded read, the read with bound 2 and the last one


def test_remembered_offsets_are_bounded() -> None:
    router = Router(LiveNode("a", 0), LiveNode("b", 0))
    proxy = router.proxy
    for i in range(MAX_REMEMBERED_OFFSETS + 10):
        proxy.remember_offset(f"http://n{i}", "s", 0, i)
    # The 10 oldest forgotten, every later one kept: exactly MAX_REMEMBERED_OFFSETS remembered.
    assert [proxy.remembered_offset(f"http://n{i}", "s", 0) for i in range(10)] == [None] * 10
    kept = range(10, MAX_REMEMBERED_OFFSETS + 10)
    assert all(proxy.remembered_offset(f"http://n{i}", "s", 0) == i for i in kept)
    proxy.remember_offset("http://x", "s", 0, b"12")
    proxy.remember_offset("http://x", "s", 0, b"not a number")
    proxy.remember_offset("http://x", "s", 0, b"3")
    proxy.remember_offset("http://x", "s", 0, None)
    assert proxy.remembered_offset("http://x", "s", 0) == 12
    assert proxy.remembered_offset(f"http://n{10}", "s", 0) is None  # "x" made room by forgetting the oldest


# -- batches --------------------------------------------------------------------------------------------


def test_a_batch_sends_each_node_the_bounds_of_its_keys_partitions_and_fails_over_keys_behind() -> None:
    a, b = LiveNode("a", 10), LiveNode("b", 10)
    k0, k1, k2 = keys_in(0)[0], keys_in(1)[0], keys_in(2)[0]
    a.offsets = {1: 4}  # a is behind on partition 1 only
    router = Router(a, b)
    bounds = OffsetBounds(3, {1: 6, 3: 99})

    results = run(lambda: router.proxy.batch_get("s", [k0, k1, k2], "rid", bounds))
    assert [(r["status"], r["value"]["node"]) for r in results] == [(200, "a"), (200, "b"), (200, "a")]
    assert a.bodies[0] == {"keys": [k0, k1, k2], "min_offsets": {"0": 3, "1": 6, "2": 3}}
    assert b.bodies == [{"keys": [k1], "min_offsets": {"1": 6}}]
    # The entries' offsets are remembered: a later bound on partition 1 goes to b first.
    assert router.proxy.remembered_offset(node_url("a"), "s", 1) == 4
    assert router.proxy.remembered_offset(node_url("b"), "s", 1) == 10
    run(lambda: router.proxy.batch_get("s", [k1], "rid", OffsetBounds(None, {1: 6})))
    assert len(a.bodies) == 1 and b.bodies[-1] == {"keys": [k1], "min_offsets": {"1": 6}}


def test_a_batch_entry_no_replica_can_bound_is_503_not_up_to_bound() -> None:
    a, b = LiveNode("a", 1), LiveNode("b", 2)
    router = Router(a, b)
    results = run(lambda: router.proxy.batch_get("s", [KEY], "rid", OffsetBounds(5, {})))
    assert results[0]["status"] == 503 and results[0]["error"] == "not_up_to_bound"
    assert len(a.bodies) == 1 and len(b.bodies) == 1


def test_a_batch_bound_on_a_partition_the_store_lacks_is_refused_before_any_node_is_asked() -> None:
    a, b = LiveNode("a", 1), LiveNode("b", 2)
    router = Router(a, b)
    with pytest.raises(BadRequest):
        run(lambda: router.proxy.batch_get("s", [KEY], "rid", OffsetBounds(None, {PARTITIONS: 1})))
    assert a.bodies == [] and b.bodies == []


def test_a_batch_without_bounds_sends_none() -> None:
    a, b = LiveNode("a", 1), LiveNode("b", 2)
    router = Router(a, b)
    run(lambda: router.proxy.batch_get("s", [KEY], "rid"))
    assert a.bodies == [{"keys": [KEY]}]
