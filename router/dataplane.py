"""The router's data plane: every request under /stores/, answered without the ASGI app (keyroute.http.server).

    GET|HEAD /stores/{store}/keys/{key}   admission, then `Proxy.read` (with `?min_offset=N` when given): the
                                          node's reply passed on
    GET|HEAD /stores/{store}/keys/{key}/history, .../windows
                                          the same, routed by the key, the query passed on to the node
    GET|HEAD /stores/{store}/range        admission, then `ranges.read_range` in a task: every partition asked,
                                          the answers merged
    POST     /stores/{store}/batch-get    admission, then `Proxy.batch_get` in a task: the entries as JSON
    anything else under /stores/          404 not_found, or 405 method_not_allowed with Allow

Every answer is counted in the router's metrics (refusals by admission only in admission's own counters).
Errors keep the one JSON shape every endpoint uses: an `ApiError` becomes its status and
`{"error", "message"}`; anything unexpected is logged with its traceback and answered 500 with no detail.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote_to_bytes

from keyroute.core.api import (
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
from keyroute.http.forwarding import encode_entry, parse_batch_request
from keyroute.http.upstream import UpstreamResponse
from keyroute.router.proxy import Proxy
from keyroute.router.ranges import read_range

if TYPE_CHECKING:
    from keyroute.http.exchange import Exchange

log = logging.getLogger(__name__)

# The data plane's routes and their methods (HEAD goes with GET), as the OpenAPI document lists them.
ROUTES = {
    "/stores/{store}/keys/{key}": ("GET",),
    "/stores/{store}/keys/{key}/history": ("GET",),
    "/stores/{store}/keys/{key}/windows": ("GET",),
    "/stores/{store}/batch-get": ("POST",),
    "/stores/{store}/range": ("GET",),
}

_PREFIX = b"/stores/"
# The routes matched on the percent-decoded path, as a router (Starlette's) would: for what is not a key
# path or a batch-get on the raw path, they tell a 404 from a 405.
_KEYS_ROUTE = re.compile(r"/stores/[^/]+/keys/.*", re.DOTALL)
_BATCH_ROUTE = re.compile(r"/stores/([^/]+)/batch-get")
_RANGE_ROUTE = re.compile(rb"/stores/([^/]+)/range")
_JSON = [(b"content-type", b"application/json")]
_TIMELINE_ENDINGS = (b"/history", b"/windows")


class MethodNotAllowed(ApiError):
    status = 405
    code = "method_not_allowed"

    def __init__(self, allowed: str) -> None:
        super().__init__("Method Not Allowed", {"Allow": allowed})


class RouterDataPlane:
    """Answers the exchanges `keyroute.http.server.HttpServer` hands it (see `accepts`), with the proxy
    and the admission checks the router app's lifespan and `create_app` put on the app's state: the same
    counters as the app's own `RequestGuard`."""

    def __init__(self, proxy: Proxy, admission: Admission, max_key_bytes: int = 0) -> None:
        self.proxy = proxy
        self.admission = admission
        self.max_key_bytes = max_key_bytes
        self._tasks: set[asyncio.Task[None]] = set()  # batch-gets in progress (the loop keeps weak refs)
        self._delivered = self._deliver  # bound once: a read then costs one partial, no bound method

    @classmethod
    def factory(cls, max_key_bytes: int) -> Callable[[Any], RouterDataPlane]:
        """What `HttpServer(data_plane=...)` calls with the router app's state once its lifespan started."""
        return lambda state: cls(state.proxy, state.admission, max_key_bytes)

    def accepts(self, method: str, path: bytes) -> bool:
        return path.startswith(_PREFIX)

    def handle(self, exchange: Exchange) -> None:
        request = exchange.request
        path = request.path
        admission = self.admission
        # Under /stores/: neither a probe nor a protected path, however it is percent-decoded.
        refusal = admission.admit_head(path.decode("latin-1"), request.target_bytes, request.headers)
        if refusal is not None:
            _answer_error(exchange, refusal)
            return
        method = request.method
        if method == "GET" or method == "HEAD":
            try:
                # The raw path, because decoding it would turn a key's %2F into a separator.
                located = key_path_segment(path, self.max_key_bytes)
            except ApiError as exc:
                admission.release()
                self._answer_read(exchange, "", exc)
                return
            if located is None and path.endswith(_TIMELINE_ENDINGS):
                self._read_timeline(exchange, path)
                return
            if located is not None:
                store, key = located
                try:
                    on_result = functools.partial(self._delivered, exchange, store)
                    # Only a request with a query string pays for looking at it.
                    if request.query and (min_offset := min_offset_query(request.query)) is not None:
                        self.proxy.read(store, key, request.request_id, on_result, min_offset)
                    else:
                        self.proxy.read(store, key, request.request_id, on_result)
                except Exception as exc:
                    admission.release()
                    self._answer_read(exchange, store, exc)
                return
            if path.endswith(b"/range"):
                ranged = _RANGE_ROUTE.fullmatch(path)
                if ranged is not None:
                    self._spawn(self._range(exchange, _decoded(ranged.group(1))))
                    return
        elif method == "POST":
            batch = _BATCH_ROUTE.fullmatch(_decoded(path))
            if batch is not None:
                self._spawn(self._batch_get(exchange, batch.group(1)))
                return
        admission.release()
        _answer_error(exchange, _no_route(method, path))

    # -- one key ----------------------------------------------------------------------------------------

    def _deliver(self, exchange: Exchange, store: str, result: UpstreamResponse | Exception) -> None:
        """The read's result (from `Proxy.read`), answered."""
        self.admission.release()
        try:
            if result.__class__ is UpstreamResponse:  # the common case, answered here
                self.proxy.metrics.count(store, KIND_KEY, result.status)  # type: ignore[union-attr]
                exchange.answer(result.status, result.headers, result.body)  # type: ignore[union-attr]
            else:
                self._answer_read(exchange, store, result)
        except Exception:
            # Never a hung connection: the client gets a 500, the traceback goes to the log.
            log.exception("answering a key read failed", extra={"request_id": exchange.request.request_id})
            _answer_error(exchange, ApiError("internal error"))

    # -- a key's timeline -------------------------------------------------------------------------------

    def _read_timeline(self, exchange: Exchange, path: bytes) -> None:
        """A history or windows read: routed by its key like a key read, its query passed on as it came (the
        node checks it); anything else ending so is not a route."""
        request = exchange.request
        try:
            located = timeline_path_segment(path, self.max_key_bytes)
        except ApiError as exc:
            self.admission.release()
            self._answer_read(exchange, "", exc, KIND_TIMELINE)
            return
        if located is None:
            self.admission.release()
            _answer_error(exchange, _no_route(request.method, path))
            return
        store, key, read = located
        tail = "/" + read + ("?" + request.query.decode("latin-1") if request.query else "")
        try:
            on_result = functools.partial(self._deliver_timeline, exchange, store)
            self.proxy.read(store, key, request.request_id, on_result, tail=tail)
        except Exception as exc:
            self.admission.release()
            self._answer_read(exchange, store, exc, KIND_TIMELINE)

    def _deliver_timeline(self, exchange: Exchange, store: str, result: UpstreamResponse | Exception) -> None:
        self.admission.release()
        try:
            self._answer_read(exchange, store, result, KIND_TIMELINE)
        except Exception:
            log.exception("answering a timeline read failed", extra={"request_id": exchange.request.request_id})
            _answer_error(exchange, ApiError("internal error"))

    def _answer_read(
        self, exchange: Exchange, store: str, result: UpstreamResponse | Exception, kind: str = KIND_KEY
    ) -> None:
        """What the client gets for a read's result, counted: the node's reply (the server adds the read's
        id unless the node echoed it), or the JSON error of an ApiError; anything unexpected is logged with
        its traceback and answered 500 without detail."""
        metrics = self.proxy.metrics
        if isinstance(result, UpstreamResponse):
            metrics.count(store, kind, result.status)
            exchange.answer(result.status, result.headers, result.body)  # type: ignore[arg-type]
            return
        error = result if isinstance(result, ApiError) else ApiError("internal error")  # the base class is the 500
        if error is not result:
            log.error("a %s read failed", kind, exc_info=result, extra={"request_id": exchange.request.request_id})
        metrics.count(store, kind, error.status)
        _answer_error(exchange, error)

    # -- key ranges -------------------------------------------------------------------------------------

    async def _range(self, exchange: Exchange, store: str) -> None:
        request = exchange.request
        bind_request_id({}, request.request_id)
        metrics = self.proxy.metrics
        try:
            body = await read_range(self.proxy, store, request.query, request.request_id)
        except ApiError as exc:
            self.admission.release()
            metrics.count(store, KIND_RANGE, exc.status)
            _answer_error(exchange, exc)
            return
        except Exception:
            self.admission.release()
            log.exception("a range read failed")
            metrics.count(store, KIND_RANGE, 500)
            _answer_error(exchange, ApiError("internal error"))
            return
        except BaseException:  # cancelled (the server is stopping): nothing to answer
            self.admission.release()
            raise
        self.admission.release()
        metrics.count(store, KIND_RANGE, 200)
        exchange.answer(200, list(_JSON), body)

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- batches ----------------------------------------------------------------------------------------

    async def _batch_get(self, exchange: Exchange, store: str) -> None:
        request = exchange.request
        bind_request_id({}, request.request_id)  # this task's log lines carry it
        proxy = self.proxy
        try:
            parsed = parse_batch_request(request.body, 0)  # the proxy checks (and counts) the number of keys
            results = await proxy.batch_get(store, parsed.keys, request.request_id, parsed.bounds)
        except ApiError as exc:
            self.admission.release()
            proxy.metrics.count(store, KIND_BATCH, exc.status)  # the whole batch was refused
            _answer_error(exchange, exc)
            return
        except Exception:
            self.admission.release()
            log.exception("a batch-get failed")
            _answer_error(exchange, ApiError("internal error"))
            return
        except BaseException:  # cancelled (the server is stopping): nothing to answer
            self.admission.release()
            raise
        self.admission.release()
        proxy.metrics.count_results(store, KIND_BATCH, results)
        exchange.answer(200, list(_JSON), encode_entry({"results": results}))


def _answer_error(exchange: Exchange, error: ApiError) -> None:
    exchange.answer(error.status, error_headers(error), error_json(error.code, error.message))


def _no_route(method: str, path: bytes) -> ApiError:
    """Why a request under /stores/ that is neither a key read nor a batch-get is not served."""
    decoded = _decoded(path)
    if _KEYS_ROUTE.fullmatch(decoded):
        if method == "GET" or method == "HEAD":
            return NotFound("not a key path: a key containing '/' must be percent-encoded as %2F")
        return MethodNotAllowed("GET, HEAD")
    if _BATCH_ROUTE.fullmatch(decoded):
        return MethodNotAllowed("POST")
    return NotFound("Not Found")


def _decoded(path: bytes) -> str:
    """The raw path percent-decoded, as the server's ASGI bridge decodes it (UTF-8, else Latin-1)."""
    raw = unquote_to_bytes(path) if b"%" in path else path
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")
