"""How a partition's rows are laid out in LMDB: the one definition the pipeline (which builds snapshot format
2's files) and the nodes (which serve them, and build them from format 1) share.

    environment   subdir=True, one unnamed database (max_dbs=0)
    LMDB key      db_key(serialized key bytes): b"=" + the bytes when shorter than 511 bytes (LMDB's largest
                  key), else b"#" + their SHA-256; every `#` key sorts before every `=` key
    LMDB value    the value as compact JSON bytes (keyroute.storage.snapshot.compact_json)

`PartitionFileBuilder` writes one partition's entries, given in ascending LMDB key order, in one write
transaction with append=True, into one file (subdir=False, no lock file): the data.mdb a snapshot
publishes. Appending in key order into a new environment in one transaction frees no page (every page is a
meta page or in the tree, leaves filled as LMDB's append mode fills them), so the file is as dense as
`env.copy(compact=True)` would make it, and as deterministic (the same entries give the same bytes): it is
published as it is, with no compacting copy. `finish` checks that (every page below the last one in use is
the tree's) and falls back to the compacting copy should it ever not hold. The environment is private (no
lock file, no syncs: the publisher makes the finished file durable).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from keyroute.storage.snapshot import DATA_FILE, SnapshotError

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
    """`db_key` of every key in a pyarrow binary array (null stays null), as a binary array; a string array
    stands for its texts' UTF-8 bytes.

    Whole batches are tagged by one Arrow kernel when every key fits (the tag inserted before each key's
    bytes: a third of the time of joining it on); a batch with a long key goes key by key through `db_key`.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks()
    if not pa.types.is_binary(keys.type):
        keys = keys.cast(pa.binary())  # large_binary, binary_view; a string's own bytes
    longest = pc.max(pc.binary_length(keys)).as_py() if len(keys) else None
    if longest is None or longest < LMDB_MAX_KEY_BYTES:
        return pc.binary_replace_slice(keys, start=0, stop=0, replacement=TAG_KEY)
    return pa.array([None if k is None else db_key(k) for k in keys.to_pylist()], pa.binary())


@dataclass(frozen=True, slots=True)
class BuiltPartition:
    """A finished partition file: `path` (a data.mdb) holding `rows` entries."""

    path: Path
    rows: int


class PartitionFileBuilder:
    """Build one partition's LMDB file from entries in ascending LMDB key order.

        with PartitionFileBuilder(workdir) as builder:  # or PartitionFileBuilder.into(path): that very file
            builder.add(entries)       # (lmdb_key, value) pairs; as many calls as needed, still ascending
            built = builder.finish()   # workdir/partition-*/data.mdb; the caller moves or copies it away

    `PartitionFileBuilder(workdir)` builds in a new directory inside `workdir`; `PartitionFileBuilder.into(path)`
    builds straight into the file `path` (which must not exist: e.g. a temporary name beside the file's
    place), so publishing it needs no copy. The file holds nothing else (no lock file).

    A key that is not greater than the one before (out of order, or twice) raises SnapshotError: LMDB's
    append mode refuses it, and the build is abandoned. Leaving the block on an error or unfinished removes
    the file (and the directory made for it); a finished file stays until `discard`.
    """

    def __init__(self, workdir: Path) -> None:
        folder = Path(tempfile.mkdtemp(prefix="partition-", dir=workdir))
        self._start(folder / DATA_FILE, folder)

    @classmethod
    def into(cls, path: Path) -> PartitionFileBuilder:
        """A builder writing the file `path` itself (created here; its directory must exist)."""
        builder = cls.__new__(cls)
        builder._start(Path(path), None)
        return builder

    def _start(self, path: Path, folder: Path | None) -> None:
        self.path = path
        self._folder = folder  # the directory made for the file (removed with it), or None
        self._finished = False
        self._env: lmdb.Environment | None = None
        self._txn: lmdb.Transaction | None = None
        self.rows = 0
        try:
            # O_EXCL: a builder never writes into a file that is already there (lmdb.open would open it).
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except BaseException:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
            raise
        try:
            self._env = lmdb.open(
                str(path),
                map_size=BUILD_MAP_SIZE,
                subdir=False,
                max_dbs=0,
                lock=False,  # private to this builder: no lock file
                sync=False,
                metasync=False,
                readahead=False,
                meminit=True,  # zeroed page slack: the same entries always give the same bytes
            )
            self._txn = self._env.begin(write=True)
            self._cursor = self._txn.cursor()
        except BaseException:
            self.discard()
            raise

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
        """Commit and close: the file (not synced) and its number of entries."""
        if self._txn is None or self._env is None:
            raise SnapshotError("the partition file is already finished")
        txn, self._txn = self._txn, None
        txn.commit()
        if not is_dense(self._env, self.path):
            self._compact()
        self._close()
        self._finished = True
        return BuiltPartition(self.path, self.rows)

    def _compact(self) -> None:
        """Replace the file by LMDB's compacting copy of it (only for a file with pages out of the tree)."""
        assert self._env is not None
        copy = self.path.with_name(f"{self.path.name}.compact")
        try:
            with open(copy, "xb", buffering=0) as out:
                self._env.copyfd(out.fileno(), compact=True)
            os.replace(copy, self.path)
        except BaseException:
            copy.unlink(missing_ok=True)
            raise

    def _close(self) -> None:
        if self._txn is not None:
            txn, self._txn = self._txn, None
            txn.abort()
        if self._env is not None:
            env, self._env = self._env, None
            env.close()

    def discard(self) -> None:
        """Remove the file (finished or not) and the directory made for it: once the caller has moved or
        copied a finished file away, or to abandon the build."""
        self._close()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
        else:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> PartitionFileBuilder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if exc_info[0] is not None or not self._finished:
            self.discard()
        else:
            self._close()


def is_dense(env: lmdb.Environment, path: Path) -> bool:
    """Every page of the committed file is a meta page or one of the tree's, and the file ends at its last
    page: nothing a compacting copy would leave out."""
    info, stat = env.info(), env.stat()
    pages = 2 + stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]
    return info["last_pgno"] + 1 == pages and os.path.getsize(path) == pages * stat["psize"]


def build_partition_file(entries: Iterable[tuple[bytes, bytes]], workdir: Path) -> BuiltPartition:
    """One partition's LMDB file from (lmdb_key, value) entries in ascending LMDB key order."""
    with PartitionFileBuilder(workdir) as builder:
        builder.add(entries)
        return builder.finish()


def build_partition_rows(rows: Iterable[tuple[bytes, bytes]], workdir: Path) -> BuiltPartition:
    """One partition's file from (serialized key, value) rows in any order: for tests and small tools (it
    holds every row in memory to sort them; the pipeline streams entries Spark already sorted)."""
    entries = sorted((db_key(key), value) for key, value in rows)
    return build_partition_file(entries, workdir)
