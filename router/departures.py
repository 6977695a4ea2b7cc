"""Nodes that left the cluster or died, as this router saw them go: what the partition-map summary and page
list under "departed", so that an operator sees WHAT broke, not only that partitions are under-replicated.

The partition map holds live nodes only (their records are ephemeral): a node that died is in it until its
ZooKeeper session expires, then in the assignment until the controller moves its partitions, then nowhere.
So the router remembers each node that drops out of the map's nodes: its name, zone and URL, when it was last
seen registered, how it went (`left`: it was leaving, drained on purpose; `gone`: its session ended without
that: it died, was killed, lost its session, or is restarting) and the partitions it served (or, when its
serving record went first, was assigned). It is listed until it is back, or until every partition it held is
served as its store asks again, and `LINGER_S` after that, so a failure that healed itself is still seen.

The memory is this router's, from its own start: another router, or this one after a restart, may list
fewer departures. The work per map is in proportion to the change: a set difference of node ids, and per
summary the partitions of the departed nodes only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from keyroute.cluster.partition_map import PartitionMap

# How long a departed node stays listed once it is back or everything it held is served as asked again.
LINGER_S = 300.0
GONE = "gone"
LEFT = "left"


@dataclass(slots=True)
class Departure:
    node_id: str
    url: str
    zone: str
    how: str  # GONE | LEFT
    last_seen: float  # unix seconds: the last map that still had it registered was current until then
    held: dict[str, tuple[int, ...]]  # store -> the partitions it served (or was assigned) when it went
    back_at: float | None = None
    recovered_at: float | None = None


class Departures:
    """The nodes this router saw go, kept as the module docstring says. Thread-safe: maps are observed on the
    event loop, summaries are built in worker threads."""

    def __init__(self, clock: Callable[[], float] = time.time, linger_s: float = LINGER_S) -> None:
        self._clock = clock
        self._linger_s = linger_s
        self._lock = threading.Lock()
        self._departed: dict[str, Departure] = {}

    def observe(self, last: PartitionMap | None, m: PartitionMap) -> None:
        """A new map `m` replaces `last`: note the nodes that are no longer registered and those back."""
        if last is None or last.nodes is m.nodes:
            return
        now = self._clock()
        went = last.nodes.keys() - m.nodes.keys()
        with self._lock:
            for node_id in went:
                record = last.nodes[node_id]
                serving = last.serving.get(node_id)
                if serving is not None and any(serving.stores.values()):
                    held = {store: tuple(sorted(parts)) for store, parts in serving.stores.items() if parts}
                else:  # its serving record went first (a restart withdraws it): what it was assigned
                    assigned = last.assignment.partitions_of(node_id)
                    held = {store: tuple(sorted(parts)) for store, parts in assigned.items()}
                self._departed[node_id] = Departure(
                    node_id, record.url, record.zone, LEFT if record.leaving else GONE, now, held
                )
            for node_id, departure in self._departed.items():
                if departure.back_at is None and node_id in m.nodes:
                    departure.back_at = now

    def describe(self, m: PartitionMap) -> list[dict[str, Any]]:
        """The departed nodes still listed, latest first: `{"node", "state", "zone", "url", "last_seen",
        "held": {store: partitions}, "held_partitions", "served_again", "back_at", "recovered_at"}`."""
        now = self._clock()
        out: list[dict[str, Any]] = []
        with self._lock:
            for node_id, d in list(self._departed.items()):
                held_total = sum(len(parts) for parts in d.held.values())
                served_again = sum(
                    1 for store, parts in d.held.items() for p in parts if _served_as_asked(m, store, p)
                )
                if d.recovered_at is None and served_again == held_total:
                    d.recovered_at = now
                healed = min((t for t in (d.back_at, d.recovered_at) if t is not None), default=None)
                if healed is not None and now - healed > self._linger_s:
                    del self._departed[node_id]
                    continue
                out.append(
                    {
                        "node": node_id,
                        "state": "back" if d.back_at is not None else d.how,
                        "zone": d.zone or None,
                        "url": d.url,
                        "last_seen": round(d.last_seen, 3),
                        "held": {store: len(parts) for store, parts in sorted(d.held.items())},
                        "held_partitions": held_total,
                        "served_again": served_again,
                        "back_at": None if d.back_at is None else round(d.back_at, 3),
                        "recovered_at": None if d.recovered_at is None else round(d.recovered_at, 3),
                    }
                )
        out.sort(key=lambda entry: (-entry["last_seen"], entry["node"]))
        return out


def _served_as_asked(m: PartitionMap, store: str, partition: int) -> bool:
    """Whether a partition is served at its store's version by as many replicas as the store asks (a store
    deleted since counts as nothing left to serve)."""
    record = m.stores.get(store)
    if record is None or partition >= record.partitions:
        return True
    routes = m.routes.get(store, ())
    endpoints = routes[partition] if partition < len(routes) else ()
    current = [ep for ep in endpoints if ep.version == record.version]
    return len(current) >= record.replication_factor
