"""The router's metrics: plain counters bumped on the event loop, rendered for Prometheus at /metrics.

The data path only adds to ints and dicts (no lock, no client library); `render()` builds the metric
families from them and from the installed partition map at scrape time (keyroute_core.metrics).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from keyroute.core.metrics import (
    Exposition,
    Histogram,
    RequestCounts,
    counter,
    gauge,
    histogram_family,
    labelled_gauge,
    refusals_family,
    store_label,
)
from keyroute.core.partition_map import PartitionMap
from keyroute.core.request_guard import Admission
from prometheus_client.core import Metric

# attribute -> (metric name, help). Counters get `_total` appended by the exposition.
_COUNTERS = {
    "key_requests": ("keyroute_router_key_requests", "single-key reads received"),
    "batch_requests": ("keyroute_router_batch_requests", "batch-get requests received"),
    "batch_keys": ("keyroute_router_batch_keys", "keys received in batch-get requests"),
    "upstream_requests": ("keyroute_router_upstream_requests", "requests sent to nodes"),
    "upstream_failures": (
        "keyroute_router_upstream_failures",
        "requests to nodes that failed to connect, timed out or broke off",
    ),
    "failovers": ("keyroute_router_failovers", "reads retried on another replica"),
    "misroutes": (
        "keyroute_router_misroutes",
        "reads a node had to forward (answered with X-Keyroute-Hops >= 1) because the router's map was stale",
    ),
    "map_refreshes": (
        "keyroute_router_map_refreshes",
        "immediate map re-reads asked for because a node reported the router's view stale",
    ),
    "last_known_routes": (
        "keyroute_router_last_known_routes",
        "reads of partitions no node announces, sent to the nodes that served them last",
    ),
    "unavailable": ("keyroute_router_unavailable", "keys answered 503 because no serving node answered"),
    "hedges": ("keyroute_router_hedges", "second requests sent to another replica because the first was slow"),
    "hedge_wins": ("keyroute_router_hedge_wins", "hedged reads answered first by the second replica"),
    "budget_exhausted": (
        "keyroute_router_retry_budget_exhausted",
        "hedges not sent because the retry budget was spent (failovers after an error always go)",
    ),
    "map_updates": ("keyroute_router_map_updates", "partition maps installed"),
}
_NOT_COUNTERS = frozenset(
    {
        "map_generation",
        "map_stale",
        "map_complete",
        "partition_map",
        "stale_since",
        "requests",
        "upstream_latency",
        "admission",
    }
)


@dataclass(slots=True)
class RouterMetrics:
    """What an operator needs to see that routing is healthy: outcomes, misroutes, failovers, latency."""

    key_requests: int = 0
    batch_requests: int = 0
    batch_keys: int = 0
    upstream_requests: int = 0
    upstream_failures: int = 0
    failovers: int = 0
    misroutes: int = 0
    map_refreshes: int = 0
    last_known_routes: int = 0
    unavailable: int = 0
    hedges: int = 0
    hedge_wins: int = 0
    budget_exhausted: int = 0
    map_updates: int = 0
    map_generation: int = 0
    map_stale: bool = True
    map_complete: bool = False
    # The installed map: store names for the request labels, per-partition replicas and age at scrape.
    partition_map: PartitionMap | None = None
    # Wall-clock time the installed map went stale (ZooKeeper unreachable), None while it is fresh.
    stale_since: float | None = None
    # Reads by (store, kind, outcome); a batch counts each of its keys.
    requests: RequestCounts = field(default_factory=RequestCounts)
    # Time to a node's answer, per node id.
    upstream_latency: dict[str, Histogram] = field(default_factory=dict)
    # The admission checks in front of every request: their refusals are exported.
    admission: Admission | None = None
    _exposition: Exposition | None = None

    def map_installed(self, partition_map: PartitionMap) -> None:
        """A new map was installed (on the event loop)."""
        self.partition_map = partition_map
        if not partition_map.stale:
            self.stale_since = None
        elif self.stale_since is None:
            self.stale_since = time.time()

    def count(self, store: str, kind: str, status: int) -> None:
        """One read of `store` answered with `status` (store names the map does not know share one label)."""
        m = self.partition_map
        self.requests.add(store_label(store, m.stores if m is not None else ()), kind, status)

    def count_results(self, store: str, kind: str, results: Sequence[dict[str, Any]]) -> None:
        """Each key of a batch by the status of its own result entry."""
        m = self.partition_map
        label = store_label(store, m.stores if m is not None else ())
        for entry in results:
            status = entry.get("status")
            self.requests.add(label, kind, status if isinstance(status, int) else 500)

    def observe_upstream(self, node_id: str, seconds: float) -> None:
        histogram = self.upstream_latency.get(node_id)
        if histogram is None:
            histogram = self.upstream_latency[node_id] = Histogram()
        histogram.observe(seconds)

    def families(self) -> Iterable[Metric]:
        yield self.requests.family(
            "keyroute_router_requests",
            "reads answered, by store, kind (key: one per GET, batch: one per key of a batch-get) and outcome",
        )
        for attr, (name, documentation) in _COUNTERS.items():
            yield counter(name, documentation, getattr(self, attr))
        yield refusals_family("keyroute_router_refused_requests", self.admission)
        # Counters added to this class without a name above still show, under their attribute's name.
        for f in fields(self):
            if f.name not in _COUNTERS and f.name not in _NOT_COUNTERS and not f.name.startswith("_"):
                value = getattr(self, f.name)
                if isinstance(value, int) and not isinstance(value, bool):
                    yield counter(f"keyroute_router_{f.name}", f.name.replace("_", " "), value)
        yield histogram_family(
            "keyroute_router_upstream_latency_seconds",
            "time from sending a request to a node to its complete answer, by node",
            "node",
            self.upstream_latency,
        )
        yield gauge("keyroute_router_map_generation", "generation of the installed map", self.map_generation)
        yield gauge("keyroute_router_map_stale", "1 while ZooKeeper is unreachable", int(self.map_stale))
        yield gauge(
            "keyroute_router_map_complete",
            "1 when every partition of every store is served",
            int(self.map_complete),
        )
        now = time.time()
        m = self.partition_map
        yield gauge(
            "keyroute_router_map_age_seconds",
            "seconds since the installed map was read from ZooKeeper (it is re-read on every change)",
            max(0.0, now - m.built_at) if m is not None else 0.0,
        )
        yield gauge(
            "keyroute_router_map_stale_seconds",
            "seconds the installed map has been stale (ZooKeeper unreachable); 0 while it is fresh",
            max(0.0, now - self.stale_since) if self.stale_since is not None else 0.0,
        )
        yield labelled_gauge(
            "keyroute_router_partition_serving_replicas",
            "nodes the router sends reads of this partition to (0: no node serves it)",
            ["store", "partition"],
            (
                ([name, str(p)], len(endpoints))
                for name, per_partition in (sorted(m.routes.items()) if m is not None else ())
                for p, endpoints in enumerate(per_partition)
            ),
        )

    def render(self) -> str:
        """The Prometheus text exposition."""
        return self.exposition().decode("utf-8")

    def exposition(self) -> bytes:
        if self._exposition is None:
            self._exposition = Exposition(self.families)
        return self._exposition.render()
