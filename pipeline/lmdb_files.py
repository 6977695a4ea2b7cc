"""Snapshot format 2 on Spark's executors: each task turns its sorted rows into ready-to-serve partition files.

A task receives Arrow batches of (partition, LMDB key, value as JSON text[, a live store's merge state as
JSON text]), sorted by partition and then by LMDB key, all rows of a store partition in the same task (a
store whose LMDB keys are all the `=` tag and the key text's UTF-8 sends the key text instead, and the task
tags it: keyroute.pipeline.writer._ordered_rows). For
every store partition it meets it builds the LMDB file (keyroute_core.lmdb_layout: appended in key order,
as dense as a compacting copy, so published as built) and puts it at `{version}/partition={p}/data.mdb`:
into a local version directory it is built in place under a temporary name, checksummed as read back while
it is fsynced, and renamed; anywhere else it is built in a local scratch directory and uploaded, checksummed
in the same pass. Each yields one result row (partition, rows, bytes, checksum, misplaced), which the driver
checks and writes into the manifest.

This module runs on executors: it imports the shared core, pyarrow and lmdb only (never the node, never
Spark), so the functions Spark ships here stay small.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from keyroute.core.live import STATE_SEPARATOR
from keyroute.core.lmdb_layout import PartitionFileBuilder, db_keys
from keyroute.core.snapshot import (
    CHECKSUM_CHUNK_BYTES,
    ArrowLocation,
    Checksum,
    SnapshotError,
    compact_json,
    compact_value,
    copy_checksummed,
    data_file,
    is_local,
    local_path,
)

# The columns a task reads (internal names, as in keyroute.pipeline.compute).
PARTITION = "partition"
LMDB_KEY = "__keyroute_lmdb_key"
# In place of LMDB_KEY, when every row's LMDB key is the `=` tag and its key text's UTF-8 (db_keys makes it).
KEY_TEXT = "__keyroute_key_text"
VALUE_JSON = "__keyroute_value_json"
# Live stores whose fold keeps a merge state: {"0": s0, "1": s1, ...} (keyroute.pipeline.compute.live_state).
LIVE_STATE = "__keyroute_live_state"
# One row per partition file written; `misplaced` counts rows whose key does not hash to their partition
# (their LMDB key is null; they are not written, and the driver fails the build).
RESULT_SCHEMA = pa.schema(
    [
        pa.field("partition", pa.int32(), nullable=False),
        pa.field("rows", pa.int64(), nullable=False),
        pa.field("bytes", pa.int64(), nullable=False),
        pa.field("checksum", pa.string(), nullable=False),
        pa.field("misplaced", pa.int64(), nullable=False),
    ]
)
RESULT_DDL = "partition int, rows long, bytes long, checksum string, misplaced long"

BatchTask = Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]


@dataclass(frozen=True, slots=True)
class Destination:
    """A version directory files are published to: a local path (plain file I/O) or a pyarrow URI."""

    location: str

    def put(self, source: Path, name: str) -> Checksum:
        """Copy the local file `source` to `name` (relative) in this directory, checksumming it in the same
        pass. Readers never see a partial file: a local file (or one on a filesystem with renames) is
        written under a temporary name and moved into place; an object appears whole when its upload
        completes. A retried or speculative task writing the same file writes the same bytes."""
        if is_local(self.location):
            return _put_local(source, local_path(self.location) / name)
        return _put_arrow(source, _arrow_location(self.location), name)

    def builder(self, name: str, workdir: Path) -> PartitionFileBuilder:
        """A builder for the file `name` (relative) in this directory, finished by `publish`: in a local
        directory it builds the file in place, under a temporary name beside it; anywhere else in
        `workdir`, to be uploaded."""
        if not is_local(self.location):
            return PartitionFileBuilder(workdir)
        target = local_path(self.location) / name
        target.parent.mkdir(parents=True, exist_ok=True)
        return PartitionFileBuilder.into(_temporary(target))

    def publish(self, builder: PartitionFileBuilder, name: str) -> tuple[int, Checksum]:
        """Finish `builder` (from `self.builder(name, ...)`) into `name`: its entry count and the file's
        checksum. Readers never see a partial file: a local one is fsynced (checksummed as read back from
        the page cache meanwhile) and renamed into place; an upload appears whole when it completes. The
        builder's files are removed, also on failure."""
        try:
            built = builder.finish()
            if not is_local(self.location):
                return built.rows, _put_arrow(built.path, _arrow_location(self.location), name)
            target = local_path(self.location) / name
            with open(built.path, "rb+", buffering=0) as out:  # writable: fsync on any platform
                checksum = checksum_fsynced(out.fileno())
            os.replace(built.path, target)
        finally:
            builder.discard()  # the scratch copy once uploaded; nothing once renamed; a failed build's file
        _fsync_dir(target.parent)
        return built.rows, checksum


def _temporary(target: Path) -> Path:
    """A name beside `target` for a file being written: hidden, unique to this writer."""
    return target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")


@functools.lru_cache(maxsize=16)
def _arrow_location(uri: str) -> ArrowLocation:
    """One filesystem per version directory and process: making one may cost a request (S3 looks up the
    bucket's region), and a task publishes several files."""
    return ArrowLocation.from_uri(uri)


def _put_local(source: Path, target: Path) -> Checksum:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(target)
    try:
        with open(tmp, "wb") as out:
            checksum = copy_checksummed(source, out.write)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(target.parent)
    return checksum


def checksum_fsynced(fd: int) -> Checksum:
    """fsync the open file `fd` and checksum it (read back from the page cache) at the same time: both wait
    on the kernel, so the checksum costs no time beside the fsync. Returns once both are done."""
    failed: list[BaseException] = []

    def sync() -> None:
        try:
            os.fsync(fd)
        except BaseException as exc:  # re-raised in the caller's thread
            failed.append(exc)

    syncing = threading.Thread(target=sync, name="keyroute-fsync", daemon=True)
    syncing.start()
    try:
        checksum = checksum_fd(fd)
    finally:
        syncing.join()
    if failed:
        raise failed[0]
    return checksum


def checksum_fd(fd: int) -> Checksum:
    """The checksum of everything in the open file `fd` (read with pread: its position does not matter)."""
    checksum = Checksum()
    buffer = memoryview(bytearray(CHECKSUM_CHUNK_BYTES))
    offset = 0
    while n := os.preadv(fd, [buffer], offset):
        checksum.update(buffer[:n])
        offset += n
    return checksum


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def _put_arrow(source: Path, where: ArrowLocation, name: str) -> Checksum:
    target = where.child(name)
    filesystem = where.filesystem
    if where.is_object_store:
        with filesystem.open_output_stream(target, compression=None) as out:
            return copy_checksummed(source, out.write)
    filesystem.create_dir(target.rsplit("/", 1)[0], recursive=True)
    tmp = f"{target}.{uuid.uuid4().hex}.tmp"
    try:
        with filesystem.open_output_stream(tmp, compression=None) as out:
            checksum = copy_checksummed(source, out.write)
        filesystem.move(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            filesystem.delete_file(tmp)
        raise
    return checksum


def scratch_root() -> str | None:
    """Where a task builds its files: the executor's first Spark local directory (SPARK_LOCAL_DIRS, as
    pyspark's own spill files), else the system's temporary directory."""
    for entry in os.environ.get("SPARK_LOCAL_DIRS", "").split(","):
        if entry and os.path.isdir(entry):
            return entry
    return None


def partition_task(destination: str) -> BatchTask:
    """The function `mapInArrow` runs in every task: build and publish the files of the partitions in its
    rows (see the module docstring), to the version directory `destination` (a local path or a URI)."""

    def write_partitions(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        workdir = Path(tempfile.mkdtemp(prefix="keyroute-partitions-", dir=scratch_root()))
        try:
            yield from write_partition_files(batches, Destination(destination), workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    return write_partitions


def write_partition_files(
    batches: Iterator[pa.RecordBatch], destination: Destination, workdir: Path
) -> Iterator[pa.RecordBatch]:
    """Build, publish and report every partition in `batches` (sorted by partition, then LMDB key)."""
    builder: PartitionFileBuilder | None = None
    current = -1
    misplaced = 0
    done: set[int] = set()
    try:
        for batch, respell in _matched_ahead(batches):
            runs = pc.run_end_encode(batch.column(PARTITION))
            start = 0
            for end, value in zip(runs.run_ends.to_pylist(), runs.values.to_pylist(), strict=True):
                if value is None:
                    raise SnapshotError(f"{end - start} row(s) have no partition")
                partition = int(value)
                if partition != current:
                    if builder is not None:
                        yield _publish(builder, current, misplaced, destination)
                        builder = None
                    if partition in done or partition < current:
                        raise SnapshotError(f"the rows of partition {partition} are not together in the task")
                    done.add(partition)
                    builder = destination.builder(data_file(partition), workdir)
                    current, misplaced = partition, 0
                assert builder is not None
                misplaced += _add(builder, batch.slice(start, end - start), respell.slice(start, end - start))
                start = end
        if builder is not None:
            yield _publish(builder, current, misplaced, destination)
            builder = None
    finally:
        if builder is not None:
            builder.discard()


def _matched_ahead(batches: Iterator[pa.RecordBatch]) -> Iterator[tuple[pa.RecordBatch, pa.BooleanArray]]:
    """Every non-empty batch with `NEEDS_RESPELLING`'s matches of its values, the match of each batch run in
    a thread while the batch before is written (the regex releases the GIL: it takes a core Spark's side of
    the task leaves idle, instead of the task's own time). Batches are read in this thread only."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="keyroute-respell") as pool:
        pending: tuple[pa.RecordBatch, Future[pa.BooleanArray]] | None = None
        try:
            for batch in batches:
                if not batch.num_rows:
                    continue
                matching = pool.submit(needs_respelling, batch.column(VALUE_JSON))
                if pending is not None:
                    yield pending[0], pending[1].result()
                pending = (batch, matching)
            if pending is not None:
                yield pending[0], pending[1].result()
        finally:
            if pending is not None:
                pending[1].cancel()


def _add(builder: PartitionFileBuilder, rows: pa.RecordBatch, respell: pa.BooleanArray) -> int:
    """Append one run of rows of a partition (`respell`: `needs_respelling` of its values); the number
    left out for having no LMDB key (misplaced)."""
    keys = rows.column(LMDB_KEY) if LMDB_KEY in rows.schema.names else db_keys(rows.column(KEY_TEXT))
    values = rows.column(VALUE_JSON)
    states = rows.column(LIVE_STATE) if LIVE_STATE in rows.schema.names else None
    missing = keys.null_count
    if missing:
        present = keys.is_valid()
        keys, values, respell = keys.filter(present), values.filter(present), respell.filter(present)
        states = None if states is None else states.filter(present)
    stored = compact_values(values, respell)
    if states is not None:
        stored = map(live_value, stored, states.to_pylist())
    # to_numpy(...).tolist(): the same bytes objects as to_pylist, in about 60% of its time.
    builder.add(zip(keys.to_numpy(zero_copy_only=False).tolist(), stored, strict=True))
    return missing


# Text in which some JSON token might not be spelled as `compact_value` spells it (a conservative test: it
# may match text that is, never miss one that is not): a backslash or a control character (escapes);
# 16 or more digits in a row, a fraction ending in 0 (other than "N.0"), an exponent, a plain fraction
# below 1e-4, NaN or Infinity, an integer -0 (numbers: any other float of at most 15 significant digits in
# plain notation is re-spelled exactly as written, since no other decimal of that precision stands for the
# same double); whitespace next to a structural character or at either end (Spark writes none). RE2
# syntax, as pyarrow's compute functions take it.
NEEDS_RESPELLING = (
    r"[\\\x00-\x1f]|[0-9.]{17,}|\.[0-9]*[0-9]0([^0-9]|$)|[0-9][eE]|0\.0000|NaN|Infinity|-0([^.0-9]|$)"
    r"|[\[{:,][ \t\r\n]|[ \t\r\n][\]},:]|^[ \t\r\n]|[ \t\r\n]$"
)


def needs_respelling(values: pa.Array) -> pa.BooleanArray:
    """Which JSON texts of `values` `NEEDS_RESPELLING` matches (null for a null text)."""
    return pc.match_substring_regex(values, NEEDS_RESPELLING)


def compact_values(values: pa.Array, respell: pa.BooleanArray | None = None) -> list[bytes]:
    """`compact_value` of every JSON text in `values` (Spark's `to_json` of each row's value), without
    parsing the texts that are already spelled that way: their UTF-8 bytes are the stored value as they are.
    Only the texts `NEEDS_RESPELLING` matches go through `compact_value` (`respell`: those matches, when
    already known: `needs_respelling(values)`)."""
    if respell is None:
        respell = needs_respelling(values)
    stored: list[bytes] = values.cast(pa.binary()).to_pylist()
    if respell.true_count:
        for index in pc.indices_nonzero(respell).to_pylist():
            stored[index] = compact_value(stored[index])
    return stored


def live_value(answer: bytes, state: str) -> bytes:
    """A live store's stored value (keyroute.core.live.encode_stored): the answer's compact JSON, NUL, and the
    merge state as a compact JSON list, from the state object Spark wrote (its fields in merge order)."""
    return answer + STATE_SEPARATOR + compact_json(list(json.loads(state).values()))


def _publish(builder: PartitionFileBuilder, partition: int, misplaced: int, destination: Destination) -> pa.RecordBatch:
    rows, checksum = destination.publish(builder, data_file(partition))
    return result_batch(partition, rows, checksum, misplaced)


def result_batch(partition: int, rows: int, checksum: Checksum, misplaced: int = 0) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict(
        {
            "partition": [partition],
            "rows": [rows],
            "bytes": [checksum.size],
            "checksum": [checksum.value],
            "misplaced": [misplaced],
        },
        schema=RESULT_SCHEMA,
    )
