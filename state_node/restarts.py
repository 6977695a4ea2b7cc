"""Planned restarts: a node that stops to start again keeps its partitions (nothing is moved or copied).

A node told to stop (SIGTERM) with `--restart-grace-s` above 0 and no drain request (`keyroute node-drain`)
stops for a restart: before its ephemeral /nodes record goes it writes /restarting/{node_id} (persistent:
its node id, zone, the time it began to stop and the grace it asks for), withdraws its serving record (reads
of its partitions go to their other replicas meanwhile) and exits. The controller places a node with such a
record as if it were still live for the grace period (`holds`): the assignment does not change, so no other
node loads its partitions. The node, started again on the same data directory under the same node id,
registers, deletes the record and serves its partitions from the files on disk. When the grace ends without
it the controller deletes the record and reassigns its partitions as for any departed node.

A node with a drain request, or with `--restart-grace-s 0`, leaves as before: the controller moves every
partition away and the node serves until the new replicas do (make before break).
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from keyroute.cluster.partition_map import RecordError, json_object


@dataclass(frozen=True, slots=True)
class PlannedRestart:
    """/restarting/{node_id}: the node stopped at `at` (unix seconds) and asks to be held `grace_s` seconds."""

    node_id: str
    at: float
    grace_s: float
    zone: str = ""

    @property
    def ends_at(self) -> float:
        return self.at + self.grace_s

    def to_json(self) -> bytes:
        record: dict[str, object] = {"node_id": self.node_id, "at": self.at, "grace_s": self.grace_s}
        if self.zone:
            record["zone"] = self.zone
        return json.dumps(record, sort_keys=True, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_json(cls, raw: bytes) -> PlannedRestart:
        obj = json_object(raw, "restart record")
        node_id, at, grace_s, zone = obj.get("node_id"), obj.get("at"), obj.get("grace_s"), obj.get("zone", "")
        if not isinstance(node_id, str) or not node_id:
            raise RecordError("restart record: no node_id")
        for name, value in (("at", at), ("grace_s", grace_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise RecordError(f"restart record: {name} is not a number")
        if grace_s < 0:  # type: ignore[operator]
            raise RecordError("restart record: negative grace_s")
        return cls(node_id, float(at), float(grace_s), zone if isinstance(zone, str) else "")  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Holds:
    """What the controller makes of the restart records at one moment."""

    # node -> zone: nodes away for a planned restart within their grace, placed as if live.
    held: Mapping[str, str] = field(default_factory=dict)
    # Records to delete: their grace ended without the node (or they are unreadable).
    expired: tuple[str, ...] = ()
    # When the first hold ends (unix seconds), None without holds: the controller recomputes then.
    next_end: float | None = None


def holds(restarts: Mapping[str, PlannedRestart | None], registered: Collection[str], now: float) -> Holds:
    """The holds of `restarts` (node id -> its record, None when unreadable) at `now` (unix seconds), given the
    nodes `registered` now. A registered node is live, whatever its record says (it deletes the record on its
    return); a record is held while `now` is before its end, and expired from then on."""
    held: dict[str, str] = {}
    expired: list[str] = []
    ends: list[float] = []
    for node, record in sorted(restarts.items()):
        if node in registered:
            continue
        if record is None or record.node_id != node or now >= record.ends_at:
            expired.append(node)
            continue
        held[node] = record.zone
        ends.append(record.ends_at)
    return Holds(held, tuple(expired), min(ends) if ends else None)
