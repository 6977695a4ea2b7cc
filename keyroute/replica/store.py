"""The embedded store: one LMDB environment per loaded (store, version, partition) on the node's disk.

{data_dir}/stores/{store}/v{version}/p{partition}/data.mdb     key = Kafka-serialized key bytes,
                                                 lock.mdb     value = the value as compact JSON bytes
                                                 loaded.json  written only after the load committed

How data.mdb comes to be depends on the snapshot's format (the manifest says which):
  format 1 (JSON lines)        every row is parsed, hashed and put, in one write transaction
  format 2 (ready-to-serve)    the executor-built `partition={p}/data.mdb` is fetched as it is (a hard link
                               on the same filesystem, else a kernel copy or a download: keyroute.replica.fetch)
                               and checked: size and checksum in the same pass as the bytes move, then the
                               entry count and a sample of keys against the manifest and the partitioner.
                               Opened read-only: a hard-linked file is the snapshot's own.
  live (format 2 + `live`)     the file is always copied (never linked: it is written), checked as above,
                               opened writable, and OFFSET_KEY (the next topic offset to apply) set to the
                               manifest's `live.offsets[p]` in one write transaction; the partition's
                               `LivePartition` (keyroute.replica.live) says how far it has applied since.
The marker records which format a directory was loaded from, so a directory is reused only for the same.
A live directory's file changes as records are applied: it is reused when its marker matches and it holds
OFFSET_KEY (applying resumes from there), without comparing its size, entry count or checksum.

A live partition commits every batch of records without waiting for the disk: a commit is in the page cache
at once, so a process crash (kill -9) loses nothing, and its applier flushes the file to disk about once per
`--live-sync-ms` and on close. An operating-system crash may lose what was not flushed and leave the file
inconsistent, so `live.json` records the boot (Linux's boot_id) the file was last written in and whether it
was closed cleanly: a directory written in an earlier boot and not closed cleanly is loaded again from the
version, and the topic replayed from the version's offsets. Where the boot cannot be told, every commit is
flushed (LMDB's own sync).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar
from urllib.parse import quote, unquote

import lmdb

from keyroute.cluster.partition_map import StoreRecord
from keyroute.keys.key_format import KeyFormatError, parse_key
from keyroute.keys.partitioner import partition_for
from keyroute.replica.fetch import FetchCancelled, FetchError, check_keys, fetch_file
from keyroute.replica.live import LivePartition, read_next_offset
from keyroute.runtime.logs import describe
from keyroute.storage.live import OFFSET_KEY, LiveConfig, value_bytes
from keyroute.storage.lmdb_layout import KEY_ENCODING, LMDB_MAX_KEY_BYTES, TAG_KEY, db_key
from keyroute.storage.snapshot import (
    DATA_FILE,
    FORMAT_2,
    Manifest,
    SnapshotError,
    data_file,
    iter_partition,
    read_manifest,
    resolve_location,
)
from keyroute.storage.timeline import (
    SUFFIX_BYTES,
    Timeline,
    entry_key,
    first_after,
    key_of_part,
    key_part,
    last_at_or_before,
    last_before,
    split_entry,
)

log = logging.getLogger(__name__)

MARKER = "loaded.json"
# A live partition's last boot and clean close (see the module docstring).
LIVE_STATE = "live.json"
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
STORES_DIR = "stores"
# Readers are the event loop plus a few worker threads; LMDB's default (126) is plenty but each slot is
# only a few bytes of the lock file, so leave room for thread pools that grow.
MAX_READERS = 512
# How often (in rows) a load looks whether it was cancelled by a shutdown or a new version.
_CANCEL_CHECK_ROWS = 4096
# The greatest time and sequence: a timeline key part followed by it is at or after every entry of the key
# (and still no longer than LMDB's longest key).
_LAST_SUFFIX = b"\xff" * SUFFIX_BYTES


# Removing a partition tidies its empty version and store folders; creating one makes them. Both hold
# this lock, so a load never sees the folder it just made vanish under a concurrent removal.
_TREE_LOCK = threading.Lock()


class LoadError(Exception):
    """A partition could not be loaded; nothing of it was left on disk."""


class LoadCancelled(LoadError):
    """The load was abandoned on request (the node is stopping or the version is no longer wanted)."""


@dataclass(frozen=True, slots=True)
class PartitionId:
    """One partition of one version of one store: what a node loads, serves and drops."""

    store: str
    version: int
    partition: int

    def __str__(self) -> str:
        return f"{self.store} v{self.version} p{self.partition}"


def store_root(data_dir: Path) -> Path:
    return Path(data_dir) / STORES_DIR


def partition_path(data_dir: Path, pid: PartitionId) -> Path:
    # Store names come from a spec file: quote them so no name can climb out of the data directory.
    name = quote(pid.store, safe="")
    if name in (".", ".."):
        name = name.replace(".", "%2E")
    return store_root(data_dir) / name / f"v{pid.version}" / f"p{pid.partition}"


def iter_partition_dirs(data_dir: Path) -> Iterator[tuple[PartitionId, Path]]:
    """Every partition directory on disk, loaded or not (used to collect leftovers at startup)."""
    root = store_root(data_dir)
    if not root.is_dir():
        return
    for store_dir in sorted(root.iterdir()):
        for version_dir in sorted(store_dir.iterdir()) if store_dir.is_dir() else ():
            if not (version_dir.name.startswith("v") and version_dir.name[1:].isdigit()):
                continue
            for part_dir in sorted(version_dir.iterdir()):
                if part_dir.name.startswith("p") and part_dir.name[1:].isdigit():
                    version, partition = int(version_dir.name[1:]), int(part_dir.name[1:])
                    yield PartitionId(unquote(store_dir.name), version, partition), part_dir


@dataclass(eq=False, repr=False)
class PartitionStore:
    """A loaded batch partition, open read-only; the base of a live one (`LivePartitionStore`). The reads
    (`get`, `entries`, `key_range`) are safe from any thread; the LMDB lock file coordinates the readers.

    `live` is None for a batch partition and the partition's `LivePartition` for a live one."""

    pid: PartitionId
    path: Path
    rows: int
    _env: lmdb.Environment | None  # None once closed
    timeline: Timeline | None = None
    live: ClassVar[LivePartition | None] = None
    write_lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    # A stored value as it is answered: a batch partition stores it so.
    _answer: ClassVar[staticmethod[[bytes], bytes]] = staticmethod(bytes)
    # `pid.version`, kept as a plain attribute: a node reads it once per read (no property's frame).
    version: int = field(init=False)

    def __post_init__(self) -> None:
        self.version = self.pid.version

    @property
    def closed(self) -> bool:
        return self._env is None

    @property
    def read_only(self) -> bool:
        """Whether it is open read-only: a batch partition is (its data file may be the snapshot's own, hard
        linked, which the node must never write); a live one is not. False once closed."""
        env = self._env
        return env is not None and bool(env.flags()["readonly"])

    def get(self, key: bytes) -> bytes | None:
        env = self._env
        if env is None:
            raise LoadError(f"partition {self.pid} is closed")
        if self.timeline is not None:
            return self._latest(env, key)
        # db_key's common case inline (a frame less per read, on the node's and the local replica's read path).
        with env.begin(buffers=False) as txn:
            value = txn.get(TAG_KEY + key if len(key) < LMDB_MAX_KEY_BYTES else db_key(key))
        if value is None:
            return None
        return self._answer(value)

    def _latest(self, env: lmdb.Environment, key: bytes) -> bytes | None:
        """A timeline partition's value of a key: its latest entry (history row or window)."""
        part = key_part(key)
        with env.begin(buffers=False) as txn:
            cursor = txn.cursor()
            if last_at_or_before(cursor, part + _LAST_SUFFIX) and cursor.key().startswith(part):
                return self._answer(bytes(cursor.value()))
        return None

    def entries(
        self,
        key: bytes,
        low: int | None,
        high: int | None,
        limit: int,
        descending: bool = False,
        after: tuple[int, int] | None = None,
    ) -> tuple[list[tuple[int, int, bytes]], bool]:
        """A timeline partition's entries of `key` with `low` <= time < `high` (None: unbounded), oldest
        first (newest with `descending`), strictly after `after` (time, sequence) in that order: at most
        `limit` of them as (time, sequence, value), and whether more follow."""
        env = self._env
        if env is None:
            raise LoadError(f"partition {self.pid} is closed")
        part = key_part(key)
        answer = self._answer  # a live window keeps its merge state after the answer
        lowest = part if low is None else entry_key(part, low, 0)
        beyond = None if high is None else entry_key(part, high, 0)  # exclusive
        previous = None if after is None else entry_key(part, *after)  # exclusive
        found: list[tuple[int, int, bytes]] = []
        with env.begin(buffers=False) as txn:
            cursor = txn.cursor()
            if not descending:
                step = cursor.next
                if previous is not None and previous >= lowest:
                    more = first_after(cursor, previous)
                else:
                    more = cursor.set_range(lowest)
            else:
                step = cursor.prev
                if previous is not None and (beyond is None or previous <= beyond):
                    more = last_before(cursor, previous)
                elif beyond is not None:
                    more = last_before(cursor, beyond)
                else:
                    more = last_at_or_before(cursor, part + _LAST_SUFFIX)
            # Ascending starts at or after `lowest`, descending below `beyond`: one test ends either walk.
            while more:
                lmdb_key = cursor.key()
                if not lmdb_key.startswith(part) or lmdb_key < lowest or (beyond is not None and lmdb_key >= beyond):
                    break
                if len(found) == limit:
                    return found, True
                _, time, sequence = split_entry(lmdb_key)
                found.append((time, sequence, answer(bytes(cursor.value()))))
                more = step()
        return found, False

    def key_range(
        self, start: bytes, end: bytes, limit: int, resume: bytes | None = None
    ) -> tuple[list[tuple[bytes, bytes]], bool, bytes | None]:
        """Up to `limit` (serialized key, value) of the keys whose LMDB keys (value layout) or key parts
        (timeline layout) are in [start, end), in LMDB order, from `start` or strictly after `resume` (what
        an earlier call returned); whether more follow, and where to resume. Hashed (too long) keys cannot
        be told back and are left out; a timeline key's value is its latest entry."""
        env = self._env
        if env is None:
            raise LoadError(f"partition {self.pid} is closed")
        found: list[tuple[bytes, bytes]] = []
        answer = self._answer
        with env.begin(buffers=False) as txn:
            cursor = txn.cursor()
            more = cursor.set_range(start) if resume is None else first_after(cursor, resume)
            if self.timeline is None:
                while more:
                    lmdb_key = cursor.key()
                    if lmdb_key >= end:
                        break
                    if lmdb_key[:1] == TAG_KEY:
                        if len(found) == limit:
                            return found, True, resume
                        found.append((lmdb_key[1:], answer(cursor.value())))
                    resume = lmdb_key
                    more = cursor.next()
                return found, False, resume
            while more:
                lmdb_key = cursor.key()
                if lmdb_key >= end:
                    break
                part = lmdb_key[:-SUFFIX_BYTES]
                last = part + _LAST_SUFFIX  # at or after every entry of the key
                data = key_of_part(part)
                if data is not None:
                    if len(found) == limit:
                        return found, True, resume
                    last_at_or_before(cursor, last)  # the key's latest entry
                    found.append((data, answer(cursor.value())))
                resume = last
                more = first_after(cursor, last)
        return found, False, resume

    def read_txn(self) -> lmdb.Transaction:
        """A read transaction (values as bytes): one consistent state of the partition, its rows and, for a
        live one, OFFSET_KEY together. The caller uses it as a context manager."""
        env = self._env
        if env is None:
            raise LoadError(f"partition {self.pid} is closed")
        return env.begin(buffers=False)

    def clear_stale_readers(self) -> int:
        """Free the reader slots of processes that ended without closing the environment (kill -9): they
        would keep old pages from being reused. How many were freed."""
        env = self._env
        return 0 if env is None else int(env.reader_check())

    def write_txn(self) -> lmdb.Transaction:
        """Only a live partition is written."""
        raise LoadError(f"partition {self.pid} is closed or not live")

    def sync(self) -> None:
        """Nothing to flush: a batch partition is never written."""

    def close(self) -> None:
        with self.write_lock:
            env, self._env = self._env, None
        if env is not None:
            env.close()

    def discard(self) -> None:
        """Close and delete the files: the partition is no longer served here."""
        self.close()
        remove_partition_dir(self.path)

    def __repr__(self) -> str:
        return f"PartitionStore({self.pid}, rows={self.rows})"


@dataclass(eq=False, repr=False)
class LivePartitionStore(PartitionStore):
    """A loaded live partition, open writable: its applier writes it through `write_txn` under `write_lock`,
    which `close` takes too, so no write ever reaches a closed environment. Reads answer without the merge
    state the values carry."""

    # Its own where every other partition answers the class's None.
    live: LivePartition = field(kw_only=True)  # type: ignore[misc]
    _answer: ClassVar[staticmethod[[bytes], bytes]] = staticmethod(value_bytes)

    def write_txn(self) -> lmdb.Transaction:
        """A write transaction on the partition's environment; the caller holds `write_lock` and has checked
        `closed` under it."""
        env = self._env
        if env is None:
            raise LoadError(f"partition {self.pid} is closed or not live")
        return env.begin(write=True)

    def sync(self) -> None:
        """Flush the committed writes to disk (the applier calls it every --live-sync-ms)."""
        with self.write_lock:
            if self._env is not None:
                self._env.sync(True)

    def close(self) -> None:
        with self.write_lock:
            env, self._env = self._env, None
            if env is not None:
                with contextlib.suppress(lmdb.Error, OSError):
                    env.sync(True)
                    _write_live_state(self.path, clean=True)
        if env is not None:
            env.close()

    def __repr__(self) -> str:
        return f"PartitionStore({self.pid}, rows={self.rows}, live)"


@dataclass(eq=False, repr=False)
class AppliedPartitionStore(PartitionStore):
    """A live partition another process loaded and applies to, opened here for reads only: its reads answer
    without the merge state, and the offset they reflect is OFFSET_KEY in the same read transaction."""

    _answer = staticmethod(value_bytes)

    def __repr__(self) -> str:
        return f"PartitionStore({self.pid}, rows={self.rows}, live, read-only)"


def open_loaded(
    data_dir: Path, pid: PartitionId, map_size: int, *, live: bool, timeline: Timeline | None = None
) -> PartitionStore:
    """A partition another process of this host loaded into `data_dir` (its marker says the load completed),
    opened read-only beside it: LMDB's lock file lets any number of processes read while one writes. Raises
    LoadError when it is not loaded there (or no longer: its version was retired meanwhile)."""
    path = partition_path(data_dir, pid)
    if _read_marker(path) is None:
        raise LoadError(f"{pid} is not loaded in {data_dir}")
    try:
        env = _open(path, map_size, readonly=True)
        rows = int(env.stat()["entries"])
    except lmdb.Error as exc:
        raise LoadError(f"{pid}: {describe(exc)}") from exc
    if live:
        return AppliedPartitionStore(pid, path, max(0, rows - 1), env, timeline)
    return PartitionStore(pid, path, rows, env, timeline)


def remove_partition_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    # Tidy empty version/store folders so the data directory mirrors what is loaded.
    with _TREE_LOCK:
        for parent in (path.parent, path.parent.parent):
            try:
                parent.rmdir()
            except OSError:
                break


def _make_partition_dir(path: Path) -> None:
    with _TREE_LOCK:
        path.mkdir(parents=True)


def _marker(manifest: Manifest, partition: int) -> dict[str, object]:
    return {
        "key_encoding": KEY_ENCODING,
        "store": manifest.store,
        "version": manifest.version,
        "partition": partition,
        "rows": manifest.rows[partition],
        "key_format": manifest.key_format.value,
        "partitioner": manifest.partitioner.value,
        "manifest_created_at": manifest.created_at,
    }


def _read_marker(path: Path) -> dict[str, object] | None:
    try:
        obj = json.loads((path / MARKER).read_bytes())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def _write_marker(path: Path, marker: dict[str, object]) -> None:
    tmp = path / (MARKER + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(json.dumps(marker, sort_keys=True).encode("utf-8"))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path / MARKER)


@functools.cache
def boot_id() -> str | None:
    """This operating system's boot (Linux's random boot_id), or None where it cannot be told."""
    try:
        return _BOOT_ID.read_text().strip() or None
    except OSError:
        return None


def _write_live_state(path: Path, *, clean: bool) -> None:
    tmp = path / (LIVE_STATE + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(json.dumps({"boot_id": boot_id(), "clean": clean}).encode("utf-8"))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path / LIVE_STATE)


def _live_state_trusted(path: Path) -> str | None:
    """None when a live directory's file can be trusted (closed cleanly, or written in this boot, whose page
    cache holds every commit); else why not."""
    try:
        state = json.loads((path / LIVE_STATE).read_bytes())
    except (OSError, ValueError):
        return "its boot record is missing"
    if not isinstance(state, dict):
        return "its boot record is unreadable"
    if state.get("clean") is True:
        return None
    if state.get("boot_id") is not None and state.get("boot_id") == boot_id():
        return None
    return "the machine restarted while it had writes not yet flushed to disk"


def _open(path: Path, map_size: int, readonly: bool) -> lmdb.Environment:
    return lmdb.open(
        str(path),
        map_size=map_size,
        subdir=True,
        readonly=readonly,
        lock=True,
        max_readers=MAX_READERS,
        max_dbs=0,
        # Point reads of random keys: read-ahead would only pull in pages nobody asked for.
        readahead=False,
        meminit=False,
        # A live partition commits every batch of records; its applier flushes them every --live-sync-ms (see
        # the module docstring). Where the boot cannot be told, each commit is flushed, once (no meta sync:
        # an operating-system crash may then undo the last commit, rows and next offset together, and the node
        # applies those records again). Format-1 loads sync explicitly at the end.
        sync=readonly or boot_id() is None,
        metasync=False,
    )


def load_partition(
    data_dir: Path,
    record: StoreRecord,
    partition: int,
    map_size: int,
    cancelled: Callable[[], bool] = lambda: False,
    *,
    link: bool = True,
) -> PartitionStore:
    """Load one partition of the record's published version, or reuse it if an earlier run did.

    Format 1: the rows go in one write transaction. Format 2: the partition's data file is fetched and
    verified (`link=False` copies it even where a hard link would do). Either way `loaded.json` is
    written only after the data is complete, so a directory without a matching marker is always a
    leftover and is rebuilt. Blocking: run it in a worker thread.
    """
    pid = PartitionId(record.name, record.version, partition)
    path = partition_path(data_dir, pid)
    try:
        manifest = read_manifest(record.snapshot)
    except SnapshotError as exc:
        raise LoadError(f"{pid}: {exc}") from exc
    _check_manifest(pid, record, manifest)
    if manifest.format == FORMAT_2:
        return _load_file(pid, path, record, manifest, map_size, cancelled, link)

    expected = _marker(manifest, partition)
    if _read_marker(path) == expected:
        try:
            return PartitionStore(pid, path, manifest.rows[partition], _open(path, map_size, readonly=True))
        except lmdb.Error as exc:
            log.warning("%s: marker present but the environment did not open (%s); reloading", pid, describe(exc))

    remove_partition_dir(path)
    _make_partition_dir(path)
    env: lmdb.Environment | None = None
    try:
        env = _open(path, map_size, readonly=False)
        rows = _write_rows(env, pid, record, manifest, cancelled)
        env.sync(True)
        env.close()
        env = None
        _write_marker(path, expected)
        return PartitionStore(pid, path, rows, _open(path, map_size, readonly=True))
    except BaseException as exc:
        _abandon(path, env)
        if isinstance(exc, LoadError):
            raise
        if isinstance(exc, (SnapshotError, KeyFormatError, lmdb.Error, OSError)):
            raise LoadError(f"{pid}: {exc}") from exc
        raise



def _abandon(path: Path, env: lmdb.Environment | None) -> None:
    """A load failed: close the environment it had open (if any) and remove what it wrote."""
    if env is not None:
        env.close()
    remove_partition_dir(path)

def _check_manifest(pid: PartitionId, record: StoreRecord, manifest: Manifest) -> None:
    # The record in ZooKeeper and the manifest on disk must describe the same data, or keys would be
    # parsed or hashed differently from how they were written.
    problems = []
    if manifest.store != record.name:
        problems.append(f"store {manifest.store!r}")
    if manifest.version != record.version:
        problems.append(f"version {manifest.version}")
    if manifest.partitions != record.partitions:
        problems.append(f"{manifest.partitions} partitions (record: {record.partitions})")
    if manifest.key_format != record.key_format:
        problems.append(f"key format {manifest.key_format.value} (record: {record.key_format.value})")
    if manifest.partitioner != record.partitioner:
        problems.append(f"partitioner {manifest.partitioner.value} (record: {record.partitioner.value})")
    if not 0 <= pid.partition < manifest.partitions:
        problems.append(f"partition out of range 0..{manifest.partitions - 1}")
    if problems:
        raise LoadError(f"{pid}: the manifest at {record.snapshot} says {'; '.join(problems)}")


def _write_rows(
    env: lmdb.Environment,
    pid: PartitionId,
    record: StoreRecord,
    manifest: Manifest,
    cancelled: Callable[[], bool],
) -> int:
    rows = 0
    with env.begin(write=True) as txn:
        for key_text, value in iter_partition(record.snapshot, manifest, pid.partition):
            key = parse_key(manifest.key_format, key_text).data
            # A key the producer's partitioner sends elsewhere could never be asked for here: the
            # snapshot was written with a different partitioner or key format.
            if partition_for(manifest.partitioner, key, manifest.partitions) != pid.partition:
                raise LoadError(f"{pid}: key {key_text!r} belongs to another partition")
            if not txn.put(db_key(key), value, overwrite=False):
                raise LoadError(f"{pid}: key {key_text!r} appears twice")
            rows += 1
            if rows % _CANCEL_CHECK_ROWS == 0 and cancelled():
                raise LoadCancelled(f"{pid}: load cancelled")
        if cancelled():
            raise LoadCancelled(f"{pid}: load cancelled")
    return rows


# -- format 2: a ready-to-serve data file per partition -----------------------------------------------


def _load_file(
    pid: PartitionId,
    path: Path,
    record: StoreRecord,
    manifest: Manifest,
    map_size: int,
    cancelled: Callable[[], bool],
    link: bool,
) -> PartitionStore:
    partition = pid.partition
    name = data_file(partition)  # the manifest lists exactly this (Manifest.from_json checks it)
    rows = manifest.rows[partition]
    live = manifest.live
    expected = _file_marker(manifest, partition)
    if _read_marker(path) == expected:
        reused = (
            _reuse_live(pid, path, live, map_size, manifest.timeline)
            if live is not None
            else _reuse_file(pid, path, manifest, map_size)
        )
        if reused is not None:
            return reused

    remove_partition_dir(path)
    _make_partition_dir(path)
    env: lmdb.Environment | None = None
    shown = f"{record.snapshot.rstrip('/')}/{name}"
    try:
        where = resolve_location(record.snapshot)
        shown = str(where / name) if isinstance(where, Path) else where.describe(name)
        fetched = fetch_file(
            where,
            name,
            path / DATA_FILE,
            size=manifest.bytes[partition],
            checksum=manifest.checksums[partition],
            cancelled=cancelled,
            # A live partition's file is written as records are applied: never the snapshot's own.
            link=link and live is None,
        )
        if cancelled():
            raise LoadCancelled(f"{pid}: load cancelled")
        # Read-only unless live: a hard-linked file is the snapshot's own (the lock file is this directory's).
        env = _open(path, map_size, readonly=live is None)
        with env.begin(buffers=False) as txn:
            check_keys(
                txn,
                partitioner=manifest.partitioner,
                partitions=manifest.partitions,
                partition=partition,
                key_format=manifest.key_format,
                shown=shown,
                timeline=manifest.timeline is not None,
            )
        entries = int(env.stat()["entries"])
        if entries != rows:
            raise LoadError(f"{pid}: {shown}: {entries} rows vs manifest {rows}")
        held: PartitionStore
        if live is not None:
            live_partition = LivePartition(pid.store, pid.version, partition, live, _start_offset(env, live, partition))
            env.sync(True)
            _write_live_state(path, clean=False)
            held = LivePartitionStore(pid, path, entries, env, manifest.timeline, live=live_partition)
        else:
            held = PartitionStore(pid, path, entries, env, manifest.timeline)
        _write_marker(path, expected)
        log.info("%s: %s by %s (%d bytes, %s)", pid, shown, fetched.method, fetched.size, fetched.checksum)
        env = None
        return held
    except BaseException as exc:
        _abandon(path, env)
        if isinstance(exc, FetchCancelled):
            raise LoadCancelled(f"{pid}: load cancelled") from exc
        if isinstance(exc, LoadError):
            raise
        if isinstance(exc, (FetchError, SnapshotError, OSError)):
            raise LoadError(f"{pid}: {exc}") from exc
        if isinstance(exc, lmdb.Error):
            raise LoadError(f"{pid}: {shown} does not open as an LMDB environment: {exc}") from exc
        raise


def _file_marker(manifest: Manifest, partition: int) -> dict[str, object]:
    # The format-1 marker has no "format": neither kind of directory is ever taken for the other.
    marker = {
        **_marker(manifest, partition),
        "format": manifest.format,
        "bytes": manifest.bytes[partition],
        "checksum": manifest.checksums[partition],
    }
    if manifest.live is not None:
        # The size and checksum are the version's file as fetched, not as it is now (records were applied).
        marker["live"] = True
        marker["start_offset"] = manifest.live.offsets[partition]
    return marker


def _start_offset(env: lmdb.Environment, live: LiveConfig, partition: int) -> int:
    """The next offset to apply: OFFSET_KEY, set (durably) to the version's offset when absent."""
    with env.begin(write=True) as txn:
        stored = read_next_offset(txn)
        if stored is not None:
            return stored
        start = live.offsets[partition]
        txn.put(OFFSET_KEY, str(start).encode("ascii"))
    return start


def _reopen(pid: PartitionId, path: Path, map_size: int, *, readonly: bool) -> lmdb.Environment | None:
    """The environment an earlier run loaded (its marker says so), or None, said, when it does not open."""
    try:
        return _open(path, map_size, readonly=readonly)
    except lmdb.Error as exc:
        log.warning("%s: marker present but the environment did not open (%s); reloading", pid, describe(exc))
        return None


def _reuse_live(
    pid: PartitionId, path: Path, live: LiveConfig, map_size: int, timeline: Timeline | None = None
) -> LivePartitionStore | None:
    """A live partition loaded by an earlier run: reused (applying resumes from its OFFSET_KEY) when its file
    can be trusted (`_live_state_trusted`), opens and holds OFFSET_KEY; else None and it is fetched again from
    the version."""
    distrust = _live_state_trusted(path)
    if distrust is not None:
        log.warning("%s: not reusing the live partition on disk (%s); loading it from the version again", pid, distrust)
        return None
    env = _reopen(pid, path, map_size, readonly=False)
    if env is None:
        return None
    try:
        with env.begin() as txn:
            next_offset = read_next_offset(txn)
        entries = int(env.stat()["entries"])
    except (lmdb.Error, ValueError) as exc:
        log.warning("%s: marker present but the live data is unreadable (%s); reloading", pid, describe(exc))
        next_offset, entries = None, 0
    if next_offset is None:
        env.close()
        log.warning("%s: marker present but no applied offset is stored; reloading", pid)
        return None
    try:
        _write_live_state(path, clean=False)
    except OSError as exc:
        env.close()
        log.warning("%s: cannot record the boot of the live partition (%s); reloading", pid, describe(exc))
        return None
    log.info("%s: reusing the live partition on disk, resuming at offset %d", pid, next_offset)
    live_partition = LivePartition(pid.store, pid.version, pid.partition, live, next_offset)
    return LivePartitionStore(pid, path, max(0, entries - 1), env, timeline, live=live_partition)


def _reuse_file(pid: PartitionId, path: Path, manifest: Manifest, map_size: int) -> PartitionStore | None:
    """The partition loaded by an earlier run, if its file still looks like it (size and entry count:
    cheap, no read of the data); else None and it is fetched again."""
    rows = manifest.rows[pid.partition]
    env = _reopen(pid, path, map_size, readonly=True)
    if env is None:
        return None
    try:
        size = (path / DATA_FILE).stat().st_size
        entries = int(env.stat()["entries"])
    except (OSError, lmdb.Error) as exc:
        size, entries = -1, -1
        log.warning("%s: marker present but the data file is unreadable (%s)", pid, describe(exc))
    if size == manifest.bytes[pid.partition] and entries == rows:
        return PartitionStore(pid, path, rows, env, timeline=manifest.timeline)
    env.close()
    log.warning("%s: marker present but the data file differs (%d bytes, %d rows); reloading", pid, size, entries)
    return None
