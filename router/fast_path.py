"""The single-key read served as a bare ASGI exchange, in front of the router's Starlette application.

`GET /stores/{store}/keys/{key}` is nearly every request a router sees. Starlette's exception handling,
route matching and Request/Response objects cost a large share of a proxied read's CPU, so this path reads
the raw path and the one header it needs straight from the ASGI scope, asks the proxy, and sends the
node's answer on with two ASGI messages. Everything else (batch-get, admin, health, a method other than
GET or HEAD, a path that is not a key path) goes on to the full application.

Errors keep the one JSON shape every endpoint uses: an `ApiError` becomes its status and
`{"error", "message"}`; anything unexpected is logged with its traceback and answered 500 with no detail.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from keyroute_core.api import ApiError, error_json, key_path_segment
from keyroute_core.logs import bind_request_id
from keyroute_core.metrics import KIND_KEY
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


class KeyReadFastPath:
    """ASGI middleware: single-key reads answered here, every other request passed on to `app`.

    It sits behind the request guard (concurrency, header size) and in front of Starlette's exception
    handling and routing; the proxy is the one the application's lifespan put on `app.state`.
    """

    def __init__(self, app: ASGIApp, max_key_bytes: int = 0) -> None:
        self.app = app
        self.max_key_bytes = max_key_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw: bytes = scope.get("raw_path") or b""
        if (
            scope["type"] == "http"
            and scope["method"] in _READ_METHODS
            and raw.startswith(_PREFIX)
            and raw.find(_KEYS, 8) > 0
            and await self.serve(scope["app"].state.proxy, scope, raw, send)
        ):
            return
        await self.app(scope, receive, send)

    async def serve(self, proxy: Proxy, scope: Scope, raw: bytes, send: Send) -> bool:
        """Answer the read; False (nothing sent) when the path is not a key path after all, such as
        `/stores/a/b/keys/c`: the application then answers it as usual."""
        query = raw.find(b"?")
        supplied = None
        for name, value in scope["headers"]:
            if name == _REQUEST_ID:
                supplied = value.decode("latin-1")
                break
        request_id = bind_request_id(scope, supplied)
        store = ""
        try:
            # The raw path, because the decoded one has already turned a key's %2F into a separator.
            located = key_path_segment(raw if query < 0 else raw[:query], self.max_key_bytes)
            if located is None:
                return False
            store = located[0]
            answer = await proxy.get(store, located[1], request_id)
        except ApiError as exc:
            proxy.metrics.count(store, KIND_KEY, exc.status)
            headers = _error_headers(exc)
            headers.append((_REQUEST_ID, request_id.encode("latin-1")))
            await _send(send, exc.status, headers, error_json(exc.code, exc.message))
            return True
        except Exception:
            log.exception("a key read failed")
            proxy.metrics.count(store, KIND_KEY, 500)
            await _send(send, 500, [_JSON, (_REQUEST_ID, request_id.encode("latin-1"))], _INTERNAL)
            return True
        proxy.metrics.count(store, KIND_KEY, answer.status)
        headers = list(answer.headers)
        # The node echoes the id we sent (proof that it got there); one that does not gets it added here.
        for name, _ in headers:
            if name == _REQUEST_ID:
                break
        else:
            headers.append((_REQUEST_ID, request_id.encode("latin-1")))
        await _send(send, answer.status, headers, answer.body)
        return True


def _error_headers(exc: ApiError) -> list[tuple[bytes, bytes]]:
    headers = [_JSON]
    for name, value in exc.headers.items():
        headers.append((name.lower().encode("latin-1"), value.encode("latin-1")))
    return headers


async def _send(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    headers.append((b"content-length", str(len(body)).encode("ascii")))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
