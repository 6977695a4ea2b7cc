"""The node's data plane: every request under /stores/, handed over by `keyroute.http.server` without ASGI.

    GET|HEAD /stores/{store}/keys/{key}   `reads.read_key`: answered at once when held here, else passed on
                                          once (`reads.forward_read`) in a task; `?min_offset=N` a live
                                          partition has not applied yet waits for it in a task
    POST     /stores/{store}/batch-get    `reads.read_batch`, the keys held elsewhere sent on (and the keys
                                          of partitions behind their bound waited for) in a task
    anything else under /stores/          404 not_found, or 405 method_not_allowed with Allow

Every request passes the admission checks first (the ones the admin app's `RequestGuard` applies, on the
same counters), holds its place until it is answered, and is answered with the API's JSON errors.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any
from urllib.parse import unquote_to_bytes

from keyroute.core.api import (
    HEADER_AUTH,
    HEADER_HOPS,
    ApiError,
    NotFound,
    error_headers,
    error_json,
    key_path_segment,
    min_offset_query,
    timeline_path_segment,
)
from keyroute.core.logs import bind_request_id
from keyroute.core.metrics import KIND_BATCH, KIND_KEY, KIND_RANGE, KIND_TIMELINE
from keyroute.http.admission import Admission
from keyroute.http.exchange import Answer, Exchange, Request
from keyroute.http.forwarding import parse_batch_request
from keyroute.state_node.app import Node
from keyroute.state_node.ranges import read_partition_range
from keyroute.state_node.reads import (
    Batch,
    Behind,
    Forward,
    forward_read,
    is_forwarded,
    read_batch,
    read_key,
    read_timeline,
)

log = logging.getLogger(__name__)

_PREFIX = b"/stores/"
# What the admission checks are given as the request's path: every data-plane path starts with it, and it is
# neither a probe's path nor a protected one, as no percent-decoding of such a path can be.
_ADMITTED_PATH = "/stores/"
_HOPS = HEADER_HOPS.encode("ascii")
_AUTH = HEADER_AUTH.encode("ascii")
_TIMELINE_ENDINGS = (b"/history", b"/windows")
_NOT_A_KEY_PATH = "expected /stores/{store}/keys/{key} with the key as one path segment"


class MethodNotAllowed(ApiError):
    status = 405
    code = "method_not_allowed"

    def __init__(self, allow: str) -> None:
        super().__init__("Method Not Allowed", {"Allow": allow})


class NodeDataPlane:
    """`keyroute.http.server.DataPlane` for a node: `node` answers, `admission` admits."""

    def __init__(self, node: Node, admission: Admission) -> None:
        self.node = node
        self.admission = admission
        settings = node.settings
        self._max_key_bytes = settings.limits.max_key_bytes
        self._max_batch_keys = settings.max_batch_keys
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    def from_state(cls, state: Any) -> NodeDataPlane:
        """What `HttpServer(data_plane=...)` calls once the app's lifespan has started: the data plane of the
        node and admission checks on the node app's `state` (keyroute.state_node.app.create_app)."""
        return cls(state.node, state.admission)

    def accepts(self, method: str, path: bytes) -> bool:
        return path.startswith(_PREFIX)

    def handle(self, exchange: Exchange) -> None:
        request = exchange.request
        admission = self.admission
        refusal = admission.admit_head(_ADMITTED_PATH, request.target_bytes, request.headers)
        if refusal is not None:
            exchange.answer(*self.error_answer(refusal))
            return
        later = False
        try:
            later = self._answer(exchange, request)
        except Exception:
            # Never a hung connection and never a traceback for the client: logged, answered 500.
            log.exception(
                "answering %s %r failed", request.method, request.path[:200], extra={"request_id": request.request_id}
            )
            exchange.answer(*self.error_answer(ApiError("internal error")))
        finally:
            if not later:
                admission.release()

    def error_answer(self, exc: ApiError) -> Answer:
        """An ApiError as the API's JSON error, with X-Keyroute-Node and the error's own headers."""
        return exc.status, error_headers(exc, (self.node.node_header,)), error_json(exc.code, exc.message)

    # -- dispatch ---------------------------------------------------------------------------------------

    def _answer(self, exchange: Exchange, request: Request) -> bool:
        """Answer the request now (False), or start the task that answers it and releases its admission
        (True)."""
        method = request.method
        if method == "GET" or method == "HEAD":
            if request.path.endswith(b"/range"):
                parts = request.path.split(b"/")
                if len(parts) == 6 and parts[2] and parts[3] == b"partitions" and parts[5] == b"range":
                    return self._read_range(exchange, request, _segment(parts[2]), _segment(parts[4]))
            if request.path.endswith(_TIMELINE_ENDINGS):
                timeline = self._timeline_path(exchange, request)
                if timeline is not None:
                    return self._read_timeline(exchange, request, *timeline) if timeline else False
            return self._read_key(exchange, request)
        if method == "POST":
            parts = request.path.split(b"/")
            if len(parts) == 4 and parts[2] and parts[3] == b"batch-get":
                return self._read_batch(exchange, request, _segment(parts[2]))
        exchange.answer(*self.error_answer(_no_route(method, request.path)))
        return False

    def _forwarded(self, request: Request) -> bool:
        hops = request.header(_HOPS)
        if hops is None:
            return False
        node = self.node
        forwarded = is_forwarded(node.members, hops, request.header(_AUTH))
        if forwarded:
            node.metrics.forwarded_in += 1
        return forwarded

    # -- one key ----------------------------------------------------------------------------------------

    def _read_key(self, exchange: Exchange, request: Request) -> bool:
        forwarded = self._forwarded(request)
        metrics = self.node.metrics
        try:
            parsed = key_path_segment(request.path, self._max_key_bytes)
        except ApiError as exc:  # a key over the limit, or not UTF-8
            metrics.count(_segment(request.path.split(b"/", 3)[2]), KIND_KEY, exc.status)
            exchange.answer(*self.error_answer(exc))
            return False
        if parsed is None:
            exchange.answer(*self.error_answer(_no_route(request.method, request.path)))
            return False
        store, key_text = parsed
        try:
            # Only a request with a query string pays for looking at it.
            min_offset = min_offset_query(request.query) if request.query else None
            answer = read_key(self.node, store, key_text, forwarded, min_offset)
        except ApiError as exc:
            metrics.count(store, KIND_KEY, exc.status)
            exchange.answer(*self.error_answer(exc))
            return False
        if type(answer) is tuple:
            metrics.count(store, KIND_KEY, answer[0])
            exchange.answer(*answer)
            return False
        if type(answer) is Behind:
            again = functools.partial(read_key, self.node, store, key_text, forwarded, answer.min_offset, waited=True)
            self._spawn(self._catch_up(exchange, store, KIND_KEY, answer, again))
            return True
        assert isinstance(answer, Forward)
        self._spawn(self._forward(exchange, store, answer))
        return True

    # -- a key's timeline -------------------------------------------------------------------------------

    def _timeline_path(self, exchange: Exchange, request: Request) -> tuple[str, str, str] | tuple[()] | None:
        """(store, key, read) of a history or windows read; () when its key was refused (answered here);
        None when the path is not one (then it is a key read: a key may end in /history if encoded)."""
        try:
            located = timeline_path_segment(request.path, self._max_key_bytes)
        except ApiError as exc:
            self.node.metrics.count(_segment(request.path.split(b"/", 3)[2]), KIND_TIMELINE, exc.status)
            exchange.answer(*self.error_answer(exc))
            return ()
        return located

    def _read_timeline(self, exchange: Exchange, request: Request, store: str, key_text: str, read: str) -> bool:
        forwarded = self._forwarded(request)
        metrics = self.node.metrics
        try:
            answer = read_timeline(self.node, store, key_text, read, request.query, forwarded)
        except ApiError as exc:
            metrics.count(store, KIND_TIMELINE, exc.status)
            exchange.answer(*self.error_answer(exc))
            return False
        if type(answer) is tuple:
            metrics.count(store, KIND_TIMELINE, answer[0])
            exchange.answer(*answer)
            return False
        if type(answer) is Behind:
            query = request.query
            again = functools.partial(read_timeline, self.node, store, key_text, read, query, forwarded, waited=True)
            self._spawn(self._catch_up(exchange, store, KIND_TIMELINE, answer, again))
            return True
        assert isinstance(answer, Forward)
        self._spawn(self._forward(exchange, store, answer, KIND_TIMELINE))
        return True

    def _read_range(self, exchange: Exchange, request: Request, store: str, partition: str) -> bool:
        metrics = self.node.metrics
        try:
            answer = read_partition_range(self.node, store, partition, request.query)
        except ApiError as exc:
            metrics.count(store, KIND_RANGE, exc.status)
            exchange.answer(*self.error_answer(exc))
            return False
        metrics.count(store, KIND_RANGE, answer[0])
        exchange.answer(*answer)
        return False

    async def _catch_up(
        self, exchange: Exchange, store: str, kind: str, behind: Behind, read_again: Callable[[], Answer | Forward]
    ) -> None:
        """A bounded read (of a key, or of a key's timeline) of a live partition held here, once it has applied
        the bound or the wait is over: `read_again` reads it then (waited)."""
        request = exchange.request
        bind_request_id({}, request.request_id)
        node = self.node
        try:
            await behind.live.wait_reached(behind.min_offset, node.settings.min_offset_wait_ms / 1000)
            # Read again: the partition may have moved or changed version meanwhile.
            answer = read_again()
            if isinstance(answer, Forward):
                answer = await forward_read(node, _target(request), answer, request.request_id)
        except ApiError as exc:
            answer = self.error_answer(exc)
        except Exception:
            log.exception("answering a bounded read of %r failed", request.path[:200])
            answer = self.error_answer(ApiError("internal error"))
        finally:
            self.admission.release()
        assert type(answer) is tuple
        node.metrics.count(store, kind, answer[0])
        exchange.answer(*answer)

    async def _forward(self, exchange: Exchange, store: str, forward: Forward, kind: str = KIND_KEY) -> None:
        request = exchange.request
        bind_request_id({}, request.request_id)  # this task's log lines carry it
        try:
            answer = await forward_read(self.node, _target(request), forward, request.request_id)
        except ApiError as exc:
            answer = self.error_answer(exc)
        except Exception:
            log.exception("forwarding a read of %r failed", request.path[:200])
            answer = self.error_answer(ApiError("internal error"))
        finally:
            self.admission.release()
        self.node.metrics.count(store, kind, answer[0])
        exchange.answer(*answer)

    # -- a batch ----------------------------------------------------------------------------------------

    def _read_batch(self, exchange: Exchange, request: Request, store: str) -> bool:
        forwarded = self._forwarded(request)
        node = self.node
        try:
            # The body's size is bounded by the server (keyroute.state_node.service.server_limits).
            parsed = parse_batch_request(request.body, self._max_batch_keys)
            batch = read_batch(node, store, parsed.keys, forwarded, parsed.bounds)
        except ApiError as exc:
            node.metrics.count(store, KIND_BATCH, exc.status)  # the whole batch was refused
            exchange.answer(*self.error_answer(exc))
            return False
        if batch.complete:
            exchange.answer(*batch.answer())
            return False
        self._spawn(self._forward_batch(exchange, batch))
        return True

    async def _forward_batch(self, exchange: Exchange, batch: Batch) -> None:
        request_id = exchange.request.request_id
        bind_request_id({}, request_id)
        try:
            await batch.finish(request_id)
            answer = batch.answer()
        except Exception:
            log.exception("forwarding a batch-get failed")
            answer = self.error_answer(ApiError("internal error"))
        finally:
            self.admission.release()
        exchange.answer(*answer)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _no_route(method: str, path: bytes) -> ApiError:
    """The error for a request under /stores/ that is neither a key read nor a batch-get: 405 with the
    methods its path takes, or 404."""
    parts = path.split(b"/", 4)  # b"", b"stores", the store, b"keys" or b"batch-get", the key
    if len(parts) >= 4 and parts[2]:
        if parts[3] == b"keys" and len(parts) == 5:
            if method == "GET" or method == "HEAD":
                return NotFound(_NOT_A_KEY_PATH)  # a key with '/' in it, not percent-encoded
            return MethodNotAllowed("GET, HEAD")
        if parts[3] == b"batch-get" and len(parts) == 4:
            return MethodNotAllowed("POST")
    return NotFound("Not Found")


def _target(request: Request) -> bytes:
    """The raw path with its query (a `min_offset` goes on with a forwarded read)."""
    return request.path + b"?" + request.query if request.query else request.path


def _segment(raw: bytes) -> str:
    """A raw path segment percent-decoded as the ASGI path is (UTF-8, undecodable bytes replaced)."""
    return (unquote_to_bytes(raw) if b"%" in raw else raw).decode("utf-8", "replace")
