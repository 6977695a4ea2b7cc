"""/metrics of a router with `--workers N`: every worker's scrape shows the sum over all of them.

Each worker here is a RouterMetrics sharing one directory under a made-up pid, as worker processes share
the directory their parent created (router/workers.py); snapshots are published when a test says so.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from keyroute.http.admission import Admission
from keyroute.router import metrics as router_metrics
from keyroute.router.metrics import RouterMetrics
from keyroute.runtime.metrics import RETIRED_FILE, UNKNOWN_STORE, WorkerSnapshots, retire
from tests.unit.router.fakes import build_map, store_record
from tests.util import wait_for

STORES = [store_record("s", 4)]
LATENCY = "keyroute_router_upstream_latency_seconds"
REQUESTS = "keyroute_router_requests_total"
DURATION = "keyroute_router_request_duration_seconds"


class Worker(RouterMetrics):
    """A worker's metrics, and the snapshots it shares them through (as router/workers.py keeps them). Not a
    dataclass of its own: a dataclass subclass leaves the fields of the compiled build's RouterMetrics unset."""

    def __init__(self, snapshots: WorkerSnapshots | None = None, clock: Callable[[], float] = time.time) -> None:
        super().__init__(clock=clock)
        self.snapshots = snapshots


def worker(
    directory: Path, index: int, interval_s: float | None = None, clock: Callable[[], float] = time.time
) -> Worker:
    """Worker `index` (pid 1000 + index), publishing only when asked unless `interval_s` is given; `clock`: the
    wall clock its ages are counted to."""
    snapshots = WorkerSnapshots(directory, index, interval_s=interval_s, pid=1000 + index)
    m = Worker(snapshots=snapshots, clock=clock)
    m.share(snapshots)
    return m


def publish(m: Worker) -> None:
    assert m.snapshots is not None
    m.snapshots.publish()


def scrape(m: RouterMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """(sample name, labels) -> value of one scrape (the parser fails on anything malformed)."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(m.render())
        for s in family.samples
    }


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return samples[name, frozenset(labels.items())]


def reads(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], **labels: str) -> float:
    """The sum of keyroute_router_requests_total over the samples that carry `labels`."""
    wanted = set(labels.items())
    return sum(v for (name, ls), v in samples.items() if name == REQUESTS and wanted <= ls)


def test_a_scrape_sums_its_own_live_counters_and_every_other_workers_snapshot(tmp_path: Path) -> None:
    a, b, c = worker(tmp_path, 1), worker(tmp_path, 2), worker(tmp_path, 3)
    full = build_map(STORES, {"n1": {"s": [0, 1, 2, 3]}, "n2": {"s": [0, 1]}}, generation=9)
    behind = build_map(STORES, {"n1": {"s": [0, 1, 2]}}, generation=7)
    for m, pm in ((a, full), (b, full), (c, behind)):
        m.map_installed(pm)
        m.map_generation = pm.generation
        m.map_stale = False
        m.map_complete = pm is full
    a.count("s", "key", 200)
    b.count("s", "key", 200)
    b.count("s", "key", 200)
    b.count("s", "key", 404)
    c.count_results("s", "batch", [{"status": 200}, {"status": 503}])
    a.misroutes, b.misroutes, c.misroutes = 1, 2, 4
    a.observe_upstream("n1", 0.0004)
    b.observe_upstream("n1", 0.003)
    b.observe_upstream("n2", 0.2)
    c.observe_upstream("n1", 30.0)
    a.observe_request("s", 200, 0.0004)
    b.observe_request("s", 200, 0.001)
    b.observe_request("s", 404, 0.002)
    c.observe_request("s", 200, 0.001)
    b.admission = Admission()
    b.admission.overloaded = 5
    publish(b)
    publish(c)
    # Counted by a after the others published, and by b after: a shows its own at once, b's when published.
    a.count("s", "key", 404)
    a.observe_request("s", 404, 0.003)
    b.count("s", "key", 503)

    samples = scrape(a)

    assert value(samples, REQUESTS, store="s", kind="key", outcome="found") == 3
    assert value(samples, REQUESTS, store="s", kind="key", outcome="not_found") == 2
    assert (
        "keyroute_router_requests_total",
        frozenset({"store": "s", "kind": "key", "outcome": "unavailable"}.items()),
    ) not in samples
    assert value(samples, REQUESTS, store="s", kind="batch", outcome="found") == 1
    assert value(samples, REQUESTS, store="s", kind="batch", outcome="unavailable") == 1
    assert value(samples, "keyroute_router_misroutes_total") == 7
    assert value(samples, "keyroute_router_refused_requests_total", reason="overloaded") == 5
    # Histograms: buckets, counts and sums added bucket by bucket.
    assert value(samples, LATENCY + "_bucket", node="n1", le="0.0005") == 1
    assert value(samples, LATENCY + "_bucket", node="n1", le="0.005") == 2
    assert value(samples, LATENCY + "_bucket", node="n1", le="5.0") == 2
    assert value(samples, LATENCY + "_bucket", node="n1", le="+Inf") == 3
    assert value(samples, LATENCY + "_count", node="n1") == 3
    assert value(samples, LATENCY + "_sum", node="n1") == pytest.approx(30.0034)
    assert value(samples, LATENCY + "_count", node="n2") == 1
    # Request durations too, per store and status class.
    assert value(samples, DURATION + "_count", store="s", code_class="2xx") == 3
    assert value(samples, DURATION + "_bucket", store="s", code_class="2xx", le="0.0005") == 1
    assert value(samples, DURATION + "_sum", store="s", code_class="2xx") == pytest.approx(0.0024)
    assert value(samples, DURATION + "_count", store="s", code_class="4xx") == 2
    # Per-process gauges show the worker furthest behind.
    assert value(samples, "keyroute_router_map_generation") == 7
    assert value(samples, "keyroute_router_map_complete") == 0
    assert value(samples, "keyroute_router_map_stale") == 0
    assert value(samples, "keyroute_router_partition_serving_replicas", store="s", partition="0") == 1
    assert value(samples, "keyroute_router_partition_serving_replicas", store="s", partition="3") == 0
    # And each live worker, by its index.
    assert value(samples, "keyroute_router_workers") == 3
    assert value(samples, "keyroute_router_worker_map_generation", worker="1") == 9
    assert value(samples, "keyroute_router_worker_map_generation", worker="3") == 7
    assert value(samples, "keyroute_router_worker_requests_total", worker="1", outcome="found") == 1
    assert value(samples, "keyroute_router_worker_requests_total", worker="1", outcome="not_found") == 1
    assert value(samples, "keyroute_router_worker_requests_total", worker="2", outcome="found") == 2
    assert value(samples, "keyroute_router_worker_requests_total", worker="3", outcome="unavailable") == 1

    # b's scrape: its own live counters (with the 503 counted after it published) and a's, just published.
    samples = scrape(b)
    assert value(samples, REQUESTS, store="s", kind="key", outcome="unavailable") == 1
    assert reads(samples) == 8 == reads(scrape(a))


def test_the_oldest_map_and_the_longest_staleness_are_shown(tmp_path: Path) -> None:
    fresh = build_map(STORES, {"n1": {"s": [0]}})
    now = [fresh.built_at]
    a, b = worker(tmp_path, 1, clock=lambda: now[0]), worker(tmp_path, 2, clock=lambda: now[0])
    a.map_installed(fresh)
    b.map_installed(replace(fresh, built_at=fresh.built_at - 500).marked_stale(True))
    now[0] += 100  # b has been cut off from ZooKeeper for 100 s
    publish(b)
    samples = scrape(a)
    assert value(samples, "keyroute_router_map_stale_seconds") == pytest.approx(100)
    assert value(samples, "keyroute_router_map_age_seconds") == pytest.approx(600)
    assert value(samples, "keyroute_router_map_stale") == 1


def test_the_oldest_version_any_worker_routes_is_the_age_shown(tmp_path: Path) -> None:
    now = 1_800_000_000.0
    a, b = worker(tmp_path, 1, clock=lambda: now), worker(tmp_path, 2, clock=lambda: now)
    for m, age in ((a, 100), (b, 500)):
        m.map_installed(build_map([replace(STORES[0], published_at=now - age)], {"n1": {"s": [0]}}))
    publish(b)
    assert value(scrape(a), "keyroute_store_version_age_seconds", store="s") == 500


def test_a_single_process_router_shows_no_worker_families() -> None:
    names = {family.name for family in text_string_to_metric_families(RouterMetrics().render())}
    assert "keyroute_router_requests" in names
    assert not {n for n in names if n.startswith("keyroute_router_worker")}


def test_a_retired_workers_counters_stay_and_its_gauges_and_file_go(tmp_path: Path) -> None:
    a, b = worker(tmp_path, 1), worker(tmp_path, 2)
    b.map_generation = 3
    a.map_generation = 9
    for _ in range(4):
        b.count("s", "key", 200)
    b.observe_upstream("n1", 0.01)
    publish(b)
    b.count("s", "key", 200)  # counted after b's last snapshot: never shown, by anyone
    before = scrape(a)
    assert reads(before) == 4 and value(before, "keyroute_router_map_generation") == 3

    retire(tmp_path, 1002)  # the parent reaped b

    assert not (tmp_path / "1002.json").exists()
    after = scrape(a)
    assert reads(after) == 4
    assert value(after, LATENCY + "_count", node="n1") == 1
    assert value(after, "keyroute_router_map_generation") == 9
    assert value(after, "keyroute_router_workers") == 1
    assert not [
        labels
        for name, labels in after
        if name == "keyroute_router_worker_requests_total" and ("worker", "2") in labels
    ]
    # A replacement worker with the same index (and, here, even the same pid) counts from 0 again; the
    # sum does not go back.
    b2 = worker(tmp_path, 2)
    b2.count("s", "key", 404)
    publish(b2)
    again = scrape(a)
    assert reads(again) == 5
    assert value(again, "keyroute_router_worker_requests_total", worker="2", outcome="not_found") == 1


def test_a_dead_workers_file_still_there_after_it_was_retired_is_counted_once(tmp_path: Path) -> None:
    a, b = worker(tmp_path, 1), worker(tmp_path, 2)
    b.count("s", "key", 200)
    b.count("s", "key", 200)
    publish(b)
    stale = (tmp_path / "1002.json").read_bytes()
    retire(tmp_path, 1002)
    # As a scrape reading the directory between the parent's writing the retired sum and deleting the file.
    (tmp_path / "1002.json").write_bytes(stale)
    samples = scrape(a)
    assert reads(samples) == 2
    assert value(samples, "keyroute_router_workers") == 1
    # Retiring it again (the parent never does) changes nothing either.
    retire(tmp_path, 1002)
    assert reads(scrape(a)) == 2
    assert len(json.loads((tmp_path / RETIRED_FILE).read_text())["folded"]) == 1


def test_retiring_a_worker_that_never_published_removes_nothing_else(tmp_path: Path) -> None:
    a = worker(tmp_path, 1)
    a.count("s", "key", 200)
    retire(tmp_path, 4242)
    assert reads(scrape(a)) == 1
    assert not (tmp_path / RETIRED_FILE).exists()


def test_scrapes_answered_by_any_worker_never_go_backwards(tmp_path: Path) -> None:
    workers = [worker(tmp_path, i) for i in (1, 2, 3)]
    totals: list[float] = []
    for step in range(30):
        for i, m in enumerate(workers):
            for _ in range((step + i) % 3):
                m.count("s", "key", 200)
            m.upstream_requests += 1
        samples = scrape(workers[(step * 7) % 3])
        totals.append(reads(samples))
        totals.append(value(samples, "keyroute_router_upstream_requests_total"))
    reads_seen, upstream_seen = totals[0::2], totals[1::2]
    assert reads_seen == sorted(reads_seen) and upstream_seen == sorted(upstream_seen)
    for m in workers:
        publish(m)
    assert reads(scrape(workers[0])) == sum(m.requests.total() for m in workers)


def test_a_counter_the_request_path_gives_back_is_never_shown_lower(tmp_path: Path) -> None:
    # The proxy takes back an upstream request sent on a connection the node had closed, and sends it again.
    a, b = worker(tmp_path, 1), worker(tmp_path, 2)
    a.upstream_requests = 5
    assert value(scrape(a), "keyroute_router_upstream_requests_total") == 5
    a.upstream_requests -= 1
    assert value(scrape(a), "keyroute_router_upstream_requests_total") == 5
    assert value(scrape(b), "keyroute_router_upstream_requests_total") == 5
    a.upstream_requests += 2
    assert value(scrape(b), "keyroute_router_upstream_requests_total") == 5  # a has not published since
    assert value(scrape(a), "keyroute_router_upstream_requests_total") == 6


def test_an_unchanged_snapshot_is_not_written_again(tmp_path: Path) -> None:
    a = worker(tmp_path, 1)
    a.count("s", "key", 200)
    publish(a)
    path = tmp_path / "1001.json"
    written = path.stat().st_ino  # every write is a new file renamed over the old one
    publish(a)
    assert path.stat().st_ino == written
    a.count("s", "key", 200)
    publish(a)
    assert path.stat().st_ino != written
    assert json.loads(path.read_text())["sums"]["requests"][UNKNOWN_STORE]["key"]["found"] == 2
    assert not [p.name for p in tmp_path.iterdir() if p.name != "1001.json"]  # no temporary file left


def test_snapshots_are_published_in_the_background_and_on_close(tmp_path: Path) -> None:
    a = worker(tmp_path, 1)
    before = set(threading.enumerate())
    b = worker(tmp_path, 2, interval_s=0.02)
    (publisher,) = [t for t in threading.enumerate() if t not in before and t.name == "keyroute-metrics-snapshots"]
    b.count("s", "key", 200)
    wait_for(lambda: reads(scrape(a)) == 1, 10, message="b's snapshot")
    b.count("s", "key", 404)
    wait_for(lambda: reads(scrape(a)) == 2, 10, message="b's next snapshot")
    assert b.snapshots is not None
    b.snapshots.close()
    assert not publisher.is_alive()  # close stops the background publication
    b.count("s", "key", 200)
    b.snapshots.close()  # the last snapshot of a worker that is stopping
    assert reads(scrape(a)) == 3


def test_a_snapshot_can_be_taken_while_the_request_path_adds_new_series() -> None:
    m = RouterMetrics()
    for i in range(200):
        m.count(f"s{i}", "key", 200)
        m.observe_upstream(f"n{i}", 0.001)
        sums, facts = m.snapshot()
    assert len(sums["upstream_latency"]) == 200 and json.dumps([sums, facts])


def test_metrics_made_in_a_worker_process_share_its_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(router_metrics, "_process_snapshots", None)
    peer = worker(tmp_path, 2)
    peer.count("s", "key", 200)
    publish(peer)
    snapshots = router_metrics.share_across_workers(str(tmp_path), 1)
    try:
        m = RouterMetrics()  # as the worker's router makes it
        m.count("s", "key", 404)
        own = snapshots.publish()  # the process's snapshots publish what m counted
        assert own is not None and own["sums"]["requests"][UNKNOWN_STORE]["key"] == {"not_found": 1}
        samples: dict[Any, float] = scrape(m)
        assert reads(samples) == 2 and value(samples, "keyroute_router_workers") == 2
    finally:
        snapshots.close()
