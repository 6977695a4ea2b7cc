"""The snapshot format: one immutable directory per store version, readable without Spark.

Format 1 ("keyroute-snapshot/1", JSON lines; nodes parse, hash and put every row):
    {output}/{store}/v{version:06d}/partition={p}/part-*.json   JSON lines {"key": text, "value": {...}},
                                                                 sorted by key within the partition
Format 2 ("keyroute-snapshot/2", ready to serve; nodes move the bytes):
    {output}/{store}/v{version:06d}/partition={p}/data.mdb      one compacted LMDB data file per partition,
                                                                 empty partitions included; its layout
                                                                 (keys, values) is keyroute.storage.lmdb_layout
Both:
    {output}/{store}/v{version:06d}/manifest.json                written last: a version without a
                                                                 manifest is incomplete and never served;
                                                                 format 2's also holds each file's size
                                                                 and checksum ("<algorithm>:<hex>")

Reading takes a location: a local path or file:// URI (read with plain file I/O), or any URI a pyarrow
filesystem understands (s3://, gs://, hdfs://, abfs://, ...; s3a:// and s3n:// as Hadoop writes them are
read as s3://). Writing a version's manifest and listing versions work on the same locations.

Checksums: `Checksum` (streaming, chunk by chunk) and `checksum_file` are the one implementation both the
pipeline (while uploading a file) and nodes (while fetching it) use. CHECKSUM_ALGORITHM is what the
pipeline writes: zlib's CRC-32, measured fastest of sha256, blake2b and crc32 (about 2.6 GB/s against
sha256's 1.5 GB/s and blake2b's 0.66 GB/s on 500 MB, a copy alone running at 2.5 to 3.9 GB/s); the size is
checked beside it, so a truncated file never passes, and a CRC-32 catches every burst of up to 32 bits and
any other accidental change but one in 2**32. It guards against accidents (a torn upload, a bad disk),
not against someone forging a file: whoever can write the snapshot can also write its manifest.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import json
import os
import re
import time
import zlib
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload
from urllib.parse import unquote, urlparse

from keyroute.keys.key_format import KeyFormat
from keyroute.keys.key_schema import KeySchema
from keyroute.keys.partitioner import Partitioner
from keyroute.storage.live import LiveConfig
from keyroute.storage.timeline import Timeline, TimelineError

FORMAT_1 = "keyroute-snapshot/1"
FORMAT_2 = "keyroute-snapshot/2"
FORMATS = (FORMAT_1, FORMAT_2)
# The format a Manifest has unless it says otherwise (every manifest written before format 2 existed).
FORMAT = FORMAT_1
_VERSION_DIR = re.compile(r"v[0-9]+")
MANIFEST = "manifest.json"
# Format 2: the one file of each partition, in its partition directory.
DATA_FILE = "data.mdb"
# What the pipeline writes (see the module docstring); `Checksum` also verifies the others named here.
CHECKSUM_ALGORITHM = "crc32"
CHECKSUM_ALGORITHMS = ("crc32", "sha256", "blake2b")
CHECKSUM_CHUNK_BYTES = 4 << 20
# Hadoop's names for object stores that pyarrow knows under another scheme (same bucket, same keys).
_ARROW_SCHEME_ALIASES = {"s3a": "s3", "s3n": "s3"}
_READ_CHUNK_BYTES = 1 << 20
# pyarrow filesystems (`type_name`) where a single write appears whole and there is no rename.
_OBJECT_STORES = frozenset({"s3", "gcs"})


class SnapshotError(Exception):
    """A snapshot is missing, incomplete, or does not match its manifest."""


def local_path(location: str) -> Path:
    """The filesystem path behind a snapshot location (a path or a file:// URI)."""
    parsed = urlparse(location)
    if parsed.scheme in ("", "file"):
        return Path(unquote(parsed.path) if parsed.scheme else location)
    raise SnapshotError(
        f"snapshot location {location!r}: nodes read snapshots from a filesystem path or file:// URI "
        "(mount shared storage on the nodes)"
    )


def is_local(location: str | Path) -> bool:
    """True for a Path, a plain path string or a file:// URI: read with plain file I/O."""
    return isinstance(location, Path) or urlparse(location).scheme in ("", "file")


@dataclass(frozen=True, slots=True)
class ArrowLocation:
    """A snapshot version directory on a pyarrow filesystem (`path` in that filesystem's own syntax).

    Built from a URI by `from_uri`; tests and callers holding a filesystem already (a SubTreeFileSystem,
    a mock) construct it directly.
    """

    filesystem: Any  # pyarrow.fs.FileSystem; typed loosely so that the core imports pyarrow only on use
    path: str
    uri: str = ""

    @classmethod
    def from_uri(cls, uri: str) -> ArrowLocation:
        scheme, sep, rest = uri.partition("://")
        target = f"{_ARROW_SCHEME_ALIASES.get(scheme.lower(), scheme)}{sep}{rest}" if sep else uri
        try:
            filesystem, path = _arrow_from_uri(target)
        except (ValueError, OSError, ImportError) as exc:
            raise SnapshotError(f"snapshot location {uri!r}: no filesystem can read it ({exc})") from exc
        return cls(filesystem=filesystem, path=path.rstrip("/") or path, uri=uri)

    def child(self, name: str) -> str:
        """The filesystem path of `name` (a relative, '/'-separated path) inside this directory."""
        return f"{self.path.rstrip('/')}/{name}" if self.path else name

    def describe(self, name: str = "") -> str:
        """How to name this location (or a file in it) in a message."""
        base = self.uri.rstrip("/") if self.uri else f"{type(self.filesystem).__name__}:{self.path}"
        return f"{base}/{name}" if name else base

    def read_bytes(self, name: str) -> bytes:
        with self.filesystem.open_input_stream(self.child(name), compression=None) as stream:
            return bytes(stream.read())

    @property
    def is_object_store(self) -> bool:
        """An object store: no directories to create, a single write appears whole, no rename."""
        return str(getattr(self.filesystem, "type_name", "")) in _OBJECT_STORES

    def write_bytes(self, name: str, data: bytes) -> None:
        """Write a whole file so that readers see all of it or none: one object on an object store, else a
        temporary file moved into place."""
        target = self.child(name)
        if self.is_object_store:
            with self.filesystem.open_output_stream(target, compression=None) as out:
                out.write(data)
            return
        parent = target.rsplit("/", 1)[0] if "/" in target else ""
        if parent:
            self.filesystem.create_dir(parent, recursive=True)
        tmp = f"{target}.tmp-{os.getpid()}-{time.monotonic_ns()}"
        try:
            with self.filesystem.open_output_stream(tmp, compression=None) as out:
                out.write(data)
            self.filesystem.move(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                self.filesystem.delete_file(tmp)
            raise

    def names(self, folder: str = "") -> list[tuple[str, bool]]:
        """(name, is a directory) of every entry directly in `folder` (relative), sorted; [] if none."""
        from pyarrow import fs as arrow_fs

        path = self.child(folder) if folder else self.path
        selector = arrow_fs.FileSelector(path, allow_not_found=True)
        infos = self.filesystem.get_file_info(selector)
        return sorted((info.base_name, info.type == arrow_fs.FileType.Directory) for info in infos)

    def exists(self) -> bool:
        """Whether anything is at this location (a file, a directory, or objects under the prefix)."""
        from pyarrow import fs as arrow_fs

        if self.filesystem.get_file_info(self.path).type != arrow_fs.FileType.NotFound:
            return True
        return bool(self.names())

    def delete(self) -> None:
        """Remove this directory and everything under it (nothing to do if it is not there)."""
        with contextlib.suppress(FileNotFoundError):
            self.filesystem.delete_dir(self.path)

    def at(self, name: str) -> ArrowLocation:
        """The location of `name` (relative) inside this one."""
        return ArrowLocation(self.filesystem, self.child(name), f"{self.uri.rstrip('/')}/{name}" if self.uri else "")

    def list_parts(self, folder: str) -> list[str]:
        """Names (relative to this directory) of the part-* files directly in `folder`, sorted."""
        from pyarrow import fs as arrow_fs

        selector = arrow_fs.FileSelector(self.child(folder), allow_not_found=True)
        names = [info.base_name for info in self.filesystem.get_file_info(selector)]
        return sorted(f"{folder}/{name}" for name in names if name.startswith("part-"))


SnapshotLocation = str | Path | ArrowLocation


def _arrow_from_uri(uri: str) -> tuple[Any, str]:
    from pyarrow import fs as arrow_fs

    filesystem, path = arrow_fs.FileSystem.from_uri(uri)
    return filesystem, str(path)


def resolve_location(location: SnapshotLocation) -> Path | ArrowLocation:
    """A local Path for local locations (the fast path), else the pyarrow filesystem that reads the URI."""
    if isinstance(location, (Path, ArrowLocation)):
        return location
    if is_local(location):
        return local_path(location)
    return ArrowLocation.from_uri(location)


def version_name(version: int) -> str:
    return f"v{version:06d}"


def version_dir(output: str, store: str, version: int) -> Path:
    """The directory of one version under a local output (a path or file:// URI)."""
    return local_path(output) / store / version_name(version)


def version_uri(output: str, store: str, version: int) -> str:
    """The location of one version under any output, spelled like the output (a path or a URI)."""
    if is_local(output):
        return str(version_dir(output, store, version))
    base, sep, query = output.partition("?")  # options a URI may carry (?region=...&endpoint_override=...)
    return f"{base.rstrip('/')}/{store}/{version_name(version)}{sep}{query}"


def version_location(output: str, store: str, version: int) -> Path | ArrowLocation:
    """One version's directory: a local Path, or a pyarrow filesystem location for any other URI."""
    return resolve_location(version_uri(output, store, version))


def folders(output: str, folder: str = "") -> list[str] | None:
    """The names of the folders directly in `folder` (relative) under `output`, a local path or a pyarrow
    filesystem's URI, sorted; None when a local `folder` is no directory (on a pyarrow filesystem, where
    folders are prefixes, a missing one has no folders: [])."""
    if not is_local(output):
        return [name for name, is_dir in ArrowLocation.from_uri(output).names(folder) if is_dir]
    root = local_path(output) / folder
    if not root.is_dir():
        return None
    return sorted(entry.name for entry in root.iterdir() if entry.is_dir())


def existing_versions(output: str, store: str) -> list[int]:
    """The versions present under `output` (complete or not), on a local path or a pyarrow filesystem."""
    return sorted(int(name[1:]) for name in folders(output, store) or () if _VERSION_DIR.fullmatch(name))


def file_sizes(location: Path | ArrowLocation) -> dict[str, int]:
    """The size of every file under a version's location, by its '/'-separated path relative to it (one
    listing on a pyarrow filesystem)."""
    if isinstance(location, Path):
        files = (path for path in location.rglob("*") if path.is_file())
        return {path.relative_to(location).as_posix(): path.stat().st_size for path in files}
    from pyarrow import fs as arrow_fs

    selector = arrow_fs.FileSelector(location.path, recursive=True, allow_not_found=True)
    base = location.path.rstrip("/") + "/"
    return {
        info.path[len(base) :]: int(info.size)
        for info in location.filesystem.get_file_info(selector)
        if info.type == arrow_fs.FileType.File and info.path.startswith(base)
    }


def partition_dir(snapshot: Path, partition: int) -> Path:
    return snapshot / f"partition={partition}"


def data_file(partition: int) -> str:
    """Format 2: a partition's one file, relative to the version directory: `partition={p}/data.mdb`."""
    return f"partition={partition}/{DATA_FILE}"


@dataclass(frozen=True, slots=True)
class Manifest:
    """What a snapshot version holds; the pipeline writes it last, nodes check data against it.

    `format` is FORMAT_1 or FORMAT_2. Format 2 also has, for every partition p, `files[p]` ==
    (data_file(p),), `checksums[p]` ("<algorithm>:<hex>" of that file's bytes) and `bytes[p]` (its size);
    a format-1 manifest has neither (empty mappings).

    `live` (live stores only, always format 2): the topic the version follows, how its records fold, and
    `live.offsets[p]`, the next offset of topic partition p to apply on top of the version's rows.
    """

    store: str
    version: int
    partitions: int
    partitioner: Partitioner
    key_format: KeyFormat
    value_columns: tuple[str, ...]
    rows: tuple[int, ...]
    files: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    created_at: float = 0.0
    format: str = FORMAT_1
    checksums: Mapping[int, str] = field(default_factory=dict)
    bytes: Mapping[int, int] = field(default_factory=dict)
    live: LiveConfig | None = None
    # History and windowed stores: the timeline their files are laid out by (rows are then entries).
    timeline: Timeline | None = None
    # Schema Registry keys: the key schema the version's keys were serialized with (restored by `store adopt`).
    key_schema: KeySchema | None = None

    @property
    def total_rows(self) -> int:
        return sum(self.rows)

    def to_json(self) -> builtins.bytes:  # `bytes` in this class is the field
        doc: dict[str, Any] = {
            "format": self.format,
            "store": self.store,
            "version": self.version,
            "partitions": self.partitions,
            "partitioner": self.partitioner.value,
            "key_format": self.key_format.value,
            "value_columns": list(self.value_columns),
            "rows": list(self.rows),
            "total_rows": self.total_rows,
            "files": {str(p): list(names) for p, names in sorted(self.files.items())},
            "created_at": self.created_at or time.time(),
        }
        if self.format != FORMAT_1:
            doc["checksums"] = {str(p): str(value) for p, value in sorted(self.checksums.items())}
            doc["bytes"] = {str(p): int(size) for p, size in sorted(self.bytes.items())}
        if self.live is not None:
            doc["live"] = self.live.to_json()
        if self.timeline is not None:
            doc["timeline"] = self.timeline.to_dict()
        if self.key_schema is not None:
            doc["key_schema"] = self.key_schema.to_dict()
        return json.dumps(doc, indent=2, sort_keys=True).encode("utf-8")

    @classmethod
    def from_json(cls, raw: builtins.bytes) -> Manifest:
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("format") not in FORMATS:
                found = doc.get("format") if isinstance(doc, dict) else None
                raise SnapshotError(
                    f"unsupported snapshot format {found!r} (expected one of: {', '.join(FORMATS)})"
                )
            snapshot_format = str(doc["format"])
            rows = tuple(int(n) for n in doc["rows"])
            partitions = int(doc["partitions"])
            if len(rows) != partitions:
                raise SnapshotError("manifest lists row counts for a different number of partitions")
            files = {int(p): tuple(str(name) for name in names) for p, names in doc.get("files", {}).items()}
            checksums: dict[int, str] = {}
            sizes: dict[int, int] = {}
            if snapshot_format == FORMAT_2:
                checksums = {int(p): str(value) for p, value in doc["checksums"].items()}
                sizes = {int(p): int(size) for p, size in doc["bytes"].items()}
                _check_files(partitions, files, checksums, sizes)
            live = None
            if doc.get("live") is not None:
                if snapshot_format != FORMAT_2:
                    raise SnapshotError(f"a live store's manifest must be format {FORMAT_2}, not {snapshot_format}")
                if not isinstance(doc["live"], dict):
                    raise SnapshotError(f"manifest's 'live' must be an object, got {doc['live']!r}")
                live = LiveConfig.from_json(doc["live"])
                if len(live.offsets) != partitions:
                    raise SnapshotError(
                        f"manifest's live offsets name {len(live.offsets)} partitions, not {partitions}"
                    )
            timeline = None
            if doc.get("timeline") is not None:
                if snapshot_format != FORMAT_2:
                    raise SnapshotError(f"a timeline store's manifest must be format {FORMAT_2}, not {snapshot_format}")
                try:
                    timeline = Timeline.from_dict(doc["timeline"])
                except TimelineError as exc:
                    raise SnapshotError(f"manifest's timeline: {exc}") from None
            return cls(
                store=str(doc["store"]),
                version=int(doc["version"]),
                partitions=partitions,
                partitioner=Partitioner(doc["partitioner"]),
                key_format=KeyFormat(doc["key_format"]),
                value_columns=tuple(doc["value_columns"]),
                rows=rows,
                files=files,
                created_at=float(doc.get("created_at", 0.0)),
                format=snapshot_format,
                checksums=checksums,
                bytes=sizes,
                live=live,
                timeline=timeline,
                key_schema=None if doc.get("key_schema") is None else KeySchema.from_dict(doc["key_schema"]),
            )
        except SnapshotError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SnapshotError(f"manifest is malformed: {exc!r}") from exc


def _check_files(
    partitions: int, files: Mapping[int, tuple[str, ...]], checksums: Mapping[int, str], sizes: Mapping[int, int]
) -> None:
    """A format-2 manifest names one data file, its checksum and its size for every partition."""
    everyone = set(range(partitions))
    for what, listed in (("files", files), ("checksums", checksums), ("bytes", sizes)):
        if set(listed) != everyone:
            raise SnapshotError(
                f"format-2 manifest: {what!r} must name every partition 0..{partitions - 1} once, "
                f"got {sorted(listed)[:10]}"
            )
    for p in range(partitions):
        if files[p] != (data_file(p),):
            raise SnapshotError(f"format-2 manifest: partition {p} lists {list(files[p])}, not [{data_file(p)!r}]")
        if sizes[p] < 0:
            raise SnapshotError(f"format-2 manifest: partition {p} has a negative size {sizes[p]}")
        parse_checksum(checksums[p])


def write_manifest(snapshot: SnapshotLocation, manifest: Manifest) -> None:
    """Write the manifest atomically: readers see either no manifest or the whole of it.

    `snapshot` is a local path (or file:// URI) or any location a pyarrow filesystem writes.
    """
    where = resolve_location(snapshot)
    if isinstance(where, ArrowLocation):
        where.write_bytes(MANIFEST, manifest.to_json())
        return
    where.mkdir(parents=True, exist_ok=True)
    tmp = where / (MANIFEST + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(manifest.to_json())
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, where / MANIFEST)


def read_manifest(location: SnapshotLocation) -> Manifest:
    """The manifest of the snapshot version at `location` (a path, a file:// URI or a filesystem URI)."""
    where = resolve_location(location)
    if isinstance(where, Path):
        path = where / MANIFEST
        try:
            raw = path.read_bytes()
        except FileNotFoundError as exc:
            raise SnapshotError(f"no manifest at {path}: the version is incomplete or was removed") from exc
    else:
        try:
            raw = where.read_bytes(MANIFEST)
        except FileNotFoundError as exc:
            raise SnapshotError(
                f"no manifest at {where.describe(MANIFEST)}: the version is incomplete or was removed"
            ) from exc
    return Manifest.from_json(raw)


@overload
def partition_files(snapshot: Path, manifest: Manifest, partition: int) -> list[Path]: ...


@overload
def partition_files(
    snapshot: SnapshotLocation, manifest: Manifest, partition: int
) -> list[Path] | list[str]: ...


def partition_files(
    snapshot: SnapshotLocation, manifest: Manifest, partition: int
) -> list[Path] | list[str]:
    """The files holding one partition: local Paths, or filesystem paths for a pyarrow location."""
    where = resolve_location(snapshot)
    names = manifest.files.get(partition)
    if isinstance(where, ArrowLocation):
        folder_name = partition_dir(Path(), partition).as_posix()
        relative = list(names) if names is not None else where.list_parts(folder_name)
        return [where.child(name) for name in relative]
    if names is not None:
        return [where / name for name in names]
    folder = partition_dir(where, partition)
    return sorted(folder.glob("part-*")) if folder.is_dir() else []


def iter_partition(
    snapshot: SnapshotLocation, manifest: Manifest, partition: int
) -> Iterator[tuple[str, bytes]]:
    """Yield (key text, value as compact JSON bytes) for every row of one partition.

    Raises SnapshotError when the rows found differ from the manifest's count, so a truncated or
    half-copied snapshot is never served.
    """
    if not 0 <= partition < manifest.partitions:
        raise SnapshotError(f"partition {partition} out of range 0..{manifest.partitions - 1}")
    if manifest.format != FORMAT_1:
        raise SnapshotError(
            f"{manifest.store} v{manifest.version} is {manifest.format}: its partitions are ready-to-serve "
            "LMDB files (keyroute.storage.lmdb_layout), not rows to read"
        )
    where = resolve_location(snapshot)
    count = 0
    for path in partition_files(where, manifest, partition):
        with _open_lines(where, path) as (lines, name):
            for line_no, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    key, value = row["key"], row["value"]
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    raise SnapshotError(f"{name}:{line_no}: malformed row ({exc})") from exc
                count += 1
                yield str(key), compact_json(value)
    if count != manifest.rows[partition]:
        raise SnapshotError(
            f"partition {partition} of {manifest.store} v{manifest.version} has {count} rows, "
            f"manifest says {manifest.rows[partition]}"
        )



@contextmanager
def _open_lines(where: Path | ArrowLocation, path: Path | str) -> Iterator[tuple[Iterable[bytes], str]]:
    """The lines of one snapshot file (each with its b"\\n"), and the file's name for messages.

    A local file is iterated directly, as it always was; a pyarrow stream is split the same way.
    """
    if isinstance(where, Path):
        try:
            fh = open(path, "rb")  # noqa: SIM115 - closed below; only a failed open is a missing file
        except FileNotFoundError as exc:
            raise SnapshotError(f"snapshot file {path} is missing") from exc
        with fh:
            yield fh, str(path)
        return
    text = str(path)
    name = where.describe() + text[len(where.path) :] if text.startswith(where.path) else text
    try:
        stream = where.filesystem.open_input_stream(text, compression=None)
    except FileNotFoundError as exc:
        raise SnapshotError(f"snapshot file {name} is missing") from exc
    with stream:
        yield split_lines(stream), name


def split_lines(stream: Any) -> Iterator[bytes]:
    """Split a byte stream exactly as iterating a binary file does: after every b"\\n", the last line
    possibly without one."""
    pending = b""
    while chunk := stream.read(_READ_CHUNK_BYTES):
        *complete, pending = (pending + bytes(chunk)).split(b"\n")
        for line in complete:
            yield line + b"\n"
    if pending:
        yield pending


# --- values: the bytes a node serves ---------------------------------------------------------------------


# json.dumps(value, separators=(",", ":"), ensure_ascii=False), without building an encoder per call.
_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, check_circular=False)


def compact_json(value: Any) -> bytes:
    """A value as nodes store and serve it: compact JSON, UTF-8, non-ASCII kept as is."""
    return _COMPACT.encode(value).encode("utf-8")


def compact_value(raw: str | bytes) -> bytes:
    """`compact_json` of a value given as JSON text (e.g. Spark's `to_json`): the same bytes format 1's
    reader yields for that value, whatever spacing or number spelling the text used."""
    return compact_json(json.loads(raw))


# --- checksums: one implementation for the pipeline and the nodes ---------------------------------------


def parse_checksum(text: str) -> tuple[str, str]:
    """("crc32", "1a2b3c4d") from "<algorithm>:<hex>"; SnapshotError if it is not of that form."""
    algorithm, sep, digest = str(text).partition(":")
    algorithm, digest = algorithm.strip().lower(), digest.strip().lower()
    if not sep or not algorithm or not digest or any(c not in "0123456789abcdef" for c in digest):
        raise SnapshotError(f"malformed checksum {text!r} (expected <algorithm>:<hex>)")
    return algorithm, digest


class Checksum:
    """A checksum computed over a stream of chunks, with the byte count beside it.

        checksum = Checksum()                      # CHECKSUM_ALGORITHM; Checksum.like(expected) to verify
        for chunk in chunks: checksum.update(chunk)
        checksum.value                             # "crc32:1a2b3c4d"; checksum.size: bytes seen
        checksum.matches(expected)                 # same algorithm and digest (hex case ignored)
    """

    __slots__ = ("algorithm", "size", "_crc", "_digest")

    def __init__(self, algorithm: str = CHECKSUM_ALGORITHM) -> None:
        self.algorithm = algorithm.lower()
        self.size = 0
        self._crc = 0
        self._digest: Any = None
        if self.algorithm != "crc32":
            if self.algorithm not in CHECKSUM_ALGORITHMS:
                raise SnapshotError(
                    f"checksum algorithm {algorithm!r} is not supported (one of: {', '.join(CHECKSUM_ALGORITHMS)})"
                )
            self._digest = hashlib.new(self.algorithm)

    @classmethod
    def like(cls, expected: str) -> Checksum:
        """An empty checksum of the algorithm `expected` ("<algorithm>:<hex>") was computed with."""
        return cls(parse_checksum(expected)[0])

    def update(self, chunk: Any) -> None:
        """Add the next chunk (bytes, bytearray, memoryview or any buffer)."""
        if self._digest is None:
            self._crc = zlib.crc32(chunk, self._crc)
        else:
            self._digest.update(chunk)
        self.size += memoryview(chunk).nbytes

    @property
    def hexdigest(self) -> str:
        return f"{self._crc:08x}" if self._digest is None else str(self._digest.hexdigest())

    @property
    def value(self) -> str:
        return f"{self.algorithm}:{self.hexdigest}"

    def matches(self, expected: str) -> bool:
        algorithm, digest = parse_checksum(expected)
        return algorithm == self.algorithm and digest == self.hexdigest

    def __repr__(self) -> str:
        return f"Checksum({self.value!r}, size={self.size})"


def _chunks(path: Path | str) -> Iterator[memoryview]:
    """A local file's bytes in large chunks, read into one buffer: each chunk is gone at the next one."""
    buffer = bytearray(CHECKSUM_CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buffer):
            yield view[:n]


def checksum_file(path: Path | str, algorithm: str = CHECKSUM_ALGORITHM) -> Checksum:
    """The checksum (and size) of a local file, read once in large chunks."""
    checksum = Checksum(algorithm)
    for chunk in _chunks(path):
        checksum.update(chunk)
    return checksum


def copy_checksummed(path: Path | str, write: Any, algorithm: str = CHECKSUM_ALGORITHM) -> Checksum:
    """Copy a local file to `write` (a callable taking each chunk: a file's or pyarrow stream's `write`),
    computing its checksum in the same pass."""
    checksum = Checksum(algorithm)
    for chunk in _chunks(path):
        checksum.update(chunk)
        write(chunk)
    return checksum
