"""What this node holds: the lifecycle of every partition it loads, serves, hands over and drops.

Driven by partition maps on the event loop; loads run in worker threads; readers see an immutable view.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from threading import Event
from types import MappingProxyType
from typing import Any

from keyroute.cluster.partition_map import PartitionMap, StoreRecord
from keyroute.runtime.logs import describe
from keyroute.runtime.settings import NodeSettings
from keyroute.state_node.live import GAP, ApplierSettings, LiveApplier, LivePartition, LiveVersion
from keyroute.state_node.registration import Registration
from keyroute.state_node.store import (
    LoadCancelled,
    LoadError,
    PartitionId,
    PartitionStore,
    iter_partition_dirs,
    load_partition,
    remove_partition_dir,
)

log = logging.getLogger(__name__)

Loader = Callable[[Path, StoreRecord, int, int, Callable[[], bool]], PartitionStore]

# How often the live status record (/live/{node_id}) may be rewritten.
LIVE_REPORT_EVERY_S = 1.0


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

    A live partition (keyroute.state_node.live) consumes its topic partition from the moment it is loaded until
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


class _Collection(enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"


@dataclass(slots=True)
class _Entry:
    record: StoreRecord
    state: PartitionState = PartitionState.ASSIGNED
    store: PartitionStore | None = None
    error: str = ""
    retry_at: float = 0.0
    cancel: Event = field(default_factory=Event)


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


class Ownership:
    """Reconciles what this node holds with each new partition map.

    All state is touched on the event loop only. Readers call `local()`, which reads one attribute
    holding an immutable mapping {(store, partition): PartitionStore}, replaced whole on every change.
    """

    def __init__(
        self,
        settings: NodeSettings,
        registration: Registration,
        *,
        max_parallel_loads: int = 2,
        drop_grace_s: float = 2.0,
        retry_failed_s: float = 5.0,
        loader: Loader = load_partition,
        follow: Callable[[frozenset[str]], None] | None = None,
    ) -> None:
        self._settings = settings
        self._node_id = settings.node_id
        self._registration = registration
        self._max_parallel_loads = max_parallel_loads
        self._drop_grace_s = drop_grace_s
        self._version_grace_s = settings.version_grace_s
        self._retry_failed_s = retry_failed_s
        self._loader = loader
        # Asks the map watcher for the whole assignment of the stores this node hands partitions over in
        # (its map otherwise holds only this node's share): make before break needs the other replicas.
        self._follow = follow
        self._following: frozenset[str] = frozenset()
        self._executor = ThreadPoolExecutor(max_parallel_loads, thread_name_prefix="keyroute-load")
        self._map = PartitionMap.empty().marked_stale(True)
        self._entries: dict[PartitionId, _Entry] = {}
        self._view: Mapping[tuple[str, int], PartitionStore] = MappingProxyType({})
        self._desired: frozenset[PartitionId] = frozenset()
        self._tasks: set[asyncio.Task[None]] = set()
        self._publish_lock = asyncio.Lock()
        self._published: dict[str, dict[int, int]] | None = None
        self._registering = False
        # Leftover directories from earlier runs are removed once, when the node first holds everything
        # the controller assigned it (so the assignment includes it: files it may get back are kept).
        self._collection = _Collection.PENDING
        # Partitions whose directory is being removed: not loaded until the removal is done, so a
        # removal never races a load writing into the same directory.
        self._deleting: set[PartitionId] = set()
        self._retry_handle: asyncio.TimerHandle | None = None
        self._stopping = False
        self._leaving = False
        self._withdrawn = False
        self._fresh_seen = False
        self._map_changed = asyncio.Event()
        # Spawned tasks that are only waiting out a grace period (see `settled`).
        self._in_grace = 0
        # Live stores: one applier per (store, version) held here, and the status record's last content.
        self._appliers: dict[tuple[str, int], LiveApplier] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._live_reporter: asyncio.Task[None] | None = None
        self._live_reported: dict[str, Any] | None = None
        # Stores whose record is gone without a tombstone, already said so in the log (said once each).
        self._orphans_said: set[str] = set()

    # -- readers -----------------------------------------------------------------------------------

    @property
    def map(self) -> PartitionMap:
        return self._map

    def local(self, store: str, partition: int) -> PartitionStore | None:
        return self._view.get((store, partition))

    def live_partitions(self) -> list[tuple[PartitionId, LivePartition]]:
        """Every live partition held here (consuming), in order."""
        held = []
        for pid, entry in sorted(self._entries.items(), key=lambda item: _order(item[0])):
            store = entry.store
            if store is not None and store.live is not None and not store.closed:
                held.append((pid, store.live))
        return held

    def live_report(self) -> dict[str, dict[str, dict[str, Any]]]:
        """store -> {"<partition>": status} of the live partitions held here: for each partition the
        version served (else the newest held)."""
        chosen: dict[tuple[str, int], tuple[PartitionId, LivePartition]] = {}
        for pid, live in self.live_partitions():
            key = (pid.store, pid.partition)
            served = self._view.get(key)
            current = chosen.get(key)
            is_served = served is not None and served.version == pid.version
            current_served = current is not None and served is not None and served.version == current[0].version
            if is_served or current is None or (not current_served and pid.version > current[0].version):
                chosen[key] = (pid, live)
        report: dict[str, dict[str, dict[str, Any]]] = {}
        for (store, partition), (_, live) in sorted(chosen.items()):
            report.setdefault(store, {})[str(partition)] = live.status()
        return report

    def serving_view(self) -> dict[str, dict[int, int]]:
        """What this node announces: store -> {partition: version}."""
        announced: dict[str, dict[int, int]] = {}
        for (store, partition), held in sorted(self._view.items()):
            announced.setdefault(store, {})[partition] = held.version
        return announced

    def readiness(self) -> Readiness:
        m = self._map
        pending: list[str] = []
        updating: list[str] = []
        failed = {}
        served = self._view  # what answers here now, whatever its version
        for pid in sorted(self._desired, key=_order):
            entry = self._entries.get(pid)
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
        registered = self._node_id in m.nodes
        if not self._fresh_seen:
            pending.append("no partition map read from ZooKeeper yet")
        if awaiting_assignment:
            pending.append("no assignment written by the controller yet")
        if not registered and not m.stale:
            pending.append("node record not yet visible in ZooKeeper")
        ready = not pending
        held = self._orphans_held()
        degraded = tuple(
            f"store {store!r}: its record is gone from ZooKeeper without a tombstone (keyroute store delete); "
            f"keeping and serving its {count} partitions held here"
            for store, count in sorted(held.items())
        )
        return Readiness(
            ready,
            m.stale,
            tuple(pending),
            failed,
            self._leaving,
            m.generation,
            tuple(updating),
            degraded,
            sum(held.values()),
        )

    def _orphans_held(self) -> dict[str, int]:
        """store -> how many of its partitions this node holds, for every store whose record is gone from
        ZooKeeper without a tombstone."""
        orphaned = self._map.orphaned
        held: dict[str, int] = {}
        if not orphaned:
            return held
        for store, _ in self._view:
            if store in orphaned:
                held[store] = held.get(store, 0) + 1
        return held

    @property
    def leaving(self) -> bool:
        return self._leaving

    def alone(self) -> int | None:
        """With no other live node in a fresh map: how many partitions this node holds (which then nobody
        else serves); otherwise None."""
        m = self._map
        if m.stale or m.live_nodes() - {self._node_id}:
            return None
        return len(self._view)

    def handed_over(self) -> list[str]:
        """What still keeps a leaving node (empty: it may go): the assignment still placing it, and every
        partition it serves that no live node assigned it serves at the published version yet. Waiting
        for the new assignment too keeps each partition's replica count during a rolling restart. With
        no other live node there is nobody to hand over to: nothing keeps it. A stale map proves
        nothing, so then everything held is listed."""
        m = self._map
        held = sorted(self._view)
        if m.stale:
            return [f"{store} p{p}" for store, p in held]
        if not m.live_nodes() - {self._node_id}:
            return []
        remaining = [f"{store} p{p}" for store, p in held if not m.served_elsewhere(store, p, self._node_id)]
        if m.assignment.partitions_of(self._node_id):
            remaining.append(f"assignment generation {m.assignment.generation} still places this node")
        return remaining

    def leave(self) -> None:
        """Stop taking new work: nothing new is loaded or dropped; what is held keeps being served."""
        self._leaving = True
        for entry in self._entries.values():
            if entry.state is PartitionState.LOADING:
                entry.cancel.set()
        self._reconcile()

    async def wait_handed_over(self, timeout_s: float) -> list[str]:
        """Wait (at most `timeout_s`) until `handed_over()` is empty; returns what still is not."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            self._map_changed.clear()
            remaining = self.handed_over()
            left = deadline - loop.time()
            if not remaining or left <= 0:
                return remaining
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._map_changed.wait(), timeout=min(left, 1.0))

    async def wait_for_map(self, predicate: Callable[[PartitionMap], bool], timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) for a fresh map that satisfies `predicate`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            self._map_changed.clear()
            if not self._map.stale and predicate(self._map):
                return True
            left = deadline - loop.time()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._map_changed.wait(), timeout=min(left, 1.0))

    async def withdraw(self) -> None:
        """De-announce this node (delete /serving/{id}) and never announce again; the view stays, so
        reads from routers whose map is a moment old still get answers until the server stops."""
        self._withdrawn = True
        async with self._publish_lock:
            try:
                await asyncio.to_thread(self._registration.withdraw_serving)
            except Exception as exc:  # ZooKeeper unreachable: the record goes with the session
                log.warning("withdrawing the serving record failed: %s", describe(exc))
        if self._live_reporter is not None:
            self._live_reporter.cancel()
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self._registration.withdraw_live)

    def describe(self) -> dict[str, Any]:
        """Local lifecycle for /admin/partition-map: every (store, version, partition) held or wanted."""
        out: dict[str, list[dict[str, Any]]] = {}
        for pid, entry in sorted(self._entries.items(), key=lambda item: _order(item[0])):
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

    # -- driven by the map watcher -----------------------------------------------------------------

    def on_map(self, new_map: PartitionMap) -> None:
        """Take a new map (on the event loop: the watcher hands it over with call_soon_threadsafe)."""
        if self._stopping:
            return
        self._map = new_map
        self._map_changed.set()
        if not new_map.stale:
            self._fresh_seen = True
        self._reconcile()
        if new_map.stale or self._withdrawn:
            return
        if self._node_id not in new_map.nodes and not self._registering:
            # The session was replaced (expired while disconnected): ephemeral records died with it.
            self._registering = True
            self._spawn(self._register())
        announced = new_map.serving.get(self._node_id)
        if announced is None or announced.stores != self.serving_view():
            self._spawn(self._publish())

    async def stop(self) -> None:
        """Cancel loads, close every environment; files stay on disk for a fast restart."""
        self._stopping = True
        if self._retry_handle is not None:
            self._retry_handle.cancel()
        for entry in self._entries.values():
            entry.cancel.set()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._view = MappingProxyType({})
        if self._live_reporter is not None:
            self._live_reporter.cancel()
            await asyncio.gather(self._live_reporter, return_exceptions=True)
        # Every applier stops before any environment closes: no write ever reaches a closed one.
        appliers, self._appliers = list(self._appliers.values()), {}
        for applier in appliers:
            await asyncio.to_thread(applier.close)
        for entry in self._entries.values():
            if entry.store is not None:
                entry.store.close()
                entry.store = None

    # -- reconciliation ----------------------------------------------------------------------------

    def _reconcile(self) -> None:
        if self._stopping:
            return
        m = self._map
        now = time.monotonic()
        desired: dict[PartitionId, StoreRecord] = {}
        for store, partitions in m.assignment.partitions_of(self._node_id).items():
            record = m.stores.get(store)
            if record is None:
                continue
            for p in partitions:
                if p < record.partitions:
                    desired[PartitionId(store, record.version, p)] = record
        self._desired = frozenset(desired)

        for pid in sorted(desired, key=_order):
            entry = self._entries.get(pid)
            if entry is None:
                self._entries[pid] = _Entry(desired[pid])
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
            elif entry.state is PartitionState.DROPPED and entry.store is not None and not self._leaving:
                # Assigned here again within the drop grace period: still open, serve it again.
                live = entry.store.live
                entry.state = (
                    PartitionState.CATCHING_UP if live is not None and not live.caught_up else PartitionState.SERVING
                )
            elif entry.state is PartitionState.LOADING and not self._leaving:
                entry.cancel.clear()  # wanted again before the cancelled load noticed

        for pid, entry in list(self._entries.items()):
            if pid in desired:
                continue
            if entry.state in (PartitionState.ASSIGNED, PartitionState.FAILED):
                del self._entries[pid]
            elif entry.state is PartitionState.LOADING:
                entry.cancel.set()  # the finished load sees it and discards its files
            elif entry.state is PartitionState.CATCHING_UP and not self._leaving and pid.store not in m.orphaned:
                # Never served: nothing to hand over. A superseded version's files stay for a rollback.
                newer = any(d.store == pid.store and d.partition == pid.partition for d in desired)
                self._drop(pid, entry, superseded=newer)

        if self._collection is _Collection.PENDING and self._may_collect(m, desired):
            self._collection = _Collection.RUNNING
            self._spawn(self._collect_leftovers())
        loading = sum(1 for e in self._entries.values() if e.state is PartitionState.LOADING)
        for pid in sorted(self._entries, key=_order):
            entry = self._entries[pid]
            if self._leaving:
                break
            if (
                entry.state is PartitionState.ASSIGNED
                and loading < self._max_parallel_loads
                and pid not in self._deleting
            ):
                entry.state = PartitionState.LOADING
                loading += 1
                self._spawn(self._load(pid, entry))

        wanted_version = {(pid.store, pid.partition): pid for pid in desired}
        for pid, entry in list(self._entries.items()):
            if entry.state in (PartitionState.SERVING, PartitionState.DRAINING) and pid not in desired:
                wanted = wanted_version.get((pid.store, pid.partition))
                if not self._leaving and self._may_drop(pid, m, wanted):
                    self._drop(pid, entry, superseded=wanted is not None)
                else:
                    entry.state = PartitionState.DRAINING

        self._rebuild_view()
        self._schedule_retry(now)
        self._follow_handovers(desired)
        self._say_orphans()

    def _say_orphans(self) -> None:
        """Log once per store that its record vanished without a tombstone and what this node does about it."""
        held = self._orphans_held()
        for store in sorted(held.keys() - self._orphans_said):
            log.warning(
                "store %s: its record is gone from ZooKeeper but it has no tombstone (keyroute store delete): "
                "absence is not deletion, so this node keeps serving its %d partitions and their files; "
                "restore its record (publish it again, or from a ZooKeeper backup) or run keyroute store delete",
                store,
                held[store],
            )
        for store in sorted(self._orphans_said - self._map.orphaned):
            if store in self._map.stores:
                log.info("store %s: its record is back in ZooKeeper", store)
        self._orphans_said = (self._orphans_said & self._map.orphaned) | held.keys()

    def _follow_handovers(self, desired: Mapping[PartitionId, StoreRecord]) -> None:
        """Ask for the whole assignment of every store with a partition held here that is not wanted here at
        any version (being handed over; when leaving, everything held), and only of those."""
        if self._follow is None:
            return
        wanted = {(pid.store, pid.partition) for pid in desired}
        stores = frozenset(
            pid.store
            for pid, entry in self._entries.items()
            if entry.store is not None
            and entry.state in (PartitionState.SERVING, PartitionState.DRAINING)
            and (self._leaving or (pid.store, pid.partition) not in wanted)
        )
        if stores != self._following:
            self._following = stores
            self._follow(stores)

    def _may_drop(self, pid: PartitionId, m: PartitionMap, wanted: PartitionId | None) -> bool:
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
            successor = self._entries.get(wanted)
            return (
                successor is not None
                and successor.state is PartitionState.SERVING
                and (successor.store is None or successor.store.live is None or successor.store.live.serves)
            )
        if m.stale:
            return False  # a stale map cannot prove that anyone else has taken over
        # Only a live node counts: a leaving one is about to let go of its copy too.
        return m.served_elsewhere(pid.store, pid.partition, self._node_id)

    def _may_collect(self, m: PartitionMap, desired: Mapping[PartitionId, StoreRecord]) -> bool:
        """Whether leftovers can be told from partitions this node is about to get back: once the map is
        fresh, this node is registered, and the assignment gives it partitions that are all served here
        (a restarted node first sees the assignment of before its restart, which may not include it)."""
        if m.stale or self._node_id not in m.nodes or not desired:
            return False
        return all(
            (entry := self._entries.get(pid)) is not None and entry.state is PartitionState.SERVING for pid in desired
        )

    def _rebuild_view(self) -> None:
        chosen: dict[tuple[str, int], PartitionStore] = {}
        for pid, entry in self._entries.items():
            if entry.store is None or entry.state not in (PartitionState.SERVING, PartitionState.DRAINING):
                continue
            if entry.store.live is not None and entry.store.live.state == GAP:
                continue  # never served as if it were complete
            key = (pid.store, pid.partition)
            current = chosen.get(key)
            if current is None or _preferred(entry.store, current, self._map):
                chosen[key] = entry.store
        if dict(self._view) != chosen:
            self._view = MappingProxyType(chosen)  # one assignment: readers see the old or the new view
            self._spawn(self._publish())

    def _schedule_retry(self, now: float) -> None:
        if self._retry_handle is not None:
            self._retry_handle.cancel()
            self._retry_handle = None
        waits = [e.retry_at - now for e in self._entries.values() if e.state is PartitionState.FAILED]
        if waits:
            loop = asyncio.get_running_loop()
            self._retry_handle = loop.call_later(max(0.0, min(waits)) + 0.01, self._reconcile)

    # -- actions -----------------------------------------------------------------------------------

    async def _load(self, pid: PartitionId, entry: _Entry) -> None:
        loop = asyncio.get_running_loop()
        settings = self._settings
        try:
            held = await loop.run_in_executor(
                self._executor,
                self._loader,
                settings.data_dir,
                entry.record,
                pid.partition,
                settings.lmdb_map_size_bytes,
                entry.cancel.is_set,
            )
        except LoadCancelled:
            self._forget(pid, entry)
        except LoadError as exc:
            if entry.cancel.is_set() or self._stopping:
                self._forget(pid, entry)
            else:
                log.warning("loading %s failed: %s", pid, describe(exc))
                entry.state, entry.error = PartitionState.FAILED, str(exc)
                entry.retry_at = time.monotonic() + self._retry_failed_s
        except Exception as exc:  # a bug must not wedge the partition in LOADING forever
            log.exception("loading %s failed unexpectedly", pid)
            entry.state, entry.error = PartitionState.FAILED, f"internal error: {exc!r}"
            entry.retry_at = time.monotonic() + self._retry_failed_s
        else:
            if entry.cancel.is_set() or self._stopping:
                if self._stopping:
                    held.close()
                else:
                    await asyncio.to_thread(held.discard)
                self._forget(pid, entry)
            elif held.live is not None:
                log.info("loaded %s (%d rows); consuming from offset %d", pid, held.rows, held.live.next_offset)
                entry.store, entry.state = held, PartitionState.CATCHING_UP
                await self._start_consuming(entry.record, held)
            else:
                log.info("loaded %s (%d rows)", pid, held.rows)
                entry.store, entry.state = held, PartitionState.SERVING
        self._reconcile()

    # -- live partitions -----------------------------------------------------------------------------

    async def _start_consuming(self, record: StoreRecord, held: PartitionStore) -> None:
        live = held.live
        assert live is not None
        loop = self._loop = asyncio.get_running_loop()

        def changed(_: LivePartition) -> None:  # on the applier's thread
            with contextlib.suppress(RuntimeError):  # the loop is closing
                loop.call_soon_threadsafe(self._reconcile)

        live.on_change = changed
        key = (held.pid.store, held.pid.version)
        applier = self._appliers.get(key)
        if applier is None:
            source = LiveVersion(
                held.pid.store,
                held.pid.version,
                live.config,
                record.key_format,
                record.partitioner,
                record.partitions,
                record.key_schema,
            )
            settings = ApplierSettings(
                batch_records=self._settings.live_batch_records, sync_interval_s=self._settings.live_sync_ms / 1000
            )
            applier = self._appliers[key] = LiveApplier(source, node_id=self._node_id, settings=settings)
        await asyncio.to_thread(applier.add, held)
        if self._live_reporter is None and not self._stopping:
            self._live_reporter = asyncio.ensure_future(self._report_live())

    async def _stop_consuming(self, held: PartitionStore) -> None:
        """Stop applying to `held` (before it closes); the applier goes with its last partition."""
        if held.live is None:
            return
        held.live.on_change = None
        key = (held.pid.store, held.pid.version)
        applier = self._appliers.get(key)
        if applier is None:
            return
        await asyncio.to_thread(applier.remove, held.pid.partition)
        if not applier.partitions and self._appliers.get(key) is applier:
            del self._appliers[key]
            await asyncio.to_thread(applier.close)

    async def _report_live(self) -> None:
        """Write /live/{node_id} about once a second, when what it says changed (and while held)."""
        while not self._stopping and not self._withdrawn:
            stores = self.live_report()
            if stores != self._live_reported:
                try:
                    if stores:
                        report = {"stores": stores, "updated_at": time.time()}
                        await asyncio.to_thread(self._registration.publish_live, report)
                    else:
                        await asyncio.to_thread(self._registration.withdraw_live)
                    self._live_reported = stores
                except Exception as exc:  # ZooKeeper unreachable: tried again next time
                    log.debug("publishing the live status failed: %s", describe(exc))
            await asyncio.sleep(LIVE_REPORT_EVERY_S)

    def _forget(self, pid: PartitionId, entry: _Entry) -> None:
        entry.state = PartitionState.DROPPED
        if self._entries.get(pid) is entry:
            del self._entries[pid]

    def _drop(self, pid: PartitionId, entry: _Entry, superseded: bool = False) -> None:
        entry.state = PartitionState.DROPPED
        self._spawn(self._retire(pid, entry, superseded))

    async def _retire(self, pid: PartitionId, entry: _Entry, superseded: bool) -> None:
        # Unannounce first (the view rebuild after this reconcile publishes without it), then give
        # readers that still hold the old map or the old view a grace period before closing.
        await self._publish()
        await self._grace(self._drop_grace_s)
        if entry.state is not PartitionState.DROPPED:
            return  # assigned here again during the grace period, and serving again
        held, entry.store = entry.store, None
        if self._entries.get(pid) is entry:
            del self._entries[pid]
        if held is not None:
            await self._stop_consuming(held)  # before it closes
            if superseded and self._version_grace_s > 0:
                # A superseded version's files stay for the version grace period: a rollback reuses them.
                log.info("closing %s; its files go in %.0fs", pid, self._version_grace_s)
                held.close()
                self._spawn(self._remove_later(pid, held.path))
            else:
                log.info("dropping %s", pid)
                await self._remove(pid, held.discard)
        self._reconcile()  # it may have been assigned here again during the grace period

    async def _remove_later(self, pid: PartitionId, path: Path) -> None:
        await self._grace(self._version_grace_s)
        if pid in self._entries or self._stopping:
            return  # wanted again (a rollback) and reused, or about to be: keep the files
        log.info("removing %s (superseded %.0fs ago)", pid, self._version_grace_s)
        await self._remove(pid, functools.partial(remove_partition_dir, path))
        self._reconcile()

    async def _remove(self, pid: PartitionId, removal: Callable[[], None]) -> None:
        self._deleting.add(pid)
        try:
            await asyncio.to_thread(removal)
        finally:
            self._deleting.discard(pid)

    async def _publish(self) -> None:
        async with self._publish_lock:
            if self._withdrawn:
                return
            announced = self.serving_view()
            current = self._map.serving.get(self._node_id)
            if announced == self._published and current is not None and current.stores == announced:
                return
            try:
                await asyncio.to_thread(self._registration.publish_serving, announced)
                self._published = announced
            except Exception as exc:  # ZooKeeper unreachable: the next map after reconnecting retries
                log.warning("publishing the serving record failed: %s", describe(exc))
                self._published = None

    async def _register(self) -> None:
        try:
            await asyncio.to_thread(self._registration.register_node)
            self._published = None
            self._live_reported = None  # the live record went with the old session too
            await self._publish()
        except Exception as exc:
            log.warning("re-registering node %s failed: %s", self._node_id, describe(exc))
        finally:
            self._registering = False

    async def _collect_leftovers(self) -> None:
        """Remove partition directories from earlier runs that nothing here wants (startup only): those of
        a store that has a record (another version or partition) or a tombstone. A store with neither may
        just be missing from a damaged ZooKeeper: its files stay."""
        m = self._map
        kept: dict[str, int] = {}
        try:
            on_disk = await asyncio.to_thread(_on_disk, self._settings.data_dir)
            for pid, path in on_disk:
                if pid in self._entries or pid in self._deleting:
                    continue
                known = pid.store in m.stores and pid.store not in m.orphaned
                if not known and not m.deletes(pid.store, pid.version):
                    kept[pid.store] = kept.get(pid.store, 0) + 1
                    continue
                log.info("removing leftover partition directory %s", path)
                await self._remove(pid, functools.partial(remove_partition_dir, path))
        except OSError as exc:
            log.warning("cleaning leftover partitions failed: %s", describe(exc))
        finally:
            self._collection = _Collection.DONE
        for store, count in sorted(kept.items()):
            log.warning(
                "keeping %d partition directories of store %s: it has neither a record nor a tombstone in "
                "ZooKeeper (absence is not deletion; keyroute store delete removes a store)",
                count,
                store,
            )
        self._reconcile()

    async def _grace(self, delay_s: float) -> None:
        self._in_grace += 1
        try:
            await asyncio.sleep(delay_s)
        finally:
            self._in_grace -= 1

    async def settled(self, *, graces: bool = False, timeout_s: float = 10.0) -> None:
        """Wait until everything started so far has run its course: loads, publishes, registrations and
        removals (and, with `graces`, the grace periods of dropped or superseded partitions too). Then the
        state is what the maps given so far lead to, until the next map or the next grace period ends.
        Raises TimeoutError after `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        await asyncio.sleep(0)  # what was just scheduled (a task's first step, a callback) runs first
        while True:
            busy = [task for task in self._tasks if not task.done()]
            if len(busy) <= (0 if graces else self._in_grace):
                return
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError(f"{len(busy)} ownership tasks still running after {timeout_s}s")
            # A task in its grace period wakes none of these: look again now and then.
            await asyncio.wait(busy, timeout=min(left, 0.01), return_when=asyncio.FIRST_COMPLETED)

    def _spawn(self, work: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _on_disk(data_dir: Path) -> list[tuple[PartitionId, Path]]:
    return list(iter_partition_dirs(data_dir))


def _order(pid: PartitionId) -> tuple[str, int, int]:
    return (pid.store, pid.partition, pid.version)


def _preferred(candidate: PartitionStore, current: PartitionStore, m: PartitionMap) -> bool:
    """Between two loaded versions of one partition, serve the published one, else the newest."""
    record = m.stores.get(candidate.pid.store)
    published = record.version if record is not None else None
    if current.version == published:
        return False
    return candidate.version == published or candidate.version > current.version
