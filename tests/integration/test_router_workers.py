"""`keyroute router --workers N`: N whole routers share one port; a stop signal stops them all cleanly, and a
worker that dies takes the router down (non-zero exit) rather than leaving it short-handed."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from keyroute.core.settings import ZkSettings

from tests.integration.small_cluster import SmallCluster, small_cluster
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


@pytest.fixture
def cluster(tmp_path: Path, zk_settings: ZkSettings) -> Iterator[SmallCluster]:
    with small_cluster(tmp_path, zk_settings, router_args=["--workers", str(WORKERS)]) as c:
        yield c


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
