"""The router's metrics: plain counters bumped on the event loop, rendered for Prometheus at /metrics.

The data path only adds to ints and dicts (no lock, no client library); `render()` builds the metric
families from them and from the installed partition map at scrape time (keyroute.runtime.metrics).

With `--workers N` (router/workers.py) every worker process calls `share_across_workers` first: the
metrics made in that process then publish snapshots to the directory the parent shares between its
workers, and a scrape, whichever worker answers it, shows what the whole router did:

- counters and histograms (buckets, sums, counts) are the sum over the live workers and those that have
  exited (`keyroute.runtime.metrics.WorkerSnapshots`: the sum never goes backwards);
- the per-process gauges, under their usual names, show the worker that is furthest behind, what an alert
  wants: the lowest map generation, stale if any worker is, complete only if every worker's map is, the
  oldest map age and longest staleness, and per partition the fewest serving replicas any worker sees;
- families only present with workers break it down per live worker, label `worker` (1..N, the process's
  index, not its pid, so series stay few): `keyroute_router_workers`, `keyroute_router_worker_requests_total`
  (reads answered, by outcome) and `keyroute_router_worker_map_generation`.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Final

from prometheus_client.core import Metric

from keyroute.cluster.partition_map import PartitionMap
from keyroute.http.admission import Admission
from keyroute.http.quotas import Quotas, quota_families
from keyroute.runtime.answers import Answers
from keyroute.runtime.metrics import (
    JWKS_FETCH_FAILURES,
    JWKS_FETCH_FAILURES_HELP,
    LATENCY_BUCKETS_S,
    UNKNOWN_STORE,
    CallerReads,
    Exposition,
    Facts,
    Histogram,
    RequestCounts,
    Snapshot,
    Sums,
    WorkerSnapshots,
    add_sums,
    caller_families,
    counter,
    gauge,
    histogram_family,
    jwks_fetch_failures,
    labelled_counter,
    labelled_gauge,
    labelled_histogram,
    observe_duration,
    refusal_counts_family,
    refusals,
    store_label,
    tls_certificates_family,
)
from keyroute.runtime.native import mypyc_attr

# attribute -> help. Each is exported as the counter keyroute_router_<attribute> (`_total` appended by the
# exposition), unless _RENAMED names it otherwise.
_COUNTERS = {
    "key_requests": "single-key reads received",
    "batch_requests": "batch-get requests received",
    "batch_keys": "keys received in batch-get requests",
    "upstream_requests": "requests sent to nodes",
    "upstream_failures": "requests to nodes that failed to connect, timed out or broke off",
    "failovers": "reads retried on another replica",
    "misroutes": "reads a node had to forward (answered with X-Keyroute-Hops >= 1) because the router's map was stale",
    "map_refreshes": "immediate map re-reads asked for because a node reported the router's view stale",
    "last_known_routes": "reads of partitions no node announces, sent to the nodes that served them last",
    "unavailable": "keys answered 503 because no serving node answered",
    "hedges": "second requests sent to another replica because the first was slow",
    "hedge_wins": "hedged reads answered first by the second replica",
    "budget_exhausted": "hedges not sent because the retry budget was spent (failovers after an error always go)",
    "stalls": "reads sent to another replica because nothing had replied within the stall delay (a frozen node)",
    "map_updates": "partition maps installed",
}
_RENAMED = {"budget_exhausted": "keyroute_router_retry_budget_exhausted"}


def _counter_name(attr: str) -> str:
    return _RENAMED.get(attr, f"keyroute_router_{attr}")


_NOT_COUNTERS = frozenset(
    {
        "map_generation",
        "map_stale",
        "map_complete",
        "partition_map",
        "stale_since",
        "requests",
        "upstream_latency",
        "request_duration",
        "callers",
        "admission",
        "certificates",
    }
)


# Imported names every answer uses, held where the compiled build (setup.py) reads them from C statics.
_UNKNOWN_STORE: Final = UNKNOWN_STORE
_bisect_left: Final = bisect_left

# Set in a worker process before its router starts (`share_across_workers`); None in a single-process router.
_process_snapshots: WorkerSnapshots | None = None


def share_across_workers(directory: str, worker: int) -> WorkerSnapshots:
    """Make every RouterMetrics created in this process from now on publish to, and render the sum over,
    `directory`: the one the parent created for its workers; `worker` is this process's index (1..N).
    Called once, first thing in each worker process (router/workers.py); the caller closes the result
    when the worker stops."""
    global _process_snapshots
    _process_snapshots = WorkerSnapshots(directory, worker)
    return _process_snapshots


@mypyc_attr(allow_interpreted_subclasses=True)
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
    stalls: int = 0
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
    # Time from admission to the answer of a read, per (store, code_class).
    request_duration: dict[tuple[str, str], Histogram] = field(default_factory=dict)
    # Reads of named callers by (identity, store): answers by status, latency.
    callers: CallerReads = field(default_factory=CallerReads)
    # The admission checks in front of every request: their refusals are exported.
    admission: Admission | None = None
    # role -> file of each certificate this router presents (keyroute.runtime.metrics.certificates_in_use).
    certificates: dict[str, str] = field(default_factory=dict)
    # The router's quotas (keyroute/http/quotas.py): reads admitted and refused by identity and store, when configured.
    quotas: Quotas | None = None
    # The wall clock (seconds since the epoch): when the map went stale, and the ages shown at a scrape.
    clock: Callable[[], float] = time.time
    _exposition: Exposition | None = None
    # With workers: where this worker publishes its snapshots and finds the others' (see the module doc).
    _snapshots: WorkerSnapshots | None = None
    # (seq of the map they were computed from, zone_facts of it)
    _zones: tuple[int, dict[str, int]] | None = None
    # What `answered` counts and times into `requests` and `request_duration`. The store label is decided per
    # answer from the installed map (the unknown store's for a name it lacks), so its cells stay bounded by
    # the map's stores and hold nothing a new map makes wrong.
    _answers: Answers | None = None

    def __post_init__(self) -> None:
        self._answers = Answers(self.requests.counts, self.request_duration)
        if _process_snapshots is not None:
            self.share(_process_snapshots)

    def share(self, snapshots: WorkerSnapshots) -> None:
        """Publish this worker's counters through `snapshots` and render the sum over every worker."""
        self._snapshots = snapshots
        snapshots.attach(self.snapshot)

    def map_installed(self, partition_map: PartitionMap) -> None:
        """A new map was installed (on the event loop)."""
        self.partition_map = partition_map
        if not partition_map.stale:
            self.stale_since = None
        elif self.stale_since is None:
            self.stale_since = self.clock()

    def count(self, store: str, kind: str, status: int) -> None:
        """One read of `store` answered with `status` (store names the map does not know share one label).
        The data plane counts a read with `answered` instead, which also times it in the same frame."""
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
        # Histogram.observe, inline (once per upstream request).
        histogram.counts[bisect_left(histogram.bounds, seconds)] += 1
        histogram.sum += seconds

    def answered(self, store: str, kind: str, status: int, seconds: float) -> None:
        """`count(store, kind, status)` and `observe_request(store, status, seconds)` in one call: the data
        plane's every counted answer, once per read."""
        m = self.partition_map
        if m is None or store not in m.stores:
            store = _UNKNOWN_STORE
        self._answers.add(store, kind, status, seconds)  # type: ignore[union-attr]

    def observe_request(self, store: str, status: int, seconds: float) -> None:
        """One read of `store` answered with `status`, `seconds` after its admission (once per request)."""
        m = self.partition_map
        if m is None or store not in m.stores:
            store = UNKNOWN_STORE
        observe_duration(self.request_duration, store, status, seconds)

    def caller_answered(self, identity: str, store: str, status: int, seconds: float) -> None:
        """A named caller's read of `store` answered with `status` after `seconds` (the data plane's
        `caller_answered`): by identity and store."""
        m = self.partition_map
        self.callers.add(identity, store if m is not None and store in m.stores else UNKNOWN_STORE, status, seconds)

    def snapshot(self) -> Snapshot:
        """(sums, facts): this process's counters, and its gauges' inputs, as JSON values.

        May run on another thread than the event loop (the snapshot publisher), so what the request path
        changes is only copied by single C-level operations, then read from the copies."""
        counts = self.requests.counts.copy()
        latency = list(self.upstream_latency.items())
        durations = list(self.request_duration.items())
        requests: dict[str, dict[str, dict[str, int]]] = {}
        for (store, kind, outcome_label), n in counts.items():
            requests.setdefault(store, {}).setdefault(kind, {})[outcome_label] = n
        counters = {attr: getattr(self, attr) for attr in _COUNTERS}
        # Counters added to this class without a name in _COUNTERS still show, under their attribute's name.
        for f in fields(self):
            if f.name not in _COUNTERS and f.name not in _NOT_COUNTERS and not f.name.startswith("_"):
                value = getattr(self, f.name)
                if isinstance(value, int) and not isinstance(value, bool):
                    counters[f.name] = value
        sums: Sums = {
            "counters": counters,
            "requests": requests,
            "refused": refusals(self.admission),
            "jwks_fetch_failures": jwks_fetch_failures(self.admission),
            "upstream_latency": {node: {"counts": list(h.counts), "sum": h.sum} for node, h in latency},
            "request_duration": _nested_histograms(durations),
            "callers": self.callers.sums(),
            "quotas": self.quotas.counts() if self.quotas is not None else {},
        }
        m = self.partition_map
        facts: Facts = {
            "map_generation": self.map_generation,
            "map_stale": int(self.map_stale),
            "map_complete": int(self.map_complete),
            "map_built_at": m.built_at if m is not None else None,
            "stale_since": self.stale_since,
            # When each store's current version was published (records from before it was recorded: none).
            "published_at": {name: record.published_at for name, record in (m.stores.items() if m is not None else ())},
            "replicas": {
                name: [len(endpoints) for endpoints in per_partition]
                for name, per_partition in (m.routes.items() if m is not None else ())
            },
            **self._zone_facts(m),
        }
        return sums, facts

    def _zone_facts(self, m: PartitionMap | None) -> dict[str, int]:
        """The zone gauges' inputs, computed once per installed map (`zone_facts`)."""
        if m is None:
            return {}
        cached = self._zones
        if cached is None or cached[0] != m.seq:
            cached = self._zones = (m.seq, zone_facts(m))
        return cached[1]

    def families(self) -> Iterable[Metric]:
        # The certificates are files every worker shares: read by the one scraped, never summed.
        yield tls_certificates_family(self.certificates)
        snapshots = self._snapshots
        if snapshots is None:
            sums, facts = self.snapshot()
            yield from _families(sums, [facts], None, self.clock())
            return
        own, others, retired = snapshots.gather()
        records = ([own] if own is not None else []) + others
        total = retired
        for record in records:
            total = add_sums(total, record.get("sums", {}))
        yield from _families(total, [r.get("facts", {}) for r in records], records, self.clock())

    def render(self) -> str:
        """The Prometheus text exposition."""
        return self.exposition().decode("utf-8")

    def exposition(self) -> bytes:
        if self._exposition is None:
            self._exposition = Exposition(self.families)
        return self._exposition.render()


def _families(
    sums: Sums, facts: Sequence[Facts], workers: Sequence[Mapping[str, Any]] | None, now: float
) -> Iterable[Metric]:
    """The exposition of `sums` (one process's counters, or their sum over workers) and of `facts` (one
    per live process: their gauges show the furthest behind); with `workers` (their snapshot records),
    the per-worker families too. `now`: the wall clock the ages are counted to."""
    yield labelled_counter(
        "keyroute_router_requests",
        "reads answered, by store, kind (key: one per GET, batch: one per key of a batch-get) and outcome",
        ["store", "kind", "outcome"],
        _request_samples(sums.get("requests", {})),
    )
    counters: dict[str, float] = sums.get("counters", {})
    for attr, documentation in _COUNTERS.items():
        yield counter(_counter_name(attr), documentation, counters.get(attr, 0))
    yield refusal_counts_family("keyroute_router_refused_requests", sums.get("refused", {}))
    yield counter(JWKS_FETCH_FAILURES, JWKS_FETCH_FAILURES_HELP, sums.get("jwks_fetch_failures", 0))
    for attr, value in counters.items():
        if attr not in _COUNTERS:
            yield counter(_counter_name(attr), attr.replace("_", " "), value)
    latency: dict[str, Histogram] = {}
    for node, h in sums.get("upstream_latency", {}).items():
        histogram = Histogram.of(LATENCY_BUCKETS_S, h.get("counts", []), h.get("sum", 0.0))
        if histogram is not None:
            latency[node] = histogram
    yield histogram_family(
        "keyroute_router_upstream_latency_seconds",
        "time from sending a request to a node to its complete answer, by node",
        "node",
        latency,
    )
    durations: list[tuple[list[str], Histogram]] = []
    for store, per_class in sorted(sums.get("request_duration", {}).items()):
        for code, h in sorted(per_class.items()):
            histogram = Histogram.of(LATENCY_BUCKETS_S, h.get("counts", []), h.get("sum", 0.0))
            if histogram is not None:
                durations.append(([store, code], histogram))
    yield labelled_histogram(
        "keyroute_router_request_duration_seconds",
        "time from a read's admission to its answer (a batch once), by store and status class (2xx, 4xx, 5xx)",
        ["store", "code_class"],
        durations,
    )
    yield from caller_families("keyroute_router", sums.get("callers", {}))
    # Each worker's map, summed up as the worst of them: (fact, help, how the worst is found, when absent).
    for fact, text, worst, absent in (
        (
            "map_generation",
            "map generation of the installed partition map (with workers: the lowest any worker has installed)",
            min,
            0,
        ),
        ("map_stale", "1 while ZooKeeper is unreachable (with workers: for any of them)", max, 1),
        (
            "map_complete",
            "1 when every partition of every store is served (with workers: in every worker's map)",
            min,
            0,
        ),
    ):
        yield gauge(f"keyroute_router_{fact}", text, worst((f.get(fact, absent) for f in facts), default=absent))
    # Seconds since a worker's moment, the longest of them (0 when none has one).
    for name, text, fact in (
        (
            "map_age_seconds",
            "seconds since the installed map was read from ZooKeeper (it is re-read on every change; with "
            "workers: the oldest)",
            "map_built_at",
        ),
        (
            "map_stale_seconds",
            "seconds the installed map has been stale (ZooKeeper unreachable); 0 while it is fresh (with "
            "workers: the longest)",
            "stale_since",
        ),
    ):
        since = (max(0.0, now - f[fact]) for f in facts if f.get(fact) is not None)
        yield gauge(f"keyroute_router_{name}", text, max(since, default=0.0))
    published: dict[str, float] = {}
    for f in facts:
        for name, at in f.get("published_at", {}).items():
            if at:  # 0: a record from before publish times were recorded
                published[name] = min(at, published.get(name, at))
    yield labelled_gauge(
        "keyroute_store_version_age_seconds",
        "seconds since the store's current version was published (with workers: the oldest any worker routes)",
        ["store"],
        (([name], max(0.0, now - at)) for name, at in sorted(published.items())),
    )
    fewest: dict[tuple[str, int], int] = {}
    for f in facts:
        for name, per_partition in f.get("replicas", {}).items():
            for p, n in enumerate(per_partition):
                fewest[name, p] = min(n, fewest.get((name, p), n))
    yield labelled_gauge(
        "keyroute_router_partition_serving_replicas",
        "nodes the router sends reads of this partition to (0: no node serves it; with workers: the fewest)",
        ["store", "partition"],
        (([name, str(p)], n) for (name, p), n in sorted(fewest.items())),
    )
    yield gauge(
        "keyroute_router_partitions_sharing_zone",
        "partitions (over all stores) of replication factor 2 or more whose assigned replicas are all in one"
        " zone while the cluster's nodes are in more than one: a zone's outage takes every replica (with"
        " workers: the most any worker's map shows)",
        max((f.get("partitions_sharing_zone", 0) for f in facts), default=0),
    )
    yield gauge(
        "keyroute_router_nodes_without_zone",
        "registered nodes that gave no zone (--zone, --zone-file): the controller cannot spread replicas over"
        " zones by them (with workers: the most any worker's map shows)",
        max((f.get("nodes_without_zone", 0) for f in facts), default=0),
    )
    yield from quota_families("keyroute_router", sums.get("quotas", {}))
    if workers is not None:
        yield from _worker_families(workers)


def zone_facts(m: PartitionMap) -> dict[str, int]:
    """From a partition map: `partitions_sharing_zone`, the partitions of stores with replication factor >= 2
    assigned two or more replicas that are all in one zone, counted only while the registered nodes are in
    more than one zone (replicas on a node without a zone, or on one no longer registered, share no known
    zone: `nodes_without_zone` counts the first); and `nodes_without_zone`, registered nodes with an empty
    zone."""
    zone_of = {node_id: record.zone for node_id, record in m.nodes.items()}
    without = sum(1 for zone in zone_of.values() if not zone)
    sharing = 0
    if len({zone for zone in zone_of.values() if zone}) > 1:
        for name, per_partition in m.assignment.stores.items():
            record = m.stores.get(name)
            if record is None or record.replication_factor < 2:
                continue
            for replicas in per_partition:
                if len(replicas) < 2:
                    continue
                zones = {zone_of.get(node_id, "") for node_id in replicas}
                if len(zones) == 1 and "" not in zones:
                    sharing += 1
    return {"partitions_sharing_zone": sharing, "nodes_without_zone": without}


def _worker_families(records: Sequence[Mapping[str, Any]]) -> Iterable[Metric]:
    """What each live worker contributes, by its index (two records of one index, which the parent never
    runs at once, would be combined rather than exposed twice)."""
    answered: dict[tuple[str, str], float] = {}
    generation: dict[str, int] = {}
    for record in records:
        worker = str(record.get("worker"))
        for per_kind in record.get("sums", {}).get("requests", {}).values():
            for per_outcome in per_kind.values():
                for outcome_label, n in per_outcome.items():
                    answered[worker, outcome_label] = answered.get((worker, outcome_label), 0) + n
        g = record.get("facts", {}).get("map_generation", 0)
        generation[worker] = min(g, generation.get(worker, g))
    yield gauge("keyroute_router_workers", "router worker processes reporting", len(generation))
    yield labelled_counter(
        "keyroute_router_worker_requests",
        "reads answered by each live router worker (by its index), by outcome",
        ["worker", "outcome"],
        (([worker, outcome_label], n) for (worker, outcome_label), n in sorted(answered.items())),
    )
    yield labelled_gauge(
        "keyroute_router_worker_map_generation",
        "map generation of the partition map each live router worker (by its index) has installed",
        ["worker"],
        (([worker], g) for worker, g in sorted(generation.items())),
    )


def _nested_histograms(items: Iterable[tuple[tuple[str, str], Histogram]]) -> dict[str, dict[str, Any]]:
    """{store: {code_class: {"counts", "sum"}}}: histograms as snapshot sums (added over workers)."""
    out: dict[str, dict[str, Any]] = {}
    for (store, code), h in items:
        out.setdefault(store, {})[code] = {"counts": list(h.counts), "sum": h.sum}
    return out


def _request_samples(requests: Mapping[str, Any]) -> Iterable[tuple[list[str], float]]:
    flat = [
        ((store, kind, outcome_label), n)
        for store, per_kind in requests.items()
        for kind, per_outcome in per_kind.items()
        for outcome_label, n in per_outcome.items()
    ]
    return ((list(labels), n) for labels, n in sorted(flat))
