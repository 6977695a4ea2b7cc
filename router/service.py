"""The router as a process: a uvicorn server around the router app (or several worker processes, see
router/workers.py), stopped cleanly by SIGTERM or SIGINT.

Called by `keyroute router`; returns the process exit code.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterator

import uvicorn
from keyroute.core.http_server import CoalescingHttpToolsProtocol
from keyroute.core.settings import RouterSettings
from keyroute.router import workers
from keyroute.router.app import create_app
from keyroute.router.fast_path import key_read_protocol
from keyroute.router.limits import http_protocol

log = logging.getLogger(__name__)

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Server(uvicorn.Server):
    """uvicorn re-raises the stop signal after shutting down, which would end the process with -SIGTERM;
    an orchestrator asked us to stop and we did, so the exit is a clean 0."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in _STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def run(settings: RouterSettings, *, setup: Callable[[], None] | None = None) -> int:
    """Serve until stopped: in this process, or in `settings.workers` processes sharing the port, each of
    which calls `setup` (say, logging) first, since it starts afresh."""
    if settings.workers <= 1:
        return _serve(settings, None)
    try:
        sock = workers.bind(settings.http.host, settings.http.port)
    except OSError as exc:
        log.error("the router cannot listen on %s:%d: %s", settings.http.host, settings.http.port, exc)
        return 1
    return workers.run(functools.partial(_worker, settings, setup), settings.workers, sock)


def _worker(settings: RouterSettings, setup: Callable[[], None] | None, sock: socket.socket) -> int:
    if setup is not None:
        setup()
    return _serve(settings, [sock])


def _serve(settings: RouterSettings, sockets: list[socket.socket] | None) -> int:
    # httpx logs every proxied request at INFO: one line per read is noise; failures are logged here.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().getEffectiveLevel()))
    app = create_app(settings)
    # Key reads answered by the protocol itself, then uvicorn's writes coalesced, then the head bound.
    protocol = key_read_protocol(app, settings.limits.max_key_bytes, CoalescingHttpToolsProtocol)
    config = uvicorn.Config(
        app,
        host=settings.http.host,
        port=settings.http.port,
        # Request heads beyond max_header_bytes are answered 431 before they are buffered whole.
        http=http_protocol(settings, protocol),
        loop="auto",
        lifespan="on",
        log_level="warning",
        # uvicorn's own records go through the process's handlers (text or JSON lines, see keyroute_core.logs).
        log_config=None,
        access_log=False,
        # Nothing sits between clients and a router that we would trust to say who the client is.
        proxy_headers=False,
        server_header=False,
    )
    server = _Server(config)
    try:
        server.run(sockets=sockets)
    except SystemExit as exc:
        # uvicorn exits this way when startup fails (ZooKeeper unreachable, port taken); it has logged why.
        code = exc.code if isinstance(exc.code, int) else 1
        return code or 1
    if not server.started:
        log.error("the router did not start")
        return 1
    return 0
