"""keyroute's own HTTP/1.1 server (asyncio + httptools): the data plane answered directly, everything else
through an ASGI 3 bridge to the service's Starlette app. See `keyroute.http.server`."""

from keyroute.http.server import (
    Answer,
    ASGIApp,
    DataPlane,
    Exchange,
    HttpServer,
    Request,
    ServerLimits,
    run,
)

__all__ = [
    "ASGIApp",
    "Answer",
    "DataPlane",
    "Exchange",
    "HttpServer",
    "Request",
    "ServerLimits",
    "run",
]
