"""Snapshot format 2 on the node: a partition's ready-to-serve data.mdb fetched (hard link or streamed copy),
verified against the manifest (size, checksum, rows, keys of this partition), opened read-only, reused on
restart. The snapshots are built here as an executor builds them (lmdb + db_key, compacted copy), with
their manifests written by hand."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import random
import shutil
import tempfile
import uuid
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import lmdb
import pytest

from keyroute.cluster.partition_map import StoreRecord
from keyroute.keys.key_format import KeyFormat, parse_key
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.replica import fetch
from keyroute.replica.fetch import FetchCancelled, FetchError, fetch_file, sample_keys
from keyroute.replica.store import (
    MARKER,
    LoadCancelled,
    LoadError,
    PartitionId,
    PartitionStore,
    load_partition,
    partition_path,
)
from keyroute.storage.lmdb_layout import db_key
from keyroute.storage.snapshot import ArrowLocation, local_path, partition_dir, version_dir
from keyroute.storage.timeline import StoreKind, Timeline, entry_key, key_part
from tests.unit.node.conftest import write_snapshot

MAP_SIZE = 1 << 24
FORMAT_2 = "keyroute-snapshot/2"
ROWS = {f"customer-{i:03d}": {"n": i, "name": f"C{i}"} for i in range(200)}


# -- building format-2 snapshots as the pipeline's executors do ----------------------------------------


def _value_bytes(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def build_data_file(target: Path, items: Mapping[bytes, bytes]) -> None:
    """An LMDB environment written in one transaction in ascending key order, compacted with
    `env.copy(compact=True)`; only the resulting data.mdb is kept, at `target`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built, compacted = Path(tmp) / "build", Path(tmp) / "out"
        compacted.mkdir()
        env = lmdb.open(str(built), subdir=True, max_dbs=0, map_size=1 << 26)
        try:
            with env.begin(write=True) as txn:
                _, added = txn.cursor().putmulti(sorted((db_key(k), v) for k, v in items.items()), append=True)
                assert added == len(items)
            env.copy(str(compacted), compact=True)
        finally:
            env.close()
        os.replace(compacted / "data.mdb", target)


def checksum_of(path: Path, algorithm: str = "crc32") -> str:
    data = path.read_bytes()
    if algorithm == "crc32":
        return f"crc32:{zlib.crc32(data):08x}"
    return f"{algorithm}:{hashlib.new(algorithm, data).hexdigest()}"


def data_file(record: StoreRecord, partition: int) -> Path:
    return partition_dir(local_path(record.snapshot), partition) / "data.mdb"


def edit_manifest(record: StoreRecord, change: Callable[[dict[str, Any]], None]) -> None:
    path = local_path(record.snapshot) / "manifest.json"
    doc = json.loads(path.read_bytes())
    change(doc)
    path.write_text(json.dumps(doc, indent=2, sort_keys=True))


def reseal(record: StoreRecord, partition: int, algorithm: str = "crc32") -> None:
    """Make the manifest's size and checksum of a partition match its data.mdb as it is now."""
    path = data_file(record, partition)

    def change(doc: dict[str, Any]) -> None:
        doc["bytes"][str(partition)] = path.stat().st_size
        doc["checksums"][str(partition)] = checksum_of(path, algorithm)

    edit_manifest(record, change)


def write_files_snapshot(
    root: Path,
    store: str,
    version: int,
    partitions: int,
    rows: Mapping[str, Any],
    key_format: KeyFormat = KeyFormat.STRING,
    partitioner: Partitioner = Partitioner.MURMUR2,
    algorithm: str = "crc32",
    replication_factor: int = 1,
    built_with: Partitioner | None = None,
) -> StoreRecord:
    """Write `rows` (key text -> JSON value) as one format-2 store version; return the record publishing
    it. `built_with` places keys by another partitioner than the manifest names (a misbuilt snapshot)."""
    snapshot = version_dir(str(root), store, version)
    per_partition: dict[int, dict[bytes, bytes]] = {p: {} for p in range(partitions)}
    for text, value in rows.items():
        key = parse_key(key_format, text).data
        per_partition[partition_for(built_with or partitioner, key, partitions)][key] = _value_bytes(value)
    files, checksums, sizes = {}, {}, {}
    for p, items in per_partition.items():
        name = f"partition={p}/data.mdb"
        build_data_file(snapshot / name, items)
        files[str(p)] = [name]
        checksums[str(p)] = checksum_of(snapshot / name, algorithm)
        sizes[str(p)] = (snapshot / name).stat().st_size
    counts = [len(per_partition[p]) for p in range(partitions)]
    manifest = {
        "format": FORMAT_2,
        "store": store,
        "version": version,
        "partitions": partitions,
        "partitioner": partitioner.value,
        "key_format": key_format.value,
        "value_columns": ["v"],
        "rows": counts,
        "total_rows": sum(counts),
        "files": files,
        "checksums": checksums,
        "bytes": sizes,
        "created_at": 1_700_000_000.0 + version,
    }
    (snapshot / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
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


# -- helpers -------------------------------------------------------------------------------------------


@pytest.fixture
def files_snapshot(snapshot_root: Path) -> Callable[..., StoreRecord]:
    def write(store: str, version: int, partitions: int, rows: Mapping[str, Any], **options: Any) -> StoreRecord:
        return write_files_snapshot(snapshot_root, store, version, partitions, rows, **options)

    return write


def _partition_of(text: str, partitions: int) -> int:
    return partition_for(Partitioner.MURMUR2, text.encode(), partitions)


def _files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.exists() else []


def _assert_serves_exactly(held: PartitionStore, rows: Mapping[str, Any], partitions: int) -> None:
    mine = {k: v for k, v in rows.items() if _partition_of(k, partitions) == held.pid.partition}
    assert held.rows == len(mine)
    for text, value in rows.items():
        got = held.get(text.encode())
        if text in mine:
            assert got == _value_bytes(value), text
        else:
            assert got is None, text


def _loaded(data_dir: Path, record: StoreRecord, partition: int) -> Path:
    return partition_path(data_dir, PartitionId(record.name, record.version, partition)) / "data.mdb"


@pytest.fixture
def other_filesystem(data_dir: Path) -> Iterator[Path]:
    """A directory on another filesystem than the node's data directory (tmpfs), or skip."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK) or shm.stat().st_dev == data_dir.stat().st_dev:
        pytest.skip("no writable filesystem other than the data directory's")
    folder = Path(tempfile.mkdtemp(prefix="keyroute-test-", dir=shm))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# -- loading -------------------------------------------------------------------------------------------


def test_same_filesystem_loads_by_hard_link_and_never_changes_the_snapshot_file(files_snapshot, data_dir) -> None:
    record = files_snapshot("bookings", 1, 3, ROWS)
    for p in range(3):
        source = data_file(record, p)
        before = source.stat()
        digest = checksum_of(source)
        held = load_partition(data_dir, record, p, MAP_SIZE)
        try:
            loaded = _loaded(data_dir, record, p)
            assert loaded.stat().st_ino == before.st_ino and source.stat().st_nlink == 2
            assert held.read_only  # it could never write the file
            _assert_serves_exactly(held, ROWS, 3)
            # The node's lock file is its own; the snapshot directory gets nothing.
            assert (loaded.parent / "lock.mdb").is_file()
            assert sorted(f.name for f in source.parent.iterdir()) == ["data.mdb"]
        finally:
            held.discard()
        after = source.stat()
        assert (after.st_mtime_ns, after.st_size, after.st_nlink) == (before.st_mtime_ns, before.st_size, 1)
        assert checksum_of(source) == digest
    assert _files_under(data_dir) == []


def test_link_false_copies_the_file(files_snapshot, data_dir) -> None:
    record = files_snapshot("bookings", 1, 2, ROWS)
    held = load_partition(data_dir, record, 1, MAP_SIZE, link=False)
    try:
        loaded = _loaded(data_dir, record, 1)
        assert loaded.stat().st_ino != data_file(record, 1).stat().st_ino
        assert data_file(record, 1).stat().st_nlink == 1
        assert loaded.read_bytes() == data_file(record, 1).read_bytes()
        _assert_serves_exactly(held, ROWS, 2)
    finally:
        held.close()


def test_a_snapshot_on_another_filesystem_is_copied(other_filesystem: Path, data_dir: Path) -> None:
    record = write_files_snapshot(other_filesystem, "bookings", 1, 2, ROWS)
    uri = local_path(record.snapshot).as_uri()  # as a file:// URI, as the pipeline may publish it
    held = load_partition(data_dir, dataclasses.replace(record, snapshot=uri), 0, MAP_SIZE)
    try:
        loaded = _loaded(data_dir, record, 0)
        assert loaded.stat().st_dev != data_file(record, 0).stat().st_dev
        assert loaded.read_bytes() == data_file(record, 0).read_bytes()
        _assert_serves_exactly(held, ROWS, 2)
    finally:
        held.close()


def test_keys_of_any_length_and_format(files_snapshot, data_dir) -> None:
    rows = {"": {"n": 0}, "k" * 510: {"n": 510}, "k" * 511: {"n": 511}, "k" * 3000: {"n": 3000}}
    record = files_snapshot("odd", 1, 1, rows)
    held = load_partition(data_dir, record, 0, MAP_SIZE)
    try:
        assert held.rows == 4
        for text, value in rows.items():
            assert held.get(text.encode()) == _value_bytes(value), len(text)
        assert held.get(b"k" * 2999) is None
    finally:
        held.close()
    ints = {"-1": {"a": [1, 2]}, "9223372036854775807": {"b": "é"}, "0": {"c": None}}
    record = files_snapshot("ints", 1, 1, ints, key_format=KeyFormat.INT64)
    held = load_partition(data_dir, record, 0, MAP_SIZE)
    try:
        assert held.get((-1).to_bytes(8, "big", signed=True)) == b'{"a":[1,2]}'
        assert held.get((2**63 - 1).to_bytes(8, "big", signed=True)) == '{"b":"é"}'.encode()
    finally:
        held.close()


def test_an_empty_partition_and_a_partition_of_only_hashed_keys_load(files_snapshot, data_dir) -> None:
    record = files_snapshot("sparse", 1, 2, {"a": 1})
    empty = 1 - _partition_of("a", 2)
    held = load_partition(data_dir, record, empty, MAP_SIZE)
    try:
        assert held.rows == 0 and held.get(b"a") is None
    finally:
        held.close()
    long_key = "x" * 600
    record = files_snapshot("long", 1, 1, {long_key: 1})
    held = load_partition(data_dir, record, 0, MAP_SIZE)
    try:
        assert held.rows == 1 and held.get(long_key.encode()) == b"1"
    finally:
        held.close()


@pytest.mark.parametrize("algorithm", ["sha256", "crc32", "blake2b"])
def test_checksum_algorithms(files_snapshot, data_dir, algorithm: str) -> None:
    record = files_snapshot("bookings", 1, 1, ROWS, algorithm=algorithm)
    held = load_partition(data_dir, record, 0, MAP_SIZE, link=False)
    try:
        assert held.rows == len(ROWS)
    finally:
        held.close()


def test_the_marker_names_the_format_and_the_file(files_snapshot, data_dir) -> None:
    record = files_snapshot("bookings", 7, 2, ROWS)
    held = load_partition(data_dir, record, 1, MAP_SIZE)
    held.close()
    marker = json.loads((held.path / MARKER).read_text())
    assert marker["format"] == FORMAT_2 and marker["rows"] == held.rows
    assert marker["checksum"] == checksum_of(data_file(record, 1))
    assert marker["bytes"] == data_file(record, 1).stat().st_size


def test_a_version_written_by_the_cores_builder_and_manifest_loads(snapshot_root: Path, data_dir: Path) -> None:
    # The pipeline's side of the contract (keyroute.storage: PartitionFileBuilder, Manifest, Checksum) and
    # this node's side agree: what one writes the other serves.
    from keyroute.storage.lmdb_layout import build_partition_rows
    from keyroute.storage.snapshot import FORMAT_2 as CORE_FORMAT_2
    from keyroute.storage.snapshot import Manifest, checksum_file, write_manifest
    from keyroute.storage.snapshot import data_file as data_name

    snapshot = version_dir(str(snapshot_root), "core", 3)
    per_partition: dict[int, list[tuple[bytes, bytes]]] = {0: [], 1: []}
    for text, value in ROWS.items():
        per_partition[_partition_of(text, 2)].append((text.encode(), _value_bytes(value)))
    checksums, sizes = {}, {}
    for p, rows in per_partition.items():
        built = build_partition_rows(rows, snapshot_root)
        (snapshot / data_name(p)).parent.mkdir(parents=True)
        shutil.move(built.path, snapshot / data_name(p))
        checksum = checksum_file(snapshot / data_name(p))
        checksums[p], sizes[p] = checksum.value, checksum.size
    manifest = Manifest(
        store="core",
        version=3,
        partitions=2,
        partitioner=Partitioner.MURMUR2,
        key_format=KeyFormat.STRING,
        value_columns=("n", "name"),
        rows=(len(per_partition[0]), len(per_partition[1])),
        files={p: (data_name(p),) for p in range(2)},
        created_at=1.0,
        format=CORE_FORMAT_2,
        checksums=checksums,
        bytes=sizes,
    )
    write_manifest(snapshot, manifest)
    record = StoreRecord("core", 2, Partitioner.MURMUR2, KeyFormat.STRING, 3, str(snapshot), ("n", "name"))
    for p in range(2):
        held = load_partition(data_dir, record, p, MAP_SIZE)
        try:
            _assert_serves_exactly(held, ROWS, 2)
        finally:
            held.close()


# -- failures: a clear LoadError, nothing on disk --------------------------------------------------------


@pytest.mark.parametrize("link", [True, False])
def test_a_corrupted_byte_fails_on_its_checksum(files_snapshot, data_dir, link: bool) -> None:
    record = files_snapshot("bookings", 1, 2, ROWS)
    source = data_file(record, 0)
    raw = bytearray(source.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    source.write_bytes(bytes(raw))  # same size, one bit off
    with pytest.raises(LoadError, match="checksum") as failure:
        load_partition(data_dir, record, 0, MAP_SIZE, link=link)
    assert str(source) in str(failure.value) and "bookings v1 p0" in str(failure.value)
    assert _files_under(data_dir) == []
    assert source.read_bytes() == bytes(raw) and source.stat().st_nlink == 1


@pytest.mark.parametrize("link", [True, False])
def test_a_truncated_file_fails_on_its_size(files_snapshot, data_dir, link: bool) -> None:
    record = files_snapshot("bookings", 1, 2, ROWS)
    source = data_file(record, 1)
    size = source.stat().st_size
    os.truncate(source, size - 4096)
    with pytest.raises(LoadError, match=rf"size {size - 4096} bytes vs manifest {size}") as failure:
        load_partition(data_dir, record, 1, MAP_SIZE, link=link)
    assert str(source) in str(failure.value)
    assert _files_under(data_dir) == []


def test_a_file_of_another_partition_is_refused_by_its_keys(files_snapshot, data_dir) -> None:
    record = files_snapshot("bookings", 1, 2, ROWS)
    # Partition 0's file published as partition 1's, its manifest entry matching it (size, checksum, rows).
    shutil.copyfile(data_file(record, 0), data_file(record, 1))
    reseal(record, 1)
    zero = sum(1 for k in ROWS if _partition_of(k, 2) == 0)
    edit_manifest(record, lambda doc: doc["rows"].__setitem__(1, zero))
    with pytest.raises(LoadError, match=r"belongs to partition 0 \(murmur2, 2 partitions\), not 1") as failure:
        load_partition(data_dir, record, 1, MAP_SIZE)
    named = str(failure.value).split("key ", 1)[1].split(" belongs", 1)[0]
    assert _partition_of(json.loads(named.replace("'", '"')), 2) == 0
    assert str(data_file(record, 1)) in str(failure.value)
    assert _files_under(data_dir) == []


def test_a_file_built_with_another_partitioner_is_refused(files_snapshot, data_dir) -> None:
    record = files_snapshot("bookings", 1, 4, ROWS, built_with=Partitioner.CRC32)
    with pytest.raises(LoadError, match="belongs to partition"):
        load_partition(data_dir, record, 0, MAP_SIZE)
    assert _files_under(data_dir) == []


def test_a_row_count_mismatch_fails(files_snapshot, data_dir) -> None:
    record = files_snapshot("bookings", 1, 2, ROWS)
    rows = sum(1 for k in ROWS if _partition_of(k, 2) == 1)
    edit_manifest(record, lambda doc: doc["rows"].__setitem__(1, rows + 1))
    with pytest.raises(LoadError, match=rf"{rows} rows vs manifest {rows + 1}") as failure:
        load_partition(data_dir, record, 1, MAP_SIZE)
    assert str(data_file(record, 1)) in str(failure.value)
    assert _files_under(data_dir) == []


def test_a_missing_file_fails(files_snapshot, data_dir) -> None:
    record = files_snapshot("bookings", 1, 2, ROWS)
    data_file(record, 0).unlink()
    with pytest.raises(LoadError, match="missing"):
        load_partition(data_dir, record, 0, MAP_SIZE)
    assert _files_under(data_dir) == []


def test_a_file_that_is_not_lmdb_fails(files_snapshot, data_dir) -> None:
    record = files_snapshot("bookings", 1, 1, ROWS)
    data_file(record, 0).write_bytes(b"\x07" * 8192)
    reseal(record, 0)
    with pytest.raises(LoadError, match="does not open as an LMDB environment"):
        load_partition(data_dir, record, 0, MAP_SIZE)
    assert _files_under(data_dir) == []


def test_an_unknown_checksum_algorithm_fails(files_snapshot, data_dir) -> None:
    record = files_snapshot("bookings", 1, 1, ROWS)
    edit_manifest(record, lambda doc: doc["checksums"].__setitem__("0", "rot13:00ff"))
    with pytest.raises(LoadError, match="'rot13' is not supported"):
        load_partition(data_dir, record, 0, MAP_SIZE)
    assert _files_under(data_dir) == []


@pytest.mark.parametrize("link", [True, False])
def test_a_cancelled_load_leaves_nothing_behind(files_snapshot, data_dir, link: bool) -> None:
    record = files_snapshot("bookings", 1, 1, ROWS)
    with pytest.raises(LoadCancelled):
        load_partition(data_dir, record, 0, MAP_SIZE, cancelled=lambda: True, link=link)
    assert _files_under(data_dir) == []
    assert data_file(record, 0).stat().st_nlink == 1


# -- restart, and the two formats never mistaken for each other -------------------------------------------


def test_a_restart_reuses_the_loaded_file_without_fetching(files_snapshot, data_dir) -> None:
    record = files_snapshot("bookings", 1, 2, ROWS)
    load_partition(data_dir, record, 0, MAP_SIZE, link=False).close()
    loaded = _loaded(data_dir, record, 0)
    inode = loaded.stat().st_ino
    data_file(record, 0).unlink()  # only the node's own copy can still answer
    held = load_partition(data_dir, record, 0, MAP_SIZE)
    try:
        assert loaded.stat().st_ino == inode
        _assert_serves_exactly(held, ROWS, 2)
    finally:
        held.close()


def test_a_hard_linked_file_outlives_the_snapshots_removal(files_snapshot, data_dir) -> None:
    record = files_snapshot("bookings", 1, 1, ROWS)
    load_partition(data_dir, record, 0, MAP_SIZE).close()
    shutil.rmtree(local_path(record.snapshot) / "partition=0")  # the pipeline collected the old version
    held = load_partition(data_dir, record, 0, MAP_SIZE)
    try:
        _assert_serves_exactly(held, ROWS, 1)
    finally:
        held.close()


def test_a_damaged_loaded_file_is_fetched_again(files_snapshot, data_dir) -> None:
    record = files_snapshot("bookings", 1, 1, ROWS)
    load_partition(data_dir, record, 0, MAP_SIZE, link=False).close()
    loaded = _loaded(data_dir, record, 0)
    os.truncate(loaded, loaded.stat().st_size - 4096)  # a crash or a full disk since
    held = load_partition(data_dir, record, 0, MAP_SIZE)
    try:
        assert loaded.stat().st_ino == data_file(record, 0).stat().st_ino  # fetched again (linked now)
        _assert_serves_exactly(held, ROWS, 1)
    finally:
        held.close()


def test_a_format_1_directory_is_not_reused_for_format_2_nor_the_reverse(snapshot_root, data_dir) -> None:
    rows = {k: v for k, v in list(ROWS.items())[:50]}
    v1 = write_snapshot(snapshot_root, "s", 1, 1, rows)  # format 1: JSON lines
    held = load_partition(data_dir, v1, 0, MAP_SIZE)
    held.close()
    assert "format" not in json.loads((held.path / MARKER).read_text())  # as format-1 markers always were
    # The same version republished in format 2, every other field of the manifest the same.
    shutil.rmtree(local_path(v1.snapshot))
    v2 = write_files_snapshot(snapshot_root, "s", 1, 1, rows)
    held = load_partition(data_dir, v2, 0, MAP_SIZE)
    try:
        assert _loaded(data_dir, v2, 0).stat().st_ino == data_file(v2, 0).stat().st_ino  # fetched, not reused
        _assert_serves_exactly(held, rows, 1)
    finally:
        held.close()
    # And back to format 1: the linked format-2 file is not taken for rows loaded from JSON lines.
    shutil.rmtree(local_path(v2.snapshot))
    write_snapshot(snapshot_root, "s", 1, 1, rows)
    held = load_partition(data_dir, v1, 0, MAP_SIZE)
    try:
        assert "format" not in json.loads((held.path / MARKER).read_text())
        _assert_serves_exactly(held, rows, 1)
    finally:
        held.close()


def test_format_1_snapshots_still_load_row_by_row(snapshot, data_dir) -> None:
    record = snapshot("bookings", 1, 2, ROWS)
    held = load_partition(data_dir, record, 0, MAP_SIZE)
    try:
        _assert_serves_exactly(held, ROWS, 2)
    finally:
        held.close()


# -- the fetch itself ---------------------------------------------------------------------------------------


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(fetch, "CHUNK_BYTES", 4096)
    return 4096


def _source_file(tmp_path: Path, size: int = 10 * 4096 + 123) -> tuple[Path, bytes, str]:
    folder = tmp_path / "src" / "partition=0"
    folder.mkdir(parents=True)
    data = os.urandom(size)
    (folder / "data.mdb").write_bytes(data)
    return tmp_path / "src", data, f"sha256:{hashlib.sha256(data).hexdigest()}"


@pytest.mark.parametrize("how", ["link", "copy", "download"])
def test_fetch_file_moves_and_checks_the_bytes(tmp_path: Path, small_chunks: int, how: str) -> None:
    root, data, checksum = _source_file(tmp_path)
    dest = tmp_path / "dest" / "data.mdb"
    dest.parent.mkdir()
    source: Path | ArrowLocation = root
    if how == "download":
        from pyarrow import fs as arrow_fs

        source = ArrowLocation(arrow_fs.LocalFileSystem(), str(root), uri=f"test://{root}")
    got = fetch_file(source, "partition=0/data.mdb", dest, size=len(data), checksum=checksum, link=how == "link")
    assert got.method == how and got.size == len(data) and got.checksum == checksum
    assert dest.read_bytes() == data
    assert (dest.stat().st_ino == (root / "partition=0" / "data.mdb").stat().st_ino) is (how == "link")


@pytest.mark.parametrize("how", ["link", "copy", "download"])
def test_fetch_file_refuses_a_wrong_checksum_or_size(tmp_path: Path, small_chunks: int, how: str) -> None:
    root, data, checksum = _source_file(tmp_path)
    dest = tmp_path / "dest" / "data.mdb"
    dest.parent.mkdir()
    source: Path | ArrowLocation = root
    if how == "download":
        from pyarrow import fs as arrow_fs

        source = ArrowLocation(arrow_fs.LocalFileSystem(), str(root), uri="s3://bucket/v1")
    link = how == "link"
    wrong = "sha256:" + "0" * 64
    with pytest.raises(FetchError, match=r"partition=0/data.mdb: checksum sha256:[0-9a-f]{64} vs manifest sha256:0+$"):
        fetch_file(source, "partition=0/data.mdb", dest, size=len(data), checksum=wrong, link=link)
    assert not dest.exists()
    chunks: list[int] = []

    def counting() -> bool:
        chunks.append(1)
        return False

    with pytest.raises(FetchError, match=rf"size (at least )?{len(data)} bytes vs manifest {len(data) - 1}"):
        fetch_file(
            source, "partition=0/data.mdb", dest, size=len(data) - 1, checksum=checksum, link=link, cancelled=counting
        )
    assert not dest.exists()
    # A local file's size is known before anything moves; a download stops at the first byte too many.
    assert len(chunks) == (len(data) // small_chunks + 1 if how == "download" else 0)
    with pytest.raises(FetchError, match=rf"size {len(data)} bytes vs manifest {len(data) + 1}"):
        fetch_file(source, "partition=0/data.mdb", dest, size=len(data) + 1, checksum=checksum, link=link)
    assert not dest.exists()
    if how == "download":
        with pytest.raises(FetchError, match=r"s3://bucket/v1/partition=1/data.mdb is missing"):
            fetch_file(source, "partition=1/data.mdb", dest, size=1, checksum=checksum)


@pytest.mark.parametrize("how", ["link", "copy", "download"])
def test_fetch_file_is_cancelled_between_chunks(tmp_path: Path, small_chunks: int, how: str) -> None:
    root, data, checksum = _source_file(tmp_path)
    dest = tmp_path / "dest" / "data.mdb"
    dest.parent.mkdir()
    source: Path | ArrowLocation = root
    if how == "download":
        from pyarrow import fs as arrow_fs

        source = ArrowLocation(arrow_fs.LocalFileSystem(), str(root))
    asked = []

    def cancelled() -> bool:
        asked.append(dest.stat().st_size if dest.exists() else 0)
        return len(asked) > 3  # three chunks in

    with pytest.raises(FetchCancelled):
        fetch_file(
            source,
            "partition=0/data.mdb",
            dest,
            size=len(data),
            checksum=checksum,
            cancelled=cancelled,
            link=how == "link",
        )
    assert len(asked) == 4 and not dest.exists()
    assert (root / "partition=0" / "data.mdb").read_bytes() == data


@pytest.mark.parametrize("refused", [(), ("copy_file_range",), ("copy_file_range", "sendfile")])
def test_a_copy_takes_the_next_way_when_the_kernel_refuses_one(
    tmp_path: Path, small_chunks: int, monkeypatch: pytest.MonkeyPatch, refused: tuple[str, ...]
) -> None:
    """copy_file_range, else sendfile (between filesystems), else a streamed copy: the same bytes, checked."""
    root, data, checksum = _source_file(tmp_path)
    used: list[str] = []

    def way(name: str, copy: Any) -> Any:
        def run(src_fd: int, out_fd: int, count: int, offset: int) -> int:
            used.append(name)
            if name in refused:
                raise OSError(errno.EXDEV, "Invalid cross-device link")
            return copy(src_fd, out_fd, count, offset)

        return run

    ways = [way("copy_file_range", fetch._copy_file_range), way("sendfile", fetch._sendfile)]
    monkeypatch.setattr(fetch, "_kernel_copies", lambda: ways)
    dest = tmp_path / "dest" / "data.mdb"
    dest.parent.mkdir()
    got = fetch_file(root, "partition=0/data.mdb", dest, size=len(data), checksum=checksum, link=False)
    assert got.method == "copy" and dest.read_bytes() == data
    chunks = -(-len(data) // small_chunks)
    expected_calls = {name: (1 if name in refused else chunks + 1) for name in ("copy_file_range", "sendfile")}
    if not refused:
        expected_calls["sendfile"] = 0
    assert {name: used.count(name) for name in expected_calls} == expected_calls
    # A way that fails after bytes moved (a full disk, an I/O error) fails the fetch; nothing is left behind.
    dest.unlink()
    calls = 0

    def breaks_midway(src_fd: int, out_fd: int, count: int, offset: int) -> int:
        nonlocal calls
        calls += 1
        if calls > 2:
            raise OSError(errno.EIO, "Input/output error")
        return fetch._copy_file_range(src_fd, out_fd, count, offset)

    monkeypatch.setattr(fetch, "_kernel_copies", lambda: [breaks_midway])
    with pytest.raises(FetchError, match="Input/output error"):
        fetch_file(root, "partition=0/data.mdb", dest, size=len(data), checksum=checksum, link=False)
    assert not dest.exists()


def test_a_kernel_copy_of_a_corrupted_file_is_refused(tmp_path: Path, small_chunks: int) -> None:
    root, data, checksum = _source_file(tmp_path)
    source = root / "partition=0" / "data.mdb"
    corrupted = bytearray(data)
    corrupted[len(data) // 2] ^= 0x01
    source.write_bytes(bytes(corrupted))
    dest = tmp_path / "dest" / "data.mdb"
    dest.parent.mkdir()
    with pytest.raises(FetchError, match=r"partition=0/data.mdb: checksum sha256:[0-9a-f]{64} vs manifest "):
        fetch_file(root, "partition=0/data.mdb", dest, size=len(data), checksum=checksum, link=False)
    assert not dest.exists()


def test_a_refused_hard_link_falls_back_to_a_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, data, checksum = _source_file(tmp_path)
    dest = tmp_path / "dest" / "data.mdb"
    dest.parent.mkdir()

    def refuse(src: Any, dst: Any) -> None:
        raise OSError(18, "Invalid cross-device link")  # EXDEV: another mount of the same device

    monkeypatch.setattr(fetch.os, "link", refuse)
    got = fetch_file(root, "partition=0/data.mdb", dest, size=len(data), checksum=checksum)
    assert got.method == "copy" and dest.read_bytes() == data


# -- the key sample -----------------------------------------------------------------------------------------


KEY_SHAPES = {
    "padded numbers": [f"customer-{i:06d}".encode() for i in range(5000)],
    "plain numbers": [f"user{i}".encode() for i in range(5000)],
    "uuids": [str(uuid.UUID(int=random.Random(i).getrandbits(128))).encode() for i in range(5000)],
    "random bytes": [random.Random(i).randbytes(8) for i in range(5000)],
}


@pytest.mark.parametrize("shape", KEY_SHAPES)
def test_the_key_sample_is_spread_through_the_file(tmp_path: Path, shape: str) -> None:
    keys = KEY_SHAPES[shape]
    build_data_file(tmp_path / "env" / "data.mdb", {k: b"1" for k in [*keys, b"z" * 600]})  # one hashed key
    env = lmdb.open(str(tmp_path / "env"), readonly=True, lock=False, max_dbs=0)
    try:
        with env.begin(buffers=False) as txn:
            sample = sample_keys(txn, 64)
    finally:
        env.close()
    assert len(sample) == len(set(sample)) == 64
    assert all(k.startswith(b"=") for k in sample)
    position = {key: i for i, key in enumerate(sorted(keys))}
    places = sorted(position[k[1:]] for k in sample)
    assert places[0] == 0 and places[-1] == len(keys) - 1
    assert {p * 10 // len(keys) for p in places} == set(range(10))  # some of it in every tenth of the file


# -- timeline (history and windowed) files ---------------------------------------------------------------


HISTORY = {"kind": "history", "column": "ts", "time_type": "integer"}


def write_timeline_snapshot(
    files_snapshot: Callable[..., StoreRecord], rows: Mapping[str, list[int]], partitions: int = 2
) -> StoreRecord:
    """A history store version: key text -> its rows' times, one entry per time (value {"ts": t})."""
    record = files_snapshot("trips", 1, partitions, {})
    counts = [0] * partitions
    for p in range(partitions):
        entries = {}
        for text, times in rows.items():
            if _partition_of(text, partitions) == p:
                for index, time in enumerate(sorted(times)):
                    entries[entry_key(key_part(text.encode()), time, index)] = _value_bytes({"ts": time})
                counts[p] += len(times)
        path = data_file(record, p)
        path.unlink()
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            env = lmdb.open(tmp, subdir=True, max_dbs=0, map_size=1 << 26)
            with env.begin(write=True) as txn:
                txn.cursor().putmulti(sorted(entries.items()), append=True)
            (Path(tmp) / "c").mkdir()
            env.copy(str(Path(tmp) / "c"), compact=True)
            env.close()
            os.replace(Path(tmp) / "c" / "data.mdb", path)
        reseal(record, p)

    def change(doc: dict[str, Any]) -> None:
        doc["timeline"] = HISTORY
        doc["rows"] = counts
        doc["total_rows"] = sum(counts)

    edit_manifest(record, change)
    return dataclasses.replace(record, timeline=Timeline.from_dict(HISTORY))


def test_a_timeline_partition_loads_and_answers_its_entries(files_snapshot, data_dir) -> None:
    rows = {"alice": [5, 1, 9], "bob": [2], "a/b": [7, 7]}
    record = write_timeline_snapshot(files_snapshot, rows)
    for partition in range(2):
        held = load_partition(data_dir, record, partition, MAP_SIZE)
        try:
            assert held.timeline is not None and held.timeline.kind is StoreKind.HISTORY
            for text, times in rows.items():
                if _partition_of(text, 2) != partition:
                    continue
                found, more = held.entries(text.encode(), None, None, 100)
                assert [time for time, _, _ in found] == sorted(times) and not more
                assert held.get(text.encode()) == _value_bytes({"ts": max(times)})
        finally:
            held.close()


def test_a_value_file_published_as_a_timeline_is_refused(files_snapshot, data_dir) -> None:
    record = files_snapshot("bookings", 1, 2, ROWS)
    edit_manifest(record, lambda doc: doc.__setitem__("timeline", HISTORY))
    with pytest.raises(LoadError, match="is not a timeline entry") as failure:
        load_partition(data_dir, dataclasses.replace(record, timeline=Timeline.from_dict(HISTORY)), 0, MAP_SIZE)
    assert str(data_file(record, 0)) in str(failure.value)
    assert _files_under(data_dir) == []


def test_a_timeline_file_of_another_partition_is_refused_by_its_keys(files_snapshot, data_dir) -> None:
    rows = {f"k{i}": [i, i + 1] for i in range(20)}
    record = write_timeline_snapshot(files_snapshot, rows)
    shutil.copyfile(data_file(record, 0), data_file(record, 1))
    reseal(record, 1)
    zero = sum(len(times) for text, times in rows.items() if _partition_of(text, 2) == 0)
    edit_manifest(record, lambda doc: doc["rows"].__setitem__(1, zero))
    with pytest.raises(LoadError, match=r"belongs to partition 0 \(murmur2, 2 partitions\), not 1"):
        load_partition(data_dir, record, 1, MAP_SIZE)
    assert _files_under(data_dir) == []
