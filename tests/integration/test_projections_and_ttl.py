"""Projections and time to live on a real cluster.

`fields=` on get, batch-get and range reads through a `keyroute router` process and straight at `keyroute
node` processes (which pass a read on, projection and all, to the node holding its key) answers exactly the
asked fields of every value, in fewer bytes; unknown fields are a 400 naming them.

A store with a `ttl` serves the values younger than it and answers 404 `expired` for the others (by the
nodes' own clocks: the values are decades either side of the boundary), in gets, batch-gets and ranges; the
partition map shows the ttl."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from keyroute.client import BadRequest, Client, KeyNotFound
from keyroute.cluster import zk, zk_layout
from keyroute.cluster.partition_map import StoreRecord
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.runtime.settings import ZkSettings
from keyroute.storage.ttl import Ttl
from tests.integration.small_cluster import SmallCluster, small_cluster
from tests.integration.test_node import write_snapshot
from tests.util import wait_for

pytestmark = pytest.mark.integration

STORE = "profiles"
PARTITIONS = 4
COLUMNS = ("name", "fare", "trip", "notes")
PROFILES: dict[str, dict[str, Any]] = {
    f"P{i:02d}": {
        "name": f"customer {i}",
        "fare": i * 2.5,
        "trip": {"from": "OSL", "to": f"T{i}", "legs": {"n": i % 3}},
        "notes": "x" * 200,
    }
    for i in range(24)
}

EXPIRING = "features"
# Served until 2100, and expired since the 1990s: whatever the clock of the machine running the test.
FRESH = {f"F{i:02d}": {"at": "2100-01-01T00:00:00.000Z", "n": i} for i in range(10)}
STALE = {
    **{f"S{i:02d}": {"at": "1990-01-01T00:00:00.000Z", "n": i} for i in range(8)},
    "S_ms": {"at": 631152000000, "n": 99},  # 1990 in milliseconds since the epoch
}
TIMED = {**FRESH, **STALE}


def partition(key: str) -> int:
    return partition_for(Partitioner.MURMUR2, key.encode(), PARTITIONS)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, module_zk_settings: ZkSettings) -> Iterator[SmallCluster]:
    tmp_path = tmp_path_factory.mktemp("projections")
    with small_cluster(tmp_path, module_zk_settings) as c:
        snapshot = write_snapshot(tmp_path / "profiles", STORE, PROFILES, KeyFormat.STRING, PARTITIONS)
        record = StoreRecord(STORE, PARTITIONS, Partitioner.MURMUR2, KeyFormat.STRING, 1, snapshot, COLUMNS)
        expiring = write_snapshot(tmp_path / "expiring", EXPIRING, TIMED, KeyFormat.STRING, PARTITIONS)
        ttl = Ttl.parse("30 days", "at")
        expiring_record = StoreRecord(
            EXPIRING,
            PARTITIONS,
            Partitioner.MURMUR2,
            KeyFormat.STRING,
            1,
            expiring,
            ("at", "n"),
            ttl=ttl,
            colocate_with=STORE,
        )
        client = zk.connect(module_zk_settings)
        try:
            client.create(zk_layout.store_path(STORE), record.to_json(), makepath=True)
            client.create(zk_layout.store_path(EXPIRING), expiring_record.to_json(), makepath=True)
        finally:
            zk.close(client)

        def every_key_answers() -> bool:
            return all(
                httpx.get(f"{c.router_url}/stores/{STORE}/keys/{k}").status_code == 200 for k in PROFILES
            ) and all(httpx.get(f"{c.router_url}/stores/{EXPIRING}/keys/{k}").status_code == 200 for k in FRESH)

        wait_for(every_key_answers, timeout_s=60, interval_s=0.2, message="the profiles store to be served")
        yield c


def holder(cluster: SmallCluster, key: str) -> str:
    view = httpx.get(
        cluster.router_admin_url + "/admin/partition-map?detail=all",
        headers={"authorization": "Bearer admin-t0ken"},
    ).json()
    return view["stores"][STORE]["partition_map"][partition(key)]["serving"][0]["node"]


def test_a_get_answers_only_the_fields_through_the_router_and_from_either_node(cluster: SmallCluster) -> None:
    for key, value in PROFILES.items():
        whole = httpx.get(f"{cluster.router_url}/stores/{STORE}/keys/{key}")
        answer = httpx.get(f"{cluster.router_url}/stores/{STORE}/keys/{key}", params={"fields": "fare,trip.to"})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["value"] == {"fare": value["fare"], "trip": {"to": value["trip"]["to"]}}
        assert {k: v for k, v in body.items() if k != "value"} == {
            k: v for k, v in whole.json().items() if k != "value"
        }
        assert len(answer.content) < len(whole.content) / 3
    # Asked of a node that does not hold the key: it passes the read on with its projection.
    key = next(iter(PROFILES))
    other = next(n for n in cluster.node_urls if n != holder(cluster, key))
    answer = httpx.get(f"{cluster.node_urls[other]}/stores/{STORE}/keys/{key}?fields=trip.legs.n,name")
    assert answer.status_code == 200 and answer.headers["x-keyroute-hops"] == "1"
    assert answer.json()["value"] == {"trip": {"legs": {"n": 0}}, "name": "customer 0"}


def test_a_bounded_read_keeps_its_projection(cluster: SmallCluster) -> None:
    # min_offset is for live stores: the node's 400 not_live shows both parameters reached it.
    answer = httpx.get(f"{cluster.router_url}/stores/{STORE}/keys/P01?fields=fare&min_offset=3")
    assert answer.status_code == 400 and answer.json()["error"] == "not_live"


def test_a_batch_get_projects_every_found_key(cluster: SmallCluster) -> None:
    keys = [*PROFILES, "absent"]
    urls = [cluster.router_url, *cluster.node_urls.values()]  # a node passes the others' keys on
    for url in urls:
        answer = httpx.post(f"{url}/stores/{STORE}/batch-get?fields=name,trip.from", json={"keys": keys})
        assert answer.status_code == 200, answer.text
        results = answer.json()["results"]
        for key, entry in zip(keys, results, strict=True):
            if key == "absent":
                assert entry["status"] == 404
                continue
            assert entry["status"] == 200, entry
            assert entry["value"] == {"name": PROFILES[key]["name"], "trip": {"from": "OSL"}}


def test_a_range_read_projects_every_key(cluster: SmallCluster) -> None:
    answer = httpx.get(f"{cluster.router_url}/stores/{STORE}/range", params={"limit": 100, "fields": "fare"})
    assert answer.status_code == 200, answer.text
    keys = answer.json()["keys"]
    assert sorted(k["key"] for k in keys) == sorted(PROFILES)
    assert all(k["value"] == {"fare": PROFILES[k["key"]]["fare"]} for k in keys)


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", f"/stores/{STORE}/keys/P01?fields=fare,nope,trip.x", None),
        ("POST", f"/stores/{STORE}/batch-get?fields=fare,nope,trip.x", {"keys": ["P01"]}),
        ("GET", f"/stores/{STORE}/range?fields=fare,nope,trip.x", None),
    ],
)
def test_unknown_fields_are_a_400_naming_them(cluster: SmallCluster, method: str, path: str, body: Any) -> None:
    for url in [cluster.router_url, *cluster.node_urls.values()]:
        if "/range" in path and url != cluster.router_url:
            continue  # a node's range is per partition
        answer = httpx.request(method, url + path, json=body)
        assert answer.status_code == 400, (url, answer.text)
        error = answer.json()
        assert error["error"] == "unknown_fields" and "'nope'" in error["message"], error
        assert "'fare'" not in error["message"]


def test_a_malformed_projection_is_a_bad_request(cluster: SmallCluster) -> None:
    answer = httpx.get(f"{cluster.router_url}/stores/{STORE}/keys/P01?fields=a..b")
    assert answer.status_code == 400 and answer.json()["error"] == "bad_request"


@pytest.mark.parametrize("routing", ["router", "direct"])
def test_the_client_asks_for_fields(cluster: SmallCluster, routing: str) -> None:
    with Client(cluster.router_url, routing=routing) as client:
        key = "P07"
        assert client.get(STORE, key, fields=["name", "trip.legs.n"]).value == {
            "name": "customer 7",
            "trip": {"legs": {"n": 1}},
        }
        assert client.get(STORE, key, fields="fare").value == {"fare": PROFILES[key]["fare"]}
        values = client.get_many(STORE, list(PROFILES), fields=("fare",))
        assert [v.value for v in values] == [{"fare": p["fare"]} for p in PROFILES.values()]  # type: ignore[union-attr]
        ranged = dict(client.range(STORE, page_size=5, fields="trip.to"))
        assert ranged == {k: {"trip": {"to": p["trip"]["to"]}} for k, p in PROFILES.items()}
        with pytest.raises(BadRequest, match="nope"):
            client.get(STORE, key, fields="nope")


def test_a_value_past_its_ttl_is_404_expired_and_younger_ones_are_served(cluster: SmallCluster) -> None:
    for url in [cluster.router_url, *cluster.node_urls.values()]:
        for key, value in FRESH.items():
            answer = httpx.get(f"{url}/stores/{EXPIRING}/keys/{key}")
            assert answer.status_code == 200 and answer.json()["value"] == value, answer.text
        for key in STALE:
            answer = httpx.get(f"{url}/stores/{EXPIRING}/keys/{key}")
            assert answer.status_code == 404, answer.text
            assert answer.json()["error"] == "expired" and "30 days" in answer.json()["message"]
        keys = [*TIMED, "absent"]
        results = httpx.post(f"{url}/stores/{EXPIRING}/batch-get", json={"keys": keys}).json()["results"]
        got = {e["key"]: (e["status"], e.get("error")) for e in results}
        assert got == {
            **{k: (200, None) for k in FRESH},
            **{k: (404, "expired") for k in STALE},
            "absent": (404, "key_not_found"),
        }


def test_a_range_leaves_expired_values_out_and_the_map_shows_the_ttl(cluster: SmallCluster) -> None:
    answer = httpx.get(f"{cluster.router_url}/stores/{EXPIRING}/range", params={"limit": 100, "fields": "n"})
    assert answer.status_code == 200, answer.text
    assert {k["key"]: k["value"] for k in answer.json()["keys"]} == {k: {"n": v["n"]} for k, v in FRESH.items()}
    view = httpx.get(
        cluster.router_admin_url + "/admin/partition-map?detail=all",
        headers={"authorization": "Bearer admin-t0ken"},
    ).json()
    assert view["stores"][EXPIRING]["ttl"] == "30 days"
    assert "ttl" not in view["stores"][STORE]
    with Client(cluster.router_url) as client:
        with pytest.raises(KeyNotFound) as raised:  # no value to serve, as for a key never written
            client.get(EXPIRING, "S00")
        assert raised.value.code == "expired"


def test_colocated_stores_are_placed_on_the_same_replicas(cluster: SmallCluster) -> None:
    # The features store names the profiles store in its record: partition p of both on the same node.
    view = httpx.get(
        cluster.router_admin_url + "/admin/partition-map?detail=all",
        headers={"authorization": "Bearer admin-t0ken"},
    ).json()
    stores = view["stores"]
    assert stores[EXPIRING]["colocate_with"] == STORE
    assert stores[EXPIRING]["colocation_group"] == stores[STORE]["colocation_group"] == EXPIRING
    profiles = [entry["assigned"] for entry in stores[STORE]["partition_map"]]
    features = [entry["assigned"] for entry in stores[EXPIRING]["partition_map"]]
    assert profiles == features
    assert {n for assigned in profiles for n in assigned} == set(cluster.node_urls)  # both nodes used
    # Each key of both stores is answered by one node, in one hop.
    for key in FRESH:
        a = httpx.get(f"{cluster.router_url}/stores/{STORE}/keys/{key}")
        b = httpx.get(f"{cluster.router_url}/stores/{EXPIRING}/keys/{key}")
        assert b.status_code == 200 and a.status_code == 404
        assert a.headers["x-keyroute-node"] == b.headers["x-keyroute-node"]
