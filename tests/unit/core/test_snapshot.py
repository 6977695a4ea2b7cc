from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.storage.snapshot import (
    Manifest,
    SnapshotError,
    existing_versions,
    iter_partition,
    local_path,
    partition_dir,
    read_manifest,
    version_dir,
    write_manifest,
)


def make_snapshot(root: Path, rows: dict[int, list[tuple[str, dict]]], partitions: int = 3) -> Path:
    snap = version_dir(str(root), "s", 1)
    for p, items in rows.items():
        folder = partition_dir(snap, p)
        folder.mkdir(parents=True)
        with open(folder / "part-00000.json", "w", encoding="utf-8") as fh:
            for key, value in items:
                fh.write(json.dumps({"key": key, "value": value}, ensure_ascii=False) + "\n")
    manifest = Manifest(
        store="s",
        version=1,
        partitions=partitions,
        partitioner=Partitioner.MURMUR2,
        key_format=KeyFormat.STRING,
        value_columns=("a", "b"),
        rows=tuple(len(rows.get(p, [])) for p in range(partitions)),
    )
    write_manifest(snap, manifest)
    return snap


def test_reads_rows_with_value_types_kept(tmp_path: Path) -> None:
    snap = make_snapshot(tmp_path, {0: [("k1", {"a": 1, "b": 2.5}), ("ü/%", {"a": None, "b": "x"})]})
    manifest = read_manifest(str(snap))
    assert manifest.rows == (2, 0, 0) and manifest.total_rows == 2
    rows = list(iter_partition(snap, manifest, 0))
    assert rows[0] == ("k1", b'{"a":1,"b":2.5}')
    assert json.loads(rows[1][1]) == {"a": None, "b": "x"}
    assert rows[1][0] == "ü/%"
    assert list(iter_partition(snap, manifest, 2)) == []


def test_row_count_mismatch_is_an_error(tmp_path: Path) -> None:
    snap = make_snapshot(tmp_path, {1: [("k", {"a": 1, "b": 1})]})
    manifest = read_manifest(str(snap))
    lying = replace(manifest, rows=(0, 2, 0))
    with pytest.raises(SnapshotError, match="manifest says 2"):
        list(iter_partition(snap, lying, 1))


def test_missing_manifest_means_incomplete(tmp_path: Path) -> None:
    (tmp_path / "s" / "v000001").mkdir(parents=True)
    with pytest.raises(SnapshotError, match="incomplete"):
        read_manifest(str(tmp_path / "s" / "v000001"))


def test_versions_and_locations(tmp_path: Path) -> None:
    make_snapshot(tmp_path, {})
    (tmp_path / "s" / "v000003").mkdir()
    (tmp_path / "s" / "junk").mkdir()
    (tmp_path / "s" / "v\u00b2").mkdir()  # a superscript digit is not a version
    (tmp_path / "s" / "v000009").write_text("a file, not a version")
    assert existing_versions(str(tmp_path), "s") == [1, 3]
    assert existing_versions(str(tmp_path), "nope") == []
    assert local_path("file:///data/x%20y") == Path("/data/x y")
    assert local_path("rel/dir") == Path("rel/dir")
    with pytest.raises(SnapshotError, match="filesystem path"):
        local_path("s3a://bucket/x")


def test_manifest_rejects_unknown_format() -> None:
    with pytest.raises(SnapshotError, match="unsupported snapshot format"):
        Manifest.from_json(b'{"format": "other/9"}')
