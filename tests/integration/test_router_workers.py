"""`keyroute router --workers N`: N whole routers share one port; a stop signal stops them all cleanly, a
worker that dies takes the router down (non-zero exit) rather than leaving it short-handed, and /metrics,
whichever worker answers it, counts what every worker did.

One cluster for the module; each test that stops or breaks the router leaves it down, and the next test starts
it again (the same member, on the same port)."""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from keyroute.runtime.settings import ZkSettings
from tests.integration.small_cluster import STORE, SmallCluster, key_path, small_cluster
from tests.util import Proc, wait_for

pytestmark = pytest.mark.integration

WORKERS = 2


def workers_of(parent: int) -> list[int]:
    """The parent's worker processes (not multiprocessing's own helper processes)."""
    found = []
    for child in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            found.append(int(child))
    return found


def gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory, module_zk_settings: ZkSettings) -> Iterator[SmallCluster]:
    tmp = tmp_path_factory.mktemp("router-workers")
    with small_cluster(tmp, module_zk_settings, router_args=["--workers", str(WORKERS)]) as c:
        yield c


@pytest.fixture
def cluster(running: SmallCluster) -> SmallCluster:
    """The module's cluster with its router up: started again if an earlier test stopped it."""
    if not running.router.alive:
        running.router.restart()
        wait_for(
            lambda: httpx.get(running.router_url + "/readyz", timeout=5).json().get("complete") is True,
            60,
            message="the restarted router's map to be complete",
        )
    return running


def router_proc(cluster: SmallCluster) -> Proc:
    proc = next(p for p in cluster.procs if p.args[0] == "router")
    assert proc.popen is not None
    return proc


def test_every_worker_routes_and_a_stop_signal_stops_them_all_with_exit_0(cluster: SmallCluster) -> None:
    router = router_proc(cluster)
    assert router.popen is not None
    pids = wait_for(lambda: len(workers_of(router.popen.pid)) == WORKERS and workers_of(router.popen.pid), 30)
    # A new connection per read: the kernel spreads them over the workers, and every one of them routes.
    for _ in range(3):
        with httpx.Client(timeout=10, trust_env=False) as client:
            cluster.check_every_key(client)
    assert router.stop() == 0
    wait_for(lambda: all(gone(pid) for pid in pids), 30, message="every worker to exit")


def test_a_worker_that_dies_takes_the_router_down_with_a_non_zero_exit(cluster: SmallCluster) -> None:
    router = router_proc(cluster)
    assert router.popen is not None
    pids = wait_for(lambda: len(workers_of(router.popen.pid)) == WORKERS and workers_of(router.popen.pid), 30)
    os.kill(pids[0], signal.SIGKILL)
    code = wait_for(lambda: router.popen.poll(), 40, message="the router to exit")
    assert code != 0
    wait_for(lambda: all(gone(pid) for pid in pids), 30, message="every worker to exit")


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(cluster: SmallCluster) -> Samples:
    # A new connection for every scrape: the kernel hands it to either worker.
    with httpx.Client(timeout=10, trust_env=False) as client:
        response = client.get(cluster.router_url + "/metrics")
    assert response.status_code == 200, response.text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def not_found(samples: Samples) -> float:
    """Single-key reads of STORE answered 404, by the whole router (the cluster's set-up reads only keys
    that exist: these are the test's own reads)."""
    labels = frozenset({"store": STORE, "kind": "key", "outcome": "not_found"}.items())
    return samples.get(("keyroute_router_requests_total", labels), 0.0)


def not_found_by_worker(samples: Samples) -> dict[str, float]:
    return {
        dict(labels)["worker"]: value
        for (name, labels), value in samples.items()
        if name == "keyroute_router_worker_requests_total" and ("outcome", "not_found") in labels
    }


def test_metrics_from_any_worker_count_the_reads_of_every_worker(cluster: SmallCluster) -> None:
    router = router_proc(cluster)
    assert router.popen is not None
    pids = wait_for(lambda: len(workers_of(router.popen.pid)) == WORKERS and workers_of(router.popen.pid), 30)
    sent = 0
    seen: list[float] = []  # what every scrape showed, in order: it must never go backwards

    def observed() -> Samples:
        samples = scrape(cluster)
        seen.append(not_found(samples))
        return samples

    def both_workers_answered_some() -> bool:
        nonlocal sent
        for _ in range(10):
            with httpx.Client(timeout=10, trust_env=False) as client:  # a new connection per read
                response = client.get(cluster.router_url + key_path(f"missing-{sent}"))
            assert response.status_code == 404, response.text
            sent += 1
        by_worker = not_found_by_worker(observed())
        return len(by_worker) == WORKERS and all(n > 0 for n in by_worker.values())

    wait_for(both_workers_answered_some, 60, message="reads answered by every worker")
    # The directory the parent shares between its workers' metric snapshots, one file per live worker.
    tmp = Path(tempfile.gettempdir())
    shared = wait_for(
        lambda: {p.parent for pid in pids for p in tmp.glob(f"keyroute-router-metrics-*/{pid}.json")},
        10,
        message="the workers' metric snapshots",
    )
    assert len(shared) == 1

    # Each worker answered only part of the reads: a scrape that counts all of them counts every worker's.
    # Once the last snapshots are out (within a second), every scrape does, whichever worker answers it.
    wait_for(lambda: not_found(observed()) == sent, 30, message=f"a scrape counting all {sent} reads")
    for _ in range(8):
        samples = observed()
        assert not_found(samples) == sent
        assert sum(not_found_by_worker(samples).values()) == sent
        assert samples["keyroute_router_workers", frozenset()] == WORKERS
    assert seen == sorted(seen), seen

    assert router.stop() == 0
    wait_for(lambda: all(gone(pid) for pid in pids), 30, message="every worker to exit")
    assert not [d for d in shared if d.exists()]  # the parent removed the snapshots' directory
