"""A live partition's file on disk (keyroute.replica.store): commits are flushed every --live-sync-ms, not each,
so on the next start the file is reused only when it can be trusted: closed cleanly, or written in this same
boot (the page cache holds every commit: a process crash loses nothing). A file left unflushed by a boot
that ended (an operating-system crash) is loaded again from the version and the topic replayed."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from keyroute.cluster.partition_map import StoreRecord
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.replica import store as store_module
from keyroute.replica.store import LIVE_STATE, PartitionStore, boot_id, load_partition
from keyroute.storage.live import OFFSET_KEY, LiveConfig, Merge
from keyroute.storage.lmdb_layout import TAG_KEY, build_partition_file
from keyroute.storage.snapshot import FORMAT_2, Manifest, checksum_file, data_file, version_dir, write_manifest

MAP_SIZE = 1 << 24
MERGE = Merge("latest", "user", order_by="ts", columns=("ts",))
START = 5  # the version's offset: where applying starts


def live_record(root: Path) -> StoreRecord:
    """An empty live version of one partition, starting at offset START."""
    snapshot = version_dir(str(root), "clicks", 1)
    dest = snapshot / data_file(0)
    dest.parent.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as scratch:
        shutil.copyfile(build_partition_file([], Path(scratch)).path, dest)
    live = LiveConfig("clicks", "127.0.0.1:9", MERGE, (START,))
    manifest = Manifest(
        "clicks", 1, 1, Partitioner.MURMUR2, KeyFormat.STRING, ("ts",), (0,), created_at=time.time(),
        format=FORMAT_2, files={0: (data_file(0),)}, checksums={0: checksum_file(dest).value},
        bytes={0: dest.stat().st_size}, live=live,
    )  # fmt: skip
    write_manifest(snapshot, manifest)
    return StoreRecord("clicks", 1, Partitioner.MURMUR2, KeyFormat.STRING, 1, str(snapshot), ("ts",), 1, 0.0, live=True)


def apply(held: PartitionStore, key: bytes, next_offset: int) -> None:
    """What the applier does: rows and the next offset in one transaction (not flushed)."""
    with held.write_lock:
        txn = held.write_txn()
        txn.put(TAG_KEY + key, b'{"ts":1}\0[1]')
        txn.put(OFFSET_KEY, str(next_offset).encode())
        txn.commit()


def crash(held: PartitionStore) -> None:
    """The process dies: the environment goes without its close (no flush, no clean record)."""
    env = held._env  # noqa: SLF001 - a crash, not a close
    held._env = None  # noqa: SLF001
    assert env is not None
    env.close()


def state_of(held: PartitionStore) -> dict[str, object]:
    return json.loads((held.path / LIVE_STATE).read_text())


@pytest.fixture
def record(tmp_path: Path) -> StoreRecord:
    if boot_id() is None:
        pytest.skip("this system does not tell its boot id: every commit is flushed instead")
    return live_record(tmp_path / "snapshots")


def test_a_process_crash_in_the_same_boot_reuses_every_commit(tmp_path: Path, record: StoreRecord) -> None:
    held = load_partition(tmp_path / "data", record, 0, MAP_SIZE)
    assert held.live is not None and held.live.offset == START - 1
    assert not held.read_only  # its own copy: the live topic is applied to it
    assert state_of(held) == {"boot_id": boot_id(), "clean": False}
    apply(held, b"u1", START + 3)
    crash(held)
    again = load_partition(tmp_path / "data", record, 0, MAP_SIZE)
    try:
        assert again.live is not None and again.live.offset == START + 2
        assert again.get(b"u1") == b'{"ts":1}'
    finally:
        again.close()


def test_a_clean_close_is_reused_even_after_the_machine_restarted(
    tmp_path: Path, record: StoreRecord, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = load_partition(tmp_path / "data", record, 0, MAP_SIZE)
    apply(held, b"u1", START + 3)
    held.close()
    assert state_of(held) == {"boot_id": boot_id(), "clean": True}
    monkeypatch.setattr(store_module, "boot_id", lambda: "another-boot")
    again = load_partition(tmp_path / "data", record, 0, MAP_SIZE)
    try:
        assert again.live is not None and again.live.offset == START + 2
        assert again.get(b"u1") == b'{"ts":1}'
    finally:
        again.close()


@pytest.mark.parametrize("left", ["unflushed", "no record"])
def test_a_file_left_unflushed_by_an_earlier_boot_is_loaded_again_from_the_version(
    tmp_path: Path, record: StoreRecord, monkeypatch: pytest.MonkeyPatch, left: str
) -> None:
    held = load_partition(tmp_path / "data", record, 0, MAP_SIZE)
    apply(held, b"u1", START + 3)
    crash(held)
    if left == "no record":
        (held.path / LIVE_STATE).unlink()
    monkeypatch.setattr(store_module, "boot_id", lambda: "the next boot")  # the operating system restarted
    again = load_partition(tmp_path / "data", record, 0, MAP_SIZE)
    try:
        # The version's file again, applying from the version's offset: the topic is replayed from there.
        assert again.live is not None and again.live.offset == START - 1
        assert again.get(b"u1") is None
        assert json.loads((again.path / LIVE_STATE).read_text()) == {"boot_id": "the next boot", "clean": False}
    finally:
        again.close()


def test_sync_flushes_and_is_harmless_after_close(tmp_path: Path, record: StoreRecord) -> None:
    held = load_partition(tmp_path / "data", record, 0, MAP_SIZE)
    apply(held, b"u1", START + 1)
    held.sync()
    held.close()
    held.sync()  # a closed partition: nothing to flush, no error
