"""Prometheus metrics for routers and nodes: plain counters on the request path, families built at scrape.

The request path only bumps ints in dicts and lists on the event loop thread (no lock, no client library);
`Exposition` turns them into prometheus-client metric families when /metrics is scraped, through a
registry of its own per app (never the global one: a process may run several apps, tests do).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Container, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

if TYPE_CHECKING:
    from keyroute.core.request_guard import Admission

CONTENT_TYPE = CONTENT_TYPE_LATEST

# The store label of reads for a store the map does not know: one series, whatever names clients invent.
UNKNOWN_STORE = "_unknown"

KIND_KEY = "key"
KIND_BATCH = "batch"

# Upstream answers on one machine take well under a millisecond; a loaded or remote node tens of them.
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# Loading a partition takes from milliseconds (a small test store) to many minutes (a large one).
LOAD_BUCKETS_S = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 1800.0)


def outcome(status: int) -> str:
    """The outcome label of an answer with HTTP status `status`."""
    if status < 300:
        return "found"
    if status == 404:
        return "not_found"
    if status == 503:
        return "unavailable"
    if status < 500:
        return "bad_request"
    return "error"


def store_label(store: str, known: Container[str]) -> str:
    """`store` when the partition map knows it, else UNKNOWN_STORE, so label values stay bounded."""
    return store if store in known else UNKNOWN_STORE


class RequestCounts:
    """Reads by (store, kind, outcome): one dict increment per read."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str, str], int] = {}

    def add(self, store: str, kind: str, status: int, n: int = 1) -> None:
        key = (store, kind, outcome(status))
        self.counts[key] = self.counts.get(key, 0) + n

    def total(self, outcome_label: str | None = None) -> int:
        return sum(n for (_, _, o), n in self.counts.items() if outcome_label in (None, o))

    def family(self, name: str, documentation: str) -> CounterMetricFamily:
        family = CounterMetricFamily(name, documentation, labels=["store", "kind", "outcome"])
        for labels, value in sorted(self.counts.items()):
            family.add_metric(list(labels), value)
        return family


class Histogram:
    """Counts per fixed bucket (bisect on the bounds) and a sum: what a Prometheus histogram needs."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bound's bucket (Prometheus `le` is <=).
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, float]]:
        """(le, observations <= le) for every bound and +Inf, as HistogramMetricFamily takes them."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            running += n
            out.append((repr(float(bound)), running))
        out.append(("+Inf", running + self.counts[-1]))
        return out


def histogram_family(
    name: str, documentation: str, label: str, histograms: Mapping[str, Histogram]
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, documentation, labels=[label])
    for value, histogram in sorted(histograms.items()):
        family.add_metric([value], histogram.cumulative(), histogram.sum)
    return family


def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def labelled_gauge(
    name: str, documentation: str, labels: list[str], samples: Iterable[tuple[list[str], float]]
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=labels)
    for values, value in samples:
        family.add_metric(values, value)
    return family


class _Collector:
    def __init__(self, families: Callable[[], Iterable[Metric]]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families()


class Exposition:
    """A registry of its own around one collector that builds every family at scrape time."""

    def __init__(self, families: Callable[[], Iterable[Metric]]) -> None:
        # auto_describe off: registering must not collect (the families may need state not yet there).
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(families))

    def render(self) -> bytes:
        """The Prometheus text exposition (served with CONTENT_TYPE)."""
        data: Any = generate_latest(self.registry)
        return bytes(data)


REFUSAL_REASONS = ("overloaded", "headers_too_large", "unauthorized")


def refusals_family(name: str, admission: Admission | None) -> CounterMetricFamily:
    """Requests the admission checks (keyroute_core.request_guard) refused, by reason."""
    family = CounterMetricFamily(
        name,
        "requests refused before they were handled: overloaded (503, too many in progress), headers_too_large"
        " (431), unauthorized (401, admin token)",
        labels=["reason"],
    )
    for reason in REFUSAL_REASONS:
        family.add_metric([reason], getattr(admission, reason) if admission is not None else 0)
    return family
