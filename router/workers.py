"""Several router processes behind one listening socket, for when the machine has cores to spare.

A router's work is CPU-bound Python on one event loop, so one process uses at most one core. With
`--workers N` the parent binds the port once and starts N worker processes ("spawn": nothing of the
parent's threads or ZooKeeper session is inherited); the kernel hands each new connection to one of them.
Every worker is a whole router: its own map watcher and ZooKeeper session, its own connection pools. Its
`/metrics` shows the whole router, whichever worker answers the scrape: the parent creates a private
directory for the workers' metric snapshots and hands it to each worker with its index; the worker passes
them to router/metrics.py (`share_across_workers`) before its router starts, and the parent folds the
counters of each worker it reaps into the directory's retired sum (`keyroute.runtime.metrics.retire`) and
removes the directory when it exits. Nothing reads the directory's path from anywhere else.

The parent only supervises. SIGTERM or SIGINT is passed to every worker, which finishes its in-flight
requests and stops; the parent then exits 0. A worker that exits on its own (a crash, ZooKeeper
unreachable at start) stops the others and the parent exits non-zero: the orchestrator restarts the whole
router, rather than the router limping on with fewer workers than it was given.
"""

from __future__ import annotations

import logging
import multiprocessing
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Callable
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from types import FrameType

from keyroute.http.server import url_of
from keyroute.router.metrics import share_across_workers
from keyroute.runtime.logs import describe
from keyroute.runtime.metrics import retire

log = logging.getLogger(__name__)

# How long a worker may take to finish its in-flight requests after SIGTERM before it is killed.
STOP_TIMEOUT_S = 30.0
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

# serve(sock, admin_sock): the data port's socket and the admin port's (None without one).
Serve = Callable[[socket.socket, socket.socket | None], int]


def bind(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """The listening socket the workers share."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


def _worker(
    serve: Serve, sock: socket.socket, metrics_dir: str, index: int, admin_sock: socket.socket | None = None
) -> None:
    # Before `serve` builds the router: its metrics publish to, and render the sum over, `metrics_dir`.
    snapshots = share_across_workers(metrics_dir, index)
    try:
        code = serve(sock, admin_sock)
    finally:
        snapshots.close()  # a last snapshot, which the parent keeps in the retired sum
    raise SystemExit(code)


def run(
    serve: Serve, workers: int, sock: socket.socket, admin_sock: socket.socket | None = None, scheme: str = "http"
) -> int:
    """Run `serve(sock, admin_sock)` in `workers` spawned processes until stopped; the process exit code.
    `admin_sock` (None: none): the admin port's listening socket, shared as `sock` is. `scheme`: what the
    workers speak there ("https" with TLS), for the line saying where the router listens.

    `serve` must be picklable (a module-level function or a `functools.partial` of one).
    """
    context = multiprocessing.get_context("spawn")
    stopping = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in _STOP_SIGNALS}
    processes: list[BaseProcess] = []
    # The workers' metric snapshots (router/metrics.py): private to this router, gone when it stops.
    metrics_dir = tempfile.mkdtemp(prefix="keyroute-router-metrics-")
    try:
        for index in range(1, workers + 1):
            process = context.Process(
                target=_worker,
                args=(serve, sock, metrics_dir, index, admin_sock),
                name=f"keyroute-router-{index}",
            )
            process.start()
            processes.append(process)
        admin = f" (admin: {url_of(admin_sock, scheme)})" if admin_sock is not None else ""
        where = url_of(sock, scheme) + admin
        pids = ", ".join(str(p.pid) for p in processes)
        log.info("router is listening on %s with %d worker processes (%s)", where, workers, pids)
        failed: BaseProcess | None = None
        while not stopping.is_set() and failed is None:
            wait([p.sentinel for p in processes], timeout=0.5)
            failed = next((p for p in processes if p.exitcode is not None), None)
        if stopping.is_set():
            failed = None  # asked to stop: workers that got the same signal first exited as they should
        elif failed is not None:
            log.error("router worker %s exited with code %s: stopping the router", failed.pid, failed.exitcode)
            _retire(metrics_dir, failed)  # the others still answer scrapes while they stop
        return _stop(processes, failed, metrics_dir)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
        if admin_sock is not None:
            admin_sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _retire(metrics_dir: str, process: BaseProcess) -> None:
    """Keep the counters of a worker that has exited in the sum the others show, without its file."""
    if process.pid is None:
        return
    try:
        retire(metrics_dir, process.pid)
    except OSError as exc:
        log.warning("cannot retire the metrics of router worker %s: %s", process.pid, describe(exc))


def _stop(processes: list[BaseProcess], failed: BaseProcess | None, metrics_dir: str) -> int:
    for process in processes:
        if process.exitcode is None and process.pid is not None:
            process.terminate()  # SIGTERM: the worker's server finishes in-flight requests, then stops
    for process in processes:
        process.join(STOP_TIMEOUT_S)
        if process.exitcode is None:
            log.warning("router worker %s did not stop within %.0fs: killing it", process.pid, STOP_TIMEOUT_S)
            process.kill()
            process.join()
        if process is not failed:
            _retire(metrics_dir, process)
    if failed is not None:
        return failed.exitcode or 1
    return 0
