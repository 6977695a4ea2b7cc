"""The router's counters, rendered in the Prometheus text format at /metrics.

Plain integers bumped on the event loop thread: no lock, no client library on the hot path.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RouterMetrics:
    """What an operator needs to see that routing is healthy: misroutes, failovers and unavailability."""

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
    map_updates: int = 0
    map_generation: int = 0
    map_stale: bool = True
    map_complete: bool = False

    def render(self) -> str:
        rows = [
            ("keyroute_router_key_requests_total", "counter", "single-key reads received", self.key_requests),
            (
                "keyroute_router_batch_requests_total",
                "counter",
                "batch-get requests received",
                self.batch_requests,
            ),
            (
                "keyroute_router_batch_keys_total",
                "counter",
                "keys received in batch-get requests",
                self.batch_keys,
            ),
            (
                "keyroute_router_upstream_requests_total",
                "counter",
                "requests sent to nodes",
                self.upstream_requests,
            ),
            (
                "keyroute_router_upstream_failures_total",
                "counter",
                "requests to nodes that failed to connect, timed out or broke off",
                self.upstream_failures,
            ),
            (
                "keyroute_router_failovers_total",
                "counter",
                "reads retried on another replica",
                self.failovers,
            ),
            (
                "keyroute_router_misroutes_total",
                "counter",
                "reads a node had to forward because the router's map was stale",
                self.misroutes,
            ),
            (
                "keyroute_router_map_refreshes_total",
                "counter",
                "immediate map re-reads asked for because a node reported the router's view stale",
                self.map_refreshes,
            ),
            (
                "keyroute_router_last_known_routes_total",
                "counter",
                "reads of partitions no node announces, sent to the nodes that served them last",
                self.last_known_routes,
            ),
            (
                "keyroute_router_unavailable_total",
                "counter",
                "keys answered 503 because no serving node answered",
                self.unavailable,
            ),
            ("keyroute_router_map_updates_total", "counter", "partition maps installed", self.map_updates),
            (
                "keyroute_router_map_generation",
                "gauge",
                "generation of the installed map",
                self.map_generation,
            ),
            ("keyroute_router_map_stale", "gauge", "1 while ZooKeeper is unreachable", int(self.map_stale)),
            (
                "keyroute_router_map_complete",
                "gauge",
                "1 when every partition of every store is served",
                int(self.map_complete),
            ),
        ]
        lines: list[str] = []
        for name, kind, help_text, value in rows:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
        return "\n".join(lines) + "\n"
