"""The applying side of a local replica: what the process holding the data directory's lock does.

It follows the partition map from ZooKeeper (keyroute.cluster.map_watcher, read only: a reader identity
suffices), and for each store it holds brings its partitions to the published version with the node's own
code (keyroute.replica): `load_partition` (hard link, kernel copy or download, size, checksum and keys checked
against the manifest; a directory an earlier run loaded is reused) and, for a live store, a `LiveApplier` per
version (offsets stored in the same transaction as the rows; resumes from them after any crash).

Make before break, as on a node: a new version's partitions are loaded beside the old ones (and, live, caught
up to the topic's end within the version's `catch_up_records`); only then is the store's view swapped, in one
assignment, and the old partitions are stopped, closed and removed after a grace period (reads that started
on them finish first). A version that fails to load leaves the old one served, and is tried again.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from keyroute.cluster import zk
from keyroute.cluster.map_watcher import MapWatcher
from keyroute.cluster.partition_map import PartitionMap, StoreRecord
from keyroute.local.shared import HeldStore, write_status, write_view
from keyroute.replica.live import GAP, ApplierSettings, LiveApplier, LiveVersion
from keyroute.replica.store import (
    LoadError,
    PartitionId,
    PartitionStore,
    iter_partition_dirs,
    load_partition,
    remove_partition_dir,
)
from keyroute.runtime.logs import describe
from keyroute.runtime.settings import ZkSettings

log = logging.getLogger(__name__)

# Publish: the held stores and every open partition of them, handed to the reading side.
Publish = Callable[[Mapping[str, HeldStore], Mapping[PartitionId, PartitionStore]], None]


class Holder:
    """Loads, applies and swaps the held stores (one thread); `publish` is called after every swap."""

    def __init__(
        self,
        *,
        zk_settings: ZkSettings,
        data_dir: Path,
        stores: tuple[str, ...],
        subsets: Mapping[str, frozenset[int]],
        publish: Publish,
        map_size: int,
        applier_settings: ApplierSettings,
        grace_s: float = 1.0,
        retry_s: float = 2.0,
        parallel_loads: int = 4,
    ) -> None:
        self._zk_settings = zk_settings
        self._data_dir = Path(data_dir)
        self._stores = stores
        self._subsets = dict(subsets)
        self._publish_to = publish
        self._map_size = map_size
        self._applier_settings = applier_settings
        self._grace_s = grace_s
        self._retry_s = retry_s
        self._executor = concurrent.futures.ThreadPoolExecutor(max(1, parallel_loads), "keyroute-local-load")
        self._identity = f"local-{socket.gethostname()}-{os.getpid()}"
        self._map: PartitionMap | None = None
        self._parts: dict[PartitionId, PartitionStore] = {}
        self._held: dict[str, HeldStore] = {}
        self._appliers: dict[tuple[str, int], LiveApplier] = {}
        self._retire: list[tuple[float, list[PartitionStore], bool]] = []
        self._failed: dict[str, tuple[float, str]] = {}
        self._generation = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="keyroute-local-holder", daemon=True)
        self._client: Any = None
        self._watcher: MapWatcher | None = None
        self._status_at = 0.0
        self._collected = False  # leftovers of earlier runs removed (once every store is held)

    # -- any thread -----------------------------------------------------------------------------------

    @property
    def errors(self) -> dict[str, str]:
        """Why a store is not (yet) at its published version: the last load failure per store."""
        return {store: why for store, (_, why) in self._failed.items()}

    def start(self, resume: Mapping[str, HeldStore]) -> None:
        """Start: first reopen what `resume` says was held (a hand-over from a process that stopped: its
        directories are reused, live ones resume from their stored offsets), then follow the map."""
        self._resume = dict(resume)
        self._thread.start()

    def set_subset(self, store: str, partitions: frozenset[int] | None) -> None:
        if partitions is None:
            self._subsets.pop(store, None)
        else:
            self._subsets[store] = partitions
        self._wake.set()

    def stop(self) -> None:
        """Stop applying and close every partition (their files stay for the next holder)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(30)

    def live_status(self) -> dict[str, dict[str, dict[str, Any]]]:
        """store -> partition -> {version, offset, lag_records, lag_ms, state} of the live partitions held."""
        found: dict[str, dict[str, dict[str, Any]]] = {}
        for name, held in list(self._held.items()):
            for p in held.partitions:
                part = self._parts.get(PartitionId(name, held.version, p))
                live = part.live if part is not None else None
                if live is not None:
                    found.setdefault(name, {})[str(p)] = {
                        "version": held.version,
                        "offset": live.offset,
                        "lag_records": live.lag_records,
                        "lag_ms": round(live.lag_ms, 1),
                        "state": live.state,
                    }
        return found

    # -- the thread -----------------------------------------------------------------------------------

    def _on_map(self, new_map: PartitionMap) -> None:  # on the watcher's thread
        self._map = new_map
        self._wake.set()

    def _run(self) -> None:
        try:
            if self._resume:
                self._take_back(self._resume)
            self._client = zk.connect(self._zk_settings, ensure_layout=False)
            self._watcher = MapWatcher(self._client, self._on_map)
            self._watcher.start()
            while not self._stop.is_set():
                self._wake.wait(0.05)
                self._wake.clear()
                if self._stop.is_set():
                    break
                try:
                    self._reconcile()
                except Exception:
                    log.exception("the local replica's holder failed a turn; trying again")
                self._retire_due(time.monotonic())
                self._report()
                if not self._collected and all(name in self._held for name in self._stores):
                    self._collected = True
                    self._collect_leftovers()
        except Exception:
            log.exception("the local replica's holder stopped")
        finally:
            self._close_all()

    def _take_back(self, resume: Mapping[str, HeldStore]) -> None:
        for name, held in resume.items():
            if name not in self._stores:
                continue
            parts = self._load(held.record, held.partitions)
            if parts is None:
                continue
            self._start_applying(held.record, parts)
            for part in parts:
                self._clear_stale_readers(part)
            self._held[name] = held
        if self._held:
            self._publish()
            log.info("local replica: took over applying %s", ", ".join(sorted(self._held)))

    def _reconcile(self) -> None:
        m = self._map
        if m is None:
            return
        now = time.monotonic()
        for name in self._stores:
            record = m.stores.get(name)
            held = self._held.get(name)
            if held is not None and m.deletes(name, held.version):
                log.info("local replica: store %s was deleted; dropping it", name)
                del self._held[name]
                self._publish()
                self._schedule_retire([p for pid, p in self._parts.items() if pid.store == name], discard=True)
                continue
            if record is None:
                continue  # not published yet, or its record vanished without a tombstone: keep what is held
            wanted = tuple(
                sorted(p for p in self._subsets.get(name, range(record.partitions)) if p < record.partitions)
            )
            if held is not None and held.version == record.version and held.partitions == wanted:
                continue
            failed = self._failed.get(name)
            if failed is not None and now < failed[0]:
                continue
            parts = self._load(record, wanted)
            if parts is None:
                continue
            self._start_applying(record, parts)
            if not all(part.live is None or (part.live.serves and part.live.state != GAP) for part in parts):
                continue  # still catching up: the version held now keeps answering meanwhile
            self._held[name] = HeldStore(record, record.version, wanted)
            self._publish()
            keep = {part.pid for part in parts}
            superseded = [p for pid, p in self._parts.items() if pid.store == name and pid not in keep]
            self._schedule_retire(superseded, discard=True)

    def _load(self, record: StoreRecord, partitions: Iterable[int]) -> list[PartitionStore] | None:
        """The partitions of the record's version, loaded (or reused) in parallel; None when one failed."""
        name = record.name
        for p in partitions:
            self._take_back_retiring(PartitionId(name, record.version, p))
        missing = [p for p in partitions if PartitionId(name, record.version, p) not in self._parts]
        futures = {
            p: self._executor.submit(load_partition, self._data_dir, record, p, self._map_size, self._stop.is_set)
            for p in missing
        }
        problem = None
        for p, future in futures.items():
            try:
                part = future.result()
            except LoadError as exc:
                problem = problem or str(exc)
                continue
            except Exception as exc:
                log.exception("local replica: loading %s v%d p%d failed unexpectedly", name, record.version, p)
                problem = problem or f"internal error: {exc!r}"
                continue
            self._parts[part.pid] = part
        if problem is not None:
            if not self._stop.is_set():
                log.warning("local replica: loading store %s v%d failed: %s", name, record.version, problem)
            self._failed[name] = (time.monotonic() + self._retry_s, problem)
            return None
        self._failed.pop(name, None)
        return [self._parts[PartitionId(name, record.version, p)] for p in partitions]

    def _start_applying(self, record: StoreRecord, parts: list[PartitionStore]) -> None:
        for part in parts:
            live = part.live
            if live is None:
                continue
            key = (part.pid.store, part.pid.version)
            applier = self._appliers.get(key)
            if applier is None:
                source = LiveVersion(
                    record.name,
                    part.pid.version,
                    live.config,
                    record.key_format,
                    record.partitioner,
                    record.partitions,
                    record.key_schema,
                )
                applier = self._appliers[key] = LiveApplier(
                    source, node_id=self._identity, settings=self._applier_settings
                )
            if part.pid.partition not in applier.partitions:
                applier.add(part)

    def _clear_stale_readers(self, part: PartitionStore) -> None:
        """Free the reader slots a process that died left in the partition's lock file (they would hold
        old pages from reuse)."""
        try:
            part.clear_stale_readers()
        except Exception as exc:
            log.debug("local replica: reader check of %s: %s", part.pid, describe(exc))

    def _publish(self) -> None:
        self._generation += 1
        held = dict(self._held)
        parts = {
            pid: part
            for pid, part in self._parts.items()
            if pid.store in held
            and pid.version == held[pid.store].version
            and pid.partition in held[pid.store].partitions
        }
        self._publish_to(held, parts)
        try:
            write_view(self._data_dir, held, self._generation)
        except OSError as exc:
            log.error("local replica: writing the view for the other processes failed: %s", describe(exc))

    def _schedule_retire(self, parts: list[PartitionStore], *, discard: bool) -> None:
        for part in parts:
            self._parts.pop(part.pid, None)
            if part.live is not None:
                applier = self._appliers.get((part.pid.store, part.pid.version))
                if applier is not None:
                    applier.remove(part.pid.partition)
                    if not applier.partitions:
                        del self._appliers[(part.pid.store, part.pid.version)]
                        applier.close()
        if parts:
            self._retire.append((time.monotonic() + self._grace_s, parts, discard))

    def _take_back_retiring(self, pid: PartitionId) -> None:
        """A partition let go less than a grace period ago and wanted again (a subset changed back): it is
        still open; keep it rather than remove its files under a load that would reuse them."""
        for entry in self._retire:
            for part in entry[1]:
                if part.pid == pid and not part.closed:
                    entry[1].remove(part)
                    self._parts[pid] = part
                    return

    def _retire_due(self, now: float) -> None:
        due = [entry for entry in self._retire if entry[0] <= now]
        if not due:
            return
        self._retire = [entry for entry in self._retire if entry[0] > now]
        for _, parts, discard in due:
            for part in parts:
                if discard:
                    log.info("local replica: dropping %s", part.pid)
                    part.discard()
                else:
                    part.close()

    def _collect_leftovers(self) -> None:
        """Remove what earlier runs left of the held stores (a superseded version whose removal a crash cut
        short, partitions no longer chosen): every directory of theirs that is not open here. Other stores'
        directories stay (absence is not deletion)."""
        for pid, path in iter_partition_dirs(self._data_dir):
            held = self._held.get(pid.store)
            if held is None or pid in self._parts:
                continue
            if pid.version != held.version or pid.partition not in held.partitions:
                log.info("local replica: removing %s, left by an earlier run", pid)
                remove_partition_dir(path)

    def _report(self) -> None:
        now = time.monotonic()
        if now - self._status_at < 1.0:
            return
        self._status_at = now
        try:
            write_status(self._data_dir, self.live_status())
        except OSError as exc:
            log.debug("local replica: writing the live status failed: %s", describe(exc))

    def _close_all(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
        if self._client is not None:
            zk.close(self._client)
        for applier in list(self._appliers.values()):
            applier.close()
        self._appliers.clear()
        for part in list(self._parts.values()):
            part.close()
        for _, parts, discard in self._retire:
            for part in parts:
                part.close()
                if discard:
                    remove_partition_dir(part.path)
        self._retire.clear()
        self._executor.shutdown(wait=True, cancel_futures=True)
