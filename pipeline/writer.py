"""Writing one computed store as a new snapshot version, in keyroute_core.snapshot's layout.

The version directory is claimed with mkdir (never overwritten), filled by Spark, and sealed by the manifest.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from keyroute.core.snapshot import (
    Manifest,
    SnapshotError,
    existing_versions,
    partition_dir,
    version_dir,
    write_manifest,
)
from keyroute.pipeline.compute import ComputedStore, spark_errors
from keyroute.pipeline.errors import PublishError


@dataclass(frozen=True, slots=True)
class WrittenVersion:
    """A complete snapshot version on disk (manifest written), not yet published."""

    store: str
    version: int
    snapshot: Path
    manifest: Manifest


def next_version(output: str, store: str, published: int | None) -> int:
    """One past every version on disk and the one published in ZooKeeper, so numbers never repeat."""
    try:
        on_disk = existing_versions(output, store)
    except (SnapshotError, OSError) as exc:
        raise PublishError(store, f"cannot list versions under output {output!r}: {exc}") from exc
    return max([*on_disk, published or 0]) + 1


def snapshot_dir(output: str, store: str, version: int) -> Path:
    """The absolute directory of one version (a local path or file:// output only)."""
    try:
        return version_dir(output, store, version).resolve()
    except SnapshotError as exc:
        raise PublishError(store, str(exc)) from exc


def write_version(computed: ComputedStore, output: str, version: int) -> WrittenVersion:
    """Write `computed` as version `version`; on any failure the version directory is removed again."""
    store = computed.spec
    target = snapshot_dir(output, store.name, version)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.mkdir()  # claims the version: a concurrent build (or an old one) cannot share it
    except FileExistsError:
        raise PublishError(
            store.name, f"version directory {target} already exists (versions are never overwritten)"
        ) from None
    except OSError as exc:
        raise PublishError(store.name, f"cannot create version directory {target}: {exc}") from exc
    try:
        rows = _write_rows(computed, target)
        files = {p: _partition_files(target, p) for p in range(store.partitions)}
        for partition, count in enumerate(rows):
            if count and not files[partition]:
                raise PublishError(
                    store.name, f"Spark wrote no file for partition {partition} ({count} rows)"
                )
        manifest = Manifest(
            store=store.name,
            version=version,
            partitions=store.partitions,
            partitioner=store.partitioner,
            key_format=store.key_format,
            value_columns=computed.value_columns,
            rows=rows,
            files=files,
            created_at=time.time(),
        )
        write_manifest(target, manifest)  # last: until now, readers see an incomplete version
    except BaseException:
        remove_version(target)
        raise
    return WrittenVersion(store=store.name, version=version, snapshot=target, manifest=manifest)


def remove_version(snapshot: Path) -> None:
    """Delete a version directory this build created and did not publish."""
    shutil.rmtree(snapshot, ignore_errors=True)


def _write_rows(computed: ComputedStore, target: Path) -> tuple[int, ...]:
    store = computed.spec
    with spark_errors(store.name, f"writing {target}", PublishError):
        rows = computed.frame.select("key", "value", "partition")
        # All rows of a partition go to one task, so each partition directory gets exactly one file.
        # Sorting by (partition, key) satisfies the ordering the partitioned writer needs, so Spark adds
        # no sort of its own that could disturb the key order inside a file.
        (
            rows.repartition(store.partitions, "partition")
            .sortWithinPartitions("partition", "key")
            .write.mode("append")  # into the empty directory claimed above
            .partitionBy("partition")
            .option("ignoreNullFields", False)  # a null value column stays in the value as null
            .option("maxRecordsPerFile", 0)
            # Spark takes a path string literally (no percent-decoding), unlike Path.as_uri().
            .json("file://" + target.as_posix())
        )
    # Counted from the same cached frame while checking its keys (see compute._check_keys).
    return computed.partition_rows


def _partition_files(target: Path, partition: int) -> tuple[str, ...]:
    folder = partition_dir(target, partition)
    return tuple(sorted(path.relative_to(target).as_posix() for path in folder.glob("part-*")))
