"""Multi-store reads on a real cluster: three `keyroute node` processes and a `keyroute router`, three stores
co-located (`colocate_with`: partition p of each on the same replicas) and one that is not (another partition
count).

Every multi-store read, of one key or of many, through the router or straight at a node, equals what the
single-store reads of the same keys answer; a read of the co-located stores is answered by one node
(X-Keyroute-Node, X-Keyroute-Hops 0), in steady state and while a node joins and leaves."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from keyroute.client import AsyncClient, Client, KeyNotFound, KeyrouteError, Value
from keyroute.cluster import zk, zk_layout
from keyroute.cluster.partition_map import StoreRecord
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.runtime.settings import ZkSettings
from tests.harness import Member
from tests.integration.small_cluster import SmallCluster, small_cluster
from tests.integration.test_node import write_snapshot
from tests.util import free_port, wait_for

pytestmark = pytest.mark.integration

PARTITIONS = 4
KEYS = [f"P{i:02d}" for i in range(40)]
# Three co-located stores, each holding some of the keys, and one with another partition count.
STORES: dict[str, dict[str, dict[str, Any]]] = {
    "profile": {k: {"name": f"customer {k}", "tier": i % 3} for i, k in enumerate(KEYS)},
    "balance": {k: {"amount": i * 10.5, "currency": "NOK"} for i, k in enumerate(KEYS[:30])},
    "trips": {k: {"last": f"OSL-T{i}", "legs": {"n": i % 4}} for i, k in enumerate(KEYS[10:], 10)},
    "fares": {k: {"fare": i * 1.5} for i, k in enumerate(KEYS) if i % 2 == 0},
}
COLUMNS = {
    "profile": ("name", "tier"),
    "balance": ("amount", "currency"),
    "trips": ("last", "legs"),
    "fares": ("fare",),
}
PARTITIONS_OF = {"profile": PARTITIONS, "balance": PARTITIONS, "trips": PARTITIONS, "fares": 6}
COLOCATED = ("profile", "balance", "trips")
ALL = (*COLOCATED, "fares")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, module_zk_settings: ZkSettings) -> Iterator[SmallCluster]:
    tmp_path = tmp_path_factory.mktemp("multistore")
    with small_cluster(tmp_path, module_zk_settings, node_ids=("n1", "n2", "n3"), replication_factor=2) as c:
        client = zk.connect(module_zk_settings)
        try:
            for store, rows in STORES.items():
                snapshot = write_snapshot(tmp_path / store, store, rows, KeyFormat.STRING, PARTITIONS_OF[store])
                record = StoreRecord(
                    store,
                    PARTITIONS_OF[store],
                    Partitioner.MURMUR2,
                    KeyFormat.STRING,
                    1,
                    snapshot,
                    COLUMNS[store],
                    replication_factor=2,
                    colocate_with="profile" if store in ("balance", "trips") else None,
                )
                client.create(zk_layout.store_path(store), record.to_json(), makepath=True)
        finally:
            zk.close(client)

        def every_store_served() -> bool:
            return (
                all(
                    httpx.get(f"{c.router_url}/stores/{store}/keys/{next(iter(rows))}").status_code == 200
                    for store, rows in STORES.items()
                )
                and httpx.get(c.router_url + "/readyz").json().get("complete") is True
            )

        wait_for(every_store_served, timeout_s=90, interval_s=0.2, message="every store to be served")
        yield c


def single(url: str, store: str, key: str) -> httpx.Response:
    return httpx.get(f"{url}/stores/{store}/keys/{quote(key, safe='')}", timeout=10)


def assert_same(entry: dict[str, Any], one: httpx.Response, key: str) -> None:
    """A multi-store read's entry of a store says what the single read of the key in that store said."""
    body = one.json()
    assert entry["status"] == one.status_code, (key, entry, body)
    assert entry["key"] == key
    if one.status_code == 200:
        assert entry["value"] == body["value"]
        assert (entry["partition"], entry["version"]) == (body["partition"], body["version"])
        assert entry["node"]
    else:
        assert entry["error"] == body["error"], (entry, body)


def test_every_multi_store_read_equals_the_single_reads(cluster: SmallCluster) -> None:
    rng = random.Random(45)
    urls = [cluster.router_url, *cluster.node_urls.values()]
    for key in [*KEYS, "absent"]:
        singles = {store: single(cluster.router_url, store, key) for store in ALL}
        for url in urls:
            stores = list(ALL)
            rng.shuffle(stores)
            stores = stores[: rng.randint(1, len(stores))]
            answer = httpx.get(f"{url}/stores/{','.join(stores)}/read/{key}", timeout=10)
            assert answer.status_code == 200, answer.text
            body = answer.json()
            assert body["key"] == key
            assert list(body["stores"]) == stores  # in the order named
            for store in stores:
                assert_same(body["stores"][store], singles[store], key)


def test_a_batch_of_many_keys_equals_the_single_reads(cluster: SmallCluster) -> None:
    keys = [*KEYS, "absent", KEYS[3]]  # a key named twice has two results
    singles = {(store, key): single(cluster.router_url, store, key) for store in ALL for key in set(keys)}
    for url in [cluster.router_url, *cluster.node_urls.values()]:
        answer = httpx.post(f"{url}/stores/{','.join(ALL)}/read", json={"keys": keys}, timeout=30)
        assert answer.status_code == 200, answer.text
        results = answer.json()["results"]
        assert [r["key"] for r in results] == keys
        for result in results:
            assert list(result["stores"]) == list(ALL)
            for store, entry in result["stores"].items():
                assert_same(entry, singles[(store, result["key"])], result["key"])
        # Each store its own keys: one result per distinct key, with the stores that read it.
        asked = {"profile": KEYS[:5], "fares": KEYS[3:8], "trips": ["absent"]}
        answer = httpx.post(f"{url}/stores/{','.join(ALL)}/read", json={"keys": asked}, timeout=30)
        assert answer.status_code == 200, answer.text
        results = answer.json()["results"]
        assert [r["key"] for r in results] == [*KEYS[:8], "absent"]
        for result in results:
            named = [store for store, keys_of in asked.items() if result["key"] in keys_of]
            assert list(result["stores"]) == named
            for store in named:
                assert_same(result["stores"][store], singles[(store, result["key"])], result["key"])


def test_co_located_stores_are_read_from_one_node_in_one_hop(cluster: SmallCluster) -> None:
    stores = ",".join(COLOCATED)
    for key in KEYS:
        answer = httpx.get(f"{cluster.router_url}/stores/{stores}/read/{key}", timeout=10)
        assert answer.status_code == 200, answer.text
        node = answer.headers["x-keyroute-node"]
        assert answer.headers["x-keyroute-hops"] == "0", (key, answer.headers)
        found = [entry for entry in answer.json()["stores"].values() if entry["status"] == 200]
        assert found and all(entry["node"] == node for entry in found)
    # With the store that is not co-located, the read is put together from the nodes that serve each.
    answer = httpx.get(f"{cluster.router_url}/stores/{','.join(ALL)}/read/{KEYS[10]}", timeout=10)
    assert answer.status_code == 200 and answer.headers["x-keyroute-hops"] == "0"
    assert all(entry["status"] == 200 for entry in answer.json()["stores"].values())


def test_options_apply_per_store(cluster: SmallCluster) -> None:
    key = KEYS[12]
    answer = httpx.get(
        f"{cluster.router_url}/stores/profile,trips,fares/read/{key}?fields.trips=legs.n&fields.profile=name"
    )
    assert answer.status_code == 200, answer.text
    stores = answer.json()["stores"]
    assert stores["profile"]["value"] == {"name": STORES["profile"][key]["name"]}
    assert stores["trips"]["value"] == {"legs": {"n": STORES["trips"][key]["legs"]["n"]}}
    assert stores["fares"]["value"] == STORES["fares"][key]
    # `fields` for every store: a store without such a field is that store's 400 entry.
    stores = httpx.get(f"{cluster.router_url}/stores/profile,fares/read/{key}?fields=fare").json()["stores"]
    assert stores["fares"]["value"] == STORES["fares"][key]
    assert stores["profile"]["status"] == 400 and stores["profile"]["error"] == "unknown_fields"
    # min_offset is for live stores: the store's entry says not_live, as a get's answer would.
    stores = httpx.get(f"{cluster.router_url}/stores/profile,fares/read/{key}?min_offset=fares:3").json()["stores"]
    assert stores["fares"]["error"] == "not_live" and stores["profile"]["status"] == 200


@pytest.mark.parametrize(
    ("path", "word"),
    [
        ("/stores/profile,,fares/read/P01", "store names"),
        ("/stores/profile,profile/read/P01", "more than once"),
        ("/stores/profile/read/P01?min_offset=trips:3", "not one of the stores"),
        ("/stores/profile/read/P01?min_offset=3", "store:offset"),
        ("/stores/profile/read/P01?fields.trips=a", "not one of the stores"),
        ("/stores/profile/read/P01?nope=1", "unknown query parameter"),
    ],
)
def test_a_malformed_multi_store_read_is_a_400(cluster: SmallCluster, path: str, word: str) -> None:
    for url in [cluster.router_url, *cluster.node_urls.values()]:
        answer = httpx.get(url + path)
        assert answer.status_code == 400, (url, answer.text)
        assert answer.json()["error"] == "bad_request" and word in answer.json()["message"]


def test_an_unknown_store_is_its_own_entry(cluster: SmallCluster) -> None:
    for url in [cluster.router_url, *cluster.node_urls.values()]:
        stores = httpx.get(f"{url}/stores/profile,profiel/read/P01").json()["stores"]
        assert stores["profile"]["status"] == 200
        assert stores["profiel"]["status"] == 404 and stores["profiel"]["error"] == "store_not_found"
        assert "did you mean 'profile'" in stores["profiel"]["message"]


def check_values(values: dict[str, Value | KeyrouteError], key: str, stores: tuple[str, ...]) -> None:
    assert list(values) == list(stores)
    for store in stores:
        got = values[store]
        if key in STORES[store]:
            assert isinstance(got, Value) and got.value == STORES[store][key], (store, key, got)
            assert (got.store, got.key) == (store, key)
        else:
            assert isinstance(got, KeyNotFound), (store, key, got)


@pytest.mark.parametrize("routing", ["router", "direct"])
def test_the_client_reads_several_stores(cluster: SmallCluster, routing: str) -> None:
    with Client(cluster.router_url, routing=routing) as client:
        for key in KEYS[::7]:
            check_values(client.get_stores(key, ALL), key, ALL)
        keys = [*KEYS, "absent"]
        for key, values in zip(keys, client.get_many_stores(keys, ALL), strict=True):
            check_values(values, key, ALL)
        projected = client.get_stores(KEYS[12], ["profile", "trips"], fields={"trips": "last"})
        assert projected["trips"].value == {"last": STORES["trips"][KEYS[12]]["last"]}  # type: ignore[union-attr]
        assert projected["profile"].value == STORES["profile"][KEYS[12]]  # type: ignore[union-attr]


@pytest.mark.parametrize("routing", ["router", "direct"])
def test_the_async_client_reads_several_stores(cluster: SmallCluster, routing: str) -> None:
    async def reads() -> None:
        async with AsyncClient(cluster.router_url, routing=routing) as client:
            for key in KEYS[::9]:
                check_values(await client.get_stores(key, ALL), key, ALL)
            keys = KEYS[:12]
            for key, values in zip(keys, await client.get_many_stores(keys, COLOCATED), strict=True):
                check_values(values, key, COLOCATED)

    asyncio.run(reads())


def start_node(cluster: SmallCluster, tmp_path: Path, zk_settings: ZkSettings, node_id: str) -> Member:
    """Another node of the cluster, started as small_cluster starts its own."""
    port = free_port()
    args = ["node", "--zk", zk_settings.connect_string, "--node-id", node_id, "--port", str(port)]
    args += ["--data-dir", str(tmp_path / f"data-{node_id}"), "--zk-session-timeout-s", "4"]
    args += ["--version-grace-s", "1", "--drain-timeout-s", "5"]
    return Member(node_id, args, tmp_path / f"{node_id}.log", f"http://127.0.0.1:{port}").start()


def colocated_nodes(cluster: SmallCluster) -> set[str]:
    """The nodes serving any partition of the co-located stores (the router's view)."""
    view = httpx.get(
        cluster.router_admin_url + "/admin/partition-map?detail=all",
        headers={"authorization": "Bearer admin-t0ken"},
        timeout=10,
    ).json()
    return {
        serving["node"]
        for store in COLOCATED
        for entry in view["stores"][store]["partition_map"]
        for serving in entry["serving"]
    }


def test_reads_of_co_located_stores_take_one_hop_while_a_node_joins_and_leaves(
    cluster: SmallCluster, tmp_path: Path, module_zk_settings: ZkSettings
) -> None:
    stores = ",".join(COLOCATED)
    expected = {key: {s: STORES[s].get(key) for s in COLOCATED} for key in KEYS}
    failures: list[str] = []
    hops: dict[str, int] = {}
    nodes_seen: set[str] = set()
    reads = 0
    stop = threading.Event()

    def reader() -> None:
        nonlocal reads
        with httpx.Client(timeout=10) as http:
            while not stop.is_set():
                for key in KEYS:
                    answer = http.get(f"{cluster.router_url}/stores/{stores}/read/{key}")
                    reads += 1
                    try:
                        body = answer.json()
                        got = {s: e.get("value") if e["status"] == 200 else None for s, e in body["stores"].items()}
                        bad = [e for e in body["stores"].values() if e["status"] not in (200, 404)]
                    except (ValueError, KeyError) as exc:
                        failures.append(f"{key}: {answer.status_code} {answer.text[:200]} ({exc})")
                        continue
                    if answer.status_code != 200 or bad or got != expected[key]:
                        failures.append(f"{key}: {answer.status_code} {answer.text[:300]}")
                        continue
                    node = answer.headers.get("x-keyroute-node")
                    nodes_seen.add(node or "")
                    hop = answer.headers.get("x-keyroute-hops", "?")
                    hops[hop] = hops.get(hop, 0) + 1
                    found = [e for e in body["stores"].values() if e["status"] == 200]
                    if hop == "0" and (node is None or any(e["node"] != node for e in found)):
                        failures.append(f"{key}: not answered by one node: {answer.headers} {body}")

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    joining = start_node(cluster, tmp_path, module_zk_settings, "n4")
    try:
        wait_for(lambda: "n4" in colocated_nodes(cluster), timeout_s=90, interval_s=0.2, message="n4 to serve")
        wait_for(lambda: "n4" in nodes_seen, timeout_s=30, interval_s=0.1, message="reads answered by n4")
        seen = reads
        wait_for(lambda: reads > seen + 2 * len(KEYS), timeout_s=30, interval_s=0.05, message="more reads")
    finally:
        joining.stop()  # a planned leave: it drains, its partitions move back
    wait_for(lambda: "n4" not in colocated_nodes(cluster), timeout_s=90, interval_s=0.2, message="n4 to leave")
    seen = reads
    wait_for(lambda: reads > seen + 2 * len(KEYS), timeout_s=30, interval_s=0.05, message="reads after the leave")
    stop.set()
    thread.join(timeout=30)
    if failures:
        pytest.fail("\n".join(failures[:5]))
    assert reads > 4 * len(KEYS)
    # Every read was answered by one node, all of its stores; and in one hop, but for a read that met a map
    # change on its way (the node then passes it on once: hops 1, still answered).
    print("reads by hops:", hops)
    assert hops.get("0", 0) >= 0.95 * reads, hops


LIVE = "clicks"


def test_a_live_store_read_with_a_batch_store_equals_the_single_reads(tmp_path: Path, zk_settings: ZkSettings) -> None:
    """A live store (built by `keyroute pipeline build`, following librdkafka's mock broker) and a batch store
    co-located with it: every multi-store read, bounded per store by `min_offset`, carries the live store's
    offset and equals the single reads."""
    from confluent_kafka import Producer

    from keyroute.dev.kafka_mock import MockKafka
    from keyroute.keys.partitioner import partition_for
    from tests.util import Proc

    with MockKafka() as kafka:
        topic = f"clicks-{uuid.uuid4().hex[:8]}"
        kafka.create_topic(topic, PARTITIONS)
        spec = tmp_path / "stores.toml"
        spec.write_text(
            f"""
[stores.{LIVE}]
key = "user"
partitions = {PARTITIONS}
mode = "latest"
order_by = "ts"
columns = ["ts", "page"]

[stores.{LIVE}.live]
topic = "{topic}"
bootstrap_servers = "{kafka.bootstrap_servers}"
start = "earliest"
"""
        )
        connect = zk_settings.connect_string
        build = Proc(
            ["pipeline", "build", "--spec", str(spec), "--zk", connect, "--output", str(tmp_path / "snapshots"),
             "--master", "local[1]"],
            tmp_path / "pipeline.log",
        ).start()  # fmt: skip
        assert build.popen is not None
        try:
            assert build.popen.wait(timeout=280) == 0, build.output()[-6000:]
        finally:
            build.stop()
        users = {f"u{i:02d}": {"name": f"user {i}"} for i in range(0, 20, 2)}
        snapshot = write_snapshot(tmp_path / "users", "users", users, KeyFormat.STRING, PARTITIONS)
        record = StoreRecord(
            "users", PARTITIONS, Partitioner.MURMUR2, KeyFormat.STRING, 1, snapshot, ("name",), colocate_with=LIVE
        )
        client = zk.connect(zk_settings)
        try:
            client.create(zk_layout.store_path("users"), record.to_json(), makepath=True)
        finally:
            zk.close(client)

        procs: list[Proc] = []
        try:
            for node_id in ("n1", "n2"):
                args = ["node", "--zk", connect, "--node-id", node_id, "--port", str(free_port())]
                args += ["--data-dir", str(tmp_path / f"data-{node_id}"), "--zk-session-timeout-s", "4"]
                procs.append(Proc(args, tmp_path / f"{node_id}.log").start())
            port = free_port()
            procs.append(Proc(["router", "--zk", connect, "--port", str(port)], tmp_path / "router.log").start())
            router = f"http://127.0.0.1:{port}"
            wait_for(
                lambda: httpx.get(router + "/readyz", timeout=5).json().get("complete") is True,
                timeout_s=90,
                interval_s=0.2,
                message="the router to be ready",
            )

            def placed_together() -> bool:
                view = httpx.get(router + "/admin/partition-map?detail=all", timeout=10).json()["stores"]
                nodes = {
                    store: [sorted(e["node"] for e in entry["serving"]) for entry in view[store]["partition_map"]]
                    for store in (LIVE, "users")
                }
                return all(nodes[LIVE]) and nodes[LIVE] == nodes["users"]

            wait_for(placed_together, timeout_s=60, interval_s=0.2, message="the two stores placed together")
            producer = Producer({"bootstrap.servers": kafka.bootstrap_servers, "log_level": 3})
            offsets: dict[str, int] = {}

            def delivered(err: Any, msg: Any) -> None:
                assert err is None, err
                offsets[msg.key().decode()] = msg.offset()

            for i in range(20):
                user = f"u{i:02d}"
                p = partition_for(Partitioner.MURMUR2, user.encode(), PARTITIONS)
                value = {"ts": i, "page": f"/p{i}"}
                producer.produce(topic, key=user.encode(), value=json.dumps(value).encode(), partition=p,
                                 on_delivery=delivered)  # fmt: skip
            producer.flush(10)
            with httpx.Client(timeout=10) as http:
                for user, offset in offsets.items():
                    answer = http.get(f"{router}/stores/{LIVE},users/read/{user}?min_offset={LIVE}:{offset}")
                    assert answer.status_code == 200 and answer.headers["x-keyroute-hops"] == "0", answer.text
                    entries = answer.json()["stores"]
                    assert entries[LIVE]["offset"] >= offset and "offset" not in entries["users"]
                    for store, entry in entries.items():
                        assert_same(entry, single(router, store, user), user)
                keys = [*offsets, "absent"]
                results = http.post(f"{router}/stores/{LIVE},users/read", json={"keys": keys}).json()["results"]
                for result in results:
                    for store, entry in result["stores"].items():
                        assert_same(entry, single(router, store, result["key"]), result["key"])
                    assert result["stores"][LIVE]["offset"] >= 0
                # A bound no replica reaches is that store's 503 entry; the other store is answered.
                far = http.get(f"{router}/stores/{LIVE},users/read/u00?min_offset={LIVE}:{offsets['u00'] + 1000}")
                entries = far.json()["stores"]
                assert entries[LIVE]["status"] == 503 and entries[LIVE]["error"] == "not_up_to_bound"
                assert entries[LIVE]["offset"] >= offsets["u00"]
                assert entries["users"]["status"] == 200
        finally:
            for proc in procs:
                proc.stop()
