"""Proxy: the data path against fake nodes (failover, back-off, misroutes, batches), and its one single-key
read engine against real nodes (hedging, stale connections, reads sent without a coroutine), always over the
router's own wire (FastUpstream) to servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar
from urllib.parse import quote

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from keyroute.api import (
    HEADER_ROUTER,
    PartitionUnavailable,
    PayloadTooLarge,
    StoreNotFound,
    found_body,
    key_path_segment,
)
from keyroute.cluster.partition_map import Assignment, NodeRecord, PartitionMap, ServingRecord
from keyroute.http.exchange import ServerLimits
from keyroute.http.fast_upstream import FastUpstream
from keyroute.http.forwarding import HOP_BY_HOP, passthrough_headers
from keyroute.http.server import HttpServer
from keyroute.http.upstream import Upstream, UpstreamResponse, UpstreamUnavailable
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.router.backoff import NodeBackoff
from keyroute.router.balancer import DEFAULT_RECOMPUTE_EVERY
from keyroute.router.proxy import HedgeSettings, Proxy, ProxySettings
from keyroute.router.routing_table import RoutingTable
from keyroute.runtime.settings import RequestLimits, RouterSettings
from tests.unit.http.test_fast_upstream import CLOSE, RawServer, ok
from tests.unit.router.fakes import FakeCluster, FakeNode, build_map, get, node_url, read_result, store_record
from tests.util import serve_in_thread, wait_until

T = TypeVar("T")
PARTITIONS = 4
WEIRD_KEYS = [
    "a/b",
    "100%",
    "what?",
    "#tag",
    "a+b",
    "with space",
    "東京",
    "😀",
    "%2F",
    "",
    ".",
    "..",
    "a%20b",
]


def partition(key: str) -> int:
    return partition_for(Partitioner.MURMUR2, key.encode("utf-8"), PARTITIONS)


def keys_in(p: int, count: int = 1) -> list[str]:
    found = [k for k in (f"key-{i}" for i in range(1000)) if partition(k) == p]
    return found[:count]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class MapOrderOnTies(random.Random):
    """Draws that make the balancer keep the map's order between equally loaded replicas, so tests of
    failover and back-off know which replica is asked first (spreading is tested in test_balancer.py)."""

    def random(self) -> float:
        return 0.0


class Harness:
    """A Proxy wired to fake nodes `a` and `b` over the router's own wire, with a controllable clock (the
    back-off's too, unless `backoff_clock` is given) and a refresh counter."""

    def __init__(
        self,
        partition_map: PartitionMap,
        *nodes: FakeNode,
        max_batch_keys: int = 1000,
        hedge_after_s: float | None = 0.0,
        rng: random.Random | None = None,
        backoff_clock: Callable[[], float] | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.cluster = FakeCluster(*nodes)
        self.clock = clock or Clock()
        self.refreshes = 0
        self.backoff = NodeBackoff(backoff_s=2.0, clock=backoff_clock or self.clock)
        self.proxy = Proxy(
            self.cluster.upstream(),
            on_stale_map=self._refresh,
            settings=ProxySettings(max_batch_keys=max_batch_keys, retry_after_s=3),
            hedge=HedgeSettings(after_s=hedge_after_s),
            backoff=self.backoff,
            clock=self.clock,
            rng=rng or MapOrderOnTies(),
        )
        self.proxy.install(RoutingTable.of(partition_map))

    def _refresh(self) -> None:
        self.refreshes += 1


def run(make: Callable[[], Awaitable[T]]) -> T:
    async def main() -> T:
        return await make()

    return asyncio.run(main())


def values_for(keys: list[str], store: str = "s") -> dict[tuple[str, str], Any]:
    return {(store, k): {"v": k} for k in keys}


def replicated_map(order: tuple[str, ...] = ("a", "b")) -> PartitionMap:
    """Both nodes serve every partition; `order` is the preferred-first assignment for all partitions."""
    assignment = Assignment(generation=1, stores={"s": tuple(order for _ in range(PARTITIONS))})
    everything = {"s": range(PARTITIONS)}
    return build_map([store_record("s", PARTITIONS)], {"a": everything, "b": everything}, assignment)


def split_map() -> PartitionMap:
    return build_map([store_record("s", PARTITIONS)], {"a": {"s": [0, 1]}, "b": {"s": [2, 3]}})


def test_each_key_goes_to_the_node_serving_its_partition_with_the_router_marker_and_no_hop_header() -> None:
    keys = [k for p in range(PARTITIONS) for k in keys_in(p, 2)]
    a, b = FakeNode("a", values_for(keys)), FakeNode("b", values_for(keys))
    h = Harness(split_map(), a, b)

    async def scenario() -> None:
        for key in keys:
            answer = await get(h.proxy, "s", key, "req-1")
            assert answer.status == 200
            assert json.loads(answer.body)["value"] == {"v": key}
            assert dict(answer.headers)[b"x-keyroute-node"] == (b"a" if partition(key) < 2 else b"b")

    run(scenario)
    assert [r.key for r in a.received] == [k for k in keys if partition(k) < 2]
    assert [r.key for r in b.received] == [k for k in keys if partition(k) >= 2]
    for received in a.received + b.received:
        assert received.headers[HEADER_ROUTER] == "1"
        assert "x-keyroute-hops" not in received.headers
        assert received.headers["x-request-id"] == "req-1"
    assert h.refreshes == 0 and h.proxy.metrics.misroutes == 0


def test_keys_with_reserved_and_non_ascii_characters_reach_the_node_intact() -> None:
    a = FakeNode("a", values_for(WEIRD_KEYS))
    h = Harness(build_map([store_record("s", PARTITIONS)], {"a": {"s": range(PARTITIONS)}}), a)

    async def scenario() -> None:
        for key in WEIRD_KEYS:
            answer = await get(h.proxy, "s", key)
            assert answer.status == 200, key
            assert json.loads(answer.body)["key"] == key

    run(scenario)
    assert [r.key for r in a.received] == WEIRD_KEYS
    expected = [quote(k, safe="") if k not in (".", "..") else k.replace(".", "%2E") for k in WEIRD_KEYS]
    assert [r.raw_path for r in a.received] == [f"/stores/s/keys/{k}".encode() for k in expected]


def test_status_body_and_keyroute_headers_pass_through_while_hop_by_hop_headers_do_not() -> None:
    a = FakeNode("a", values_for(["k"]))
    a.extra_headers = [
        ("Connection", "keep-alive, X-Private"),
        ("X-Private", "secret"),
        ("Keep-Alive", "timeout=5"),
        ("Cache-Control", "no-store"),
    ]
    h = Harness(build_map([store_record("s", PARTITIONS)], {"a": {"s": range(PARTITIONS)}}), a)
    direct: list[httpx.Response] = []

    async def scenario() -> tuple[Any, Any]:
        found = await get(h.proxy, "s", "k")
        missing = await get(h.proxy, "s", "nope")
        async with httpx.AsyncClient(transport=h.cluster) as client:
            direct.append(await client.get("http://a:8000/stores/s/keys/nope"))
        return found, missing

    found, missing = run(scenario)
    headers = dict(found.headers)
    assert headers[b"content-type"] == b"application/json"
    assert headers[b"x-keyroute-node"] == b"a" and headers[b"x-keyroute-hops"] == b"0"
    assert headers[b"x-keyroute-partition"] == b"0" and headers[b"x-keyroute-version"] == b"1"
    assert headers[b"cache-control"] == b"no-store"
    for hop_by_hop in (b"connection", b"keep-alive", b"x-private", b"content-length", b"transfer-encoding"):
        assert hop_by_hop not in headers
    # A node's error passes through byte for byte: the router does not re-render it.
    assert missing.status == 404 and missing.body == direct[0].content
    assert json.loads(missing.body)["error"] == "key_not_found"


def test_every_hop_by_hop_header_stops_at_the_router_and_names_of_the_same_length_pass() -> None:
    # The router looks a name up among the hop-by-hop ones only when one of them is as long: every one of them
    # (but the framing a node's server writes itself) is still dropped, and a name of each of their lengths
    # that is not one of them passes.
    framing = {b"content-length", b"transfer-encoding", b"connection", b"date"}
    dropped = sorted(HOP_BY_HOP - framing)
    passed = [b"x" * len(name) for name in dropped]
    a = FakeNode("a", values_for(["k"]))
    a.extra_headers = [(name.decode().title(), "v") for name in dropped + passed]
    h = Harness(build_map([store_record("s", PARTITIONS)], {"a": {"s": range(PARTITIONS)}}), a)
    found = run(lambda: get(h.proxy, "s", "k"))
    names = [name for name, _ in found.headers]
    assert found.status == 200 and not set(dropped) & set(names)
    assert [name for name in names if name in set(passed)] == passed


@pytest.mark.parametrize(
    "fault",
    [
        lambda: httpx.ConnectError("refused"),
        lambda: httpx.ReadError("reset by peer"),
        lambda: httpx.RemoteProtocolError("Server disconnected without sending a response"),
        lambda: httpx.ReadTimeout("timed out"),
        lambda: httpx.ConnectTimeout("timed out"),
    ],
    ids=["refused", "reset", "died-mid-request", "read-timeout", "connect-timeout"],
)
def test_a_failing_node_is_retried_at_once_on_the_next_replica(fault: Callable[[], Exception]) -> None:
    a, b = FakeNode("a", values_for(["k"])), FakeNode("b", values_for(["k"]))
    a.fault = fault
    h = Harness(replicated_map(("a", "b")), a, b)
    answer = run(lambda: get(h.proxy, "s", "k"))
    assert answer.status == 200 and dict(answer.headers)[b"x-keyroute-node"] == b"b"
    assert len(b.received) == 1
    assert h.proxy.metrics.failovers == 1 and h.proxy.metrics.upstream_failures == 1


def test_a_failed_node_is_ordered_last_during_its_backoff_then_first_again() -> None:
    a, b = FakeNode("a", values_for(["k"])), FakeNode("b", values_for(["k"]))
    h = Harness(replicated_map(("a", "b")), a, b)

    async def scenario() -> None:
        a.down = True
        assert dict((await get(h.proxy, "s", "k")).headers)[b"x-keyroute-node"] == b"b"
        a.down = False
        # Within the back-off the healthy replica is asked first: `a` sees nothing.
        h.clock.now += 1.0
        assert dict((await get(h.proxy, "s", "k")).headers)[b"x-keyroute-node"] == b"b"
        assert a.received == []
        h.clock.now += 1.5
        assert dict((await get(h.proxy, "s", "k")).headers)[b"x-keyroute-node"] == b"a"

    run(scenario)
    assert h.proxy.metrics.upstream_failures == 1 and h.proxy.metrics.failovers == 1


def test_every_replica_failing_is_503_partition_unavailable_with_retry_after() -> None:
    a, b = FakeNode("a"), FakeNode("b")
    a.down = b.down = True
    h = Harness(replicated_map(), a, b)
    with pytest.raises(PartitionUnavailable) as caught:
        run(lambda: get(h.proxy, "s", "k"))
    assert caught.value.status == 503 and caught.value.headers == {"Retry-After": "3"}
    assert "a, b" in caught.value.message
    assert h.proxy.metrics.unavailable == 1


def test_no_serving_node_is_503_without_contacting_any_node() -> None:
    a = FakeNode("a", values_for(keys_in(0) + keys_in(3)))
    h = Harness(build_map([store_record("s", PARTITIONS)], {"a": {"s": [0, 1, 2]}}), a)
    with pytest.raises(PartitionUnavailable) as caught:
        run(lambda: get(h.proxy, "s", keys_in(3)[0]))
    assert caught.value.headers["Retry-After"] == "3"
    assert a.received == []


def test_an_unknown_store_is_404_without_contacting_any_node() -> None:
    a = FakeNode("a")
    h = Harness(split_map(), a)
    with pytest.raises(StoreNotFound):
        run(lambda: get(h.proxy, "nope", "k"))
    assert a.received == []


def test_a_forwarded_answer_counts_a_misroute_and_refreshes_the_map_once_per_burst() -> None:
    a = FakeNode("a", values_for(["k"]))
    a.hops = "1"
    h = Harness(build_map([store_record("s", PARTITIONS)], {"a": {"s": range(PARTITIONS)}}), a)

    async def scenario() -> None:
        for _ in range(3):
            answer = await get(h.proxy, "s", "k")
            assert answer.status == 200 and dict(answer.headers)[b"x-keyroute-hops"] == b"1"
        h.clock.now += 1.0
        await get(h.proxy, "s", "k")

    run(scenario)
    assert h.proxy.metrics.misroutes == 4
    assert h.refreshes == 2


def test_a_node_reporting_a_newer_map_generation_makes_the_router_re_read_at_once() -> None:
    a = FakeNode("a", values_for(["k"]))
    a.hops = "1"
    a.extra_headers = [("x-keyroute-generation", "100")]  # ours is 7 (tests/unit/router/fakes.py)
    h = Harness(build_map([store_record("s", PARTITIONS)], {"a": {"s": range(PARTITIONS)}}), a)

    async def scenario() -> None:
        await get(h.proxy, "s", "k")  # within the throttle interval of nothing: one re-read
        assert h.refreshes == 1
        h.clock.now += 0.1
        a.extra_headers = [("x-keyroute-generation", "101")]  # newer again: re-read at once
        await get(h.proxy, "s", "k")
        assert h.refreshes == 2
        h.clock.now += 0.1
        await get(h.proxy, "s", "k")  # the same generation again: the re-read is already under way
        assert h.refreshes == 2
        h.clock.now += 0.1
        a.extra_headers = [("x-keyroute-generation", "3")]  # the node is behind us: throttled only
        await get(h.proxy, "s", "k")
        assert h.refreshes == 2

    run(scenario)
    assert h.proxy.metrics.misroutes == 4 and h.proxy.metrics.map_refreshes == 2
    assert "keyroute_router_map_refreshes_total 2" in h.proxy.metrics.render()


def test_a_batch_sends_all_keys_of_a_partition_to_one_node_even_when_a_backoff_expires_meanwhile() -> None:
    a, b = FakeNode("a", values_for(keys_in(0, 6))), FakeNode("b", values_for(keys_in(0, 6)))

    class Ticking:
        """A clock that, once started, moves past the back-off while the batch is being grouped."""

        def __init__(self, clock: Clock) -> None:
            self.clock = clock
            self.calls: int | None = None

        def __call__(self) -> float:
            if self.calls is None:
                return self.clock.now
            self.calls += 1
            return self.clock.now + (0.0 if self.calls < 3 else 10.0)

    clock = Clock()
    ticking = Ticking(clock)
    h = Harness(replicated_map(("a", "b")), a, b, clock=clock, backoff_clock=ticking)
    h.backoff.failed(h.proxy.table.map.serving_endpoints("s", 0)[0], "test")
    ticking.calls = 0
    results = run(lambda: h.proxy.batch_get("s", keys_in(0, 6)))
    assert [r["status"] for r in results] == [200] * 6
    # Every key of partition 0 went in one request to one node.
    assert len(a.received) + len(b.received) == 1


def test_a_node_that_no_longer_serves_the_partition_hands_over_to_the_next_replica() -> None:
    a, b = FakeNode("a", values_for(["k"])), FakeNode("b", values_for(["k"]))
    a.unavailable = True
    h = Harness(replicated_map(("a", "b")), a, b)
    answer = run(lambda: get(h.proxy, "s", "k"))
    assert answer.status == 200 and dict(answer.headers)[b"x-keyroute-node"] == b"b"
    assert h.refreshes == 1


def test_the_last_replicas_503_is_passed_through_with_its_retry_after() -> None:
    a = FakeNode("a", values_for(["k"]))
    a.unavailable = True
    h = Harness(build_map([store_record("s", PARTITIONS)], {"a": {"s": range(PARTITIONS)}}), a)
    answer = run(lambda: get(h.proxy, "s", "k"))
    assert answer.status == 503 and dict(answer.headers)[b"retry-after"] == b"7"
    assert json.loads(answer.body)["error"] == "partition_unavailable"


def test_batch_fans_out_one_request_per_node_in_parallel_and_answers_in_request_order() -> None:
    partition_map = build_map([store_record("s", PARTITIONS)], {"a": {"s": [0, 1]}, "b": {"s": [2]}})
    in_a = keys_in(0, 2) + keys_in(1, 1)
    in_b = keys_in(2, 2)
    unserved = keys_in(3, 1)
    assert partition("17") == 0  # a JSON number is read as its decimal text
    a, b = FakeNode("a", values_for([*in_a, "17"])), FakeNode("b", values_for(in_b[:1]))
    h = Harness(partition_map, a, b)
    keys: list[Any] = [in_b[0], in_a[0], unserved[0], in_a[1], in_b[1], 17, in_a[2], None]
    # Each node waits until the other has its request too: passes only if the fan-out is concurrent.
    a.barrier = b.barrier = asyncio.Barrier(2)

    results = run(lambda: h.proxy.batch_get("s", keys))
    assert [r["key"] for r in results] == [
        in_b[0],
        in_a[0],
        unserved[0],
        in_a[1],
        in_b[1],
        "17",
        in_a[2],
        None,
    ]
    assert [r["status"] for r in results] == [200, 200, 503, 200, 404, 200, 200, 400]
    assert results[0]["value"] == {"v": in_b[0]} and results[3]["value"] == {"v": in_a[1]}
    assert results[5]["value"] == {"v": "17"}
    assert results[2]["error"] == "partition_unavailable" and results[4]["error"] == "key_not_found"
    assert results[7]["error"] == "bad_key"
    # One POST per node, carrying that node's keys in request order; the unserved and bad keys went nowhere.
    assert len(a.received) == 1 and len(b.received) == 1
    assert a.received[0].raw_path == b"/stores/s/batch-get"
    assert a.received[0].keys == [in_a[0], in_a[1], "17", in_a[2]]
    assert b.received[0].keys == [in_b[0], in_b[1]]
    assert a.received[0].headers[HEADER_ROUTER] == "1"


def test_batch_keys_that_do_not_fit_the_key_format_get_their_own_400_without_a_node_request() -> None:
    ints = store_record("n", PARTITIONS, key_format=KeyFormat.INT64)
    a = FakeNode("a", {("n", "5"): {"x": 1}})
    h = Harness(build_map([ints], {"a": {"n": range(PARTITIONS)}}), a)
    results = run(lambda: h.proxy.batch_get("n", ["abc", "5", str(2**63), True]))
    assert [r["status"] for r in results] == [400, 200, 400, 400]
    assert {r.get("error") for r in results if r["status"] == 400} == {"bad_key"}
    assert a.received[0].keys == ["5"]


def test_batch_keys_of_a_failed_node_are_retried_on_the_next_replica() -> None:
    keys = [k for p in range(PARTITIONS) for k in keys_in(p, 2)]
    a, b = FakeNode("a", values_for(keys)), FakeNode("b", values_for(keys))
    a.down = True
    h = Harness(replicated_map(("a", "b")), a, b)
    results = run(lambda: h.proxy.batch_get("s", keys))
    assert [r["status"] for r in results] == [200] * len(keys)
    assert [r["key"] for r in results] == keys
    assert len(b.received) == 1 and b.received[0].keys == keys
    assert h.proxy.metrics.failovers == len(keys)


def test_batch_keys_whose_replicas_all_fail_are_503_entries() -> None:
    keys = keys_in(0, 2) + keys_in(2, 2)
    a, b = FakeNode("a", values_for(keys)), FakeNode("b", values_for(keys))
    b.down = True
    h = Harness(split_map(), a, b)
    results = run(lambda: h.proxy.batch_get("s", keys))
    assert [r["status"] for r in results] == [200, 200, 503, 503]
    assert results[2]["error"] == "partition_unavailable"


def test_batch_entries_a_node_refuses_with_503_go_to_the_next_replica() -> None:
    keys = keys_in(0, 2)
    a, b = FakeNode("a", values_for(keys)), FakeNode("b", values_for(keys))
    a.unavailable = True
    h = Harness(replicated_map(("a", "b")), a, b)
    results = run(lambda: h.proxy.batch_get("s", keys))
    assert [r["status"] for r in results] == [200, 200]
    assert b.received[0].keys == keys


def test_a_batch_over_the_limit_is_413_and_an_unknown_store_404() -> None:
    h = Harness(split_map(), FakeNode("a"), FakeNode("b"), max_batch_keys=3)
    with pytest.raises(PayloadTooLarge) as caught:
        run(lambda: h.proxy.batch_get("s", ["1", "2", "3", "4"]))
    assert caught.value.status == 413 and caught.value.code == "too_many_keys"
    with pytest.raises(StoreNotFound):
        run(lambda: h.proxy.batch_get("nope", ["1"]))


def test_a_partition_nobody_announces_is_read_from_the_node_that_served_it_last() -> None:
    a = FakeNode("a", values_for(keys_in(1, 2)))
    store = store_record("s", PARTITIONS)
    h = Harness(build_map([store], {"a": {"s": range(PARTITIONS)}}), a)
    h.proxy.install(RoutingTable.of(build_map([store], {"b": {"s": [0]}}), h.proxy.table))
    key, other = keys_in(1, 2)
    answer = run(lambda: get(h.proxy, "s", key))
    assert answer.status == 200 and dict(answer.headers)[b"x-keyroute-node"] == b"a"
    results = run(lambda: h.proxy.batch_get("s", [key, other]))
    assert [r["status"] for r in results] == [200, 200]
    assert h.proxy.metrics.last_known_routes == 2 and h.proxy.metrics.unavailable == 0
    a.down = True  # gone for good: 503, as when nobody served it at all
    with pytest.raises(PartitionUnavailable):
        run(lambda: get(h.proxy, "s", key))


# -- spreading ----------------------------------------------------------------------------------------------


def test_reads_of_one_partition_are_spread_over_its_replicas() -> None:
    a, b = FakeNode("a", values_for(["k"])), FakeNode("b", values_for(["k"]))
    h = Harness(replicated_map(("a", "b")), a, b, rng=random.Random(3))

    async def scenario() -> None:
        for _ in range(200):
            assert (await get(h.proxy, "s", "k")).status == 200

    run(scenario)
    assert 70 <= len(a.received) <= 130 and len(a.received) + len(b.received) == 200
    assert h.proxy.in_flight == {}


def test_batches_are_spread_over_the_replicas_too_with_each_partition_in_one_request() -> None:
    keys = [k for p in range(PARTITIONS) for k in keys_in(p, 3)]
    a, b = FakeNode("a", values_for(keys)), FakeNode("b", values_for(keys))
    h = Harness(replicated_map(("a", "b")), a, b, rng=random.Random(5))

    async def scenario() -> None:
        for _ in range(20):
            results = await h.proxy.batch_get("s", keys)
            assert [r["status"] for r in results] == [200] * len(keys)

    run(scenario)
    got_a = Counter(partition(k) for r in a.received for k in r.keys)
    got_b = Counter(partition(k) for r in b.received for k in r.keys)
    # Both replicas carry a share, and each partition's 3 keys always travelled together.
    assert sum(got_a.values()) >= 40 and sum(got_b.values()) >= 40
    assert all(n % 3 == 0 for n in [*got_a.values(), *got_b.values()])
    assert h.proxy.metrics.upstream_requests == len(a.received) + len(b.received)


# -- the read engine against real nodes on 127.0.0.1, over the router's own HTTP client ----------------------


class LocalNode:
    """A small real node (keyroute's HTTP server in a thread) answering every key of store `s` after
    `delay_s`. Records the key of every request that reached it (`received`) and of every answer it made
    (`answered`, once its delay is over); `unavailable` answers 503 (after the delay)."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.port = 0
        self.delay_s = 0.0
        self.unavailable = False
        self.hops = "0"
        self.received: list[str] = []
        self.answered: list[str] = []
        self.test = 0  # which test the node serves: reset() starts the next
        app = Starlette(routes=[Route("/stores/{store}/keys/{key:path}", self._get, methods=["GET"])])
        self.server = HttpServer(app, ServerLimits())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _get(self, request: Request) -> Response:
        located = key_path_segment(request.scope["raw_path"])
        assert located is not None
        store, key = located
        self.received.append(key)
        delay_s, unavailable = self.delay_s, self.unavailable  # as they were when the request arrived
        test = self.test
        if delay_s:
            await asyncio.sleep(delay_s)  # the node being slow, not the test waiting
        if test == self.test:  # a request of an earlier test, answered late, is not this test's answer
            self.answered.append(key)
        headers = {"x-keyroute-node": self.node_id, "x-keyroute-hops": self.hops, "x-keyroute-generation": "9"}
        if unavailable:
            body = json.dumps({"error": "partition_unavailable", "message": "not here"}).encode()
            return Response(body, status_code=503, media_type="application/json", headers=headers)
        value = json.dumps({"node": self.node_id}).encode()
        return Response(found_body(store, key, 0, 1, value), media_type="application/json", headers=headers)

    def reset(self) -> None:
        self.test += 1
        self.delay_s = 0.0
        self.unavailable = False
        self.hops = "0"
        self.received = []
        self.answered = []


@pytest.fixture(scope="module")
def local_nodes() -> Iterator[tuple[LocalNode, LocalNode]]:
    nodes = (LocalNode("slow"), LocalNode("fast"))
    with contextlib.ExitStack() as stack:
        for node in nodes:
            node.port = stack.enter_context(serve_in_thread(node.server))
        yield nodes


@pytest.fixture
def slow_fast(local_nodes: tuple[LocalNode, LocalNode]) -> tuple[LocalNode, LocalNode]:
    for node in local_nodes:
        node.reset()
    return local_nodes


class Named(Protocol):
    @property
    def node_id(self) -> str: ...

    @property
    def url(self) -> str: ...


@dataclass(frozen=True)
class Somewhere:
    node_id: str
    url: str


class CountingUpstream(FastUpstream):
    """FastUpstream counting the requests `get_now` and `get_now_at` sent without a coroutine and those
    declined; `at_once = False` declines every one, so each goes through `Upstream.get` in a task."""

    def __init__(self, timeout_s: float, connect_timeout_s: float) -> None:
        super().__init__(timeout_s, connect_timeout_s)
        self.sent = 0
        self.declined = 0
        self.at_once = True

    def get_now(self, url: str, head: bytes, on_reply: Callable[[UpstreamResponse | Exception], None]) -> Any:
        exchange = super().get_now(url, head, on_reply) if self.at_once else None
        if exchange is None:
            self.declined += 1
        else:
            self.sent += 1
        return exchange

    def get_now_at(
        self, origin: str, target: str, head: bytes, on_reply: Callable[[UpstreamResponse | Exception], None]
    ) -> Any:
        exchange = super().get_now_at(origin, target, head, on_reply) if self.at_once else None
        if exchange is not None:
            self.sent += 1
        return exchange  # declined: the proxy asks get_now next, which counts it


class LocalHarness:
    """A Proxy over FastUpstream to two real nodes serving every partition; the first is preferred."""

    def __init__(
        self,
        first: Named,
        second: Named,
        hedge_after_s: float | None,
        rng: random.Random | None = None,
        timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        budget_ratio: float = 0.1,
        stall_after_s: float = HedgeSettings().stall_after_s,
    ) -> None:
        store = store_record("s", PARTITIONS)
        assignment = Assignment(
            generation=1, stores={"s": tuple((first.node_id, second.node_id) for _ in range(PARTITIONS))}
        )
        serving = {
            n.node_id: ServingRecord(n.node_id, n.url, {"s": dict.fromkeys(range(PARTITIONS), 1)})
            for n in (first, second)
        }
        nodes = {n.node_id: NodeRecord(n.node_id, n.url) for n in (first, second)}
        self.refreshes = 0
        self.nodes = (first, second)
        self.upstream = CountingUpstream(timeout_s, 1.0)
        self.backoff = NodeBackoff()
        self.proxy = Proxy(
            self.upstream,
            on_stale_map=self._refresh,
            hedge=HedgeSettings(after_s=hedge_after_s, budget_ratio=budget_ratio, stall_after_s=stall_after_s),
            backoff=self.backoff,
            clock=clock,
            rng=rng or MapOrderOnTies(),
        )
        self.proxy.install(RoutingTable.of(PartitionMap.build({"s": store}, nodes, assignment, serving, 7)))

    def _refresh(self) -> None:
        self.refreshes += 1

    async def read(self, key: str) -> tuple[str, str, set[str]]:
        """(answering node, key in the answer, the nodes that had answered the key by the time the read
        delivered) of one read through the proxy."""
        answer = await get(self.proxy, "s", key)
        assert answer.status == 200, answer.body
        return dict(answer.headers)[b"x-keyroute-node"].decode(), json.loads(answer.body)["key"], self.answered(key)

    def answered(self, key: str) -> set[str]:
        """The nodes that have answered a request for `key` (real nodes only) by now."""
        return {n.node_id for n in self.nodes if isinstance(n, LocalNode) and key in n.answered}


def test_a_read_stuck_on_a_slow_replica_is_hedged_and_answered_by_the_other(
    slow_fast: tuple[LocalNode, LocalNode],
) -> None:
    slow, fast = slow_fast
    # Slow by far more than the hedge delay: on a loaded machine the other node's answer may itself take a while.
    slow.delay_s = 1.0
    h = LocalHarness(slow, fast, hedge_after_s=0.02)  # the slow node is always asked first
    keys = [f"k{i}" for i in range(8)]

    async def scenario() -> tuple[list[tuple[str, str, set[str]]], list[tuple[str, str, set[str]]]]:
        try:
            hedged = [await h.read(key) for key in keys]
            # The slow node still owes its answers to the cancelled requests: had a cancelled request's
            # connection gone back to the pool, these reads would receive those late answers.
            slow.delay_s = 0.0
            after = [await h.read(f"after-{i}") for i in range(8)]
            return hedged, after
        finally:
            await h.upstream.aclose()

    hedged, after = run(scenario)
    assert [(node, key) for node, key, _ in hedged] == [("fast", key) for key in keys]
    # Delivered without waiting for the slow node (0.3 s): most reads before it had answered at all.
    assert sum("slow" not in answered for _, _, answered in hedged) > len(hedged) // 2
    # Every read asked the slow node first (each was hedged, below); on a loaded machine a request cancelled by the
    # hedge's answer may be closed before the slow node has read it, so it received the keys in order, some missing.
    first = [key for key in slow.received if not key.startswith("after-")]
    assert first == [key for key in keys if key in first] and fast.received == keys
    m = h.proxy.metrics
    assert m.hedges == len(keys) and m.hedge_wins == len(keys) and m.budget_exhausted == 0
    assert [(node, key) for node, key, _ in after] == [("slow", f"after-{i}") for i in range(8)]
    assert m.hedges == len(keys)  # fast answers are not hedged
    assert h.proxy.in_flight == {}


@pytest.mark.parametrize(
    ("offset_s", "hedge_after_s", "hedged"),
    [(1e6, 0.02, True), (-1e6, 5.0, False)],
    ids=["ahead-short-delay", "behind-long-delay"],
)
def test_a_hedge_is_due_by_the_proxys_clock_however_far_it_is_from_the_loops(
    slow_fast: tuple[LocalNode, LocalNode], offset_s: float, hedge_after_s: float, hedged: bool
) -> None:
    # A deadline read on one clock and compared with the other would be due never (ahead) or at once
    # (behind): either way the answer would come from the other node.
    slow, fast = slow_fast
    slow.delay_s = 0.3
    h = LocalHarness(slow, fast, hedge_after_s=hedge_after_s, clock=lambda: time.monotonic() + offset_s)

    async def scenario() -> tuple[str, str, set[str]]:
        try:
            return await h.read("k")
        finally:
            await h.upstream.aclose()

    node, key, _ = run(scenario)
    assert (node, key) == ("fast" if hedged else "slow", "k")
    assert h.proxy.metrics.hedges == (1 if hedged else 0)


def test_settings_are_read_from_the_router_settings_and_a_negative_hedge_delay_is_refused() -> None:
    router = RouterSettings(
        max_batch_keys=7,
        unavailable_retry_after_s=4,
        hedge_after_ms=25,
        retry_budget_percent=5,
        limits=RequestLimits(max_key_bytes=99),
    )
    assert ProxySettings.of(router, {"x-keyroute-auth": "t"}) == ProxySettings(
        max_batch_keys=7, max_key_bytes=99, retry_after_s=4, member_headers={"x-keyroute-auth": "t"}
    )
    assert HedgeSettings.of(router) == HedgeSettings(after_s=0.025, budget_ratio=0.05)
    assert HedgeSettings.of(RouterSettings()).after_s is None  # derived from latencies
    with pytest.raises(ValueError, match="negative"):
        HedgeSettings(after_s=-0.001)
    with pytest.raises(ValueError, match="negative"):
        HedgeSettings(budget_ratio=-0.1)


def test_without_hedging_the_slow_replica_answers_every_read_it_gets(
    slow_fast: tuple[LocalNode, LocalNode],
) -> None:
    slow, fast = slow_fast
    slow.delay_s = 0.3
    # The stall delay (which would ask the other node after 0.25 s) is a setting of its own.
    h = LocalHarness(slow, fast, hedge_after_s=0, stall_after_s=0)

    async def scenario() -> list[tuple[str, str, set[str]]]:
        try:
            return [await h.read(f"k{i}") for i in range(2)]
        finally:
            await h.upstream.aclose()

    answers = run(scenario)
    assert [node for node, _, _ in answers] == ["slow", "slow"] and fast.received == []
    assert h.proxy.metrics.hedges == 0


def test_when_the_first_replica_answers_first_the_hedge_is_cancelled(
    slow_fast: tuple[LocalNode, LocalNode],
) -> None:
    first, second = slow_fast
    first.delay_s, second.delay_s = 0.1, 15.0  # far slower, even when load stretches 0.1 s
    h = LocalHarness(first, second, hedge_after_s=0.02)

    async def scenario() -> tuple[str, str, set[str]]:
        try:
            return await h.read("k")
        finally:
            await h.upstream.aclose()

    node, _, answered = run(scenario)
    assert node == "slow" and "fast" not in answered  # the first node's answer, without waiting for the hedge
    assert second.received == ["k"]
    assert h.proxy.metrics.hedges == 1 and h.proxy.metrics.hedge_wins == 0
    assert h.proxy.in_flight == {}


def test_a_first_replica_refusing_after_the_hedge_went_out_leaves_the_answer_to_the_hedge(
    slow_fast: tuple[LocalNode, LocalNode],
) -> None:
    first, second = slow_fast
    first.delay_s, first.unavailable = 0.05, True
    second.delay_s = 0.15
    h = LocalHarness(first, second, hedge_after_s=0.01)

    async def scenario() -> tuple[str, str, set[str]]:
        try:
            return await h.read("k")
        finally:
            await h.upstream.aclose()

    node, key, _ = run(scenario)
    assert (node, key) == ("fast", "k")
    assert h.proxy.metrics.hedges == 1 and h.proxy.metrics.hedge_wins == 1
    assert h.proxy.metrics.failovers == 0  # the hedge was already out: nothing more was sent
    assert h.refreshes == 1  # the 503 still tells the router its map may be stale


def test_a_read_cancelled_while_hedged_cancels_both_requests(slow_fast: tuple[LocalNode, LocalNode]) -> None:
    first, second = slow_fast
    first.delay_s = second.delay_s = 2.0
    h = LocalHarness(first, second, hedge_after_s=0.01)

    async def scenario() -> dict[str, int]:
        try:
            read = asyncio.ensure_future(get(h.proxy, "s", "k"))
            await wait_until(lambda: first.received and second.received, message="both requests at the nodes")
            read.cancel()
            with pytest.raises(asyncio.CancelledError):
                await read
            await wait_until(lambda: not h.proxy.in_flight, message="no request in flight")
            return dict(h.proxy.in_flight)
        finally:
            await h.upstream.aclose()

    assert run(scenario) == {}
    assert h.proxy.metrics.hedge_wins == 0


def test_the_budget_holds_the_extra_requests_for_a_node_slow_on_every_read(
    slow_fast: tuple[LocalNode, LocalNode],
) -> None:
    slow, fast = slow_fast
    slow.delay_s = 0.2
    # The stall delay off: on a busy machine the slow node's 0.2 s may stretch past it (what it bounds is tested
    # below).
    h = LocalHarness(slow, fast, hedge_after_s=0.01, rng=random.Random(1), stall_after_s=0)
    waves, per_wave = 3, 100

    async def scenario() -> list[tuple[str, str, set[str]]]:
        try:
            answers = []
            for wave in range(waves):
                keys = [f"w{wave}-{i}" for i in range(per_wave)]
                answers += await asyncio.gather(*(h.read(key) for key in keys))
            return answers
        finally:
            await h.upstream.aclose()

    answers = run(scenario)
    reads = waves * per_wave
    assert len(answers) == reads and all(key.startswith("w") for _, key, _ in answers)
    extra = len(slow.received) + len(fast.received) - reads
    m = h.proxy.metrics
    # A hedge cancelled while still connecting never reaches its node, so the nodes may count fewer.
    assert m.upstream_requests == reads + m.hedges and extra <= m.hedges
    # 10% of the reads plus the burst of a full bucket, and no more, though half the reads were slow.
    assert extra > 0 and m.hedges <= 0.1 * reads + 10
    assert m.budget_exhausted > 0
    assert h.proxy.in_flight == {}


@pytest.mark.parametrize("why", ["hedging off", "the other replica backed off", "the retry budget spent"])
def test_a_read_waiting_on_a_frozen_replica_asks_the_other_at_the_stall_delay_whatever_the_budget(
    slow_fast: tuple[LocalNode, LocalNode], why: str
) -> None:
    # The first node answers nothing for 2 s (frozen, as under SIGSTOP); the upstream timeout is 5 s. Hedging
    # cannot help (off, refused by back-off or by an empty budget): the stall delay still asks the other node.
    slow, fast = slow_fast
    h = LocalHarness(
        slow,
        fast,
        hedge_after_s=0 if why == "hedging off" else 0.01,
        budget_ratio=0.0,
        stall_after_s=0.05,
    )

    async def scenario() -> tuple[str, str, set[str]]:
        try:
            if why == "the retry budget spent":
                slow.delay_s = 0.3
                while h.proxy.metrics.budget_exhausted == 0:  # the burst goes on hedges; none is earned back
                    await h.read(f"spend-{h.proxy.metrics.upstream_requests}")
                # The read that found the budget empty may have stalled and backed the slow node off: undone.
                h.backoff.succeeded(h.proxy.table.serving_of("s", "k")[1][0])
            if why == "the other replica backed off":
                h.backoff.failed(h.proxy.table.serving_of("s", "k")[1][1], "failed just now")
            slow.delay_s = 2.0
            before = h.proxy.metrics.stalls
            answer = await h.read("k")
            assert h.proxy.metrics.stalls == before + 1
            return answer
        finally:
            await h.upstream.aclose()

    node, key, answered = run(scenario)
    assert (node, key) == ("fast", "k")
    assert "slow" not in answered  # delivered before the frozen node answered anything: not its timeout
    assert h.proxy.metrics.upstream_failures == 0
    assert h.backoff.backed_off(slow.url)  # the next reads go to the other replica first


def test_a_replica_answering_in_time_is_not_asked_twice_by_the_stall_delay(
    slow_fast: tuple[LocalNode, LocalNode],
) -> None:
    slow, fast = slow_fast
    h = LocalHarness(slow, fast, hedge_after_s=0, stall_after_s=5.0)

    async def scenario() -> list[tuple[str, str, set[str]]]:
        try:
            return [await h.read(f"k{i}") for i in range(20)]
        finally:
            await h.upstream.aclose()

    answers = run(scenario)
    assert [node for node, _, _ in answers] == ["slow"] * 20  # the first node, in map order on ties
    m = h.proxy.metrics
    assert m.stalls == 0 and m.failovers == 0 and m.upstream_requests == 20
    assert fast.received == []


def test_a_negative_stall_delay_is_refused() -> None:
    with pytest.raises(ValueError, match="stall delay"):
        HedgeSettings(stall_after_s=-1)


def test_the_automatic_threshold_comes_from_recent_latencies(slow_fast: tuple[LocalNode, LocalNode]) -> None:
    slow, fast = slow_fast
    h = LocalHarness(slow, fast, hedge_after_s=None)

    async def scenario() -> list[tuple[str, str, set[str]]]:
        try:
            assert h.proxy.hedge_delay_s is None  # no latencies yet: no hedging
            for i in range(DEFAULT_RECOMPUTE_EVERY):  # both fast: enough reads to know what "usual" is
                await h.read(f"warm-{i}")
            assert h.proxy.hedge_delay_s is not None
            assert h.proxy.metrics.hedges == 0
            slow.delay_s = 0.3
            return [await h.read(f"k{i}") for i in range(4)]
        finally:
            await h.upstream.aclose()

    answers = run(scenario)
    assert [node for node, _, _ in answers] == ["fast"] * 4
    assert h.proxy.metrics.hedges == 4 and h.proxy.metrics.hedge_wins == 4


# -- a read on an idle connection: no coroutine, the reply delivered from the connection's callback --------


class SendNowSpy:
    """What a harness's upstream sent without a coroutine, and declined, since the spy was made."""

    def __init__(self, upstream: CountingUpstream) -> None:
        self.upstream = upstream
        self._sent = upstream.sent
        self._declined = upstream.declined

    @property
    def sent(self) -> int:
        return self.upstream.sent - self._sent

    @property
    def declined(self) -> int:
        return self.upstream.declined - self._declined


def no_task_left() -> bool:
    """Whether the running test's coroutine is the only task on its loop (every request task has ended)."""
    return asyncio.all_tasks() == {asyncio.current_task()}


async def read_via_callback(proxy: Proxy, key: str, store: str = "s") -> Any:
    """What `Proxy.read` delivers (an UpstreamResponse or the exception the read failed with)."""
    return await asyncio.wait_for(read_result(proxy, store, key), 10)


def counters(proxy: Proxy) -> dict[str, int]:
    m = proxy.metrics
    names = ("key_requests", "upstream_requests", "upstream_failures", "failovers", "misroutes", "unavailable")
    return {name: getattr(m, name) for name in names}


def test_a_read_on_an_idle_connection_delivers_what_a_read_through_a_task_delivers(
    slow_fast: tuple[LocalNode, LocalNode],
) -> None:
    first, second = slow_fast
    h = LocalHarness(first, second, hedge_after_s=0)
    keys = [f"k{i}" for i in range(10)] + ["a/b", "東京", ".."]

    async def scenario() -> tuple[list[Any], list[Any], dict[str, int], dict[str, int], SendNowSpy]:
        try:
            h.upstream.at_once = False  # every request through `Upstream.get`
            through_tasks = [await read_via_callback(h.proxy, key) for key in keys]
            after_tasks = counters(h.proxy)
            assert no_task_left()
            h.upstream.at_once = True
            spy = SendNowSpy(h.upstream)
            at_once = [await read_via_callback(h.proxy, key) for key in keys]
            assert no_task_left()
            return through_tasks, at_once, after_tasks, counters(h.proxy), spy
        finally:
            await h.upstream.aclose()

    through_tasks, at_once, after_tasks, after_at_once, spy = run(scenario)
    assert [(r.status, r.body) for r in at_once] == [(g.status, g.body) for g in through_tasks]
    assert [sorted(r.headers) for r in at_once] == [sorted(g.headers) for g in through_tasks]
    assert all(json.loads(r.body)["key"] == key for r, key in zip(at_once, keys, strict=True))
    # The same bookkeeping either way: one key request and one upstream request per read.
    assert {name: after_at_once[name] - after_tasks[name] for name in after_tasks} == after_tasks
    assert after_tasks["key_requests"] == after_tasks["upstream_requests"] == len(keys)
    assert spy.sent == len(keys) and spy.declined == 0  # the first pass left an idle connection for each
    assert h.proxy.in_flight == {}
    latency = h.proxy.metrics.upstream_latency["slow"]
    assert latency.count == 2 * len(keys)


def test_read_raises_at_once_what_is_wrong_before_any_node_is_asked(slow_fast: tuple[LocalNode, LocalNode]) -> None:
    first, second = slow_fast
    h = LocalHarness(first, second, hedge_after_s=0)

    async def scenario() -> None:
        try:
            with pytest.raises(StoreNotFound):
                h.proxy.read("nope", "k", "rid-1", lambda answer: pytest.fail("no answer expected"))
        finally:
            await h.upstream.aclose()

    run(scenario)
    assert first.received == [] and second.received == []


def test_a_read_the_first_replica_refuses_is_answered_by_the_other(slow_fast: tuple[LocalNode, LocalNode]) -> None:
    first, second = slow_fast
    h = LocalHarness(first, second, hedge_after_s=0)
    spy = SendNowSpy(h.upstream)

    async def scenario() -> Any:
        try:
            await get(h.proxy, "s", "warm", "rid-1")  # an idle connection to the first replica
            first.unavailable = True
            return await read_via_callback(h.proxy, "k")
        finally:
            await h.upstream.aclose()

    answer = run(scenario)
    assert answer.status == 200 and answer.header(b"x-keyroute-node") == b"fast"
    assert spy.sent == 1 and first.received == ["warm", "k"] and second.received == ["k"]
    assert h.proxy.metrics.failovers == 1 and h.refreshes == 1


def test_a_read_whose_node_stops_answering_goes_to_the_other_and_the_node_is_backed_off(
    slow_fast: tuple[LocalNode, LocalNode],
) -> None:
    first, second = slow_fast
    # The upstream timeout's path: the stall delay (0.25 s by default) off.
    h = LocalHarness(first, second, hedge_after_s=0, timeout_s=0.3, stall_after_s=0)
    spy = SendNowSpy(h.upstream)

    async def scenario() -> tuple[Any, Any]:
        try:
            await get(h.proxy, "s", "warm", "rid-1")
            first.delay_s = 1.0
            answer = await read_via_callback(h.proxy, "k")
            first.delay_s = 0.0
            return answer, await read_via_callback(h.proxy, "k2")
        finally:
            await h.upstream.aclose()

    answer, later = run(scenario)
    assert answer.status == 200 and answer.header(b"x-keyroute-node") == b"fast"
    assert spy.sent >= 1
    m = h.proxy.metrics
    assert m.upstream_failures == 1 and m.failovers == 1
    # Backed off: the next read goes to the other replica first.
    assert later.header(b"x-keyroute-node") == b"fast" and h.backoff.backed_off(first.url)
    assert h.proxy.in_flight == {}


def test_a_forwarded_answer_read_without_a_coroutine_counts_a_misroute(
    slow_fast: tuple[LocalNode, LocalNode],
) -> None:
    first, second = slow_fast
    h = LocalHarness(first, second, hedge_after_s=0)
    spy = SendNowSpy(h.upstream)

    async def scenario() -> Any:
        try:
            await get(h.proxy, "s", "warm", "rid-1")
            first.hops = "1"
            return await read_via_callback(h.proxy, "k")
        finally:
            await h.upstream.aclose()

    answer = run(scenario)
    assert answer.status == 200 and spy.sent == 1
    assert h.proxy.metrics.misroutes == 1 and h.refreshes == 1  # generation 9 is newer than our 7


class CoroutinesOnly:
    """An `Upstream` with `get` and `post` only (no `get_now`), as any other HTTP client would be."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.gets = 0

    async def get(self, url: str, headers: Mapping[str, str]) -> UpstreamResponse:
        self.gets += 1
        return await self.upstream.get(url, headers)

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        return await self.upstream.post(url, body, headers)

    async def aclose(self) -> None:
        await self.upstream.aclose()


def test_a_read_over_an_upstream_that_cannot_send_at_once_goes_through_a_task() -> None:
    a, b = FakeNode("a", values_for(["k"])), FakeNode("b", values_for(["k"]))
    cluster = FakeCluster(a, b)
    upstream = CoroutinesOnly(cluster.upstream())
    proxy = Proxy(upstream, on_stale_map=lambda: None, hedge=HedgeSettings(after_s=0), rng=MapOrderOnTies())
    proxy.install(RoutingTable.of(replicated_map()))
    a.down = True

    async def scenario() -> Any:
        try:
            return await read_via_callback(proxy, "k")
        finally:
            await upstream.aclose()

    answer = run(scenario)
    assert answer.status == 200 and answer.header(b"x-keyroute-node") == b"b"
    assert proxy.metrics.failovers == 1
    assert upstream.gets == 2  # both requests, the failed one and the failover, through `get`


class MixedCaseNode:
    """An `Upstream` (get only) whose every reply names its headers as some HTTP stacks do: capitalised."""

    def __init__(self) -> None:
        self.reply = UpstreamResponse(
            200,
            [
                (b"Content-Type", b"application/json"),
                (b"X-Keyroute-Node", b"a"),
                (b"X-Keyroute-Hops", b"1"),
                (b"Connection", b"keep-alive, X-Private"),
                (b"X-Private", b"not for the client"),
                (b"Content-Length", b"2"),
                (b"Date", b"Fri, 27 Nov 2026 10:00:00 GMT"),
            ],
            b"{}",
        )

    async def get(self, url: str, headers: Mapping[str, str]) -> UpstreamResponse:
        return self.reply

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        raise AssertionError("no batch here")

    async def aclose(self) -> None:
        pass


def test_a_reply_with_capitalised_header_names_is_relayed_lower_cased_without_hop_by_hop_headers() -> None:
    proxy = Proxy(MixedCaseNode(), on_stale_map=lambda: None, hedge=HedgeSettings(after_s=0), rng=MapOrderOnTies())
    proxy.install(RoutingTable.of(replicated_map()))

    answer = run(lambda: read_via_callback(proxy, "k"))
    assert answer.status == 200 and answer.body == b"{}"
    assert list(answer.headers) == [
        (b"content-type", b"application/json"),
        (b"x-keyroute-node", b"a"),
        (b"x-keyroute-hops", b"1"),
    ]
    assert proxy.metrics.misroutes == 1  # X-Keyroute-Hops: 1 seen under its capitalised name too


async def idle_connections_to(h: LocalHarness, node: LocalNode, count: int) -> None:
    """`count` idle connections from the harness's upstream to `node`, for reads sent without a coroutine."""
    answers = await asyncio.gather(
        *(h.upstream.get(f"{node.url}/stores/s/keys/warm-{i}", {"accept-encoding": "identity"}) for i in range(count))
    )
    assert {a.status for a in answers} == {200}
    node.received.clear()


def test_a_read_sent_without_a_coroutine_is_hedged_when_its_replica_is_slow(
    slow_fast: tuple[LocalNode, LocalNode],
) -> None:
    slow, fast = slow_fast
    h = LocalHarness(slow, fast, hedge_after_s=0.02)
    spy = SendNowSpy(h.upstream)
    keys = [f"k{i}" for i in range(6)]

    m = h.proxy.metrics
    phase: dict[str, int] = {}

    async def scenario() -> tuple[list[tuple[Any, set[str]]], list[Any]]:
        try:
            await idle_connections_to(h, slow, len(keys))
            slow.delay_s = 0.3
            hedged = []
            for key in keys:
                answer = await read_via_callback(h.proxy, key)
                hedged.append((answer, h.answered(key)))
            phase.update(hedges=m.hedges, wins=m.hedge_wins, exhausted=m.budget_exhausted, fast=len(fast.received))
            # The slow node still owes its answers to the abandoned requests: had an abandoned request's
            # connection gone back to the pool, these reads would receive those late answers.
            slow.delay_s = 0.0
            after = [await read_via_callback(h.proxy, f"after-{i}") for i in range(6)]
            await wait_until(lambda: not h.proxy.in_flight, message="no request in flight")
            return hedged, after
        finally:
            await h.upstream.aclose()

    hedged, after = run(scenario)
    assert spy.sent >= len(keys)  # every hedged read went out without a coroutine
    assert [(a.header(b"x-keyroute-node"), json.loads(a.body)["key"]) for a, _ in hedged] == [
        (b"fast", key) for key in keys
    ]
    # Delivered without waiting for the slow node (0.3 s): most reads before it had answered at all.
    assert sum("slow" not in answered for _, answered in hedged) > len(keys) // 2
    assert slow.received[: len(keys)] == keys and fast.received[: len(keys)] == keys
    assert phase == {"hedges": len(keys), "wins": len(keys), "exhausted": 0, "fast": len(keys)}
    # Each read afterwards gets its own answer, never a late one the slow node owed; on a loaded machine one
    # may still take longer than the hedge delay and be hedged to the fast node (its answer then says so).
    assert [json.loads(a.body)["key"] for a in after] == [f"after-{i}" for i in range(6)]
    hedged_after = fast.received[len(keys) :]
    assert set(hedged_after) <= {f"after-{i}" for i in range(6)}
    assert all(a.header(b"x-keyroute-node") == b"slow" or json.loads(a.body)["key"] in hedged_after for a in after)
    assert m.hedges == len(keys) + len(hedged_after)
    assert m.upstream_requests == len(keys) + len(after) + m.hedges


def test_when_the_first_replica_answers_first_the_hedge_of_a_read_without_a_coroutine_is_cancelled(
    slow_fast: tuple[LocalNode, LocalNode],
) -> None:
    first, second = slow_fast
    h = LocalHarness(first, second, hedge_after_s=0.02)
    spy = SendNowSpy(h.upstream)

    async def scenario() -> tuple[Any, set[str]]:
        try:
            await idle_connections_to(h, first, 1)
            # The second node far slower than the first: on a loaded machine 0.1 s can stretch past a second (and
            # was seen to stretch past three).
            first.delay_s, second.delay_s = 0.1, 15.0
            answer = await read_via_callback(h.proxy, "k")
            answered = h.answered("k")
            await wait_until(lambda: not h.proxy.in_flight, message="the hedge stopped")
            return answer, answered
        finally:
            await h.upstream.aclose()

    answer, answered = run(scenario)
    assert spy.sent == 1
    assert answer.header(b"x-keyroute-node") == b"slow" and "fast" not in answered  # without waiting for the hedge
    assert second.received == ["k"]
    assert h.proxy.metrics.hedges == 1 and h.proxy.metrics.hedge_wins == 0


def test_a_first_replica_refusing_while_the_hedge_is_out_leaves_the_answer_to_the_hedge_without_a_coroutine(
    slow_fast: tuple[LocalNode, LocalNode],
) -> None:
    first, second = slow_fast
    h = LocalHarness(first, second, hedge_after_s=0.01)
    spy = SendNowSpy(h.upstream)

    async def scenario() -> Any:
        try:
            await idle_connections_to(h, first, 1)
            first.delay_s, first.unavailable = 0.05, True
            second.delay_s = 0.15
            return await read_via_callback(h.proxy, "k")
        finally:
            await h.upstream.aclose()

    answer = run(scenario)
    assert spy.sent == 1
    assert (answer.header(b"x-keyroute-node"), json.loads(answer.body)["key"]) == (b"fast", "k")
    m = h.proxy.metrics
    assert m.hedges == 1 and m.hedge_wins == 1
    assert m.failovers == 0  # the hedge was already out: nothing more was sent
    assert h.refreshes == 1  # the 503 still tells the router its map may be stale


def test_a_read_without_a_coroutine_is_freed_as_soon_as_it_is_answered(slow_fast: tuple[LocalNode, LocalNode]) -> None:
    # Left in a reference cycle, every read would wait for the cyclic garbage collector, which then runs
    # every few hundred reads and costs the router a tenth of its CPU.
    first, second = slow_fast
    h = LocalHarness(first, second, hedge_after_s=0)
    spy = SendNowSpy(h.upstream)

    async def scenario() -> list[str]:
        try:
            await get(h.proxy, "s", "warm", "rid-1")
            gc.collect()
            gc.disable()
            gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds stays in gc.garbage, for us to see
            try:
                for i in range(20):
                    assert (await read_via_callback(h.proxy, f"k{i}")).status == 200
                gc.collect()
                ours = {type(o).__name__ for o in gc.garbage if type(o).__module__.startswith("keyroute.router.")}
                return sorted(ours)
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
                gc.enable()
        finally:
            await h.upstream.aclose()

    assert run(scenario) == []
    assert spy.sent == 20


def test_a_read_whose_idle_connection_the_node_had_closed_is_sent_again_on_a_new_one() -> None:
    # Every connection replies to its first request and closes on its second, without a byte of reply.
    def script(connection: int, number: int) -> list[bytes | str]:
        return [ok(b'{"key": "k"}')] if number == 0 else [CLOSE]

    async def scenario() -> tuple[Any, list[int], LocalHarness, str]:
        async with RawServer(script) as server:
            node = Somewhere("raw", server.url)
            h = LocalHarness(node, Somewhere("other", "http://127.0.0.1:1"), hedge_after_s=0)
            spy = SendNowSpy(h.upstream)
            try:
                assert (await read_via_callback(h.proxy, "k")).status == 200  # leaves an idle connection
                answer = await read_via_callback(h.proxy, "k")
                assert spy.sent == 1  # the second read found the idle connection
                return answer, [connection for connection, _ in server.requests], h, server.url
            finally:
                await h.upstream.aclose()

    answer, connections, h, url = run(scenario)
    assert isinstance(answer, UpstreamResponse) and answer.status == 200
    # The node never saw the request on the closed connection: one upstream request, on a new connection,
    # nothing blamed on the node, nothing sent to the other replica.
    assert connections == [0, 0, 1]
    m = h.proxy.metrics
    assert m.upstream_requests == 2 and m.upstream_failures == 0 and m.failovers == 0
    assert not h.backoff.backed_off(url) and h.proxy.in_flight == {}


class FailingNodes:
    """Every node's every request fails with `error()` (a key read's as a batch-get's)."""

    def __init__(self, error: Callable[[], Exception]) -> None:
        self.error = error

    async def get(self, url: str, headers: Mapping[str, str]) -> UpstreamResponse:
        raise self.error()

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        raise self.error()

    async def aclose(self) -> None:
        pass


@pytest.mark.parametrize(
    ("error", "node_failure", "backs_off"),
    [
        (lambda: UpstreamUnavailable("connection refused"), True, True),
        (lambda: UpstreamUnavailable("", node_fault=True), True, True),
        (lambda: UpstreamUnavailable("the pool is exhausted", node_fault=False), True, False),
        (lambda: ValueError("not an http:// URL"), True, True),
        (lambda: RuntimeError("a bug"), False, False),
    ],
    ids=["refused", "no text", "pool exhausted", "unusable URL", "unexpected"],
)
def test_a_key_read_and_a_batch_get_take_a_failed_request_to_a_node_alike(
    error: Callable[[], Exception], node_failure: bool, backs_off: bool
) -> None:
    """One classification for both engines: a node's failure is counted, backs the node off when it is the
    node's fault, and the read goes on to the other replica (then 503, none answering); anything else fails
    the read with it (a key read delivers it, a batch-get raises it)."""
    key = keys_in(0)[0]
    outcomes: dict[str, tuple[Any, ...]] = {}
    for engine in ("key", "batch"):
        backoff = NodeBackoff()
        proxy = Proxy(
            FailingNodes(error),
            on_stale_map=lambda: None,
            hedge=HedgeSettings(after_s=0),
            backoff=backoff,
            rng=MapOrderOnTies(),
        )
        proxy.install(RoutingTable.of(replicated_map()))

        async def outcome(engine: str = engine, proxy: Proxy = proxy) -> Any:
            if engine == "key":
                return await read_via_callback(proxy, key)
            try:
                return await proxy.batch_get("s", [key])
            except Exception as exc:  # noqa: BLE001 (what the batch-get fails with is the outcome here)
                return exc

        result = run(outcome)
        if not node_failure:
            assert isinstance(result, RuntimeError) and str(result) == "a bug"
        elif engine == "key":
            assert isinstance(result, PartitionUnavailable)
        else:
            assert [entry["status"] for entry in result] == [503]
        outcomes[engine] = (
            proxy.metrics.upstream_failures,
            tuple(backoff.backed_off(node_url(n)) for n in ("a", "b")),
        )
    expected_failures = 2 if node_failure else 0
    assert outcomes["key"] == outcomes["batch"] == (expected_failures, (backs_off, backs_off))


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(
                [
                    b"content-type",
                    b"x-keyroute-node",
                    b"x-keyroute-hops",
                    b"x-a",
                    b"connection",
                    b"keep-alive",
                    b"te",
                    b"trailer",
                    b"upgrade",
                    b"transfer-encoding",
                    b"proxy-authenticate",
                    b"x-private",
                ]
            ),
            st.sampled_from([b"0", b"1", b"close", b"x-a", b"X-Private, x-a", b" TE ", b"v"]),
        ),
        max_size=10,
    )
)
def test_a_replys_headers_are_relayed_as_passthrough_headers_relays_them(pairs: list[tuple[bytes, bytes]]) -> None:
    """The key read's one pass over a node's reply headers (what is relayed, the hop count it notes) gives what
    `passthrough_headers` gives, and counts a misroute exactly when the first X-Keyroute-Hops is not 0."""

    class Node:
        async def get(self, url: str, headers: Mapping[str, str]) -> UpstreamResponse:
            return UpstreamResponse(200, list(pairs), b"{}")

        async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
            raise AssertionError("no batch here")

    proxy = Proxy(Node(), on_stale_map=lambda: None, hedge=HedgeSettings(after_s=0), rng=MapOrderOnTies())
    proxy.install(RoutingTable.of(replicated_map()))
    answer = run(lambda: read_via_callback(proxy, "k"))
    assert list(answer.headers) == passthrough_headers(pairs)
    hops = next((value for name, value in passthrough_headers(pairs) if name == b"x-keyroute-hops"), None)
    assert proxy.metrics.misroutes == (hops is not None and hops.strip() not in (b"", b"0"))
