"""The ASGI lifespan protocol (spec 2.0) around the server's listening: the app's startup before the server
listens, its shutdown after the server stops; `StartupError` for a startup its operator can act on."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, cast

from keyroute.http.asgi import ASGIApp, Message

log = logging.getLogger(__name__)


class StartupError(Exception):
    """Raised by an app's lifespan when it cannot start for a reason its operator can act on (ZooKeeper
    unreachable, a node id in use): the server logs the message as one line, without a traceback."""


class Lifespan:
    """The ASGI lifespan protocol (spec 2.0) around the server's listening."""

    def __init__(self, app: ASGIApp, state: dict[str, Any]) -> None:
        self._app = app
        self._state = state
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._startup: asyncio.Future[tuple[bool, str]] | None = None
        self._shutdown: asyncio.Future[tuple[bool, str]] | None = None
        self._supported = True

    async def startup(self) -> None:
        loop = asyncio.get_running_loop()
        self._startup = loop.create_future()
        self._shutdown = loop.create_future()
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": self._state}
        # An ASGI app is an async callable: what its call returns is a coroutine.
        running = cast("Coroutine[Any, Any, None]", self._app(scope, self._inbox.get, self._send))
        self._task = task = loop.create_task(running)
        self._inbox.put_nowait({"type": "lifespan.startup"})
        await asyncio.wait((self._startup, task), return_when=asyncio.FIRST_COMPLETED)
        if self._startup.done():
            failed, message = self._startup.result()
            if failed:
                await asyncio.wait((task,), timeout=5.0)
                exc = self._retrieve()
                if isinstance(exc, StartupError):
                    raise exc
                raise RuntimeError(f"lifespan startup failed: {message}")
            return
        # Per the lifespan spec, an app that ends (or raises) before answering startup does not support it.
        self._supported = False
        exc = None if task.cancelled() else task.exception()
        log.info("the ASGI app does not support the lifespan protocol (%r); going on without it", exc)

    async def _send(self, message: Message) -> None:
        kind = message["type"]
        if kind.startswith("lifespan.startup."):
            future = self._startup
        elif kind.startswith("lifespan.shutdown."):
            future = self._shutdown
        else:
            raise RuntimeError(f"unexpected lifespan message {kind!r}")
        if future is not None and not future.done():
            future.set_result((kind.endswith(".failed"), str(message.get("message", ""))))

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        task = self._task
        if not self._supported or task is None or self._shutdown is None:
            return
        if not task.done():
            self._inbox.put_nowait({"type": "lifespan.shutdown"})
            await asyncio.wait((self._shutdown, task), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.wait((task,), timeout=5.0)
            if not task.done():
                task.cancel()
                await asyncio.wait((task,))
        reported = self._shutdown.done()
        if reported and self._shutdown.result()[0]:
            log.error("lifespan shutdown failed: %s", self._shutdown.result()[1])
            self._retrieve()
        elif not reported:
            exc = self._retrieve()
            log.error("the lifespan ended without completing its shutdown", exc_info=exc)
        else:
            exc = self._retrieve()
            if exc is not None:
                log.error("the lifespan raised after its shutdown", exc_info=exc)

    def _retrieve(self) -> BaseException | None:
        task = self._task
        if task is None or not task.done() or task.cancelled():
            return None
        return task.exception()
