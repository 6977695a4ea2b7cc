"""The router as a process: one uvicorn server around the router app, stopped cleanly by SIGTERM or SIGINT.

Called by `keyroute router`; returns the process exit code.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

import uvicorn

from keyroute_core.settings import RouterSettings
from router.app import create_app

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


def run(settings: RouterSettings) -> int:
    # httpx logs every proxied request at INFO: one line per read is noise; failures are logged here.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().getEffectiveLevel()))
    config = uvicorn.Config(
        create_app(settings),
        host=settings.http.host,
        port=settings.http.port,
        http="httptools",
        loop="auto",
        lifespan="on",
        log_level="warning",
        access_log=False,
    )
    server = _Server(config)
    try:
        server.run()
    except SystemExit as exc:
        # uvicorn exits this way when startup fails (ZooKeeper unreachable, port taken); it has logged why.
        code = exc.code if isinstance(exc.code, int) else 1
        return code or 1
    if not server.started:
        log.error("the router did not start")
        return 1
    return 0
