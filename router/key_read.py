"""One single-key read as it goes (`Read`) and each request it sends a node (`NodeRequest`): the state the
read engine (router/read_engine.py) moves along, and delivering the result exactly once.

A read delivers once: after it, or after `cancel()`, its `on_result` is `_DELIVERED`, which nothing may call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from keyroute.cluster.partition_map import Endpoint
from keyroute.http.upstream import UpstreamResponse, UpstreamUnavailable

if TYPE_CHECKING:
    from keyroute.router.read_engine import ReadEngine

log = logging.getLogger(__name__)

# What a read's caller gets its result with (`Proxy.read`), and what a request's reply or failure goes to.
OnResult = Callable[[UpstreamResponse | Exception], None]


def _delivered(result: UpstreamResponse | Exception) -> None:
    """A read's `on_result` once it has delivered or been cancelled: nothing may reach its caller again."""
    raise AssertionError("a read delivered twice")


_DELIVERED: Final = _delivered


class Read:
    """One single-key read (made by `Proxy.read`): where it goes, in which order, its requests out.

    At most two requests are out at once: `lead` (the first request, or after a failure the failover) and
    `hedge`. `asked` counts the replicas of `order` asked so far. `waiting` is True while a hedge may still
    be sent (`HedgeTimer` calls `fire` when it is due). The first usable reply is delivered and the other
    request cancelled; when nothing is out and nothing usable came back, the next replica is asked.

    A plain class with its own `__init__` (not a dataclass): made once per read, and a dataclass's generated
    `__init__` stays interpreted Python in the compiled build.
    """

    __slots__ = (
        "engine", "store", "partition", "path", "order", "request_id", "on_result", "asked", "lead", "hedge",
        "refused", "waiting", "live", "min_offset", "tail", "stalled", "due",
    )  # fmt: skip

    def __init__(
        self,
        engine: ReadEngine,
        store: str,
        partition: int,
        path: str,
        order: tuple[Endpoint, ...],
        request_id: str,
        on_result: OnResult,
    ) -> None:
        self.engine, self.request_id, self.on_result = engine, request_id, on_result
        # Where it goes: the partition, the path asked of its nodes, its replicas in the order to ask them.
        self.store, self.partition, self.path, self.order = store, partition, path, order
        self.asked = 1
        self.lead: NodeRequest | None = None
        self.hedge: NodeRequest | None = None
        # The last 503 reply, passed on if no replica does better.
        self.refused: UpstreamResponse | None = None
        # `live`: a read of a live store (its replies' offsets are remembered), with its bound `min_offset`
        # (None: none). `tail`: the path ends in a caller's own text (a timeline read's query), checked by the
        # upstream when sent.
        self.waiting = self.live = self.tail = False
        # `stalled`: the timer, when it fires, is the stall delay's rather than the hedge's. `due`: the
        # deadline of the read's one current timer entry (earlier entries of it are dropped when they come up).
        self.stalled = False
        self.due = 0.0
        self.min_offset: int | None = None

    @property
    def over(self) -> bool:
        """Delivered or cancelled."""
        return self.on_result is _DELIVERED

    def deliver(self, result: UpstreamResponse | Exception) -> None:
        """The read's result to its caller (once); whatever request is still out is cancelled."""
        self.waiting = False
        if self.lead is not None or self.hedge is not None:
            self._stop()
        on_result = self.on_result
        # Let go of the caller's callback: whatever it holds (the client's exchange) is freed with it.
        self.on_result = _DELIVERED
        try:
            on_result(result)
        except Exception:  # never into a connection's parser: the router goes on
            log.exception("delivering a read's result failed", extra={"request_id": self.request_id})

    def cancel(self) -> None:
        """Abandon the read: every request out is cancelled and nothing is delivered."""
        self._stop()
        self.on_result = _DELIVERED

    def fire(self) -> None:
        """The hedge (or the stall delay) is due (called by `HedgeTimer` while `waiting`)."""
        self.waiting = False
        self.engine.hedge(self)

    def _stop(self) -> None:
        self.waiting = False
        engine = self.engine
        for request in (self.lead, self.hedge):
            if request is not None:
                engine.cancel(request)


class NodeRequest:
    """One request of a read to one node (the read's `lead` or its `hedge`). `pending` is what cancels it
    while it is out (FastUpstream's exchange, or the task of `Upstream.get`); None once it has ended."""

    __slots__ = ("read", "endpoint", "started", "pending")

    def __init__(self, read: Read, endpoint: Endpoint) -> None:
        self.read = read
        self.endpoint = endpoint
        self.started = 0.0
        self.pending: Any = None

    def replied(self, result: UpstreamResponse | Exception) -> None:
        """The request's reply or failure (from the connection's callback or the task's end)."""
        if self.pending is None:
            return  # cancelled meanwhile
        read = self.read
        try:
            read.engine.replied(self, result)
        except Exception as exc:  # never into the connection's parser: the read fails, the router goes on
            log.exception("handling a node's reply failed", extra={"request_id": read.request_id})
            if not read.over:
                read.deliver(exc)

    def fetched(self, task: asyncio.Task[UpstreamResponse]) -> None:
        self.read.engine.tasks.discard(task)
        if task.cancelled():
            if self.pending is None:
                return  # cancelled by the read
            self.replied(UpstreamUnavailable("the request was cancelled", node_fault=False))
            return
        failure = task.exception()
        if failure is not None:
            self.replied(failure)  # type: ignore[arg-type]
            return
        # `Upstream.get` of any kind: header names lower-cased here, as FastUpstream's already are, so that
        # `ReadEngine.replied` compares them as they come.
        reply = task.result()
        headers = [(name.lower(), value) for name, value in reply.headers]
        self.replied(UpstreamResponse(reply.status, headers, reply.body))
