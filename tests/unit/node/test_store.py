"""The embedded LMDB store: loading a snapshot partition, fast restart from the marker, clean failures."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from keyroute.keys.key_format import KeyFormat, parse_key
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.replica.store import (
    MARKER,
    LoadCancelled,
    LoadError,
    PartitionId,
    iter_partition_dirs,
    load_partition,
    partition_path,
)
from keyroute.storage.snapshot import local_path, partition_dir, read_manifest, write_manifest

MAP_SIZE = 1 << 24
ROWS = {f"customer-{i:03d}": {"n": i, "name": f"C{i}"} for i in range(60)}


def _partition_of(text: str, partitions: int, fmt: KeyFormat = KeyFormat.STRING) -> int:
    return partition_for(Partitioner.MURMUR2, parse_key(fmt, text).data, partitions)


def _files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.exists() else []


def test_load_serves_every_row_of_its_partition_and_nothing_else(snapshot, data_dir: Path) -> None:
    record = snapshot("bookings", 1, 4, ROWS)
    for p in range(4):
        held = load_partition(data_dir, record, p, MAP_SIZE)
        try:
            mine = {k: v for k, v in ROWS.items() if _partition_of(k, 4) == p}
            assert held.rows == len(mine)
            assert held.pid == PartitionId("bookings", 1, p)
            for text, value in ROWS.items():
                got = held.get(text.encode("utf-8"))
                if text in mine:
                    assert got is not None and json.loads(got) == value
                else:
                    assert got is None
        finally:
            held.close()


def test_values_are_stored_as_compact_json_bytes_under_the_serialized_key(snapshot, data_dir: Path) -> None:
    rows = {"-1": {"a": [1, 2]}, "9223372036854775807": {"b": "é"}, "0": {"c": None}}
    record = snapshot("ints", 1, 1, rows, key_format=KeyFormat.INT64)
    held = load_partition(data_dir, record, 0, MAP_SIZE)
    try:
        assert held.get((-1).to_bytes(8, "big", signed=True)) == b'{"a":[1,2]}'
        assert held.get((2**63 - 1).to_bytes(8, "big", signed=True)) == '{"b":"é"}'.encode()
        assert held.get(b"0") is None  # the text form is not the key: the 8 serialized bytes are
        assert held.get((0).to_bytes(8, "big")) == b'{"c":null}'
    finally:
        held.close()


def test_keys_of_any_length_are_stored_even_those_lmdb_cannot_hold_as_they_are(snapshot, data_dir: Path) -> None:
    # LMDB keys are 1 to 511 bytes: an empty key and longer ones are stored under a tagged SHA-256.
    rows = {"": {"n": 0}, "k" * 510: {"n": 510}, "k" * 511: {"n": 511}, "k" * 3000: {"n": 3000}}
    rows["k" * 3000 + "x"] = {"n": 3001}  # shares its first 3000 bytes with another key
    record = snapshot("odd", 1, 1, rows)
    held = load_partition(data_dir, record, 0, MAP_SIZE)
    try:
        assert held.rows == len(rows)
        for text, value in rows.items():
            got = held.get(text.encode())
            assert got is not None and json.loads(got) == value, len(text)
        assert held.get(b"k" * 2999) is None
        assert held.get(b"k" * 4000) is None
    finally:
        held.close()


def test_layout_and_marker(snapshot, data_dir: Path) -> None:
    record = snapshot("bookings", 7, 2, ROWS)
    held = load_partition(data_dir, record, 1, MAP_SIZE)
    held.close()
    path = data_dir / "stores" / "bookings" / "v7" / "p1"
    assert held.path == path == partition_path(data_dir, PartitionId("bookings", 7, 1))
    assert (path / "data.mdb").is_file()
    marker = json.loads((path / MARKER).read_text())
    assert marker["rows"] == held.rows and marker["version"] == 7 and marker["partition"] == 1
    assert [pid for pid, _ in iter_partition_dirs(data_dir)] == [PartitionId("bookings", 7, 1)]


def test_a_matching_marker_reuses_the_data_on_disk(snapshot, data_dir: Path) -> None:
    record = snapshot("bookings", 1, 2, ROWS)
    load_partition(data_dir, record, 0, MAP_SIZE).close()
    # Remove the partition's rows from the snapshot: only a reuse of the loaded data can still answer.
    snapshot_dir = local_path(record.snapshot)
    for f in partition_dir(snapshot_dir, 0).iterdir():
        f.unlink()
    held = load_partition(data_dir, record, 0, MAP_SIZE)
    try:
        key = next(k for k in ROWS if _partition_of(k, 2) == 0)
        assert json.loads(held.get(key.encode()) or b"null") == ROWS[key]
    finally:
        held.close()


def test_a_marker_for_another_manifest_is_not_reused(snapshot, data_dir: Path) -> None:
    record = snapshot("bookings", 1, 2, ROWS)
    load_partition(data_dir, record, 0, MAP_SIZE).close()
    # The same version rewritten (a different manifest): the data on disk must not be trusted.
    snapshot_dir = local_path(record.snapshot)
    manifest = read_manifest(snapshot_dir)
    write_manifest(snapshot_dir, dataclasses.replace(manifest, created_at=1.0))
    for f in partition_dir(snapshot_dir, 0).iterdir():
        f.write_text("")
    with pytest.raises(LoadError, match="rows"):
        load_partition(data_dir, record, 0, MAP_SIZE)
    assert not partition_path(data_dir, PartitionId("bookings", 1, 0)).exists()


def test_a_row_count_mismatch_fails_and_leaves_nothing_behind(snapshot, data_dir: Path) -> None:
    record = snapshot("bookings", 1, 2, ROWS)
    folder = partition_dir(local_path(record.snapshot), 1)
    part = next(folder.iterdir())
    lines = part.read_text().splitlines(keepends=True)
    part.write_text("".join(lines[:-1]))  # a truncated copy
    with pytest.raises(LoadError, match="manifest says"):
        load_partition(data_dir, record, 1, MAP_SIZE)
    assert _files_under(data_dir) == []


def test_a_key_that_does_not_fit_the_key_format_fails_the_load(snapshot, data_dir: Path) -> None:
    record = snapshot("ints", 1, 1, {"1": {}, "2": {}}, key_format=KeyFormat.INT32)
    part = next(partition_dir(local_path(record.snapshot), 0).iterdir())
    part.write_text(part.read_text().replace('"key": "2"', '"key": "two"'))
    with pytest.raises(LoadError, match="not a valid int32"):
        load_partition(data_dir, record, 0, MAP_SIZE)
    assert _files_under(data_dir) == []


def test_a_key_in_the_wrong_partition_fails_the_load(snapshot, data_dir: Path) -> None:
    record = snapshot("bookings", 1, 2, ROWS)
    snapshot_dir = local_path(record.snapshot)
    wrong = next(k for k in ROWS if _partition_of(k, 2) == 1)
    with open(next(partition_dir(snapshot_dir, 0).iterdir()), "a") as fh:
        fh.write(json.dumps({"key": wrong, "value": {}}) + "\n")
    manifest = read_manifest(snapshot_dir)
    write_manifest(snapshot_dir, dataclasses.replace(manifest, rows=(manifest.rows[0] + 1, manifest.rows[1])))
    with pytest.raises(LoadError, match="belongs to another partition"):
        load_partition(data_dir, record, 0, MAP_SIZE)
    assert _files_under(data_dir) == []


def test_a_duplicate_key_fails_the_load(snapshot, data_dir: Path) -> None:
    record = snapshot("bookings", 1, 1, {"a": 1, "b": 2})
    snapshot_dir = local_path(record.snapshot)
    with open(next(partition_dir(snapshot_dir, 0).iterdir()), "a") as fh:
        fh.write(json.dumps({"key": "a", "value": 3}) + "\n")
    manifest = read_manifest(snapshot_dir)
    write_manifest(snapshot_dir, dataclasses.replace(manifest, rows=(3,)))
    with pytest.raises(LoadError, match="twice"):
        load_partition(data_dir, record, 0, MAP_SIZE)
    assert _files_under(data_dir) == []


def test_a_missing_manifest_fails_the_load(snapshot, data_dir: Path) -> None:
    record = snapshot("bookings", 1, 1, ROWS)
    os.unlink(local_path(record.snapshot) / "manifest.json")
    with pytest.raises(LoadError, match="no manifest"):
        load_partition(data_dir, record, 0, MAP_SIZE)
    assert _files_under(data_dir) == []


def test_a_manifest_that_disagrees_with_the_store_record_fails_the_load(snapshot, data_dir: Path) -> None:
    record = snapshot("bookings", 1, 2, ROWS)
    with pytest.raises(LoadError, match=r"2 partitions \(record: 3\)"):
        load_partition(data_dir, dataclasses.replace(record, partitions=3), 0, MAP_SIZE)
    with pytest.raises(LoadError, match="key format"):
        load_partition(data_dir, dataclasses.replace(record, key_format=KeyFormat.BYTES), 0, MAP_SIZE)
    assert _files_under(data_dir) == []


def test_a_partially_written_directory_is_rebuilt(snapshot, data_dir: Path) -> None:
    record = snapshot("bookings", 1, 1, ROWS)
    path = partition_path(data_dir, PartitionId("bookings", 1, 0))
    path.mkdir(parents=True)
    (path / "data.mdb").write_bytes(b"garbage from a crash before the marker was written")
    held = load_partition(data_dir, record, 0, MAP_SIZE)
    try:
        assert held.rows == len(ROWS)
    finally:
        held.close()


def test_a_cancelled_load_leaves_nothing_behind(snapshot, data_dir: Path) -> None:
    record = snapshot("bookings", 1, 1, ROWS)
    with pytest.raises(LoadCancelled):
        load_partition(data_dir, record, 0, MAP_SIZE, cancelled=lambda: True)
    assert _files_under(data_dir) == []


def test_discard_removes_the_files(snapshot, data_dir: Path) -> None:
    record = snapshot("bookings", 1, 1, ROWS)
    held = load_partition(data_dir, record, 0, MAP_SIZE)
    held.discard()
    assert _files_under(data_dir) == []
    assert list(iter_partition_dirs(data_dir)) == []


@pytest.mark.parametrize("name", ["a/b", "..", ".", "x y", "東京"])
def test_store_names_never_leave_the_data_directory(data_dir: Path, name: str) -> None:
    path = partition_path(data_dir, PartitionId(name, 1, 0))
    assert path.resolve().is_relative_to((data_dir / "stores").resolve())
    assert path.parent.parent.parent == data_dir / "stores"
    path.mkdir(parents=True)
    assert [pid.store for pid, _ in iter_partition_dirs(data_dir)] == [name]
