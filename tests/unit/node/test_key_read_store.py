"""A node's read of one key (`keyroute.state_node.reads.read_key`) from the partitions it really holds: a batch
partition loaded from a snapshot (read on a read transaction the node keeps open on it) answers what the
partition's own `get` answers, for every key and under a new partition map too, and a closed one fails as its
`get` does; a partition open for writing is read afresh by every read (a write between two reads is seen)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lmdb
import pytest

from keyroute.cluster.partition_map import Assignment, NodeRecord, PartitionMap, ServingRecord, StoreRecord
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.replica.store import LoadError, PartitionId, PartitionStore, load_partition
from keyroute.runtime.settings import NodeSettings
from keyroute.state_node.app import Node
from keyroute.state_node.reads import read_key
from keyroute.storage.lmdb_layout import db_key

MAP_SIZE = 1 << 24
ROWS = {f"customer-{i:03d}": {"n": i, "name": f"C{i}"} for i in range(40)}
# One key longer than LMDB's longest key: stored under its digest (keyroute.storage.lmdb_layout.db_key).
LONG = "k" * 600


class _Ownership:
    """What `read_key` reads of `keyroute.state_node.ownership.Ownership`: the map and the partitions held."""

    def __init__(self, m: PartitionMap, held: dict[tuple[str, int], Any]) -> None:
        self.map = m
        self.held = held

    def local(self, store: str, partition: int) -> Any:
        return self.held.get((store, partition))


def _map(record: StoreRecord, generation: int = 1) -> PartitionMap:
    return PartitionMap.build(
        {record.name: record},
        {"n1": NodeRecord("n1", "http://n1")},
        Assignment(1, {}),
        {"n1": ServingRecord("n1", "http://n1", {record.name: {0: record.version}})},
        generation=generation,
    )


def _node(record: StoreRecord, held: Any) -> Node:
    ownership = _Ownership(_map(record), {(record.name, 0): held})
    return Node(NodeSettings(node_id="n1", data_dir=None), ownership, None)  # type: ignore[arg-type]


def _read(node: Node, store: str, text: str) -> tuple[int, Any]:
    status, _, body = read_key(node, store, text, False)  # type: ignore[misc]
    return status, json.loads(body)


def test_a_batch_partition_answers_every_key_as_its_own_get_does_under_each_map(snapshot, data_dir: Path) -> None:
    record = snapshot("bookings", 1, 1, {**ROWS, LONG: {"long": True}})
    held = load_partition(data_dir, record, 0, MAP_SIZE)
    try:
        assert held.read_only
        node = _node(record, held)
        for generation in (1, 2):  # a new map: the read transactions are taken again
            node.ownership.map = _map(record, generation)  # type: ignore[misc]
            for text in [*ROWS, LONG, "absent", "k" * 599]:
                expected = held.get(text.encode("utf-8"))
                status, body = _read(node, "bookings", text)
                if expected is None:
                    assert (status, body["error"]) == (404, "key_not_found")
                else:
                    assert status == 200 and body["value"] == json.loads(expected)
                    assert body["version"] == 1 and body["partition"] == 0
            assert _read(node, "bookings", "customer-007")[1]["value"] == ROWS["customer-007"]
            assert _read(node, "bookings", LONG)[1]["value"] == {"long": True}
        held.close()
        # Closed (dropped after its grace period): the read fails as the partition's get does.
        with pytest.raises(LoadError):
            held.get(b"customer-007")
        with pytest.raises(LoadError):
            read_key(node, "bookings", "customer-007", False)
    finally:
        held.close()


def test_a_partition_open_for_writing_is_read_afresh_by_every_read(tmp_path: Path) -> None:
    record = StoreRecord("s", 1, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/nowhere", ("v",))
    env = lmdb.open(str(tmp_path / "p0"), map_size=MAP_SIZE, subdir=True, max_dbs=0)
    held = PartitionStore(PartitionId("s", 1, 0), tmp_path / "p0", 0, env)
    try:
        assert not held.read_only
        node = _node(record, held)
        assert _read(node, "s", "a")[0] == 404
        for n in range(3):  # each write is seen by the next read
            with env.begin(write=True) as txn:
                txn.put(db_key(b"a"), json.dumps({"v": n}).encode())
            status, body = _read(node, "s", "a")
            assert status == 200 and body["value"] == {"v": n}
    finally:
        held.close()
