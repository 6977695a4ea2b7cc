"""What this node holds: the lifecycle of every partition it loads, serves, hands over and drops.

Driven by partition maps on the event loop; loads run in worker threads; readers see an immutable view.
`Ownership` carries out what its parts decide and do: the lifecycle's decisions (keyroute.state_node.lifecycle),
the live partitions' appliers (live_appliers), the removal of directories from disk (janitor) and what the node
tells ZooKeeper (announcer).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import MappingProxyType
from typing import Any

from keyroute.cluster.partition_map import PartitionMap, StoreRecord
from keyroute.replica.expiry import sweep_expired
from keyroute.replica.live import LivePartition
from keyroute.replica.store import LoadCancelled, LoadError, PartitionId, PartitionStore, load_partition
from keyroute.runtime.clock import SYSTEM_CLOCK, Clock, Timer
from keyroute.runtime.logs import describe
from keyroute.runtime.settings import NodeSettings
from keyroute.state_node.announcer import LIVE_REPORT_EVERY_S, Announcer
from keyroute.state_node.janitor import DiskJanitor
from keyroute.state_node.lifecycle import Entry, Lifecycle, PartitionState, Readiness, orphans_held
from keyroute.state_node.live_appliers import LiveAppliers
from keyroute.state_node.registration import Registration
from keyroute.storage.timeline import StoreKind

__all__ = ["LIVE_REPORT_EVERY_S", "Loader", "Ownership", "PartitionState", "Readiness"]

log = logging.getLogger(__name__)

Loader = Callable[[Path, StoreRecord, int, int, Callable[[], bool]], PartitionStore]


class Ownership:
    """Reconciles what this node holds with each new partition map.

    All state is touched on the event loop only. Readers call `local()` (or read `held` itself), which reads one
    attribute holding an immutable mapping {(store, partition): PartitionStore}, replaced whole on every change,
    and `map`, the partition map, replaced whole too.
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
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        """`clock`: the time of its grace periods, load retries and live status reports."""
        self._settings = settings
        self._clock = clock
        self._node_id = settings.node_id
        self._drop_grace_s = drop_grace_s
        self._version_grace_s = settings.version_grace_s
        self._loader = loader
        # Asks the map watcher for the whole assignment of the stores this node hands partitions over in
        # (its map otherwise holds only this node's share): make before break needs the other replicas.
        self._follow = follow
        self._following: frozenset[str] = frozenset()
        self._executor = ThreadPoolExecutor(max_parallel_loads, thread_name_prefix="keyroute-load")
        # The partition map reads are routed with: a plain attribute, not a property (read once per read, from
        # compiled code: no interpreted frame), replaced whole by `on_map` on the event loop only.
        self.map: PartitionMap = PartitionMap.empty().marked_stale(True)
        self._lifecycle = Lifecycle(settings.node_id, max_parallel_loads, retry_failed_s)
        # {(store, partition): PartitionStore} of the partitions served here (`local`), an immutable mapping
        # replaced whole on every change: a plain attribute, which the compiled read path reads directly.
        self.held: Mapping[tuple[str, int], PartitionStore] = MappingProxyType({})
        self._tasks: set[asyncio.Task[None]] = set()
        self._announcer = Announcer(
            registration, settings.node_id, self.serving_view, lambda: self.map, self._spawn, clock
        )
        self._janitor = DiskJanitor(settings.data_dir)
        self._appliers = LiveAppliers(settings)
        self._retry_handle: Timer | None = None
        self._stopping = False
        self._fresh_seen = False
        self._map_changed = asyncio.Event()
        # Spawned tasks that are only waiting out a grace period (see `settled`).
        self._in_grace = 0
        # Stores whose record is gone without a tombstone, already said so in the log (said once each).
        self._orphans_said: set[str] = set()
        # Deletes expired values from the live partitions held here, every `expiry_sweep_s` (`_sweep_expired`):
        # started once there is one to sweep, outside `_tasks` (it never settles).
        self._sweeper: asyncio.Task[None] | None = None

    # -- readers -----------------------------------------------------------------------------------

    def local(self, store: str, partition: int) -> PartitionStore | None:
        return self.held.get((store, partition))

    def live_partitions(self) -> list[tuple[PartitionId, LivePartition]]:
        """Every live partition held here (consuming), in order."""
        return self._lifecycle.live_partitions()

    def live_report(self) -> dict[str, dict[str, dict[str, Any]]]:
        """store -> {"<partition>": status} of the live partitions held here: for each partition the
        version served (else the newest held)."""
        chosen: dict[tuple[str, int], tuple[PartitionId, LivePartition]] = {}
        for pid, live in self.live_partitions():
            key = (pid.store, pid.partition)
            served = self.held.get(key)
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
        for (store, partition), held in sorted(self.held.items()):
            announced.setdefault(store, {})[partition] = held.version
        return announced

    def readiness(self) -> Readiness:
        return self._lifecycle.readiness(self.map, self.held, self._fresh_seen)

    @property
    def leaving(self) -> bool:
        return self._lifecycle.leaving

    def alone(self) -> int | None:
        """With no other live node in a fresh map: how many partitions this node holds (which then nobody
        else serves); otherwise None."""
        m = self.map
        if m.stale or m.live_nodes() - {self._node_id}:
            return None
        return len(self.held)

    def handed_over(self) -> list[str]:
        """What still keeps a leaving node (empty: it may go): the assignment still placing it, and every
        partition it serves that no live node assigned it serves at the published version yet. Waiting
        for the new assignment too keeps each partition's replica count during a rolling restart. With
        no other live node there is nobody to hand over to: nothing keeps it. A stale map proves
        nothing, so then everything held is listed."""
        m = self.map
        held = sorted(self.held)
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
        self._lifecycle.leave()
        self._reconcile()

    async def wait_handed_over(self, timeout_s: float) -> list[str]:
        """Wait (at most `timeout_s` of its clock) until `handed_over()` is empty; returns what still is not."""
        deadline = self._clock.monotonic() + timeout_s
        while True:
            self._map_changed.clear()
            remaining = self.handed_over()
            left = deadline - self._clock.monotonic()
            if not remaining or left <= 0:
                return remaining
            await self._next_map(min(left, 1.0))  # and look again now and then: the view changes too

    async def wait_for_map(self, predicate: Callable[[PartitionMap], bool], timeout_s: float) -> bool:
        """Wait (at most `timeout_s` of its clock) for a fresh map that satisfies `predicate`."""
        deadline = self._clock.monotonic() + timeout_s
        while True:
            self._map_changed.clear()
            if not self.map.stale and predicate(self.map):
                return True
            left = deadline - self._clock.monotonic()
            if left <= 0:
                return False
            await self._next_map(min(left, 1.0))  # and look again now and then: the view changes too

    async def _next_map(self, timeout_s: float) -> None:
        """Wait until the next map is taken, or `timeout_s` of the clock has passed."""
        changed = asyncio.ensure_future(self._map_changed.wait())
        timeout = asyncio.ensure_future(self._clock.sleep(timeout_s))
        try:
            await asyncio.wait((changed, timeout), return_when=asyncio.FIRST_COMPLETED)
        finally:
            changed.cancel()
            timeout.cancel()

    async def withdraw(self) -> None:
        """De-announce this node (delete /serving/{id}) and never announce again; the view stays, so
        reads from routers whose map is a moment old still get answers until the server stops."""
        await self._announcer.withdraw()

    def describe(self) -> dict[str, Any]:
        """Local lifecycle for /admin/partition-map: every (store, version, partition) held or wanted."""
        return self._lifecycle.describe()

    # -- driven by the map watcher -----------------------------------------------------------------

    def on_map(self, new_map: PartitionMap) -> None:
        """Take a new map (on the event loop: the watcher hands it over with call_soon_threadsafe)."""
        if self._stopping:
            return
        self.map = new_map
        self._map_changed.set()
        if not new_map.stale:
            self._fresh_seen = True
        self._reconcile()
        self._announcer.map_changed(new_map)

    async def stop(self) -> None:
        """Cancel loads, close every environment; files stay on disk for a fast restart."""
        self._stopping = True
        self._announcer.halt()
        if self._retry_handle is not None:
            self._retry_handle.cancel()
        entries = self._lifecycle.entries
        for entry in entries.values():
            entry.cancel.set()
        tasks = list(self._tasks)
        if self._sweeper is not None:
            tasks.append(self._sweeper)  # a sweep under way ends its transaction before the environment closes
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.held = MappingProxyType({})
        await self._announcer.stop()
        # Every applier stops before any environment closes: no write ever reaches a closed one.
        await self._appliers.close()
        for entry in entries.values():
            if entry.store is not None:
                entry.store.close()
                entry.store = None

    # -- reconciliation ----------------------------------------------------------------------------

    def _reconcile(self) -> None:
        """Carry out what the lifecycle decides with the current map: drops, the leftovers' collection, loads."""
        if self._stopping:
            return
        m = self.map
        now = self._clock.monotonic()
        lifecycle, janitor = self._lifecycle, self._janitor
        for pid, entry, superseded in lifecycle.take_map(m, now):
            self._spawn(self._retire(pid, entry, superseded))
        if janitor.leftovers_pending and lifecycle.may_collect(m):
            janitor.leftovers_pending = False
            self._spawn(self._collect_leftovers())
        for pid, entry in lifecycle.start_loads(janitor.deleting):
            self._spawn(self._load(pid, entry))
        for pid, entry, superseded in lifecycle.let_go(m):
            self._spawn(self._retire(pid, entry, superseded))
        self._rebuild_view()
        self._schedule_retry(now)
        self._follow_handovers()
        if self._sweeper is None and self._settings.expiry_sweep_s > 0 and any(map(self._sweeps, self.held.values())):
            self._sweeper = asyncio.ensure_future(self._sweep_expired(self._settings.expiry_sweep_s))
        self._say_orphans()

    def _say_orphans(self) -> None:
        """Log once per store that its record vanished without a tombstone and what this node does about it."""
        held = orphans_held(self.map, self.held)
        for store in sorted(held.keys() - self._orphans_said):
            log.warning(
                "store %s: its record is gone from ZooKeeper but it has no tombstone (keyroute store delete): "
                "absence is not deletion, so this node keeps serving its %d partitions and their files; "
                "restore its record (publish it again, or from a ZooKeeper backup) or run keyroute store delete",
                store,
                held[store],
            )
        for store in sorted(self._orphans_said - self.map.orphaned):
            if store in self.map.stores:
                log.info("store %s: its record is back in ZooKeeper", store)
        self._orphans_said = (self._orphans_said & self.map.orphaned) | held.keys()

    def _follow_handovers(self) -> None:
        """Ask for the whole assignment of every store with a partition held here that is not wanted here at
        any version (being handed over; when leaving, everything held), and only of those."""
        if self._follow is None:
            return
        stores = self._lifecycle.handing_over()
        if stores != self._following:
            self._following = stores
            self._follow(stores)

    def _rebuild_view(self) -> None:
        chosen = self._lifecycle.view(self.map)
        if dict(self.held) != chosen:
            self.held = MappingProxyType(chosen)  # one assignment: readers see the old or the new view
            self._spawn(self._announcer.publish())

    def _schedule_retry(self, now: float) -> None:
        if self._retry_handle is not None:
            self._retry_handle.cancel()
            self._retry_handle = None
        wait = self._lifecycle.next_retry(now)
        if wait is not None:
            self._retry_handle = self._clock.call_later(wait + 0.01, self._reconcile)

    # -- actions -----------------------------------------------------------------------------------

    async def _load(self, pid: PartitionId, entry: Entry) -> None:
        loop = asyncio.get_running_loop()
        settings = self._settings
        lifecycle = self._lifecycle
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
            lifecycle.forget(pid, entry)
        except LoadError as exc:
            if entry.cancel.is_set() or self._stopping:
                lifecycle.forget(pid, entry)
            else:
                log.warning("loading %s failed: %s", pid, describe(exc))
                lifecycle.failed(entry, str(exc), self._clock.monotonic())
        except Exception as exc:  # a bug must not wedge the partition in LOADING forever
            log.exception("loading %s failed unexpectedly", pid)
            lifecycle.failed(entry, f"internal error: {exc!r}", self._clock.monotonic())
        else:
            if entry.cancel.is_set() or self._stopping:
                if self._stopping:
                    held.close()
                else:
                    await asyncio.to_thread(held.discard)
                lifecycle.forget(pid, entry)
            elif held.live is not None:
                log.info("loaded %s (%d rows); consuming from offset %d", pid, held.rows, held.live.next_offset)
                lifecycle.loaded(entry, held)
                await self._start_consuming(entry.record, held)
            else:
                log.info("loaded %s (%d rows)", pid, held.rows)
                lifecycle.loaded(entry, held)
        self._reconcile()

    async def _start_consuming(self, record: StoreRecord, held: PartitionStore) -> None:
        loop = asyncio.get_running_loop()

        def changed(_: LivePartition) -> None:  # on the applier's thread
            with contextlib.suppress(RuntimeError):  # the loop is closing
                loop.call_soon_threadsafe(self._reconcile)

        await self._appliers.start(record, held, changed)
        if not self._stopping:
            self._announcer.report_live(self.live_report)

    async def _retire(self, pid: PartitionId, entry: Entry, superseded: bool) -> None:
        # Unannounce first (the view rebuild after this reconcile publishes without it), then give
        # readers that still hold the old map or the old view a grace period before closing.
        await self._announcer.publish()
        await self._grace(self._drop_grace_s)
        if entry.state is not PartitionState.DROPPED:
            return  # assigned here again during the grace period, and serving again
        held, entry.store = entry.store, None
        entries = self._lifecycle.entries
        if entries.get(pid) is entry:
            del entries[pid]
        if held is not None:
            await self._appliers.stop(held)  # before it closes
            if superseded and self._version_grace_s > 0:
                # A superseded version's files stay for the version grace period: a rollback reuses them.
                log.info("closing %s; its files go in %.0fs", pid, self._version_grace_s)
                held.close()
                self._spawn(self._remove_later(pid, held.path))
            else:
                log.info("dropping %s", pid)
                await self._janitor.remove(pid, held.discard)
        self._reconcile()  # it may have been assigned here again during the grace period

    async def _remove_later(self, pid: PartitionId, path: Path) -> None:
        await self._grace(self._version_grace_s)
        if pid in self._lifecycle.entries or self._stopping:
            return  # wanted again (a rollback) and reused, or about to be: keep the files
        log.info("removing %s (superseded %.0fs ago)", pid, self._version_grace_s)
        await self._janitor.remove_directory(pid, path)
        self._reconcile()

    def _sweeps(self, held: PartitionStore) -> bool:
        """Whether `held` is swept for expired values: a live partition of a store with a ttl (of one value per
        key, or a history store)."""
        if held.live is None or (held.timeline is not None and held.timeline.kind is not StoreKind.HISTORY):
            return False
        record = self.map.stores.get(held.pid.store)
        return record is not None and record.ttl is not None

    async def _sweep_expired(self, every_s: float) -> None:
        """Every `every_s`: delete the expired values (history rows) of each live partition held here of a store
        with a `ttl` (keyroute.replica.expiry), "now" being this node's clock, as its reads'."""
        while not self._stopping:
            await self._clock.sleep(every_s)
            for held in list(self.held.values()):
                record = self.map.stores.get(held.pid.store)
                if record is None or record.ttl is None or not self._sweeps(held):
                    continue
                try:
                    deleted = await asyncio.to_thread(sweep_expired, held, record.ttl, self._clock.time)
                except Exception as exc:  # the next sweep tries again
                    log.warning("sweeping the expired values of %s failed: %s", held.pid, describe(exc))
                    continue
                if deleted:
                    log.info("deleted %d expired values of %s (ttl %s)", deleted, held.pid, record.ttl.text)

    async def _collect_leftovers(self) -> None:
        await self._janitor.collect_leftovers(self.map, self._lifecycle.entries)
        self._reconcile()

    async def _grace(self, delay_s: float) -> None:
        self._in_grace += 1
        try:
            await self._clock.sleep(delay_s)
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
