"""The snapshot format: one immutable directory per store version, readable without Spark.

    {output}/{store}/v{version:06d}/partition={p}/part-*.json   JSON lines {"key": text, "value": {...}},
                                                                 sorted by key within the partition
    {output}/{store}/v{version:06d}/manifest.json                written last: a version without a
                                                                 manifest is incomplete and never served
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from keyroute_core.key_format import KeyFormat
from keyroute_core.partitioner import Partitioner

FORMAT = "keyroute-snapshot/1"
_VERSION_DIR = re.compile(r"v[0-9]+")
MANIFEST = "manifest.json"


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


def version_dir(output: str, store: str, version: int) -> Path:
    return local_path(output) / store / f"v{version:06d}"


def existing_versions(output: str, store: str) -> list[int]:
    root = local_path(output) / store
    if not root.is_dir():
        return []
    return sorted(
        int(entry.name[1:]) for entry in root.iterdir() if _VERSION_DIR.fullmatch(entry.name) and entry.is_dir()
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


def read_manifest(location: str | Path) -> Manifest:
    path = (location if isinstance(location, Path) else local_path(location)) / MANIFEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError as exc:
        raise SnapshotError(f"no manifest at {path}: the version is incomplete or was removed") from exc
    return Manifest.from_json(raw)


def partition_files(snapshot: Path, manifest: Manifest, partition: int) -> list[Path]:
    names = manifest.files.get(partition)
    if names is not None:
        return [snapshot / name for name in names]
    folder = partition_dir(snapshot, partition)
    return sorted(folder.glob("part-*")) if folder.is_dir() else []


def iter_partition(snapshot: Path, manifest: Manifest, partition: int) -> Iterator[tuple[str, bytes]]:
    """Yield (key text, value as compact JSON bytes) for every row of one partition.

    Raises SnapshotError when the rows found differ from the manifest's count, so a truncated or
    half-copied snapshot is never served.
    """
    if not 0 <= partition < manifest.partitions:
        raise SnapshotError(f"partition {partition} out of range 0..{manifest.partitions - 1}")
    count = 0
    for path in partition_files(snapshot, manifest, partition):
        try:
            fh = open(path, "rb")
        except FileNotFoundError as exc:
            raise SnapshotError(f"snapshot file {path} is missing") from exc
        with fh:
            for line_no, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    key, value = row["key"], row["value"]
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    raise SnapshotError(f"{path}:{line_no}: malformed row ({exc})") from exc
                count += 1
                yield str(key), json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if count != manifest.rows[partition]:
        raise SnapshotError(
            f"partition {partition} of {manifest.store} v{manifest.version} has {count} rows, "
            f"manifest says {manifest.rows[partition]}"
        )
