"""What a request to a node ended with, taken one way by both of the proxy's engines (a key's read,
router/read_engine.py, and a batch's fan-out, router/batch_reads.py):

    replied   the node answered (any status): its latency observed, its back-off (if any) lifted
    refused   it answered 503: the map is re-read, but not for a bounded read's replica behind the bound
    failed    the request failed: the node's fault backs the node off and the read goes on with another
              replica; anything unexpected fails the read
    misroute  the reply says the node forwarded it (X-Keyroute-Hops): our map is behind, re-read it

The map is re-read through the proxy's `on_stale_map`, at most every MIN_REFRESH_INTERVAL_S, or at once when a
node proves a newer map generation than ours.
"""

from __future__ import annotations

import json
from bisect import bisect_left
from collections.abc import Callable
from typing import Final

from keyroute.api import HEADER_GENERATION, HEADER_HOPS
from keyroute.cluster.partition_map import Endpoint
from keyroute.http.upstream import UpstreamResponse, UpstreamUnavailable
from keyroute.router.backoff import NodeBackoff
from keyroute.router.metrics import RouterMetrics
from keyroute.runtime.logs import describe
from keyroute.runtime.metrics import Histogram

# A burst of misrouted reads (say, during a rebalance) asks for one re-read, not one per read.
MIN_REFRESH_INTERVAL_S = 0.5

HOPS: Final = HEADER_HOPS.encode("ascii")
_GENERATION: Final = HEADER_GENERATION.encode("ascii")
# Imported names a read uses, held where the compiled build (setup.py) reads them from C statics.
_bisect_left: Final = bisect_left


class NodeOutcomes:
    """Takes what each request to a node ended with: counts it, backs failing nodes off, re-reads the map
    (`map_refresh`)."""

    def __init__(self, metrics: RouterMetrics, backoff: NodeBackoff, map_refresh: MapRefresh) -> None:
        self.metrics = metrics
        self.backoff = backoff
        self._backed_off = backoff.backed_off_urls  # the nodes in back-off (empty: none)
        self.map_refresh = map_refresh

    def replied(self, endpoint: Endpoint, elapsed: float) -> None:
        """A node replied (whatever the status) `elapsed` seconds after it was asked: its latency observed, its
        back-off (if any) lifted."""
        # RouterMetrics.observe_upstream, inline (once per read)
        latency = self.metrics.upstream_latency
        histogram = latency.get(endpoint.node_id)
        if histogram is None:
            histogram = latency[endpoint.node_id] = Histogram()
        histogram.counts[_bisect_left(histogram.bounds, elapsed)] += 1
        histogram.sum += elapsed
        if self._backed_off:  # NodeBackoff.succeeded, inline: only a node in back-off has anything to undo
            self.backoff.succeeded(endpoint)

    def refused(self, reply: UpstreamResponse, bounded: bool) -> None:
        """A node replied 503: it no longer serves the partition and knows no one who does, so the map is
        re-read; but a bounded read's (`bounded`) 503 not_up_to_bound is a replica behind the bound, not a
        stale map."""
        if not bounded or error_code(reply.body) != "not_up_to_bound":
            self.map_refresh.ask()

    def failed(self, endpoint: Endpoint, error: Exception) -> bool:
        """A request to `endpoint` failed with `error`. A node's failure is counted and, when it is the node's
        fault, backs the node off (its replicas lead for a while): the node could not be reached, timed out or
        broke off (UpstreamUnavailable), or advertises a URL the wire cannot speak to (ValueError: a
        misconfigured node, taken as an unreachable one). True then: the read goes on with another replica.
        Anything else is unexpected: False, the read fails with it."""
        if isinstance(error, UpstreamUnavailable):
            self.metrics.upstream_failures += 1
            if error.node_fault:
                self.backoff.failed(endpoint, describe(error))
            return True
        if isinstance(error, ValueError):
            self.metrics.upstream_failures += 1
            self.backoff.failed(endpoint, f"unusable node URL: {describe(error)}")
            return True
        return False

    def check_hops(self, reply: UpstreamResponse) -> None:
        """Whether `reply` was forwarded by the node asked (a misroute)."""
        hops = reply.header(HOPS)
        if hops is not None:
            self.hops_seen(hops, reply)

    def hops_seen(self, hops: bytes, reply: UpstreamResponse) -> None:
        """`reply` carried X-Keyroute-Hops: `hops`."""
        if hops.strip() not in (b"", b"0"):
            # The node had to forward: it does not serve what our map says it serves.
            self.metrics.misroutes += 1
            self.map_refresh.ask(int_header(reply.header(_GENERATION)))

class MapRefresh:
    """When the map source is asked to re-read the map (`on_stale_map`): at most every MIN_REFRESH_INTERVAL_S,
    or at once when a node proves a map generation newer than `generation`, the installed table's (kept
    current by `Proxy.install`)."""

    def __init__(self, on_stale_map: Callable[[], None], clock: Callable[[], float], metrics: RouterMetrics) -> None:
        self._on_stale_map = on_stale_map
        self._clock = clock
        self._metrics = metrics
        self.generation = 0
        self._last_refresh = float("-inf")
        # The highest map generation a node reported while forwarding for us that made us re-read.
        self._refreshed_for = 0

    def ask(self, reported_map_generation: int | None = None) -> None:
        """Ask the map source to re-read now. A node that forwarded for us and used a newer map than ours
        proves our view is behind: re-read at once (once per such map generation). Otherwise re-read at most
        every MIN_REFRESH_INTERVAL_S, so a burst of misroutes costs one read."""
        now = self._clock()
        newer = (
            reported_map_generation is not None
            and reported_map_generation > self.generation
            and reported_map_generation > self._refreshed_for
        )
        if newer or now - self._last_refresh >= MIN_REFRESH_INTERVAL_S:
            if newer and reported_map_generation is not None:
                self._refreshed_for = reported_map_generation
            self._last_refresh = now
            self._metrics.map_refreshes += 1
            self._on_stale_map()


def error_code(body: bytes) -> str | None:
    """The `error` of a JSON error body, or None when it is not one."""
    try:
        code = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    return code if isinstance(code, str) else None


def int_header(value: bytes | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value.strip())
    except ValueError:
        return None
