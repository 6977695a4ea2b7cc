"""The lifecycle of every partition this node holds or wants, as decisions only: given a partition map and the
time, which partitions to load, which to let go and which to serve. No I/O, no task, no clock of its own:
`keyroute.state_node.ownership.Ownership` feeds it maps, carries out what it decides and tells it the outcomes.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from threading import Event
from typing import Any

from keyroute.cluster.colocation import colocation_groups
from keyroute.cluster.partition_map import PartitionMap, StoreRecord
from keyroute.replica.live import GAP, LivePartition
from keyroute.replica.store import PartitionId, PartitionStore

log = logging.getLogger(__name__)

# What answers here: (store, partition) -> the loaded partition.
View = Mapping[tuple[str, int], PartitionStore]


class PartitionState(enum.Enum):
    """Lifecycle of one (store, version, partition) on this node.

        ASSIGNED  -> LOADING    a load slot is free (at most `max_parallel_loads` at a time)
        LOADING   -> SERVING    the rows are committed; only now is it put in the view and announced
        LOADING   -> CATCHING_UP  a live partition: loaded, now consuming its topic partition
        CATCHING_UP -> SERVING  its lag was within the version's `catch_up_records` once: put in the view
                                and announced (meanwhile the old version or other replicas serve it)
        CATCHING_UP -> DROPPED  no longer wanted: it stops consuming, then closes
        LOADING   -> FAILED     the snapshot or a key is bad; retried after a back-off while still wanted
        LOADING   -> DROPPED    no longer wanted: the load is cancelled and its files removed
        SERVING   -> DRAINING   unassigned from this node, or superseded by a newer version loaded here
        DRAINING  -> SERVING    assigned here again
        DRAINING  -> DROPPED    make before break: a live node assigned the partition serves it at the
                                published version (for a superseded version: this node serves the new
                                one); it is unannounced first and closed after a grace delay; its files
                                go then, or for a superseded version after the version grace period (a
                                rollback within it reuses them)
        DROPPED   -> SERVING    assigned here again within that grace delay (still open)
        FAILED    -> ASSIGNED   the back-off elapsed

    DROPPED is terminal: the entry is forgotten once it is closed. While the node is leaving (SIGTERM)
    nothing new is loaded and nothing is dropped: it serves what it holds until it de-announces, and its
    files stay on disk for a restart.

    A live partition (keyroute.replica.live) consumes its topic partition from the moment it is loaded until
    it is closed; it is stopped before its environment closes. One in a gap (records it needs are gone) is
    kept out of the view and the announcement whatever its state, until a new version replaces it.
    """

    ASSIGNED = "assigned"
    LOADING = "loading"
    CATCHING_UP = "catching_up"
    SERVING = "serving"
    DRAINING = "draining"
    DROPPED = "dropped"
    FAILED = "failed"


@dataclass(slots=True)
class Entry:
    """One (store, version, partition) held or wanted here: its record, state, and what it holds."""

    record: StoreRecord
    state: PartitionState = PartitionState.ASSIGNED
    store: PartitionStore | None = None
    error: str = ""
    retry_at: float = 0.0  # FAILED: when it may be loaded again (monotonic seconds)
    cancel: Event = field(default_factory=Event)  # set: its load is no longer wanted


@dataclass(frozen=True, slots=True)
class Readiness:
    """Whether the node has loaded everything assigned to it at the published versions, and if not why.

    A stale map (ZooKeeper unreachable) does not make a ready node unready: it keeps serving what it
    holds and says the map is stale.
    """

    ready: bool
    stale: bool
    pending: tuple[str, ...]
    failed: Mapping[str, str]
    leaving: bool = False
    map_generation: int = 0  # of the map it was judged by
    # Partitions served here at another version while the published one loads (or failed to load): a version
    # swap in progress, which does not make the node unready (keyroute_node_partitions_updating counts them).
    updating: tuple[str, ...] = ()
    # Why this node keeps partitions it would otherwise let go (a store record gone without a tombstone):
    # it stays ready and keeps serving them (keyroute_node_orphaned_partitions counts them).
    degraded: tuple[str, ...] = ()
    orphaned_partitions: int = 0

    def describe(self) -> dict[str, Any]:
        return {
            "status": "ready" if self.ready else "not_ready",
            "stale": self.stale,
            "map_stale": self.stale,
            "generation": self.map_generation,
            "leaving": self.leaving,
            "pending": list(self.pending),
            "updating": list(self.updating),
            "failed": dict(self.failed),
            "degraded": list(self.degraded),
        }


# A partition to let go: its id, its entry (now DROPPED), and whether a newer version of it is wanted here.
Drop = tuple[PartitionId, Entry, bool]


class Lifecycle:
    """Every (store, version, partition) this node holds or wants (`entries`) and the decisions of its lifecycle
    (see `PartitionState`). A map is taken in three steps, between which the caller acts: `take_map` (what is
    wanted; returns what was never served and may go at once), `start_loads` (returns what to load now) and
    `let_go` (returns what was served and may go now: make before break). Every method runs on the event loop."""

    def __init__(self, node_id: str, max_parallel_loads: int = 2, retry_failed_s: float = 5.0) -> None:
        self.node_id = node_id
        self.max_parallel_loads = max_parallel_loads
        self.retry_failed_s = retry_failed_s
        self.entries: dict[PartitionId, Entry] = {}
        # What the last map assigns this node, at the published versions.
        self.desired: frozenset[PartitionId] = frozenset()
        self.leaving = False

    # -- taking a map ------------------------------------------------------------------------------------

    def take_map(self, m: PartitionMap, now: float) -> list[Drop]:
        """What `m` assigns here becomes `desired`; every entry moves on accordingly (`now`: monotonic seconds,
        for failed loads' back-off). Returns the live partitions still catching up that are no longer wanted:
        never served, nothing to hand over, they go at once (marked DROPPED)."""
        desired = wanted_by(m, self.node_id)
        self.desired = frozenset(desired)
        entries = self.entries
        for pid in sorted(desired, key=order):
            entry = entries.get(pid)
            if entry is None:
                entries[pid] = Entry(desired[pid])
            elif entry.state is PartitionState.CATCHING_UP:
                live = entry.store.live if entry.store is not None else None
                if live is not None and live.caught_up:
                    log.info("%s caught up (offset %d, lag %d records): serving it", pid, live.offset, live.lag_records)
                    entry.state = PartitionState.SERVING
            elif entry.state is PartitionState.FAILED and now >= entry.retry_at:
                entry.state, entry.error = PartitionState.ASSIGNED, ""
                entry.record = desired[pid]
            elif entry.state is PartitionState.DRAINING:
                entry.state = PartitionState.SERVING
            elif entry.state is PartitionState.DROPPED and entry.store is not None and not self.leaving:
                # Assigned here again within the drop grace period: still open, serve it again.
                live = entry.store.live
                entry.state = (
                    PartitionState.CATCHING_UP if live is not None and not live.caught_up else PartitionState.SERVING
                )
            elif entry.state is PartitionState.LOADING and not self.leaving:
                entry.cancel.clear()  # wanted again before the cancelled load noticed

        drops: list[Drop] = []
        for pid, entry in list(entries.items()):
            if pid in desired:
                continue
            if entry.state in (PartitionState.ASSIGNED, PartitionState.FAILED):
                del entries[pid]
            elif entry.state is PartitionState.LOADING:
                entry.cancel.set()  # the finished load sees it and discards its files
            elif entry.state is PartitionState.CATCHING_UP and not self.leaving and pid.store not in m.orphaned:
                # Never served: nothing to hand over. A superseded version's files stay for a rollback.
                newer = any(d.store == pid.store and d.partition == pid.partition for d in desired)
                entry.state = PartitionState.DROPPED
                drops.append((pid, entry, newer))
        return drops

    def start_loads(self, deleting: Container[PartitionId]) -> list[tuple[PartitionId, Entry]]:
        """The assigned partitions to load now (marked LOADING): as many as free load slots allow, none whose
        directory is being removed (`deleting`), none while leaving."""
        if self.leaving:
            return []
        entries = self.entries
        loading = sum(1 for e in entries.values() if e.state is PartitionState.LOADING)
        started = []
        for pid in sorted(entries, key=order):
            entry = entries[pid]
            if entry.state is PartitionState.ASSIGNED and loading < self.max_parallel_loads and pid not in deleting:
                entry.state = PartitionState.LOADING
                loading += 1
                started.append((pid, entry))
        return started

    def let_go(self, m: PartitionMap) -> list[Drop]:
        """Every served partition no longer wanted at its version: those that may go now (make before break:
        `may_drop`) are marked DROPPED and returned; the others are DRAINING (kept, served, announced)."""
        wanted_version = {(pid.store, pid.partition): pid for pid in self.desired}
        going: list[tuple[PartitionId, Entry, PartitionId | None, bool]] = []
        for pid, entry in list(self.entries.items()):
            if entry.state in (PartitionState.SERVING, PartitionState.DRAINING) and pid not in self.desired:
                wanted = wanted_version.get((pid.store, pid.partition))
                going.append((pid, entry, wanted, not self.leaving and self.may_drop(pid, m, wanted)))
        # Co-located stores (keyroute.cluster.colocation) let go of a partition together: partition p of one
        # is kept while p of another store of its group is kept here, so that a node serving p of one serves p
        # of all until each is served elsewhere (a multi-store read of them stays one hop during a move).
        groups = colocation_groups({name: record.colocate_with for name, record in m.stores.items()}) if going else {}
        kept = {(groups[pid.store], pid.partition) for pid, _, _, may in going if not may and pid.store in groups}
        drops: list[Drop] = []
        for pid, entry, wanted, may in going:
            if may and (pid.store not in groups or (groups[pid.store], pid.partition) not in kept):
                entry.state = PartitionState.DROPPED
                drops.append((pid, entry, wanted is not None))
            else:
                entry.state = PartitionState.DRAINING
        return drops

    def may_drop(self, pid: PartitionId, m: PartitionMap, wanted: PartitionId | None) -> bool:
        """Whether a partition no longer wanted at this version may go (make before break)."""
        if pid.store in m.orphaned:
            # Its record vanished without a tombstone (a ZooKeeper restored from an old backup, a wrong
            # `deleteall`): absence is not deletion, keep serving it.
            return False
        record = m.stores.get(pid.store)
        if record is None:
            # Deleted (`keyroute store delete` left a tombstone covering this version): nothing to hand over,
            # nobody routes to it. Without one nothing proves a deletion (a ZooKeeper restored from a backup
            # may hold the tombstone of an earlier deletion, not of the version published since): keep it.
            return not m.stale and m.deletes(pid.store, pid.version)
        if wanted is not None:
            # Still assigned here, at another version: superseded once that version serves here.
            successor = self.entries.get(wanted)
            return (
                successor is not None
                and successor.state is PartitionState.SERVING
                and (successor.store is None or successor.store.live is None or successor.store.live.serves)
            )
        if m.stale:
            return False  # a stale map cannot prove that anyone else has taken over
        # Only a live node counts: a leaving one is about to let go of its copy too.
        return m.served_elsewhere(pid.store, pid.partition, self.node_id)

    def may_collect(self, m: PartitionMap) -> bool:
        """Whether leftovers can be told from partitions this node is about to get back: once the map is
        fresh, this node is registered, and the assignment gives it partitions that are all served here
        (a restarted node first sees the assignment of before its restart, which may not include it)."""
        desired = self.desired
        if m.stale or self.node_id not in m.nodes or not desired:
            return False
        return all(
            (entry := self.entries.get(pid)) is not None and entry.state is PartitionState.SERVING for pid in desired
        )

    def view(self, m: PartitionMap) -> dict[tuple[str, int], PartitionStore]:
        """What should answer here now: per (store, partition), of the versions served or draining, the
        published one, else the newest; never a live partition in a gap."""
        chosen: dict[tuple[str, int], PartitionStore] = {}
        for pid, entry in self.entries.items():
            if entry.store is None or entry.state not in (PartitionState.SERVING, PartitionState.DRAINING):
                continue
            if entry.store.live is not None and entry.store.live.state == GAP:
                continue  # never served as if it were complete
            key = (pid.store, pid.partition)
            current = chosen.get(key)
            if current is None or preferred(entry.store, current, m):
                chosen[key] = entry.store
        return chosen

    def next_retry(self, now: float) -> float | None:
        """In how many seconds the soonest failed load may be tried again (None: none failed)."""
        waits = [e.retry_at - now for e in self.entries.values() if e.state is PartitionState.FAILED]
        return max(0.0, min(waits)) if waits else None

    def handing_over(self) -> frozenset[str]:
        """The stores with a partition held here that is not wanted here at any version (being handed over;
        when leaving, every store held)."""
        wanted = {(pid.store, pid.partition) for pid in self.desired}
        return frozenset(
            pid.store
            for pid, entry in self.entries.items()
            if entry.store is not None
            and entry.state in (PartitionState.SERVING, PartitionState.DRAINING)
            and (self.leaving or (pid.store, pid.partition) not in wanted)
        )

    # -- outcomes ----------------------------------------------------------------------------------------

    def loaded(self, entry: Entry, held: PartitionStore) -> None:
        """Its load is done: a batch partition serves; a live one catches up first."""
        entry.store = held
        entry.state = PartitionState.CATCHING_UP if held.live is not None else PartitionState.SERVING

    def failed(self, entry: Entry, error: str, now: float) -> None:
        """Its load failed: tried again `retry_failed_s` after `now` while still wanted."""
        entry.state, entry.error = PartitionState.FAILED, error
        entry.retry_at = now + self.retry_failed_s

    def forget(self, pid: PartitionId, entry: Entry) -> None:
        """Gone (a cancelled load, a closed partition): no longer held."""
        entry.state = PartitionState.DROPPED
        if self.entries.get(pid) is entry:
            del self.entries[pid]

    def leave(self) -> None:
        """Nothing new is loaded or dropped from now on; loads under way are cancelled."""
        self.leaving = True
        for entry in self.entries.values():
            if entry.state is PartitionState.LOADING:
                entry.cancel.set()

    # -- what it says -------------------------------------------------------------------------------------

    def readiness(self, m: PartitionMap, served: View, fresh_seen: bool) -> Readiness:
        """Judged by `m`, with `served` answering here now and `fresh_seen`: a fresh map was ever read."""
        pending: list[str] = []
        updating: list[str] = []
        failed = {}
        for pid in sorted(self.desired, key=order):
            entry = self.entries.get(pid)
            live = entry.store.live if entry is not None and entry.store is not None else None
            if live is not None and live.state == GAP:
                # Not served, but nothing this node can do until a new version: it does not make it unready.
                failed[str(pid)] = live.error or "gap"
            elif entry is None or entry.state is not PartitionState.SERVING:
                # Another version of the partition still answers here: a swap in progress, not unready (else
                # every publish would make every node unready, and a failed load keep it so).
                (updating if (pid.store, pid.partition) in served else pending).append(str(pid))
                if entry is not None and entry.state is PartitionState.FAILED:
                    failed[str(pid)] = entry.error
        awaiting_assignment = bool(m.stores) and m.assignment.generation == 0
        registered = self.node_id in m.nodes
        if not fresh_seen:
            pending.append("no partition map read from ZooKeeper yet")
        if awaiting_assignment:
            pending.append("no assignment written by the controller yet")
        if not registered and not m.stale:
            pending.append("node record not yet visible in ZooKeeper")
        held = orphans_held(m, served)
        degraded = tuple(
            f"store {store!r}: its record is gone from ZooKeeper without a tombstone (keyroute store delete); "
            f"keeping and serving its {count} partitions held here"
            for store, count in sorted(held.items())
        )
        return Readiness(
            not pending,
            m.stale,
            tuple(pending),
            failed,
            self.leaving,
            m.generation,
            tuple(updating),
            degraded,
            sum(held.values()),
        )

    def live_partitions(self) -> list[tuple[PartitionId, LivePartition]]:
        """Every live partition held here (consuming), in order."""
        held = []
        for pid, entry in sorted(self.entries.items(), key=lambda item: order(item[0])):
            store = entry.store
            if store is not None and store.live is not None and not store.closed:
                held.append((pid, store.live))
        return held

    def describe(self) -> dict[str, Any]:
        """Every (store, version, partition) held or wanted, by store: its state, rows, live status, error."""
        out: dict[str, list[dict[str, Any]]] = {}
        for pid, entry in sorted(self.entries.items(), key=lambda item: order(item[0])):
            row: dict[str, Any] = {
                "partition": pid.partition,
                "version": pid.version,
                "state": entry.state.value,
            }
            if entry.store is not None:
                row["rows"] = entry.store.rows
                if entry.store.live is not None:
                    row["live"] = entry.store.live.status()
            if entry.error:
                row["error"] = entry.error
            out.setdefault(pid.store, []).append(row)
        return out


def wanted_by(m: PartitionMap, node_id: str) -> dict[PartitionId, StoreRecord]:
    """What `m` assigns `node_id`, at the published versions."""
    desired: dict[PartitionId, StoreRecord] = {}
    for store, partitions in m.assignment.partitions_of(node_id).items():
        record = m.stores.get(store)
        if record is None:
            continue
        for p in partitions:
            if p < record.partitions:
                desired[PartitionId(store, record.version, p)] = record
    return desired


def orphans_held(m: PartitionMap, served: View) -> dict[str, int]:
    """store -> how many of its partitions answer here (`served`), for every store whose record is gone from
    ZooKeeper without a tombstone."""
    orphaned = m.orphaned
    held: dict[str, int] = {}
    if not orphaned:
        return held
    for store, _ in served:
        if store in orphaned:
            held[store] = held.get(store, 0) + 1
    return held


def order(pid: PartitionId) -> tuple[str, int, int]:
    return (pid.store, pid.partition, pid.version)


def preferred(candidate: PartitionStore, current: PartitionStore, m: PartitionMap) -> bool:
    """Between two loaded versions of one partition, serve the published one, else the newest."""
    record = m.stores.get(candidate.pid.store)
    published = record.version if record is not None else None
    if current.version == published:
        return False
    return candidate.version == published or candidate.version > current.version
