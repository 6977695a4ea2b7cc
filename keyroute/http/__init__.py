"""keyroute's own HTTP/1.1 server (asyncio + httptools): the data plane answered directly, everything else
through an ASGI 3 bridge to the service's Starlette app. See `keyroute.http.server` (the server),
`keyroute.http.protocol` (a connection, and the behaviour contract), `keyroute.http.exchange` (what a data
plane sees), `keyroute.http.asgi`, `keyroute.http.lifespan` and `keyroute.http.tls` (HTTPS, mutual TLS between members,
certificate rotation)."""

from keyroute.http.asgi import ASGIApp
from keyroute.http.exchange import Answer, DataPlane, Exchange, Request, ServerLimits
from keyroute.http.server import HttpServer, run

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
