"""The partition directories on this node's disk that nothing here needs any more, removed: a dropped partition's,
a superseded version's once its grace period is over, and once at start-up the leftovers of earlier runs. A
directory is never removed while a load writes into it, nor loaded while it is being removed (`deleting`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Container
from pathlib import Path

from keyroute.cluster.partition_map import PartitionMap
from keyroute.replica.store import PartitionId, iter_partition_dirs, remove_partition_dir
from keyroute.runtime.logs import describe

log = logging.getLogger(__name__)


class DiskJanitor:
    """Removals of partition directories under `data_dir`, in worker threads; on the event loop."""

    def __init__(self, data_dir: Path) -> None:
        self._data_dir = data_dir
        # Partitions whose directory is being removed: not loaded until the removal is done, so a removal
        # never races a load writing into the same directory.
        self.deleting: set[PartitionId] = set()
        # Leftovers from earlier runs are looked for once (`collect_leftovers`): until then, this is True.
        self.leftovers_pending = True

    async def remove(self, pid: PartitionId, removal: Callable[[], None]) -> None:
        """Run `removal` (of `pid`'s directory) in a worker thread, `pid` in `deleting` meanwhile."""
        self.deleting.add(pid)
        try:
            await asyncio.to_thread(removal)
        finally:
            self.deleting.discard(pid)

    async def remove_directory(self, pid: PartitionId, path: Path) -> None:
        await self.remove(pid, functools.partial(remove_partition_dir, path))

    async def collect_leftovers(self, m: PartitionMap, held: Container[PartitionId]) -> None:
        """Remove partition directories from earlier runs that nothing here wants (`held`: what this node holds
        or wants, looked at as the removals go): those of a store that has a record (another version or
        partition) or a tombstone in `m`. A store with neither may just be missing from a damaged ZooKeeper: its
        files stay. Done once: `leftovers_pending` is False from the start of it on."""
        self.leftovers_pending = False
        kept: dict[str, int] = {}
        try:
            on_disk = await asyncio.to_thread(_on_disk, self._data_dir)
            for pid, path in on_disk:
                if pid in held or pid in self.deleting:
                    continue
                known = pid.store in m.stores and pid.store not in m.orphaned
                if not known and not m.deletes(pid.store, pid.version):
                    kept[pid.store] = kept.get(pid.store, 0) + 1
                    continue
                log.info("removing leftover partition directory %s", path)
                await self.remove_directory(pid, path)
        except OSError as exc:
            log.warning("cleaning leftover partitions failed: %s", describe(exc))
        for store, count in sorted(kept.items()):
            log.warning(
                "keeping %d partition directories of store %s: it has neither a record nor a tombstone in "
                "ZooKeeper (absence is not deletion; keyroute store delete removes a store)",
                count,
                store,
            )


def _on_disk(data_dir: Path) -> list[tuple[PartitionId, Path]]:
    return list(iter_partition_dirs(data_dir))
