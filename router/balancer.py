"""Which serving replica a read goes to first, when a slow read is worth a second request, and how many
second requests the router may send at all: pure bookkeeping for `Proxy`, touched only on the event loop.

    Balancer         least outstanding requests (in flight from this router) over a partition's replicas
    RetryBudget      token bucket that caps hedges (and counts failovers) at a share of primary requests
    LatencyQuantile  a high quantile of recent upstream latencies: the automatic hedge threshold
"""

from __future__ import annotations

import random
from collections.abc import Callable

from keyroute.cluster.partition_map import Endpoint
from keyroute.router.backoff import NodeBackoff
from keyroute.runtime.counters import count_down, count_up

DEFAULT_BUDGET_RATIO = 0.1
# Hedges the bucket can hold: a burst after a quiet spell, and what a fresh router may send at once.
DEFAULT_BUDGET_BURST = 10.0

DEFAULT_QUANTILE = 0.95
DEFAULT_FLOOR_S = 0.002
DEFAULT_CEILING_S = 1.0
DEFAULT_WINDOW = 512
# The quantile is re-sorted from the window every this many reads: at 64 the sort cost ~1,400 instructions per
# read, about 1% of a proxied read; at 256 a quarter of that, and the delay still follows a change of latency
# within a fraction of a second at any rate worth hedging.
DEFAULT_RECOMPUTE_EVERY = 256


class Balancer:
    """Orders a partition's serving replicas for one read (or one batch group): the first is asked first.

    Least outstanding requests: the healthy replica with the fewest requests in flight to its node from
    this router leads (a tie is a coin toss among the tied), the next fewest follows (the hedge and first
    failover target, ties alike), then the remaining healthy replicas in map order, then the ones
    `NodeBackoff` holds back. A single healthy replica involves no randomness at all, and two with different
    loads none either. The counts are this router's own and exact at once (each request is counted as it
    goes out), so routers do not herd onto one replica as they would on a shared, delayed load report.

    In-flight counts are per node URL, raised by `request_sent` and lowered by `request_ended` around every
    upstream request (single keys and batch groups alike, as both load the node). One event loop, so no lock.
    """

    def __init__(self, backoff: NodeBackoff | None = None, rng: random.Random | None = None) -> None:
        self.backoff = backoff or NodeBackoff()
        self._random: Callable[[], float] = (rng or random.Random()).random
        # Requests in flight per node URL; a URL leaves the dict when its count drops to zero, so nodes
        # replaced over the router's lifetime (new pod addresses) leave nothing behind.
        self.in_flight: dict[str, int] = {}

    def request_sent(self, url: str) -> None:
        """A request to the node at `url` went out."""
        count_up(self.in_flight, url)

    def request_ended(self, url: str) -> None:
        """A request to the node at `url` ended: replied, failed or cancelled."""
        count_down(self.in_flight, url)

    def order(self, endpoints: tuple[Endpoint, ...]) -> tuple[Endpoint, ...]:
        """`endpoints` (one partition's serving replicas, map order) in the order to ask them."""
        if len(endpoints) < 2:
            return endpoints
        backoff = self.backoff
        if backoff.active:
            healthy, held_back = backoff.split(endpoints)
            if held_back:
                return (*self._pick(healthy), *held_back)
        return self._pick(endpoints)

    def _pick(self, endpoints: tuple[Endpoint, ...]) -> tuple[Endpoint, ...]:
        n = len(endpoints)
        if n < 2:
            return endpoints
        load = self.in_flight
        if n == 2:  # the common case (replication factor 2): no draw needed to find the two candidates
            first, second = endpoints
            a, b = load.get(first.url, 0), load.get(second.url, 0)
            if a < b or (a == b and self._random() < 0.5):
                return endpoints
            return (second, first)
        loads = [load.get(ep.url, 0) for ep in endpoints]
        i = self._lightest(loads, -1)
        j = self._lightest(loads, i)
        first, second = endpoints[i], endpoints[j]
        return (first, second, *(ep for ep in endpoints if ep is not first and ep is not second))

    def _lightest(self, loads: list[int], skip: int) -> int:
        """The index of the smallest of `loads` but `skip`, a tie drawn uniformly (one draw per tie seen)."""
        rand = self._random
        best = -1
        low = 0
        ties = 0
        for i, x in enumerate(loads):
            if i == skip:
                continue
            if best < 0 or x < low:
                best, low, ties = i, x, 1
            elif x == low:
                ties += 1
                if rand() * ties < 1.0:
                    best = i
        return best


class RetryBudget:
    """How many extra requests (hedges, failovers) the router may send: a token bucket fed by reads.

    Every primary request (a single-key read, a batch's first request to a node) deposits `ratio` tokens,
    up to `burst`; a hedge needs one whole token and spends it. So over any stretch of time, hedges are at
    most `ratio` of the primary requests plus `burst`: a node that is slow for every read gets 10% more
    requests, never a retry storm that would make it slower still.

    A failover after a failed request (connection refused or reset, a timeout, a node's 503) spends a
    token when there is one but is never refused. It is what keeps reads from failing when a node dies,
    and unlike a hedge it cannot snowball: the failed node is backed off after its first failure, so the
    next reads go to a healthy replica first, and each read still tries each replica at most once.
    Spending on failovers means a sick cluster stops hedging first, which is what it needs.
    """

    __slots__ = ("ratio", "burst", "_gain", "_cap", "_units")

    # Tokens are counted in thousandths, as integers: ten deposits of 0.1 make exactly one hedge.
    _UNIT = 1000

    def __init__(self, ratio: float = DEFAULT_BUDGET_RATIO, burst: float = DEFAULT_BUDGET_BURST) -> None:
        if ratio < 0 or burst < 0:
            raise ValueError("the retry budget's ratio and burst must not be negative")
        self.ratio = ratio
        self.burst = burst
        self._gain = round(ratio * self._UNIT)
        self._cap = round(burst * self._UNIT)
        self._units = self._cap

    @property
    def tokens(self) -> float:
        return self._units / self._UNIT

    def deposit(self) -> None:
        """One primary request was sent."""
        units = self._units + self._gain
        self._units = units if units < self._cap else self._cap

    def try_spend(self) -> bool:
        """Take a token for a hedge; False (nothing taken) when the bucket holds less than one."""
        if self._units >= self._UNIT:
            self._units -= self._UNIT
            return True
        return False

    def spend_failover(self) -> None:
        """A failover is sent regardless; it takes a token if one is there."""
        units = self._units - self._UNIT
        self._units = units if units > 0 else 0


class LatencyQuantile:
    """A `quantile` of the last `window` latencies, clamped to [`floor_s`, `ceiling_s`]; None until known.

    `record` writes into a fixed ring (no allocation); the quantile is recomputed by sorting the ring
    every `recompute_every` samples, a few microseconds spread over that many reads.
    """

    __slots__ = ("quantile", "floor_s", "ceiling_s", "recompute_every", "value_s", "_ring", "_next", "_count")

    def __init__(
        self,
        quantile: float = DEFAULT_QUANTILE,
        *,
        floor_s: float = DEFAULT_FLOOR_S,
        ceiling_s: float = DEFAULT_CEILING_S,
        window: int = DEFAULT_WINDOW,
        recompute_every: int = DEFAULT_RECOMPUTE_EVERY,
    ) -> None:
        if not 0.0 < quantile < 1.0:
            raise ValueError("the quantile must be between 0 and 1")
        if not 0.0 < floor_s <= ceiling_s:
            raise ValueError("expected 0 < floor_s <= ceiling_s")
        if window < 1 or not 1 <= recompute_every <= window:
            raise ValueError("expected a window of at least one sample and 1 <= recompute_every <= window")
        self.quantile = quantile
        self.floor_s = floor_s
        self.ceiling_s = ceiling_s
        self.recompute_every = recompute_every
        # None until `recompute_every` samples have been seen: no hedging on a guess.
        self.value_s: float | None = None
        self._ring = [0.0] * window
        self._next = 0
        self._count = 0

    def record(self, latency_s: float) -> None:
        i = self._next
        ring = self._ring
        ring[i] = latency_s
        i += 1
        self._next = i if i < len(ring) else 0
        self._count = count = self._count + 1
        if count % self.recompute_every == 0:
            self._recompute()

    def _recompute(self) -> None:
        ring = self._ring
        samples = sorted(ring if self._count >= len(ring) else ring[: self._count])
        value = samples[min(len(samples) - 1, int(self.quantile * len(samples)))]
        self.value_s = min(self.ceiling_s, max(self.floor_s, value))
