"""keyroute.local.holder: a partition let go and wanted back within the grace period is kept, not removed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from keyroute.local.holder import Holder
from keyroute.replica.live import ApplierSettings
from keyroute.replica.store import PartitionId
from keyroute.runtime.settings import ZkSettings


@dataclass
class Part:
    """A loaded batch partition as the holder sees it."""

    pid: PartitionId
    closed: bool = False
    discarded: bool = False
    live: None = None

    def close(self) -> None:
        self.closed = True

    def discard(self) -> None:
        self.closed = self.discarded = True


def holder(tmp_path: Path) -> Holder:
    return Holder(
        zk_settings=ZkSettings(),
        data_dir=tmp_path,
        stores=("bookings",),
        subsets={},
        publish=lambda held, parts: None,
        map_size=1 << 20,
        applier_settings=ApplierSettings(),
        grace_s=1.0,
    )


def test_a_partition_wanted_back_within_the_grace_period_is_kept_open_and_its_files_stay(tmp_path: Path) -> None:
    h = holder(tmp_path)
    kept, dropped = Part(PartitionId("bookings", 1, 0)), Part(PartitionId("bookings", 1, 1))
    h._parts = {kept.pid: kept, dropped.pid: dropped}  # type: ignore[dict-item]
    h._schedule_retire([kept, dropped], discard=True)  # type: ignore[list-item]
    assert h._parts == {}
    h._take_back_retiring(kept.pid)  # the subset changed back before the grace period ended
    assert h._parts == {kept.pid: kept}
    h._retire_due(float("inf"))
    assert not kept.closed and not kept.discarded
    assert dropped.discarded
