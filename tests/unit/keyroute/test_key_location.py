"""One KeyLocation: the client's direct routing, the router's routing table and the partition map agree on
where every key lives (its partition and its replicas' order), whatever the key format and partitioner."""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import httpx
import pytest

from keyroute.client import AsyncClient, Client
from keyroute.cluster.partition_map import Assignment, PartitionMap
from keyroute.keys.key_format import KeyFormat, parse_key
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.router.map_views import RoutingTables
from keyroute.router.routing_table import RoutingTable
from tests.unit.router.fakes import build_map, node_url, store_record

NODES = ("a", "b", "c")
# Six partitions, each with its own order of the three nodes: the order a client asks them in names the
# partition it located the key in.
ORDERS = tuple(itertools.permutations(NODES))
PARTITIONS = len(ORDERS)
STORES = {
    "strings": (KeyFormat.STRING, Partitioner.MURMUR2, [f"C{i:06d}" for i in range(200)] + ["", "東京", "a/b"]),
    "numbers": (KeyFormat.INT64, Partitioner.MURMUR2, [str(i * 7919 - 500_000) for i in range(200)]),
    "crc": (KeyFormat.STRING, Partitioner.CRC32, [f"k{i}" for i in range(200)]),
    "uuids": (KeyFormat.UUID, Partitioner.FNV1A, [f"00000000-0000-4000-8000-{i:012x}" for i in range(100)]),
}


def cluster_map() -> PartitionMap:
    stores = [store_record(name, PARTITIONS, key_format=fmt, partitioner=p) for name, (fmt, p, _) in STORES.items()]
    assignment = Assignment(2, {name: ORDERS for name in STORES})
    return build_map(stores, {n: {name: range(PARTITIONS) for name in STORES} for n in NODES}, assignment)


def scripted_cluster(partition_map: PartitionMap, asked: list[str]) -> httpx.MockTransport:
    """The router serves its map and answers every read; every node answers 503, so a direct-routing
    client asks each replica of the key's partition in turn, then the router."""
    # The router's own routing view of the map (router/map_views.py), as `GET /routing` answers it.
    routing = RoutingTables().document(partition_map, sorted(partition_map.stores), None)

    def handler(request: httpx.Request) -> httpx.Response:
        where = f"{request.url.scheme}://{request.url.host}:{request.url.port or 80}"
        if request.url.path == "/routing":
            return httpx.Response(200, content=routing, headers={"content-type": "application/json"})
        asked.append(where)
        if where != "http://router:80":
            return httpx.Response(503, json={"error": "partition_unavailable", "message": "m"})
        store, key = request.url.path.split("/")[2], request.url.path.split("/")[4]
        return httpx.Response(200, json={"store": store, "key": key, "partition": 0, "version": 1, "value": 1})

    return httpx.MockTransport(handler)


def asked_in_order(asked: list[str]) -> list[str]:
    assert asked[-1] == "http://router:80"  # after every replica's 503
    return asked[:-1]


@pytest.mark.parametrize("client_kind", ["blocking", "asyncio"])
def test_the_client_the_routing_table_and_the_map_agree_on_every_keys_location(client_kind: str) -> None:
    partition_map = cluster_map()
    table = RoutingTable.of(partition_map)
    asked: list[str] = []
    located: dict[tuple[str, str], list[str]] = {}

    async def read_all_async() -> None:
        transport = scripted_cluster(partition_map, asked)
        async with AsyncClient("http://router", routing="direct", transport=transport, retries=0) as client:
            for name, (_, _, keys) in STORES.items():
                for key in keys:
                    asked.clear()
                    await client.get(name, key)
                    located[(name, key)] = asked_in_order(asked)

    if client_kind == "asyncio":
        asyncio.run(read_all_async())
    else:
        transport = scripted_cluster(partition_map, asked)
        with Client("http://router", routing="direct", transport=transport, retries=0) as client:
            for name, (_, _, keys) in STORES.items():
                for key in keys:
                    asked.clear()
                    client.get(name, key)
                    located[(name, key)] = asked_in_order(asked)

    partitions_seen: dict[str, set[int]] = {name: set() for name in STORES}
    for (name, key), replicas in located.items():
        key_format, partitioner, _ = STORES[name]
        parsed = parse_key(key_format, key)
        by_table = table.locate(name, key)
        by_map = partition_map.locate(partition_map.stores[name], parsed)
        assert by_table == by_map
        assert table.serving_of(name, key) == (by_table.partition, by_table.serving)  # the read's lean lookup
        assert by_table.partition == partition_for(partitioner, parsed.data, PARTITIONS)
        assert by_table.assigned == ORDERS[by_table.partition]
        # The client asked the replicas of that very partition, preferred first.
        assert replicas == [ep.url for ep in by_table.serving] == [node_url(n) for n in by_table.assigned]
        partitions_seen[name].add(by_table.partition)
    assert all(len(seen) == PARTITIONS for seen in partitions_seen.values())


def test_a_key_the_store_s_format_refuses_goes_to_the_router_which_says_why() -> None:
    partition_map = cluster_map()
    asked: list[str] = []
    transport = scripted_cluster(partition_map, asked)
    with Client("http://router", routing="direct", transport=transport, retries=0) as client:
        client.get("numbers", "not-a-number")
        client.get("nope", "k")
        assert asked == ["http://router:80", "http://router:80"]
        assert client.stats["via_router"] == 2 and client.stats["direct"] == 0


def found_entries(request: httpx.Request) -> dict[str, Any]:
    keys = json.loads(request.content)["keys"]
    return {
        "results": [
            {"key": k, "status": 200, "partition": 1, "version": 2, "value": {"k": k}, "offset": 40 + i}
            for i, k in enumerate(keys)
        ]
    }


def test_the_blocking_and_the_asyncio_client_answer_alike() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path.endswith("/batch-get"):
            return httpx.Response(200, json=found_entries(request))
        if path.endswith("/history"):
            cursor = request.url.params.get("cursor")
            body: dict[str, Any] = {"rows": [{"n": cursor or "0"}]}
            return httpx.Response(200, json=body if cursor else {**body, "next": "1"})
        if path.endswith("/missing"):
            return httpx.Response(404, json={"error": "key_not_found", "message": "no"})
        body = {"store": "s", "key": path.rsplit("/", 1)[1], "partition": 3, "version": 7, "value": 1}
        return httpx.Response(200, json=body, headers={"x-keyroute-node": "n1", "x-keyroute-offset": "9"})

    def blocking() -> list[Any]:
        with Client("http://kr", transport=httpx.MockTransport(handler)) as client:
            missing: Any
            try:
                client.get("s", "missing")
            except Exception as exc:  # noqa: BLE001 - compared below
                missing = (type(exc), str(exc))
            return [client.get("s", 42), client.get_many("s", ["x", b"\xff"]), list(client.history("s", "k")), missing]

    async def asynchronous() -> list[Any]:
        async with AsyncClient("http://kr", transport=httpx.MockTransport(handler)) as client:
            missing: Any
            try:
                await client.get("s", "missing")
            except Exception as exc:  # noqa: BLE001 - compared below
                missing = (type(exc), str(exc))
            rows = [row async for row in client.history("s", "k")]
            return [await client.get("s", 42), await client.get_many("s", ["x", b"\xff"]), rows, missing]

    answers = blocking()
    assert answers == asyncio.run(asynchronous())
    value, batch, rows, missing = answers
    assert (value.key, value.node, value.offset) == ("42", "n1", 9)
    assert [(v.key, v.offset) for v in batch] == [("x", 40), ("_w", 41)]  # a batch entry's own offset
    assert rows == [{"n": "0"}, {"n": "1"}]
    assert missing[0].__name__ == "KeyNotFound"
