"""Planned restarts (keyroute.state_node.restarts): the restart record, the controller's holds and their end by
an injected clock, and how a stopping node tells a restart from a departure (keyroute.state_node.service)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from kazoo.exceptions import NoNodeError

from keyroute.api import NoPartitionMap, StoreNotFound
from keyroute.cluster.partition_map import Assignment, NodeRecord, PartitionMap, RecordError
from keyroute.state_node.controller import Controller
from keyroute.state_node.reads import find_store
from keyroute.state_node.restarts import Holds, PlannedRestart, holds
from keyroute.state_node.service import stop_gracefully


def test_a_restart_record_reads_back_as_written() -> None:
    record = PlannedRestart("n3", 1000.5, 120.0, "eu-west-1a")
    assert PlannedRestart.from_json(record.to_json()) == record
    assert record.ends_at == 1120.5
    assert PlannedRestart.from_json(PlannedRestart("n3", 1000, 0).to_json()).zone == ""


@pytest.mark.parametrize(
    "raw",
    [b"", b"[]", b'{"at": 1, "grace_s": 2}', b'{"node_id": "n", "at": "x", "grace_s": 2}',
     b'{"node_id": "n", "at": 1, "grace_s": -1}', b'{"node_id": "n", "at": 1, "grace_s": true}',
     b'{"node_id": "n", "at": 1, "grace_s": NaN}'],
)  # fmt: skip
def test_an_unreadable_restart_record_is_refused(raw: bytes) -> None:
    with pytest.raises(RecordError, match="^restart record: "):
        PlannedRestart.from_json(raw)


def test_a_node_is_held_until_its_grace_ends_and_then_no_longer() -> None:
    records = {"n3": PlannedRestart("n3", 1000.0, 120.0, "z3")}
    assert holds(records, {"n1", "n2"}, now=1000.0) == Holds({"n3": "z3"}, (), 1120.0)
    assert holds(records, {"n1", "n2"}, now=1119.9) == Holds({"n3": "z3"}, (), 1120.0)
    assert holds(records, {"n1", "n2"}, now=1120.0) == Holds({}, ("n3",), None)
    assert holds(records, {"n1", "n2"}, now=5000.0) == Holds({}, ("n3",), None)


def test_a_node_back_is_live_whatever_its_record_says() -> None:
    records = {"n3": PlannedRestart("n3", 1000.0, 120.0)}
    assert holds(records, {"n1", "n2", "n3"}, now=1010.0) == Holds()
    assert holds(records, {"n3"}, now=9999.0) == Holds()  # not expired either: the node deletes it itself


def test_unreadable_or_misnamed_records_hold_nothing_and_the_first_end_wakes_the_controller() -> None:
    records = {
        "n2": PlannedRestart("n2", 1000.0, 30.0),
        "n3": PlannedRestart("n3", 990.0, 120.0),
        "n4": None,
        "n5": PlannedRestart("n6", 1000.0, 120.0),
    }
    assert holds(records, {"n1"}, now=1001.0) == Holds({"n2": "", "n3": ""}, ("n4", "n5"), 1030.0)
    assert holds(records, {"n1"}, now=1030.0) == Holds({"n3": ""}, ("n2", "n4", "n5"), 1110.0)


# -- how a stopping node tells a restart from a departure ---------------------------------------------------


class FakeRegistration:
    def __init__(self, *, drain: bool = False, fails: bool = False) -> None:
        self.drain, self.fails = drain, fails
        self.restarts: list[tuple[float, float]] = []

    def drain_requested(self) -> bool:
        if self.fails:
            raise ConnectionError("ZooKeeper unreachable")
        return self.drain

    def mark_restarting(self, grace_s: float, at: float) -> None:
        self.restarts.append((grace_s, at))


class FakeOwnership:
    map = PartitionMap.empty()

    def __init__(self) -> None:
        self.calls: list[str] = []

    def alone(self) -> int | None:
        return None

    def serving_view(self) -> dict[str, dict[int, int]]:
        return {}

    def leave(self) -> None:
        self.calls.append("leave")

    async def withdraw(self) -> None:
        self.calls.append("withdraw")

    async def wait_for_map(self, predicate: Any, timeout_s: float) -> bool:
        self.calls.append("wait_for_map")
        return bool(predicate(PartitionMap.empty()))


def fake_node(grace_s: float, registration: FakeRegistration | None) -> Any:
    node = SimpleNamespace(
        node_id="n3",
        settings=SimpleNamespace(restart_grace_s=grace_s),
        registration=registration,
        ownership=FakeOwnership(),
        departures=0,
    )

    async def leave() -> None:
        node.departures += 1

    node.leave = leave
    return node


def test_a_sigterm_is_a_planned_restart_recorded_before_the_node_de_announces() -> None:
    registration = FakeRegistration()
    node = fake_node(120.0, registration)
    asyncio.run(stop_gracefully(node, clock=lambda: 1234.5))
    assert registration.restarts == [(120.0, 1234.5)]
    assert node.ownership.calls == ["leave", "withdraw", "wait_for_map"]
    assert node.departures == 0


@pytest.mark.parametrize(
    ("grace_s", "registration"),
    [(0.0, FakeRegistration()), (120.0, FakeRegistration(drain=True)), (120.0, FakeRegistration(fails=True))],
    ids=["no grace", "drain requested", "zookeeper unreachable"],
)
def test_otherwise_the_node_departs_and_hands_its_partitions_over(
    grace_s: float, registration: FakeRegistration
) -> None:
    node = fake_node(grace_s, registration)
    asyncio.run(stop_gracefully(node, clock=lambda: 1.0))
    assert node.departures == 1
    assert registration.restarts == []
    assert node.ownership.calls == []



def test_a_node_that_has_not_read_its_map_yet_says_so_rather_than_no_such_store() -> None:
    # A restarting node listens before it has read its map, and routers send it reads of the partitions nobody
    # announces meanwhile (it served them last): 503 and a retry, never 404 for a store that exists.
    with pytest.raises(NoPartitionMap):
        find_store(PartitionMap.empty().marked_stale(True), "bookings")
    with pytest.raises(StoreNotFound):
        find_store(PartitionMap.empty(), "bookings")


# -- the controller's view of the nodes, on a stand-in for ZooKeeper ------------------------------------------


class _Pending:
    def __init__(self, data: bytes | None) -> None:
        self._data = data

    def get(self) -> tuple[bytes, None]:
        if self._data is None:
            raise NoNodeError()
        return self._data, None


class FakeZooKeeper:
    """Listings and records; a record in `vanishing` is listed but gone when read (deleted in between)."""

    def __init__(self, records: dict[str, bytes], vanishing: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.records, self.vanishing = records, set(vanishing)
        self.deleted: list[str] = []

    def get_children(self, parent: str, watch: Any = None) -> list[str]:
        listed = {p for p in self.records if p.startswith(parent + "/")} | {
            p for p in self.vanishing if p.startswith(parent + "/")
        }
        return sorted(p[len(parent) + 1 :] for p in listed)

    def get_async(self, path: str, watch: Any = None) -> _Pending:
        return _Pending(None if path in self.vanishing else self.records.get(path))

    def exists(self, path: str) -> object | None:
        return object() if path in self.records else None

    def delete(self, path: str) -> None:
        self.deleted.append(path)
        if path not in self.records:
            raise NoNodeError()
        del self.records[path]


def _node(node_id: str, zone: str = "", leaving: bool = False) -> bytes:
    return NodeRecord(node_id, f"http://{node_id}:1", leaving=leaving, zone=zone).to_json()


def test_the_controller_places_a_restarting_node_until_its_grace_ends_then_drops_its_record() -> None:
    now = [1000.0]
    zk_ = FakeZooKeeper(
        {
            "/nodes/n1": _node("n1", "a"),
            "/nodes/n2": _node("n2", "b"),
            "/restarting/n3": PlannedRestart("n3", 990.0, 30.0, "c").to_json(),
        }
    )
    controller = Controller(zk_, "n1", clock=lambda: now[0])  # type: ignore[arg-type]
    assert controller.assignable_nodes(set(), set()) == {"n1": "a", "n2": "b", "n3": "c"}
    assert controller.holds.next_end == 1020.0
    now[0] = 1020.0
    assert controller.assignable_nodes(set(), set()) == {"n1": "a", "n2": "b"}
    assert zk_.deleted == ["/restarting/n3"] and "/restarting/n3" not in zk_.records


def test_a_node_whose_record_vanishes_between_listing_and_reading_is_held_by_its_restart_record() -> None:
    # A new controller lists /nodes while the restarting node (the old controller) deletes its record.
    zk_ = FakeZooKeeper(
        {"/nodes/n1": _node("n1"), "/restarting/n2": PlannedRestart("n2", 1000.0, 120.0).to_json()},
        vanishing={"/nodes/n2"},
    )
    controller = Controller(zk_, "n1", clock=lambda: 1001.0)  # type: ignore[arg-type]
    assert controller.assignable_nodes(set(), set()) == {"n1": "", "n2": ""}


def test_a_leaving_node_is_not_held_whatever_its_restart_record_says() -> None:
    zk_ = FakeZooKeeper(
        {
            "/nodes/n1": _node("n1"),
            "/nodes/n2": _node("n2", leaving=True),
            "/restarting/n2": PlannedRestart("n2", 1000.0, 120.0).to_json(),
        }
    )
    controller = Controller(zk_, "n1", clock=lambda: 1001.0)  # type: ignore[arg-type]
    assert controller.assignable_nodes(set(), set()) == {"n1": ""}


def test_a_node_that_came_back_between_the_controllers_two_listings_keeps_its_partitions() -> None:
    # Listed: the nodes (n2 not registered yet), then n2 registers and deletes its restart record, then the
    # restart records (none): n2 looks gone; the controller looks once more before reassigning.
    zk_ = FakeZooKeeper({"/nodes/n1": _node("n1")})
    controller = Controller(zk_, "n1", clock=lambda: 1001.0)  # type: ignore[arg-type]
    zones = controller.assignable_nodes(set(), set())
    assert zones == {"n1": ""}
    previous = Assignment(7, {"s": (("n1", "n2"), ("n2", "n1"))})
    assert not controller.back_meanwhile(previous, zones)  # n2 gone for good: its partitions move
    zk_.records["/nodes/n2"] = _node("n2")  # ...or back meanwhile: read again first
    assert controller.back_meanwhile(previous, zones)
