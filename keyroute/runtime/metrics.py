"""Prometheus metrics for routers and nodes: plain counters on the request path, families built at scrape.

The request path only bumps ints in dicts and lists on the event loop thread (no lock, no client library);
`Exposition` turns them into prometheus-client metric families when /metrics is scraped, through a
registry of its own per app (never the global one: a process may run several apps, tests do).

Several worker processes behind one port (the router's `--workers`) share their counters through files, as
prometheus-client's multiprocess mode does, without touching the request path: see `WorkerSnapshots`.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
from bisect import bisect_left
from collections.abc import Callable, Container, Iterable, Mapping
from itertools import zip_longest
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from keyroute.runtime.logs import describe
from keyroute.runtime.settings import TlsSettings, ZkTls

log = logging.getLogger(__name__)

CONTENT_TYPE = CONTENT_TYPE_LATEST

# The store label of reads for a store the map does not know: one series, whatever names clients invent.
UNKNOWN_STORE = "_unknown"

KIND_KEY = "key"
KIND_BATCH = "batch"
KIND_TIMELINE = "timeline"  # history and windows reads
KIND_RANGE = "range"  # key ranges (a router's whole read; a node's one partition)

# Upstream answers on one machine take well under a millisecond; a loaded or remote node tens of them.
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# Loading a partition takes from milliseconds (a small test store) to many minutes (a large one).
LOAD_BUCKETS_S = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 1800.0)


# Refusals of who is asking, each its own outcome: a caller turned away is no malformed request.
_CALLER_OUTCOMES = {401: "unauthorized", 403: "forbidden", 429: "quota_exceeded"}


def outcome(status: int) -> str:
    """The outcome label of an answer with HTTP status `status`."""
    if status < 300:
        return "found"
    if status == 404:
        return "not_found"
    if status == 503:
        return "unavailable"
    if status < 500:
        return _CALLER_OUTCOMES.get(status, "bad_request")
    return "error"


def code_class(status: int) -> str:
    """The code_class label of an answer with HTTP status `status`: 2xx, 4xx, 5xx."""
    return f"{status // 100}xx"


# code_class of every status, looked up once per read instead of formatted.
CODE_CLASSES = {status: code_class(status) for status in range(100, 600)}


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

    @classmethod
    def of(cls, bounds: tuple[float, ...], counts: list[int], total: float) -> Histogram | None:
        """The histogram with these per-bucket `counts` (the last one +Inf) and sum; None if they do not fit
        `bounds`."""
        if len(counts) != len(bounds) + 1:
            return None
        histogram = cls(bounds)
        histogram.counts = list(counts)
        histogram.sum = total
        return histogram

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


# The identity label of callers beyond a process's first `CallerReads.cap` names: one series for the rest.
OTHER_CALLER = "other"
DEFAULT_CALLER_LABELS = 64


class CallerReads:
    """Reads by caller (identity name) and store: answers by HTTP status (401, 403, 429, 503 ... as they come)
    and a latency histogram per (identity, store). One dict lookup per read. Label sets stay bounded: the
    store is the caller's label (bounded by the map), identities are the `names` given (say, from
    configuration) and the first ones seen up to `cap` names in all; later ones share OTHER_CALLER."""

    __slots__ = ("cap", "entries", "_names")

    def __init__(self, cap: int = DEFAULT_CALLER_LABELS, names: Iterable[str] = ()) -> None:
        self.cap = cap
        # (identity, store) -> (answers by status, latency)
        self.entries: dict[tuple[str, str], tuple[dict[int, int], Histogram]] = {}
        self._names = set(names)  # the identities with a label of their own

    def add(self, name: str, store: str, status: int, seconds: float) -> None:
        entry = self.entries.get((name, store))
        if entry is None:
            entry = self._entry(name, store)
        statuses, histogram = entry
        statuses[status] = statuses.get(status, 0) + 1
        histogram.counts[bisect_left(histogram.bounds, seconds)] += 1  # Histogram.observe, inline
        histogram.sum += seconds

    def _entry(self, name: str, store: str) -> tuple[dict[int, int], Histogram]:
        names = self._names
        if name not in names:
            if len(names) < self.cap:
                names.add(name)
            else:
                name = OTHER_CALLER
        entry = self.entries.get((name, store))
        if entry is None:
            entry = self.entries[name, store] = ({}, Histogram())
        return entry

    def sums(self) -> dict[str, dict[str, Any]]:
        """{identity: {store: {"statuses": {status: n}, "counts": [...], "sum": s}}}: JSON values that add up
        over processes (`add_sums`). Copies what the request path changes by single C-level operations."""
        out: dict[str, dict[str, Any]] = {}
        for (name, store), (statuses, histogram) in list(self.entries.items()):
            out.setdefault(name, {})[store] = {
                "statuses": {str(status): n for status, n in statuses.copy().items()},
                "counts": list(histogram.counts),
                "sum": histogram.sum,
            }
        return out


def caller_families(prefix: str, sums: Mapping[str, Mapping[str, Any]]) -> Iterable[Metric]:
    """`{prefix}_caller_requests_total{identity, store, status}` and `{prefix}_caller_request_duration_seconds
    {identity, store}` of `CallerReads.sums` (or their sum over processes)."""
    answers: list[tuple[list[str], float]] = []
    durations: list[tuple[list[str], Histogram]] = []
    for name, per_store in sorted(sums.items()):
        for store, entry in sorted(per_store.items()):
            for status, n in sorted(entry.get("statuses", {}).items()):
                answers.append(([name, store, status], n))
            histogram = Histogram.of(LATENCY_BUCKETS_S, entry.get("counts", []), entry.get("sum", 0.0))
            if histogram is not None:
                durations.append(([name, store], histogram))
    yield labelled_counter(
        f"{prefix}_caller_requests",
        "reads of authenticated callers (and 401s), by identity (beyond the first names: other), store and HTTP"
        " status (a batch once)",
        ["identity", "store", "status"],
        answers,
    )
    yield labelled_histogram(
        f"{prefix}_caller_request_duration_seconds",
        "time from a read's admission to its answer, by identity (beyond the first names: other) and store",
        ["identity", "store"],
        durations,
    )


def observe_duration(durations: dict[tuple[str, str], Histogram], store: str, status: int, seconds: float) -> None:
    """One read of `store` answered with `status`, `seconds` after its admission, into the histogram of its
    (store, code class): routers and nodes keep their request durations this way (once per request)."""
    key = (store, CODE_CLASSES.get(status) or code_class(status))
    histogram = durations.get(key)
    if histogram is None:
        histogram = durations[key] = Histogram()
    histogram.counts[bisect_left(histogram.bounds, seconds)] += 1  # Histogram.observe, inline
    histogram.sum += seconds


def histogram_family(
    name: str, documentation: str, label: str, histograms: Mapping[str, Histogram]
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, documentation, labels=[label])
    for value, histogram in sorted(histograms.items()):
        family.add_metric([value], histogram.cumulative(), histogram.sum)
    return family


def labelled_histogram(
    name: str, documentation: str, labels: list[str], samples: Iterable[tuple[list[str], Histogram]]
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, documentation, labels=labels)
    for values, histogram in samples:
        family.add_metric(values, histogram.cumulative(), histogram.sum)
    return family


def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def labelled_counter(
    name: str, documentation: str, labels: list[str], samples: Iterable[tuple[list[str], float]]
) -> CounterMetricFamily:
    return _labelled(CounterMetricFamily(name, documentation, labels=labels), samples)


def labelled_gauge(
    name: str, documentation: str, labels: list[str], samples: Iterable[tuple[list[str], float]]
) -> GaugeMetricFamily:
    return _labelled(GaugeMetricFamily(name, documentation, labels=labels), samples)


_Family = TypeVar("_Family", CounterMetricFamily, GaugeMetricFamily)


def _labelled(family: _Family, samples: Iterable[tuple[list[str], float]]) -> _Family:
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


# Why requests are refused before they are handled, as `Admission` counts them (one attribute each) and the
# metrics export them (the `reason` label): its own checks' reasons (overloaded, headers_too_large,
# unauthorized), then those of the HTTP server, which refuses some requests before any service code sees them
# (keyroute.http.server's `on_refusal`: SERVER_REFUSALS, headers_too_large being both).
REFUSAL_REASONS = (
    "overloaded",
    "headers_too_large",
    "unauthorized",
    "bad_request",
    "body_timeout",
    "body_too_large",
    "expectation_failed",
)
SERVER_REFUSALS = ("bad_request", "body_timeout", "body_too_large", "expectation_failed", "headers_too_large")


def refusals(admission: object | None) -> dict[str, int]:
    """reason -> requests refused for it, as the admission checks count them (0s without checks): every
    reason of `REFUSAL_REASONS`, the HTTP server's refusals included."""
    return {reason: getattr(admission, reason) if admission is not None else 0 for reason in REFUSAL_REASONS}


def jwks_fetch_failures(admission: object | None) -> int:
    """JWKS fetches that failed (the last good signing keys kept), as the access check behind `admission`
    (its `callers`, keyroute.http.authn.Callers) counts them: 0 without a JWT issuer."""
    return int(getattr(getattr(admission, "callers", None), "jwks_fetch_failures", 0))


JWKS_FETCH_FAILURES = "keyroute_jwks_fetch_failures"
JWKS_FETCH_FAILURES_HELP = "JWKS fetches that failed or passed their deadline (the last good signing keys kept)"

# Roles of the certificates a process presents, as keyroute_tls_certificate_not_after_seconds labels them.
CERTIFICATE_SERVER = "server"  # --tls-cert: served to clients, and presented to nodes as the member identity
CERTIFICATE_ZOOKEEPER_CLIENT = "zookeeper-client"  # --zk-tls-cert: presented to ZooKeeper


def certificates_in_use(tls: TlsSettings, zk_tls: ZkTls | None) -> dict[str, str]:
    """role -> file of each certificate a router or node presents (none: TLS off on that wire)."""
    zk_cert = zk_tls.cert if zk_tls is not None else None
    found = {CERTIFICATE_SERVER: tls.cert, CERTIFICATE_ZOOKEEPER_CLIENT: str(zk_cert or "")}
    return {role: path for role, path in found.items() if path}


def certificate_not_after(path: str) -> float | None:
    """When the first certificate of the PEM file at `path` ends, in seconds since 1970; None when the file
    cannot be read or holds no PEM certificate (the process then refuses it itself, or keeps the previous)."""
    from cryptography import x509

    try:
        with open(path, "rb") as f:
            return x509.load_pem_x509_certificate(f.read()).not_valid_after_utc.timestamp()
    except (OSError, ValueError):
        return None


def tls_certificates_family(certificates: Mapping[str, str]) -> GaugeMetricFamily:
    """keyroute_tls_certificate_not_after_seconds of `certificates` (role -> file), each file read at the
    scrape: a renewed certificate shows at once, as the process loads it without a restart."""
    samples = ((role, path, certificate_not_after(path)) for role, path in sorted(certificates.items()))
    return labelled_gauge(
        "keyroute_tls_certificate_not_after_seconds",
        "when each certificate this process presents ends (seconds since 1970), by role and file",
        ["role", "path"],
        (([role, path], not_after) for role, path, not_after in samples if not_after is not None),
    )


def refusals_family(name: str, admission: object | None) -> CounterMetricFamily:
    """Requests refused before they were handled, by reason: by the admission checks
    (keyroute.http.admission) and by the HTTP server in front of them (counted by `Admission.refused`)."""
    return refusal_counts_family(name, refusals(admission))


def refusal_counts_family(name: str, counts: Mapping[str, float]) -> CounterMetricFamily:
    """`refusals_family` of counts by reason (`refusals`, or their sum over several processes)."""
    family = CounterMetricFamily(
        name,
        "requests refused before they were handled: overloaded (503, too many in progress), headers_too_large"
        " (431), unauthorized (401, admin token), bad_request (400, malformed HTTP), body_timeout (408, body"
        " not in time), body_too_large (413), expectation_failed (417)",
        labels=["reason"],
    )
    for reason in REFUSAL_REASONS:
        family.add_metric([reason], counts.get(reason, 0))
    return family


# ---------------------------------------------------------------------------------------------------------
# Several worker processes, one exposition.
#
# The parent of the workers creates a private directory and hands it to each worker, with the worker's
# index. Every worker publishes a snapshot of its own metrics to `<dir>/<pid>.json` (written whole to a
# temporary file, then renamed over the old one) every PUBLISH_INTERVAL_S on a daemon thread, and again
# whenever it is scraped. A scrape renders the worker's own snapshot, just published, plus the latest one
# of every other worker, plus RETIRED_FILE: the counters of workers that have exited, which the parent
# folds in there (`retire`) when it reaps one, before deleting its file.
#
# A snapshot is {"sums": ..., "facts": ...}. Sums are counters: nested dicts of numbers and of lists of
# numbers (histogram buckets), added key by key and element by element over workers (`add_sums`). Facts
# are per-process values (a gauge such as the map generation): the caller decides how to combine them,
# and they leave with the worker.
#
# Why the sum never goes backwards (Prometheus would read a decrease as a counter reset): each worker
# publishes its sums clamped to what it published before (`at_least`), so each file only grows; a scrape
# renders exactly what its worker just published; and a retired worker's last snapshot stays in the sum.
# So for two scrapes one after the other, answered by any workers, every worker's part of the second is at
# least its part of the first. What a worker counted after its last snapshot before it died is never
# shown: at most one interval's worth, which no scrape had shown either.
# ---------------------------------------------------------------------------------------------------------

SNAPSHOT_FORMAT = 1
RETIRED_FILE = "retired.json"
PUBLISH_INTERVAL_S = 1.0

Sums = dict[str, Any]
Facts = dict[str, Any]
Snapshot = tuple[Sums, Facts]


def add_sums(a: Any, b: Any) -> Any:
    """`a` + `b` for counters: dicts key by key (a key in one only is kept), lists element by element
    (the shorter one padded with 0), numbers added."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = dict(a)
        for key, value in b.items():
            out[key] = add_sums(out[key], value) if key in out else value
        return out
    if isinstance(a, list) and isinstance(b, list):
        return [add_sums(x, y) for x, y in zip_longest(a, b, fillvalue=0)]
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a + b
    return b  # a mismatch (never between processes of one version): the newer wins


def at_least(previous: Any, current: Any) -> Any:
    """`current`, raised wherever it is below `previous`: a counter published once never goes back."""
    if isinstance(previous, dict) and isinstance(current, dict):
        out = dict(previous)
        for key, value in current.items():
            out[key] = at_least(previous[key], value) if key in previous else value
        return out
    if isinstance(previous, list) and isinstance(current, list) and len(previous) == len(current):
        return [at_least(p, c) for p, c in zip(previous, current, strict=True)]
    if isinstance(previous, int | float) and isinstance(current, int | float):
        return max(previous, current)
    return current


def _write_atomically(path: Path, data: bytes) -> None:
    # Readers see the old file or the new one, never a part: rename replaces the name in one step.
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_bytes())
    except (OSError, ValueError):  # gone (its worker was retired meanwhile), or not one of ours
        return None
    return record if isinstance(record, dict) and record.get("format") == SNAPSHOT_FORMAT else None


def read_snapshots(
    directory: str | os.PathLike[str], exclude: str | os.PathLike[str] | None = None
) -> tuple[list[dict[str, Any]], Sums]:
    """(the latest snapshot record of every live worker but the one at `exclude`, the retired workers'
    summed counters).

    The retired file is read after the workers' files, and a worker's file whose snapshot it already holds
    is skipped: `retire` writes the retired file before deleting the worker's file, so a worker being
    retired during the read is counted once, from one place or the other."""
    directory = Path(directory)
    excluded = Path(exclude) if exclude is not None else None
    records: list[dict[str, Any]] = []
    for path in sorted(directory.glob("*.json")):
        if path.name == RETIRED_FILE or path == excluded:
            continue
        record = _read(path)
        if record is not None:
            records.append(record)
    retired = _read(directory / RETIRED_FILE) or {}
    folded = set(retired.get("folded", ()))
    return [r for r in records if r.get("token") not in folded], retired.get("sums", {})


def retire(directory: str | os.PathLike[str], pid: int) -> None:
    """Called by the parent when it has reaped worker `pid`: its last snapshot's counters join the retired
    sum (its facts are dropped), then its file is deleted. Only the parent writes the retired file."""
    directory = Path(directory)
    path = directory / f"{pid}.json"
    record = _read(path)
    if record is not None:
        retired = _read(directory / RETIRED_FILE) or {"format": SNAPSHOT_FORMAT, "folded": [], "sums": {}}
        if record.get("token") not in retired["folded"]:
            retired["sums"] = add_sums(retired["sums"], record.get("sums", {}))
            retired["folded"].append(record.get("token"))
            _write_atomically(directory / RETIRED_FILE, json.dumps(retired, separators=(",", ":")).encode())
    path.unlink(missing_ok=True)
    path.with_name(f".{path.name}.tmp").unlink(missing_ok=True)  # killed while writing


class WorkerSnapshots:
    """One worker's side of the directory its parent shares between its workers' metrics.

    `attach(take)` gives the function that snapshots this worker's metrics, `take() -> (sums, facts)`; it
    runs on the event loop at scrape time and on a daemon thread every `interval_s` (None: only when
    asked, for tests), so it must only copy what the request path mutates with C-level operations
    (`dict.copy()`, `list(...)`, reading an attribute), never iterate a live dict in Python. `gather()`
    publishes a fresh snapshot and returns it with every other worker's latest: what a scrape renders.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        worker: int,
        *,
        interval_s: float | None = PUBLISH_INTERVAL_S,
        pid: int | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.worker = worker
        self.pid = os.getpid() if pid is None else pid
        self.path = self.directory / f"{self.pid}.json"
        # Tells this worker's snapshots from those of an earlier process with the same pid (`retire`).
        self.token = secrets.token_hex(8)
        self.interval_s = interval_s
        self._take: Callable[[], Snapshot] | None = None
        self._lock = threading.Lock()  # one publication at a time: the file only ever grows
        self._published: Sums = {}
        self._written: bytes | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def attach(self, take: Callable[[], Snapshot]) -> None:
        """Publish the snapshots `take` returns (from now on, in place of any attached before)."""
        self._take = take
        if self.interval_s is not None and self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._run, name="keyroute-metrics-snapshots", daemon=True)
            self._thread.start()

    def publish(self) -> dict[str, Any] | None:
        """Write this worker's snapshot now (unless unchanged) and return it; None before `attach`."""
        take = self._take
        if take is None:
            return None
        with self._lock:
            sums, facts = take()
            sums = at_least(self._published, sums)
            record = {
                "format": SNAPSHOT_FORMAT,
                "pid": self.pid,
                "worker": self.worker,
                "token": self.token,
                "sums": sums,
                "facts": facts,
            }
            data = json.dumps(record, separators=(",", ":")).encode()
            if data != self._written:
                try:
                    _write_atomically(self.path, data)
                except OSError as exc:  # the directory is gone: the parent is stopping
                    log.debug("cannot publish worker metrics to %s: %s", self.path, describe(exc))
                else:
                    self._written = data
            self._published = sums
        return record

    def gather(self) -> tuple[dict[str, Any] | None, list[dict[str, Any]], Sums]:
        """(this worker's snapshot, just published; the other live workers' latest; the retired sums)."""
        own = self.publish()
        others, retired = read_snapshots(self.directory, exclude=self.path)
        return own, others, retired

    def close(self) -> None:
        """Stop the thread and publish a last time (the worker is exiting: `retire` keeps the result)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self.publish()

    def _run(self) -> None:
        interval_s = self.interval_s if self.interval_s is not None else PUBLISH_INTERVAL_S
        while not self._stop.wait(interval_s):
            try:
                self.publish()
            except Exception:
                log.exception("publishing this worker's metrics failed")
