"""Each node's share of the assignment in a record of its own (/assigned/{node}): written by a real controller
ahead of the root, kept in line through joins, leaves and a takeover, and followed by a node's map watcher, which
reads it rather than every placement record (a real ZooKeeper)."""

from __future__ import annotations

import pytest
from kazoo.client import KazooClient

from keyroute.cluster import placement_records, zk_layout
from keyroute.cluster.map_watcher import MapWatcher
from keyroute.cluster.partition_map import Assignment, NodeRecord, StoreRecord
from keyroute.cluster.zk import close, connect
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.runtime.settings import ZkSettings
from keyroute.state_node.controller import Controller
from tests.util import wait_for

pytestmark = pytest.mark.integration

SHAPES = {f"s{i}": (8, 2) for i in range(6)}
ME = "n2"


def _written(admin: KazooClient) -> dict[str, placement_records.Share]:
    out = {}
    for name in admin.get_children(zk_layout.ASSIGNED):
        out[name] = placement_records.parse_share_record(admin.get(zk_layout.assigned_path(name))[0])[1]
    return out


def _in_line(admin: KazooClient) -> Assignment | None:
    """The assignment the root names, once every share record holds that node's share of it (else None)."""
    try:
        whole = placement_records.read(admin)[0]
    except placement_records.InProgress:
        return None
    return whole if whole is not None and _written(admin) == placement_records.shares(whole) else None


def test_share_records_follow_the_assignment_and_a_node_reads_only_its_own(zk_settings: ZkSettings) -> None:
    admin, fleet, node_zk, router_zk = (connect(zk_settings) for _ in range(4))
    node = MapWatcher(node_zk, lambda _map: None, safety_refresh_s=600.0, node_id=ME)
    router = MapWatcher(router_zk, lambda _map: None, safety_refresh_s=600.0)
    controllers: list[Controller] = []

    def join(name: str) -> None:
        fleet.create(zk_layout.node_path(name), NodeRecord(name, f"http://{name}").to_json(), ephemeral=True)

    def settled(what: str, check=lambda whole: True) -> Assignment:  # type: ignore[no-untyped-def]
        whole = wait_for(lambda: (w := _in_line(admin)) is not None and check(w) and w, message=what)
        wait_for(lambda: router.current.assignment == whole, message=f"the router: {what}")
        wait_for(
            lambda: node.current.assignment.generation == whole.generation
            and node.current.assignment.partitions_of(ME) == whole.partitions_of(ME),
            message=f"node {ME}: {what}",
        )
        return whole

    def members(whole: Assignment) -> set[str]:
        return {n for per in whole.stores.values() for reps in per for n in reps}

    try:
        for name, (partitions, rf) in SHAPES.items():
            record = StoreRecord(name, partitions, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/snap", ("v",), rf)
            admin.create(zk_layout.store_path(name), record.to_json())
        for name in ("n1", "n2", "n3", "n4"):
            join(name)
        node.start()
        router.start()
        controllers.append(Controller(admin, "n1"))
        controllers[0].start()
        whole = settled("the first assignment", lambda w: members(w) == {"n1", "n2", "n3", "n4"})
        # The node's map holds its own share only: no other node's id, and no placement record was read for it.
        assert all(set(reps) <= {ME} for per in node.current.assignment.stores.values() for reps in per)
        assert node.current.assignment.partitions_of(ME)

        # Asked to follow a store (it hands a partition over there), it gets that store's replicas whole.
        node.follow(frozenset({"s0"}))
        wait_for(lambda: node.current.assignment.stores.get("s0") == whole.stores["s0"], message="s0 followed")
        assert all(set(reps) <= {ME} for reps in node.current.assignment.stores["s1"])
        node.follow(frozenset())
        wait_for(lambda: all(set(reps) <= {ME} for reps in node.current.assignment.stores["s0"]), message="unfollowed")

        # A node joins: it gets a record, the nodes that gave it partitions get theirs rewritten.
        router_reads, node_reads = router.placement_records_read, node.placement_records_read
        join("n5")
        settled("n5 placed", lambda w: "n5" in members(w))
        # The router read every placement record the new assignment rewrote; the node, the root and its share.
        assert router.placement_records_read > router_reads and node.placement_records_read == node_reads

        # A node goes: its record goes with its share.
        fleet.delete(zk_layout.node_path("n3"))
        settled("n3 gone", lambda w: "n3" not in members(w))
        assert "n3" not in admin.get_children(zk_layout.ASSIGNED)

        # The controller stops; records are tampered with (as a predecessor that stopped between its root and
        # its share records would leave them); the next controller puts every one right before anything else.
        controllers[0].stop()
        admin.set(zk_layout.assigned_path(ME), placement_records.share_record(1, {"s0": (8, frozenset({7}))}))
        admin.delete(zk_layout.assigned_path("n4"))
        admin.create(zk_layout.assigned_path("ghost"), placement_records.share_record(1, {"s1": (8, frozenset({0}))}))
        admin.create(zk_layout.assigned_path("emptied"), placement_records.share_record(1, {}))  # never deleted
        controllers.append(Controller(admin, "n4"))
        controllers[1].start()
        settled("records put right by the next controller")
        assert not {"ghost", "emptied"} & set(admin.get_children(zk_layout.ASSIGNED))
    finally:
        for controller in controllers:
            controller.stop()
        node.stop()
        router.stop()
        for client in (router_zk, node_zk, fleet, admin):
            close(client)


def test_under_a_root_without_share_records_a_node_reads_every_placement_record(zk_settings: ZkSettings) -> None:
    """A controller from before share records (an upgrade in progress) writes no /assigned records: a node then
    reads the placement records as a router does, and switches to its own share once a root says it is written."""
    admin, reader = connect(zk_settings), connect(zk_settings)
    node = MapWatcher(reader, lambda _map: None, safety_refresh_s=600.0, node_id=ME)
    first = {"a": (("n1", ME), (ME, "n3")), "b": (("n3", "n1"),)}
    try:
        for name, replicas in first.items():
            admin.create(zk_layout.placement_path(name), placement_records.placement_record(1, replicas))
        admin.set(zk_layout.PLACEMENT, placement_records.root_record(1, {"a": 1, "b": 1}, share_records=False))
        node.start()
        wait_for(lambda: node.current.assignment == Assignment(1, first), message="the whole assignment")

        second = {"a": ((ME, "n3"), (ME, "n3")), "b": (("n3", "n1"),)}
        admin.set(zk_layout.placement_path("a"), placement_records.placement_record(2, second["a"]))
        admin.create(zk_layout.assigned_path(ME), placement_records.share_record(2, {"a": (2, frozenset({0, 1}))}))
        admin.set(zk_layout.PLACEMENT, placement_records.root_record(2, {"a": 2, "b": 1}))
        wait_for(
            lambda: node.current.assignment == Assignment(2, {"a": ((ME,), (ME,))}), message="this node's share alone"
        )

        # A record written ahead of the root (as the controller writes them) waits for the root to reach it.
        admin.set(zk_layout.assigned_path(ME), placement_records.share_record(3, {"b": (1, frozenset({0}))}))
        admin.create(zk_layout.node_path("n9"), NodeRecord("n9", "http://n9").to_json())  # seen after it
        wait_for(lambda: "n9" in node.current.nodes, message="the change after the record")
        assert node.current.assignment == Assignment(2, {"a": ((ME,), (ME,))})
        admin.set(zk_layout.placement_path("b"), placement_records.placement_record(3, ((ME,),)))
        admin.set(zk_layout.PLACEMENT, placement_records.root_record(3, {"a": 2, "b": 3}))
        wait_for(lambda: node.current.assignment == Assignment(3, {"b": ((ME,),)}), message="the share with its root")
    finally:
        node.stop()
        close(reader)
        close(admin)


def test_the_controller_follows_each_store_record_it_has_read_before(zk_settings: ZkSettings) -> None:
    """The controller re-reads a store record only when its watch fired: a change of shape, a store emptied
    and filled again (as the pipeline creates it), one deleted, one new are each placed."""
    admin, fleet = connect(zk_settings), connect(zk_settings)
    controller = Controller(admin, "n1")

    def store(name: str, partitions: int, rf: int) -> bytes:
        return StoreRecord(name, partitions, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/snap", ("v",), rf).to_json()

    def shapes() -> dict[str, tuple[int, int]] | None:
        whole = _in_line(admin)
        if whole is None:
            return None
        return {name: (len(per), max(len(reps) for reps in per)) for name, per in whole.stores.items()}

    try:
        for name in ("n1", "n2", "n3"):
            fleet.create(zk_layout.node_path(name), NodeRecord(name, f"http://{name}").to_json(), ephemeral=True)
        admin.create(zk_layout.store_path("a"), store("a", 4, 2))
        admin.create(zk_layout.store_path("b"), store("b", 2, 1))
        controller.start()
        wait_for(lambda: shapes() == {"a": (4, 2), "b": (2, 1)}, message="the first placement")
        admin.set(zk_layout.store_path("a"), store("a", 6, 3))
        wait_for(lambda: shapes() == {"a": (6, 3), "b": (2, 1)}, message="a with 6 partitions, rf 3")
        admin.delete(zk_layout.store_path("b"))
        admin.create(zk_layout.store_path("c"), b"")  # created first, published later
        wait_for(lambda: shapes() == {"a": (6, 3)}, message="b gone, c not published yet")
        admin.set(zk_layout.store_path("c"), store("c", 3, 2))
        wait_for(lambda: shapes() == {"a": (6, 3), "c": (3, 2)}, message="c published")
    finally:
        controller.stop()
        close(fleet)
        close(admin)
