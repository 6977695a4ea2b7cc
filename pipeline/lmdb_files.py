"""Snapshot format 2 on Spark's executors: each task turns its sorted rows into ready-to-serve partition files.

A task receives Arrow batches of (partition, LMDB key, value[, a live store's merge state as JSON text]),
sorted by partition and then by LMDB key, all rows of a store partition in the same task (a store whose
LMDB keys are all the `=` tag and the key text's UTF-8 sends the key text instead, and the task tags it; a
value that is a struct of booleans, integers, doubles and strings comes as that struct, and the task spells
its JSON; any other value comes as Spark's JSON text: keyroute.pipeline.writer._ordered_rows). For
every store partition it meets it builds the LMDB file (keyroute.storage.lmdb_layout: appended in key order,
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
import math
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy
import pyarrow as pa
import pyarrow.compute as pc

from keyroute.pipeline import columns
from keyroute.storage.live import STATE_SEPARATOR
from keyroute.storage.lmdb_layout import PartitionFileBuilder, db_keys
from keyroute.storage.snapshot import (
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

# The columns a task reads (internal names, as in keyroute.pipeline.columns).
PARTITION = "partition"
LMDB_KEY = columns.LMDB_KEY
# In place of LMDB_KEY, when every row's LMDB key is the `=` tag and its key text's UTF-8 (db_keys makes it).
KEY_TEXT = "__keyroute_key_text"
VALUE_JSON = "__keyroute_value_json"
# In place of VALUE_JSON, for a value whose fields `spelled_fields` accepts: the value itself, a struct.
VALUE_STRUCT = "__keyroute_value"
# Live stores whose fold keeps a merge state: {"0": s0, "1": s1, ...} (keyroute.pipeline.reduce.live_state).
LIVE_STATE = columns.STATE
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
        for batch, spelled in _spelled(batches):
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
                misplaced += _add(builder, batch.slice(start, end - start), spelled.slice(start, end - start))
                start = end
        if builder is not None:
            yield _publish(builder, current, misplaced, destination)
            builder = None
    finally:
        if builder is not None:
            builder.discard()


@dataclass(frozen=True, slots=True)
class SpelledValues:
    """Rows' stored values (`compact_value` of their JSON, as format 1's reader makes them), as Arrow texts:
    `texts` holds them, but for the rows `redo` marks, which are spelled from `source` one by one.

    From Spark's JSON text (VALUE_JSON): the texts themselves, redone where `NEEDS_RESPELLING` matches. From
    the value struct (VALUE_STRUCT): `struct_texts`, redone where it cannot vouch for a field."""

    texts: pa.Array  # string or binary, one per row
    redo: pa.BooleanArray
    source: pa.Array  # the VALUE_JSON texts or the VALUE_STRUCT structs

    def slice(self, start: int, length: int) -> SpelledValues:
        return SpelledValues(
            self.texts.slice(start, length), self.redo.slice(start, length), self.source.slice(start, length)
        )

    def filter(self, keep: pa.BooleanArray) -> SpelledValues:
        return SpelledValues(self.texts.filter(keep), self.redo.filter(keep), self.source.filter(keep))

    def stored(self) -> list[bytes]:
        stored: list[bytes] = self.texts.cast(_binary_like(self.texts.type)).to_pylist()
        if self.redo.true_count:
            indices = pc.indices_nonzero(self.redo)
            picked = self.source.take(indices)
            if pa.types.is_struct(picked.type):
                redone = struct_values(picked)
            else:
                redone = [compact_value(text) for text in picked.cast(_binary_like(picked.type)).to_pylist()]
            for index, value in zip(indices.to_pylist(), redone, strict=True):
                stored[index] = value
        return stored


def _binary_like(data_type: pa.DataType) -> pa.DataType:
    """The binary type a text column is cast to for its bytes (a large one for large strings)."""
    large = pa.types.is_large_string(data_type) or pa.types.is_large_binary(data_type)
    return pa.large_binary() if large else pa.binary()


def spell_values(batch: pa.RecordBatch) -> SpelledValues:
    """The stored values of a batch's rows, from its VALUE_STRUCT column when it has one, else from VALUE_JSON."""
    if VALUE_STRUCT in batch.schema.names:
        structs = batch.column(VALUE_STRUCT)
        texts, redo = struct_texts(structs)
        return SpelledValues(texts, redo, structs)
    values = batch.column(VALUE_JSON)
    return SpelledValues(values, needs_respelling(values), values)


def _spelled(batches: Iterator[pa.RecordBatch]) -> Iterator[tuple[pa.RecordBatch, SpelledValues]]:
    """Every non-empty batch with `spell_values` of it. In the task's own thread: spelling in a second
    thread, a batch ahead, was slower (its two dozen kernel calls a batch contend for the GIL with
    putmulti, which releases and retakes it around every put)."""
    for batch in batches:
        if batch.num_rows:
            yield batch, spell_values(batch)


def _add(builder: PartitionFileBuilder, rows: pa.RecordBatch, spelled: SpelledValues) -> int:
    """Append one run of rows of a partition (`spelled`: its values); the number left out for having no
    LMDB key (misplaced)."""
    keys = rows.column(LMDB_KEY) if LMDB_KEY in rows.schema.names else db_keys(rows.column(KEY_TEXT))
    states = rows.column(LIVE_STATE) if LIVE_STATE in rows.schema.names else None
    missing = keys.null_count
    if missing:
        present = keys.is_valid()
        keys, spelled = keys.filter(present), spelled.filter(present)
        states = None if states is None else states.filter(present)
    stored: Iterable[bytes] = spelled.stored()
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
    return SpelledValues(values, respell, values).stored()


# --- values handed over as their struct: JSON spelled by Arrow's kernels ------------------------------------
#
# What a node makes of format 1's row is `compact_value` of Spark's `to_json` of the value: json.loads of
# Spark's text, dumped compactly. For a struct of scalar fields with distinct names that is, field by field
# in the struct's order, `"name":` (the name as json.dumps spells it) and the field's value:
#   boolean, integer   Spark's and Python's spelling agree: Arrow's cast to string spells them the same way.
#   double             Spark writes a decimal that reads back as the same double (Java's Double.toString,
#                      not always the shortest before Java 19), so Python writes repr(x): the shortest
#                      digits, in plain notation from 1e-4 up to 1e16 with at least one digit after the
#                      point, else d.ddde[+-]XX. Arrow's cast writes the same shortest digits; where it uses
#                      plain notation and the double is in Python's plain range, the text is the same but
#                      for a missing ".0", added here; other doubles are redone. NaN and the infinities,
#                      which Spark writes as the strings "NaN", "Infinity", "-Infinity", too.
#   string             "text" when the text has nothing Python escapes (", \, control characters) and is
#                      valid UTF-8; other strings are redone (Spark decodes invalid UTF-8 with U+FFFD).
#   null               null.
# Float, decimal, date, timestamp and binary fields, nested values and repeated names are not spelled here
# (their text depends on Java's formatting): such values come as Spark's JSON text.

# Arrow types of the fields `struct_texts` spells (Spark's boolean, byte, short, int, long, double, string).
# Strings come as `large_string` when Spark's spark.sql.execution.arrow.useLargeVarTypes is on.
_SPELLED_TYPES = (
    pa.bool_(), pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.float64(), pa.string(), pa.large_string()
)  # fmt: skip
# What Python escapes in a string (json.dumps with ensure_ascii=False), RE2 syntax.
_ESCAPED = r'["\\\x00-\x1f]'
# Spark's JSON for a double that is not finite: a string.
_NOT_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def spelled_fields(names: list[str], types: list[pa.DataType | None]) -> bool:
    """Whether `struct_texts` spells a struct of these fields: at least one, distinct names, each of a type
    in `_SPELLED_TYPES`."""
    return bool(names) and len(set(names)) == len(names) and all(t in _SPELLED_TYPES for t in types)


def struct_texts(structs: pa.Array) -> tuple[pa.Array, pa.BooleanArray]:
    """The stored value's text of every struct (see above), and which rows must be redone by
    `struct_values` instead (a null struct, a field the kernels cannot vouch for). Each field's text is
    made whole first (`"name":` put in front by one slice kernel, cheaper than one more piece to join),
    then the fields are joined."""
    fields = list(structs.type)
    if not spelled_fields([f.name for f in fields], [f.type for f in fields]):
        raise SnapshotError(f"values of type {structs.type} are not spelled from their struct")
    texts: list[pa.Array] = []
    redo: list[pa.Array] = [structs.is_null()] if structs.null_count else []
    for index, field in enumerate(fields):
        child = structs.field(index)
        unsure: pa.Array | None = None
        if is_text(field.type):
            text, unsure = _string_texts(child)
        elif field.type == pa.float64():
            text, unsure = _double_texts(child)
        else:
            text = pc.cast(child, pa.string())
        if child.null_count:
            text = pc.fill_null(text, "null")
        text = _prepend(text, ("{" if index == 0 else ",") + json.dumps(field.name, ensure_ascii=False) + ":")
        texts.append(_append(text, "}") if index == len(fields) - 1 else text)
        if unsure is not None:
            redo.append(unsure)
    if any(pa.types.is_large_string(text.type) for text in texts):  # join one type: the large one
        texts = [text.cast(pa.large_string()) for text in texts]
    joined = texts[0] if len(texts) == 1 else pc.binary_join_element_wise(*texts, pa.scalar("", texts[0].type))
    if not redo:
        return joined, pa.nulls(len(structs), pa.bool_()).fill_null(False)
    marked = redo[0]
    for more in redo[1:]:
        marked = pc.or_(marked, more)
    return joined, marked


def _prepend(texts: pa.Array, prefix: str) -> pa.Array:
    return pc.binary_replace_slice(texts, 0, 0, prefix)


def _append(texts: pa.Array, suffix: str) -> pa.Array:
    return pc.binary_replace_slice(texts, _PAST_THE_END, _PAST_THE_END, suffix)


_PAST_THE_END = 2**31 - 1  # a slice start beyond any string's end: the end


def _may_escape(data: pa.Buffer | None) -> bool:
    """Whether some byte of `data` is one `_ESCAPED` matches (a control character, '"', '\\'): a
    vectorized minimum and two memchr scans, a few milliseconds per 10 MB."""
    if data is None or not data.size:
        return False
    raw = data.to_pybytes()
    return int(numpy.frombuffer(raw, dtype=numpy.uint8).min()) < 0x20 or b'"' in raw or b"\\" in raw


def _string_texts(child: pa.Array) -> tuple[pa.Array, pa.Array | None]:
    """`"text"` of every string, and which ones must be redone (Python escapes something in them, or they
    are not UTF-8); None when none must. One look at all of the batch's string bytes first: in most
    batches no string has anything escaped, and the regex per string is not run."""
    unsure = None
    if _may_escape(child.buffers()[2]):
        unsure = pc.fill_null(pc.match_substring_regex(child, _ESCAPED), False)
    try:
        child.validate(full=True)  # UTF-8 included
    except pa.ArrowInvalid:
        invalid = pa.array([not _is_utf8(b) for b in child.cast(pa.large_binary()).to_pylist()])
        unsure = invalid if unsure is None else pc.or_(unsure, invalid)
    return _append(_prepend(child, '"'), '"'), unsure


def _is_utf8(data: bytes | None) -> bool:
    if data is None:
        return True
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _double_texts(child: pa.Array) -> tuple[pa.Array, pa.Array]:
    text = pc.cast(child, pa.string())
    size = pc.abs(child)
    plain = pc.or_(pc.equal(size, 0.0), pc.and_(pc.greater_equal(size, 1e-4), pc.less(size, 1e16)))
    # Not finite, outside Python's plain range, or in Arrow's exponent notation: redone.
    unsure = pc.fill_null(pc.or_(pc.invert(plain), pc.match_substring(text, "e")), False)
    pointed = pc.match_substring(text, ".")
    if pc.any(pc.invert(pointed)).as_py():
        text = pc.if_else(pointed, text, _append(text, ".0"))
    return text, unsure


def struct_values(structs: pa.Array) -> list[bytes]:
    """The stored value of every struct, one by one in Python: `compact_json` of the fields as json.loads
    reads Spark's JSON of them (a null struct: null)."""
    names = [field.name for field in structs.type]
    columns = [_python_values(structs.field(i)) for i in range(len(names))]
    valid = structs.is_valid().to_pylist()
    return [
        compact_json(dict(zip(names, (column[row] for column in columns), strict=True))) if ok else b"null"
        for row, ok in enumerate(valid)
    ]


def is_text(data_type: pa.DataType) -> bool:
    """Whether an Arrow type is a string type (string or large_string)."""
    return bool(pa.types.is_string(data_type) or pa.types.is_large_string(data_type))


def _python_values(child: pa.Array) -> list[Any]:
    if is_text(child.type):
        raw = child.cast(pa.large_binary() if pa.types.is_large_string(child.type) else pa.binary())
        return [None if b is None else b.decode("utf-8", "replace") for b in raw.to_pylist()]
    values = child.to_pylist()
    if child.type == pa.float64():
        return [_NOT_FINITE.get(repr(v), v) if isinstance(v, float) and not math.isfinite(v) else v for v in values]
    return values


def live_value(answer: bytes, state: str) -> bytes:
    """A live store's stored value (keyroute.storage.live.encode_stored): the answer's compact JSON, NUL, and the
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
