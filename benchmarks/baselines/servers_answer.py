"""One fixed key-read answer served four ways, for benchmarks/servers.py to compare what SERVING costs.

`python benchmarks/baselines/servers_answer.py MODE PORT` serves `GET /stores/{store}/keys/{key}` on
127.0.0.1:PORT with the same answer every time: status 200, a 120-byte JSON body and the six headers a
node's key read carries (content-type and x-keyroute-partition/node/version/hops/generation), plus the
server's own content-length and date and an `x-request-id` made by `keyroute.runtime.logs.new_request_id()`
(keyroute's server adds one to every answer; the other servers get it from the app, so every server
writes the same answer). MODE:

- `keyroute`: keyroute.http.server.HttpServer, a DataPlane that answers synchronously in `handle`,
  served by `run()` (uvloop); other paths go to a raw ASGI app answering 404.
- `granian-rsgi`: granian's RSGI interface, `proto.response_bytes` from the handler.
- `granian-asgi`: granian's ASGI interface, the raw ASGI callable below (no framework).
- `uvicorn`: uvicorn with httptools and uvloop, the same raw ASGI callable; no access log, no lifespan,
  no `server` header (keyroute's server writes none).

granian runs with 1 worker and one single-threaded Rust runtime (GRANIAN_SETTINGS), the settings of its
docs that spend the least CPU per request on a small machine; HTTP/1 only, no websockets, no access log.
Nothing here is a project dependency: benchmarks/servers.py installs granian into the venv when missing.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from keyroute.runtime.logs import new_request_id

# A node's answer to a key read, trimmed to a fixed size.
BODY = (
    b'{"store":"s","key":"K000123","partition":3,"version":7,'
    b'"value":{"customer":123,"route":"R4","fare":194.5,"tier":"gold"}}'
)
assert 115 <= len(BODY) <= 125, len(BODY)
HEADERS: list[tuple[bytes, bytes]] = [
    (b"content-type", b"application/json"),
    (b"x-keyroute-partition", b"3"),
    (b"x-keyroute-node", b"node-1"),
    (b"x-keyroute-version", b"7"),
    (b"x-keyroute-hops", b"0"),
    (b"x-keyroute-generation", b"42"),
]
PREFIX = b"/stores/"
PREFIX_TEXT = PREFIX.decode()
NOT_FOUND = b'{"error":"not_found","message":"no route"}'

# granian: one worker process, one single-threaded Rust runtime, uvloop for the Python side.
GRANIAN_SETTINGS: dict[str, Any] = {
    "workers": 1,
    "runtime_threads": 1,
    "runtime_mode": "st",
    "loop": "uvloop",
    "http": "1",
    "websockets": False,
    "log_access": False,
}

_ASGI_HEADERS = [*HEADERS, (b"content-length", str(len(BODY)).encode())]
_ASGI_404 = [(b"content-type", b"application/json"), (b"content-length", str(len(NOT_FOUND)).encode())]
_RSGI_HEADERS = [(name.decode(), value.decode()) for name, value in HEADERS]


# -- (a) keyroute's server ------------------------------------------------------------------------------


class AnswerPlane:
    """The DataPlane: every key read answered at once, from the parsed request."""

    def accepts(self, method: str, path: bytes) -> bool:
        return path.startswith(PREFIX)

    def handle(self, exchange: Any) -> None:
        exchange.answer(200, HEADERS, BODY)


# -- (b2, c) one raw ASGI callable -------------------------------------------------------------------------


async def asgi_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":  # lifespan (granian's ASGI, keyroute's bridge): nothing to start or stop
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        return
    if scope["path"].startswith(PREFIX_TEXT):
        headers = [*_ASGI_HEADERS, (b"x-request-id", new_request_id().encode("ascii"))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": BODY})
    else:
        await send({"type": "http.response.start", "status": 404, "headers": _ASGI_404})
        await send({"type": "http.response.body", "body": NOT_FOUND})


# -- (b1) granian's RSGI ---------------------------------------------------------------------------------


async def rsgi_app(scope: Any, proto: Any) -> None:
    if scope.proto != "http":
        return
    if scope.path.startswith(PREFIX_TEXT):
        proto.response_bytes(200, [*_RSGI_HEADERS, ("x-request-id", new_request_id())], BODY)
    else:
        proto.response_bytes(404, [("content-type", "application/json")], NOT_FOUND)


# -- serving ---------------------------------------------------------------------------------------------


def serve_keyroute(port: int) -> int:
    from keyroute.http.server import HttpServer, run

    return run(HttpServer(asgi_app, data_plane=lambda state: AnswerPlane()), "127.0.0.1", port)


def serve_granian(interface: str, port: int) -> int:
    from granian import Granian
    from granian.constants import HTTPModes, Interfaces, Loops, RuntimeModes

    settings = dict(GRANIAN_SETTINGS)
    settings["runtime_mode"] = RuntimeModes(settings["runtime_mode"])
    settings["loop"] = Loops(settings["loop"])
    settings["http"] = HTTPModes(settings["http"])
    Granian(
        f"{Path(__file__).stem}:{interface}_app",
        address="127.0.0.1",
        port=port,
        interface=Interfaces(interface),
        log_level="warning",
        working_dir=Path(__file__).resolve().parent,
        **settings,
    ).serve()
    return 0


def serve_uvicorn(port: int) -> int:
    import uvicorn

    uvicorn.run(
        asgi_app,
        host="127.0.0.1",
        port=port,
        http="httptools",
        loop="uvloop",
        lifespan="off",
        access_log=False,
        server_header=False,
        log_level="warning",
    )
    return 0


MODES = {
    "keyroute": serve_keyroute,
    "granian-rsgi": lambda port: serve_granian("rsgi", port),
    "granian-asgi": lambda port: serve_granian("asgi", port),
    "uvicorn": serve_uvicorn,
}

if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in MODES:
        raise SystemExit(f"usage: {sys.argv[0]} {{{'|'.join(MODES)}}} PORT")
    raise SystemExit(MODES[sys.argv[1]](int(sys.argv[2])))
