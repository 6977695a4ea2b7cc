"""The partition lifecycle's decisions alone (keyroute.state_node.lifecycle): hand-built maps and stand-ins for loaded
partitions, no disk, no task, no clock; what Ownership does with the decisions is tested in test_ownership.py."""

from __future__ import annotations

import dataclasses
from typing import Any

from keyroute.cluster.partition_map import NodeRecord, PartitionMap, StoreRecord
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.replica.store import PartitionId
from keyroute.state_node.lifecycle import Lifecycle, PartitionState
from tests.unit.node.test_ownership import ME, OTHER, build_map

S = PartitionState


def record(version: int = 1, partitions: int = 4) -> StoreRecord:
    return StoreRecord("s", partitions, Partitioner.MURMUR2, KeyFormat.STRING, version, "/nowhere", ("v",), 2)


@dataclasses.dataclass
class Held:
    """A loaded partition as the lifecycle looks at it (keyroute.replica.store.PartitionStore): batch."""

    pid: PartitionId
    live: Any = None
    closed: bool = False
    rows: int = 3

    @property
    def version(self) -> int:
        return self.pid.version


def pid(partition: int, version: int = 1) -> PartitionId:
    return PartitionId("s", version, partition)


def states(lifecycle: Lifecycle) -> dict[PartitionId, PartitionState]:
    return {p: entry.state for p, entry in lifecycle.entries.items()}


def serving(lifecycle: Lifecycle, m: PartitionMap, *pids: PartitionId) -> None:
    """Take `m`, then have `pids` loaded (batch: serving at once)."""
    lifecycle.take_map(m, 0.0)
    for loading, entry in lifecycle.start_loads(set()):
        if loading in pids:
            lifecycle.loaded(entry, Held(loading))  # type: ignore[arg-type]


def test_assigned_partitions_load_within_the_free_slots_and_never_while_their_directory_goes() -> None:
    lifecycle = Lifecycle(ME, max_parallel_loads=2)
    m = build_map([record()], {"s": ((ME,), (ME,), (ME,), (ME,))})
    assert lifecycle.take_map(m, 0.0) == []
    assert lifecycle.desired == {pid(p) for p in range(4)}
    assert set(states(lifecycle).values()) == {S.ASSIGNED}
    started = lifecycle.start_loads(set())
    assert [p for p, _ in started] == [pid(0), pid(1)]
    assert lifecycle.start_loads(set()) == []  # both slots taken
    lifecycle.loaded(started[0][1], Held(pid(0)))  # type: ignore[arg-type]
    assert [p for p, _ in lifecycle.start_loads({pid(2)})] == [pid(3)]  # p2's directory is being removed
    assert states(lifecycle) == {pid(0): S.SERVING, pid(1): S.LOADING, pid(2): S.ASSIGNED, pid(3): S.LOADING}


def test_a_failed_load_is_tried_again_once_its_back_off_is_over() -> None:
    lifecycle = Lifecycle(ME, retry_failed_s=5.0)
    m = build_map([record(partitions=1)], {"s": ((ME,),)})
    lifecycle.take_map(m, 100.0)
    ((_, entry),) = lifecycle.start_loads(set())
    lifecycle.failed(entry, "bad checksum", 100.0)
    assert lifecycle.next_retry(101.0) == 4.0
    lifecycle.take_map(m, 104.9)
    assert entry.state is S.FAILED and lifecycle.start_loads(set()) == []
    assert lifecycle.readiness(m, {}, True).failed == {"s v1 p0": "bad checksum"}
    lifecycle.take_map(m, 105.0)
    assert (entry.state, entry.error) == (S.ASSIGNED, "") and lifecycle.next_retry(105.0) is None
    assert [p for p, _ in lifecycle.start_loads(set())] == [pid(0)]


def test_a_served_partition_moved_away_goes_only_once_a_live_node_assigned_it_serves_it() -> None:
    lifecycle = Lifecycle(ME)
    serving(lifecycle, build_map([record(partitions=2)], {"s": ((ME,), (ME,))}), pid(0), pid(1))
    moved = {"s": ((OTHER,), (ME,))}
    here = {ME: {"s": {0: 1, 1: 1}}}
    for m in (
        build_map([record(partitions=2)], moved, here, 2),  # nobody else serves it yet
        build_map([record(partitions=2)], moved, {**here, OTHER: {"s": {0: 0}}}, 3),  # an older version
        build_map([record(partitions=2)], moved, {**here, OTHER: {"s": {0: 1}}}, 4).marked_stale(True),
    ):
        assert lifecycle.take_map(m, 0.0) == [] and lifecycle.let_go(m) == []
        assert states(lifecycle)[pid(0)] is S.DRAINING and (("s", 0) in lifecycle.view(m))
        assert lifecycle.handing_over() == {"s"}
    handed = build_map([record(partitions=2)], moved, {**here, OTHER: {"s": {0: 1}}}, 5)
    lifecycle.take_map(handed, 0.0)
    ((gone, entry, superseded),) = lifecycle.let_go(handed)
    assert (gone, entry.state, superseded) == (pid(0), S.DROPPED, False)
    assert set(lifecycle.view(handed)) == {("s", 1)}
    # Assigned back while still open (the drop's grace period): served again, nothing loaded.
    lifecycle.take_map(build_map([record(partitions=2)], {"s": ((ME,), (ME,))}, generation=6), 0.0)
    assert entry.state is S.SERVING and lifecycle.start_loads(set()) == []


def test_co_located_stores_let_go_of_a_partition_together() -> None:
    # "t" is co-located with "s": partition 0 of both moves to OTHER, which serves s's first, then t's.
    lifecycle = Lifecycle(ME)
    s, t = record(partitions=2), dataclasses.replace(record(partitions=2), name="t", colocate_with="s")
    both = {"s": ((ME,), (ME,)), "t": ((ME,), (ME,))}
    lifecycle.take_map(build_map([s, t], both), 0.0)
    for loading, entry in lifecycle.start_loads(set()):
        lifecycle.loaded(entry, Held(loading))  # type: ignore[arg-type]
    for loading, entry in lifecycle.start_loads(set()):
        lifecycle.loaded(entry, Held(loading))  # type: ignore[arg-type]
    t0 = PartitionId("t", 1, 0)
    moved = {"s": ((OTHER,), (ME,)), "t": ((OTHER,), (ME,))}
    here = {"s": {0: 1, 1: 1}, "t": {0: 1, 1: 1}}
    half = build_map([s, t], moved, {ME: here, OTHER: {"s": {0: 1}}}, 2)
    lifecycle.take_map(half, 0.0)
    assert lifecycle.let_go(half) == []  # s p0 is served elsewhere, t p0 not yet: both stay
    assert states(lifecycle)[pid(0)] is S.DRAINING and states(lifecycle)[t0] is S.DRAINING
    whole = build_map([s, t], moved, {ME: here, OTHER: {"s": {0: 1}, "t": {0: 1}}}, 3)
    lifecycle.take_map(whole, 0.0)
    assert {gone for gone, _, _ in lifecycle.let_go(whole)} == {pid(0), t0}
    # Stores not co-located let go of a partition each on its own.
    apart = dataclasses.replace(t, colocate_with=None)
    alone = Lifecycle(ME)
    alone.take_map(build_map([s, apart], both), 0.0)
    for _ in range(2):
        for loading, entry in alone.start_loads(set()):
            alone.loaded(entry, Held(loading))  # type: ignore[arg-type]
    half = build_map([s, apart], moved, {ME: here, OTHER: {"s": {0: 1}}}, 2)
    alone.take_map(half, 0.0)
    assert [gone for gone, _, _ in alone.let_go(half)] == [pid(0)]


def test_a_new_version_supersedes_the_old_one_once_it_serves_here() -> None:
    lifecycle = Lifecycle(ME)
    serving(lifecycle, build_map([record(1, 1)], {"s": ((ME,),)}), pid(0))
    v2 = build_map([record(2, 1)], {"s": ((ME,),)}, {ME: {"s": {0: 1}}}, 2)
    lifecycle.take_map(v2, 0.0)
    ((loading, entry),) = lifecycle.start_loads(set())
    assert loading == pid(0, 2) and lifecycle.let_go(v2) == []
    assert states(lifecycle)[pid(0)] is S.DRAINING and lifecycle.view(v2)[("s", 0)].version == 1
    readiness = lifecycle.readiness(v2, lifecycle.view(v2), True)
    assert readiness.ready and readiness.updating == ("s v2 p0",)
    lifecycle.loaded(entry, Held(pid(0, 2)))  # type: ignore[arg-type]
    lifecycle.take_map(v2, 0.0)
    assert lifecycle.view(v2)[("s", 0)].version == 2  # the published version is preferred
    assert [(p, superseded) for p, _, superseded in lifecycle.let_go(v2)] == [(pid(0), True)]


def test_a_leaving_node_loads_nothing_and_lets_nothing_go() -> None:
    lifecycle = Lifecycle(ME)
    serving(lifecycle, build_map([record(partitions=3)], {"s": ((ME,), (ME,), (OTHER,))}), pid(0))
    loading = lifecycle.entries[pid(1)]
    lifecycle.leave()
    assert loading.cancel.is_set() and lifecycle.readiness(PartitionMap.empty(), {}, True).leaving
    # p0 served elsewhere, p2 assigned here: neither let go nor loaded.
    assignment = {"s": ((OTHER,), (OTHER, ME), (ME,))}
    handed = build_map([record(partitions=3)], assignment, {OTHER: {"s": {0: 1}}}, 2)
    lifecycle.take_map(handed, 0.0)
    assert states(lifecycle)[pid(2)] is S.ASSIGNED
    assert lifecycle.start_loads(set()) == [] and lifecycle.let_go(handed) == []
    assert states(lifecycle)[pid(0)] is S.DRAINING and lifecycle.handing_over() == {"s"}


def test_a_store_gone_without_a_tombstone_is_kept_and_one_with_a_tombstone_goes() -> None:
    lifecycle = Lifecycle(ME)
    serving(lifecycle, build_map([record(partitions=1)], {"s": ((ME,),)}), pid(0))
    gone = build_map([record(partitions=1)], {}, {OTHER: {"s": {0: 1}}}, 2)
    orphaned = dataclasses.replace(gone, orphaned=frozenset({"s"}))
    lifecycle.take_map(orphaned, 0.0)
    assert lifecycle.let_go(orphaned) == []
    readiness = lifecycle.readiness(orphaned, lifecycle.view(orphaned), True)
    assert readiness.ready and readiness.orphaned_partitions == 1 and len(readiness.degraded) == 1
    bare = build_map([], {}, {}, 3)
    for earlier in (bare, dataclasses.replace(bare, deleted={"s": 0})):  # no record; an older tombstone
        lifecycle.take_map(earlier, 0.0)
        assert lifecycle.let_go(earlier) == []
    deleted = dataclasses.replace(bare, deleted={"s": 1})
    lifecycle.take_map(deleted, 0.0)
    assert [p for p, _, _ in lifecycle.let_go(deleted)] == [pid(0)]


def test_leftovers_are_told_apart_only_once_everything_assigned_here_serves() -> None:
    lifecycle = Lifecycle(ME, max_parallel_loads=1)
    m = build_map([record(partitions=2)], {"s": ((ME,), (ME,))})
    serving(lifecycle, m, pid(0))
    assert not lifecycle.may_collect(m)  # p1 still to load
    ((_, entry),) = lifecycle.start_loads(set())
    lifecycle.loaded(entry, Held(pid(1)))  # type: ignore[arg-type]
    assert lifecycle.may_collect(m)
    assert not lifecycle.may_collect(m.marked_stale(True))
    unregistered = dataclasses.replace(m, nodes={OTHER: NodeRecord(OTHER, "http://n2")})
    assert not lifecycle.may_collect(unregistered)


def test_readiness_says_what_is_missing() -> None:
    lifecycle = Lifecycle(ME)
    m = build_map([record(partitions=1)], {"s": ((ME,),)})
    lifecycle.take_map(m, 0.0)
    readiness = lifecycle.readiness(m, {}, fresh_seen=False)
    assert not readiness.ready
    assert readiness.pending == ("s v1 p0", "no partition map read from ZooKeeper yet")
    assert readiness.describe()["status"] == "not_ready" and readiness.map_generation == 1
