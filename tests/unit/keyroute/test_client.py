"""The client's pure logic over a scripted transport: how keys and times are sent, how answers and errors
become values and exceptions, retries on 503, and paging by cursor. (Against a real cluster: the
integration tests in tests/integration/test_timeline_reads.py.)"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from keyroute.client import (
    AsyncClient,
    BadKey,
    Client,
    ConnectionFailed,
    CursorExpired,
    Forbidden,
    KeyNotFound,
    KeyrouteError,
    StoreNotFound,
    Unavailable,
    Value,
    WrongStoreKind,
    key_segment,
    key_text,
    time_text,
)
from tests.util import free_port


def transport(handler: Callable[[httpx.Request], httpx.Response]) -> httpx.MockTransport:
    return httpx.MockTransport(handler)


def error(status: int, code: str, message: str = "m", **headers: str) -> httpx.Response:
    return httpx.Response(status, json={"error": code, "message": message}, headers=headers)


@pytest.mark.parametrize(
    ("key", "segment"),
    [
        ("a/b", "a%2Fb"),
        ("100%", "100%25"),
        ("東京", "%E6%9D%B1%E4%BA%AC"),
        (".", "%2E"),
        ("..", "%2E%2E"),
        (-(2**63), "-9223372036854775808"),
        (uuid.UUID(int=1), "00000000-0000-0000-0000-000000000001"),
        (b"\xff\x00", "_wA"),
    ],
)
def test_keys_are_sent_in_their_text_form_as_one_segment(key: Any, segment: str) -> None:
    assert key_segment(key) == segment


def test_what_is_not_a_key_or_a_time_is_refused() -> None:
    for bad in (True, 1.5, None):
        with pytest.raises(TypeError):
            key_text(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        time_text(1.5)  # type: ignore[arg-type]


def test_times() -> None:
    assert time_text(dt.datetime(2024, 6, 11, 10, 0)) == "2024-06-11T10:00:00+00:00"  # naive is UTC
    assert time_text(dt.datetime(2024, 6, 11, 12, tzinfo=dt.timezone(dt.timedelta(hours=2)))) == (
        "2024-06-11T12:00:00+02:00"
    )
    assert time_text(dt.date(2024, 6, 11)) == "2024-06-11"
    assert time_text(-5) == "-5"


def test_a_value_and_each_error_as_its_exception() -> None:
    answers = {
        "/stores/s/keys/k": httpx.Response(
            200,
            json={"store": "s", "key": "k", "partition": 3, "version": 7, "value": {"n": 1}},
            headers={"x-keyroute-node": "n1", "x-keyroute-offset": "41"},
        ),
        "/stores/s/keys/missing": error(404, "key_not_found"),
        "/stores/nope/keys/k": error(404, "store_not_found"),
        "/stores/s/keys/x": error(400, "bad_key"),
        "/stores/s/keys/k/history": error(400, "wrong_store_kind"),
        "/stores/s/keys/old/history": error(410, "cursor_expired"),
        "/stores/s/keys/teapot": error(418, "teapot"),
        "/stores/secret/keys/k": error(403, "forbidden", "'team-a' may not read store 'secret'"),
    }

    def handler(request: httpx.Request) -> httpx.Response:
        return answers[request.url.path]

    with Client("http://kr", transport=transport(handler)) as client:
        assert client.get("s", "k") == Value("s", "k", 3, 7, {"n": 1}, node="n1", offset=41)
        for key, store, kind in (("missing", "s", KeyNotFound), ("k", "nope", StoreNotFound), ("x", "s", BadKey)):
            with pytest.raises(kind) as raised:
                client.get(store, key)
            assert raised.value.status in (400, 404)
        with pytest.raises(WrongStoreKind):
            list(client.history("s", "k"))
        with pytest.raises(CursorExpired):
            list(client.history("s", "old"))
        with pytest.raises(KeyrouteError) as raised:
            client.get("s", "teapot")
        assert (raised.value.status, raised.value.code) == (418, "teapot")
        with pytest.raises(Forbidden) as refused:
            client.get("secret", "k")
        assert (refused.value.status, refused.value.code) == (403, "forbidden") and "secret" in refused.value.message


def test_the_public_surface_names_every_error() -> None:
    import keyroute.client
    from keyroute.client import _errors

    errors = {n for n, v in vars(_errors).items() if isinstance(v, type) and issubclass(v, _errors.KeyrouteError)}
    assert {"Forbidden", "Unauthorized", "KeyrouteError"} <= errors <= set(keyroute.client.__all__)
    assert keyroute.client.__all__ == sorted(keyroute.client.__all__)


def test_a_503_is_retried_after_its_retry_after_then_raised() -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path.endswith("/soon") and len(calls) < 3:
            return error(503, "partition_unavailable", **{"Retry-After": "0"})
        if request.url.path.endswith("/never"):
            return error(503, "overloaded", **{"Retry-After": "0"})
        return httpx.Response(200, json={"store": "s", "key": "soon", "partition": 0, "version": 1, "value": 1})

    with Client("http://kr", transport=transport(handler), retries=3, backoff_s=0) as client:
        assert client.get("s", "soon").value == 1
        assert len(calls) == 3
        calls.clear()
        with pytest.raises(Unavailable) as raised:
            client.get("s", "never")
        assert len(calls) == 4 and raised.value.retry_after == 0


def test_paged_reads_follow_cursors_with_the_same_parameters() -> None:
    seen: list[dict[str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        params = dict(request.url.params)
        seen.append(params)
        page = int(params.get("cursor", "0"))
        body: dict[str, Any] = {"store": "s", "key": "k", "partition": 0, "version": 1, "rows": [{"n": page}]}
        if page < 2:
            body["next"] = str(page + 1)
        return httpx.Response(200, json=body)

    with Client("http://kr", transport=transport(handler)) as client:
        rows = list(client.history("s", "k", start=dt.date(2024, 1, 1), end=5, order="desc", page_size=1))
    assert rows == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert [p.get("cursor") for p in seen] == [None, "1", "2"]
    assert all(p["from"] == "2024-01-01" and p["to"] == "5" and p["order"] == "desc" for p in seen)
    with pytest.raises(ValueError):
        list(Client("http://kr", transport=transport(handler)).history("s", "k", page_size=0))


def test_a_paged_read_sends_and_checks_nothing_until_iterated_and_only_in_its_clients_mode() -> None:
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, json={"store": "s", "keys": [{"key": "a", "partition": 0, "value": 1}]})

    with Client("http://kr", transport=transport(handler)) as client:
        pages = client.history("s", "k", page_size=0)  # checked when the first row is asked for
        with pytest.raises(ValueError, match="page_size"):
            next(iter(pages))
        ranged = client.range("s")
        assert sent == []
        with pytest.raises(TypeError, match="with `for`"):
            ranged.__aiter__()
        assert list(ranged) == [("a", 1)] and len(sent) == 1

    async def main() -> None:
        async with AsyncClient("http://kr", transport=httpx.MockTransport(handler)) as client:
            ranged = client.range("s")
            with pytest.raises(TypeError, match="with `async for`"):
                iter(ranged)
            assert [kv async for kv in ranged] == [("a", 1)] and len(sent) == 2

    asyncio.run(main())


def test_the_async_client_reads_the_same_way() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path.endswith("/batch-get"):
            keys = json.loads(request.content)["keys"]
            return httpx.Response(
                200,
                json={
                    "results": [
                        {"key": keys[0], "status": 200, "partition": 1, "version": 2, "value": {"a": 1}},
                        {"key": keys[1], "status": 404, "error": "key_not_found", "message": "no"},
                    ]
                },
            )
        if path.endswith("/range"):
            cursor = request.url.params.get("cursor")
            keys = [{"key": "b", "partition": 0, "value": 2}] if cursor else [{"key": "a", "partition": 1, "value": 1}]
            return httpx.Response(200, json={"store": "s", "keys": keys, **({} if cursor else {"next": "c"})})
        return error(404, "not_found")

    async def main() -> None:
        async with AsyncClient("http://kr", transport=httpx.MockTransport(handler)) as client:
            found, missing = await client.get_many("s", ["x", 7])
            assert isinstance(found, Value) and found.value == {"a": 1} and found.partition == 1
            assert isinstance(missing, KeyNotFound)
            assert [kv async for kv in client.range("s", prefix="a")] == [("a", 1), ("b", 2)]

    asyncio.run(main())


def partition_map(generation: int, serving: dict[int, list[str]], partitions: int = 4) -> dict[str, Any]:
    return {
        "generation": generation,
        "stores": {
            "s": {
                "partitions": partitions,
                "partitioner": "murmur2",
                "key_format": "string",
                "partition_map": [
                    {"partition": p, "serving": [{"node": u, "url": u, "version": 1} for u in serving.get(p, [])]}
                    for p in range(partitions)
                ],
            }
        },
    }


def routing(generation: int, serving: dict[int, list[str]], partitions: int = 4) -> dict[str, Any]:
    """The router's routing view (GET /routing) of store `s`: per partition the URLs serving it."""
    nodes = sorted({u for urls in serving.values() for u in urls})
    return {
        "format": 1,
        "generation": generation,
        "store_names": ["s"],
        "nodes": [[u, u] for u in nodes],
        "stores": {
            "s": {
                "partitions": partitions,
                "partitioner": "murmur2",
                "key_format": "string",
                "version": 1,
                "replicas": [[nodes.index(u) for u in serving.get(p, [])] for p in range(partitions)],
                "versions": {},
            }
        },
    }


def found(key: str, **headers: str) -> httpx.Response:
    body = {"store": "s", "key": key, "partition": 0, "version": 1, "value": {"k": key}}
    return httpx.Response(200, json=body, headers=headers)


def test_direct_routing_goes_to_the_partition_s_node_and_fails_over_and_falls_back() -> None:
    from keyroute.keys.partitioner import Partitioner, partition_for

    key = "C000042"
    partition = partition_for(Partitioner.MURMUR2, key.encode(), 4)
    asked: list[str] = []
    answered_generation = ["1"]
    serving = {partition: ["http://n1", "http://n2"]}

    def handler(request: httpx.Request) -> httpx.Response:
        where = f"{request.url.scheme}://{request.url.host}"
        asked.append(where + request.url.path)
        if request.url.path == "/routing":
            return httpx.Response(200, json=routing(1, serving))
        if where == "http://n1":
            raise httpx.ConnectError("refused", request=request)
        if where == "http://n2":
            return found(key, **{"x-keyroute-generation": answered_generation[0]})
        return found(key)  # the router

    with Client("http://router", routing="direct", transport=transport(handler)) as client:
        client.map_reload_min_s = 0.0
        path = f"/stores/s/keys/{key}"
        assert client.get("s", key).value == {"k": key}
        assert asked == ["http://router/routing", "http://n1" + path, "http://n2" + path]
        assert client.stats["failovers"] == 1 and client.stats["direct"] == 1
        # The failure made the map be read again; n1 is held back a while, so n2 is asked first.
        asked.clear()
        client.get("s", key)
        assert asked == ["http://router/routing", "http://n2" + path]
        assert client.stats["misroutes"] == 0
        # An answer routed with a newer map (or forwarded) makes the next read re-read the map.
        answered_generation[0] = "7"
        asked.clear()
        client.get("s", key)
        assert asked == ["http://n2" + path] and client.stats["misroutes"] == 1
        asked.clear()
        answered_generation[0] = "1"
        client.get("s", key)
        assert asked == ["http://router/routing", "http://n2" + path]
        # No node serves the partition: the router answers (a map of any age is read again from now on).
        serving.clear()
        client.map_max_age_s = 0.0
        asked.clear()
        assert client.get("s", key).value == {"k": key}
        assert asked == ["http://router/routing", "http://router" + path]
        assert client.stats["via_router"] == 1


def test_direct_get_many_sends_one_batch_per_node_and_the_rest_to_the_router() -> None:
    from keyroute.keys.partitioner import Partitioner, partition_for

    keys = [f"k{i}" for i in range(12)]
    node_of = {p: f"http://n{p % 2}" for p in range(4)}
    batches: dict[str, list[str]] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        where = f"{request.url.scheme}://{request.url.host}"
        if request.url.path == "/routing":
            return httpx.Response(200, json=routing(1, {p: [u] for p, u in node_of.items() if p != 3}))
        asked = json.loads(request.content)["keys"]
        batches[where] = asked
        results = []
        for key in asked:
            if where == "http://n1" and key == asked[0]:
                results.append({"key": key, "status": 503, "error": "partition_unavailable", "message": "m"})
            else:
                results.append({"key": key, "status": 200, "partition": 0, "version": 1, "value": {"at": where}})
        return httpx.Response(200, json={"results": results})

    async def main() -> None:
        async with AsyncClient("http://router", routing="direct", transport=httpx.MockTransport(handler)) as client:
            found = await client.get_many("s", keys)
            assert [f.key for f in found if isinstance(f, Value)] == keys
            partition = {k: partition_for(Partitioner.MURMUR2, k.encode(), 4) for k in keys}
            for node in ("http://n0", "http://n1"):
                assert batches[node] == [k for k in keys if partition[k] != 3 and node_of[partition[k]] == node]
            # Partition 3 has no node in the map, and n1's 503 key: both through the router.
            retried = batches["http://n1"][0]
            assert batches["http://router"] == [k for k in keys if partition[k] == 3 or k == retried]
            assert client.stats["direct"] + client.stats["via_router"] == len(keys)

    asyncio.run(main())


def test_nothing_listening_is_a_keyroute_error_not_httpx_s() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with Client(url, retries=1, backoff_s=0) as client, pytest.raises(ConnectionFailed) as raised:
        client.get("s", "k")
    assert isinstance(raised.value, Unavailable) and isinstance(raised.value, KeyrouteError)
    assert (raised.value.status, raised.value.code) == (0, "connection_failed")
    assert str(raised.value).startswith(f"connection_failed: no answer from {url} (2 attempts): ConnectError")
    assert isinstance(raised.value.__cause__, httpx.ConnectError)

    async def main() -> None:
        async with AsyncClient(url, retries=0) as client:
            with pytest.raises(ConnectionFailed) as raised:
                await client.get_many("s", ["k"])
            assert isinstance(raised.value.__cause__, httpx.ConnectError)
            with pytest.raises(ConnectionFailed):
                [row async for row in client.history("s", "k")]

    asyncio.run(main())


def test_router_mode_counts_its_reads_and_get_many_says_which_node_answered() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/batch-get"):
            keys = json.loads(request.content)["keys"]
            entries = [{"key": k, "status": 200, "partition": 0, "version": 1, "node": "n2", "value": 1} for k in keys]
            return httpx.Response(200, json={"results": entries})
        return found(request.url.path.rsplit("/", 1)[-1], **{"x-keyroute-node": "n1"})

    with Client("http://kr", transport=transport(handler)) as client:
        assert client.get("s", "a").node == "n1"
        results = client.get_many("s", ["b", "c"])
        assert [r.node for r in results if isinstance(r, Value)] == ["n2", "n2"]
        assert client.stats == {"direct": 0, "via_router": 3, "map_loads": 0, "misroutes": 0, "failovers": 0}

    async def main() -> None:
        async with AsyncClient("http://kr", transport=httpx.MockTransport(handler)) as client:
            [one] = await client.get_many("s", ["b"])
            assert isinstance(one, Value) and one.node == "n2"
            await client.get("s", "a")
            assert client.stats["via_router"] == 2

    asyncio.run(main())


def test_direct_routing_refreshes_one_store_after_a_misroute_and_asks_what_changed_since_its_map() -> None:
    from keyroute.keys.partitioner import Partitioner, partition_for

    key = "C000042"
    partition = partition_for(Partitioner.MURMUR2, key.encode(), 4)
    asked: list[str] = []
    hops = ["0"]
    etag = '"g1.a1"'

    def handler(request: httpx.Request) -> httpx.Response:
        where = f"{request.url.scheme}://{request.url.host}"
        asked.append(where + request.url.path + ("?" + request.url.query.decode() if request.url.query else ""))
        if request.url.path == "/routing":
            if request.headers.get("if-none-match") == etag:
                return httpx.Response(304, headers={"etag": etag})
            return httpx.Response(200, json=routing(1, {partition: ["http://n1"]}), headers={"etag": etag})
        return found(key, **{"x-keyroute-hops": hops[0]})

    with Client("http://router", routing="direct", transport=transport(handler)) as client:
        client.map_reload_min_s = 0.0
        client.get("s", key)
        assert asked[0] == "http://router/routing" and asked[1].startswith("http://n1/")
        # A forwarded answer: the next read re-reads that store alone.
        hops[0] = "1"
        client.get("s", key)
        hops[0] = "0"
        asked.clear()
        client.get("s", key)
        assert asked[0] == "http://router/routing?store=s" and asked[1].startswith("http://n1/")
        assert client.stats["misroutes"] == 1
        # The map grown old: what changed since its generation, with its ETag; a 304 keeps the map.
        client.map_max_age_s = 0.0
        asked.clear()
        client.get("s", key)
        assert asked[0] == "http://router/routing?since=1" and asked[1].startswith("http://n1/")
        assert client._map is not None and "s" in client._map.stores


def test_direct_routing_reads_the_whole_map_of_a_router_without_a_routing_view() -> None:
    from keyroute.keys.partitioner import Partitioner, partition_for

    key = "C000042"
    partition = partition_for(Partitioner.MURMUR2, key.encode(), 4)
    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        where = f"{request.url.scheme}://{request.url.host}"
        asked.append(where + request.url.path)
        if request.url.path == "/routing":
            return httpx.Response(404, json={"error": "not_found", "message": "Not Found"})
        if request.url.path == "/admin/partition-map":
            assert request.url.params["detail"] == "all"
            return httpx.Response(200, json=partition_map(1, {partition: ["http://n1"]}))
        return found(key)

    with Client("http://router", routing="direct", transport=transport(handler)) as client:
        client.map_reload_min_s = 0.0
        client.get("s", key)
        client.get("s", key)
        path = f"/stores/s/keys/{key}"
        assert asked == [
            "http://router/routing",
            "http://router" + path,
            "http://router/admin/partition-map",
            "http://n1" + path,
        ]


def test_a_routing_view_gives_each_partition_its_replicas_at_the_version_they_serve() -> None:
    from keyroute.client._base import _DirectMap

    doc = routing(3, {0: ["http://n1", "http://n2"], 1: ["http://n2"]})
    doc["stores"]["s"]["versions"] = {"1": 7}
    direct = _DirectMap.of_routing(doc, None)
    locator = direct.stores["s"]
    assert [(ep.node_id, ep.url, ep.version) for ep in locator.serving[0]] == [
        ("http://n1", "http://n1", 1),
        ("http://n2", "http://n2", 1),
    ]
    assert [ep.version for ep in locator.serving[1]] == [7] and locator.serving[2] == ()
    # A partial view keeps the other stores the router still names, and drops those it does not.
    other = {**doc, "stores": {}, "store_names": ["s"], "generation": 4}
    assert _DirectMap.of_routing(other, direct).stores["s"] is locator
    assert _DirectMap.of_routing({**other, "store_names": []}, direct).stores == {}


def test_direct_routing_serializes_schema_registry_keys_with_the_recorded_schema() -> None:
    from keyroute.client._base import _DirectMap
    from keyroute.keys.key_format import KeyFormat, parse_key
    from keyroute.keys.key_schema import KeySchema
    from keyroute.keys.partitioner import Partitioner, partition_for

    record = '{"type":"record","name":"K","fields":[{"name":"region","type":"string"},{"name":"id","type":"long"}]}'
    schema = KeySchema(KeyFormat.AVRO, 41, record)
    doc = routing(1, {p: ["http://n1"] for p in range(7)}, partitions=7)
    doc["stores"]["s"]["key_format"] = "avro"
    doc["stores"]["s"]["key_schema"] = schema.to_dict()
    direct = _DirectMap.of_routing(doc, None)
    for i in range(30):
        key = {"region": "eu", "id": i}
        location = direct.locate("s", key)
        assert location is not None
        data = parse_key(KeyFormat.AVRO, key_text(key), schema).data
        assert data[:5] == b"\x00\x00\x00\x00\x29"  # the producer's framing: magic byte and schema id 41
        assert location.partition == partition_for(Partitioner.MURMUR2, data, 7)
    # A key that does not fit is the router's to judge (its 400 names the field).
    assert direct.locate("s", {"region": "eu"}) is None


def test_the_client_asks_for_avro_when_told_and_returns_the_same_values() -> None:
    from keyroute.formats.avro_answers import SCHEMA_ID, encode_answer

    value = {"fare": 12.5, "n": 2**64, "seats": [1, 2], "note": None, "ok": True}
    found = {"store": "s", "key": "k", "partition": 1, "version": 3, "value": value}
    rows = {"store": "s", "key": "k", "partition": 1, "version": 3, "rows": [{"ts": "2024-06-01", "v": 1}]}
    batch = {
        "results": [
            {"key": "k", "status": 200, "partition": 1, "version": 3, "node": "n1", "value": value},
            {"key": "x", "status": 404, "error": "key_not_found", "message": "gone"},
        ]
    }
    windows = {**rows, "windows": [{"start": "2024-06-01", "end": "2024-06-02", "value": {"n": 2, "sum": 0.5}}]}
    del windows["rows"]
    asked: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        accept = request.headers.get("accept")
        asked.append(accept)
        path = request.url.path
        if path.endswith("/missing"):
            return error(404, "key_not_found")  # errors are JSON whatever was asked
        answer = batch if path.endswith("batch-get") else rows if path.endswith("/history") else found
        if path.endswith("/windows"):
            answer = windows
        if accept == "application/avro":
            headers = {"content-type": "application/avro", "x-keyroute-schema-id": SCHEMA_ID}
            return httpx.Response(200, content=encode_answer(answer), headers=headers)
        return httpx.Response(200, json=answer)

    with Client("http://router", transport=transport(handler), answer_format="avro") as client:
        got = client.get("s", "k")
        assert got == Value("s", "k", 1, 3, value) and type(got.value["n"]) is int
        assert asked[-1] == "application/avro"
        assert list(client.history("s", "k")) == rows["rows"]
        hit, miss = client.get_many("s", ["k", "x"])
        assert hit == Value("s", "k", 1, 3, value, node="n1") and isinstance(miss, KeyNotFound)
        with pytest.raises(KeyNotFound):
            client.get("s", "missing")
        assert set(asked) == {"application/avro"}
        assert client.get("s", "k", answer_format="json") == got  # per read
        assert asked[-1] == "application/json"
    with Client("http://router", transport=transport(handler)) as client:
        assert client.get("s", "k", answer_format="avro") == got
        assert asked[-1] == "application/avro"
        assert client.get("s", "k") == got and asked[-1] == "application/json"
        assert list(client.windows("s", "k", answer_format="avro")) == windows["windows"]
        assert asked[-1] == "application/avro"
        assert list(client.history("s", "k", answer_format="avro")) == rows["rows"]
        assert asked[-1] == "application/avro"
        with pytest.raises(ValueError, match="answer_format"):
            client.get("s", "k", answer_format="xml")
        with pytest.raises(TypeError):
            list(client.windows("s", "k", answer_fromat="avro"))
    with pytest.raises(ValueError, match="answer_format"):
        Client("http://router", answer_format="protobuf")

    async def read_async() -> list[Any]:
        async with AsyncClient("http://router", transport=transport(handler), answer_format="avro") as client:
            return [await client.get("s", "k"), [r async for r in client.history("s", "k")]]

    assert asyncio.run(read_async()) == [got, rows["rows"]]
