"""The appliers of a node's live partitions (keyroute.state_node.live_appliers): one per (store, version), made with
its first partition and closed with its last; stand-ins for the appliers and the partitions."""

from __future__ import annotations

import asyncio
from typing import Any

from keyroute.cluster.partition_map import StoreRecord
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.replica.live import ApplierSettings, LiveVersion
from keyroute.replica.store import PartitionId
from keyroute.runtime.settings import NodeSettings
from keyroute.state_node.live_appliers import LiveAppliers
from keyroute.storage.live import LiveConfig, Merge

CONFIG = LiveConfig("clicks", "127.0.0.1:9", Merge("latest", "user", order_by="ts", columns=("ts",)), (5, 5))


class Applier:
    made: list[Applier] = []

    def __init__(self, source: LiveVersion, node_id: str, settings: ApplierSettings) -> None:
        self.source, self.node_id, self.settings = source, node_id, settings
        self.partitions: list[int] = []
        self.closed = False
        Applier.made.append(self)

    def add(self, held: Any) -> None:
        self.partitions.append(held.pid.partition)

    def remove(self, partition: int) -> None:
        self.partitions.remove(partition)

    def close(self) -> None:
        self.closed = True


class Live:
    config = CONFIG
    on_change: Any = None


class Held:
    def __init__(self, version: int, partition: int, live: bool = True) -> None:
        self.pid = PartitionId("clicks", version, partition)
        self.live = Live() if live else None


def record(version: int) -> StoreRecord:
    return StoreRecord("clicks", 2, Partitioner.MURMUR2, KeyFormat.STRING, version, "/nowhere", ("ts",), 1, live=True)


def test_one_applier_per_version_made_with_its_first_partition_and_closed_with_its_last() -> None:
    Applier.made = []
    settings = NodeSettings(node_id="n1", data_dir=None, live_batch_records=7, live_sync_ms=250)  # type: ignore[arg-type]
    appliers = LiveAppliers(settings, make=Applier)  # type: ignore[arg-type]
    changed = print
    v1p0, v1p1, v2p0 = Held(1, 0), Held(1, 1), Held(2, 0)

    async def scenario() -> None:
        for held in (v1p0, v1p1, v2p0):
            await appliers.start(record(held.pid.version), held, changed)  # type: ignore[arg-type]
        first, second = Applier.made
        assert (first.source.version, first.partitions, second.source.version) == (1, [0, 1], 2)
        assert (first.node_id, first.settings.batch_records, first.settings.sync_interval_s) == ("n1", 7, 0.25)
        assert v1p0.live.on_change is changed and len(appliers) == 2
        await appliers.stop(v1p0)
        assert first.partitions == [1] and not first.closed and v1p0.live.on_change is None
        await appliers.stop(v1p1)
        assert first.closed and len(appliers) == 1
        await appliers.stop(Held(1, 0, live=False))  # a batch partition: nothing to stop
        await appliers.close()
        assert second.closed and len(appliers) == 0

    asyncio.run(scenario())
