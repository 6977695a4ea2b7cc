"""Snapshot format 2 in the core, without Spark: the manifest of both formats, the checksum helper the
pipeline and the nodes share, the LMDB layout, and writing and listing versions on a pyarrow filesystem."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import zlib
from pathlib import Path

import lmdb
import pyarrow as pa
import pyarrow.fs as arrow_fs
import pytest

from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.storage import lmdb_layout
from keyroute.storage.lmdb_layout import (
    KEY_ENCODING,
    LMDB_MAX_KEY_BYTES,
    PartitionFileBuilder,
    build_partition_file,
    build_partition_rows,
    db_key,
    db_keys,
    key_of,
)
from keyroute.storage.snapshot import (
    CHECKSUM_ALGORITHM,
    FORMAT_1,
    FORMAT_2,
    ArrowLocation,
    Checksum,
    Manifest,
    SnapshotError,
    checksum_file,
    compact_json,
    compact_value,
    copy_checksummed,
    data_file,
    iter_partition,
    parse_checksum,
    read_manifest,
    version_uri,
    write_manifest,
)
from tests.memory_fs import memory_filesystem

BASE = dict(
    store="s",
    version=7,
    partitions=3,
    partitioner=Partitioner.CRC32,
    key_format=KeyFormat.INT64,
    value_columns=("a", "b"),
    rows=(2, 0, 5),
    created_at=1700000000.5,
)


def format_2(**changes: object) -> Manifest:
    fields: dict[str, object] = dict(
        BASE,
        format=FORMAT_2,
        files={p: (data_file(p),) for p in range(3)},
        checksums={0: "crc32:0a0b0c0d", 1: "crc32:12345678", 2: "sha256:" + "ab" * 32},
        bytes={0: 12288, 1: 8192, 2: 40960},
    )
    fields.update(changes)
    return Manifest(**fields)  # type: ignore[arg-type]


# --- the manifest ----------------------------------------------------------------------------------------


def test_a_format_1_manifest_round_trips_and_has_no_format_2_fields() -> None:
    manifest = Manifest(**BASE, files={0: ("partition=0/part-00000.json",)})  # type: ignore[arg-type]
    assert manifest.format == FORMAT_1 and manifest.checksums == {} and manifest.bytes == {}
    doc = json.loads(manifest.to_json())
    # Exactly the fields format 1 always had: readers of format 1 see nothing new.
    assert set(doc) == {
        "format",
        "store",
        "version",
        "partitions",
        "partitioner",
        "key_format",
        "value_columns",
        "rows",
        "total_rows",
        "files",
        "created_at",
    }
    assert doc["format"] == "keyroute-snapshot/1"
    assert Manifest.from_json(manifest.to_json()) == manifest


def test_a_manifest_written_before_format_2_still_reads() -> None:
    old = {
        "format": "keyroute-snapshot/1",
        "store": "s",
        "version": 1,
        "partitions": 2,
        "partitioner": "murmur2",
        "key_format": "string",
        "value_columns": ["v"],
        "rows": [1, 0],
        "total_rows": 1,
        "files": {"0": ["partition=0/part-0.json"], "1": []},
        "created_at": 5.0,
    }
    manifest = Manifest.from_json(json.dumps(old).encode())
    assert (manifest.format, manifest.rows, manifest.checksums, manifest.bytes) == (FORMAT_1, (1, 0), {}, {})


def test_a_format_2_manifest_round_trips() -> None:
    manifest = format_2()
    doc = json.loads(manifest.to_json())
    assert doc["format"] == "keyroute-snapshot/2"
    assert doc["files"] == {"0": ["partition=0/data.mdb"], "1": ["partition=1/data.mdb"], "2": ["partition=2/data.mdb"]}
    assert doc["checksums"]["1"] == "crc32:12345678" and doc["bytes"] == {"0": 12288, "1": 8192, "2": 40960}
    assert doc["total_rows"] == 7
    again = Manifest.from_json(manifest.to_json())
    assert again == manifest
    assert again.checksums[2] == "sha256:" + "ab" * 32 and again.bytes[0] == 12288


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"checksums": {0: "crc32:00000000", 1: "crc32:00000000"}}, "'checksums' must name every partition"),
        ({"bytes": {0: 1, 1: 2, 2: 3, 3: 4}}, "'bytes' must name every partition"),
        ({"files": {0: ("partition=0/data.mdb",), 1: ("partition=1/part-0.json",), 2: ("x",)}}, "partition 1 lists"),
        ({"checksums": {0: "crc32:zz", 1: "crc32:00", 2: "crc32:00"}}, "malformed checksum 'crc32:zz'"),
        ({"checksums": {0: "0a0b0c0d", 1: "crc32:00", 2: "crc32:00"}}, "malformed checksum '0a0b0c0d'"),
        ({"bytes": {0: 1, 1: -2, 2: 3}}, "negative size"),
    ],
)
def test_a_format_2_manifest_must_describe_every_file(change: dict[str, object], message: str) -> None:
    raw = format_2(**change).to_json()
    with pytest.raises(SnapshotError, match=message):
        Manifest.from_json(raw)


def test_a_format_2_manifest_without_checksums_is_malformed() -> None:
    doc = json.loads(format_2().to_json())
    del doc["checksums"]
    with pytest.raises(SnapshotError, match="manifest is malformed"):
        Manifest.from_json(json.dumps(doc).encode())


def test_unknown_formats_are_refused_naming_the_known_ones() -> None:
    with pytest.raises(SnapshotError, match="unsupported snapshot format 'keyroute-snapshot/3'.*keyroute-snapshot/2"):
        Manifest.from_json(b'{"format": "keyroute-snapshot/3"}')
    with pytest.raises(SnapshotError, match="unsupported snapshot format None"):
        Manifest.from_json(b"[1, 2]")


def test_format_2_partitions_are_not_rows_to_read(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match="ready-to-serve LMDB files"):
        list(iter_partition(tmp_path, format_2(), 0))


def test_compact_value_gives_the_bytes_format_1_yields() -> None:
    # Spark's JSON spells numbers the Java way and may escape; nodes serve Python's compact JSON.
    spark_json = '{"fare":1.0E-5,"big":12345678901234567890,"neg":-0.0,"s":"\\u00fc\\n\\"x\\"","n":null,"l":[1,2.5]}'
    assert compact_value(spark_json) == compact_json(json.loads(spark_json))
    assert compact_value(spark_json) == (
        b'{"fare":1e-05,"big":12345678901234567890,"neg":-0.0,"s":"\xc3\xbc\\n\\"x\\"","n":null,"l":[1,2.5]}'
    )
    assert compact_value(b'{ "a" : { "b" : [ ] } }') == b'{"a":{"b":[]}}'


# --- checksums ---------------------------------------------------------------------------------------------


def test_the_pipeline_writes_crc32() -> None:
    assert CHECKSUM_ALGORITHM == "crc32"
    checksum = Checksum()
    checksum.update(b"123456789")
    assert checksum.value == "crc32:cbf43926"  # the CRC-32 check value
    assert checksum.size == 9


@pytest.mark.parametrize("algorithm", ["crc32", "sha256", "blake2b"])
def test_a_checksum_over_chunks_is_the_checksum_of_the_whole(algorithm: str) -> None:
    data = random.Random(1).randbytes(100_003)
    whole = Checksum(algorithm)
    whole.update(data)
    chunked = Checksum(algorithm)
    for start in range(0, len(data), 4096):
        chunked.update(memoryview(data)[start : start + 4096])
    assert chunked.value == whole.value and chunked.size == whole.size == len(data)
    reference = f"{zlib.crc32(data):08x}" if algorithm == "crc32" else hashlib.new(algorithm, data).hexdigest()
    assert whole.value == f"{algorithm}:{reference}"
    assert whole.matches(whole.value.upper().replace(algorithm.upper(), algorithm))
    assert Checksum.like(whole.value).algorithm == algorithm


def test_checksums_catch_truncation_and_corruption() -> None:
    rng = random.Random(2)
    data = bytearray(rng.randbytes(64 * 1024)) + bytes(8192)  # a zero tail, like an LMDB page's slack

    def value(blob: bytes | bytearray) -> str:
        checksum = Checksum()
        checksum.update(blob)
        return checksum.value

    good = value(data)
    assert value(data[:-1]) != good and value(data[:-4096]) != good  # truncated (even by zero bytes)
    assert value(data + b"\0") != good  # extended by a zero byte
    for _ in range(200):
        flipped = bytearray(data)
        flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        assert value(flipped) != good
    swapped = data[4096:8192] + data[:4096] + data[8192:]  # two pages in the wrong order
    assert value(swapped) != good


def test_checksum_strings_are_checked() -> None:
    assert parse_checksum(" CRC32:0A0B0C0D ") == ("crc32", "0a0b0c0d")
    for bad in ("crc32", "crc32:", ":00", "crc32:xyz", ""):
        with pytest.raises(SnapshotError, match="malformed checksum"):
            parse_checksum(bad)
    with pytest.raises(SnapshotError, match="'md5' is not supported"):
        Checksum("md5")
    with pytest.raises(SnapshotError, match="not supported"):
        Checksum.like("crc64nvme:00")


def test_files_are_checksummed_and_copied_in_one_pass(tmp_path: Path) -> None:
    source = tmp_path / "data.mdb"
    source.write_bytes(random.Random(3).randbytes(9 << 20))  # more than two read chunks
    copied = bytearray()
    during_copy = copy_checksummed(source, copied.extend)
    assert bytes(copied) == source.read_bytes()
    assert during_copy.value == checksum_file(source).value == f"crc32:{zlib.crc32(source.read_bytes()):08x}"
    assert during_copy.size == checksum_file(source, "sha256").size == 9 << 20


# --- the LMDB layout ----------------------------------------------------------------------------------------


def test_db_key_tags_short_keys_and_hashes_long_ones() -> None:
    assert KEY_ENCODING == 2 and LMDB_MAX_KEY_BYTES == 511
    assert db_key(b"") == b"="
    assert db_key(b"k" * 510) == b"=" + b"k" * 510
    assert db_key(b"k" * 511) == b"#" + hashlib.sha256(b"k" * 511).digest()
    assert key_of(db_key(b"abc")) == b"abc" and key_of(db_key(b"k" * 600)) is None


def test_db_keys_is_db_key_for_a_whole_batch() -> None:
    rng = random.Random(4)
    short = [rng.randbytes(rng.randrange(0, 40)) for _ in range(500)] + [b"", bytes(range(256))]
    assert db_keys(pa.array(short, pa.binary())).to_pylist() == [db_key(k) for k in short]
    mixed = [*short[:10], None, b"x" * 510, b"x" * 511, b"y" * 2000]
    assert db_keys(pa.array(mixed, pa.binary())).to_pylist() == [None if k is None else db_key(k) for k in mixed]
    assert db_keys(pa.array(mixed, pa.large_binary())).type == pa.binary()
    assert db_keys(pa.array([], pa.binary())).to_pylist() == []
    assert db_keys(pa.array([None], pa.binary())).to_pylist() == [None]


def read_env(folder: Path) -> list[tuple[bytes, bytes]]:
    env = lmdb.open(str(folder), readonly=True, lock=False, subdir=True, max_dbs=0)
    try:
        with env.begin() as txn:
            return [(bytes(k), bytes(v)) for k, v in txn.cursor()]
    finally:
        env.close()


def test_a_partition_file_holds_the_rows_in_lmdb_order(tmp_path: Path) -> None:
    rng = random.Random(5)
    rows = [(rng.randbytes(rng.randrange(1, 30)), b'{"i":%d}' % i) for i in range(3000)]
    rows += [(b"long" * 200, b'{"long":true}'), (b"", b'{"empty":true}')]
    rows = list(dict(rows).items())  # unique keys
    built = build_partition_rows(rows, tmp_path)
    assert built.rows == len(rows) and built.path.name == "data.mdb"
    assert sorted(os.listdir(built.path.parent)) == ["data.mdb"]  # compacted copy only: no lock file
    entries = read_env(built.path.parent)
    assert entries == sorted((db_key(k), v) for k, v in rows)
    assert entries[0][0][:1] == b"#"  # hashed keys sort before every tagged key
    # The same entries always give the same bytes (a retried task rewrites an identical file).
    again = build_partition_rows(reversed(rows), tmp_path)
    assert again.path.read_bytes() == built.path.read_bytes()


def test_an_empty_partition_file_opens_with_no_entries(tmp_path: Path) -> None:
    built = build_partition_file([], tmp_path)
    assert built.rows == 0 and read_env(built.path.parent) == []
    assert built.path.stat().st_size == 2 * 4096  # the two meta pages


@pytest.mark.parametrize(
    "entries",
    [[(b"=b", b"1"), (b"=a", b"2")], [(b"=a", b"1"), (b"=a", b"2")]],
    ids=["out of order", "repeated key"],
)
def test_keys_out_of_order_fail_the_partition_and_leave_nothing(tmp_path: Path, entries: list) -> None:
    with pytest.raises(SnapshotError, match="out of LMDB key order or repeat a key"):
        build_partition_file(entries, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_builder_takes_entries_in_several_batches(tmp_path: Path) -> None:
    builder = PartitionFileBuilder(tmp_path)
    builder.add([(b"=a", b"1"), (b"=b", b"2")])
    builder.add(iter([(b"=c", b"3")]))
    with pytest.raises(SnapshotError, match="1 of 1 entries"):
        builder.add([(b"=b", b"again")])  # not after "=c"
    builder.discard()
    assert list(tmp_path.iterdir()) == []


def compacted_copy(path: Path, folder: Path) -> Path:
    """LMDB's own compacting copy of the file `path` (what builders published before they built in place)."""
    folder.mkdir()
    # The builders' map size: a copy's meta pages record the map size of the environment it was made from.
    env = lmdb.open(str(path), readonly=True, lock=False, subdir=False, max_dbs=0, map_size=lmdb_layout.BUILD_MAP_SIZE)
    try:
        env.copy(str(folder / "data.mdb"), compact=True)  # subdir=False: the path is the copy's file
    finally:
        env.close()
    return folder / "data.mdb"


def test_a_file_built_in_key_order_is_as_dense_as_its_compacting_copy(tmp_path: Path) -> None:
    rng = random.Random(11)
    # Values of every size: small ones share leaf pages, large ones get overflow pages of their own.
    rows = [(b"k%06d" % i, rng.randbytes(rng.choice([5, 60, 700, 3000, 9000]))) for i in range(4000)]
    built = build_partition_rows(rows, tmp_path)
    compact = compacted_copy(built.path, tmp_path / "compact")
    assert built.path.stat().st_size == compact.stat().st_size
    assert read_env(built.path.parent) == read_env(compact.parent) == sorted((db_key(k), v) for k, v in rows)


def test_a_builder_builds_straight_into_the_file_it_is_given(tmp_path: Path) -> None:
    entries = sorted((db_key(b"key-%d" % i), b'{"i":%d}' % i) for i in range(5000))
    target = tmp_path / "partition=3" / ".data.mdb.tmp"
    target.parent.mkdir()
    builder = PartitionFileBuilder.into(target)
    builder.add(entries[:1234])
    builder.add(entries[1234:])
    built = builder.finish()
    assert (built.path, built.rows) == (target, len(entries))
    assert os.listdir(target.parent) == [target.name]  # no lock file, nothing else
    # The same bytes as a file built in a scratch directory (the same entries give the same file).
    assert target.read_bytes() == build_partition_file(entries, tmp_path).path.read_bytes()
    builder.discard()  # once the caller is done with it (a publisher renames it first)
    assert not target.exists()


def test_a_builder_never_writes_into_an_existing_file(tmp_path: Path) -> None:
    target = tmp_path / "data.mdb"
    target.write_bytes(b"someone else's")
    with pytest.raises(FileExistsError):
        PartitionFileBuilder.into(target)
    assert target.read_bytes() == b"someone else's"


def test_an_abandoned_build_in_place_leaves_no_file(tmp_path: Path) -> None:
    target = tmp_path / "data.mdb.tmp"
    with pytest.raises(SnapshotError), PartitionFileBuilder.into(target) as builder:
        builder.add([(b"=b", b"1"), (b"=a", b"2")])
    assert list(tmp_path.iterdir()) == []


def test_pages_left_free_are_seen_and_compacted_away(tmp_path: Path) -> None:
    # A file whose second transaction rewrote its pages has free ones: not dense.
    path = tmp_path / "two-commits.mdb"
    env = lmdb.open(str(path), subdir=False, lock=False, max_dbs=0, map_size=1 << 30)
    try:
        with env.begin(write=True) as txn:
            for i in range(2000):
                txn.put(b"=%06d" % i, b"x" * 100)
        assert lmdb_layout.is_dense(env, path)
        with env.begin(write=True) as txn:
            for i in range(0, 2000, 2):
                txn.delete(b"=%06d" % i)
        assert not lmdb_layout.is_dense(env, path)
    finally:
        env.close()


def test_a_file_that_is_not_dense_is_replaced_by_its_compacting_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entries = [(db_key(b"%05d" % i), b"v" * 50) for i in range(3000)]
    expected = build_partition_file(entries, tmp_path).path
    checked: list[Path] = []

    def never_dense(env: lmdb.Environment, path: Path) -> bool:
        checked.append(path)
        return False

    monkeypatch.setattr(lmdb_layout, "is_dense", never_dense)
    built = build_partition_file(entries, tmp_path)
    assert checked == [built.path]
    assert sorted(os.listdir(built.path.parent)) == ["data.mdb"]  # the copy took the file's place
    assert built.path.read_bytes() == compacted_copy(expected, tmp_path / "compact").read_bytes()
    assert read_env(built.path.parent) == entries


# --- versions on a pyarrow filesystem ----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["mock", "local"])
def test_a_manifest_is_written_and_read_through_a_pyarrow_filesystem(kind: str, tmp_path: Path) -> None:
    if kind == "mock":
        where = ArrowLocation(memory_filesystem(), "bucket/out/s/v000007", uri="mock://bucket/out/s/v000007")
    else:
        where = ArrowLocation(arrow_fs.LocalFileSystem(), str(tmp_path / "s" / "v000007"))
    assert not where.exists() and where.names() == []
    write_manifest(where, format_2())
    assert where.exists()
    assert [name for name, _ in where.names()] == ["manifest.json"]  # no temporary file left over
    assert read_manifest(where) == format_2()
    write_manifest(where, dataclasses.replace(format_2(), rows=(1, 1, 1)))  # replaced whole
    assert read_manifest(where).rows == (1, 1, 1)
    where.at("partition=0").write_bytes("data.mdb", b"x")
    assert where.names() == [("manifest.json", False), ("partition=0", True)]
    where.delete()
    assert not where.exists()
    where.delete()  # nothing left: no error


def test_version_uris_keep_the_outputs_spelling_and_options() -> None:
    assert version_uri("s3a://b/out/", "s", 3) == "s3a://b/out/s/v000003"
    assert version_uri("s3://b/out?region=eu-west-1&scheme=http", "s", 12) == (
        "s3://b/out/s/v000012?region=eu-west-1&scheme=http"
    )
    assert version_uri("file:///data/x%20y", "s", 1) == "/data/x y/s/v000001"
    assert version_uri("rel/out", "s", 1) == "rel/out/s/v000001"
