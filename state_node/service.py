"""Runs one state node in the foreground until SIGTERM or SIGINT, then leaves the cluster gracefully.

`keyroute node` calls `run(settings)`. The first stop signal starts a graceful leave (hand every partition
over, de-announce) and then stops the server, which finishes in-flight requests; a second signal stops at
once. The exit code is 0 after a signal-initiated shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from types import FrameType

import uvicorn
from keyroute.core.bounded_http import bounded_httptools
from keyroute.core.http_server import CoalescingHttpToolsProtocol
from keyroute.core.settings import NodeSettings
from keyroute.node.app import Node, create_app, local_read_protocol

log = logging.getLogger(__name__)

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Server(uvicorn.Server):
    """uvicorn's server, with two changes for a node.

    A stop signal first runs `leave` (the graceful hand-over) and only then lets uvicorn shut down; a
    second signal, or one that arrives before the node has started, stops at once.
    uvicorn re-raises the captured signal once it has shut down, so the default handler would kill the
    process with -SIGTERM after the lifespan had already deregistered it. A service stopped on purpose
    should exit 0, so the signals are captured the same way and not raised again.
    """

    def __init__(self, config: uvicorn.Config, leave: Callable[[], Awaitable[None] | None]) -> None:
        super().__init__(config)
        self._leave = leave
        self._leaving: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

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

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or not self.started or self._leaving is not None or self.should_exit:
            self.should_exit = True  # not started yet, or asked twice: stop now
            return
        # A signal handler runs between two bytecodes of the loop's thread: only schedule from here.
        self._loop.call_soon_threadsafe(self._start_leaving)

    def _start_leaving(self) -> None:
        if self._leaving is None:
            self._leaving = asyncio.ensure_future(self._leave_then_stop())

    async def _leave_then_stop(self) -> None:
        try:
            work = self._leave()
            if work is not None:
                await work
        except Exception:  # leaving must end in a stop, whatever happened on the way
            log.exception("graceful leave failed; stopping now")
        finally:
            self.should_exit = True


def run(settings: NodeSettings) -> int:
    """Serve until told to stop; 0 after a clean shutdown, 1 if the node could not start."""
    # httpx logs every forwarded request at INFO: one line per read is noise, failures are logged here.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().getEffectiveLevel()))
    app = create_app(settings)

    def leave() -> Awaitable[None] | None:
        node: Node | None = getattr(app.state, "node", None)
        return node.leave() if node is not None else None

    config = uvicorn.Config(
        app,
        host=settings.http.host,
        port=settings.http.port,
        loop="auto",
        # Reads of keys held here answered by the protocol itself, other writes coalesced, request heads
        # beyond max_header_bytes answered 431 before they are buffered whole.
        http=bounded_httptools(
            settings.limits.max_header_bytes, local_read_protocol(app, settings.node_id, CoalescingHttpToolsProtocol)
        ),
        lifespan="on",
        log_level="warning",
        # uvicorn's own records go through the process's handlers (text or JSON lines, see keyroute_core.logs).
        log_config=None,
        access_log=False,
        proxy_headers=False,
        server_header=False,
        # Long enough for in-flight forwards to finish, short enough for a Kubernetes grace period.
        timeout_graceful_shutdown=10,
    )
    server = _Server(config, leave)
    try:
        server.run()
    except SystemExit as exc:  # uvicorn's way out when startup failed (ZooKeeper unreachable, port taken)
        return 0 if exc.code in (0, None) else 1
    if not server.started:
        log.error("node %s did not start (see the errors above)", settings.node_id)
        return 1
    log.info("node %s stopped", settings.node_id)
    return 0
