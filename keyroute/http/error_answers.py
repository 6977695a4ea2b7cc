"""How a router's or a node's app answers an error: one set of Starlette exception handlers for both apps
(the data plane answers its own errors alike: keyroute.http.dataplane).

    ApiError              its status, `{"error": code, "message"}` and its own headers
    HTTPException         Starlette's own 404 and 405 (a path or method no route has): `not_found`,
                          `method_not_allowed` (any other status: `http_error`), its headers (`Allow`)
    anything else         500 `{"error": "internal_error", "message": "internal error"}`: no detail goes to
                          the client; the server logs the traceback (keyroute.http.asgi), with the request

Every error answer carries the app's own headers (a node's X-Keyroute-Node) and X-Request-ID: the id bound
to the request by its handler, else the client's (when acceptable) or a new one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from keyroute.api import HEADER_REQUEST_ID, ApiError
from keyroute.runtime.logs import bind_request_id

__all__ = ["HTTP_ERROR_CODES", "INTERNAL_ERROR", "exception_handlers"]

# Starlette's own errors, by status, as the API's codes.
HTTP_ERROR_CODES = {404: "not_found", 405: "method_not_allowed"}
INTERNAL_ERROR = {"error": "internal_error", "message": "internal error"}

Handler = Callable[[Request, Exception], Awaitable[Response]]


def exception_handlers(headers: Mapping[str, str] | None = None) -> dict[Any, Handler]:
    """Starlette's `exception_handlers` for an app whose every error answer also carries `headers`."""
    own = dict(headers or {})

    def answer(request: Request, body: dict[str, Any], status: int, extra: Mapping[str, str] | None) -> Response:
        request_id = bind_request_id(request.scope, request.headers.get(HEADER_REQUEST_ID))
        return JSONResponse(body, status_code=status, headers={**own, **(extra or {}), HEADER_REQUEST_ID: request_id})

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return answer(request, exc.body(), exc.status, exc.headers)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        body = {"error": HTTP_ERROR_CODES.get(exc.status_code, "http_error"), "message": str(exc.detail)}
        return answer(request, body, exc.status_code, exc.headers)

    async def internal_error(request: Request, exc: Exception) -> Response:
        return answer(request, dict(INTERNAL_ERROR), 500, None)

    return {ApiError: api_error, HTTPException: http_error, Exception: internal_error}
