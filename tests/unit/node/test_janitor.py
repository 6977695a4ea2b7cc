"""Partition directories removed from a node's disk (keyroute.state_node.janitor): leftovers of earlier runs told
from what a store may still need, and no directory loaded while it is being removed."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from keyroute.cluster.partition_map import StoreRecord
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.replica.store import PartitionId, partition_path
from keyroute.state_node.janitor import DiskJanitor
from tests.unit.node.test_ownership import ME, build_map


def directory(data_dir: Path, store: str, version: int, partition: int) -> Path:
    path = partition_path(data_dir, PartitionId(store, version, partition))
    path.mkdir(parents=True)
    (path / "data.mdb").write_bytes(b"rows")
    return path


def test_leftovers_of_known_or_deleted_stores_go_and_the_others_stay(tmp_path: Path, caplog) -> None:
    held = directory(tmp_path, "s", 2, 0)  # held or wanted here: kept
    old_version = directory(tmp_path, "s", 1, 0)  # another version of a store with a record: goes
    other_partition = directory(tmp_path, "s", 2, 1)  # another partition of it: goes
    deleted = directory(tmp_path, "gone", 3, 0)  # a store with a tombstone: goes
    unknown = directory(tmp_path, "lost", 1, 0)  # neither record nor tombstone: absence is not deletion
    record = StoreRecord("s", 2, Partitioner.MURMUR2, KeyFormat.STRING, 2, "/nowhere", ("v",), 1)
    m = dataclasses.replace(build_map([record], {"s": ((ME,), ())}), deleted={"gone": 3})
    janitor = DiskJanitor(tmp_path)
    assert janitor.leftovers_pending
    asyncio.run(janitor.collect_leftovers(m, {PartitionId("s", 2, 0)}))
    assert not janitor.leftovers_pending
    assert held.exists() and unknown.exists()
    assert not any(path.exists() for path in (old_version, other_partition, deleted))
    assert "keeping 1 partition directories of store lost" in caplog.text


def test_a_directory_being_removed_is_in_deleting_until_it_is_gone(tmp_path: Path) -> None:
    path = directory(tmp_path, "s", 1, 0)
    pid = PartitionId("s", 1, 0)
    janitor = DiskJanitor(tmp_path)
    seen: list[bool] = []

    def removal() -> None:
        seen.append(pid in janitor.deleting)  # what a load about to start would see
        raise OSError("the disk went away")

    async def scenario() -> None:
        with pytest.raises(OSError, match="the disk went away"):
            await janitor.remove(pid, removal)
        assert seen == [True] and janitor.deleting == set() and path.exists()
        await janitor.remove_directory(pid, path)
        assert not path.exists() and janitor.deleting == set()

    asyncio.run(scenario())
