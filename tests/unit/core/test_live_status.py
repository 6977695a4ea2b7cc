"""The live-status reader keeps what it read for `max_age_s` by its injected clock, and no longer."""

from __future__ import annotations

import json
from typing import Any

from keyroute.cluster import zk_layout
from keyroute.cluster.live_status import LiveStatusReader


class _Done:
    def __init__(self, value: Any) -> None:
        self.value = value

    def get(self, timeout: float) -> Any:
        return self.value


class _Handler:
    timeout_exception = TimeoutError


class _FakeZk:
    """The few kazoo calls the reader makes, over a dict of live records; counts the reads of `/live`."""

    connected = True
    handler = _Handler()

    def __init__(self) -> None:
        self.records: dict[str, dict[str, Any]] = {}
        self.listings = 0

    def get_children_async(self, path: str) -> _Done:
        assert path == zk_layout.LIVE
        self.listings += 1
        return _Done(list(self.records))

    def get_async(self, path: str) -> _Done:
        node_id = path.rsplit("/", 1)[1]
        return _Done((json.dumps(self.records[node_id]).encode(), None))


def test_a_report_is_kept_for_max_age_and_a_newer_one_read_after_it() -> None:
    zk = _FakeZk()
    zk.records["n1"] = {"stores": {"s": {"0": {"offset": 41}}}}
    now = [100.0]
    reader = LiveStatusReader(lambda: zk, max_age_s=1.0, clock=lambda: now[0])  # type: ignore[arg-type,return-value]

    assert reader.read().reports["n1"]["stores"]["s"]["0"]["offset"] == 41
    zk.records["n1"] = {"stores": {"s": {"0": {"offset": 50}}}}
    now[0] = 100.999  # within max_age_s: the cached read, ZooKeeper not asked again
    assert reader.read().reports["n1"]["stores"]["s"]["0"]["offset"] == 41
    assert zk.listings == 1
    now[0] = 101.0  # max_age_s later: read again, the newer report shows
    assert reader.read().reports["n1"]["stores"]["s"]["0"]["offset"] == 50
    assert zk.listings == 2


def test_nothing_is_cached_for_longer_when_reads_keep_coming() -> None:
    zk = _FakeZk()
    now = [0.0]
    reader = LiveStatusReader(lambda: zk, max_age_s=1.0, clock=lambda: now[0])  # type: ignore[arg-type,return-value]
    for step in range(1, 31):  # a read every 0.1 s for 3 s: the cache's age counts from its read, not the last use
        now[0] = step * 0.1
        reader.read()
    assert zk.listings == 3
