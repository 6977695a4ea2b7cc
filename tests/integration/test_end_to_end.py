"""The whole path, all real: events -> Spark pipeline -> ZooKeeper -> state nodes -> router -> HTTP client.

Every key answers through the router with exactly the value a plain-Python computation over the same
events expects, and keeps answering after a node is killed with SIGKILL.

One Spark build and one cluster for the module (`shared`, `tests.harness` members): the tests that only read
come first, then the ones that kill a node (and bring it back, or a new one, so that the next test finds
three nodes serving every partition as assigned).
"""

from __future__ import annotations

import contextlib
import json
import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from keyroute.cluster import zk, zk_layout
from keyroute.dev import sample_data
from keyroute.dev.zookeeper_server import EmbeddedZooKeeper
from keyroute.keys.key_format import KeyFormat, parse_key
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.runtime.settings import ZkSettings
from tests.harness import Member
from tests.util import free_port, wait_for

pytestmark = pytest.mark.integration

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
PARTITIONS = {"bookings": 12, "positions": 6, "accounts": 8}


def write_accounts(folder: Path, seed: int = 11) -> Path:
    rng = random.Random(seed)
    ids = [INT64_MIN, INT64_MAX, -1, 0, 1, 2**31, -(2**31) - 1]
    ids += [rng.randint(INT64_MIN, INT64_MAX) for _ in range(300)]
    path = folder / "accounts.jsonl"
    with open(path, "w") as fh:
        for n in range(1500):
            record = {
                "account": rng.choice(ids),
                "seq": n,
                "balance": round(rng.uniform(-50, 5000), 2),
                "tier": rng.choice(["gold", "silver", None]),
            }
            fh.write(json.dumps(record) + "\n")
    return path


def expected_latest(path: Path, key: str, order_by: str, columns: list[str]) -> dict[Any, dict[str, Any]]:
    best: dict[Any, dict[str, Any]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        current = best.get(row[key])
        if current is None or row[order_by] > current[order_by]:
            best[row[key]] = row
    return {k: {c: row[c] for c in columns} for k, row in best.items()}


def expected_positions(path: Path) -> dict[str, dict[str, Any]]:
    agg: dict[str, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        a = agg.setdefault(row["asset"], {"trades": 0, "volume": 0, "ts": -1, "last_price": None})
        a["trades"] += 1
        a["volume"] += row["qty"]
        if row["ts"] > a["ts"]:
            a["ts"], a["last_price"] = row["ts"], row["price"]
    return {k: {"trades": v["trades"], "volume": v["volume"], "last_price": v["last_price"]} for k, v in agg.items()}


@dataclass
class Cluster:
    router_url: str
    nodes: dict[str, tuple[Member, str]]
    expected: dict[str, dict[Any, dict[str, Any]]]
    zk: ZkSettings

    def wait_settled(self) -> None:
        # Nodes started one by one: the first ones loaded more than their share and let go only once the
        # new owners serve. Wait until actual placement equals the assignment (make before break done).
        wait_for(
            lambda: settled(httpx.get(self.router_url + "/admin/partition-map?detail=all").json()),
            timeout_s=120,
            message="serving view equal to the assignment",
        )

    def live_node(self) -> tuple[str, Member]:
        return next((node_id, proc) for node_id, (proc, _url) in self.nodes.items() if proc.alive)


@dataclass(frozen=True)
class Built:
    """One Spark build for the whole module: the stores' records as published (their snapshots are immutable
    files every cluster of the module serves) and every key's expected value."""

    records: dict[str, bytes]
    expected: dict[str, dict[Any, dict[str, Any]]]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, zk_server: EmbeddedZooKeeper, spark: Any) -> Built:
    settings = ZkSettings(hosts=zk_server.connect_string, chroot=f"/m-{uuid.uuid4().hex[:12]}", session_timeout_s=4.0)
    from keyroute.pipeline.build import build

    tmp = tmp_path_factory.mktemp("end-to-end-build")
    files = sample_data.generate(tmp / "events", events=6_000)
    accounts = write_accounts(tmp / "events")
    spec = tmp / "stores.toml"
    spec.write_text(
        sample_data.spec_toml(files, partitions=PARTITIONS["bookings"], replication_factor=2)
        + f"""
[stores.accounts]
source = {json.dumps(str(accounts))}
format = "json"
key = "account"
key_format = "int64"
partitions = {PARTITIONS["accounts"]}
replication_factor = 2
mode = "latest"
order_by = "seq"
columns = ["balance", "tier"]
"""
    )
    published = build(spec, settings, str(tmp / "snapshots"), spark=spark)
    assert sorted(p.store for p in published) == ["accounts", "bookings", "positions"]
    client = zk.connect(settings, ensure_layout=False)
    try:
        records = {
            name: client.get(zk_layout.store_path(name))[0] for name in client.get_children(zk_layout.STORES)
        }
    finally:
        zk.close(client)
    expected = {
        "bookings": expected_latest(files.bookings, "customer_id", "ts", ["ts", "route", "fare", "seats"]),
        "positions": expected_positions(files.trades),
        "accounts": expected_latest(accounts, "account", "seq", ["balance", "tier"]),
    }
    return Built(records, expected)


@contextlib.contextmanager
def running_cluster(tmp_path: Path, zk_settings: ZkSettings, built: Built) -> Iterator[Cluster]:
    """The module's build published in `zk_settings`' chroot, served by three nodes behind a router."""
    client = zk.connect(zk_settings)
    try:
        for name, record in built.records.items():
            client.create(zk_layout.store_path(name), record)
    finally:
        zk.close(client)
    zk_address = zk_settings.connect_string
    procs: list[Member] = []
    nodes: dict[str, tuple[Member, str]] = {}
    try:
        for i in range(3):
            port = free_port()
            node_id = f"node-{i}"
            args = ["node", "--zk", zk_address, "--node-id", node_id, "--port", str(port)]
            args += ["--data-dir", str(tmp_path / node_id), "--zk-session-timeout-s", "4"]
            proc = Member(node_id, args, tmp_path / f"{node_id}.log", f"http://127.0.0.1:{port}").start()
            procs.append(proc)
            nodes[node_id] = (proc, proc.url)
        router_port = free_port()
        router_url = f"http://127.0.0.1:{router_port}"
        router_args = ["router", "--zk", zk_address, "--port", str(router_port)]
        router = Member("router", router_args, tmp_path / "router.log", router_url).start()
        procs.append(router)
        wait_for(
            lambda: httpx.get(router_url + "/readyz").json().get("complete") is True,
            timeout_s=120,
            message="router ready (complete map)",
        )
        cluster = Cluster(router_url, nodes, built.expected, zk_settings)
        cluster.wait_settled()
        yield cluster
    finally:
        for proc in reversed(procs):
            proc.stop()
        for proc in procs:
            if proc.popen and proc.popen.returncode not in (0, -9):
                print(f"--- {proc.args[:4]} exited {proc.popen.returncode}\n{proc.output()[-3000:]}")


@pytest.fixture(scope="module")
def shared(
    tmp_path_factory: pytest.TempPathFactory, module_zk_settings: ZkSettings, built: Built
) -> Iterator[Cluster]:
    """One cluster for the module: the tests that kill a node leave three serving, as they found it."""
    with running_cluster(tmp_path_factory.mktemp("end-to-end-shared"), module_zk_settings, built) as c:
        yield c


def settled(pmap: dict[str, Any]) -> bool:
    assigned: set[str] = set()
    for store in pmap["stores"].values():
        for entry in store["partition_map"]:
            serving = {s["node"] for s in entry["serving"] if s["version"] == store["version"]}
            if len(entry["assigned"]) != 2 or serving != set(entry["assigned"]):
                return False
            assigned.update(entry["assigned"])
    # All three nodes placed: with two nodes up, every partition on both of them also fits "2 replicas each",
    # and the third node's arrival would then move partitions under the tests' feet.
    return len(pmap["stores"]) == 3 and assigned == set(pmap["nodes"]) and len(assigned) == 3


def key_url(base: str, store: str, key: Any) -> str:
    return f"{base}/stores/{store}/keys/{quote(str(key), safe='')}"


def check_all_keys(client: httpx.Client, cluster: Cluster, *, hops: str | None = "0") -> int:
    checked = 0
    for store, values in cluster.expected.items():
        fmt = KeyFormat.INT64 if store == "accounts" else KeyFormat.STRING
        for key, value in values.items():
            resp = client.get(key_url(cluster.router_url, store, key))
            assert resp.status_code == 200, (store, key, resp.text)
            body = resp.json()
            assert body["value"] == value, (store, key)
            # Types are kept: an int stays an int, a double stays a double.
            assert {k: type(v) for k, v in body["value"].items()} == {k: type(v) for k, v in value.items()}
            assert body["key"] == str(key) and body["store"] == store
            partition = partition_for(Partitioner.MURMUR2, parse_key(fmt, str(key)).data, PARTITIONS[store])
            assert body["partition"] == partition
            assert resp.headers["x-keyroute-partition"] == str(partition)
            if hops is not None:
                assert resp.headers["x-keyroute-hops"] == hops
            checked += 1
    return checked


def test_errors_are_json_with_the_right_status(shared: Cluster) -> None:
    base = shared.router_url
    with httpx.Client(timeout=10) as client:
        cases = [
            (key_url(base, "nope", "k"), 404, "store_not_found"),
            (key_url(base, "bookings", "no-such-customer"), 404, "key_not_found"),
            (key_url(base, "accounts", str(INT64_MAX + 1)), 400, "bad_key"),
            (key_url(base, "accounts", "abc"), 400, "bad_key"),
            (base + "/stores/bookings/keys/%FF", 400, "bad_key"),
            (base + "/no/such/route", 404, None),
        ]
        for url, status, code in cases:
            resp = client.get(url)
            assert resp.status_code == status, (url, resp.text)
            body = resp.json()
            assert "message" in body and "Traceback" not in resp.text
            if code:
                assert body["error"] == code


def test_batch_get_answers_in_request_order(shared: Cluster) -> None:
    cluster = shared
    bookings = cluster.expected["bookings"]
    keys = list(bookings)[:40] + ["nobody", "a/b", "東京-42"]
    with httpx.Client(timeout=10) as client:
        resp = client.post(cluster.router_url + "/stores/bookings/batch-get", json={"keys": keys})
        assert resp.status_code == 200
        results = resp.json()["results"]
        assert [r["key"] for r in results] == keys
        for key, result in zip(keys, results, strict=True):
            if key in bookings:
                assert result["status"] == 200 and result["value"] == bookings[key]
            else:
                assert result["status"] == 404 and result["error"] == "key_not_found"
        bad = client.post(cluster.router_url + "/stores/accounts/batch-get", json={"keys": ["1", "x", INT64_MIN]})
        statuses = [r["status"] for r in bad.json()["results"]]
        assert statuses[1] == 400 and statuses[2] == 200


def test_a_node_forwards_a_key_it_does_not_serve_exactly_once(shared: Cluster) -> None:
    cluster = shared
    with httpx.Client(timeout=10) as client:
        pmap = client.get(cluster.router_url + "/admin/partition-map?detail=all").json()
        partitions = pmap["stores"]["bookings"]["partition_map"]
        node_id, (_proc, node_url) = next(iter(cluster.nodes.items()))
        served_here = {p["partition"] for p in partitions if any(s["node"] == node_id for s in p["serving"])}
        elsewhere = [
            (key, value)
            for key, value in cluster.expected["bookings"].items()
            if partition_for(Partitioner.MURMUR2, key.encode(), PARTITIONS["bookings"]) not in served_here
        ]
        if not elsewhere:
            pytest.fail("node serves every partition; cannot test forwarding")
        key, value = elsewhere[0]
        resp = client.get(key_url(node_url, "bookings", key))
        assert resp.status_code == 200 and resp.json()["value"] == value
        assert resp.headers["x-keyroute-hops"] == "1"
        assert resp.headers["x-keyroute-node"] != node_id
        # A request already marked as forwarded is never forwarded again.
        again = client.get(key_url(node_url, "bookings", key), headers={"X-Keyroute-Hops": "1"})
        assert again.status_code == 503 and again.json()["error"] == "partition_unavailable"


# The tests that kill a node come after the ones that only read.
def test_every_key_answers_exactly_through_the_router_and_survives_kill_9(shared: Cluster) -> None:
    cluster = shared
    with httpx.Client(timeout=10) as client:
        total = check_all_keys(client, cluster)
        assert total == sum(len(v) for v in cluster.expected.values())
        for special in sample_data.SPECIAL_CUSTOMERS:
            assert special in cluster.expected["bookings"]
        assert {INT64_MIN, INT64_MAX} <= set(cluster.expected["accounts"])

        # kill -9 one node: with replication 2 every key still answers (the router retries a replica at
        # once; after the session expires the map no longer lists the dead node).
        victim, proc = cluster.live_node()
        proc.kill()
        assert check_all_keys(client, cluster, hops=None) == total
        wait_for(
            lambda: victim not in client.get(cluster.router_url + "/admin/partition-map?detail=all").json()["nodes"],
            timeout_s=30,
            message="dead node gone from the map",
        )
        assert check_all_keys(client, cluster, hops=None) == total

    # Back on its data directory: the next test finds three nodes serving every partition as assigned.
    proc.restart()
    cluster.wait_settled()


def test_the_direct_client_reads_every_key_through_a_kill_9_and_a_rebalance(shared: Cluster, tmp_path: Path) -> None:
    """keyroute.client in direct mode (the map from the router, keys hashed by the client, straight to a
    serving node): no failed or wrong read while a node is killed and while a new node takes partitions."""
    import threading

    from keyroute.client import Client

    cluster = shared
    keys = list(cluster.expected["bookings"].items())
    accounts = list(cluster.expected["accounts"].items())
    failures: list[str] = []
    rounds = [0]
    stop = threading.Event()
    stats: dict[str, int] = {}

    def read_forever() -> None:
        with Client(cluster.router_url, routing="direct", timeout=5, retries=6) as client:
            while not stop.is_set():
                for key, value in keys:
                    try:
                        if client.get("bookings", key).value != value:
                            failures.append(f"bookings {key}: wrong value")
                    except Exception as exc:  # noqa: BLE001 - every failure is what this test counts
                        failures.append(f"bookings {key}: {exc!r}")
                found = client.get_many("accounts", [k for k, _ in accounts])
                for (key, value), result in zip(accounts, found, strict=True):
                    if getattr(result, "value", None) != value:
                        failures.append(f"accounts {key}: {result!r}")
                rounds[0] += 1
            stats.update(client.stats)

    reader = threading.Thread(target=read_forever)
    reader.start()
    try:
        wait_for(lambda: rounds[0] >= 2, timeout_s=60, message="reading")
        victim, proc = cluster.live_node()
        proc.kill()
        wait_for(
            lambda: victim not in httpx.get(cluster.router_url + "/admin/partition-map?detail=all").json()["nodes"],
            timeout_s=30,
            message="dead node gone from the map",
        )
        port = free_port()
        newcomer = Member(
            "node-new",
            ["node", "--zk", cluster.zk.connect_string, "--node-id", "node-new", "--port", str(port),
             "--data-dir", str(tmp_path / "node-new"), "--zk-session-timeout-s", "4"],
            tmp_path / "node-new.log",
            f"http://127.0.0.1:{port}",
        ).start()  # fmt: skip
        try:
            full_map = cluster.router_url + "/admin/partition-map?detail=all"
            wait_for(lambda: settled(httpx.get(full_map).json()), timeout_s=120,
                     message="the new node serving its share")  # fmt: skip
            done = rounds[0]
            wait_for(lambda: rounds[0] >= done + 2, timeout_s=60, message="reading after the rebalance")
        finally:
            stop.set()
            reader.join()
            newcomer.stop()
    finally:
        stop.set()
        reader.join()
    assert failures == []
    assert stats["direct"] > 0 and stats["map_loads"] >= 2, stats
