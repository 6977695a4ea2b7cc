"""How a partition's rows are laid out in LMDB: the one definition the pipeline (which builds snapshot format
2's files) and the nodes (which serve them, and build them from format 1) share.

    environment   subdir=True, one unnamed database (max_dbs=0)
    LMDB key      db_key(serialized key bytes): b"=" + the bytes when shorter than 511 bytes (LMDB's largest
                  key), else b"#" + their SHA-256; every `#` key sorts before every `=` key
    LMDB value    the value as compact JSON bytes (keyroute_core.snapshot.compact_json)

`PartitionFileBuilder` writes one partition's entries, given in ascending LMDB key order, in one write
transaction with append=True, and leaves a compacted copy (`env.copy(compact=True)`): the data.mdb a
snapshot publishes, without a lock file. The builder's environment is private (no lock file, no syncs: the
compacted copy is what counts, and its publisher makes that durable).
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from keyroute.core.snapshot import DATA_FILE, SnapshotError

# How keys are laid out in LMDB (`db_key`); nodes record it in their loaded markers, so files written
# another way are loaded again rather than reused.
KEY_ENCODING = 2
# LMDB's largest key (the lmdb wheel's build: `Environment.max_key_size()`).
LMDB_MAX_KEY_BYTES = 511
# The first byte of every LMDB key: the key's own bytes follow, or (too long for LMDB) their SHA-256.
TAG_KEY = b"="
TAG_HASHED = b"#"
HASHED_KEY_BYTES = 1 + hashlib.sha256().digest_size
# The builder's map: address space only (the file grows with the data), larger than any partition.
BUILD_MAP_SIZE = 1 << 40


def db_key(key: bytes) -> bytes:
    """The LMDB key of a key's serialized bytes. LMDB keys are 1 to 511 bytes, while a store's keys may be
    empty or longer: every key gets a one-byte tag, `=` before the bytes themselves when they fit, `#`
    before their SHA-256 when they do not (a collision would need two keys with one SHA-256)."""
    if len(key) < LMDB_MAX_KEY_BYTES:
        return TAG_KEY + key
    return TAG_HASHED + hashlib.sha256(key).digest()


def key_of(lmdb_key: bytes) -> bytes | None:
    """The serialized key an LMDB key holds, or None for a hashed (`#`) one, which cannot be turned back."""
    return bytes(lmdb_key[1:]) if lmdb_key[:1] == TAG_KEY else None


def db_keys(keys: Any) -> Any:
    """`db_key` of every key in a pyarrow binary array (null stays null), as a binary array.

    Whole batches are tagged by one Arrow kernel when every key fits; a batch with a long key goes key by
    key through `db_key` itself.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks()
    if pa.types.is_large_binary(keys.type) or pa.types.is_binary_view(keys.type):
        keys = keys.cast(pa.binary())
    longest = pc.max(pc.binary_length(keys)).as_py() if len(keys) else None
    if longest is None or longest < LMDB_MAX_KEY_BYTES:
        tagged = pc.binary_join_element_wise(pa.scalar(TAG_KEY, pa.binary()), keys, pa.scalar(b"", pa.binary()))
        return tagged.cast(pa.binary())
    return pa.array([None if k is None else db_key(k) for k in keys.to_pylist()], pa.binary())


@dataclass(frozen=True, slots=True)
class BuiltPartition:
    """A compacted partition file: `path` (a data.mdb) holding `rows` entries."""

    path: Path
    rows: int


class PartitionFileBuilder:
    """Build one partition's LMDB file from entries in ascending LMDB key order, inside `workdir`.

        with PartitionFileBuilder(workdir) as builder:
            builder.add(entries)       # (lmdb_key, value) pairs; as many calls as needed, still ascending
            built = builder.finish()   # workdir/compact/data.mdb; the caller moves or copies it away

    A key that is not greater than the one before (out of order, or twice) raises SnapshotError: LMDB's
    append mode refuses it, and the build is abandoned. Leaving the block removes the work files (not the
    compacted copy once finished).
    """

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="partition-", dir=workdir))
        self._env: lmdb.Environment | None = lmdb.open(
            str(self.workdir / "build"),
            map_size=BUILD_MAP_SIZE,
            subdir=True,
            max_dbs=0,
            lock=False,  # private to this builder: no lock file
            sync=False,
            metasync=False,
            readahead=False,
            meminit=True,  # zeroed page slack: the same entries always give the same bytes
        )
        self._txn: lmdb.Transaction | None = self._env.begin(write=True)
        self._cursor = self._txn.cursor()
        self.rows = 0

    def add(self, entries: Iterable[tuple[bytes, bytes]]) -> int:
        """Append entries (ascending LMDB keys, each greater than every key added before); their count."""
        if self._txn is None:
            raise SnapshotError("the partition file is already finished")
        consumed, added = self._cursor.putmulti(entries, append=True)
        self.rows += added
        if added != consumed:
            raise SnapshotError(
                f"{consumed - added} of {consumed} entries are out of LMDB key order or repeat a key "
                f"(after {self.rows} entries in order)"
            )
        return int(added)

    def finish(self) -> BuiltPartition:
        """Commit, and write the compacted copy: `workdir/compact/data.mdb`."""
        target = self.workdir / "compact"
        target.mkdir()
        with open(target / DATA_FILE, "xb", buffering=0) as out:
            rows = self.finish_into(out.fileno())
        return BuiltPartition(target / DATA_FILE, rows)

    def finish_into(self, fd: int) -> int:
        """Commit, and write the compacted copy to the open file `fd` (from its current position; not
        synced); the number of entries. The work files are removed."""
        if self._txn is None or self._env is None:
            raise SnapshotError("the partition file is already finished")
        txn, self._txn = self._txn, None
        txn.commit()
        self._env.copyfd(fd, compact=True)
        self._close()
        shutil.rmtree(self.workdir / "build", ignore_errors=True)
        return self.rows

    def _close(self) -> None:
        if self._txn is not None:
            txn, self._txn = self._txn, None
            txn.abort()
        if self._env is not None:
            env, self._env = self._env, None
            env.close()

    def discard(self) -> None:
        """Abandon the build and remove every file of it."""
        self._close()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> PartitionFileBuilder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._close()
        shutil.rmtree(self.workdir / "build", ignore_errors=True)
        if exc_info[0] is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


def build_partition_file(entries: Iterable[tuple[bytes, bytes]], workdir: Path) -> BuiltPartition:
    """One partition's compacted LMDB file from (lmdb_key, value) entries in ascending LMDB key order."""
    with PartitionFileBuilder(workdir) as builder:
        builder.add(entries)
        return builder.finish()


def build_partition_rows(rows: Iterable[tuple[bytes, bytes]], workdir: Path) -> BuiltPartition:
    """One partition's file from (serialized key, value) rows in any order: for tests and small tools (it
    holds every row in memory to sort them; the pipeline streams entries Spark already sorted)."""
    entries = sorted((db_key(key), value) for key, value in rows)
    return build_partition_file(entries, workdir)
