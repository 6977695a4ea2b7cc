"""The router's views of its map (router/map_views.py): the summary, filtered detail, the whole document as
`PartitionMap.describe()` gives it, the routing view; ETag and If-None-Match, the long poll, and bad
parameters. Over HTTP against a router on 127.0.0.1 (tests.unit.router.test_app.router)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import httpx

from keyroute.cluster.cluster_policy import ClusterPolicy, PolicyCheck
from keyroute.cluster.live_status import LiveStatus, LiveStatusReader, annotate
from keyroute.cluster.partition_map import Assignment, NodeRecord, PartitionMap, ServingRecord, StoreRecord
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.router.app import create_app
from keyroute.router.map_views import HEAT_CELLS, MapViews, Views
from tests.unit.router.fakes import FakeCluster, StaticMapSource, node_url
from tests.unit.router.test_app import SETTINGS, router, router_server, run
from tests.util import wait_until


def store(name: str, partitions: int, rf: int = 1, version: int = 2, live: bool = False) -> StoreRecord:
    return StoreRecord(
        name, partitions, Partitioner.MURMUR2, KeyFormat.STRING, version, f"/s/{name}", ("v",), rf, 1.0, live=live
    )


def cluster_map(generation: int = 7, partitions: int = 8) -> PartitionMap:
    """Store `a` (rf 2): p0 unserved, p1 loading (an older version only), p2 served by one node of two
    (under-replicated), the rest by both. Store `b` (rf 1): all served by n3. Node n4 is assigned a
    partition but not registered (gone); n2 is leaving."""
    a, b = store("a", partitions, rf=2), store("b", 4)
    assignment = Assignment(
        3,
        {
            "a": tuple(("n1", "n2") for _ in range(partitions)),
            "b": (("n3",), ("n3",), ("n3",), ("n4",)),
        },
    )
    serving = {
        "n1": ServingRecord("n1", node_url("n1"), {"a": {1: 1, **{p: 2 for p in range(2, partitions)}}}),
        "n2": ServingRecord("n2", node_url("n2"), {"a": {p: 2 for p in range(3, partitions)}}),
        "n3": ServingRecord("n3", node_url("n3"), {"b": {p: 2 for p in range(4)}}),
    }
    nodes = {
        "n1": NodeRecord("n1", node_url("n1"), zone="z1"),
        "n2": NodeRecord("n2", node_url("n2"), leaving=True),
        "n3": NodeRecord("n3", node_url("n3")),
    }
    return PartitionMap.build({"a": a, "b": b}, nodes, assignment, serving, generation=generation, built_at=100.0)


def views_of(m: PartitionMap, status: LiveStatus | None = None, now: float = 130.0) -> Views:
    return Views(m, status or LiveStatus({}, 0.0), '"x"', now, MapViews(LiveStatusReader(lambda: None)))


def test_the_whole_document_is_todays_describe_field_by_field() -> None:
    m = cluster_map()
    full = json.loads(views_of(m).full())
    reference = {**m.describe(now=130.0), "router": True}
    assert full == reference
    assert full["age_s"] == 30.0 and full["stores"]["a"]["partition_map"][3]["serving"][1]["node"] == "n2"
    # A live store with a replica's report: annotated as today's endpoint did.
    live_map = PartitionMap.build({"l": store("l", 2, live=True)}, {}, Assignment(1), {}, generation=3)
    report = {"stores": {"l": {"1": {"version": 2, "offset": 5, "lag_records": 4, "state": "catching_up"}}}}
    status = LiveStatus({"n1": {**report, "updated_at": 120.0}}, 1.0)
    reference = {**live_map.describe(now=130.0), "router": True}
    annotate(reference, live_map, status, now=130.0)
    assert json.loads(views_of(live_map, status).full()) == reference
    assert reference["stores"]["l"]["partition_map"][1]["live"][0]["lag_records"] == 4


def test_the_summary_counts_states_per_store_and_node_and_puts_problems_first() -> None:
    summary = json.loads(views_of(cluster_map()).summary())
    assert summary["view"] == "summary" and summary["generation"] == 7 and summary["assignment_generation"] == 3
    assert summary["age_s"] == 30.0 and summary["stale"] is False and summary["complete"] is False
    a = summary["stores"]["a"]
    assert (a["unserved"], a["loading"], a["under_replicated"], a["served"]) == (1, 1, 1, 5)
    assert a["versions_served"] == [1, 2] and a["heat"] == "ulrsssss"
    assert summary["stores"]["b"]["served"] == 4 and "live" not in summary["stores"]["b"]
    assert summary["nodes"]["n1"] == {"url": node_url("n1"), "zone": "z1", "state": "up", "assigned": 8, "serving": 7}
    assert summary["nodes"]["n2"]["state"] == "leaving" and summary["nodes"]["n2"]["serving"] == 5
    assert summary["nodes"]["n4"] == {"url": None, "zone": None, "state": "gone", "assigned": 1, "serving": 0}
    assert summary["totals"] == {
        "stores": 2,
        "nodes": 3,
        "nodes_leaving": 1,
        "nodes_gone": 1,
        "partitions": 12,
        "unserved": 1,
        "loading": 1,
        "under_replicated": 1,
        "served": 9,
        "lagging": 0,
    }
    assert summary["problems"] == [
        {"store": "a", "state": "unserved", "partitions": 1},
        {"store": "a", "state": "loading", "partitions": 1},
        {"store": "a", "state": "under_replicated", "partitions": 1},
        {"node": "n4", "state": "gone"},
        {"node": "n2", "state": "leaving"},
    ]


def test_the_summary_does_not_grow_with_partitions_and_says_live_lag() -> None:
    small = views_of(cluster_map(partitions=200)).summary()
    large = views_of(cluster_map(partitions=20_000)).summary()
    assert abs(len(large) - len(small)) < 40  # digits of counts only
    assert len(json.loads(large)["stores"]["a"]["heat"]) == HEAT_CELLS
    live_map = PartitionMap.build({"l": store("l", 100, live=True)}, {}, Assignment(1), {}, generation=3)
    reports = {str(p): {"version": 2, "lag_records": p, "lag_ms": 10 * p, "state": "live"} for p in range(100)}
    reports["7"]["state"] = "stalled"
    status = LiveStatus({"n1": {"stores": {"l": reports}, "updated_at": 1.0}}, 1.0)
    entry = json.loads(views_of(live_map, status).summary())["stores"]["l"]
    assert entry["live"] is True and entry["lagging"] == 1
    assert (entry["lag_records_max"], entry["lag_records_p99"], entry["lag_ms_max"]) == (99, 98, 990)


async def _get(client: httpx.AsyncClient, path: str, **params: Any) -> httpx.Response:
    return await client.get(path, params=params)


def test_filters_and_pages_select_partitions_on_the_server() -> None:
    async def scenario() -> None:
        async with router(cluster_map(partitions=50)) as r:
            c = r.client
            body = (await _get(c, "/admin/partition-map", store="a", state="unserved")).json()
            assert body["view"] == "detail" and body["matched"] == 1
            assert body["partitions"] == [
                {"store": "a", "partition": 0, "state": "unserved", "assigned": ["n1", "n2"], "serving": []}
            ]
            loading = (await _get(c, "/admin/partition-map", state="loading")).json()["partitions"]
            assert [(e["store"], e["partition"], e["serving"][0]["version"]) for e in loading] == [("a", 1, 1)]
            on_n4 = (await _get(c, "/admin/partition-map", node="n4")).json()["partitions"]
            assert [(e["store"], e["partition"], e["state"]) for e in on_n4] == [("b", 3, "served")]
            one = (await _get(c, "/admin/partition-map", partition="2")).json()["partitions"]
            assert [(e["store"], e["state"]) for e in one] == [("a", "under_replicated"), ("b", "served")]
            assert (await _get(c, "/admin/partition-map", store="a", partition="60")).json()["matched"] == 0
            # Pages: every partition of n1 exactly once, in order, across pages of 7.
            seen, params = [], {"node": "n1", "limit": "7"}
            while True:
                page = (await _get(c, "/admin/partition-map", **params)).json()
                assert len(page["partitions"]) <= 7 and page["matched"] == 50
                seen += [(e["store"], e["partition"]) for e in page["partitions"]]
                if "next" not in page:
                    break
                params = {**params, "cursor": page["next"]}
            assert seen == [("a", p) for p in range(50)]

    run(scenario)


def test_a_bad_parameter_is_a_400_naming_it() -> None:
    async def scenario() -> None:
        async with router(cluster_map()) as r:
            for params, named in [
                ({"state": "broken"}, "state"),
                ({"limit": "0"}, "limit"),
                ({"limit": "x"}, "limit"),
                ({"partition": "-1"}, "partition"),
                ({"cursor": "zz"}, "cursor"),
                ({"detail": "some"}, "detail"),
                ({"detail": "all", "store": "a"}, "detail=all"),
                ({"stor": "a"}, "stor"),
                ({"since": "1", "wait_s": "600"}, "wait_s"),
                ({"wait_s": "1"}, "since"),
                ({"since": "-3"}, "since"),
            ]:
                answer = await r.client.get("/admin/partition-map", params=params)
                assert answer.status_code == 400, params
                assert answer.json()["error"] == "bad_request" and f"'{named}'" in answer.json()["message"], params
            repeated = await r.client.get("/admin/partition-map?store=a&store=b")
            assert repeated.status_code == 400 and "'store'" in repeated.json()["message"]
            bad = await r.client.get("/routing", params={"since": "x"})
            assert bad.status_code == 400 and "'since'" in bad.json()["message"]
            # And everything else keeps working.
            assert (await r.client.get("/admin/partition-map")).status_code == 200

    run(scenario)


def test_every_view_carries_an_etag_and_a_repeated_request_is_a_304_until_the_map_changes() -> None:
    async def scenario() -> None:
        async with router(cluster_map()) as r:
            for params in ({}, {"detail": "all"}, {"store": "a"}):
                first = await r.client.get("/admin/partition-map", params=params)
                etag = first.headers["etag"]
                assert first.status_code == 200 and etag == '"g7.a3"', params
                assert float(first.headers["x-keyroute-map-age-s"]) >= 0
                again = await r.client.get("/admin/partition-map", params=params, headers={"if-none-match": etag})
                assert again.status_code == 304 and again.content == b"" and again.headers["etag"] == etag
            full = await r.client.get("/admin/partition-map", params={"detail": "all"})
            reference = {**cluster_map().describe(), "router": True, "policy": PolicyCheck().describe()}
            assert {k: v for k, v in full.json().items() if k != "age_s"} == {
                k: v for k, v in reference.items() if k != "age_s"
            }
            await r.push(cluster_map(generation=8))
            changed = await r.client.get("/admin/partition-map", headers={"if-none-match": '"g7.a3"'})
            assert changed.status_code == 200 and changed.json()["generation"] == 8
            assert changed.headers["etag"] == '"g8.a3"'
            await r.push(cluster_map(generation=8).marked_stale(True))
            stale = await r.client.get("/admin/partition-map", headers={"if-none-match": '"g8.a3"'})
            assert stale.status_code == 200 and stale.headers["etag"] == '"g8.a3.s"' and stale.json()["stale"]

    run(scenario)


def test_a_long_poll_answers_when_the_map_passes_the_generation_or_at_its_timeout() -> None:
    async def scenario() -> None:
        async with router(cluster_map()) as r:
            # Already past: at once.
            past = await r.client.get("/admin/partition-map", params={"since": "6", "wait_s": "30"})
            assert past.status_code == 200 and past.json()["generation"] == 7
            # Nothing new: 304 at the timeout (with the ETag), the same body without one.
            tag = {"if-none-match": '"g7.a3"'}
            quiet = await r.client.get("/admin/partition-map", params={"since": "7", "wait_s": "0.2"}, headers=tag)
            assert quiet.status_code == 304
            same = await r.client.get("/admin/partition-map", params={"since": "7", "wait_s": "0.2"})
            assert same.status_code == 200 and same.json()["generation"] == 7
            waiting = asyncio.ensure_future(
                r.client.get("/admin/partition-map", params={"since": "7", "wait_s": "30"}, headers=tag)
            )
            views: MapViews = r.app.state.map_views
            await wait_until(lambda: views.long_polls == 1, message="the long poll waiting")
            assert not waiting.done()
            await r.push(cluster_map(generation=9))
            answer = await asyncio.wait_for(waiting, 10)
            assert answer.status_code == 200 and answer.json()["generation"] == 9

    run(scenario)


def test_the_map_shows_the_cluster_policy_and_a_router_that_does_not_meet_it_serves_no_read() -> None:
    async def scenario() -> None:
        source = StaticMapSource(cluster_map())
        app = create_app(SETTINGS, map_source=source, upstream=FakeCluster().upstream())
        server = router_server(app, SETTINGS)
        await server.start(port=0)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", trust_env=False) as client:
                first = await client.get("/admin/partition-map")
                assert first.json()["policy"] == PolicyCheck().describe()  # no record: nothing asked
                assert (first.json()["policy"]["recorded"], first.json()["policy"]["satisfied"]) == (False, True)
                watch = app.state.policy
                tightened = ClusterPolicy(require_tls=frozenset({"zookeeper"})).to_json()
                check = PolicyCheck.of(tightened, watch.member)
                watch.check, watch.version = check, 1  # as the watch's read of a changed record sets them
                watch.on_change(check)  # and tells, from ZooKeeper's thread
                await wait_until(lambda: app.state.admission.withheld is not None, message="reads withheld")
                shown = await client.get("/admin/partition-map", headers={"if-none-match": first.headers["etag"]})
                assert shown.status_code == 200 and shown.headers["etag"] == '"g7.a3.p1"'
                policy = shown.json()["policy"]
                assert (policy["require_tls"], policy["satisfied"]) == (["zookeeper"], False)
                assert policy["unmet"] == ["TLS to ZooKeeper: set --zk-tls-ca"]
                read = await client.get("/stores/a/keys/k")
                assert read.status_code == 503 and read.json()["error"] == "policy_not_satisfied"
                assert read.json()["message"] == "the cluster policy requires TLS to ZooKeeper: set --zk-tls-ca"
                ready = await client.get("/readyz")
                assert ready.status_code == 503 and ready.json()["reason"] == read.json()["message"]
                assert (await client.get("/admin/partition-map")).status_code == 200  # admin still answers
        finally:
            await server.stop(grace_s=5)

    run(scenario)


def test_a_long_poll_ends_when_its_client_goes_away() -> None:
    async def scenario() -> None:
        source = StaticMapSource(cluster_map())
        app = create_app(SETTINGS, map_source=source, upstream=FakeCluster().upstream())
        server = router_server(app, SETTINGS)
        await server.start(port=0)
        try:
            views: MapViews = app.state.map_views
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", trust_env=False) as client:
                waiting = asyncio.ensure_future(
                    client.get("/admin/partition-map", params={"since": "7", "wait_s": "60"})
                )
                await wait_until(lambda: views.long_polls == 1, message="the poll waits")
                waiting.cancel()  # closes the connection
                await wait_until(lambda: views.long_polls == 0, message="the poll ends with its client")
                assert (await client.get("/admin/partition-map")).status_code == 200
        finally:
            await server.stop(grace_s=5)

    run(scenario)


def test_the_routing_view_names_nodes_by_index_and_gives_only_changed_stores_since_a_generation() -> None:
    async def scenario() -> None:
        m = cluster_map()
        async with router(m) as r:
            answer = await r.client.get("/routing")
            doc = answer.json()
            assert answer.status_code == 200 and answer.headers["etag"] == '"g7.a3"'
            assert doc["format"] == 1 and doc["generation"] == 7 and doc["store_names"] == ["a", "b"]
            nodes = doc["nodes"]
            a = doc["stores"]["a"]
            assert (a["partitions"], a["partitioner"], a["key_format"], a["version"]) == (8, "murmur2", "string", 2)
            for p in range(8):
                assert [nodes[i][0] for i in a["replicas"][p]] == [ep.node_id for ep in m.serving_endpoints("a", p)]
                assert [nodes[i][1] for i in a["replicas"][p]] == [ep.url for ep in m.serving_endpoints("a", p)]
            assert a["versions"] == {"1": 1}  # p1: served at an older version only
            same = await r.client.get("/routing", headers={"if-none-match": answer.headers["etag"]})
            assert same.status_code == 304
            # One node's serving record changes store b only: `since` gives b alone.
            serving = dict(m.serving)
            serving["n3"] = ServingRecord("n3", node_url("n3"), {"b": {0: 2, 1: 2}})
            changed = PartitionMap.build(m.stores, m.nodes, m.assignment, serving, generation=8)
            b_only = MapViewsProbe.derive(m, changed)
            await r.push(b_only)
            delta = (await r.client.get("/routing", params={"since": "7"})).json()
            assert delta["since"] == 7 and list(delta["stores"]) == ["b"] and delta["store_names"] == ["a", "b"]
            assert [len(reps) for reps in delta["stores"]["b"]["replicas"]] == [1, 1, 0, 0]
            nothing = (await r.client.get("/routing", params={"since": "8"})).json()
            assert nothing["stores"] == {} and nothing["nodes"] == [] and nothing["store_names"] == ["a", "b"]
            # Older than the router knows: everything, without `since`.
            everything = (await r.client.get("/routing", params={"since": "2"})).json()
            assert "since" not in everything and sorted(everything["stores"]) == ["a", "b"]
            one = (await r.client.get("/routing", params=[("store", "a"), ("store", "nope")])).json()
            assert list(one["stores"]) == ["a"]

    run(scenario)


class MapViewsProbe:
    @staticmethod
    def derive(old: PartitionMap, new: PartitionMap) -> PartitionMap:
        """`new` with `old`'s very routes for the stores whose routes did not change (as MapBuilder keeps
        them), so the views see which stores changed as they do in production."""
        routes = {
            name: old.routes[name] if old.routes.get(name) == new.routes.get(name) else new.routes[name]
            for name in new.routes
        }
        return dataclasses.replace(new, routes=routes)


def test_each_view_is_built_once_per_map_and_never_on_the_event_loop(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import threading

    built: list[tuple[str, int]] = []
    for name in ("_make_summary", "_make_detail"):
        original = getattr(Views, name)

        def spy(self, *args, _original=original, _name=name):  # type: ignore[no-untyped-def]
            built.append((_name, threading.get_ident()))
            return _original(self, *args)

        monkeypatch.setattr(Views, name, spy)

    async def scenario() -> None:
        loop_thread = threading.get_ident()
        async with router(cluster_map()) as r:
            for _ in range(3):
                assert (await r.client.get("/admin/partition-map")).status_code == 200
                assert (await r.client.get("/admin/partition-map", params={"store": "a"})).status_code == 200
            assert [name for name, _ in built] == ["_make_summary", "_make_detail"]
            await r.push(cluster_map(generation=8))
            assert (await r.client.get("/admin/partition-map")).json()["generation"] == 8
            assert [name for name, _ in built] == ["_make_summary", "_make_detail", "_make_summary"]
            assert all(thread != loop_thread for _, thread in built)

    run(scenario)
