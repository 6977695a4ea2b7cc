"""State nodes as real processes on a real ZooKeeper: assignment, loading, one-hop forwarding, failover.

The snapshots are written by hand in the keyroute snapshot format (no Spark here) and published with kazoo.
"""

from __future__ import annotations

import asyncio
import functools
import json
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from keyroute.cluster import placement_records, zk, zk_layout
from keyroute.cluster.partition_map import Assignment, NodeRecord, ServingRecord, StoreRecord
from keyroute.http.server import HttpServer
from keyroute.keys.key_format import KeyFormat, parse_key
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.router.app import create_app as create_router
from keyroute.router.dataplane import RouterDataPlane
from keyroute.router.limits import server_limits as router_server_limits
from keyroute.router.map_source import ZooKeeperMapSource
from keyroute.runtime.settings import NodeSettings, RouterSettings, ZkSettings
from keyroute.state_node.app import create_app as create_node
from keyroute.state_node.controller import Controller
from keyroute.state_node.dataplane import NodeDataPlane
from keyroute.state_node.service import server_limits as node_server_limits
from keyroute.storage.snapshot import Manifest, partition_dir, version_dir, write_manifest
from tests.util import Proc, free_port, wait_for, wait_until

pytestmark = pytest.mark.integration

BOOKINGS = {
    **{f"C{i:04d}": {"customer": i, "route": f"R{i % 7}", "fare": round(10 + i * 1.5, 2)} for i in range(90)},
    "a/b": {"slash": True},
    "東京-42": {"city": "Tokyo"},
    "x y?#%": {"odd": "chars"},
    "..": {"dots": 2},
}
POSITIONS = {str(n): {"asset": n, "qty": n * 3} for n in [-(2**63), -1, 0, 1, 42, 2**31, 2**63 - 1]}
STORES: dict[str, tuple[dict[str, Any], KeyFormat, int]] = {
    "bookings": (BOOKINGS, KeyFormat.STRING, 6),
    "positions": (POSITIONS, KeyFormat.INT64, 4),
}
RF = 2


def write_snapshot(
    root: Path, store: str, rows: Mapping[str, Any], fmt: KeyFormat, partitions: int, version: int = 1
) -> str:
    snapshot = version_dir(str(root), store, version)
    per_partition: dict[int, list[tuple[str, Any]]] = {p: [] for p in range(partitions)}
    for text, value in rows.items():
        key = parse_key(fmt, text)
        per_partition[partition_for(Partitioner.MURMUR2, key.data, partitions)].append((key.text, value))
    for p, items in per_partition.items():
        folder = partition_dir(snapshot, p)
        folder.mkdir(parents=True)
        with open(folder / "part-00000.json", "w", encoding="utf-8") as fh:
            for text, value in sorted(items):
                fh.write(json.dumps({"key": text, "value": value}, ensure_ascii=False) + "\n")
    counts = tuple(len(per_partition[p]) for p in range(partitions))
    write_manifest(snapshot, Manifest(store, version, partitions, Partitioner.MURMUR2, fmt, ("v",), counts))
    return str(snapshot)


def key_url(store: str, text: str) -> str:
    segment = text.replace(".", "%2E") if text in (".", "..") else quote(text, safe="")
    return f"/stores/{store}/keys/{segment}"


def compact(value: Any) -> Any:
    return json.loads(json.dumps(value))


class Cluster:
    """Node processes sharing one ZooKeeper chroot, and a kazoo client to look at their records."""

    def __init__(self, tmp: Path, zk_settings: ZkSettings, client: KazooClient) -> None:
        self.tmp = tmp
        self.zk_settings = zk_settings
        self.client = client
        self.procs: dict[str, Proc] = {}
        self.urls: dict[str, str] = {}
        self.http = httpx.Client(timeout=10.0, trust_env=False)

    def start(self, node_id: str) -> None:
        port = free_port()
        connect = f"{self.zk_settings.hosts}{self.zk_settings.chroot}"
        args = ["node", "--zk", connect, "--node-id", node_id, "--port", str(port)]
        args += ["--data-dir", str(self.tmp / f"data-{node_id}"), "--zk-session-timeout-s", "4"]
        args += ["--version-grace-s", "1", "--drain-timeout-s", "20"]
        self.procs[node_id] = Proc(args, self.tmp / f"{node_id}.log").start()
        self.urls[node_id] = f"http://127.0.0.1:{port}"

    def get(self, node_id: str, path: str, **kwargs: Any) -> httpx.Response:
        return self.http.get(self.urls[node_id] + path, **kwargs)

    def post(self, node_id: str, path: str, body: Any, **kwargs: Any) -> httpx.Response:
        return self.http.post(self.urls[node_id] + path, json=body, **kwargs)

    def alive(self) -> list[str]:
        return sorted(n for n, p in self.procs.items() if p.alive)

    def assignment(self) -> Assignment:
        current = placement_records.read(self.client)[0]
        assert current is not None
        return current

    def settled(self) -> bool:
        """Every live node is ready and sees every partition served exactly by its assigned replicas."""
        nodes = self.alive()
        for node_id in nodes:
            if self.get(node_id, "/readyz").status_code != 200:
                return False
            view = self.get(node_id, "/admin/partition-map").json()
            if set(view["nodes"]) != set(nodes) or set(view["stores"]) != set(STORES):
                return False
            # Every live node placed: one that just registered is ready (nothing assigned to it yet) until
            # the controller's next assignment, which then moves partitions.
            placed = {n for store in view["stores"].values() for e in store["partition_map"] for n in e["assigned"]}
            if placed != set(nodes):
                return False
            for store in view["stores"].values():
                for entry in store["partition_map"]:
                    serving = sorted(e["node"] for e in entry["serving"])
                    if len(entry["assigned"]) != min(RF, len(nodes)) or serving != sorted(entry["assigned"]):
                        return False
        return True

    def wait_settled(self, timeout_s: float = 60.0) -> dict[str, Any]:
        wait_for(self.settled, timeout_s=timeout_s, interval_s=0.2, message="every partition served as assigned")
        return dict(self.get(self.alive()[0], "/admin/partition-map").json())

    def logs(self) -> str:
        return "\n".join(f"----- {n} -----\n{p.output()[-6000:]}" for n, p in self.procs.items())

    def close(self) -> None:
        # All at once: every node is leaving, so none waits for another to take its partitions over.
        for proc in self.procs.values():
            if proc.alive and proc.popen is not None:
                proc.popen.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            proc.stop()
        self.http.close()


@pytest.fixture
def cluster(tmp_path: Path, zk_settings: ZkSettings) -> Iterator[Cluster]:
    client = zk.connect(zk_settings)
    for store, (rows, fmt, partitions) in STORES.items():
        snapshot = write_snapshot(tmp_path / "snapshots", store, rows, fmt, partitions)
        record = StoreRecord(store, partitions, Partitioner.MURMUR2, fmt, 1, snapshot, ("v",), RF, 1.0)
        client.create(zk_layout.store_path(store), record.to_json())
    c = Cluster(tmp_path, zk_settings, client)
    try:
        for node_id in ("n1", "n2", "n3"):
            c.start(node_id)
        yield c
    finally:
        c.close()
        print(c.logs())  # pytest shows captured output only when the test failed
        zk.close(client)


def owners(view: Mapping[str, Any], store: str, partition: int) -> list[str]:
    return [e["node"] for e in view["stores"][store]["partition_map"][partition]["serving"]]


def partition_of(store: str, text: str) -> int:
    rows, fmt, partitions = STORES[store]
    return partition_for(Partitioner.MURMUR2, parse_key(fmt, text).data, partitions)


def check_every_key(c: Cluster, view: Mapping[str, Any]) -> None:
    """Each key from a node serving it (hops 0) and from one that does not (forwarded once)."""
    nodes = c.alive()
    forwarded = asked_outsiders = 0
    for store, (rows, _, _) in STORES.items():
        for text, value in rows.items():
            partition = partition_of(store, text)
            serving = owners(view, store, partition)
            r = c.get(serving[0], key_url(store, text))
            assert r.status_code == 200, (store, text, r.text)
            assert r.json() == {
                "store": store,
                "key": text,
                "partition": partition,
                "version": 1,
                "value": compact(value),
            }
            assert r.headers["x-keyroute-hops"] == "0" and r.headers["x-keyroute-node"] == serving[0]
            assert r.headers["x-keyroute-partition"] == str(partition)
            outsiders = [n for n in nodes if n not in serving]
            if outsiders:
                asked_outsiders += 1
                r = c.get(outsiders[0], key_url(store, text))
                assert r.status_code == 200, (store, text, r.text)
                assert r.json()["value"] == compact(value)
                if r.headers["x-keyroute-hops"] == "0":
                    # Make before break: a node that has just handed the partition over may still hold
                    # its copy (same version) and answer from it; anything else must be forwarded.
                    assert r.headers["x-keyroute-node"] == outsiders[0]
                    continue
                forwarded += 1
                assert r.headers["x-keyroute-hops"] == "1"
                assert r.headers["x-keyroute-forwarded-by"] == outsiders[0]
                assert r.headers["x-keyroute-node"] in serving
    if asked_outsiders:
        assert forwarded > 0, "no read was forwarded"


def test_three_nodes_serve_every_key_in_one_hop(cluster: Cluster) -> None:
    c = cluster
    view = c.wait_settled()

    # The controller's assignment: rf=2 on 3 nodes, balanced in replicas and preferred replicas.
    assignment = c.assignment()
    totals: Counter[str] = Counter()
    preferred: Counter[str] = Counter()
    for store, (_, _, partitions) in STORES.items():
        assert len(assignment.stores[store]) == partitions
        for replicas in assignment.stores[store]:
            assert len(set(replicas)) == RF
            totals.update(replicas)
            preferred[replicas[0]] += 1
    assert sorted(totals) == ["n1", "n2", "n3"] and max(totals.values()) - min(totals.values()) <= 1
    assert max(preferred.values()) - min(preferred.values()) <= 1
    assert sum(view["controller"] for view in [c.get(n, "/admin/partition-map").json() for n in c.alive()]) == 1

    check_every_key(c, view)

    # Partitions loaded while fewer nodes were up, and since handed over, are dropped (after a grace
    # period): in the end each node holds exactly what is assigned to it, and nothing else on disk.
    def holds_only_its_assignment(node_id: str) -> bool:
        local = c.get(node_id, "/admin/partition-map").json()["local"]
        held = {(s, e["partition"]) for s, entries in local.items() for e in entries if e["state"] == "serving"}
        everything = {(s, e["partition"]) for s, entries in local.items() for e in entries}
        mine = {(s, p) for s, per in assignment.stores.items() for p, r in enumerate(per) if node_id in r}
        on_disk = {
            (d.parent.parent.name, int(d.name[1:])) for d in (c.tmp / f"data-{node_id}" / "stores").glob("*/v*/p*")
        }
        return held == everything == mine == on_disk

    for node_id in c.alive():
        wait_for(functools.partial(holds_only_its_assignment, node_id), timeout_s=30, message=f"{node_id} to drop")

    # A request already forwarded once is never forwarded again, even by a node that could.
    text = "C0007"
    partition = partition_of("bookings", text)
    outsider = next(n for n in c.alive() if n not in owners(view, "bookings", partition))
    r = c.get(outsider, key_url("bookings", text), headers={"x-keyroute-hops": "1"})
    assert r.status_code == 503
    assert r.json()["error"] == "partition_unavailable" and r.headers["retry-after"]

    # Errors are JSON with a code and a message, from any node.
    r = c.get("n1", key_url("nope", "k"))
    assert (r.status_code, r.json()["error"]) == (404, "store_not_found")
    for node_id in c.alive():
        r = c.get(node_id, key_url("bookings", "no-such-customer"))
        assert (r.status_code, r.json()["error"]) == (404, "key_not_found") and r.json()["message"]
        r = c.get(node_id, key_url("positions", "12abc"))
        assert (r.status_code, r.json()["error"]) == (400, "bad_key") and r.json()["message"]
        r = c.get(node_id, key_url("positions", str(2**63)))
        assert (r.status_code, r.json()["error"]) == (400, "bad_key")

    # Batch-get from one node: local, remote, missing and bad keys, answered in request order.
    # (Each store is balanced on its own: with rf=2 on 3 nodes every node holds some bookings
    # partitions but not all.)
    def holders(text: str) -> list[str]:
        return owners(view, "bookings", partition_of("bookings", text))

    asked = next(
        n for n in c.alive() if any(n in holders(t) for t in BOOKINGS) and any(n not in holders(t) for t in BOOKINGS)
    )
    local = next(t for t in BOOKINGS if asked in holders(t))
    remote = next(t for t in BOOKINGS if asked not in holders(t))
    r = c.post(asked, "/stores/bookings/batch-get", {"keys": [remote, "nobody", local, "a/b", "東京-42"]})
    assert r.status_code == 200
    results = r.json()["results"]
    assert [e["key"] for e in results] == [remote, "nobody", local, "a/b", "東京-42"]
    assert [e["status"] for e in results] == [200, 404, 200, 200, 200]
    assert results[0]["value"] == compact(BOOKINGS[remote]) and results[2]["value"] == compact(BOOKINGS[local])
    assert results[4]["value"] == {"city": "Tokyo"}
    r = c.post("n2", "/stores/positions/batch-get", {"keys": [42, "-1", "x", "9223372036854775807", 7]})
    assert [e["status"] for e in r.json()["results"]] == [200, 200, 400, 200, 404]
    assert r.json()["results"][0]["value"] == {"asset": 42, "qty": 126}
    r = c.post("n2", "/stores/positions/batch-get", {"keys": [None]})
    assert (r.status_code, r.json()["error"]) == (400, "bad_request")

    # The admin route agrees with the partition map.
    r = c.get("n3", "/admin/route", params={"store": "bookings", "key": "a/b"})
    assert r.json()["partition"] == partition_of("bookings", "a/b")
    # Its assigned replicas are the whole assignment's (a node's own map holds only its share).
    whole = placement_records.read(c.client)[0]
    assert whole is not None and r.json()["assigned"] == list(whole.replicas("bookings", r.json()["partition"]))
    assert sorted(e["node"] for e in r.json()["serving"]) == sorted(owners(view, "bookings", r.json()["partition"]))


def test_nodes_fail_over_after_a_crash_and_leave_cleanly_on_sigterm(cluster: Cluster) -> None:
    c = cluster
    c.wait_settled()

    # kill -9: no goodbye, the session has to expire (4 s) before ZooKeeper forgets the node.
    c.procs["n3"].kill9()
    # Even before that, every key answers: a forward to the dead replica fails over to the live one.
    for store, (rows, _, _) in STORES.items():
        for text in rows:
            for node_id in ("n1", "n2"):
                r = c.get(node_id, key_url(store, text))
                assert r.status_code == 200, (node_id, store, text, r.text)
    wait_for(
        lambda: "n3" not in c.client.get_children(zk_layout.NODES),
        timeout_s=30,
        message="n3's ZooKeeper session to expire",
    )
    view = c.wait_settled()
    assert all(sorted(owners(view, store, p)) == ["n1", "n2"] for store, (_, _, n) in STORES.items() for p in range(n))
    check_every_key(c, view)

    # A drain request, then SIGTERM: a departure (without the request, a planned restart keeps n2's partitions
    # assigned to it), a clean exit, with its records withdrawn at once rather than at session expiry.
    connect = f"{c.zk_settings.hosts}{c.zk_settings.chroot}"
    drain = [sys.executable, "-m", "keyroute", "node-drain", "--zk", connect, "--node-id", "n2"]
    requested = subprocess.run(drain, capture_output=True, text=True, timeout=60, check=False)
    assert requested.returncode == 0, requested.stderr
    assert json.loads(requested.stdout)["node_id"] == "n2"
    assert c.procs["n2"].stop() == 0
    children = c.client.get_children(zk_layout.NODES), c.client.get_children(zk_layout.SERVING)
    assert "n2" not in children[0] and "n2" not in children[1]
    view = c.wait_settled()
    check_every_key(c, view)
    assert c.procs["n1"].stop() == 0
    assert c.client.get_children(zk_layout.NODES) == [] and c.client.get_children(zk_layout.SERVING) == []


def test_a_new_version_replaces_the_old_without_a_failed_read(cluster: Cluster) -> None:
    c = cluster
    c.wait_settled()
    rows, fmt, partitions = STORES["bookings"]
    newer = {text: {**value, "v2": True} for text, value in rows.items()}
    snapshot = write_snapshot(c.tmp / "snapshots-v2", "bookings", newer, fmt, partitions, version=2)
    record = StoreRecord("bookings", partitions, Partitioner.MURMUR2, fmt, 2, snapshot, ("v",), RF, 2.0)
    c.client.set(zk_layout.store_path("bookings"), record.to_json())

    def everything_on_v2() -> bool:
        view = c.get("n1", "/admin/partition-map").json()
        entries = view["stores"]["bookings"]["partition_map"]
        return all(e["serving"] and all(s["version"] == 2 for s in e["serving"]) for e in entries)

    sample = list(rows)[:12]
    seen_versions: set[int] = set()
    while not everything_on_v2():  # read all the way through the swap: never a failure
        for text in sample:
            for node_id in c.alive():
                r = c.get(node_id, key_url("bookings", text))
                assert r.status_code == 200, (node_id, text, r.text)
                body = r.json()
                assert body["value"] == compact(rows[text] if body["version"] == 1 else newer[text])
                seen_versions.add(body["version"])
    view = c.wait_settled()
    assert view["stores"]["bookings"]["version"] == 2
    for text in rows:
        for node_id in c.alive():
            r = c.get(node_id, key_url("bookings", text))
            assert (r.status_code, r.json()["version"], r.json()["value"]) == (200, 2, compact(newer[text]))
    # Version 1's files are removed once version 2 serves.
    wait_for(
        lambda: not any((c.tmp / f"data-{n}" / "stores" / "bookings" / "v1").exists() for n in c.alive()),
        message="version 1 files to go",
    )


def test_one_controller_at_a_time_rewrites_the_assignment_only_when_it_changes(
    zk_settings: ZkSettings,
) -> None:
    """Two controllers in this process, each with its own ZooKeeper session."""
    admin, first, second = (zk.connect(zk_settings) for _ in range(3))
    record = StoreRecord("s", 8, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/unused", (), 2)
    admin.create(zk_layout.store_path("s"), record.to_json())
    for client, node_id in ((first, "a"), (second, "b")):
        client.create(zk_layout.node_path(node_id), b'{"node_id": "x", "url": "http://x"}', ephemeral=True)
    controllers = [Controller(first, "a"), Controller(second, "b")]
    try:
        for controller in controllers:
            controller.start()

        def assignment() -> Assignment | None:
            return placement_records.read(admin)[0]

        wait_for(lambda: (a := assignment()) and {n for r in a.stores["s"] for n in r} == {"a", "b"})
        leader = next(c for c in controllers if c.is_leader)
        assert sum(c.is_leader for c in controllers) == 1
        current = assignment()
        assert current is not None
        generation = current.generation

        # A change that does not alter the placement (a new version) writes nothing: when "c" has been
        # placed, exactly one more generation exists.
        admin.set(zk_layout.store_path("s"), StoreRecord(**{**_fields(record), "version": 2}).to_json())
        admin.create(zk_layout.node_path("c"), b'{"node_id": "c", "url": "http://c"}', ephemeral=True)
        wait_for(lambda: (a := assignment()) and any("c" in r for r in a.stores["s"]), message="c to be placed")
        after = assignment()
        assert after is not None and after.generation == generation + 1

        # The leader's session ends: the other takes over and keeps the assignment up to date.
        writes_before = leader.writes
        leader.stop()
        zk.close(first if leader is controllers[0] else second)
        follower = next(c for c in controllers if c is not leader)
        wait_for(lambda: follower.is_leader, timeout_s=30, message="the other controller to take over")
        admin.delete(zk_layout.node_path("c"))
        wait_for(lambda: (a := assignment()) and not any("c" in r for r in a.stores["s"]), message="c removed")
        assert leader.writes == writes_before  # the stopped leader wrote nothing more
        final = assignment()
        # The old leader's node left with its session and "c" was removed: one or two more generations
        # (the new leader's first computation may already see both changes).
        assert final is not None and final.generation in (generation + 2, generation + 3)
        assert {n for r in final.stores["s"] for n in r} == {"b" if leader is controllers[0] else "a"}
        assert all(len(r) == len(set(r)) for r in final.stores["s"])
    finally:
        for controller in controllers:
            controller.stop()
        for client in (admin, first, second):
            zk.close(client)


def _fields(record: StoreRecord) -> dict[str, Any]:
    return {name: getattr(record, name) for name in record.__slots__}


def test_a_router_with_a_stale_view_is_answered_in_one_hop_and_re_reads_its_map_at_once(
    tmp_path: Path, zk_settings: ZkSettings
) -> None:
    """Real nodes, a real ZooKeeper, and a router served in this process so that its view can be made
    stale on purpose: FAULT INJECTION, its map watcher ignores watch events (as if delivered late)."""
    client = zk.connect(zk_settings)
    rows = {f"k{i:03d}": {"i": i} for i in range(60)}
    snapshot = write_snapshot(tmp_path / "snapshots", "moving", rows, KeyFormat.STRING, 4)
    record = StoreRecord("moving", 4, Partitioner.MURMUR2, KeyFormat.STRING, 1, snapshot, ("v",), 1, 1.0)
    client.create(zk_layout.store_path("moving"), record.to_json())
    c = Cluster(tmp_path, zk_settings, client)

    def serving(node_id: str) -> set[int]:
        try:
            raw, _ = client.get(zk_layout.serving_path(node_id))
        except NoNodeError:
            return set()
        return set(ServingRecord.from_json(raw).stores.get("moving", {}))

    async def scenario() -> None:
        source = ZooKeeperMapSource(zk_settings)
        settings = RouterSettings(zk=zk_settings)
        router = HttpServer(
            create_router(settings, map_source=source),
            router_server_limits(settings),
            data_plane=RouterDataPlane.factory(settings.limits.max_key_bytes),
        )
        await router.start(port=0)
        try:
            base_url = f"http://127.0.0.1:{router.port}"
            async with httpx.AsyncClient(base_url=base_url, trust_env=False, timeout=10) as http:

                async def pmap() -> dict[str, Any]:
                    return dict((await http.get("/admin/partition-map?detail=all")).json())

                async def holders(p: int) -> list[str]:
                    entries = (await pmap())["stores"]["moving"]["partition_map"]
                    return [e["node"] for e in entries[p]["serving"]]

                async def n1_serves_all() -> bool:
                    return all([await holders(p) == ["n1"] for p in range(4)])

                await wait_until(n1_serves_all, message="the router to see n1 serving everything", timeout_s=30)
                stale_generation = (await pmap())["generation"]
                assert source.watcher is not None
                source.watcher.hold_watches()  # FAULT INJECTION: from here on the router's view is frozen

                c.start("n2")  # the controller moves two partitions to n2; n1 lets go once n2 serves them
                await wait_until(
                    lambda: len(serving("n2")) == 2 and serving("n1") == {0, 1, 2, 3} - serving("n2"),
                    message="the hand-over to n2",
                    timeout_s=30,
                )
                assert (await pmap())["generation"] == stale_generation and await n1_serves_all()

                moved = min(serving("n2"))
                key = next(k for k in rows if partition_of_moving(k) == moved)
                r = await http.get(key_url("moving", key))
                assert r.status_code == 200 and r.json()["value"] == rows[key]
                # One hop: n1 no longer holds the partition and forwarded the read to n2, once.
                assert r.headers["x-keyroute-hops"] == "1"
                assert r.headers["x-keyroute-forwarded-by"] == "n1" and r.headers["x-keyroute-node"] == "n2"
                assert int(r.headers["x-keyroute-generation"]) > stale_generation
                metrics = (await http.get("/metrics")).text
                assert "keyroute_router_misroutes_total 1.0\n" in metrics
                assert "keyroute_router_map_refreshes_total 1.0\n" in metrics

                # The router re-read its map at once, with watches still held: only the misroute did it.
                async def refreshed() -> bool:
                    return await holders(moved) == ["n2"]

                # Well within the watcher's 60 s safety refresh, which would otherwise re-read it too.
                await wait_until(refreshed, timeout_s=15, message="the refreshed map")
                assert (await pmap())["generation"] > stale_generation
                r = await http.get(key_url("moving", key))
                assert r.headers["x-keyroute-hops"] == "0" and r.headers["x-keyroute-node"] == "n2"
                source.watcher.release_watches()
        finally:
            await router.stop(grace_s=5.0)

    try:
        c.start("n1")
        wait_for(lambda: serving("n1") == {0, 1, 2, 3}, timeout_s=30, message="n1 serving everything")
        asyncio.run(scenario())
    finally:
        c.close()
        print(c.logs())
        zk.close(client)


def partition_of_moving(text: str) -> int:
    return partition_for(Partitioner.MURMUR2, text.encode("utf-8"), 4)


def test_a_node_whose_session_expired_registers_and_announces_again(tmp_path: Path, zk_settings: ZkSettings) -> None:
    """The node served in this process, so its ZooKeeper session can be expired the way kazoo's own test
    harness does it: a second client joins the session and closes it."""
    client = zk.connect(zk_settings)
    rows = {f"k{i}": {"i": i} for i in range(20)}
    snapshot = write_snapshot(tmp_path / "snapshots", "s", rows, KeyFormat.STRING, 2)
    record = StoreRecord("s", 2, Partitioner.MURMUR2, KeyFormat.STRING, 1, snapshot, ("v",), 1, 1.0)
    client.create(zk_layout.store_path("s"), record.to_json())
    settings = NodeSettings(node_id="solo", data_dir=tmp_path / "solo", zk=zk_settings, lmdb_map_size_bytes=1 << 24)

    def owner(path: str) -> int | None:
        stat = client.exists(path)
        return stat.ephemeralOwner if stat is not None else None

    async def scenario() -> None:
        app = create_node(settings)
        node = HttpServer(app, node_server_limits(settings), data_plane=NodeDataPlane.from_state)
        await node.start(port=0)
        try:
            base_url = f"http://127.0.0.1:{node.port}"
            async with httpx.AsyncClient(base_url=base_url, trust_env=False, timeout=10) as http:
                await wait_until(lambda: owner(zk_layout.serving_path("solo")), message="serving record", timeout_s=30)
                await wait_until(lambda: _ready(http), message="ready", timeout_s=30)
                node_client = app.state.node.registration._client
                first_session = node_client.client_id[0]
                assert owner(zk_layout.node_path("solo")) == first_session

                intruder = KazooClient(hosts=zk_settings.connect_string, client_id=node_client.client_id)
                intruder.start()
                intruder.stop()  # closing the session: the node's ephemeral records go with it
                intruder.close()
                # Both records: the node writes them in two steps, not necessarily node record first.
                await wait_until(
                    lambda: all(
                        owner(path) not in (None, first_session)
                        for path in (zk_layout.serving_path("solo"), zk_layout.node_path("solo"))
                    ),
                    message="records written again under a new session",
                    timeout_s=30,
                )
                assert owner(zk_layout.node_path("solo")) not in (None, first_session)
                raw, _ = client.get(zk_layout.serving_path("solo"))
                assert ServingRecord.from_json(raw).stores == {"s": {0: 1, 1: 1}}
                r = await wait_until(lambda: _ready(http), message="ready again with a fresh map", timeout_s=20)
                assert r.json()["stale"] is False
                assert (await http.get(key_url("s", "k3"))).json()["value"] == {"i": 3}
        finally:
            await node.stop(grace_s=5.0)

    try:
        asyncio.run(scenario())
    finally:
        zk.close(client)


async def _ready(http: httpx.AsyncClient) -> httpx.Response | None:
    r = await http.get("/readyz")
    return r if r.status_code == 200 and not r.json()["stale"] else None


def test_a_leaving_controller_writes_an_assignment_without_itself_then_resigns(
    zk_settings: ZkSettings,
) -> None:
    admin, first, second = (zk.connect(zk_settings) for _ in range(3))
    record = StoreRecord("s", 6, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/unused", (), 1)
    admin.create(zk_layout.store_path("s"), record.to_json())
    clients = {"a": first, "b": second}
    for node_id, client in clients.items():
        record_json = NodeRecord(node_id, f"http://{node_id}").to_json()
        client.create(zk_layout.node_path(node_id), record_json, ephemeral=True)
    controllers = {node_id: Controller(client, node_id) for node_id, client in clients.items()}

    def assignment() -> Assignment | None:
        return placement_records.read(admin)[0]

    try:
        for controller in controllers.values():
            controller.start()
        wait_for(lambda: (a := assignment()) and {n for r in a.stores["s"] for n in r} == {"a", "b"})
        leader_id = next(n for n, c in controllers.items() if c.is_leader)
        other_id = "b" if leader_id == "a" else "a"
        leader = controllers[leader_id]

        # What a node does on SIGTERM: its record says leaving, then its controller is told.
        leaving = NodeRecord(leader_id, f"http://{leader_id}", leaving=True)
        clients[leader_id].set(zk_layout.node_path(leader_id), leaving.to_json())
        leader.leave()
        wait_for(lambda: leader.resigned and not leader.is_leader, message="the leader to resign")
        final = assignment()
        assert final is not None and {n for r in final.stores["s"] for n in r} == {other_id}
        wait_for(lambda: controllers[other_id].is_leader, timeout_s=20, message="the other to take over")
        assert not leader.is_leader  # and it does not contend again
    finally:
        for controller in controllers.values():
            controller.stop()
        for client in (admin, first, second):
            zk.close(client)


def test_a_replication_factor_above_the_live_nodes_is_allowed_and_said_once(
    zk_settings: ZkSettings, caplog: pytest.LogCaptureFixture
) -> None:
    admin, client = zk.connect(zk_settings), zk.connect(zk_settings)
    record = StoreRecord("wide", 4, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/unused", (), 3)
    admin.create(zk_layout.store_path("wide"), record.to_json())
    client.create(zk_layout.node_path("a"), b'{"node_id": "a", "url": "http://a"}', ephemeral=True)
    controller = Controller(client, "a")
    try:
        with caplog.at_level("WARNING", logger="keyroute.state_node.controller"):
            controller.start()

            def assigned() -> Assignment | None:
                return placement_records.read(admin)[0]

            done = wait_for(lambda: (a := assigned()) and a.stores.get("wide") and a, message="the assignment")
            assert all(replicas == ("a",) for replicas in done.stores["wide"])  # one replica per live node
            said = [r.getMessage() for r in caplog.records if "asks for 3 replicas" in r.getMessage()]
            assert said == ["store wide asks for 3 replicas of each partition but 1 node(s) can take them: "
                            "each partition gets 1 until more nodes join"]  # fmt: skip
    finally:
        controller.stop()
        zk.close(client)
        zk.close(admin)
