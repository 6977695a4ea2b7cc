"""One data directory shared by the worker processes of a host: one of them applies, the others read.

{data_dir}/local.lock        an exclusive, non-blocking `flock`: its holder is the applying process (it
                             loads versions, applies live topics, retires what is superseded). The kernel
                             releases it when that process ends, however it ends (kill -9 too), and a
                             reading process takes it over on its next try.
{data_dir}/local-view.json   what the applying process holds, replaced whole (write, fsync, rename) after
                             each swap: per store its record as published and the version and partitions
                             held. Readers open the same partition directories read-only (LMDB's lock file
                             lets any number of processes read while one writes).
{data_dir}/local-status.json the applying process's live status per partition (offset, lag, state), about
                             once a second: lag as the applying process last saw it.
{data_dir}/stores/...        the partitions, laid out as a node lays out its own (keyroute.replica.store).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keyroute.cluster.partition_map import RecordError, StoreRecord

LOCK_FILE = "local.lock"
VIEW_FILE = "local-view.json"
STATUS_FILE = "local-status.json"


@dataclass(frozen=True, slots=True)
class HeldStore:
    """One store as the applying process holds it: the record it was loaded from, the version and the
    partitions held (all of them or the chosen subset)."""

    record: StoreRecord
    version: int
    partitions: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "record": json.loads(self.record.to_json()),
            "version": self.version,
            "partitions": list(self.partitions),
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> HeldStore:
        record = StoreRecord.from_json(json.dumps(doc["record"]).encode("utf-8"))
        return cls(record, int(doc["version"]), tuple(int(p) for p in doc["partitions"]))


class ApplyLock:
    """The data directory's applying role: `try_take` takes it when no other process holds it."""

    def __init__(self, data_dir: Path) -> None:
        self._path = Path(data_dir) / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_take(self) -> bool:
        """Take the role if it is free (no blocking); True when this process holds it (now or already)."""
        if self._fd is not None:
            return True
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid()}).encode("utf-8"), 0)
        self._fd = fd
        return True

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _write_atomically(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(json.dumps(doc, sort_keys=True).encode("utf-8"))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_view(data_dir: Path, held: dict[str, HeldStore], generation: int) -> None:
    """Say what the applying process holds now (after a swap)."""
    stores = {name: store.to_dict() for name, store in sorted(held.items())}
    _write_atomically(Path(data_dir) / VIEW_FILE, {"generation": generation, "stores": stores})


def view_stamp(data_dir: Path) -> tuple[int, int] | None:
    """What changes whenever the view file is replaced (its inode and modification time), None when absent:
    a reader stats it rather than reading it."""
    try:
        st = os.stat(Path(data_dir) / VIEW_FILE)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def read_view(data_dir: Path) -> tuple[int, dict[str, HeldStore]] | None:
    """The view file's generation and stores; None when it is absent or unreadable (being replaced)."""
    try:
        doc = json.loads((Path(data_dir) / VIEW_FILE).read_bytes())
        stores = {str(name): HeldStore.from_dict(entry) for name, entry in doc["stores"].items()}
        return int(doc["generation"]), stores
    except (OSError, ValueError, KeyError, TypeError, RecordError):
        return None


def write_status(data_dir: Path, status: dict[str, dict[str, dict[str, Any]]]) -> None:
    _write_atomically(Path(data_dir) / STATUS_FILE, {"stores": status})


def read_status(data_dir: Path) -> dict[str, dict[str, dict[str, Any]]]:
    try:
        doc = json.loads((Path(data_dir) / STATUS_FILE).read_bytes())
        stores = doc["stores"]
        return stores if isinstance(stores, dict) else {}
    except (OSError, ValueError, KeyError, TypeError):
        return {}
