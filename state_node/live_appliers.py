"""The appliers of this node's live partitions: one `keyroute.replica.live.LiveApplier` per (store, version) held
here, consuming the topic partitions of that version's partitions held here, made with the first of them and
closed with the last. A partition stops being applied to before its environment closes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from keyroute.cluster.partition_map import StoreRecord
from keyroute.replica.live import ApplierSettings, LiveApplier, LivePartition, LiveVersion
from keyroute.replica.store import PartitionStore
from keyroute.runtime.settings import NodeSettings

# What makes the applier of one (store, version): LiveApplier unless a test says otherwise.
ApplierFactory = Callable[[LiveVersion, str, ApplierSettings], LiveApplier]


def _applier(source: LiveVersion, node_id: str, settings: ApplierSettings) -> LiveApplier:
    return LiveApplier(source, node_id=node_id, settings=settings)


class LiveAppliers:
    """The appliers by (store, version); on the event loop (their own work runs on their threads)."""

    def __init__(self, settings: NodeSettings, make: ApplierFactory = _applier) -> None:
        self._node_id = settings.node_id
        self._settings = ApplierSettings(
            batch_records=settings.live_batch_records, sync_interval_s=settings.live_sync_ms / 1000
        )
        self._make = make
        self._appliers: dict[tuple[str, int], LiveApplier] = {}

    def __len__(self) -> int:
        return len(self._appliers)

    async def start(
        self, record: StoreRecord, held: PartitionStore, on_change: Callable[[LivePartition], None]
    ) -> None:
        """Apply `held`'s topic partition from its next offset on (`record`: its store's), `on_change` told (on
        the applier's thread) when its state changes."""
        live = held.live
        assert live is not None
        live.on_change = on_change
        key = (held.pid.store, held.pid.version)
        applier = self._appliers.get(key)
        if applier is None:
            source = LiveVersion(
                held.pid.store,
                held.pid.version,
                live.config,
                record.key_format,
                record.partitioner,
                record.partitions,
                record.key_schema,
            )
            applier = self._appliers[key] = self._make(source, self._node_id, self._settings)
        await asyncio.to_thread(applier.add, held)

    async def stop(self, held: PartitionStore) -> None:
        """Stop applying to `held` (before it closes); the applier goes with its last partition."""
        if held.live is None:
            return
        held.live.on_change = None
        key = (held.pid.store, held.pid.version)
        applier = self._appliers.get(key)
        if applier is None:
            return
        await asyncio.to_thread(applier.remove, held.pid.partition)
        if not applier.partitions and self._appliers.get(key) is applier:
            del self._appliers[key]
            await asyncio.to_thread(applier.close)

    async def close(self) -> None:
        """Stop every applier (before any environment closes: no write ever reaches a closed one)."""
        appliers, self._appliers = list(self._appliers.values()), {}
        for applier in appliers:
            await asyncio.to_thread(applier.close)
