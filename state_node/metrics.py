"""The node's metrics: plain counters bumped on the event loop, rendered for Prometheus at /metrics.

Request counters are ints and dicts touched only by the loop. Partition state, versions and the map are
read from `Ownership` when /metrics is scraped; load durations come from the load threads (under a lock).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from keyroute.cluster.partition_map import StoreRecord
from keyroute.http.admission import Admission
from keyroute.http.quotas import Quotas, quota_families
from keyroute.replica.live import STATES as LIVE_STATES
from keyroute.replica.live import LivePartition
from keyroute.replica.store import MARKER, LoadCancelled, PartitionId, PartitionStore, partition_path
from keyroute.runtime.answers import Answers, MapAnswers
from keyroute.runtime.metrics import (
    JWKS_FETCH_FAILURES,
    JWKS_FETCH_FAILURES_HELP,
    LOAD_BUCKETS_S,
    UNKNOWN_STORE,
    CallerReads,
    Exposition,
    Histogram,
    RequestCounts,
    caller_families,
    counter,
    gauge,
    jwks_fetch_failures,
    labelled_counter,
    labelled_gauge,
    labelled_histogram,
    observe_duration,
    refusals_family,
    store_label,
    tls_certificates_family,
)
from keyroute.storage.snapshot import DATA_FILE

if TYPE_CHECKING:
    from keyroute.state_node.ownership import Ownership

Loader = Callable[[Path, StoreRecord, int, int, Callable[[], bool]], PartitionStore]

LOAD_OUTCOMES = ("loaded", "failed", "cancelled")

# A live partition's metrics with one sample per (store, partition): (family, name, help, its value).
_LIVE_PER_PARTITION: tuple[tuple[Callable[..., Metric], str, str, Callable[[LivePartition], float]], ...] = (
    (
        labelled_counter,
        "keyroute_node_live_applied_records",
        "records of a live store's topic partition folded into the partition held here",
        lambda live: live.applied,
    ),
    (
        labelled_gauge,
        "keyroute_node_live_lag_records",
        "records of the topic partition not applied yet (last known high watermark - next offset)",
        lambda live: live.lag_records,
    ),
    (
        labelled_gauge,
        "keyroute_node_live_lag_seconds",
        "age of the last applied record while the partition is behind (0 when it is not)",
        lambda live: live.lag_ms / 1000,
    ),
    (
        labelled_gauge,
        "keyroute_node_live_offset",
        "last applied offset of the topic partition (-1: none yet)",
        lambda live: live.offset,
    ),
)


class NodeMetrics:
    """What an operator needs to see that a node answers: outcomes, forwarding, partitions and loads."""

    def __init__(self) -> None:
        # Reads by (store, kind, outcome); a batch counts each of its keys.
        self.requests = RequestCounts()
        # Time from admission to the answer of a read, per (store, code_class).
        self.request_duration: dict[tuple[str, str], Histogram] = {}
        # What `answered` counts and times into those two.
        self._answers = Answers(self.requests.counts, self.request_duration)
        # `count(store, kind, status)` and `observe_request(store, status, seconds)` in one call: the data
        # plane's every counted answer, once per read (compiled: keyroute.runtime.answers).
        self.answered = MapAnswers(self._answers)
        # Reads of named callers (a router's forwarded ones under the caller it names) by (identity, store).
        self.callers = CallerReads()
        # Keys answered from a partition held here / by another node this one forwarded to.
        self.local_answers = 0
        self.forwarded_answers = 0
        # Requests sent to other nodes (one per single-key forward, one per node of a batch forward).
        self.forwards = 0
        self.forward_failures = 0
        # Requests that arrived already forwarded by another node (X-Keyroute-Hops >= 1).
        self.forwarded_in = 0
        self._ownership: Ownership | None = None
        # The admission checks in front of every request: their refusals are exported.
        self.admission: Admission | None = None
        # The quotas of direct reads (keyroute.http.quotas): reads admitted and refused by identity and store.
        self.quotas: Quotas | None = None
        # role -> file of each certificate this node presents (keyroute.runtime.metrics.certificates_in_use).
        self.certificates: dict[str, str] = {}
        self._loads_lock = threading.Lock()
        self._load_seconds = {outcome: Histogram(LOAD_BUCKETS_S) for outcome in LOAD_OUTCOMES}
        # Loads that brought a partition's data into the data directory (fetched, copied, linked or built from
        # rows) and the bytes of the data files they left there; loads that took back a partition already on
        # disk (an earlier run's files, verified) instead. A planned restart should add only to the latter.
        self.partitions_fetched = 0
        self.bytes_fetched = 0
        self.partitions_reused = 0
        self._exposition = Exposition(self.families)

    def watch(self, ownership: Ownership) -> None:
        """Read partition states and the map from `ownership` at scrape time (and each answer's store label)."""
        self._ownership = ownership
        self.answered.source = ownership

    def count(self, store: str, kind: str, status: int) -> None:
        ownership = self._ownership
        self.requests.add(store_label(store, ownership.map.stores if ownership is not None else ()), kind, status)

    def observe_request(self, store: str, status: int, seconds: float) -> None:
        """One read of `store` answered with `status`, `seconds` after its admission (once per request)."""
        ownership = self._ownership
        if ownership is None or store not in ownership.map.stores:
            store = UNKNOWN_STORE
        observe_duration(self.request_duration, store, status, seconds)

    def caller_answered(self, identity: str, store: str, status: int, seconds: float) -> None:
        """A named caller's read of `store` answered with `status` after `seconds`: by identity and store."""
        ownership = self._ownership
        known = ownership is not None and store in ownership.map.stores
        self.callers.add(identity, store if known else UNKNOWN_STORE, status, seconds)

    def timed(self, loader: Loader) -> Loader:
        """`loader`, with the duration of every load recorded by how it ended."""

        def load(
            data_dir: Path, record: StoreRecord, partition: int, map_size: int, cancelled: Callable[[], bool]
        ) -> PartitionStore:
            started = time.monotonic()
            outcome = "failed"
            marker = partition_path(data_dir, PartitionId(record.name, record.version, partition)) / MARKER
            before = _identity(marker)
            try:
                held = loader(data_dir, record, partition, map_size, cancelled)
                outcome = "loaded"
                self._count_load(held, before is not None and _identity(marker) == before)
                return held
            except LoadCancelled:
                outcome = "cancelled"
                raise
            finally:
                with self._loads_lock:
                    self._load_seconds[outcome].observe(time.monotonic() - started)

        return load

    def _count_load(self, held: PartitionStore, reused: bool) -> None:
        """A load that kept the marker an earlier run wrote reused that run's files; any other wrote them anew."""
        if reused:
            with self._loads_lock:
                self.partitions_reused += 1
            return
        try:
            size = (held.path / DATA_FILE).stat().st_size
        except (OSError, AttributeError, TypeError):
            size = 0
        with self._loads_lock:
            self.partitions_fetched += 1
            self.bytes_fetched += size

    def families(self) -> Iterable[Metric]:
        yield self.requests.family(
            "keyroute_node_requests",
            "reads answered, by store, kind (key: one per GET, batch: one per key of a batch-get) and outcome",
        )
        yield labelled_histogram(
            "keyroute_node_request_duration_seconds",
            "time from a read's admission to its answer (a batch once), by store and status class (2xx, 4xx, 5xx)",
            ["store", "code_class"],
            (([store, code], h) for (store, code), h in sorted(self.request_duration.items())),
        )
        yield from caller_families("keyroute_node", self.callers.sums())
        answers = CounterMetricFamily(
            "keyroute_node_answers",
            "keys answered from a partition held here (local) or by the node this one forwarded to (forwarded)",
            labels=["source"],
        )
        answers.add_metric(["local"], self.local_answers)
        answers.add_metric(["forwarded"], self.forwarded_answers)
        yield answers
        yield refusals_family("keyroute_node_refused_requests", self.admission)
        yield counter(JWKS_FETCH_FAILURES, JWKS_FETCH_FAILURES_HELP, jwks_fetch_failures(self.admission))
        yield tls_certificates_family(self.certificates)
        yield counter("keyroute_node_forwards", "requests forwarded to another node", self.forwards)
        yield counter(
            "keyroute_node_forward_failures",
            "forwarded requests that failed to connect, timed out or got an unusable answer",
            self.forward_failures,
        )
        yield counter(
            "keyroute_node_forwarded_in",
            "requests received already forwarded by another node",
            self.forwarded_in,
        )
        yield from quota_families("keyroute_node", self.quotas.counts() if self.quotas is not None else {})
        with self._loads_lock:
            loads = HistogramMetricFamily(
                "keyroute_node_partition_load_seconds",
                "time to load one partition into the local store, by how the load ended",
                labels=["outcome"],
            )
            for outcome, histogram in self._load_seconds.items():
                loads.add_metric([outcome], histogram.cumulative(), histogram.sum)
        yield loads
        with self._loads_lock:
            fetched, fetched_bytes, reused = self.partitions_fetched, self.bytes_fetched, self.partitions_reused
        yield counter(
            "keyroute_node_partitions_fetched",
            "partition loads that brought the partition's data into the data directory (fetched, copied, linked "
            "or built from rows)",
            fetched,
        )
        yield counter(
            "keyroute_node_fetched_bytes",
            "bytes of the data files those loads left in the data directory",
            fetched_bytes,
        )
        yield counter(
            "keyroute_node_partitions_reused",
            "partition loads that took back the files an earlier run left on disk (checked, nothing fetched)",
            reused,
        )
        yield from self._partition_families()
        yield from self._live_families()

    def _partition_families(self) -> Iterable[Metric]:
        ownership = self._ownership
        if ownership is None:
            return
        served = ownership.serving_view()
        known: set[tuple[str, int]] = {(s, p) for s, parts in served.items() for p in parts}
        for store, rows in ownership.describe().items():
            known.update((store, row["partition"]) for row in rows)
        yield labelled_gauge(
            "keyroute_node_partition_serving",
            "1 while this node serves the partition, 0 while it is loading, failed or being dropped",
            ["store", "partition"],
            (([s, str(p)], 1 if p in served.get(s, {}) else 0) for s, p in sorted(known)),
        )
        yield labelled_gauge(
            "keyroute_node_partition_version",
            "store version this node serves the partition at",
            ["store", "partition"],
            (([s, str(p)], version) for s, parts in sorted(served.items()) for p, version in sorted(parts.items())),
        )
        m = ownership.map
        readiness = ownership.readiness()
        yield gauge("keyroute_node_ready", "1 when the node has loaded everything assigned to it", int(readiness.ready))
        yield gauge(
            "keyroute_node_partitions_updating",
            "partitions served at another version than the published one (a swap in progress, or a failed load)",
            len(readiness.updating),
        )
        yield gauge(
            "keyroute_node_orphaned_partitions",
            "partitions served here of stores whose record is gone from ZooKeeper without a tombstone (kept)",
            readiness.orphaned_partitions,
        )
        yield gauge("keyroute_node_map_generation", "map generation of the partition map in use", m.generation)
        yield gauge("keyroute_node_map_stale", "1 while ZooKeeper is unreachable", int(m.stale))
        yield gauge(
            "keyroute_node_map_age_seconds",
            "seconds since the map in use was read from ZooKeeper (it is re-read on every change)",
            max(0.0, time.time() - m.built_at),
        )

    def _live_families(self) -> Iterable[Metric]:
        """Live partitions held here (every version consuming: both during a version swap)."""
        ownership = self._ownership
        held = ownership.live_partitions() if ownership is not None else []
        # One sample per (store, partition): the version in the view, else the newest (as /live reports).
        chosen: dict[tuple[str, int], LivePartition] = {}
        for pid, live in held:
            served = ownership.local(pid.store, pid.partition) if ownership is not None else None
            key = (pid.store, pid.partition)
            if (
                key not in chosen
                or (served is not None and served.version == pid.version)
                or ((served is None or served.version != chosen[key].version) and pid.version > chosen[key].version)
            ):
                chosen[key] = live
        lives = sorted(chosen.items())
        labels = ["store", "partition"]
        for family, name, documentation, value in _LIVE_PER_PARTITION:
            yield family(name, documentation, labels, (([s, str(p)], value(live)) for (s, p), live in lives))
        yield labelled_counter(
            "keyroute_node_live_skipped_records",
            "records of a live store's topic partition skipped (counted, not applied), by why",
            [*labels, "reason"],
            (([s, str(p), reason], n) for (s, p), live in lives for reason, n in sorted(live.skipped.items())),
        )
        yield labelled_gauge(
            "keyroute_node_live_state",
            "1 for the live partition's current state (catching_up, live, stalled, gap, stopped)",
            [*labels, "state"],
            (([s, str(p), state], int(live.state == state)) for (s, p), live in lives for state in LIVE_STATES),
        )

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return self._exposition.render()


def _identity(path: Path) -> tuple[int, int] | None:
    """The file's (inode, modification time): a marker written anew (atomically replaced) changes it."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns
