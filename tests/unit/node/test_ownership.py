"""The node's partition lifecycle, driven by hand-built partition maps (no ZooKeeper, real LMDB)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

from keyroute.cluster.partition_map import Assignment, NodeRecord, PartitionMap, ServingRecord, StoreRecord
from keyroute.replica.store import PartitionId, PartitionStore, load_partition, partition_path
from keyroute.runtime.settings import NodeSettings
from keyroute.state_node.ownership import Ownership, PartitionState
from keyroute.storage.snapshot import local_path, partition_dir
from tests.clock import ManualClock
from tests.unit.node.test_store_files import data_file, write_files_snapshot
from tests.util import wait_until

ME = "n1"
OTHER = "n2"
ROWS = {f"k{i}": {"i": i} for i in range(40)}


class FakeRegistration:
    """Records what the node would have written to ZooKeeper."""

    def __init__(self) -> None:
        self.published: list[dict[str, dict[int, int]]] = []
        self.registrations = 0

    def publish_serving(self, stores: Mapping[str, Mapping[int, int]]) -> None:
        self.published.append({s: dict(parts) for s, parts in stores.items()})

    def register_node(self) -> None:
        self.registrations += 1

    def withdraw(self) -> None:
        pass

    def withdraw_serving(self) -> None:
        self.published.append({"<withdrawn>": {}})

    @property
    def last(self) -> dict[str, dict[int, int]] | None:
        return self.published[-1] if self.published else None


def build_map(
    stores: list[StoreRecord],
    assignment: Mapping[str, tuple[tuple[str, ...], ...]],
    serving: Mapping[str, Mapping[str, Mapping[int, int]]] | None = None,
    generation: int = 1,
    nodes: tuple[str, ...] = (ME, OTHER),
) -> PartitionMap:
    return PartitionMap.build(
        {s.name: s for s in stores},
        {n: NodeRecord(n, f"http://{n}") for n in nodes},
        Assignment(generation, dict(assignment)),
        {n: ServingRecord(n, f"http://{n}", {s: dict(p) for s, p in v.items()}) for n, v in (serving or {}).items()},
        generation=generation,
    )


def run(
    data_dir: Path,
    scenario: Callable[[Ownership, FakeRegistration], Coroutine[Any, Any, None]],
    **options: Any,
) -> None:
    async def main() -> None:
        registration = FakeRegistration()
        settings = NodeSettings(
            node_id=ME,
            data_dir=data_dir,
            lmdb_map_size_bytes=1 << 24,
            version_grace_s=options.pop("version_grace_s", 0.0),
        )
        options.setdefault("drop_grace_s", 0.0)
        options.setdefault("clock", ManualClock())  # no time passes unless the test says so
        ownership = Ownership(settings, registration, **options)  # type: ignore[arg-type]
        try:
            await scenario(ownership, registration)
        finally:
            await ownership.stop()

    asyncio.run(main())


def state(ownership: Ownership, store: str, version: int, partition: int) -> str | None:
    for row in ownership.describe().get(store, []):
        if row["version"] == version and row["partition"] == partition:
            return str(row["state"])
    return None


def test_a_partition_is_announced_only_once_loaded(snapshot, data_dir: Path) -> None:
    record = snapshot("s", 1, 2, ROWS)
    gate = threading.Event()

    def slow_loader(*args: Any) -> PartitionStore:
        gate.wait(10)
        return load_partition(*args)

    async def scenario(ownership: Ownership, registration: FakeRegistration) -> None:
        ownership.on_map(build_map([record], {"s": ((ME,), (ME, OTHER))}))
        await wait_until(lambda: state(ownership, "s", 1, 0) == "loading")
        assert ownership.local("s", 0) is None
        assert not ownership.readiness().ready
        assert "s v1 p0" in ownership.readiness().pending
        assert all(not stores for stores in registration.published)  # nothing announced yet
        gate.set()
        await wait_until(lambda: registration.last == {"s": {0: 1, 1: 1}})
        for text in ROWS:  # every row answers from one of the two local partitions
            found = [held.get(text.encode()) for held in (ownership.local("s", 0), ownership.local("s", 1)) if held]
            assert [v for v in found if v is not None] == [f'{{"i":{text[1:]}}}'.encode()]
        ownership.on_map(build_map([record], {"s": ((ME,), (ME, OTHER))}, {ME: {"s": {0: 1, 1: 1}}}, 2))
        assert ownership.readiness().ready

    run(data_dir, scenario, loader=slow_loader)


def test_make_before_break_when_a_partition_moves_away(snapshot, data_dir: Path) -> None:
    record = snapshot("s", 1, 2, ROWS)

    async def scenario(ownership: Ownership, registration: FakeRegistration) -> None:
        ownership.on_map(build_map([record], {"s": ((ME,), (ME,))}))
        await wait_until(lambda: registration.last == {"s": {0: 1, 1: 1}})
        path = partition_path(data_dir, PartitionId("s", 1, 0))
        assert path.exists()

        # Partition 0 is reassigned, but nobody else serves it yet: keep serving and announcing it.
        moved = {"s": ((OTHER,), (ME,))}
        ownership.on_map(build_map([record], moved, {ME: {"s": {0: 1, 1: 1}}}, 2))
        await ownership.settled()
        assert state(ownership, "s", 1, 0) == "draining"
        assert ownership.local("s", 0) is not None
        assert registration.last == {"s": {0: 1, 1: 1}}
        assert ownership.readiness().ready  # readiness concerns assigned partitions only

        # Another node serves it at an older version: still not a handover.
        ownership.on_map(build_map([record], moved, {ME: {"s": {0: 1, 1: 1}}, OTHER: {"s": {0: 0}}}, 3))
        await ownership.settled()
        assert ownership.local("s", 0) is not None

        # A stale map cannot prove a handover either.
        handed = build_map([record], moved, {ME: {"s": {0: 1, 1: 1}}, OTHER: {"s": {0: 1}}}, 4)
        ownership.on_map(handed.marked_stale(True))
        await ownership.settled()
        assert ownership.local("s", 0) is not None

        ownership.on_map(handed)
        await wait_until(lambda: registration.last == {"s": {1: 1}})
        assert ownership.local("s", 0) is None
        await wait_until(lambda: not path.exists())
        assert state(ownership, "s", 1, 0) is None

    run(data_dir, scenario)


def test_the_whole_assignment_is_followed_only_for_stores_with_a_partition_being_handed_over(
    snapshot, data_dir: Path
) -> None:
    """A node's map holds its own share of the assignment; make before break needs the other replicas of a
    partition it hands over, so it asks for those stores' whole assignment, and only while it needs them."""
    s, t = snapshot("s", 1, 2, ROWS), snapshot("t", 1, 1, ROWS)
    asked: list[frozenset[str]] = []

    async def scenario(ownership: Ownership, registration: FakeRegistration) -> None:
        held = {"s": {0: 1, 1: 1}, "t": {0: 1}}
        ownership.on_map(build_map([s, t], {"s": ((ME,), (ME,)), "t": ((ME,),)}))
        await wait_until(lambda: registration.last == held)
        assert all(not stores for stores in asked)  # nothing handed over: only this node's share
        moved = {"s": ((OTHER,), (ME,)), "t": ((ME,),)}
        ownership.on_map(build_map([s, t], moved, {ME: held}, 2))
        await ownership.settled()
        assert asked[-1] == {"s"}
        ownership.on_map(build_map([s, t], moved, {ME: held, OTHER: {"s": {0: 1}}}, 3))
        await wait_until(lambda: registration.last == {"s": {1: 1}, "t": {0: 1}})
        assert asked[-1] == frozenset()  # handed over: back to this node's share alone
        ownership.leave()  # a leaving node hands over everything it holds
        assert asked[-1] == {"s", "t"}

    run(data_dir, scenario, follow=asked.append)


def test_a_partition_leaving_both_its_holders_is_kept_until_a_new_holder_serves_it(snapshot, data_dir: Path) -> None:
    record = snapshot("s", 1, 1, ROWS)
    third = "n3"

    async def scenario(ownership: Ownership, registration: FakeRegistration) -> None:
        ownership.on_map(build_map([record], {"s": ((ME, OTHER),)}, nodes=(ME, OTHER, third)))
        await wait_until(lambda: registration.last == {"s": {0: 1}})
        # Moved from {ME, OTHER} to {n3}: OTHER still serving it is no reason to let go (OTHER may
        # reason the same way about us), only n3, which is assigned it, serving it is.
        both = {ME: {"s": {0: 1}}, OTHER: {"s": {0: 1}}}
        ownership.on_map(build_map([record], {"s": ((third,),)}, both, 2, nodes=(ME, OTHER, third)))
        await ownership.settled()
        assert state(ownership, "s", 1, 0) == "draining" and ownership.local("s", 0) is not None
        served = {**both, third: {"s": {0: 1}}}
        ownership.on_map(build_map([record], {"s": ((third,),)}, served, 3, nodes=(ME, OTHER, third)))
        await wait_until(lambda: registration.last == {})

    run(data_dir, scenario)


def test_a_partition_assigned_back_during_its_drop_grace_is_served_again_without_a_reload(
    snapshot, data_dir: Path
) -> None:
    record = snapshot("s", 1, 1, ROWS)
    loads: list[int] = []

    def loader(directory: Path, rec: StoreRecord, partition: int, *args: Any) -> PartitionStore:
        loads.append(partition)
        return load_partition(directory, rec, partition, *args)

    clock = ManualClock()

    async def scenario(ownership: Ownership, registration: FakeRegistration) -> None:
        ownership.on_map(build_map([record], {"s": ((ME,),)}))
        await wait_until(lambda: registration.last == {"s": {0: 1}})
        moved = build_map([record], {"s": ((OTHER,),)}, {ME: {"s": {0: 1}}, OTHER: {"s": {0: 1}}}, 2)
        ownership.on_map(moved)
        await wait_until(lambda: registration.last == {})  # unannounced, still open for the grace period
        await ownership.settled()
        assert clock.pending() == [2.0] and state(ownership, "s", 1, 0) == "dropped"  # not yet closed
        clock.advance(1.5)
        ownership.on_map(build_map([record], {"s": ((ME,),)}, {OTHER: {"s": {0: 1}}}, 3))
        await wait_until(lambda: registration.last == {"s": {0: 1}})
        clock.advance(0.5)  # the grace period is over: nothing was closed or removed
        await ownership.settled()
        assert clock.pending() == []
        held = ownership.local("s", 0)
        assert held is not None and held.get(b"k1") == b'{"i":1}'
        assert loads == [0] and partition_path(data_dir, PartitionId("s", 1, 0)).exists()

    run(data_dir, scenario, loader=loader, drop_grace_s=2.0, clock=clock)


def test_a_new_version_is_loaded_beside_the_old_and_swapped_atomically(snapshot, data_dir: Path) -> None:
    v1 = snapshot("s", 1, 1, ROWS)
    v2 = snapshot("s", 2, 1, {**ROWS, "k0": {"i": "new"}})
    gate = threading.Event()

    def loader(directory: Path, record: StoreRecord, *args: Any) -> PartitionStore:
        if record.version == 2:
            gate.wait(10)
        return load_partition(directory, record, *args)

    async def scenario(ownership: Ownership, registration: FakeRegistration) -> None:
        ownership.on_map(build_map([v1], {"s": ((ME,),)}))
        await wait_until(lambda: registration.last == {"s": {0: 1}})
        old = ownership.local("s", 0)
        assert old is not None and old.get(b"k0") == b'{"i":0}'

        ownership.on_map(build_map([v2], {"s": ((ME,),)}, {ME: {"s": {0: 1}}}, 2))
        await wait_until(lambda: state(ownership, "s", 2, 0) == "loading")
        assert ownership.local("s", 0) is old  # the old version keeps answering meanwhile
        # A version swap in progress does not make the node unready (drains and upgrades go on).
        readiness = ownership.readiness()
        assert readiness.ready and readiness.updating == ("s v2 p0",) and readiness.pending == ()
        gate.set()
        await wait_until(lambda: registration.last == {"s": {0: 2}})
        new = ownership.local("s", 0)
        assert new is not None and new.version == 2 and new.get(b"k0") == b'{"i":"new"}'
        await wait_until(lambda: not partition_path(data_dir, PartitionId("s", 1, 0)).exists())
        ownership.on_map(build_map([v2], {"s": ((ME,),)}, {ME: {"s": {0: 2}}}, 3))
        assert ownership.readiness().ready

    run(data_dir, scenario, loader=loader)


def test_a_superseded_version_keeps_its_files_for_the_grace_period_and_a_rollback_reuses_them(
    snapshot, data_dir: Path
) -> None:
    v1 = snapshot("s", 1, 1, ROWS)
    v2 = snapshot("s", 2, 1, {**ROWS, "k0": {"i": "new"}})
    loads: list[int] = []

    def loader(directory: Path, record: StoreRecord, *args: Any) -> PartitionStore:
        loads.append(record.version)
        return load_partition(directory, record, *args)

    old_files = partition_path(data_dir, PartitionId("s", 1, 0))

    clock = ManualClock()
    new_files = partition_path(data_dir, PartitionId("s", 2, 0))

    async def scenario(ownership: Ownership, registration: FakeRegistration) -> None:
        ownership.on_map(build_map([v1], {"s": ((ME,),)}))
        await wait_until(lambda: registration.last == {"s": {0: 1}})
        marker = (old_files / "loaded.json").stat().st_ino
        ownership.on_map(build_map([v2], {"s": ((ME,),)}, {ME: {"s": {0: 1}}}, 2))
        await wait_until(lambda: registration.last == {"s": {0: 2}})
        await wait_until(lambda: state(ownership, "s", 1, 0) is None)  # closed, forgotten...
        await ownership.settled()
        assert clock.pending() == [60.0] and old_files.exists()  # ...but its files wait out the grace period
        clock.advance(30.0)

        # Rolled back within the grace period: version 1 is reused from disk, not rebuilt.
        rolled_back = dataclasses.replace(v1, retained={1: v1.snapshot, 2: v2.snapshot})
        ownership.on_map(build_map([rolled_back], {"s": ((ME,),)}, {ME: {"s": {0: 2}}}, 3))
        await wait_until(lambda: registration.last == {"s": {0: 1}})
        assert (old_files / "loaded.json").stat().st_ino == marker
        held = ownership.local("s", 0)
        assert held is not None and held.version == 1 and held.get(b"k0") == b'{"i":0}'
        # Version 2, superseded in turn, is removed once its grace period is over; version 1 stays (its own
        # grace period, still running, finds it wanted again).
        await ownership.settled()
        clock.advance(59.5)
        await ownership.settled()
        assert new_files.exists() and old_files.exists()
        clock.advance(0.5)
        await wait_until(lambda: not new_files.exists())
        await ownership.settled()
        assert old_files.exists() and loads == [1, 2, 1] and clock.pending() == []

    run(data_dir, scenario, loader=loader, version_grace_s=60.0, clock=clock)


def test_a_leaving_node_loads_nothing_new_and_keeps_serving_until_handed_over(snapshot, data_dir: Path) -> None:
    record = snapshot("s", 1, 2, ROWS)

    async def scenario(ownership: Ownership, registration: FakeRegistration) -> None:
        ownership.on_map(build_map([record], {"s": ((ME,), (OTHER,))}))
        await wait_until(lambda: registration.last == {"s": {0: 1}})
        ownership.leave()
        assert ownership.readiness().leaving
        assert ownership.handed_over() == ["s p0", "assignment generation 1 still places this node"]
        assert ownership.alone() is None  # another node is live
        # The controller moves p0 away and gives p1 here: p1 is not loaded, p0 keeps serving.
        moved = {"s": ((OTHER,), (ME, OTHER))}
        ownership.on_map(build_map([record], moved, {ME: {"s": {0: 1}}}, 2))
        await ownership.settled()
        assert state(ownership, "s", 1, 1) == "assigned" and ownership.local("s", 0) is not None
        waiting = asyncio.ensure_future(ownership.wait_handed_over(5.0))
        await ownership.settled()
        assert not waiting.done() and ownership.handed_over()
        # Served elsewhere by a node that is itself leaving, while a live one (n3) could take it: not
        # enough (with no live peer at all there would be nobody to wait for).
        leaving_other = build_map(
            [record], moved, {ME: {"s": {0: 1}}, OTHER: {"s": {0: 1}}}, 3, nodes=(ME, OTHER, "n3")
        )
        nodes = {**leaving_other.nodes, OTHER: NodeRecord(OTHER, f"http://{OTHER}", leaving=True)}
        ownership.on_map(dataclasses.replace(leaving_other, nodes=nodes))
        await ownership.settled()
        assert not waiting.done() and ownership.handed_over()
        # A live node assigned p0 serves it at the published version, but the assignment still places
        # this node (p1): not yet. Then an assignment without this node: handed over. Nothing was
        # dropped meanwhile.
        ownership.on_map(build_map([record], moved, {ME: {"s": {0: 1}}, OTHER: {"s": {0: 1}}}, 4))
        await ownership.settled()
        assert not waiting.done() and ownership.handed_over()
        assert ownership.handed_over() == ["assignment generation 4 still places this node"]
        away = {"s": ((OTHER,), (OTHER,))}
        ownership.on_map(build_map([record], away, {ME: {"s": {0: 1}}, OTHER: {"s": {0: 1, 1: 1}}}, 5))
        assert await waiting == []
        assert ownership.local("s", 0) is not None
        assert partition_path(data_dir, PartitionId("s", 1, 0)).exists()
        await ownership.withdraw()
        assert registration.last == {"<withdrawn>": {}}
        ownership.on_map(build_map([record], away, {OTHER: {"s": {0: 1, 1: 1}}}, 6))
        await ownership.settled()
        assert registration.last == {"<withdrawn>": {}}  # never announced again
        assert ownership.local("s", 0) is not None  # stragglers still get answers

    run(data_dir, scenario)


def test_a_leaving_node_stops_waiting_for_its_handover_at_the_timeout(snapshot, data_dir: Path) -> None:
    record = snapshot("s", 1, 1, ROWS)
    clock = ManualClock()

    async def scenario(ownership: Ownership, registration: FakeRegistration) -> None:
        ownership.on_map(build_map([record], {"s": ((ME,),)}))
        await wait_until(lambda: registration.last == {"s": {0: 1}})
        ownership.leave()
        waiting = asyncio.ensure_future(ownership.wait_handed_over(5.0))
        for _ in range(5):  # it looks again every second of the clock
            await wait_until(lambda: clock.pending() == [1.0], message="waiting for the next look")
            assert not waiting.done()
            clock.advance(1.0)
        assert await waiting == ["s p0", "assignment generation 1 still places this node"]
        assert ownership.local("s", 0) is not None  # nothing was dropped meanwhile

    run(data_dir, scenario, clock=clock)


def test_a_leaving_node_with_no_live_peer_has_nothing_to_hand_over(snapshot, data_dir: Path) -> None:
    record = snapshot("s", 1, 1, ROWS)

    async def scenario(ownership: Ownership, registration: FakeRegistration) -> None:
        ownership.on_map(build_map([record], {"s": ((ME,),)}, nodes=(ME,)))
        await wait_until(lambda: registration.last == {"s": {0: 1}})
        ownership.leave()
        assert await ownership.wait_handed_over(1.0) == []
        # Nothing to hand over is not "served elsewhere": the node says it stops as the only one.
        assert ownership.alone() == 1

    run(data_dir, scenario)


def test_a_stale_map_keeps_a_ready_node_ready(snapshot, data_dir: Path) -> None:
    record = snapshot("s", 1, 1, ROWS)

    async def scenario(ownership: Ownership, registration: FakeRegistration) -> None:
        assert not ownership.readiness().ready  # nothing read from ZooKeeper yet
        fresh = build_map([record], {"s": ((ME,),)}, {ME: {"s": {0: 1}}})
        ownership.on_map(fresh)
        await wait_until(lambda: ownership.readiness().ready)
        ownership.on_map(fresh.marked_stale(True))
        readiness = ownership.readiness()
        assert readiness.ready and readiness.stale and readiness.describe()["stale"] is True
        assert ownership.local("s", 0) is not None

    run(data_dir, scenario)


def test_a_failed_load_is_reported_and_retried(snapshot, data_dir: Path) -> None:
    record = snapshot("s", 1, 1, ROWS)
    part = next(partition_dir(local_path(record.snapshot), 0).iterdir())
    good = part.read_text()
    part.write_text(good.split("\n", 1)[1])  # one row short of the manifest

    clock = ManualClock()

    async def scenario(ownership: Ownership, registration: FakeRegistration) -> None:
        ownership.on_map(build_map([record], {"s": ((ME,),)}))
        await wait_until(lambda: state(ownership, "s", 1, 0) == "failed")
        readiness = ownership.readiness()
        assert not readiness.ready and "manifest says" in readiness.failed["s v1 p0"]
        assert not partition_path(data_dir, PartitionId("s", 1, 0)).exists()
        part.write_text(good)  # the snapshot is repaired; the retry picks it up without a new map
        clock.advance(4.9)
        await ownership.settled()
        assert state(ownership, "s", 1, 0) == "failed"  # not before the back-off is over
        clock.advance(0.2)
        await wait_until(lambda: registration.last == {"s": {0: 1}})
        assert state(ownership, "s", 1, 0) == "serving"

    run(data_dir, scenario, retry_failed_s=5.0, clock=clock)


def test_a_deleted_store_is_dropped(snapshot, data_dir: Path) -> None:
    record = snapshot("s", 1, 1, ROWS)

    async def scenario(ownership: Ownership, registration: FakeRegistration) -> None:
        ownership.on_map(build_map([record], {"s": ((ME,),)}))
        await wait_until(lambda: registration.last == {"s": {0: 1}})
        # `keyroute store delete`: the record goes and the map carries the store's tombstone.
        deleted = build_map([], {}, {ME: {"s": {0: 1}}}, 2)
        ownership.on_map(dataclasses.replace(deleted, deleted={"s": 1}))
        await wait_until(lambda: registration.last == {})
        await wait_until(lambda: not partition_path(data_dir, PartitionId("s", 1, 0)).exists())
        assert ownership.readiness().degraded == ()

    run(data_dir, scenario)


def test_a_store_record_gone_without_a_tombstone_is_kept_and_said_once(snapshot, data_dir: Path, caplog) -> None:
    record = snapshot("s", 2, 2, ROWS)
    files = [partition_path(data_dir, PartitionId("s", 2, p)) for p in (0, 1)]

    async def scenario(ownership: Ownership, registration: FakeRegistration) -> None:
        ownership.on_map(build_map([record], {"s": ((ME,), (ME, OTHER))}))
        await wait_until(lambda: registration.last == {"s": {0: 2, 1: 2}})
        # The record vanished (a ZooKeeper restored from an old backup, a wrong `deleteall`): the map watcher
        # keeps its last record, marked orphaned, and the controller drops the store from the assignment.
        # Another node serves p1 too: without the orphan rule it would be handed over and dropped.
        gone = build_map([record], {}, {ME: {"s": {0: 2, 1: 2}}, OTHER: {"s": {1: 2}}}, 2)
        for generation in (2, 3, 4):
            ownership.on_map(dataclasses.replace(gone, orphaned=frozenset({"s"}), generation=generation))
            await ownership.settled(graces=True)
        assert registration.last == {"s": {0: 2, 1: 2}}
        assert ownership.local("s", 0) is not None and ownership.local("s", 1) is not None
        assert all(path.exists() for path in files)
        readiness = ownership.readiness()
        assert readiness.ready and readiness.orphaned_partitions == 2
        assert len(readiness.degraded) == 1 and "without a tombstone" in readiness.degraded[0]
        assert ownership.readiness().describe()["degraded"] == list(readiness.degraded)
        said = [r for r in caplog.records if "has no tombstone" in r.getMessage()]
        assert len(said) == 1, said  # once, not on every map
        # A map without even the last record (a watcher that never read it) keeps it all the same, and so
        # does one with the tombstone of an earlier deletion (version 1: a ZooKeeper restored from a backup
        # taken before the store was published again).
        bare = build_map([], {}, {ME: {"s": {0: 2, 1: 2}}}, 5)
        for earlier in (bare, dataclasses.replace(bare, deleted={"s": 1}, generation=6)):
            ownership.on_map(earlier)
            await ownership.settled(graces=True)
            assert registration.last == {"s": {0: 2, 1: 2}} and all(path.exists() for path in files)
        # Then `keyroute store delete`: its tombstone covers version 2 and lets it go.
        ownership.on_map(dataclasses.replace(bare, deleted={"s": 2}, generation=7))
        await wait_until(lambda: registration.last == {})
        await wait_until(lambda: not any(path.exists() for path in files))

    caplog.set_level("INFO", logger="keyroute.state_node.ownership")
    run(data_dir, scenario)


def test_startup_reuses_loaded_partitions_and_removes_leftovers(snapshot, data_dir: Path) -> None:
    record = snapshot("s", 1, 2, ROWS)
    load_partition(data_dir, record, 0, 1 << 24).close()  # from an earlier run, still assigned
    load_partition(data_dir, record, 1, 1 << 24).close()  # from an earlier run, no longer assigned
    leftover = partition_path(data_dir, PartitionId("old", 3, 0))  # a deleted store: it has a tombstone
    leftover.mkdir(parents=True)
    unknown = partition_path(data_dir, PartitionId("lost", 2, 0))  # neither record nor tombstone: kept
    unknown.mkdir(parents=True)
    calls: list[int] = []

    def counting_loader(directory: Path, rec: StoreRecord, partition: int, *args: Any) -> PartitionStore:
        calls.append(partition)
        return load_partition(directory, rec, partition, *args)

    async def scenario(ownership: Ownership, registration: FakeRegistration) -> None:
        first = build_map([record], {"s": ((ME,), (OTHER,))})
        ownership.on_map(dataclasses.replace(first, deleted={"old": 3}))
        await wait_until(lambda: registration.last == {"s": {0: 1}})
        unassigned = partition_path(data_dir, PartitionId("s", 1, 1))
        await wait_until(lambda: not leftover.exists() and not unassigned.exists())
        await ownership.settled()
        assert partition_path(data_dir, PartitionId("s", 1, 0)).exists()
        assert unknown.exists()  # absence is not deletion
        assert calls == [0]

    run(data_dir, scenario, loader=counting_loader)


def test_missing_ephemeral_records_are_written_again(snapshot, data_dir: Path) -> None:
    record = snapshot("s", 1, 1, ROWS)

    async def scenario(ownership: Ownership, registration: FakeRegistration) -> None:
        ownership.on_map(build_map([record], {"s": ((ME,),)}, {ME: {}}))
        await wait_until(lambda: registration.last == {"s": {0: 1}})
        published = len(registration.published)
        # A new session: the map no longer lists this node nor its serving record.
        ownership.on_map(build_map([record], {"s": ((ME,),)}, {}, 2, nodes=(OTHER,)))
        await wait_until(lambda: registration.registrations == 1 and len(registration.published) > published)
        assert registration.last == {"s": {0: 1}}

    run(data_dir, scenario)


def test_lifecycle_states_are_the_documented_ones() -> None:
    assert [s.name for s in PartitionState] == [
        "ASSIGNED",
        "LOADING",
        "CATCHING_UP",
        "SERVING",
        "DRAINING",
        "DROPPED",
        "FAILED",
    ]
    doc = PartitionState.__doc__ or ""
    for s in PartitionState:
        assert s.name in doc
    assert dataclasses.is_dataclass(PartitionId)


def test_a_corrupt_new_version_leaves_the_old_one_serving(snapshot_root: Path, data_dir: Path) -> None:
    v1 = write_files_snapshot(snapshot_root, "s", 1, 1, ROWS)
    v2 = write_files_snapshot(snapshot_root, "s", 2, 1, {**ROWS, "k0": {"i": "new"}})
    source = data_file(v2, 0)
    good = source.read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x01
    source.write_bytes(bytes(bad))  # one bit flipped in transit or on the storage
    clock = ManualClock()

    async def scenario(ownership: Ownership, registration: FakeRegistration) -> None:
        ownership.on_map(build_map([v1], {"s": ((ME,),)}))
        await wait_until(lambda: registration.last == {"s": {0: 1}})
        old = ownership.local("s", 0)
        assert old is not None and old.version == 1
        ownership.on_map(build_map([v2], {"s": ((ME,),)}, {ME: {"s": {0: 1}}}, 2))
        await wait_until(lambda: state(ownership, "s", 2, 0) == "failed")
        failure = ownership.readiness().failed["s v2 p0"]
        assert "checksum" in failure and str(source) in failure
        # The old version keeps serving and stays announced; nothing of the new one is on disk.
        assert ownership.local("s", 0) is old and old.get(b"k0") == b'{"i":0}'
        assert state(ownership, "s", 1, 0) == "draining" and registration.last == {"s": {0: 1}}
        assert not partition_path(data_dir, PartitionId("s", 2, 0)).exists()
        source.write_bytes(good)  # republished intact: the retry loads it and swaps
        clock.advance(5.1)
        await wait_until(lambda: registration.last == {"s": {0: 2}})
        new = ownership.local("s", 0)
        assert new is not None and new.version == 2 and new.get(b"k0") == b'{"i":"new"}'
        await wait_until(lambda: not partition_path(data_dir, PartitionId("s", 1, 0)).exists())
        assert data_file(v1, 0).stat().st_nlink == 1  # the node's hard link to v1 went with it

    run(data_dir, scenario, retry_failed_s=5.0, clock=clock)
