"""Time to live (keyroute.storage.ttl), with an injected clock: a value (a history row) is served until its
time is exactly `ttl` old, not from then on; a node's key and batch reads answer 404 `expired` for it."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest

from keyroute.cluster.partition_map import Assignment, NodeRecord, PartitionMap, ServingRecord, StoreRecord
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.runtime.settings import NodeSettings
from keyroute.state_node.app import Node
from keyroute.state_node.reads import read_batch, read_key
from keyroute.storage.timeline import TimelineError, TimeType
from keyroute.storage.ttl import Ttl, time_in_us

DAY_US = 86_400_000_000
NOW = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.UTC)
NOW_S = NOW.timestamp()
MS = 0.001


def ttl(text: str = "7 days") -> Ttl:
    return Ttl.parse(text, "at")


def value(at: Any) -> bytes:
    return json.dumps({"at": at, "fare": 3}).encode()


def iso(moment: dt.datetime) -> str:
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def test_a_value_exactly_ttl_old_is_expired_one_ms_younger_is_not() -> None:
    boundary = NOW - dt.timedelta(days=7)
    for shown in (iso, lambda m: int(m.timestamp() * 1000)):
        assert ttl().expired(value(shown(boundary)), NOW_S)
        assert not ttl().expired(value(shown(boundary + dt.timedelta(milliseconds=1))), NOW_S)
        assert ttl().expired(value(shown(boundary - dt.timedelta(milliseconds=1))), NOW_S)
    # The clock moving on by one ms expires the value that was one ms younger.
    younger = value(iso(boundary + dt.timedelta(milliseconds=1)))
    assert not ttl().expired(younger, NOW_S)
    assert ttl().expired(younger, NOW_S + MS)


def test_a_date_is_its_days_start_and_a_value_without_a_time_never_expires() -> None:
    assert ttl("1 day").expired(value("2026-02-28"), NOW_S)
    assert not ttl("2 days").expired(value("2026-02-28"), NOW_S)
    for timeless in (None, "not a time", True, [1]):
        assert not ttl().expired(value(timeless), NOW_S)
    assert not ttl().expired(b"[1, 2]", NOW_S)
    assert time_in_us("1970-01-02") == DAY_US


def test_a_history_reads_lower_bound_is_the_oldest_time_still_served() -> None:
    boundary_us = int(NOW_S * 1_000_000) - 7 * DAY_US
    assert ttl().timeline_low(NOW_S, TimeType.TIMESTAMP) == boundary_us + 1
    # Integer times are milliseconds: the boundary's own millisecond is expired, the next is served.
    assert ttl().timeline_low(NOW_S, TimeType.INTEGER) == boundary_us // 1000 + 1
    # Dates: the day that starts exactly at the boundary is expired.
    assert ttl().timeline_low(NOW_S, TimeType.DATE) == boundary_us // DAY_US + 1


def test_a_ttl_is_a_positive_duration_and_survives_its_record() -> None:
    with pytest.raises(TimelineError):
        Ttl.parse("soon")
    parsed = Ttl.parse("90 minutes", "at")
    assert parsed.span_us == 90 * 60 * 1_000_000
    assert Ttl.from_dict(parsed.to_dict()) == parsed
    record = StoreRecord("s", 1, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/x", ("at",), ttl=parsed)
    assert StoreRecord.from_json(record.to_json()).ttl == parsed
    assert (
        StoreRecord.from_json(StoreRecord("s", 1, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/x").to_json()).ttl is None
    )


class _Held:
    live = None
    version = 1

    def __init__(self, rows: dict[bytes, bytes]) -> None:
        self.rows = rows

    def get(self, key: bytes) -> bytes | None:
        return self.rows.get(key)


class _Ownership:
    def __init__(self, m: PartitionMap, held: _Held) -> None:
        self.map = m
        self.held = {("s", 0): held}

    def local(self, store: str, partition: int) -> _Held | None:
        return self.held.get((store, partition))


def node_with(rows: dict[str, Any], clock: list[float]) -> Node:
    record = StoreRecord("s", 1, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/x", ("at", "fare"), ttl=ttl())
    m = PartitionMap.build(
        {"s": record},
        {"n1": NodeRecord("n1", "http://n1")},
        Assignment(1, {}),
        {"n1": ServingRecord("n1", "http://n1", {"s": {0: 1}})},
    )
    held = _Held({k.encode(): value(v) for k, v in rows.items()})
    node = Node(NodeSettings(node_id="n1", data_dir=None), _Ownership(m, held), None)  # type: ignore[arg-type]
    node.clock = lambda: clock[0]
    return node


def test_a_node_answers_an_expired_value_404_expired_by_its_clock() -> None:
    boundary = NOW - dt.timedelta(days=7)
    clock = [NOW_S]
    node = node_with({"old": iso(boundary), "young": iso(boundary + dt.timedelta(milliseconds=1))}, clock)
    status, _, body = read_key(node, "s", "old", False)  # type: ignore[misc]
    assert status == 404 and json.loads(body)["error"] == "expired"
    status, _, body = read_key(node, "s", "young", False)  # type: ignore[misc]
    assert status == 200 and json.loads(body)["value"]["fare"] == 3
    status, _, body = read_key(node, "s", "absent", False)  # type: ignore[misc]
    assert status == 404 and json.loads(body)["error"] == "key_not_found"
    entries = [json.loads(e) for e in read_batch(node, "s", ["old", "young"], False).entries]  # type: ignore[arg-type]
    assert [(e["status"], e.get("error")) for e in entries] == [(404, "expired"), (200, None)]
    clock[0] = NOW_S + MS  # one ms on, the young value is exactly ttl old
    status, _, body = read_key(node, "s", "young", False)  # type: ignore[misc]
    assert status == 404 and json.loads(body)["error"] == "expired"
    entries = [json.loads(e) for e in read_batch(node, "s", ["young"], False).entries]  # type: ignore[arg-type]
    assert entries[0]["status"] == 404 and entries[0]["error"] == "expired"
