"""Runs one state node in the foreground until SIGTERM or SIGINT, then leaves the cluster cleanly.

`keyroute node` calls `run(settings)`; the exit code is 0 after a signal-initiated shutdown.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

import uvicorn

from keyroute_core.settings import NodeSettings
from state_node.app import create_app

log = logging.getLogger(__name__)

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Server(uvicorn.Server):
    """uvicorn's server, except that a stop signal ends in a return instead of a re-raised signal.

    uvicorn re-raises the captured signal once it has shut down, so the default handler would kill the
    process with -SIGTERM after the lifespan had already deregistered it. A service stopped on purpose
    should exit 0, so the signals are captured the same way and not raised again.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def run(settings: NodeSettings) -> int:
    """Serve until told to stop; 0 after a clean shutdown, 1 if the node could not start."""
    # httpx logs every forwarded request at INFO: one line per read is noise, failures are logged here.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().getEffectiveLevel()))
    config = uvicorn.Config(
        create_app(settings),
        host=settings.http.host,
        port=settings.http.port,
        loop="auto",
        http="httptools",
        lifespan="on",
        log_level="warning",
        access_log=False,
        # Long enough for in-flight forwards to finish, short enough for a Kubernetes grace period.
        timeout_graceful_shutdown=10,
    )
    server = _Server(config)
    try:
        server.run()
    except SystemExit as exc:  # uvicorn's way out when startup failed (ZooKeeper unreachable, port taken)
        return 0 if exc.code in (0, None) else 1
    if not server.started:
        log.error("node %s did not start (see the errors above)", settings.node_id)
        return 1
    log.info("node %s stopped", settings.node_id)
    return 0
