"""The format-2 writer without Spark: claiming versions (local and on a pyarrow filesystem, also under
concurrent builds), what an executor task does with its sorted rows, the LMDB keys the driver's UDF computes,
and removing versions. Spark runs these pieces in tests/integration/test_pipeline.py."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import pyarrow as pa
import pytest

from keyroute.keys.key_format import KeyFormat, parse_key
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.pipeline import lmdb_files, writer
from keyroute.pipeline.errors import PublishError, SpecError
from keyroute.pipeline.keys import lmdb_keys
from keyroute.pipeline.publish import remove_snapshot
from keyroute.pipeline.spec import parse_spec
from keyroute.pipeline.writer import (
    CLAIM_PREFIX,
    VersionTaken,
    claim_next_version,
    claim_version,
    next_version,
    remove_version,
    version_snapshot,
)
from keyroute.storage import snapshot as snapshot_module
from keyroute.storage.lmdb_layout import db_key
from keyroute.storage.snapshot import (
    FORMAT_2,
    ArrowLocation,
    Manifest,
    SnapshotError,
    checksum_file,
    compact_value,
    data_file,
    existing_versions,
    read_manifest,
    write_manifest,
)
from tests.memory_fs import memory_filesystem

MOCK = "mock://"


@pytest.fixture
def mock_fs(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """`mock://bucket/...` URIs open one in-memory pyarrow filesystem (not an object store: it renames)."""
    filesystem = memory_filesystem()
    real = snapshot_module._arrow_from_uri

    def from_uri(uri: str) -> tuple[Any, str]:
        if uri.startswith(MOCK):
            return filesystem, uri[len(MOCK) :].split("?", 1)[0]
        return real(uri)

    monkeypatch.setattr(snapshot_module, "_arrow_from_uri", from_uri)
    lmdb_files._arrow_location.cache_clear()
    yield filesystem
    lmdb_files._arrow_location.cache_clear()


# --- the spec option ---------------------------------------------------------------------------------------


def spec_with(**fields: object) -> Any:
    table = {"source": "x", "format": "json", "key": "k", "partitions": 2, "mode": "latest", "order_by": "ts"}
    return parse_spec({"stores": {"s": {**table, **fields}}}, Path("/data"))


def test_format_2_is_the_default_and_format_1_can_be_asked_for() -> None:
    assert spec_with().stores[0].snapshot_format == 2
    assert spec_with(snapshot_format=1).stores[0].snapshot_format == 1
    for bad in (3, 0, "2", True, 1.0):
        with pytest.raises(SpecError, match="'snapshot_format' must be 1 or 2"):
            spec_with(snapshot_format=bad)


# --- claiming a version ------------------------------------------------------------------------------------


def test_a_local_version_is_claimed_by_creating_its_directory(tmp_path: Path) -> None:
    claimed = claim_version(str(tmp_path / "out"), "s", 3)
    assert claimed.location == tmp_path / "out" / "s" / "v000003" and claimed.location.is_dir()
    assert claimed.snapshot == str(claimed.location) and list(claimed.location.iterdir()) == []
    with pytest.raises(VersionTaken, match="already exists"):
        claim_version(str(tmp_path / "out"), "s", 3)
    assert claim_next_version(str(tmp_path / "out"), "s", None).version == 4
    assert claim_next_version(tmp_path.as_uri() + "/out", "s", 9).version == 10


def test_the_snapshot_of_a_version_is_an_absolute_path_or_the_uri() -> None:
    assert version_snapshot("rel/out", "s", 1) == str(Path("rel/out/s/v000001").resolve())
    assert version_snapshot("s3a://bucket/out", "s", 2) == "s3a://bucket/out/s/v000002"


def test_a_version_on_a_pyarrow_filesystem_is_claimed_by_a_marker(mock_fs: Any) -> None:
    output = MOCK + "bucket/out"
    assert next_version(output, "s", None) == 1 and existing_versions(output, "s") == []
    claimed = claim_version(output, "s", 1)
    assert isinstance(claimed.location, ArrowLocation) and claimed.snapshot == output + "/s/v000001"
    [(marker, is_dir)] = claimed.location.names()
    assert marker.startswith(CLAIM_PREFIX) and not is_dir
    record = json.loads(claimed.location.read_bytes(marker))
    assert (record["store"], record["version"]) == ("s", 1) and record["pid"] > 0
    assert existing_versions(output, "s") == [1] and next_version(output, "s", None) == 2
    with pytest.raises(VersionTaken, match="taken"):
        claim_version(output, "s", 1)
    assert [name for name, _ in claimed.location.names()] == [marker]  # no second marker in a taken version
    assert claim_next_version(output, "s", 4).version == 5


def racing_marker(monkeypatch: pytest.MonkeyPatch, name: str, data: bytes = b"{}") -> list[str]:
    """A concurrent builder's marker `name` lands in the version right after ours, before we list; the names
    of the markers we wrote are returned (in a list filled as we write)."""
    real_write = ArrowLocation.write_bytes
    ours: list[str] = []

    def write_and_race(self: ArrowLocation, marker: str, content: bytes) -> None:
        real_write(self, marker, content)
        if not ours:
            real_write(self, name, data)
        ours.append(marker)

    monkeypatch.setattr(ArrowLocation, "write_bytes", write_and_race)
    return ours


def test_a_builder_that_sees_a_lower_claim_withdraws_its_own_and_takes_the_next_version(
    mock_fs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    output = MOCK + "bucket/out"
    lower = f"{CLAIM_PREFIX}{'0' * 32}.json"  # lower than any marker of ours
    racing_marker(monkeypatch, lower)
    with pytest.raises(VersionTaken):
        claim_version(output, "s", 1)
    location = ArrowLocation.from_uri(output + "/s/v000001")
    assert [name for name, _ in location.names()] == [lower]  # ours was removed, the other one's stays
    claimed = claim_next_version(output, "s", None)
    assert claimed.version == 2
    assert existing_versions(output, "s") == [1, 2]


def test_the_lowest_of_several_claims_waits_for_the_others_to_withdraw_and_wins(
    mock_fs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    output = MOCK + "bucket/out"
    higher = f"{CLAIM_PREFIX}{'f' * 32}.json"  # higher than any marker of ours
    racing_marker(monkeypatch, higher)
    real_names = ArrowLocation.names
    listings: list[list[str]] = []

    def names_then_withdraw(self: ArrowLocation, folder: str = "") -> list[tuple[str, bool]]:
        found = real_names(self, folder)
        listings.append([name for name, _ in found])
        if len(listings) == 2:  # the other builder lists after us, sees our lower marker and withdraws
            self.filesystem.delete_file(self.child(higher))
        return found

    monkeypatch.setattr(ArrowLocation, "names", names_then_withdraw)
    claimed = claim_version(output, "s", 1)
    assert claimed.version == 1 and len(listings) == 3 and higher in listings[1]  # [0]: before writing ours
    [(marker, _)] = real_names(claimed.location)  # type: ignore[arg-type]
    assert json.loads(claimed.location.read_bytes(marker))["won"] is True  # type: ignore[union-attr]


def test_a_builder_gives_up_at_once_on_a_claim_marked_won_and_after_a_wait_on_one_that_stays(
    mock_fs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    output = MOCK + "bucket/out"
    won = f"{CLAIM_PREFIX}{'f' * 32}.json"
    racing_marker(monkeypatch, won, json.dumps({"store": "s", "version": 1, "won": True}).encode())
    slept: list[float] = []
    monkeypatch.setattr(writer.time, "sleep", slept.append)
    with pytest.raises(VersionTaken):
        claim_version(output, "s", 1)
    assert slept == []  # the other builder had listed before we wrote, alone: it won
    location = ArrowLocation.from_uri(output + "/s/v000001")
    assert [name for name, _ in location.names()] == [won]
    # A marker that neither wins nor withdraws (its builder died): given up after the wait, ours removed.
    racing_marker(monkeypatch, f"{CLAIM_PREFIX}{'f' * 32}.json")
    now = [0.0]
    monkeypatch.setattr(writer.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(writer.time, "sleep", lambda s: now.__setitem__(0, now[0] + s))
    with pytest.raises(VersionTaken):
        claim_version(output, "s", 2)
    assert now[0] >= writer._CLAIM_WAIT_S
    location = ArrowLocation.from_uri(output + "/s/v000002")
    assert [name for name, _ in location.names()] == [f"{CLAIM_PREFIX}{'f' * 32}.json"]


# The concurrent claim is run this many times in a row (each a fresh filesystem): a livelock or a shared
# version shows as one failed round. TEST_CLAIM_ROUNDS=500 runs more.
CONCURRENT_ROUNDS = int(os.environ.get("TEST_CLAIM_ROUNDS", "5"))


@pytest.mark.parametrize("builders", [2, 8])
def test_concurrent_builders_never_share_a_version(mock_fs: Any, builders: int) -> None:
    for round_no in range(CONCURRENT_ROUNDS):
        output = MOCK + f"bucket/out-{round_no}"
        versions: list[int] = []
        errors: list[BaseException] = []
        start = threading.Barrier(builders)

        def build(output: str, start: threading.Barrier, versions: list[int], errors: list[BaseException]) -> None:
            try:
                start.wait()
                versions.append(claim_next_version(output, "s", None).version)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=build, args=(output, start, versions, errors)) for _ in range(builders)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, (round_no, errors)
        assert len(versions) == len(set(versions)) == builders, (round_no, versions)
        # Every version a builder gave up holds no marker of its: each claimed one holds exactly its winner's.
        for version in existing_versions(output, "s"):
            names = [n for n, _ in ArrowLocation.from_uri(f"{output}/s/v{version:06d}").names()]
            assert len(names) == (1 if version in versions else 0), (round_no, version, names)


def test_removing_a_version_removes_it_everywhere(tmp_path: Path, mock_fs: Any) -> None:
    local = claim_version(str(tmp_path), "s", 1)
    (local.location / "partition=0").mkdir()  # type: ignore[operator]
    remove_version(local.snapshot)
    assert not Path(local.snapshot).exists() and existing_versions(str(tmp_path), "s") == []
    remote = claim_version(MOCK + "bucket/out", "s", 1)
    remote.location.at("partition=0").write_bytes("data.mdb", b"x")  # type: ignore[union-attr]
    remove_version(remote.snapshot)
    assert existing_versions(MOCK + "bucket/out", "s") == []
    remove_version(remote.snapshot)  # already gone: no error


def test_a_version_no_longer_retained_is_removed_from_a_pyarrow_filesystem(mock_fs: Any) -> None:
    claimed = claim_version(MOCK + "bucket/out", "s", 4)
    manifest = Manifest("s", 4, 1, Partitioner.MURMUR2, KeyFormat.STRING, ("v",), (0,))
    write_manifest(claimed.location, manifest)
    assert not remove_snapshot("other", 4, claimed.snapshot)  # another store's manifest: left alone
    assert read_manifest(claimed.snapshot).version == 4
    assert remove_snapshot("s", 4, claimed.snapshot)
    assert existing_versions(MOCK + "bucket/out", "s") == []


# --- an executor task ---------------------------------------------------------------------------------------

STRING_KEYS = {
    0: ["a", "b/c", "ü", "k" * 600],
    2: ["x", "y"],
    5: [],
}


def batch(partition: int, keys: list[bytes | None], values: list[str]) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict(
        {
            lmdb_files.PARTITION: pa.array([partition] * len(keys), pa.int32()),
            lmdb_files.LMDB_KEY: pa.array(keys, pa.binary()),
            lmdb_files.VALUE_JSON: pa.array(values, pa.string()),
        }
    )


def sorted_rows(texts: list[str]) -> tuple[list[bytes], list[str]]:
    entries = sorted((db_key(t.encode()), json.dumps({"key": t, "n": 1.0e-5})) for t in texts)
    return [k for k, _ in entries], [v for _, v in entries]


def read_file(path: Path) -> list[tuple[bytes, bytes]]:
    env = lmdb.open(str(path.parent), readonly=True, lock=False, max_dbs=0)
    try:
        with env.begin() as txn:
            return [(bytes(k), bytes(v)) for k, v in txn.cursor()]
    finally:
        env.close()


def run_task(destination: str, batches: list[pa.RecordBatch], workdir: Path) -> list[dict[str, Any]]:
    out = lmdb_files.write_partition_files(iter(batches), lmdb_files.Destination(destination), workdir)
    return [row for b in out for row in pa.Table.from_batches([b]).to_pylist()]


def test_a_task_builds_uploads_and_reports_each_of_its_partitions(tmp_path: Path) -> None:
    keys0, values0 = sorted_rows(STRING_KEYS[0])
    keys2, values2 = sorted_rows(STRING_KEYS[2])
    # Partition 0 spans two batches; its rest and partition 2 share the second; the last batch is empty.
    shared = pa.Table.from_batches([batch(0, keys0[2:], values0[2:]), batch(2, keys2, values2)])
    batches = [batch(0, keys0[:2], values0[:2]), shared.combine_chunks().to_batches()[0], batch(2, [], [])]
    assert batches[1].num_rows == 4
    version = tmp_path / "out" / "s" / "v000001"
    workdir = tmp_path / "scratch"
    workdir.mkdir()
    results = run_task(str(version), batches, workdir)
    assert [(r["partition"], r["rows"], r["misplaced"]) for r in results] == [(0, 4, 0), (2, 2, 0)]
    for result, keys, values in ((results[0], keys0, values0), (results[1], keys2, values2)):
        path = version / data_file(result["partition"])
        assert sorted(p.name for p in path.parent.iterdir()) == ["data.mdb"]  # no temporary or lock file
        assert result["bytes"] == path.stat().st_size
        assert result["checksum"] == checksum_file(path).value
        assert read_file(path) == [(k, compact_value(v)) for k, v in zip(keys, values, strict=True)]
    assert list(workdir.iterdir()) == []  # the task's scratch files are gone


def test_a_task_given_key_texts_writes_the_file_their_lmdb_keys_make(tmp_path: Path) -> None:
    # Stores none of whose keys is hashed send the key text (in LMDB key order), which the task tags itself.
    keys, values = sorted_rows(["a", "b/c", "ü", "", "k" * 510, "é"])
    texts = pa.array([key[1:].decode("utf-8") for key in keys], pa.string())
    by_text = pa.RecordBatch.from_pydict(
        {
            lmdb_files.PARTITION: pa.array([0] * len(keys), pa.int32()),
            lmdb_files.KEY_TEXT: texts,
            lmdb_files.VALUE_JSON: pa.array(values, pa.string()),
        }
    )
    # Split where the second batch starts inside the partition: its texts are an offset slice.
    text_results = run_task(str(tmp_path / "texts"), [by_text.slice(0, 1), by_text.slice(1)], tmp_path)
    key_results = run_task(str(tmp_path / "keys"), [batch(0, keys, values)], tmp_path)
    assert [(r["rows"], r["misplaced"]) for r in text_results] == [(len(keys), 0)]
    assert text_results == key_results
    path = tmp_path / "texts" / data_file(0)
    assert read_file(path) == [(k, compact_value(v)) for k, v in zip(keys, values, strict=True)]
    assert path.read_bytes() == (tmp_path / "keys" / data_file(0)).read_bytes()


def test_rows_without_an_lmdb_key_are_counted_not_written(tmp_path: Path) -> None:
    keys, values = sorted_rows(["a", "b"])
    results = run_task(str(tmp_path / "v"), [batch(1, [None, *keys], ['{"x":1}', *values])], tmp_path)
    assert [(r["partition"], r["rows"], r["misplaced"]) for r in results] == [(1, 2, 1)]


@pytest.mark.parametrize(
    ("batches", "message"),
    [
        ([batch(0, [b"=b", b"=a"], ["{}", "{}"])], "out of LMDB key order"),
        ([batch(0, [b"=a"], ["{}"]), batch(1, [b"=a"], ["{}"]), batch(0, [b"=b"], ["{}"])], "not together"),
    ],
    ids=["keys out of order", "a partition split in two"],
)
def test_a_task_fails_on_rows_it_cannot_write(tmp_path: Path, batches: list[pa.RecordBatch], message: str) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with pytest.raises(SnapshotError, match=message):
        run_task(str(tmp_path / "v"), batches, scratch)
    assert list(scratch.iterdir()) == []


def test_a_failed_partition_leaves_no_file_in_a_local_version(tmp_path: Path) -> None:
    # Built in place under a temporary name: a partition that fails midway is removed from the version too.
    keys, values = sorted_rows(["a", "b", "c"])
    version = tmp_path / "v"
    rows = [batch(4, keys, values), batch(4, [keys[0]], values[:1])]  # the second batch goes back in order
    with pytest.raises(SnapshotError, match="out of LMDB key order"):
        run_task(str(version), rows, tmp_path)
    assert [p for p in version.rglob("*") if p.is_file()] == []


def test_a_published_file_is_fsynced_and_checksummed_as_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    real_fsync = lmdb_files.os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.fstat(fd).st_ino)
        real_fsync(fd)

    monkeypatch.setattr(lmdb_files.os, "fsync", fsync)
    keys, values = sorted_rows(["a", "b"])
    version = tmp_path / "v"
    [result] = run_task(str(version), [batch(0, keys, values)], tmp_path)
    path = version / data_file(0)
    assert path.stat().st_ino in synced  # the file itself (then its directory)
    assert (path.parent.stat().st_ino in synced) and result["checksum"] == checksum_file(path).value


def test_an_fsync_that_fails_fails_the_partition(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(lmdb_files.os, "fsync", fsync)
    keys, values = sorted_rows(["a"])
    with pytest.raises(OSError, match="Input/output error"):
        run_task(str(tmp_path / "v"), [batch(0, keys, values)], tmp_path)
    assert [p for p in (tmp_path / "v").rglob("*") if p.is_file()] == []  # nothing published


def test_a_task_uploads_to_a_pyarrow_filesystem(tmp_path: Path, mock_fs: Any) -> None:
    keys, values = sorted_rows(["a", "b", "c"])
    destination = MOCK + "bucket/out/s/v000001"
    [result] = run_task(destination, [batch(3, keys, values)], tmp_path)
    where = ArrowLocation.from_uri(destination)
    assert where.names() == [("partition=3", True)]
    assert [name for name, _ in where.names("partition=3")] == ["data.mdb"]
    local = tmp_path / "copy" / "data.mdb"
    local.parent.mkdir()
    local.write_bytes(where.read_bytes(data_file(3)))
    assert (result["bytes"], result["checksum"]) == (local.stat().st_size, checksum_file(local).value)
    assert read_file(local) == [(k, compact_value(v)) for k, v in zip(keys, values, strict=True)]


# --- the driver's LMDB keys ----------------------------------------------------------------------------------

KEYS = {
    KeyFormat.STRING: ["a", "ü/%", "", "k" * 511],
    KeyFormat.INT64: ["0", "-1", "9223372036854775807", "-9223372036854775808"],
    KeyFormat.INT16: ["7", "-32768"],
    KeyFormat.UUID: ["5e0b6a52-4c52-4bd8-9b8e-3a2f4c9d1e7f"],
    KeyFormat.BYTES: ["", "AAEC", "_-8", "w4_DvA"],
}


@pytest.mark.parametrize("key_format", list(KEYS), ids=lambda f: f.value)
def test_lmdb_keys_are_db_key_of_the_serialized_key_in_its_partition(key_format: KeyFormat) -> None:
    texts = KEYS[key_format]
    data = [parse_key(key_format, t).data for t in texts]
    parts = [partition_for(Partitioner.MURMUR2, d, 6) for d in data]
    got = lmdb_keys(pa.array(texts, pa.string()), pa.array(parts, pa.int32()), key_format, Partitioner.MURMUR2, 6)
    assert got.to_pylist() == [db_key(d) for d in data]
    # A row whose key hashes elsewhere gets no LMDB key: the task leaves it out and the build fails.
    wrong = [(p + 1) % 6 for p in parts]
    got = lmdb_keys(pa.array(texts, pa.string()), pa.array(wrong, pa.int32()), key_format, Partitioner.MURMUR2, 6)
    assert got.to_pylist() == [None] * len(texts)


def test_a_build_with_an_unwritable_output_fails_cleanly(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(PublishError, match="cannot create version directory"):
        claim_version(str(blocker), "s", 1)


def test_manifest_written_on_a_pyarrow_filesystem_is_format_2(mock_fs: Any) -> None:
    claimed = claim_version(MOCK + "bucket/out", "s", 1)
    manifest = Manifest(
        "s",
        1,
        1,
        Partitioner.MURMUR2,
        KeyFormat.STRING,
        ("v",),
        (0,),
        files={0: (data_file(0),)},
        created_at=5.0,
        format=FORMAT_2,
        checksums={0: "crc32:00000000"},
        bytes={0: 8192},
    )
    write_manifest(claimed.location, manifest)
    assert read_manifest(claimed.snapshot) == manifest


# --- the write job's Arrow batches ----------------------------------------------------------------------------


class FakeConf:
    """A SparkSession's `conf` (get/set of strings), recording every value set."""

    def __init__(self, values: dict[str, str]) -> None:
        self.values = dict(values)
        self.history: list[tuple[str, str]] = []

    def get(self, key: str) -> str:
        return self.values[key]

    def set(self, key: str, value: str) -> None:
        self.values[key] = value
        self.history.append((key, value))


class FakeSession:
    def __init__(self, rows: str = "10000", limit: str = "67108864b") -> None:
        self.conf = FakeConf({writer._ARROW_ROWS: rows, writer._ARROW_BYTES: limit})


def test_batches_are_limited_by_rows_that_fit_the_byte_limit_at_the_greatest_row() -> None:
    session = FakeSession(limit="64m")
    json_bytes = 20_000  # ~3,000 rows in 64 MiB: fewer than Spark's 10,000
    with writer.batches_sized_by_rows(session, json_bytes):  # type: ignore[arg-type]
        rows = int(session.conf.values[writer._ARROW_ROWS])
        assert session.conf.values[writer._ARROW_BYTES] == str(2**31 - 1)  # Spark's "sizes no batch"
    # A batch of that many rows of the greatest size stays within the byte limit, with no row to spare.
    row = json_bytes + writer._ROW_BYTES
    assert rows * row <= 64 << 20 < (rows + 1) * row
    assert session.conf.values == {writer._ARROW_ROWS: "10000", writer._ARROW_BYTES: "64m"}  # set back


def test_small_rows_keep_sparks_row_limit() -> None:
    session = FakeSession()
    with writer.batches_sized_by_rows(session, 300):  # type: ignore[arg-type]
        assert session.conf.values[writer._ARROW_ROWS] == "10000"
        assert session.conf.values[writer._ARROW_BYTES] == str(2**31 - 1)
    # No row limit (0) becomes the rows that fit; a row beyond the byte limit gets a batch of its own.
    session = FakeSession(rows="0", limit="1k")
    with writer.batches_sized_by_rows(session, 10_000):  # type: ignore[arg-type]
        assert session.conf.values[writer._ARROW_ROWS] == "1"


@pytest.mark.parametrize(
    ("json_bytes", "limit", "rows"),
    [(None, "64m", "10000"), (300, str(2**31 - 1), "10000"), (300, "64 furlongs", "10000"), (300, "64m", "many")],
    ids=["no bound", "byte limit off", "unread byte limit", "unread row limit"],
)
def test_batches_stay_as_spark_sizes_them_otherwise(json_bytes: int | None, limit: str, rows: str) -> None:
    session = FakeSession(rows=rows, limit=limit)
    with writer.batches_sized_by_rows(session, json_bytes):  # type: ignore[arg-type]
        assert session.conf.history == []
    assert session.conf.history == []


def test_the_settings_are_set_back_when_the_job_fails() -> None:
    session = FakeSession()
    with pytest.raises(RuntimeError), writer.batches_sized_by_rows(session, 5_000_000):  # type: ignore[arg-type]
        raise RuntimeError("the job failed")
    assert session.conf.values == {writer._ARROW_ROWS: "10000", writer._ARROW_BYTES: "67108864b"}


@pytest.mark.parametrize(
    ("text", "size"),
    [("67108864b", 64 << 20), ("64m", 64 << 20), ("64MB", 64 << 20), ("1g", 1 << 30), ("1024", 1024), (" 2k ", 2048)],
)
def test_spark_byte_sizes_are_read_in_binary_units(text: str, size: int) -> None:
    assert writer.spark_byte_size(text) == size


@pytest.mark.parametrize("text", ["", "m", "1.5g", "-1", "64 furlongs"])
def test_byte_sizes_not_in_sparks_form_are_not_read(text: str) -> None:
    assert writer.spark_byte_size(text) is None
