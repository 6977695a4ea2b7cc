"""Keeps a PartitionMap current from ZooKeeper watches (pushed, not polled), in proportion to each change.

States of the ZooKeeper connection and what the watcher does in each:

    CONNECTED  -> read every record, re-arm the watches, publish a fresh map
    SUSPENDED  -> keep the last map, republish it marked stale (keep serving, say so)
    LOST       -> same as SUSPENDED; on the next CONNECTED the session is new, so everything is re-read

Between reconnects every record has a watch of its own (each listing too), and an event re-reads only what
it names: a node's serving record changing costs one read, one parse and the routes of that node's
partitions (keyroute.cluster.partition_map.MapBuilder), not the cluster. The assignment is read through its
root: only the placement records whose assignment generation it changed are read again. Records whose bytes did not
change are not parsed again.

A node's watcher (`node_id` given) reads its own share of the assignment (/assigned/{node_id}) instead of
every placement record, once the root says the controller writes those records: its map's assignment then
holds that node's partitions only, plus the whole replica lists of the stores it is asked to `follow()`
(a node handing partitions over must see who else is assigned them). A router reads every placement record.

Watch callbacks run on kazoo's threads and must not block: they only note the path and wake the worker.
One worker thread does the reading and hands each new immutable map to `on_map` (the caller moves it onto
its event loop, e.g. with `loop.call_soon_threadsafe`). Events that arrive while it reads are taken
together on its next turn: a burst of changes (a rolling restart) costs one map per turn, not one per
change. `refresh()` asks for a whole re-read at once (a node told a router that its view is stale), as
does the safety refresh (every minute by default). `hold_watches()` is a fault injection for tests: it
makes the view stale on purpose by ignoring watch events, as if their delivery were delayed.

Each change of the connection is said once, however often kazoo retries meanwhile (its per-retry warnings
are held back to debug, keyroute.runtime.logs): on the loss "ZooKeeper connection lost (...): serving the last
partition map, stale since T", and once a fresh map has been read after it "ZooKeeper connection back after
N s: partition map refreshed, generation G".

The watcher only reads, so a router may hold a read-only ZooKeeper identity: a path that does not exist
yet is watched with `exists` until it is created; a record this identity may not read is left out of the
map with a warning (a root it may not read keeps the last map, stale).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import KazooException, NoAuthError, NoNodeError
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.protocol.states import EventType, WatchedEvent, ZnodeStat

from keyroute.cluster import placement_records, zk_layout
from keyroute.cluster.partition_map import (
    Assignment,
    MapBuilder,
    NodeRecord,
    PartitionMap,
    RecordError,
    ServingRecord,
    StoreRecord,
)
from keyroute.runtime.collector import without_cyclic_collection
from keyroute.runtime.logs import describe
from keyroute.runtime.wakeup import Wakeup

log = logging.getLogger(__name__)


def tombstone_version(raw: bytes) -> int | None:
    """The highest version a tombstone (/deleted/{store}, written by `keyroute store delete`) deleted, or None
    when it names none (not a tombstone: nothing is deleted by it)."""
    try:
        doc = json.loads(raw)
        versions = [int(v) for v in doc.get("versions", [])] + [int(doc.get("version", 0))]
    except (ValueError, TypeError, AttributeError):
        return None
    highest = max(versions)
    return highest if highest > 0 else None

# A read that has not answered by then is treated like a dropped connection (the map is kept, stale).
_READ_TIMEOUT_S = 30.0
_RETRY_READ_S = 1.0


_PARENTS = (zk_layout.STORES, zk_layout.NODES, zk_layout.SERVING)
# What an event asks the worker to read again.
_LISTING = "listing"  # the children of a parent
_RECORD = "record"  # one record under a parent
_PLACEMENT = "placement"  # the assignment (its root, or the legacy single record)


def _where(client: KazooClient) -> str:
    """`host:port[,host:port...]/chroot` of a kazoo client, as given to it."""
    hosts = ",".join(f"{host}:{port}" for host, port in getattr(client, "hosts", None) or ())
    return hosts + (getattr(client, "chroot", "") or "")


def _utc(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))


class MapWatcher:
    """Watches stores, nodes, assignment and serving records; publishes a new map on every change."""

    def __init__(
        self,
        client: KazooClient,
        on_map: Callable[[PartitionMap], None],
        safety_refresh_s: float = 60.0,
        node_id: str | None = None,
    ) -> None:
        self._client = client
        self._on_map = on_map
        self._safety_refresh_s = safety_refresh_s
        self._wake = Wakeup()
        # Maps are published from two threads (reads, connection-state changes): one lock orders them.
        self._publish_lock = threading.Lock()
        self._connected = False
        # While the connection is lost: since when (monotonic, for the outage's length; wall clock, to say).
        self._lost_at: tuple[float, float] | None = None
        self._watches_held = False
        self._watch_missed = False
        # What watch events named since the worker's last turn, and whether to re-read everything.
        self._events_lock = threading.Lock()
        self._events: set[tuple[str, str]] = set()
        self._resync = True
        self.reads = 0  # maps read from ZooKeeper (for tests and benchmarks)
        self.full_reads = 0  # of which whole re-reads
        self.bytes_read = 0  # bytes of every record read (for tests and benchmarks)
        self.placement_records_read = 0  # placement records read (/placement/{store})
        # The worker's own state: the records as last read, and the bytes they were parsed from.
        self._builder = MapBuilder()
        self._names: dict[str, set[str]] = {parent: set() for parent in _PARENTS}
        self._raw: dict[str, bytes] = {}
        self._placement_root: bytes | None = None
        self._placement_parts: dict[str, tuple[int, tuple[tuple[str, ...], ...]]] = {}
        self._legacy_assignment: bytes | None = None
        # A node's own share: its record's path (None: a router), the record as read and parsed, and per
        # store the replica lists that share stands for (kept, so an unchanged store is the same object).
        self._own_path = zk_layout.assigned_path(node_id) if node_id is not None else None
        self._node_id = node_id
        self._own_raw: bytes | None = None
        self._own_record: tuple[int, placement_records.Share] | None = None  # as read (None: no record)
        self._own: placement_records.Share = {}  # the share in use: the record's once the root reached it
        self._own_replicas: dict[str, tuple[tuple[int, frozenset[int]], tuple[tuple[str, ...], ...]]] = {}
        # Stores whose whole assignment a node asked for (`follow`), and the ones its current map holds.
        self._follow: frozenset[str] = frozenset()
        self._followed: frozenset[str] | None = None
        self._map_generation = 0
        self._thread = threading.Thread(target=self._run, name="keyroute-map-watcher", daemon=True)
        self._current = PartitionMap.empty().marked_stale(True)
        self._listener = self._on_state

    @property
    def current(self) -> PartitionMap:
        return self._current

    def start(self) -> None:
        self._client.add_listener(self._listener)
        self._wake.ring()
        self._thread.start()

    def stop(self) -> None:
        self._wake.stop()
        self._client.remove_listener(self._listener)
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def refresh(self) -> None:
        """Re-read everything now (e.g. a node told us our view is stale)."""
        self._resync = True
        self._wake.ring()

    def follow(self, stores: frozenset[str]) -> None:
        """A node's watcher: also read these stores' whole assignment (their replica lists), not only this
        node's share of it. Any thread; takes effect on the worker's next turn."""
        stores = frozenset(stores)
        if stores == self._follow:
            return
        self._follow = stores
        with self._events_lock:
            self._events.add((_PLACEMENT, ""))
        self._wake.ring()

    def hold_watches(self) -> None:
        """FAULT INJECTION, tests only: act on no watch event until `release_watches()`, as if ZooKeeper
        delivered them late, so the published map goes stale without saying so. `refresh()`, reconnects
        and the safety refresh still re-read (and re-arm the watches)."""
        self._watches_held = True

    def release_watches(self) -> None:
        self._watches_held = False
        if self._watch_missed:
            self._watch_missed = False
            self.refresh()

    def _on_state(self, state: str) -> None:
        # Runs on kazoo's connection thread: flag and hand over, never block on ZooKeeper.
        if state == KazooState.CONNECTED:
            self._connected = True
            self.refresh()  # watches set before a lost session are gone: read (and watch) everything again
        else:
            self._connected = False
            with self._publish_lock:
                if self._lost_at is None:  # SUSPENDED then LOST is one outage: said once
                    self._lost_at = (time.monotonic(), time.time())
                    log.warning(
                        "ZooKeeper connection lost (%s): serving the last partition map, stale since %s",
                        _where(self._client),
                        _utc(self._lost_at[1]),
                    )
                self._publish(self._current.marked_stale(True))

    def _on_watch(self, event: WatchedEvent | None = None) -> None:
        if self._watches_held:
            self._watch_missed = True
            return
        path = getattr(event, "path", None)
        if not path:
            self.refresh()
            return
        if path in _PARENTS or path == zk_layout.DELETED:
            what = (_LISTING, path)
        elif path in (zk_layout.PLACEMENT, zk_layout.ASSIGNMENT):
            what = (_PLACEMENT, "")
        elif path == self._own_path:
            what = (_PLACEMENT, path)
        else:
            what = (_RECORD, path)
        with self._events_lock:
            self._events.add(what)
        self._wake.ring()

    def _publish(self, new_map: PartitionMap) -> None:
        self._current = new_map
        try:
            self._on_map(new_map)
        except Exception:  # a faulty consumer must not kill the watcher thread
            log.exception("partition map consumer failed")

    def _run(self) -> None:
        while not self._wake.stopped:
            if not self._wake.wait(self._safety_refresh_s):
                self._resync = True
            if self._wake.stopped:
                return
            self._connected = self._client.connected
            if not self._connected:
                continue
            whole_reads = self.full_reads
            try:
                new_map = self._read()
                self.reads += 1
            except (KazooException, KazooTimeoutError) as exc:
                log.warning("reading the partition map failed (%s); serving the last one, marked stale", describe(exc))
                self._resync = True  # what the failed read was to bring is re-read whole
                with self._publish_lock:
                    self._publish(self._current.marked_stale(True))
                if self._client.connected:  # still connected: no reconnect event will ask again
                    self._wake.ring_after(_RETRY_READ_S)
                continue
            if new_map is None:
                continue  # the events named nothing that changed
            # After a whole read the consumer builds its own structures from scratch too (a router's table).
            building = without_cyclic_collection() if self.full_reads != whole_reads else contextlib.nullcontext()
            with self._publish_lock, building:
                # The connection may have dropped while reading: then the new map is already stale.
                self._publish(new_map.marked_stale(not self._connected))
                if self._connected and self._lost_at is not None:
                    log.warning(
                        "ZooKeeper connection back after %.1f s: partition map refreshed, generation %d",
                        time.monotonic() - self._lost_at[0],
                        new_map.generation,
                    )
                    self._lost_at = None

    # -- reading -----------------------------------------------------------------------------------

    def _read(self) -> PartitionMap | None:
        """The next map: everything re-read when asked (or after a failure), else what the events named."""
        with self._events_lock:
            events, self._events = self._events, set()
        if self._resync:
            self._resync = False
            self.full_reads += 1
            with without_cyclic_collection():  # it builds every record and route at once
                return self._read_all()
        if not events:
            return None
        return self._read_events(events)

    def _settle(self, path: str, pending: Any, record: bool = False) -> tuple[Any, ZnodeStat] | None:
        """A pending read's (value, stat), or None when the path does not exist (or, for a record, may not
        be read by this identity)."""
        try:
            value, stat = pending.get(timeout=_READ_TIMEOUT_S)
        except NoNodeError:
            if not record and self._client.exists(path, watch=self._on_watch) is not None:
                # A root created since the read: read it (and watch it) on the next turn.
                self._on_watch(WatchedEvent(EventType.CREATED, KazooState.CONNECTED, path))
            return None
        except NoAuthError:
            if not record:
                raise  # a root this identity may not read: keep the last map, stale, and retry
            # One record a writer created without granting this identity READ: the rest of the map
            # is still right, so route on it and say what is missing.
            log.warning("ZooKeeper denies reading %s to this identity; ignoring it", path)
            return None
        self._map_generation = max(self._map_generation, stat.mzxid, stat.pzxid)
        if isinstance(value, bytes):
            self.bytes_read += len(value)
        return value, stat

    def _read_all(self) -> PartitionMap:
        """Every record, in two pipelined rounds (the roots, then every child), so a re-read costs two round
        trips to ZooKeeper rather than one per record. Each read re-arms its watch. Records whose bytes are
        unchanged keep their parsed value."""
        # The generation is counted afresh over what this read sees: if ZooKeeper's own transaction count is
        # now behind the generation published so far, the ensemble was restored or rebuilt, and only the
        # fresh count matches what ZooKeeper holds (a generation never counts transactions of a lost history).
        before, self._map_generation = self._map_generation, 0
        try:
            self._read_all_records()
        except BaseException:
            self._map_generation = max(before, self._map_generation)
            raise
        if self._client.last_zxid >= before:
            self._map_generation = max(before, self._map_generation)
            return self._builder.build(self._map_generation)
        log.warning(
            "ZooKeeper's history restarts behind this partition map (generation %d, ZooKeeper at %#x): "
            "counting generations from ZooKeeper's again, now %d",
            before,
            self._client.last_zxid,
            self._map_generation,
        )
        return self._builder.build(self._map_generation)

    def _read_all_records(self) -> None:
        zk = self._client
        watch = self._on_watch
        listing = {path: zk.get_children_async(path, watch=watch, include_data=True) for path in _PARENTS}
        tombstones = zk.get_children_async(zk_layout.DELETED, watch=watch, include_data=True)
        placement = self._start_placement(own=True)
        self._take_tombstones(self._settle(zk_layout.DELETED, tombstones))
        names: dict[str, set[str]] = {}
        for parent, pending in listing.items():
            settled = self._settle(parent, pending)
            names[parent] = set(settled[0]) if settled else set()
        reads = {
            f"{parent}/{name}": zk.get_async(f"{parent}/{name}", watch=watch)
            for parent in _PARENTS
            for name in sorted(names[parent])
        }
        self._finish_placement(placement)
        for parent in _PARENTS:
            for name in self._names[parent] - names[parent]:
                self._forget(parent, name)
            self._names[parent] = names[parent]
        for path, pending in reads.items():
            self._take(path, self._settle(path, pending, record=True))

    def _read_events(self, events: set[tuple[str, str]]) -> PartitionMap:
        zk = self._client
        watch = self._on_watch
        listing = {
            path: zk.get_children_async(path, watch=watch, include_data=True)
            for kind, path in events
            if kind == _LISTING and path != zk_layout.DELETED
        }
        if (_LISTING, zk_layout.DELETED) in events:
            # Before the store listing is taken: a record deleted with its tombstone goes, not orphaned.
            tombstones = zk.get_children_async(zk_layout.DELETED, watch=watch, include_data=True)
            self._take_tombstones(self._settle(zk_layout.DELETED, tombstones))
        asked = {path for kind, path in events if kind == _PLACEMENT}
        placement = self._start_placement(own=bool(asked - {""})) if asked else None
        wanted = {path for kind, path in events if kind == _RECORD}
        for parent, pending in listing.items():
            settled = self._settle(parent, pending)
            names = set(settled[0]) if settled else set()
            for name in self._names[parent] - names:
                self._forget(parent, name)
            wanted.update(f"{parent}/{name}" for name in names - self._names[parent])
            self._names[parent] = names
        reads = {}
        for path in sorted(wanted):
            parent, _, name = path.rpartition("/")
            if name in self._names.get(parent, ()):  # else gone (or not listed yet: its listing brings it)
                reads[path] = zk.get_async(path, watch=watch)
        if placement is not None:
            self._finish_placement(placement)
        for path, pending in reads.items():
            self._take(path, self._settle(path, pending, record=True))
        return self._builder.build(self._map_generation)

    def _take_tombstones(self, settled: tuple[Any, ZnodeStat] | None) -> None:
        """The stores with a tombstone (/deleted's children, watched: `keyroute store delete` creates one
        afresh each time, publishing deletes it) and the highest version each deleted, read pipelined. Only a
        change to that listing (a rare event) or a whole re-read reads them."""
        names = set(settled[0]) if settled else set()
        reads = {name: self._client.get_async(zk_layout.deleted_path(name)) for name in sorted(names)}
        tombstones: dict[str, int] = {}
        for name, pending in reads.items():
            read = self._settle(zk_layout.deleted_path(name), pending, record=True)
            if read is None:
                continue  # gone meanwhile: the listing's watch brings it
            version = tombstone_version(read[0])
            if version is None:
                log.warning("ignoring the tombstone of store %s: it names no version deleted", name)
                continue
            tombstones[name] = version
        self._builder.set_deleted(tombstones)

    def _forget(self, parent: str, name: str) -> None:
        self._raw.pop(f"{parent}/{name}", None)
        self._clear(parent, name)

    def _take(self, path: str, settled: tuple[Any, ZnodeStat] | None) -> None:
        """One record as read (None: gone, or not readable by this identity)."""
        parent, _, name = path.rpartition("/")
        if settled is None:
            # Gone (or not readable): unlisted too, so that the next listing that names it again (re-created
            # by then, as a restarting node does) reads it rather than taking it as known.
            self._names.get(parent, set()).discard(name)
        data = settled[0] if settled else None
        if not data:
            self._raw.pop(path, None)
            self._clear(parent, name)
            return
        if self._raw.get(path) == data:
            return  # unchanged: keep what it was parsed into
        self._raw[path] = data
        try:
            if parent == zk_layout.STORES:
                self._builder.set_store(name, StoreRecord.from_json(data))
            elif parent == zk_layout.NODES:
                self._builder.set_node(name, NodeRecord.from_json(data))
            else:
                self._builder.set_serving(name, ServingRecord.from_json(data))
        except RecordError as exc:
            what = {zk_layout.STORES: "store", zk_layout.NODES: "node"}.get(parent, "serving record of")
            log.warning("ignoring %s %s: %s", what, name, describe(exc))
            self._clear(parent, name)

    def _clear(self, parent: str, name: str) -> None:
        """The record under `parent` named `name` is gone (or unusable): out of the map."""
        if parent == zk_layout.STORES:
            # Absence is not deletion: without a tombstone the last record read stays, marked orphaned.
            self._builder.set_store(name, None, keep=True)
        elif parent == zk_layout.NODES:
            self._builder.set_node(name, None)
        elif parent == zk_layout.SERVING:
            self._builder.set_serving(name, None)

    # -- the assignment ----------------------------------------------------------------------------

    def _start_placement(self, own: bool) -> tuple[Any, Any]:
        """Ask for the assignment's root (watched: every new assignment rewrites it) and, for a node when
        `own` (its record's watch fired, or everything is read again), its own share."""
        zk = self._client
        root = zk.get_async(zk_layout.PLACEMENT, watch=self._on_watch)
        mine = zk.get_async(self._own_path, watch=self._on_watch) if own and self._own_path is not None else None
        return root, mine

    def _finish_placement(self, pending: tuple[Any, Any]) -> None:
        """Read the placement records the root names at an assignment generation not held yet (without a
        watch: the root's fires for every new assignment), or the legacy single record when there is no root
        yet. A node whose controller writes share records reads only the stores it follows, and takes its
        own share."""
        zk = self._client
        root_read, own_read = pending
        settled = self._settle(zk_layout.PLACEMENT, root_read)
        own_changed = own_read is not None and self._take_own(self._settle(self._own_path or "", own_read))
        raw_root = settled[0] if settled else None
        if not raw_root:
            # Written by a controller of the layout before /placement (an upgrade in progress).
            self._placement_root = None
            legacy = self._settle(zk_layout.ASSIGNMENT, zk.get_async(zk_layout.ASSIGNMENT, watch=self._on_watch))
            raw_legacy = legacy[0] if legacy else None
            if raw_legacy and raw_legacy != self._legacy_assignment:
                try:
                    self._builder.set_assignment(Assignment.from_json(raw_legacy))
                    self._legacy_assignment = raw_legacy
                except RecordError as exc:
                    log.warning("ignoring the assignment: %s", describe(exc))
            return
        self._legacy_assignment = None
        try:
            root = placement_records.parse_root(raw_root)
        except RecordError as exc:
            log.warning("ignoring the assignment: %s", describe(exc))
            return
        own_only = self._own_path is not None and root.share_records
        follow = self._follow if own_only else None
        if raw_root == self._placement_root and follow == self._followed and not own_changed:
            return
        if own_only:
            # The controller writes a node's share record ahead of the root it belongs to: one of a later
            # assignment generation than the root waits for it (the share before it stays in use). No record: no share
            # (a record is deleted only once a root without the node's share is written).
            record = self._own_record
            if record is None:
                self._own = {}
            elif record[0] <= root.generation:
                self._own = record[1]
        whole = set(root.stores) if follow is None else follow & root.stores.keys()
        parts = self._placement_parts
        missing = [store for store in whole if parts.get(store, (None,))[0] != root.stores[store]]
        reads = {store: zk.get_async(zk_layout.placement_path(store)) for store in missing}
        self.placement_records_read += len(reads)
        fresh: dict[str, tuple[int, tuple[tuple[str, ...], ...]]] = {}
        for store, read in reads.items():
            settled_part = self._settle(zk_layout.placement_path(store), read, record=True)
            if not settled_part or not settled_part[0]:
                # A controller is writing the next assignment: keep the one we have; the root's watch
                # fires once it is complete.
                return
            try:
                fresh[store] = placement_records.parse_placement_record(settled_part[0])
            except RecordError as exc:
                log.warning("ignoring the assignment: %s", describe(exc))
                return
            if fresh[store][0] != root.stores[store]:
                return  # written ahead of (or behind) the root: in progress, as above
        parts.update(fresh)
        for store in [store for store in parts if store not in whole]:
            del parts[store]
        self._placement_root = raw_root
        self._followed = follow
        stores = {store: parts[store][1] for store in whole}
        if own_only:
            for store, share in self._own.items():
                if store in root.stores and store not in stores:
                    stores[store] = self._own_replica_lists(store, share)
            for store in self._own_replicas.keys() - self._own.keys():
                del self._own_replicas[store]
        self._builder.set_assignment(Assignment(root.generation, stores))

    def _take_own(self, settled: tuple[Any, ZnodeStat] | None) -> bool:
        """A node's own record as read (None: it has none); whether it changed."""
        raw = settled[0] if settled else None
        if raw == self._own_raw:
            return False
        self._own_raw = raw
        try:
            self._own_record = placement_records.parse_share_record(raw) if raw else None
        except RecordError as exc:
            log.warning("ignoring this node's assignment record: %s", describe(exc))
            self._own_record = None
        return True

    def _own_replica_lists(self, store: str, share: tuple[int, frozenset[int]]) -> tuple[tuple[str, ...], ...]:
        """The store's replica lists as far as this node knows them: itself at its partitions."""
        kept = self._own_replicas.get(store)
        if kept is not None and kept[0] == share:
            return kept[1]
        count, partitions = share
        mine = (self._node_id or "",)
        lists = tuple(mine if p in partitions else () for p in range(count))
        self._own_replicas[store] = (share, lists)
        return lists
