"""The node's unit-test fixtures: snapshots written by hand in the keyroute snapshot format (no Spark), and
nodes served for a test (`client_for`, see tests/unit/node/fakes.py)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from keyroute.cluster.partition_map import StoreRecord
from keyroute.keys.key_format import KeyFormat, parse_key
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.storage.snapshot import Manifest, partition_dir, version_dir, write_manifest
from tests.unit.node.fakes import Nodes

SnapshotWriter = Callable[..., StoreRecord]


def write_snapshot(
    root: Path,
    store: str,
    version: int,
    partitions: int,
    rows: Mapping[str, Any],
    key_format: KeyFormat = KeyFormat.STRING,
    partitioner: Partitioner = Partitioner.MURMUR2,
    replication_factor: int = 1,
) -> StoreRecord:
    """Write `rows` (key text -> JSON value) as one store version; return the record that publishes it."""
    snapshot = version_dir(str(root), store, version)
    per_partition: dict[int, list[tuple[str, Any]]] = {p: [] for p in range(partitions)}
    for text, value in rows.items():
        key = parse_key(key_format, text)
        per_partition[partition_for(partitioner, key.data, partitions)].append((key.text, value))
    for p, items in per_partition.items():
        folder = partition_dir(snapshot, p)
        folder.mkdir(parents=True)
        lines = "".join(json.dumps({"key": k, "value": v}) + "\n" for k, v in sorted(items))
        (folder / "part-00000.json").write_text(lines)
    manifest = Manifest(
        store=store,
        version=version,
        partitions=partitions,
        partitioner=partitioner,
        key_format=key_format,
        value_columns=("v",),
        rows=tuple(len(per_partition[p]) for p in range(partitions)),
        created_at=1_700_000_000.0 + version,
    )
    write_manifest(snapshot, manifest)
    return StoreRecord(
        name=store,
        partitions=partitions,
        partitioner=partitioner,
        key_format=key_format,
        version=version,
        snapshot=str(snapshot),
        value_columns=("v",),
        replication_factor=replication_factor,
    )


@pytest.fixture
def snapshot_root(tmp_path: Path) -> Path:
    root = tmp_path / "snapshots"
    root.mkdir()
    return root


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "node-data"
    folder.mkdir()
    return folder


@pytest.fixture
def snapshot(snapshot_root: Path) -> SnapshotWriter:
    """`snapshot(store, version, partitions, rows, **options)` writes a version and returns its record."""

    def write(store: str, version: int, partitions: int, rows: Mapping[str, Any], **options: Any) -> StoreRecord:
        return write_snapshot(snapshot_root, store, version, partitions, rows, **options)

    return write


@pytest.fixture
def client_for() -> Iterator[Nodes]:
    """`client_for(serving, held, peer, ...)` starts a node for the test (`Nodes.__call__`): its client and
    the requests its peers received. Every node started is stopped after the test."""
    nodes = Nodes()
    try:
        yield nodes
    finally:
        nodes.close()
