"""uvicorn's httptools protocol with a bound on the request head, answered 431 with the API's JSON error.

uvicorn bounds an incomplete request only with h11 (`h11_max_incomplete_event_size`); with httptools it
buffers a request line and header fields of any size before the application sees them. This subclass
counts the bytes of every read that arrives while a head is incomplete and, past the limit, answers 431 and
closes. A pipelined head starting in the read that ended the previous message is counted from the next
read on, so the bound is the limit plus one read from the socket (at most 256 KiB).
"""

from __future__ import annotations

import asyncio
from typing import Any

from keyroute.core.api import error_json
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def _response_431(max_head_bytes: int) -> bytes:
    body = error_json(
        "headers_too_large", f"the request line and headers exceed {max_head_bytes} bytes; nothing was read"
    )
    return (
        b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
        b"content-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode("ascii") + b"\r\n"
        b"connection: close\r\n\r\n" + body
    )


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """Set `max_head_bytes` on a subclass (see `bounded_httptools`)."""

    max_head_bytes = 0
    refusal = b""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0
        self._refused = False

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > self.max_head_bytes and not self._refused:
            self._refused = True
            transport: asyncio.Transport = self.transport
            if not transport.is_closing():
                transport.write(self.refusal)
                transport.close()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        # What follows on this connection is the next head; counted from the next read on (a pipelined
        # head that starts in this read goes uncounted for this one read).
        self._in_head = True
        super().on_message_complete()


def bounded_httptools(
    max_head_bytes: int, base: type[HttpToolsProtocol] = HttpToolsProtocol
) -> type[HttpToolsProtocol]:
    """The protocol class to pass as uvicorn's `http`: `base` (another HttpToolsProtocol subclass, whose
    changes are kept) with request heads bounded; `base` itself when `max_head_bytes` is 0."""
    if not max_head_bytes:
        return base
    bases = (BoundedHttpToolsProtocol,) if base is HttpToolsProtocol else (BoundedHttpToolsProtocol, base)
    return type(
        "BoundedHttpToolsProtocol",
        bases,
        {"max_head_bytes": max_head_bytes, "refusal": _response_431(max_head_bytes)},
    )
