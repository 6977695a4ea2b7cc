"""The single-key read answered without the router's Starlette application.

`GET /stores/{store}/keys/{key}` is nearly every request a router sees. Starlette's exception handling,
route matching and Request/Response objects cost a large share of a proxied read's CPU, and so do the
ASGI exchange and uvicorn's response writer. Under uvicorn, `KeyReadProtocol` answers key reads where
uvicorn would start the application; under any other server, `KeyReadFastPath` does it as a bare ASGI
middleware. Both read the raw path and the one header they need straight from the scope, ask the proxy,
and send the node's answer on. Everything else (batch-get, admin, health, a method other than GET or
HEAD, a path that is not a key path) goes to the full application.

Errors keep the one JSON shape every endpoint uses: an `ApiError` becomes its status and
`{"error", "message"}`; anything unexpected is logged with its traceback and answered 500 with no detail.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from keyroute.core.api import ApiError, error_headers, error_json, is_key_read, key_path_segment
from keyroute.core.http_server import PENDING, Answer, DirectAnswerProtocol, ExpressCycle
from keyroute.core.metrics import KIND_KEY
from keyroute.core.request_guard import Admission, request_id_in, request_id_of
from keyroute.router.proxy import Proxy
from keyroute.router.upstream import UpstreamResponse
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_REQUEST_ID = b"x-request-id"


async def answer_key_read(proxy: Proxy, scope: Scope, raw: bytes, max_key_bytes: int) -> Answer | None:
    """Status, headers (without content-length) and body of the read at raw path `raw`; None when the path
    is not a key path after all, such as `/stores/a/b/keys/c` (the application then answers it as usual).
    Never raises for a failed read: errors become their JSON answers."""
    query = raw.find(b"?")
    request_id = request_id_of(scope)
    store = ""
    try:
        # The raw path, because the decoded one has already turned a key's %2F into a separator.
        located = key_path_segment(raw if query < 0 else raw[:query], max_key_bytes)
        if located is None:
            return None
        store = located[0]
        result: UpstreamResponse | Exception = await proxy.get(store, located[1], request_id)
    except Exception as exc:
        result = exc
    return answered_read(proxy, store, request_id, result)


def answered_read(proxy: Proxy, store: str, request_id: str, result: UpstreamResponse | Exception) -> Answer:
    """What the client gets for a read's outcome, counted: the node's answer with the read's id, or the JSON
    error of an ApiError; anything unexpected is logged with its traceback and answered 500 without detail."""
    if isinstance(result, UpstreamResponse):
        proxy.metrics.count(store, KIND_KEY, result.status)
        return result.status, with_request_id(result.headers, request_id), result.body
    error = result if isinstance(result, ApiError) else ApiError("internal error")  # the base class is the 500
    if error is not result:
        log.error("a key read failed", exc_info=result, extra={"request_id": request_id})
    proxy.metrics.count(store, KIND_KEY, error.status)
    headers = error_headers(error, ((_REQUEST_ID, request_id.encode("latin-1")),))
    return error.status, headers, error_json(error.code, error.message)


class KeyReadFastPath:
    """ASGI middleware: single-key reads answered here, every other request passed on to `app`.

    It sits behind the request guard (concurrency, header size) and in front of Starlette's exception
    handling and routing; the proxy is the one the application's lifespan put on `app.state`. Under
    uvicorn, `KeyReadProtocol` answers these reads before ASGI; this path serves them under any other
    server (and in tests that drive the application in process).
    """

    def __init__(self, app: ASGIApp, max_key_bytes: int = 0) -> None:
        self.app = app
        self.max_key_bytes = max_key_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw: bytes = scope.get("raw_path") or b""
        if scope["type"] == "http" and is_key_read(scope["method"], raw):
            answered = await answer_key_read(scope["app"].state.proxy, scope, raw, self.max_key_bytes)
            if answered is not None:
                status, headers, body = answered
                headers.append((b"content-length", str(len(body)).encode("ascii")))
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


# -- under uvicorn: before ASGI ---------------------------------------------------------------------------


class KeyReadProtocol(DirectAnswerProtocol):
    """uvicorn's httptools protocol answering single-key reads itself (keyroute_core.http_server): the
    router application's `state` has `proxy` and `admission` once its lifespan has started.

    The express way (`express`) asks `Proxy.read`, which mostly needs no coroutine at all; a pipelined
    read waiting behind another one goes through `answer` and `Proxy.get` in a task of its own.
    """

    max_key_bytes = 0

    async def answer(self, scope: Scope, raw_path: bytes) -> Answer | None:
        return await answer_key_read(self.owner_app.state.proxy, scope, raw_path, self.max_key_bytes)

    def express(
        self, cycle: ExpressCycle, raw_path: bytes, target_bytes: int, headers: list[tuple[bytes, bytes]]
    ) -> Any:
        try:
            located: tuple[str, str] | ApiError | None = key_path_segment(raw_path, self.max_key_bytes)
        except ApiError as exc:
            located = exc
        if located is None:
            return None  # not a key path after all: the application answers
        state = self.owner_app.state
        admission: Admission = state.admission
        proxy: Proxy = state.proxy
        request_id = request_id_in(headers)
        # A key path starts with /stores/: percent-decoding cannot make it a probe or an admin path.
        refusal = admission.admit_head(raw_path.decode("latin-1"), target_bytes, headers)
        if refusal is not None:
            return self.express_error(refusal, request_id)
        if isinstance(located, ApiError):
            admission.release()
            return answered_read(proxy, "", request_id, located)
        store, key = located

        def answered(result: UpstreamResponse | Exception) -> None:
            try:
                admission.release()
                self.finish_express(cycle, *answered_read(proxy, store, request_id, result))
            except Exception:
                # Never a hung connection: the client sees it close.
                log.exception("answering a key read failed", extra={"request_id": request_id})
                self.transport.close()

        try:
            proxy.read(store, key, request_id, answered)
        except Exception as exc:
            admission.release()
            return answered_read(proxy, store, request_id, exc)
        return PENDING


def with_request_id(headers: Sequence[tuple[bytes, bytes]], request_id: str) -> list[tuple[bytes, bytes]]:
    """A node's answer headers to pass on, with the read's id: the node echoes the id we sent (proof that it
    got there); one that does not gets it added here."""
    kept = list(headers)
    for name, _ in kept:
        if name == _REQUEST_ID:
            break
    else:
        kept.append((_REQUEST_ID, request_id.encode("latin-1")))
    return kept


def key_read_protocol(app: Any, max_key_bytes: int, base: type[HttpToolsProtocol] = HttpToolsProtocol) -> type:
    """The uvicorn protocol class (`base` with `KeyReadProtocol`'s key reads) for the router app `app`."""
    return KeyReadProtocol.for_app(app, base, max_key_bytes=max_key_bytes)
