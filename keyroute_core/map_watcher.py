"""Keeps a PartitionMap current from ZooKeeper watches (pushed, not polled).

States of the ZooKeeper connection and what the watcher does in each:

    CONNECTED  -> read every record, re-arm the watches, publish a fresh map
    SUSPENDED  -> keep the last map, republish it marked stale (keep serving, say so)
    LOST       -> same as SUSPENDED; on the next CONNECTED the session is new, so everything is re-read

Watch callbacks run on kazoo's threads and must not block: they only mark the map dirty. One worker
thread does the reading and hands each new immutable map to `on_map` (the caller moves it onto its
event loop, e.g. with `loop.call_soon_threadsafe`). `refresh()` asks for a read at once (a node told a
router that its view is stale). `hold_watches()` is a fault injection for tests: it makes the view stale
on purpose by ignoring watch events, as if their delivery were delayed.

The watcher only reads, so a router may hold a read-only ZooKeeper identity: a path that does not exist
yet is watched with `exists` until it is created; a record this identity may not read is left out of the
map with a warning (a root it may not read keeps the last map, stale).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import KazooException, NoAuthError, NoNodeError
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.protocol.states import ZnodeStat

from keyroute.core import placement_records, zk_layout
from keyroute.core.partition_map import (
    EMPTY_ASSIGNMENT,
    Assignment,
    NodeRecord,
    PartitionMap,
    RecordError,
    ServingRecord,
    StoreRecord,
)

log = logging.getLogger(__name__)

# A read that has not answered by then is treated like a dropped connection (the map is kept, stale).
_READ_TIMEOUT_S = 30.0
_RETRY_READ_S = 1.0


class MapWatcher:
    """Watches stores, nodes, assignment and serving records; publishes a new map on every change."""

    def __init__(
        self,
        client: KazooClient,
        on_map: Callable[[PartitionMap], None],
        safety_refresh_s: float = 60.0,
    ) -> None:
        self._client = client
        self._on_map = on_map
        self._safety_refresh_s = safety_refresh_s
        self._dirty = threading.Event()
        self._stopped = threading.Event()
        # Maps are published from two threads (reads, connection-state changes): one lock orders them.
        self._publish_lock = threading.Lock()
        self._connected = False
        self._watches_held = False
        self._watch_missed = False
        self.reads = 0  # maps read from ZooKeeper (for tests and benchmarks)
        self._thread = threading.Thread(target=self._run, name="keyroute-map-watcher", daemon=True)
        self._current = PartitionMap.empty().marked_stale(True)
        self._listener = self._on_state

    @property
    def current(self) -> PartitionMap:
        return self._current

    def start(self) -> None:
        self._client.add_listener(self._listener)
        self._dirty.set()
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._dirty.set()
        self._client.remove_listener(self._listener)
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def refresh(self) -> None:
        """Re-read now (e.g. a node told us our view is stale)."""
        self._dirty.set()

    def hold_watches(self) -> None:
        """FAULT INJECTION, tests only: act on no watch event until `release_watches()`, as if ZooKeeper
        delivered them late, so the published map goes stale without saying so. `refresh()`, reconnects
        and the safety refresh still re-read (and re-arm the watches)."""
        self._watches_held = True

    def release_watches(self) -> None:
        self._watches_held = False
        if self._watch_missed:
            self._watch_missed = False
            self._dirty.set()

    def _on_state(self, state: str) -> None:
        # Runs on kazoo's connection thread: flag and hand over, never block on ZooKeeper.
        if state == KazooState.CONNECTED:
            self._connected = True
            self._dirty.set()
        else:
            self._connected = False
            with self._publish_lock:
                self._publish(self._current.marked_stale(True))

    def _on_watch(self, *_event: Any) -> None:
        if self._watches_held:
            self._watch_missed = True
            return
        self._dirty.set()

    def _publish(self, new_map: PartitionMap) -> None:
        self._current = new_map
        try:
            self._on_map(new_map)
        except Exception:  # a faulty consumer must not kill the watcher thread
            log.exception("partition map consumer failed")

    def _run(self) -> None:
        while not self._stopped.is_set():
            if not self._dirty.wait(timeout=self._safety_refresh_s):
                self._dirty.set()
            if self._stopped.is_set():
                return
            self._dirty.clear()
            self._connected = self._client.connected
            if not self._connected:
                continue
            try:
                new_map = self._read()
                self.reads += 1
            except (KazooException, KazooTimeoutError) as exc:
                log.warning("reading the partition map failed (%r); serving the last one, marked stale", exc)
                with self._publish_lock:
                    self._publish(self._current.marked_stale(True))
                if self._client.connected:  # still connected: no reconnect event will ask again
                    self._stopped.wait(_RETRY_READ_S)
                    self._dirty.set()
                continue
            with self._publish_lock:
                # The connection may have dropped while reading: then the new map is already stale.
                self._publish(new_map.marked_stale(not self._connected))

    def _read(self) -> PartitionMap:
        """Every record, in two pipelined rounds (the four roots, then every child), so a re-read costs
        two round trips to ZooKeeper rather than one per record. Each read re-arms its watch."""
        zk = self._client
        watch = self._on_watch
        stats: list[ZnodeStat] = []

        def settle(path: str, pending: Any, record: bool = False) -> Any:
            try:
                value, stat = pending.get(timeout=_READ_TIMEOUT_S)
            except NoNodeError:
                # Readers never write (a router may hold a read-only identity): watch for its creation.
                if zk.exists(path, watch=watch) is not None:
                    self._dirty.set()  # created since the read: its listing needs a watch of its own
                return None
            except NoAuthError:
                if not record:
                    raise  # a root this identity may not read: keep the last map, stale, and retry
                # One record a writer created without granting this identity READ: the rest of the map
                # is still right, so route on it and say what is missing.
                log.warning("ZooKeeper denies reading %s to this identity; ignoring it", path)
                return None
            stats.append(stat)
            return value

        parents = (zk_layout.STORES, zk_layout.NODES, zk_layout.SERVING)
        listing = {path: zk.get_children_async(path, watch=watch, include_data=True) for path in parents}
        # The assignment: its root (watched: every new assignment rewrites it), then the store records it
        # names (read without a watch, in the second round).
        placement_read = zk.get_async(zk_layout.PLACEMENT, watch=watch)
        names = {path: sorted(settle(path, pending) or ()) for path, pending in listing.items()}
        records = {
            (parent, name): zk.get_async(f"{parent}/{name}", watch=watch)
            for parent in parents
            for name in names[parent]
        }
        raw_root = settle(zk_layout.PLACEMENT, placement_read)
        legacy_read = None
        placement: dict[str, Any] = {}
        if raw_root:
            try:
                wanted = placement_records.parse_root(raw_root)[1]
                placement = {store: zk.get_async(zk_layout.placement_path(store)) for store in wanted}
            except RecordError as exc:
                log.warning("ignoring the assignment: %s", exc)
        else:
            # Written by a controller of the layout before /placement (an upgrade in progress).
            legacy_read = zk.get_async(zk_layout.ASSIGNMENT, watch=watch)
        raw = {key: settle(f"{key[0]}/{key[1]}", pending, record=True) for key, pending in records.items()}

        stores: dict[str, StoreRecord] = {}
        for name in names[zk_layout.STORES]:
            if data := raw[(zk_layout.STORES, name)]:
                try:
                    stores[name] = StoreRecord.from_json(data)
                except RecordError as exc:
                    log.warning("ignoring store %s: %s", name, exc)

        nodes: dict[str, NodeRecord] = {}
        for node_id in names[zk_layout.NODES]:
            if data := raw[(zk_layout.NODES, node_id)]:
                try:
                    nodes[node_id] = NodeRecord.from_json(data)
                except RecordError as exc:
                    log.warning("ignoring node %s: %s", node_id, exc)

        assignment = EMPTY_ASSIGNMENT
        if legacy_read is not None:
            if raw_legacy := settle(zk_layout.ASSIGNMENT, legacy_read):
                try:
                    assignment = Assignment.from_json(raw_legacy)
                except RecordError as exc:
                    log.warning("ignoring the assignment: %s", exc)
        elif raw_root:
            parts = {store: settle(zk_layout.placement_path(store), p, record=True) for store, p in placement.items()}
            try:
                assignment = placement_records.assemble(raw_root, parts)
            except placement_records.InProgress:
                # A controller is writing the next assignment: keep the one we have; the root's watch
                # fires once it is complete.
                assignment = self._current.assignment
            except RecordError as exc:
                log.warning("ignoring the assignment: %s", exc)
                assignment = self._current.assignment

        serving: dict[str, ServingRecord] = {}
        for node_id in names[zk_layout.SERVING]:
            if data := raw[(zk_layout.SERVING, node_id)]:
                try:
                    serving[node_id] = ServingRecord.from_json(data)
                except RecordError as exc:
                    log.warning("ignoring serving record of %s: %s", node_id, exc)

        generation = max((max(s.mzxid, s.pzxid) for s in stats), default=0)
        return PartitionMap.build(stores, nodes, assignment, serving, generation=generation)
