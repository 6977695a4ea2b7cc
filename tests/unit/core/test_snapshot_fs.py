"""Reading snapshots through pyarrow filesystems (s3://, gs://, hdfs://, ...) gives exactly the local rows.

The pyarrow path is driven with filesystems that need no network: LocalFileSystem (from a file:// URI),
a SubTreeFileSystem over it, and pyarrow's in-memory mock filesystem holding a copy of the snapshot.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.fs as arrow_fs
import pytest

from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.storage import snapshot as snapshot_module
from keyroute.storage.snapshot import (
    ArrowLocation,
    Manifest,
    SnapshotError,
    is_local,
    iter_partition,
    partition_dir,
    partition_files,
    read_manifest,
    resolve_location,
    version_dir,
    write_manifest,
)
from tests.memory_fs import memory_filesystem

ROWS: dict[int, list[tuple[str, Any]]] = {
    0: [("a", {"n": 1, "f": 2.5, "s": "x", "z": None}), ("ü/%", {"n": -3}), ("東京-42", {"city": "Tokyo"})],
    1: [],
    2: [(f"k{i:05d}", {"i": i, "pad": "y" * (i % 300)}) for i in range(4000)],  # crosses read chunks
    3: [("last", {"no": "newline at the end of the file"})],
}
PARTITIONS = len(ROWS)


def write_snapshot(root: Path, *, with_files: bool) -> Path:
    """A version in the keyroute format; `with_files` lists the part files in the manifest (as the
    pipeline does) or leaves nodes to find them by listing."""
    snap = version_dir(str(root), "s", 1)
    files: dict[int, tuple[str, ...]] = {}
    for p, items in ROWS.items():
        folder = partition_dir(snap, p)
        folder.mkdir(parents=True)
        text = "".join(json.dumps({"key": k, "value": v}, ensure_ascii=False) + "\n" for k, v in items)
        if p == 3:
            text = text.rstrip("\n")
        if p == 2:  # two files, and an empty line the reader skips
            half = len(text) // 2
            cut = text.index("\n", half) + 1
            (folder / "part-00000.json").write_text(text[:cut] + "\n", encoding="utf-8")
            (folder / "part-00001.json").write_text(text[cut:], encoding="utf-8")
        else:
            (folder / "part-00000.json").write_text(text, encoding="utf-8")
        files[p] = tuple(sorted(f"partition={p}/{f.name}" for f in folder.iterdir()))
    (partition_dir(snap, 0) / "_SUCCESS").write_text("")  # not a part file: never read
    manifest = Manifest(
        store="s",
        version=1,
        partitions=PARTITIONS,
        partitioner=Partitioner.MURMUR2,
        key_format=KeyFormat.STRING,
        value_columns=("n",),
        rows=tuple(len(ROWS[p]) for p in range(PARTITIONS)),
        files=files if with_files else {},
    )
    write_manifest(snap, manifest)
    return snap


def copy_into(fs: Any, local: Path, base: str) -> None:
    fs.create_dir(base)
    for path in sorted(local.rglob("*")):
        target = f"{base}/{path.relative_to(local).as_posix()}"
        if path.is_dir():
            fs.create_dir(target)
        else:
            with fs.open_output_stream(target) as out:
                out.write(path.read_bytes())


def all_rows(location: Any) -> dict[int, list[tuple[str, bytes]]]:
    manifest = read_manifest(location)
    return {p: list(iter_partition(location, manifest, p)) for p in range(manifest.partitions)}


@pytest.fixture(params=[True, False], ids=["manifest-lists-files", "files-by-listing"])
def snap(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    return write_snapshot(tmp_path / "out", with_files=request.param)


def arrow_locations(snap: Path, tmp_path: Path) -> Iterator[tuple[str, ArrowLocation]]:
    yield "file:// URI through pyarrow", ArrowLocation.from_uri(snap.as_uri())
    yield "LocalFileSystem", ArrowLocation(arrow_fs.LocalFileSystem(), str(snap))
    subtree = arrow_fs.SubTreeFileSystem(str(tmp_path / "out"), arrow_fs.LocalFileSystem())
    yield "SubTreeFileSystem", ArrowLocation(subtree, "s/v000001")
    mock = memory_filesystem()
    copy_into(mock, snap, "bucket/keyroute/s/v000001")
    yield (
        "mock object store",
        ArrowLocation(mock, "bucket/keyroute/s/v000001", uri="s3://bucket/keyroute/s/v000001"),
    )


def test_every_pyarrow_filesystem_reads_exactly_the_local_rows(snap: Path, tmp_path: Path) -> None:
    local = all_rows(snap)
    assert [len(local[p]) for p in range(PARTITIONS)] == [len(ROWS[p]) for p in range(PARTITIONS)]
    assert local[0][0] == ("a", b'{"n":1,"f":2.5,"s":"x","z":null}')
    for label, location in arrow_locations(snap, tmp_path):
        assert read_manifest(location) == read_manifest(snap), label
        assert all_rows(location) == local, label


def test_local_locations_keep_the_plain_file_path(snap: Path) -> None:
    # Paths, path strings and file:// URIs never go through pyarrow: same Paths, same rows as before.
    assert resolve_location(snap) == snap
    assert resolve_location(str(snap)) == snap
    assert resolve_location(snap.as_uri()) == snap
    assert all(is_local(x) for x in (snap, str(snap), snap.as_uri(), "relative/dir"))
    assert not any(is_local(x) for x in ("s3://b/k", "s3a://b/k", "gs://b/k", "hdfs://nn:8020/k"))
    manifest = read_manifest(str(snap))
    files = partition_files(snap, manifest, 2)
    assert [f.name for f in files] == ["part-00000.json", "part-00001.json"]
    assert all(isinstance(f, Path) for f in files)
    assert all_rows(snap.as_uri()) == all_rows(snap)


def test_hadoop_scheme_names_are_read_as_pyarrow_ones(monkeypatch: pytest.MonkeyPatch, snap: Path) -> None:
    # Spark writes s3a://bucket/...; nodes read the same bucket and keys as s3://bucket/.... No network here:
    # the URI handed to pyarrow is recorded, and a local filesystem answers for it.
    asked: list[str] = []

    def from_uri(uri: str) -> tuple[Any, str]:
        asked.append(uri)
        return arrow_fs.LocalFileSystem(), str(snap)

    monkeypatch.setattr(snapshot_module, "_arrow_from_uri", from_uri)
    expected = {
        "s3a://bucket/out/s/v000001": "s3://bucket/out/s/v000001",
        "S3N://bucket/out/s/v000001": "s3://bucket/out/s/v000001",
        "s3://bucket/out/s/v000001": "s3://bucket/out/s/v000001",
        "gs://bucket/out/s/v000001": "gs://bucket/out/s/v000001",
        "hdfs://namenode:8020/out/s/v000001": "hdfs://namenode:8020/out/s/v000001",
    }
    for uri, opened in expected.items():
        asked.clear()
        location = resolve_location(uri)
        assert isinstance(location, ArrowLocation) and location.uri == uri
        assert all_rows(uri) == all_rows(snap)
        assert set(asked) == {opened}


def test_a_missing_manifest_or_file_is_a_snapshot_error(tmp_path: Path) -> None:
    snap = write_snapshot(tmp_path / "out", with_files=True)
    mock = memory_filesystem()
    copy_into(mock, snap, "bucket/s/v000001")
    location = ArrowLocation(mock, "bucket/s/v000001", uri="gs://bucket/s/v000001")
    manifest = read_manifest(location)
    mock.delete_file("bucket/s/v000001/partition=2/part-00001.json")
    with pytest.raises(SnapshotError, match=r"gs://bucket/s/v000001/partition=2/part-00001\.json is missing"):
        list(iter_partition(location, manifest, 2))
    mock.delete_file("bucket/s/v000001/manifest.json")
    with pytest.raises(SnapshotError, match=r"no manifest at gs://bucket/s/v000001/manifest\.json"):
        read_manifest(location)


def test_a_truncated_or_malformed_object_is_refused(tmp_path: Path) -> None:
    snap = write_snapshot(tmp_path / "out", with_files=False)
    mock = memory_filesystem()
    copy_into(mock, snap, "b/s/v000001")
    location = ArrowLocation(mock, "b/s/v000001", uri="s3://b/s/v000001")
    manifest = read_manifest(location)
    with mock.open_output_stream("b/s/v000001/partition=0/part-00000.json") as out:
        out.write(b'{"key": "a", "value": {"n": 1}}\n')  # two rows lost
    with pytest.raises(SnapshotError, match="has 1 rows, manifest says 3"):
        list(iter_partition(location, manifest, 0))
    with mock.open_output_stream("b/s/v000001/partition=0/part-00000.json") as out:
        out.write(b'{"key": "a", "value": {"n": 1}}\n{"key": "b"\n')
    malformed = r"s3://b/s/v000001/partition=0/part-00000\.json:2: malformed row"
    with pytest.raises(SnapshotError, match=malformed):
        list(iter_partition(location, manifest, 0))


def test_an_unreadable_uri_is_a_snapshot_error() -> None:
    with pytest.raises(SnapshotError, match="no filesystem can read it"):
        read_manifest("nosuchfs://bucket/s/v000001")


def test_lines_are_split_like_a_binary_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Tiny read chunks: lines cross chunk borders everywhere, and the result is still iteration of the file.
    monkeypatch.setattr(snapshot_module, "_READ_CHUNK_BYTES", 7)
    data = b'{"key": "a", "value": {}}\n\n{"key": "b", "value": {"x": "\\u00e9\\n"}}\r\n'
    data += b'{"key": "c", "value": 1}'
    path = tmp_path / "part-00000.json"
    path.write_bytes(data)
    with arrow_fs.LocalFileSystem().open_input_stream(str(path), compression=None) as stream:
        split = list(snapshot_module.split_lines(stream))
    with open(path, "rb") as fh:
        assert split == list(fh)
