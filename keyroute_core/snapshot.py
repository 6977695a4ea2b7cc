"""The snapshot format: one immutable directory per store version, readable without Spark.

    {output}/{store}/v{version:06d}/partition={p}/part-*.json   JSON lines {"key": text, "value": {...}},
                                                                 sorted by key within the partition
    {output}/{store}/v{version:06d}/manifest.json                written last: a version without a
                                                                 manifest is incomplete and never served

Reading takes a location: a local path or file:// URI (read with plain file I/O), or any URI a pyarrow
filesystem understands (s3://, gs://, hdfs://, abfs://, ...; s3a:// and s3n:// as Hadoop writes them are
read as s3://). Writing (the pipeline's side) is local paths and file:// only.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload
from urllib.parse import unquote, urlparse

from keyroute.core.key_format import KeyFormat
from keyroute.core.partitioner import Partitioner

FORMAT = "keyroute-snapshot/1"
_VERSION_DIR = re.compile(r"v[0-9]+")
MANIFEST = "manifest.json"
# Hadoop's names for object stores that pyarrow knows under another scheme (same bucket, same keys).
_ARROW_SCHEME_ALIASES = {"s3a": "s3", "s3n": "s3"}
_READ_CHUNK_BYTES = 1 << 20


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


def version_dir(output: str, store: str, version: int) -> Path:
    return local_path(output) / store / f"v{version:06d}"


def existing_versions(output: str, store: str) -> list[int]:
    root = local_path(output) / store
    if not root.is_dir():
        return []
    return sorted(
        int(entry.name[1:])
        for entry in root.iterdir()
        if _VERSION_DIR.fullmatch(entry.name) and entry.is_dir()
    )


def partition_dir(snapshot: Path, partition: int) -> Path:
    return snapshot / f"partition={partition}"


@dataclass(frozen=True, slots=True)
class Manifest:
    """What a snapshot version holds; the pipeline writes it last, nodes check data against it."""

    store: str
    version: int
    partitions: int
    partitioner: Partitioner
    key_format: KeyFormat
    value_columns: tuple[str, ...]
    rows: tuple[int, ...]
    files: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    created_at: float = 0.0

    @property
    def total_rows(self) -> int:
        return sum(self.rows)

    def to_json(self) -> bytes:
        doc: dict[str, Any] = {
            "format": FORMAT,
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
        return json.dumps(doc, indent=2, sort_keys=True).encode("utf-8")

    @classmethod
    def from_json(cls, raw: bytes) -> Manifest:
        try:
            doc = json.loads(raw)
            if doc.get("format") != FORMAT:
                raise SnapshotError(f"unsupported snapshot format {doc.get('format')!r} (expected {FORMAT})")
            rows = tuple(int(n) for n in doc["rows"])
            if len(rows) != int(doc["partitions"]):
                raise SnapshotError("manifest lists row counts for a different number of partitions")
            return cls(
                store=str(doc["store"]),
                version=int(doc["version"]),
                partitions=int(doc["partitions"]),
                partitioner=Partitioner(doc["partitioner"]),
                key_format=KeyFormat(doc["key_format"]),
                value_columns=tuple(doc["value_columns"]),
                rows=rows,
                files={int(p): tuple(names) for p, names in doc.get("files", {}).items()},
                created_at=float(doc.get("created_at", 0.0)),
            )
        except SnapshotError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise SnapshotError(f"manifest is malformed: {exc!r}") from exc


def write_manifest(snapshot: Path, manifest: Manifest) -> None:
    """Write the manifest atomically: readers see either no manifest or the whole of it."""
    snapshot.mkdir(parents=True, exist_ok=True)
    tmp = snapshot / (MANIFEST + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(manifest.to_json())
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, snapshot / MANIFEST)


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
                yield str(key), json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
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
        yield _split_lines(stream), name


def _split_lines(stream: Any) -> Iterator[bytes]:
    """Split a byte stream exactly as iterating a binary file does: after every b"\\n", the last line
    possibly without one."""
    pending = b""
    while chunk := stream.read(_READ_CHUNK_BYTES):
        *complete, pending = (pending + bytes(chunk)).split(b"\n")
        for line in complete:
            yield line + b"\n"
    if pending:
        yield pending
