"""History and windows reads and key ranges, all real: events -> Spark pipeline -> ZooKeeper -> two `keyroute node`
processes -> a `keyroute router` process -> HTTP. Every key's rows and windows answer in one hop with
exactly what a plain-Python computation over the same events expects, page by page through cursors; bad
queries get their 400, a cursor of a version no longer served its 410.

The module's tests share one build and one cluster (`cluster`); the one that publishes a new version runs
last."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pyarrow as pa
import pytest

from keyroute.cluster import zk, zk_layout
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.runtime.settings import ZkSettings
from keyroute.storage.ranges import make_range_cursor
from keyroute.storage.timeline import make_cursor
from tests.integration.test_pipeline import write_spec
from tests.integration.test_timeline_pipeline import bookings, expected_windows, micros, write_parquet
from tests.util import Proc, free_port, wait_for

pytestmark = pytest.mark.integration

PARTITIONS = 3
MINUTE = 60_000_000
KEYS = [f"C{i:03d}" for i in range(12)] + ["a/b", "東京", "C00", "C0", "C00\x00", "Z"]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
ACCOUNT_IDS = [INT64_MIN, INT64_MAX, -1, 0, 1, 255, 256, -256, -(2**31)] + random.Random(4).sample(
    range(-(10**12), 10**12), 30
)
ACCOUNTS = [{"acct": a, "seq": n, "fare": n * 3} for n, a in enumerate(ACCOUNT_IDS * 2)]
ACCOUNTS_SCHEMA = pa.schema([("acct", pa.int64()), ("seq", pa.int64()), ("fare", pa.int64())])


@dataclass
class Cluster:
    router_url: str
    node_urls: dict[str, str]
    rows: list[dict[str, Any]]
    spec: Path
    output: Path
    zk: ZkSettings


def path(store: str, key: str, read: str | None = None) -> str:
    tail = "" if read is None else f"/{read}"
    return f"/stores/{store}/keys/{quote(key, safe='')}{tail}"


def iso(us: int) -> str:
    return (dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(microseconds=us)).isoformat()


def build_stores(cluster_zk: ZkSettings, spark: Any, spec: Path, output: Path) -> list[Any]:
    from keyroute.pipeline.build import build

    return build(spec, cluster_zk, str(output), spark=spark)


@contextlib.contextmanager
def running_cluster(tmp_path: Path, zk_settings: ZkSettings, spark: Any) -> Iterator[Cluster]:
    """The stores built by Spark in `zk_settings`' chroot, served by two nodes behind a router."""
    rows = bookings(random.Random(21), KEYS, 400)
    source = write_parquet(tmp_path / "events", rows)
    accounts = write_parquet(tmp_path / "accounts", ACCOUNTS, ACCOUNTS_SCHEMA)
    common = {"source": str(source), "format": "parquet", "key": "customer", "partitions": PARTITIONS}
    spec = write_spec(
        tmp_path / "stores.toml",
        {
            "trips": {**common, "mode": "history", "order_by": "ts", "columns": ["seq", "fare"]},
            "per10": {
                **common,
                "mode": "windowed",
                "order_by": "ts",
                "window": "10 minutes",
                "aggregations": {"n": "count(*)", "total": "sum(fare)"},
            },
            "latest": {**common, "mode": "latest", "order_by": "seq", "columns": ["fare"]},
            "accounts": {
                "source": str(accounts),
                "format": "parquet",
                "key": "acct",
                "key_format": "int64",
                "partitions": 4,
                "mode": "latest",
                "order_by": "seq",
            },
        },
    )
    build_stores(zk_settings, spark, spec, tmp_path / "snapshots")
    zk = zk_settings.connect_string
    procs: list[Proc] = []
    node_urls: dict[str, str] = {}
    try:
        for i in range(2):
            port = free_port()
            node_id = f"node-{i}"
            procs.append(
                Proc(
                    ["node", "--zk", zk, "--node-id", node_id, "--port", str(port),
                     "--data-dir", str(tmp_path / node_id), "--zk-session-timeout-s", "4"],
                    tmp_path / f"{node_id}.log",
                ).start()
            )  # fmt: skip
            node_urls[node_id] = f"http://127.0.0.1:{port}"
        router_port = free_port()
        procs.append(Proc(["router", "--zk", zk, "--port", str(router_port)], tmp_path / "router.log").start())
        router_url = f"http://127.0.0.1:{router_port}"

        def settled() -> bool:
            pmap = httpx.get(router_url + "/admin/partition-map?detail=all").json()
            placed: set[str] = set()
            for store in pmap["stores"].values():
                for entry in store["partition_map"]:
                    serving = {s["node"] for s in entry["serving"] if s["version"] == store["version"]}
                    if not entry["assigned"] or serving != set(entry["assigned"]):
                        return False
                    placed.update(serving)
            return len(pmap["stores"]) == 4 and len(placed) == 2

        wait_for(settled, timeout_s=120, message="every partition served where assigned, by both nodes")
        yield Cluster(router_url, node_urls, rows, spec, tmp_path / "snapshots", zk_settings)
    finally:
        for proc in reversed(procs):
            proc.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, module_zk_settings: ZkSettings, spark: Any) -> Iterator[Cluster]:
    """One build and one cluster for the module: its tests read, and the last one publishes a new version."""
    with running_cluster(tmp_path_factory.mktemp("timeline-reads"), module_zk_settings, spark) as c:
        yield c


def cursor_key(settings: ZkSettings) -> bytes:
    """The cluster's cursor key, read from ZooKeeper as its members read it."""
    client = zk.connect(settings, ensure_layout=False)
    try:
        key, _ = client.get(zk_layout.CURSOR_KEY)
    finally:
        zk.close(client)
    assert len(key) == 32
    return bytes(key)


def expected_history(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """The key's rows as a history answer lists them: time order, ties in the order of their JSON."""
    mine = [{"ts": r["ts"], "seq": r["seq"], "fare": r["fare"]} for r in rows if r["customer"] == key]
    return sorted(mine, key=lambda r: (r["ts"], json.dumps(r, separators=(",", ":"))))


def rows_of(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [{**row, "ts": micros(row["ts"])} for row in body["rows"]]


def test_history_reads_answer_every_row_in_one_hop_page_by_page(cluster: Cluster) -> None:
    with httpx.Client(base_url=cluster.router_url, timeout=10) as client:
        for key in KEYS:
            expected = expected_history(cluster.rows, key)
            assert expected, key
            resp = client.get(path("trips", key, "history"), params={"limit": "10000"})
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-keyroute-hops"] == "0"
            body = resp.json()
            partition = partition_for(Partitioner.MURMUR2, key.encode(), PARTITIONS)
            assert (body["store"], body["key"], body["partition"], body["version"]) == ("trips", key, partition, 1)
            assert "next" not in body
            assert rows_of(body) == expected

            # A time range, newest first, three rows a page.
            low, high = expected[len(expected) // 4]["ts"], expected[3 * len(expected) // 4]["ts"]
            wanted = [r for r in expected if low <= r["ts"] < high][::-1]
            params = {"from": iso(low), "to": iso(high).replace("+00:00", "Z"), "order": "desc", "limit": "3"}
            got: list[dict[str, Any]] = []
            pages = 0
            while True:
                page = client.get(path("trips", key, "history"), params=params)
                assert page.status_code == 200, page.text
                got += rows_of(page.json())
                pages += 1
                if "next" not in page.json():
                    break
                params = {**params, "cursor": page.json()["next"]}
            assert [r["ts"] for r in got] == [r["ts"] for r in wanted]
            assert sorted(got, key=lambda r: r["seq"]) == sorted(wanted, key=lambda r: r["seq"])
            assert pages == max(1, -(-len(wanted) // 3))

            # A get of a history store's key is its latest row.
            latest = client.get(path("trips", key))
            assert latest.status_code == 200
            assert latest.json()["value"]["ts"] and micros(latest.json()["value"]["ts"]) == expected[-1]["ts"]


def test_windows_reads_answer_the_windows_that_overlap_the_range(cluster: Cluster) -> None:
    size = 10 * MINUTE
    windows = expected_windows(cluster.rows, lambda r: r["ts"], size, size)
    from keyroute.storage.timeline import key_part

    with httpx.Client(base_url=cluster.router_url, timeout=10) as client:
        for key in KEYS:
            expected = windows[key_part(key.encode())]
            resp = client.get(path("per10", key, "windows"))
            assert resp.status_code == 200, resp.text
            got = [(micros(w["start"]), micros(w["end"]), w["value"]) for w in resp.json()["windows"]]
            assert got == [(start, start + size, agg) for start, agg in expected]
            # [from, to) overlapping: a window that starts before `from` but ends after it is in.
            low = expected[0][0] + size // 2
            high = expected[-1][0]
            inside = client.get(path("per10", key, "windows"), params={"from": iso(low), "to": iso(high)})
            assert [micros(w["start"]) for w in inside.json()["windows"]] == [
                start for start, _ in expected if start + size > low and start < high
            ]


def test_history_and_windows_reads_answer_only_the_asked_fields(cluster: Cluster) -> None:
    from keyroute.client import Client

    size = 10 * MINUTE
    windows = expected_windows(cluster.rows, lambda r: r["ts"], size, size)
    from keyroute.storage.timeline import key_part

    urls = [cluster.router_url, *cluster.node_urls.values()]  # a node passes on what it does not hold
    for key in KEYS[:4]:
        expected = expected_history(cluster.rows, key)
        for url in urls:
            resp = httpx.get(url + path("trips", key, "history"), params={"limit": "10000", "fields": "fare"})
            assert resp.status_code == 200, resp.text
            assert resp.json()["rows"] == [{"fare": r["fare"]} for r in expected]
            resp = httpx.get(url + path("per10", key, "windows"), params={"fields": "total"})
            assert resp.status_code == 200, resp.text
            got = [(micros(w["start"]), w["value"]) for w in resp.json()["windows"]]
            assert got == [(start, {"total": agg["total"]}) for start, agg in windows[key_part(key.encode())]]
        with Client(cluster.router_url) as client:
            rows = list(client.history("trips", key, page_size=3, fields=["seq", "ts"]))
            assert [(micros(r["ts"]), r["seq"]) for r in rows] == [(r["ts"], r["seq"]) for r in expected]
            assert all(set(r) == {"seq", "ts"} for r in rows)
    for read, store in (("history", "trips"), ("windows", "per10")):
        resp = httpx.get(cluster.router_url + path(store, KEYS[0], read), params={"fields": "fare,nope"})
        assert resp.status_code == 400 and resp.json()["error"] == "unknown_fields", resp.text
        assert "'nope'" in resp.json()["message"]


def test_bad_timeline_queries_get_a_400_that_says_which(cluster: Cluster) -> None:
    with httpx.Client(base_url=cluster.router_url, timeout=10) as client:
        history = path("trips", "C001", "history")
        first = client.get(history, params={"limit": "1"}).json()
        cursor = first["next"]
        cases: list[tuple[str, dict[str, str], int, str, str]] = [
            (history, {"from": "2024-06-11T11:00:00Z", "to": "2024-06-11T10:00:00Z"}, 400, "bad_request", "after"),
            (history, {"from": "yesterday"}, 400, "bad_request", "ISO 8601"),
            (history, {"limit": "0"}, 400, "bad_request", "limit"),
            (history, {"limit": "10001"}, 400, "bad_request", "limit"),
            (history, {"order": "sideways"}, 400, "bad_request", "order"),
            (history, {"since": "1"}, 400, "bad_request", "unknown query parameter 'since'"),
            (history, {"cursor": "not-a-cursor"}, 400, "bad_cursor", "malformed"),
            (history, {"cursor": cursor[:-2] + ("AA" if cursor[-2:] != "AA" else "BB")}, 400, "bad_cursor", ""),
            (path("trips", "C002", "history"), {"cursor": cursor}, 400, "bad_cursor", "another"),
            (history, {"cursor": cursor, "order": "desc"}, 400, "bad_cursor", "another"),
            (path("latest", "C001", "history"), {}, 400, "wrong_store_kind", "one value per key"),
            (path("trips", "C001", "windows"), {}, 400, "wrong_store_kind", "history store"),
            (path("per10", "C001", "history"), {}, 400, "wrong_store_kind", "windowed store"),
            (path("nope", "C001", "history"), {}, 404, "store_not_found", ""),
            (history, {"min_offset": "5"}, 400, "not_live", ""),
            (history, {"min_offset": "-1"}, 400, "bad_request", "min_offset"),
        ]
        for url, params, status, code, words in cases:
            resp = client.get(url, params=params)
            assert (resp.status_code, resp.json()["error"]) == (status, code), (url, params, resp.text)
            assert words in resp.json()["message"], (url, params, resp.text)
        # A cursor signed with anything but the cluster's key is refused, whatever it says: one signed with the
        # empty key (what a cluster without a secret once signed with) too.
        query = ("trips", "C001", "history", None, None, "asc")
        forged = client.get(history, params={"cursor": make_cursor(b"", query, 1, (0, 0))})
        assert (forged.status_code, forged.json()["error"]) == (400, "bad_cursor"), forged.text
        # A cursor made for version 1 but tagged right is refused by version, not by tag: 410 only once the
        # version is gone (see below); a cursor naming another version is 410 now.
        other = make_cursor(cursor_key(cluster.zk), query, 7, (0, 0))
        gone = client.get(history, params={"cursor": other})
        assert (gone.status_code, gone.json()["error"]) == (410, "cursor_expired")
        # Everything else still answers.
        assert client.get(history).status_code == 200


def read_range(client: httpx.Client, store: str, params: dict[str, str]) -> tuple[list[dict[str, Any]], int]:
    """Every key of a range read, page by page; and the number of pages."""
    keys: list[dict[str, Any]] = []
    pages = 0
    while True:
        resp = client.get(f"/stores/{store}/range", params=params)
        assert resp.status_code == 200, resp.text
        pages += 1
        keys += resp.json()["keys"]
        if "next" not in resp.json():
            return keys, pages
        params = {**params, "cursor": resp.json()["next"]}


def test_range_reads_merge_every_partition_in_the_store_s_key_order(cluster: Cluster) -> None:
    latest_fare: dict[str, tuple[int, int]] = {}
    for row in cluster.rows:
        if row["customer"] not in latest_fare or row["seq"] > latest_fare[row["customer"]][0]:
            latest_fare[row["customer"]] = (row["seq"], row["fare"])
    by_bytes = sorted(latest_fare, key=lambda k: k.encode("utf-8"))
    with httpx.Client(base_url=cluster.router_url, timeout=10) as client:
        keys, pages = read_range(client, "latest", {"limit": "4"})
        assert [k["key"] for k in keys] == by_bytes
        assert [k["value"] for k in keys] == [{"fare": latest_fare[k][1]} for k in by_bytes]
        assert all(k["partition"] == partition_for(Partitioner.MURMUR2, k["key"].encode(), PARTITIONS) for k in keys)
        assert pages == -(-len(by_bytes) // 4)

        low, high = "C003", "C009"
        keys, _ = read_range(client, "latest", {"from_key": low, "to_key": high, "limit": "2"})
        assert [k["key"] for k in keys] == [k for k in by_bytes if low.encode() <= k.encode() < high.encode()]
        keys, _ = read_range(client, "latest", {"prefix": "C00", "limit": "3"})
        assert [k["key"] for k in keys] == [k for k in by_bytes if k.startswith("C00")]
        assert "C00" in [k["key"] for k in keys] and "C00\x00" in [k["key"] for k in keys]

        # Integer keys in numeric order, negative ones first; pages across both halves.
        numeric = sorted(set(ACCOUNT_IDS))
        keys, _ = read_range(client, "accounts", {"limit": "7"})
        assert [int(k["key"]) for k in keys] == numeric
        last = {a: r["fare"] for r in ACCOUNTS for a in [r["acct"]]}
        assert [k["value"]["fare"] for k in keys] == [last[a] for a in numeric]
        keys, _ = read_range(client, "accounts", {"from_key": "-256", "to_key": "256", "limit": "2"})
        assert [int(k["key"]) for k in keys] == [a for a in numeric if -256 <= a < 256]
        keys, _ = read_range(client, "accounts", {"from_key": str(INT64_MIN), "to_key": "0"})
        assert [int(k["key"]) for k in keys] == [a for a in numeric if a < 0]

        # A history store's range: each key with its latest row.
        keys, _ = read_range(client, "trips", {"limit": "5"})
        assert [k["key"] for k in keys] == by_bytes
        for entry in keys:
            assert micros(entry["value"]["ts"]) == expected_history(cluster.rows, entry["key"])[-1]["ts"]


def test_bad_range_queries_get_a_400_that_says_which(cluster: Cluster) -> None:
    with httpx.Client(base_url=cluster.router_url, timeout=10) as client:
        cursor = client.get("/stores/latest/range", params={"limit": "1"}).json()["next"]
        cases: list[tuple[str, dict[str, str], int, str, str]] = [
            ("latest", {"from_key": "b", "to_key": "a"}, 400, "bad_request", "after"),
            ("accounts", {"from_key": "ten"}, 400, "bad_key", "from_key"),
            ("accounts", {"from_key": "5", "to_key": "-5"}, 400, "bad_request", "after"),
            ("accounts", {"prefix": "1"}, 400, "bad_request", "string keys"),
            ("latest", {"prefix": "C", "from_key": "C"}, 400, "bad_request", "either"),
            ("latest", {"limit": "0"}, 400, "bad_request", "limit"),
            ("latest", {"limit": "10001"}, 400, "bad_request", "limit"),
            ("latest", {"start": "a"}, 400, "bad_request", "unknown query parameter"),
            ("latest", {"cursor": "garbage!"}, 400, "bad_cursor", "malformed"),
            ("latest", {"cursor": cursor, "prefix": "C"}, 400, "bad_cursor", "another"),
            ("latest", {"cursor": cursor[:-3] + ("AAA" if cursor[-3:] != "AAA" else "BBB")}, 400, "bad_cursor", ""),
            (
                "latest",
                {"cursor": make_range_cursor(b"", ("latest", None, None, None), [1] * 3, b"C")},
                400,
                "bad_cursor",
                "",
            ),
            ("nope", {}, 404, "store_not_found", ""),
        ]
        for store, params, status, code, words in cases:
            resp = client.get(f"/stores/{store}/range", params=params)
            assert (resp.status_code, resp.json()["error"]) == (status, code), (store, params, resp.text)
            assert words in resp.json()["message"], (store, params, resp.text)
        assert client.get("/stores/latest/range").status_code == 200


def test_the_python_client_reads_values_histories_windows_and_ranges(cluster: Cluster) -> None:
    from keyroute.client import AsyncClient, Client, KeyNotFound, Value, WrongStoreKind

    size = 10 * MINUTE
    windows = expected_windows(cluster.rows, lambda r: r["ts"], size, size)
    from keyroute.storage.timeline import key_part

    with Client(cluster.router_url) as client:
        for key in ("C001", "a/b", "東京"):
            rows = list(client.history("trips", key, page_size=7))
            assert [{**r, "ts": micros(r["ts"])} for r in rows] == expected_history(cluster.rows, key)
            newest = list(client.history("trips", key, order="desc", page_size=3))
            assert [r["ts"] for r in newest] == [r["ts"] for r in rows[::-1]]
            third = expected_history(cluster.rows, key)[2]["ts"]
            start = dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(microseconds=third)
            since = [micros(r["ts"]) for r in client.history("trips", key, start=start)]
            assert since == [r["ts"] for r in expected_history(cluster.rows, key) if r["ts"] >= third]
            got = [(micros(w["start"]), w["value"]) for w in client.windows("per10", key, page_size=2)]
            assert got == windows[key_part(key.encode())]
            value = client.get("latest", key)
            assert isinstance(value, Value) and value.key == key and value.version == 1 and value.node
        assert [k for k, _ in client.range("latest", prefix="C00", page_size=2)] == sorted(
            k for k in KEYS if k.startswith("C00")
        )
        found, missing = client.get_many("latest", ["C001", "nobody"])
        assert isinstance(found, Value) and isinstance(missing, KeyNotFound)
        assert found.node, found  # the node that read it, passed on by the router
        with pytest.raises(WrongStoreKind):
            list(client.windows("trips", "C001"))
        with pytest.raises(KeyNotFound):
            client.get("latest", "nobody")
    # Avro answers (router and direct routing): the same rows, windows and values as JSON gives, text times and
    # all; the raw Avro answer of a node and of the router decodes to the JSON answer, `next` included.
    from keyroute.formats.avro_answers import decode_answer

    for routing in ("router", "direct"):
        with (
            Client(cluster.router_url, routing=routing) as plain,
            Client(cluster.router_url, routing=routing, answer_format="avro") as client,
        ):
            for key in ("C001", "a/b", "東京"):
                assert list(client.history("trips", key, page_size=7)) == list(plain.history("trips", key))
                assert list(client.windows("per10", key, page_size=2)) == list(plain.windows("per10", key))
                assert client.get("latest", key) == plain.get("latest", key)
            assert client.get("accounts", INT64_MIN) == plain.get("accounts", INT64_MIN)
    with httpx.Client(timeout=10) as http:
        for base in (cluster.router_url, *cluster.node_urls.values()):
            for read in ("history?limit=3", "windows?limit=2"):
                store = "trips" if read.startswith("history") else "per10"
                url = base + path(store, "C001", read)
                as_json = http.get(url)
                as_avro = http.get(url, headers={"accept": "application/avro"})
                assert as_avro.headers["content-type"] == "application/avro", as_avro.text
                assert decode_answer(as_avro.content) == as_json.json() and "next" in as_json.json()

    async def read_async() -> list[int]:
        async with AsyncClient(cluster.router_url) as client:
            accounts = [int(k) async for k, _ in client.range("accounts", from_key=-256, to_key=256, page_size=3)]
            rows = [row async for row in client.history("trips", "C002", page_size=5)]
            assert len(rows) == len(expected_history(cluster.rows, "C002"))
            return accounts

    import asyncio

    assert asyncio.run(read_async()) == sorted(a for a in set(ACCOUNT_IDS) if -256 <= a < 256)


# Last in the module: it publishes version 2 of the shared cluster's stores, which the tests above read at
# version 1.
def test_a_node_forwards_a_timeline_read_once_and_an_old_cursor_expires(cluster: Cluster, spark: Any) -> None:
    key = "C003"
    expected = expected_history(cluster.rows, key)
    with httpx.Client(timeout=10) as client:
        pmap = client.get(cluster.router_url + "/admin/partition-map?detail=all").json()
        partition = partition_for(Partitioner.MURMUR2, key.encode(), PARTITIONS)
        holders = {s["node"] for s in pmap["stores"]["trips"]["partition_map"][partition]["serving"]}
        for node_id, url in cluster.node_urls.items():
            resp = client.get(url + path("trips", key, "history"), params={"limit": "10000"})
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-keyroute-hops"] == ("0" if node_id in holders else "1")
            assert rows_of(resp.json()) == expected

        page = client.get(cluster.router_url + path("trips", key, "history"), params={"limit": "2"}).json()
        keys_page = client.get(cluster.router_url + "/stores/latest/range", params={"limit": "2"}).json()
        build_stores(cluster.zk, spark, cluster.spec, cluster.output)  # version 2 of every store

        def swapped() -> bool:
            body = client.get(cluster.router_url + path("trips", key, "history"), params={"limit": "1"}).json()
            return body["version"] == 2

        wait_for(swapped, timeout_s=60, message="version 2 served")
        wait_for(
            lambda: all(
                client.get(url + path("trips", key, "history"), params={"limit": "1"}).json()["version"] == 2
                for url in cluster.node_urls.values()
            ),
            timeout_s=60,
            message="both nodes answer from version 2",
        )
        resp = client.get(
            cluster.router_url + path("trips", key, "history"), params={"limit": "2", "cursor": page["next"]}
        )
        assert (resp.status_code, resp.json()["error"]) == (410, "cursor_expired"), resp.text

        def only_version_2() -> bool:
            entries = client.get(cluster.router_url + "/admin/partition-map?detail=all").json()["stores"]["latest"]
            return all(s["version"] == 2 for entry in entries["partition_map"] for s in entry["serving"])

        wait_for(only_version_2, timeout_s=60, message="every partition of latest served at version 2 only")
        old = client.get(
            cluster.router_url + "/stores/latest/range", params={"limit": "2", "cursor": keys_page["next"]}
        )
        assert (old.status_code, old.json()["error"]) == (410, "cursor_expired"), old.text
        restarted = client.get(cluster.router_url + path("trips", key, "history"), params={"limit": "10000"})
        assert rows_of(restarted.json()) == expected and restarted.json()["version"] == 2
