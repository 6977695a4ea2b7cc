"""The embedded ZooKeeper and the partition-map watcher, against a real server."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from kazoo.client import KazooClient

from keyroute.cluster import placement_records, zk_layout
from keyroute.cluster.map_watcher import MapWatcher
from keyroute.cluster.partition_map import Assignment, NodeRecord, PartitionMap, ServingRecord, StoreRecord
from keyroute.cluster.zk import close, connect
from keyroute.dev.zookeeper_server import EmbeddedZooKeeper, four_letter_word, is_serving
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.runtime.settings import ZkSettings
from tests.util import Proc, free_port, wait_for

pytestmark = pytest.mark.integration


def test_session_server_is_a_real_zookeeper(zk_server: EmbeddedZooKeeper) -> None:
    assert four_letter_word(zk_server.host, zk_server.port, "ruok") == "imok"
    assert "Mode: standalone" in four_letter_word(zk_server.host, zk_server.port, "srvr")


def test_connect_creates_a_missing_chroot_and_the_layout(zk_settings: ZkSettings, zk_server: EmbeddedZooKeeper) -> None:
    client = connect(zk_settings)
    try:
        assert sorted(client.get_children("/")) == sorted(p.strip("/") for p in zk_layout.PERSISTENT_ROOTS)
    finally:
        close(client)
    root = KazooClient(hosts=zk_server.connect_string)
    root.start(timeout=10)
    try:
        assert root.exists(zk_settings.chroot) is not None
    finally:
        root.stop()
        root.close()


def test_cli_runs_zookeeper_in_the_foreground(tmp_path: Path) -> None:
    port = free_port()
    proc = Proc(["zookeeper", "--port", str(port), "--data-dir", str(tmp_path / "zk")], tmp_path / "zk.log").start()
    try:
        wait_for(lambda: is_serving("127.0.0.1", port), timeout_s=60, message="keyroute zookeeper to serve")
        client = connect(ZkSettings(hosts=f"127.0.0.1:{port}", chroot="/cli"))
        client.create("/stores/probe", b"{}")
        assert client.exists("/stores/probe")
        close(client)
    finally:
        proc.stop()
    assert not proc.alive
    # It says where it listens, once, and nothing else at start-up (no warning about settings we chose).
    lines = [line for line in proc.output().splitlines() if line.strip()]
    assert [line.split(" ", 1)[1] for line in lines[:1]] == [
        f"zookeeper INFO  NIOServerCnxnFactory: binding to port /127.0.0.1:{port}"
    ]
    assert not [line for line in lines if " WARN " in line or " ERROR " in line], lines


def test_watcher_pushes_every_change_and_marks_stale_when_disconnected(zk_settings: ZkSettings) -> None:
    writer = connect(zk_settings)
    reader = connect(zk_settings)
    seen: list[PartitionMap] = []
    lock = threading.Lock()

    def on_map(pmap: PartitionMap) -> None:
        with lock:
            seen.append(pmap)

    watcher = MapWatcher(reader, on_map)
    watcher.start()
    try:
        wait_for(lambda: seen and not seen[-1].stale, message="first map")
        record = StoreRecord("s", 2, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/snap/s/v1")
        writer.create(zk_layout.store_path("s"), record.to_json())
        writer.create(zk_layout.ASSIGNMENT, Assignment(1, {"s": (("n1",), ("n1",))}).to_json())
        serving = ServingRecord("n1", "http://127.0.0.1:1", {"s": {0: 1}})
        writer.create(zk_layout.serving_path("n1"), serving.to_json(), ephemeral=True)
        first = wait_for(lambda: watcher.current.serving_endpoints("s", 0) and watcher.current, message="serving seen")
        assert not first.complete
        assert first.assignment.generation == 1
        both = ServingRecord("n1", "http://127.0.0.1:1", {"s": {0: 1, 1: 1}})
        writer.set(zk_layout.serving_path("n1"), both.to_json())
        done = wait_for(lambda: watcher.current.complete and watcher.current, message="complete map")
        assert done.generation > first.generation
        # The ephemeral record vanishes with its session: the map follows.
        close(writer)
        wait_for(lambda: not watcher.current.serving_endpoints("s", 0), message="serving record gone")
    finally:
        watcher.stop()
        close(reader)


def test_watcher_keeps_the_last_map_marked_stale_while_zookeeper_is_down(tmp_path: Path) -> None:
    server = EmbeddedZooKeeper(port=free_port(), data_dir=tmp_path / "zk").start()
    settings = ZkSettings(hosts=server.connect_string, chroot="/outage", session_timeout_s=30.0)
    client = connect(settings)
    watcher = MapWatcher(client, lambda _m: None)
    watcher.start()
    try:
        record = StoreRecord("s", 1, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/snap/s/v1")
        client.create(zk_layout.store_path("s"), record.to_json())
        wait_for(lambda: "s" in watcher.current.stores and not watcher.current.stale, message="map with s")
        server.stop()
        stale = wait_for(lambda: watcher.current.stale and watcher.current, timeout_s=30, message="stale map")
        assert "s" in stale.stores  # still the last known map
        server.start()
        wait_for(lambda: not watcher.current.stale, timeout_s=60, message="fresh map after reconnect")
        assert "s" in watcher.current.stores
    finally:
        watcher.stop()
        close(client)
        server.stop()


def test_the_watcher_reads_the_per_store_assignment_and_never_a_half_written_one(zk_settings: ZkSettings) -> None:
    writer = connect(zk_settings)
    reader = connect(zk_settings)
    watcher = MapWatcher(reader, lambda _map: None)
    watcher.start()
    try:
        for name in ("a", "b"):
            record = StoreRecord(name, 2, Partitioner.MURMUR2, KeyFormat.STRING, 1, f"/snap/{name}/v1")
            writer.create(zk_layout.store_path(name), record.to_json())
        first = {"a": (("n1",), ("n2",)), "b": (("n2",), ("n1",))}
        for name, replicas in first.items():
            writer.create(zk_layout.placement_path(name), placement_records.placement_record(1, replicas))
        writer.set(zk_layout.PLACEMENT, placement_records.root_record(1, {"a": 1, "b": 1}))
        wait_for(lambda: watcher.current.assignment.generation == 1, message="generation 1")
        assert dict(watcher.current.assignment.stores) == first
        # Generation 2 half-written: b's record is new, the root still names generation 1 of it. A re-read
        # meanwhile (any change) keeps generation 1 whole.
        writer.set(zk_layout.placement_path("b"), placement_records.placement_record(2, (("n1",), ("n1",))))
        for _ in range(2):  # after the second read, the first one's map has been published
            reads = watcher.reads
            watcher.refresh()
            wait_for(lambda: watcher.reads > reads, message="a re-read")  # noqa: B023 (waited on at once)
        assert watcher.current.assignment.generation == 1 and dict(watcher.current.assignment.stores) == first
        # The root, written last, completes it.
        writer.set(zk_layout.PLACEMENT, placement_records.root_record(2, {"a": 1, "b": 2}))
        done = wait_for(lambda: watcher.current.assignment.generation == 2 and watcher.current, message="gen 2")
        assert dict(done.assignment.stores) == {"a": first["a"], "b": (("n1",), ("n1",))}
    finally:
        watcher.stop()
        close(reader)
        close(writer)


def whole_map(client: KazooClient) -> PartitionMap:
    """The map of what ZooKeeper holds now, read whole without any watcher."""

    def records(parent: str, parse: object) -> dict[str, object]:
        out = {}
        for name in client.get_children(parent):
            data, _ = client.get(f"{parent}/{name}")
            out[name] = parse(data)  # type: ignore[operator]
        return out

    stores = records(zk_layout.STORES, StoreRecord.from_json)
    nodes = records(zk_layout.NODES, NodeRecord.from_json)
    serving = records(zk_layout.SERVING, ServingRecord.from_json)
    assignment = placement_records.read(client)[0] or Assignment(0)
    return PartitionMap.build(stores, nodes, assignment, serving)  # type: ignore[arg-type]


def same_map(a: PartitionMap, b: PartitionMap) -> bool:
    return (
        dict(a.stores) == dict(b.stores)
        and dict(a.nodes) == dict(b.nodes)
        and dict(a.serving) == dict(b.serving)
        and dict(a.assignment.stores) == dict(b.assignment.stores)
        and dict(a.routes) == dict(b.routes)
    )


def test_the_watcher_follows_each_change_by_reading_only_what_changed(zk_settings: ZkSettings) -> None:
    writer = connect(zk_settings)
    reader = connect(zk_settings)
    maps: list[PartitionMap] = []
    watcher = MapWatcher(reader, maps.append, safety_refresh_s=600.0)  # only watches bring changes

    def store(name: str, partitions: int, version: int) -> StoreRecord:
        return StoreRecord(name, partitions, Partitioner.MURMUR2, KeyFormat.STRING, version, f"/snap/{name}/v{version}")

    def serving(node: str, stores: dict[str, dict[int, int]]) -> bytes:
        return ServingRecord(node, f"http://{node}", stores).to_json()

    def placed(generation: int, stores: dict[str, tuple[tuple[str, ...], ...]]) -> None:
        for name, replicas in stores.items():
            path = zk_layout.placement_path(name)
            if writer.exists(path):
                writer.set(path, placement_records.placement_record(generation, replicas))
            else:
                writer.create(path, placement_records.placement_record(generation, replicas))
        writer.set(zk_layout.PLACEMENT, placement_records.root_record(generation, dict.fromkeys(stores, generation)))

    def caught_up(what: str) -> PartitionMap:
        expected = whole_map(writer)
        return wait_for(lambda: same_map(watcher.current, expected) and watcher.current, message=what)

    try:
        for name in ("a", "b"):
            writer.create(zk_layout.store_path(name), store(name, 4, 1).to_json())
        for node in ("n1", "n2", "n3"):
            writer.create(zk_layout.node_path(node), NodeRecord(node, f"http://{node}").to_json())
        writer.create(zk_layout.serving_path("n1"), serving("n1", {"a": {0: 1, 1: 1}, "b": {0: 1, 1: 1}}))
        writer.create(zk_layout.serving_path("n2"), serving("n2", {"a": {2: 1, 3: 1}, "b": {2: 1, 3: 1}}))
        placed(1, {"a": (("n1",), ("n1",), ("n2",), ("n2",)), "b": (("n1",), ("n1",), ("n2",), ("n2",))})
        watcher.start()
        first = caught_up("the first map")
        assert first.complete
        full_reads = watcher.full_reads

        # One node's serving record: only its partitions are recomputed.
        writer.set(zk_layout.serving_path("n2"), serving("n2", {"a": {2: 1, 3: 1}, "b": {2: 1}}))
        after = caught_up("n2 dropping b/3")
        assert after.delta is not None and set(after.delta.stores) <= {"b"}
        assert after.routes["a"] is first.routes["a"] and after.routes["b"][3] == ()
        # A node comes with its serving record; another goes; a store moves to a new version; a new
        # assignment names one store at a new generation; a store is removed; a new store comes.
        writer.create(zk_layout.serving_path("n3"), serving("n3", {"b": {3: 1}, "a": {0: 2}}))
        caught_up("n3 serving")
        writer.delete(zk_layout.serving_path("n1"))
        writer.delete(zk_layout.node_path("n1"))
        caught_up("n1 gone")
        writer.set(zk_layout.store_path("a"), store("a", 4, 2).to_json())
        caught_up("a at version 2")
        placed(2, {"b": (("n3",), ("n3",), ("n2",), ("n3",))})  # the root names only b now
        caught_up("the assignment of generation 2")
        # A record that vanishes without a tombstone is absence, not deletion: its last record stays.
        writer.delete(zk_layout.store_path("a"))
        orphaned = wait_for(lambda: "a" in watcher.current.orphaned and watcher.current, message="a orphaned")
        assert orphaned.stores["a"] == store("a", 4, 2) and "a" in orphaned.routes
        # Its tombstone (`keyroute store delete`) deletes it.
        writer.create(zk_layout.deleted_path("a"), json.dumps({"store": "a", "versions": [1, 2]}).encode())
        writer.create(zk_layout.store_path("c"), store("c", 2, 1).to_json())
        writer.set(zk_layout.serving_path("n3"), serving("n3", {"b": {3: 1}, "c": {0: 1, 1: 1}}))
        final = caught_up("store a gone, c new")
        assert set(final.routes) == {"b", "c"} and final.store_complete("c")
        assert final.deleted == {"a": 2} and final.orphaned == frozenset()
        # A burst: many changes to one record, then the last state is what the watcher shows.
        for i in range(30):
            writer.set(zk_layout.serving_path("n2"), serving("n2", {"b": {p: 1 for p in range(4) if p != i % 4}}))
        caught_up("the last of a burst")
        # Each change was followed by reading what it named: never the whole cluster again.
        assert watcher.full_reads == full_reads
        # A whole re-read (a node told us our map is stale) finds nothing new and gives the same map.
        watcher.refresh()
        wait_for(lambda: watcher.full_reads > full_reads, message="a whole re-read")
        assert same_map(watcher.current, whole_map(writer))
    finally:
        watcher.stop()
        close(reader)
        close(writer)


def test_a_controller_finishes_what_a_predecessor_wrote_before_it_could_write_the_root(
    zk_settings: ZkSettings,
) -> None:
    """A controller that crashed after writing a store record of the next assignment but before the root leaves
    that record ahead of the root. Its successor's assignment may give that store the very same replicas: the
    root it writes must then name the record as it is, or readers would wait for it forever."""
    from keyroute.state_node.controller import Controller
    from keyroute.state_node.placement import assign

    admin = connect(zk_settings)
    fleet = connect(zk_settings)
    reader = connect(zk_settings)
    watcher = MapWatcher(reader, lambda _map: None)
    controller: Controller | None = None
    shapes = {"a": (6, 2), "b": (6, 2)}
    try:
        for name, (partitions, rf) in shapes.items():
            record = StoreRecord(name, partitions, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/snap", ("v",), rf)
            admin.create(zk_layout.store_path(name), record.to_json())
        for node in ("n1", "n2"):
            fleet.create(zk_layout.node_path(node), NodeRecord(node, f"http://{node}").to_json(), ephemeral=True)
        # The assignment for n1 and n2 (generation 1), then the one for three nodes as the crashed controller
        # computed it: only b's record of it was written.
        first = assign(shapes, ["n1", "n2"], None, 1)
        for name, replicas in first.stores.items():
            admin.create(zk_layout.placement_path(name), placement_records.placement_record(1, replicas))
        admin.set(zk_layout.PLACEMENT, placement_records.root_record(1, {"a": 1, "b": 1}))
        second = assign(shapes, ["n1", "n2", "n3"], first, 2)
        admin.set(zk_layout.placement_path("b"), placement_records.placement_record(2, second.stores["b"]))
        fleet.create(zk_layout.node_path("n3"), NodeRecord("n3", "http://n3").to_json(), ephemeral=True)

        watcher.start()
        controller = Controller(admin, "n1")
        controller.start()
        done = wait_for(
            lambda: (a := watcher.current.assignment).generation >= 2
            and any("n3" in reps for per in a.stores.values() for reps in per)
            and a,
            timeout_s=20,
            message="readers to take the successor's assignment",
        )
        assert placement_records.read(admin)[0] == done  # whole, not in progress
    finally:
        if controller is not None:
            controller.stop()
        watcher.stop()
        for client in (reader, fleet, admin):
            close(client)


def test_after_its_session_expired_the_watcher_reads_everything_again(zk_settings: ZkSettings) -> None:
    """Watches die with a session: a watcher whose session expired reads (and watches) every record again
    once it has a new one, so changes made meanwhile are in its map and later ones keep arriving."""
    writer = connect(zk_settings)
    reader = connect(zk_settings)
    watcher = MapWatcher(reader, lambda _map: None, safety_refresh_s=600.0)
    watcher.start()
    try:
        record = StoreRecord("s", 2, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/snap/s/v1")
        writer.create(zk_layout.store_path("s"), record.to_json())
        writer.create(zk_layout.serving_path("n1"), ServingRecord("n1", "http://n1", {"s": {0: 1}}).to_json())
        wait_for(lambda: same_map(watcher.current, whole_map(writer)), message="the first map")
        full_reads = watcher.full_reads
        old_session = reader.client_id
        # Expire the reader's session: a second client on the same session id closes it.
        twin = KazooClient(hosts=zk_settings.hosts, client_id=reader.client_id)
        twin.start(timeout=10)
        twin.stop()
        twin.close()
        version_2 = StoreRecord("s", 2, Partitioner.MURMUR2, KeyFormat.STRING, 2, "/snap/s/v2")
        writer.set(zk_layout.store_path("s"), version_2.to_json())
        writer.create(zk_layout.serving_path("n2"), ServingRecord("n2", "http://n2", {"s": {1: 2}}).to_json())
        wait_for(lambda: reader.client_id != old_session and reader.connected, timeout_s=30, message="a new session")
        wait_for(lambda: same_map(watcher.current, whole_map(writer)), timeout_s=30, message="what changed meanwhile")
        assert watcher.full_reads > full_reads
        # Watches are in place again on the new session.
        writer.set(zk_layout.serving_path("n2"), ServingRecord("n2", "http://n2", {"s": {0: 2, 1: 2}}).to_json())
        wait_for(lambda: same_map(watcher.current, whole_map(writer)), message="a change after the new session")
    finally:
        watcher.stop()
        close(reader)
        close(writer)


def test_a_record_deleted_and_created_again_in_quick_succession_is_never_lost(zk_settings: ZkSettings) -> None:
    """A restarting node deletes and re-creates its records; the watcher may see the deletion's events in one
    turn and the listing in another. Whatever the interleaving, the map ends with the record as written last."""
    writer = connect(zk_settings)
    reader = connect(zk_settings)
    watcher = MapWatcher(reader, lambda _map: None, safety_refresh_s=600.0)
    watcher.start()
    try:
        record = StoreRecord("s", 8, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/snap/s/v1")
        writer.create(zk_layout.store_path("s"), record.to_json())
        path = zk_layout.serving_path("n1")
        for round_ in range(40):
            if writer.exists(path):
                writer.delete(path)
            served = ServingRecord("n1", "http://n1", {"s": {round_ % 8: 1}})
            writer.create(path, served.to_json())
            if round_ % 5 == 4:  # let the watcher's turns fall between the two writes now and then
                wait_for(lambda: same_map(watcher.current, whole_map(writer)), message="the record re-created")
        wait_for(lambda: same_map(watcher.current, whole_map(writer)), message="the last record")
    finally:
        watcher.stop()
        close(reader)
        close(writer)
