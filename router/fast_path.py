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
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from keyroute_core.api import ApiError, error_json, key_path_segment
from keyroute_core.logs import bind_request_id
from keyroute_core.metrics import KIND_KEY
from keyroute_core.request_guard import Admission
from router.proxy import Proxy

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_PREFIX = b"/stores/"
_KEYS = b"/keys/"
# HEAD is GET without the body, which the server leaves out.
_READ_METHODS = ("GET", "HEAD")
_REQUEST_ID = b"x-request-id"
_JSON = (b"content-type", b"application/json")
_INTERNAL = error_json("internal_error", "internal error")


Answer = tuple[int, list[tuple[bytes, bytes]], bytes]


async def answer_key_read(proxy: Proxy, scope: Scope, raw: bytes, max_key_bytes: int) -> Answer | None:
    """Status, headers (without content-length) and body of the read at raw path `raw`; None when the path
    is not a key path after all, such as `/stores/a/b/keys/c` (the application then answers it as usual).
    Never raises for a failed read: errors become their JSON answers."""
    query = raw.find(b"?")
    request_id = _bind_request_id(scope)
    store = ""
    try:
        # The raw path, because the decoded one has already turned a key's %2F into a separator.
        located = key_path_segment(raw if query < 0 else raw[:query], max_key_bytes)
        if located is None:
            return None
        store = located[0]
        answer = await proxy.get(store, located[1], request_id)
    except ApiError as exc:
        proxy.metrics.count(store, KIND_KEY, exc.status)
        headers = error_headers(exc)
        headers.append((_REQUEST_ID, request_id.encode("latin-1")))
        return exc.status, headers, error_json(exc.code, exc.message)
    except Exception:
        log.exception("a key read failed")
        proxy.metrics.count(store, KIND_KEY, 500)
        return 500, [_JSON, (_REQUEST_ID, request_id.encode("latin-1"))], _INTERNAL
    proxy.metrics.count(store, KIND_KEY, answer.status)
    headers = list(answer.headers)
    # The node echoes the id we sent (proof that it got there); one that does not gets it added here.
    for name, _ in headers:
        if name == _REQUEST_ID:
            break
    else:
        headers.append((_REQUEST_ID, request_id.encode("latin-1")))
    return answer.status, headers, answer.body


def _bind_request_id(scope: Scope) -> str:
    supplied = None
    for name, value in scope["headers"]:
        if name == _REQUEST_ID:
            supplied = value.decode("latin-1")
            break
    return bind_request_id(scope, supplied)


def is_key_read(method: str, raw: bytes) -> bool:
    """Whether a request may be a single-key read (the path is checked fully when it is answered)."""
    return method in _READ_METHODS and raw.startswith(_PREFIX) and raw.find(_KEYS, 8) > 0


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


def error_headers(exc: ApiError) -> list[tuple[bytes, bytes]]:
    headers = [_JSON]
    for name, value in exc.headers.items():
        headers.append((name.lower().encode("latin-1"), value.encode("latin-1")))
    return headers


# -- under uvicorn: before ASGI ---------------------------------------------------------------------------


class KeyReadProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol answering single-key reads itself.

    uvicorn parses the request and builds its scope as usual; where it would start the ASGI application,
    a key read instead runs the admission checks (the ones `RequestGuard` applies to every other request,
    on the same counters), asks the proxy and writes the whole answer in one call. That leaves out the
    ASGI exchange, the middleware chain and the per-header checks of uvicorn's response writer: a key
    read's answer is headers a node sent (parsed by httptools, so without line breaks) or our own.
    Keep-alive, HTTP/1.0, pipelining and flow control follow uvicorn's own cycle, whose state is kept
    up to date. A path that is not a key path after all goes to the application.

    Subclass with `router_app` (whose `state` has `proxy` and `admission` once its lifespan has started)
    and `max_key_bytes` set: see `key_read_protocol`.
    """

    router_app: Any = None
    max_key_bytes = 0

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        scope = cycle.scope
        raw = scope["raw_path"]
        # `app is self.app`: not uvicorn's own refusal (its concurrency limit, which keyroute leaves off).
        if app is self.app and is_key_read(scope["method"], raw):
            task = self.loop.create_task(self._serve(cycle, app, raw))
            task.add_done_callback(self.tasks.discard)
            self.tasks.add(task)
            return
        super()._start_asgi_task(cycle, app)

    async def _serve(self, cycle: RequestResponseCycle, app: Any, raw: bytes) -> None:
        state = self.router_app.state
        admission: Admission = state.admission
        scope: Scope = cycle.scope  # type: ignore[assignment]
        refusal = admission.admit(scope)
        if refusal is not None:
            request_id = _bind_request_id(scope)
            headers = error_headers(refusal)
            headers.append((_REQUEST_ID, request_id.encode("latin-1")))
            await _respond(cycle, refusal.status, headers, error_json(refusal.code, refusal.message))
            return
        try:
            answered = await answer_key_read(state.proxy, scope, raw, self.max_key_bytes)
        finally:
            admission.release()
        if answered is None:
            await cycle.run_asgi(app)
        else:
            await _respond(cycle, *answered)


async def _respond(cycle: RequestResponseCycle, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    """The whole response in one write, with the cycle's state as uvicorn's own writer leaves it."""
    if cycle.flow.write_paused and not cycle.disconnected:
        await cycle.flow.drain()
    if cycle.disconnected:
        return
    out = [STATUS_LINE.get(status) or b"HTTP/1.1 %d \r\n" % status]
    for name, value in cycle.default_headers:
        out += (name, b": ", value, b"\r\n")
    for name, value in headers:
        out += (name, b": ", value, b"\r\n")
    out.append(b"content-length: %d\r\n" % len(body))
    if not cycle.keep_alive:
        out.append(b"connection: close\r\n")
    out.append(b"\r\n")
    if cycle.scope["method"] != "HEAD":
        out.append(body)
    cycle.response_started = True
    cycle.response_complete = True
    transport = cycle.transport
    write_now = getattr(transport, "write_now", None)
    (write_now or transport.write)(b"".join(out))
    cycle.message_event.set()
    if not cycle.keep_alive:
        transport.close()
    cycle.on_response()


def key_read_protocol(app: Any, max_key_bytes: int, base: type[HttpToolsProtocol] = HttpToolsProtocol) -> type:
    """The uvicorn protocol class (`base` with `KeyReadProtocol`'s key reads) for the router app `app`."""
    bases = (KeyReadProtocol,) if base is HttpToolsProtocol else (KeyReadProtocol, base)
    return type("KeyReadProtocol", bases, {"router_app": app, "max_key_bytes": max_key_bytes})
