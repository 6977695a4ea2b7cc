"""Writing one computed store as a new snapshot version, in keyroute.storage.snapshot's layout.

A version is claimed first (never overwritten, never shared with another build), filled by Spark, and
sealed by the manifest, written last by the driver. Whatever fails in between, the version is removed again.

Where: `output` is a local path, a file:// URI, or any URI a pyarrow filesystem writes (s3://, gs://,
hdfs://; s3a:// as s3://), with credentials from the usual environment variables.

Claiming a version:
    local path    mkdir of the version directory: atomic, a second builder gets FileExistsError.
    pyarrow URI   object stores have no atomic mkdir, and pyarrow offers no create-if-absent write (no S3
                  `If-None-Match: *`); so a builder writes its own marker `_claim-{token}.json` into the version
                  directory and lists the directory, and decides by one rule that at most one builder wins:
                    - its marker alone (files still being moved into place aside): it owns the version;
                    - any other entry that is not a marker, a lower marker (by name), or a marker its builder
                      has marked as won: it withdraws (removes its marker) and tries the next number;
                    - otherwise (its marker is the lowest of several): it lists again until the others have
                      withdrawn, and gives up like a loser after _CLAIM_WAIT_S.
                  Only a builder whose listing showed its marker alone wins, and a winner's marker stays, so on
                  a store whose writes and listings are strongly consistent (S3 since December 2020, GCS, Azure
                  Blob, HDFS, MinIO) two builders cannot both win: each would have listed before the other
                  wrote. And colliding builders cannot all lose for ever (as when every builder that saw
                  another gave up and left its marker behind): the lowest marker waits while the others
                  withdraw, so each collision has a winner. The winner's marker stays as a record of the
                  build that wrote it. The ZooKeeper publish (keyroute.pipeline.publish) is a separate
                  compare-and-set on the store record, so two builds never publish over each other either.

Format 2 (the default, `snapshot_format = 2`): the rows are shuffled so that each store partition's rows
are in one Spark task, sorted there by their LMDB key, and every task builds, checksums and publishes the
LMDB file of each of its partitions (keyroute.pipeline.lmdb_files: values of scalar fields reach it as their
struct and it spells their JSON, other values as Spark's JSON text); the driver writes the empty
partitions' files and the manifest. Format 1 (`snapshot_format = 1`, local outputs only): Spark's JSON
writer, one JSON-lines file per non-empty partition.

Live stores are always format 2: their values carry the merge state beside the answer, and the manifest
says which topic the version follows from which offsets (`live`). A live store without a source gets an
empty version (`write_empty_version`): every partition's file is the empty LMDB file, no Spark job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import socket
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from keyroute.pipeline import lmdb_files
from keyroute.pipeline.columns import LMDB_KEY, STATE
from keyroute.pipeline.compute import ComputedStore
from keyroute.pipeline.errors import PublishError
from keyroute.pipeline.keys import TEXT_SERIALIZED, lmdb_key_column, text_lmdb_key_column
from keyroute.pipeline.spark_errors import spark_errors
from keyroute.pipeline.spec import StoreSpec
from keyroute.pipeline.timeline import TEXT, TIME
from keyroute.storage.live import LiveConfig
from keyroute.storage.lmdb_layout import LMDB_MAX_KEY_BYTES, build_partition_file
from keyroute.storage.snapshot import (
    FORMAT_1,
    FORMAT_2,
    ArrowLocation,
    Manifest,
    SnapshotError,
    data_file,
    existing_versions,
    file_sizes,
    is_local,
    partition_dir,
    resolve_location,
    version_uri,
    write_manifest,
)
from keyroute.storage.timeline import INT64_MIN, StoreKind, Timeline

# A builder's claim on a version directory on a pyarrow filesystem (see the module docstring).
CLAIM_PREFIX = "_claim-"
# How many version numbers a build tries before giving up (each one taken by a concurrent build).
_CLAIM_ATTEMPTS = 20
# How long the builder with the lowest of several markers waits for the others to withdraw theirs (they do
# within one listing each), and how often it lists again meanwhile.
_CLAIM_WAIT_S = 10.0
_CLAIM_POLL_S = 0.02


@dataclass(frozen=True, slots=True)
class WrittenVersion:
    """A complete snapshot version (manifest written), not yet published.

    `snapshot` is where nodes read it: the absolute local path, or the URI under the output.
    """

    store: str
    version: int
    snapshot: str | Path
    manifest: Manifest


@dataclass(frozen=True, slots=True)
class ClaimedVersion:
    """A version directory this build owns: created (locally) or marked (on a pyarrow filesystem), empty."""

    store: str
    version: int
    snapshot: str  # the version's location as published: an absolute local path or a URI
    location: Path | ArrowLocation


class VersionTaken(PublishError):
    """The version directory exists already, or another build claimed it at the same moment."""


def next_version(output: str, store: str, published: int | None) -> int:
    """One past every version under the output and the one published in ZooKeeper, so numbers never repeat."""
    try:
        on_disk = existing_versions(output, store)
    except (SnapshotError, OSError) as exc:
        raise PublishError(store, f"cannot list versions under output {output!r}: {exc}") from exc
    return max([*on_disk, published or 0]) + 1


def version_snapshot(output: str, store: str, version: int) -> str:
    """Where one version lives, as published: the absolute local path, or the URI under the output."""
    try:
        location = version_uri(output, store, version)
        return str(Path(location).resolve()) if is_local(output) else location
    except SnapshotError as exc:
        raise PublishError(store, str(exc)) from exc


def claim_version(output: str, store: str, version: int) -> ClaimedVersion:
    """Claim `version` of `store` under `output` for this build; VersionTaken if it is anyone else's."""
    snapshot = version_snapshot(output, store, version)
    try:
        location = resolve_location(snapshot)
    except SnapshotError as exc:
        raise PublishError(store, str(exc)) from exc
    claimed = ClaimedVersion(store, version, snapshot, location)
    if isinstance(location, Path):
        try:
            location.parent.mkdir(parents=True, exist_ok=True)
            location.mkdir()
        except FileExistsError:
            raise VersionTaken(
                store, f"version directory {location} already exists (versions are never overwritten)"
            ) from None
        except OSError as exc:
            raise PublishError(store, f"cannot create version directory {location}: {exc}") from exc
        return claimed
    taken = VersionTaken(store, f"version {version} at {snapshot} is taken (versions are never overwritten)")
    try:
        if location.exists():
            raise taken
        marker = f"{CLAIM_PREFIX}{uuid.uuid4().hex}.json"
        location.write_bytes(marker, _claim_record(store, version))
        won = _decide_claim(location, marker)
        if won:
            # Said in the marker itself, so that a builder waiting on it gives up at once.
            location.write_bytes(marker, _claim_record(store, version, won=True))
        else:
            location.filesystem.delete_file(location.child(marker))
    except OSError as exc:
        raise PublishError(store, f"cannot claim version {version} at {snapshot}: {exc}") from exc
    if not won:
        raise taken
    return claimed


def _decide_claim(location: ArrowLocation, marker: str) -> bool:
    """Whether this builder, having written `marker`, owns the version (the rule in the module docstring)."""
    deadline = time.monotonic() + _CLAIM_WAIT_S
    while True:
        # A name with ".tmp-" is a file still being written and moved into place: not there yet.
        others = [name for name, _ in location.names() if name != marker and ".tmp-" not in name]
        if not others:
            return True
        if any(not name.startswith(CLAIM_PREFIX) or name < marker for name in others):
            return False
        if any(_marked_won(location, name) for name in others) or time.monotonic() >= deadline:
            return False
        time.sleep(_CLAIM_POLL_S)


def _marked_won(location: ArrowLocation, marker: str) -> bool:
    """Whether another builder's marker says it won (False if it is gone or unreadable: it withdrew)."""
    try:
        return json.loads(location.read_bytes(marker)).get("won") is True
    except (OSError, ValueError, AttributeError):
        return False


def claim_next_version(output: str, store: str, published: int | None) -> ClaimedVersion:
    """Claim the next free version of `store` (see `next_version`), trying later numbers while concurrent
    builds take them."""
    version = next_version(output, store, published)
    for _ in range(_CLAIM_ATTEMPTS):
        try:
            return claim_version(output, store, version)
        except VersionTaken:
            version = max(version + 1, next_version(output, store, published))
    raise PublishError(store, f"no free version under {output!r} after {_CLAIM_ATTEMPTS} attempts")


def _claim_record(store: str, version: int, won: bool = False) -> bytes:
    record = {"store": store, "version": version, "host": socket.gethostname(), "pid": os.getpid(), "at": time.time()}
    if won:
        record["won"] = True
    return json.dumps(record, sort_keys=True).encode("utf-8")


@contextlib.contextmanager
def _removed_on_failure(store: str, claimed: ClaimedVersion) -> Iterator[None]:
    """Remove the `claimed` version again on any failure inside; an OSError or SnapshotError becomes a
    PublishError naming the version."""
    try:
        try:
            yield
        except (OSError, SnapshotError) as exc:
            problem = f"writing version {claimed.version} to {claimed.snapshot} failed: {exc}"
            raise PublishError(store, problem) from exc
    except BaseException:
        remove_version(claimed.location)
        raise


def write_version(computed: ComputedStore, claimed: ClaimedVersion, live: LiveConfig | None = None) -> WrittenVersion:
    """Write `computed` into the version `claimed` for it (a live store's with `live` in its manifest); on
    any failure the version is removed again."""
    store = computed.spec
    with _removed_on_failure(store.name, claimed):
        if store.snapshot_format == 1:
            manifest = _write_format_1(computed, claimed)
        else:
            manifest = dataclasses.replace(_write_format_2(computed, claimed), live=live)
        write_manifest(claimed.location, manifest)  # last: until now, readers see an incomplete version
    return WrittenVersion(store=store.name, version=claimed.version, snapshot=claimed.snapshot, manifest=manifest)


def write_empty_version(
    store: StoreSpec,
    claimed: ClaimedVersion,
    live: LiveConfig,
    value_columns: tuple[str, ...],
    timeline: Timeline | None = None,
) -> WrittenVersion:
    """A version of a live store without a source: no rows, every partition's file the empty LMDB file,
    put in place and checksummed as any partition file; `live.offsets` says where nodes start applying."""
    with _removed_on_failure(store.name, claimed):
        written = _write_empty(claimed, list(range(store.partitions)))
        _check_sizes(store.name, claimed, {p: f.size for p, f in written.items()})
        files = _files_of(written, store.partitions)
        rows = (0,) * store.partitions
        manifest = _manifest(store, claimed.version, value_columns, rows, timeline, live=live, **files)
        write_manifest(claimed.location, manifest)
    return WrittenVersion(store=store.name, version=claimed.version, snapshot=claimed.snapshot, manifest=manifest)


def remove_version(snapshot: str | Path | ArrowLocation) -> None:
    """Delete a version this build created and did not publish (a local directory or a pyarrow location)."""
    try:
        where = resolve_location(snapshot)
    except SnapshotError:
        return
    if isinstance(where, Path):
        shutil.rmtree(where, ignore_errors=True)
        return
    with contextlib.suppress(OSError):
        where.delete()


def _manifest(
    store: StoreSpec,
    version: int,
    value_columns: tuple[str, ...],
    rows: tuple[int, ...],
    timeline: Timeline | None,
    **fields: object,
) -> Manifest:
    """The manifest of `version` of `store`, made now; `fields`: the format's own (and a live store's)."""
    return Manifest(
        store=store.name,
        version=version,
        partitions=store.partitions,
        partitioner=store.partitioner,
        key_format=store.key_format,
        value_columns=value_columns,
        rows=rows,
        created_at=time.time(),
        timeline=timeline,
        key_schema=store.key_schema,
        **fields,  # type: ignore[arg-type]
    )


def _computed_manifest(computed: ComputedStore, version: int, **fields: object) -> Manifest:
    # The rows are counted from the cached frame while checking its keys.
    rows = computed.partition_rows
    return _manifest(computed.spec, version, computed.value_columns, rows, computed.timeline, **fields)


def _files_of(written: Mapping[int, _PartitionFile], count: int) -> dict[str, object]:
    """A format-2 manifest's own fields, from the file of every partition (of `count`) as written."""
    partitions = range(count)
    return {
        "format": FORMAT_2,
        "files": {p: (data_file(p),) for p in partitions},
        "checksums": {p: written[p].checksum for p in partitions},
        "bytes": {p: written[p].size for p in partitions},
    }


# --- format 2: ready-to-serve LMDB files, built by the executors ----------------------------------------


@dataclass(frozen=True, slots=True)
class _PartitionFile:
    rows: int
    size: int
    checksum: str


def _write_format_2(computed: ComputedStore, claimed: ClaimedVersion) -> Manifest:
    store = computed.spec
    expected = computed.partition_rows
    written = _build_files(computed, claimed)
    problems = []
    for partition, result in sorted(written.items()):
        if not 0 <= partition < store.partitions:
            problems.append(f"partition {partition} is out of range")
        elif result.rows != expected[partition]:
            problems.append(f"partition {partition}: {result.rows} rows written, {expected[partition]} computed")
    problems += [f"partition {p}: no file for {n} rows" for p, n in enumerate(expected) if n and p not in written]
    if problems:
        raise PublishError(store.name, "the partition files do not hold the computed rows: " + "; ".join(problems[:5]))
    empty = [p for p in range(store.partitions) if p not in written]
    written.update(_write_empty(claimed, empty))
    _check_sizes(store.name, claimed, {p: f.size for p, f in written.items()})
    return _computed_manifest(computed, claimed.version, **_files_of(written, store.partitions))


def _build_files(computed: ComputedStore, claimed: ClaimedVersion) -> dict[int, _PartitionFile]:
    """Run the Spark job that builds and uploads every non-empty partition's file; what each task reported."""
    store = computed.spec
    task = lmdb_files.partition_task(claimed.snapshot)
    with spark_errors(store.name, f"writing the partition files of {claimed.snapshot}", PublishError):
        ordered = _ordered_rows(computed)
        with warnings.catch_warnings():
            # mapInArrow goes through pandas_udf's version check, which warns about pandas 3; no pandas is
            # involved (Arrow batches in and out), as in keyroute.pipeline.session.
            warnings.filterwarnings(
                "ignore", message="PySpark does not yet fully support pandas", category=FutureWarning
            )
            files = ordered.mapInArrow(task, lmdb_files.RESULT_DDL)
        with batches_sized_by_rows(computed.frame.sparkSession, computed.json_bytes):
            results = files.collect()
    written: dict[int, _PartitionFile] = {}
    misplaced = 0
    for row in results:
        partition = int(row["partition"])
        if partition in written:
            raise PublishError(store.name, f"partition {partition} was written by two tasks")
        written[partition] = _PartitionFile(int(row["rows"]), int(row["bytes"]), str(row["checksum"]))
        misplaced += int(row["misplaced"])
    if misplaced:
        raise PublishError(
            store.name,
            f"{misplaced} key(s) do not serialize to bytes that {store.partitioner.value} puts in their "
            "partition; nothing was published",
        )
    return written


def _ordered_rows(computed: ComputedStore) -> DataFrame:
    """The rows the write job's tasks get: (partition, LMDB key or key text, value JSON[, merge state]), every
    row of a store partition in one task, in LMDB key order there.

    Spark compares binary values as unsigned bytes, shorter first on a common prefix: LMDB's default order.
    It compares strings (of the binary collation) the same way, by their UTF-8 bytes, so the rows of a store
    whose LMDB keys are all `=` + the key text's UTF-8 (string and uuid keys, none too long for LMDB) are in
    LMDB key order once sorted by their key text: they are shuffled and sorted by it, and the tasks get the
    text (`lmdb_files.KEY_TEXT`) and tag it themselves, with one Arrow kernel per batch (making each LMDB key
    in the JVM, before the shuffle or after the sort, cost Spark about 0.1-0.2 s of CPU per 1,000,000 rows).
    Other rows are sorted by their LMDB key itself."""
    store = computed.spec
    partition, lmdb_key = lmdb_files.PARTITION, lmdb_files.LMDB_KEY
    if computed.timeline is not None:
        rows = _timeline_rows(computed)
        return rows.repartition(store.partitions, partition).sortWithinPartitions(partition, lmdb_key)
    # A live store's merge state, appended to each value on the executors (keyroute.storage.live's stored form).
    state = [F.col(STATE).alias(lmdb_files.LIVE_STATE)] if STATE in computed.frame.columns else []
    value = _value_column(computed.frame.schema["value"].dataType)
    if _sorted_by_key_text(computed):
        text = lmdb_files.KEY_TEXT
        by_text = computed.frame.select(F.col("partition").alias(partition), F.col("key").alias(text), value, *state)
        return by_text.repartition(store.partitions, partition).sortWithinPartitions(partition, text)
    rows = computed.frame.select(
        F.col("partition").alias(partition), _lmdb_key(computed).alias(lmdb_key), value, *state
    )
    return rows.repartition(store.partitions, partition).sortWithinPartitions(partition, lmdb_key)


def _value_column(value_type: T.DataType) -> Column:
    """How the value reaches the tasks: a struct whose JSON the tasks spell with Arrow's kernels (booleans,
    integers, doubles and strings, distinct names: lmdb_files.spelled_fields) as it is; any other value as
    Spark's JSON text (as format 1 writes it; made compact JSON on the executors). Spelling the struct costs
    the task less than `to_json` costs Spark (about 0.4 s of CPU per 1,000,000 rows of four fields) plus the
    respelling regex over its text."""
    if isinstance(value_type, T.StructType):
        fields = value_type.fields
        types = [_SPELLED_SPARK_TYPES.get(type(f.dataType)) for f in fields]
        plain_strings = all(f.dataType == T.StringType() for f in fields if isinstance(f.dataType, T.StringType))
        if plain_strings and lmdb_files.spelled_fields([f.name for f in fields], types):
            return F.col("value").alias(lmdb_files.VALUE_STRUCT)
    return F.to_json(F.col("value"), {"ignoreNullFields": "false"}).alias(lmdb_files.VALUE_JSON)


# Spark's types of the value fields tasks spell from the struct, and the Arrow types they arrive as (a string
# of the default collation only).
_SPELLED_SPARK_TYPES: dict[type[T.DataType], pa.DataType] = {
    T.BooleanType: pa.bool_(),
    T.ByteType: pa.int8(),
    T.ShortType: pa.int16(),
    T.IntegerType: pa.int32(),
    T.LongType: pa.int64(),
    T.DoubleType: pa.float64(),
    T.StringType: pa.string(),
}


def _sorted_by_key_text(computed: ComputedStore) -> bool:
    """Whether every row's LMDB key is `=` + its key text's UTF-8 and Spark orders the texts by those bytes:
    string or uuid keys, the longest (counted while checking the frame) short enough not to be hashed, in
    a string column of the binary collation."""
    return (
        computed.spec.key_format in TEXT_SERIALIZED
        and computed.key_bytes is not None
        and computed.key_bytes < LMDB_MAX_KEY_BYTES
        and computed.frame.schema["key"].dataType == T.StringType()
    )


# Spark's limits on the Arrow batches it feeds a Python task: rows, and bytes (Spark's byte-size syntax).
_ARROW_ROWS = "spark.sql.execution.arrow.maxRecordsPerBatch"
_ARROW_BYTES = "spark.sql.execution.arrow.maxBytesPerBatch"
_NO_BYTE_LIMIT = 2**31 - 1  # what Spark takes for "no byte limit" (it then never sizes a batch)
# A task's row besides its JSON text: the partition (int32), the longest LMDB key, three offsets (key, value,
# merge state) and validity bits, rounded up.
_ROW_BYTES = 4 + LMDB_MAX_KEY_BYTES + 3 * 4 + 8
_BYTE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}


@contextlib.contextmanager
def batches_sized_by_rows(spark: SparkSession, json_bytes: int | None) -> Iterator[None]:
    """Within the block, Spark feeds Python tasks batches limited by their number of rows alone: at most
    as many as fit in its byte limit at the greatest size a row of this store can have (`json_bytes` of
    JSON text, plus `_ROW_BYTES`). A batch is held to the same bytes as before, but Spark no longer sizes
    its Arrow vectors after every row it adds (with the byte limit on, it does, at a cost that was more
    than half of the time a task of 1,000,000 rows spent handing its rows to Python: 0.44 s against 0.19).
    Nothing changes when no such size is known, the byte limit is off, or a setting is not in a form read
    here. Spark reads the settings when the job starts; they are the session's, so they are set back at the
    end of the block (builds write their stores one at a time)."""
    conf = spark.conf
    rows_text, bytes_text = conf.get(_ARROW_ROWS), conf.get(_ARROW_BYTES)
    limit = spark_byte_size(bytes_text or "")
    try:
        rows = int(rows_text or "")
    except ValueError:
        rows = None
    if json_bytes is None or limit is None or rows is None or limit >= _NO_BYTE_LIMIT:
        yield
        return
    assert rows_text is not None and bytes_text is not None  # both read as numbers
    fit = max(1, limit // (json_bytes + _ROW_BYTES))
    conf.set(_ARROW_ROWS, str(fit if rows <= 0 else min(rows, fit)))
    conf.set(_ARROW_BYTES, str(_NO_BYTE_LIMIT))
    try:
        yield
    finally:
        conf.set(_ARROW_ROWS, rows_text)
        conf.set(_ARROW_BYTES, bytes_text)


def spark_byte_size(text: str) -> int | None:
    """Bytes of a Spark size setting ("67108864b", "64m", "1g", "1024"), or None when not of that form."""
    found = re.fullmatch(r"\s*(\d+)\s*([kmgtp]?)b?\s*", text.lower())
    return None if found is None else int(found.group(1)) * _BYTE_UNITS[found.group(2)]


def _timeline_rows(computed: ComputedStore) -> DataFrame:
    """A history or windowed store's entries, one row each: LMDB key = the key part the route computed +
    the entry's time + its sequence (keyroute.storage.timeline), value = its JSON."""
    if LMDB_KEY not in computed.frame.columns:
        raise PublishError(computed.spec.name, "a history or windowed store is routed by its partitioner only")
    part, index, entry = "__keyroute_key_part", "__keyroute_index", "__keyroute_entry"
    exploded = computed.frame.select(
        F.col("partition"), F.col(LMDB_KEY).alias(part), F.posexplode(F.col("value")).alias(index, entry)
    )
    flipped = F.col(f"{entry}.{TIME}").bitwiseXOR(F.lit(INT64_MIN))  # the sign bit flipped: negatives first
    # A history row's sequence is its index among the key's rows; a window is the only entry at its start
    # (sequence 0, where a live store folds its records into it).
    windowed = computed.timeline is not None and computed.timeline.kind is StoreKind.WINDOWED
    sequence = F.lit(0).cast(T.LongType()) if windowed else F.col(index).cast(T.LongType())
    return exploded.select(
        F.col("partition").alias(lmdb_files.PARTITION),
        F.concat(F.col(part), _big_endian(flipped, 8), _big_endian(sequence, 4)).alias(lmdb_files.LMDB_KEY),
        F.col(f"{entry}.{TEXT}").alias(lmdb_files.VALUE_JSON),
    )


def _big_endian(number: Column, width: int) -> Column:
    """The low `width` bytes of an int64 column, big-endian (Spark's hex of a long is its two's complement)."""
    return F.unhex(F.substring(F.lpad(F.hex(number), 16, "0"), 17 - 2 * width, 2 * width))


def _lmdb_key(computed: ComputedStore) -> Column:
    """Every row's LMDB key, from the bytes its partition was computed from: string and uuid keys' text is
    those bytes (the JVM tags them); other keys' LMDB key came with the route, or (only when a benchmark
    routes without the partitioner) is serialized again here by a Python UDF."""
    store = computed.spec
    if store.key_format in TEXT_SERIALIZED:
        return text_lmdb_key_column(F.col("key"))
    if LMDB_KEY in computed.frame.columns:
        return F.col(LMDB_KEY)
    return lmdb_key_column(store, F.col("key"), F.col("partition"))


def _write_empty(claimed: ClaimedVersion, partitions: list[int]) -> dict[int, _PartitionFile]:
    """The file of every empty partition: one empty LMDB file, built here and put in place for each."""
    if not partitions:
        return {}
    destination = lmdb_files.Destination(claimed.snapshot)
    with tempfile.TemporaryDirectory(prefix="keyroute-empty-") as scratch:
        built = build_partition_file([], Path(scratch))
        result = {}
        for partition in partitions:
            checksum = destination.put(built.path, data_file(partition))
            result[partition] = _PartitionFile(0, checksum.size, checksum.value)
    return result


def _check_sizes(store: str, claimed: ClaimedVersion, sizes: Mapping[int, int]) -> None:
    """Every partition file is in place with the size its writer reported (one listing on a pyarrow
    filesystem): a file missing, or replaced since, fails the build before the manifest is written."""
    found = file_sizes(claimed.location)
    wrong = []
    for partition, size in sorted(sizes.items()):
        actual = found.get(data_file(partition))
        if actual != size:
            found_as = "missing" if actual is None else f"{actual} bytes"
            wrong.append(f"{data_file(partition)}: {found_as}, expected {size}")
    if wrong:
        raise PublishError(
            store, f"partition files at {claimed.snapshot} differ from what was written: " + "; ".join(wrong[:5])
        )


# --- format 1: JSON lines, by Spark's writer (local outputs only) -----------------------------------------


def _write_format_1(computed: ComputedStore, claimed: ClaimedVersion) -> Manifest:
    store = computed.spec
    target = claimed.location
    if not isinstance(target, Path):
        raise PublishError(store.name, f"snapshot_format 1 is written to local paths only, not {claimed.snapshot}")
    with spark_errors(store.name, f"writing {target}", PublishError):
        rows = computed.frame.select("key", "value", "partition")
        # All rows of a partition go to one task, so each partition directory gets exactly one file.
        # Sorting by (partition, key) satisfies the ordering the partitioned writer needs, so Spark adds
        # no sort of its own that could disturb the key order inside a file.
        (
            rows.repartition(store.partitions, "partition")
            .sortWithinPartitions("partition", "key")
            .write.mode("append")  # into the empty directory claimed
            .partitionBy("partition")
            .option("ignoreNullFields", False)  # a null value column stays in the value as null
            .option("maxRecordsPerFile", 0)
            # Spark takes a path string literally (no percent-decoding), unlike Path.as_uri().
            .json("file://" + target.as_posix())
        )
    files = {p: _partition_files(target, p) for p in range(store.partitions)}
    for partition, count in enumerate(computed.partition_rows):
        if count and not files[partition]:
            raise PublishError(store.name, f"Spark wrote no file for partition {partition} ({count} rows)")
    return _computed_manifest(computed, claimed.version, format=FORMAT_1, files=files)


def _partition_files(target: Path, partition: int) -> tuple[str, ...]:
    folder = partition_dir(target, partition)
    return tuple(sorted(path.relative_to(target).as_posix() for path in folder.glob("part-*")))
