"""Short memory of nodes that just failed, so the next requests try a healthy replica first.

A failed node is only ordered last, never skipped: when every replica failed recently, all are still tried.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from keyroute.cluster.partition_map import Endpoint

log = logging.getLogger(__name__)

DEFAULT_BACKOFF_S = 2.0


class NodeBackoff:
    """Node URLs that failed within the last `backoff_s` seconds, with the time each may lead again."""

    def __init__(self, backoff_s: float = DEFAULT_BACKOFF_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._backoff_s = backoff_s
        self._clock = clock
        # Touched only from the event loop thread, so no lock.
        self._until: dict[str, float] = {}

    def failed(self, endpoint: Endpoint, reason: str) -> None:
        if endpoint.url not in self._until:
            log.warning(
                "node %s (%s) failed: %s; trying other replicas first for %.1fs",
                endpoint.node_id,
                endpoint.url,
                reason,
                self._backoff_s,
            )
        self._until[endpoint.url] = self._clock() + self._backoff_s

    @property
    def backed_off_urls(self) -> Mapping[str, float]:
        """The node URLs in back-off now or until `backed_off` next looks (each with the time it may lead
        again): the live view, empty while no node is, so a caller may skip `succeeded` when it is."""
        return self._until

    def succeeded(self, endpoint: Endpoint) -> None:
        if self._until:
            self._until.pop(endpoint.url, None)

    def backed_off(self, url: str) -> bool:
        until = self._until.get(url)
        if until is None:
            return False
        if self._clock() >= until:
            del self._until[url]
            return False
        return True

    @property
    def active(self) -> bool:
        """Whether any node is (or was until just now) backed off: False makes `split` unnecessary."""
        return bool(self._until)

    def split(self, endpoints: tuple[Endpoint, ...]) -> tuple[tuple[Endpoint, ...], tuple[Endpoint, ...]]:
        """`endpoints` as (healthy, backed off), each keeping the map's preference order."""
        if not self._until:
            return endpoints, ()
        healthy = tuple(ep for ep in endpoints if not self.backed_off(ep.url))
        if len(healthy) == len(endpoints):
            return endpoints, ()
        return healthy, tuple(ep for ep in endpoints if ep not in healthy)

    def order(self, endpoints: tuple[Endpoint, ...]) -> tuple[Endpoint, ...]:
        """`endpoints` with backed-off nodes moved last, each group keeping the map's preference order."""
        if not self._until:  # the common case costs one truth test
            return endpoints
        healthy = [ep for ep in endpoints if not self.backed_off(ep.url)]
        if len(healthy) == len(endpoints):
            return endpoints
        return (*healthy, *(ep for ep in endpoints if ep not in healthy))
