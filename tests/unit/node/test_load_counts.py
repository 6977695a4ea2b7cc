"""What a node counts of its loads (keyroute.state_node.metrics): partitions whose data it brought into its data
directory, and partitions it took back from the files an earlier run left there."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from keyroute.cluster.partition_map import StoreRecord
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.replica.store import MARKER, PartitionId, partition_path
from keyroute.state_node.metrics import NodeMetrics
from keyroute.storage.snapshot import DATA_FILE


def test_loads_count_as_fetched_unless_they_kept_an_earlier_runs_files(tmp_path: Path) -> None:
    metrics = NodeMetrics()
    record = StoreRecord("s", 2, Partitioner.MURMUR2, KeyFormat.STRING, 1, str(tmp_path / "snap"), ("v",), 2, 1.0)

    def loader(data_dir: Path, record: StoreRecord, partition: int, map_size: int, cancelled: Any) -> Any:
        path = partition_path(data_dir, PartitionId(record.name, record.version, partition))
        if not (path / MARKER).exists():  # as load_partition does: the data, then the marker, replaced whole
            path.mkdir(parents=True)
            (path / DATA_FILE).write_bytes(b"x" * 100)
            (path / "marker.tmp").write_text("{}")
            os.replace(path / "marker.tmp", path / MARKER)
        return SimpleNamespace(path=path)

    load = metrics.timed(loader)
    load(tmp_path, record, 0, 0, lambda: False)
    load(tmp_path, record, 1, 0, lambda: False)
    assert (metrics.partitions_fetched, metrics.bytes_fetched, metrics.partitions_reused) == (2, 200, 0)
    load(tmp_path, record, 0, 0, lambda: False)  # a restart: the files are there
    assert (metrics.partitions_fetched, metrics.bytes_fetched, metrics.partitions_reused) == (2, 200, 1)
    text = metrics.render().decode()
    assert "keyroute_node_partitions_fetched_total 2.0" in text
    assert "keyroute_node_fetched_bytes_total 200.0" in text
    assert "keyroute_node_partitions_reused_total 1.0" in text
