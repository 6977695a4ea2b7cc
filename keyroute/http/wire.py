"""Answers as bytes on the wire: HTTP/1.1 status lines, the server's own headers (date, x-request-id,
connection) and a whole answer joined once. Bytes only: no socket, no event loop."""

from __future__ import annotations

from email.utils import formatdate
from http import HTTPStatus
from time import time
from typing import Final

from keyroute.api import ApiError, error_json
from keyroute.runtime.logs import acceptable_request_id, new_request_id

# Final: the compiled build (setup.py) reads these from C statics (or inlines them), not from the module's dict.
STATUS_LINES: Final = {s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode("latin-1")) for s in HTTPStatus}
X_REQUEST_ID: Final = b"x-request-id"
CLOSE: Final = b"connection: close\r\n"
KEEP_ALIVE_10: Final = b"connection: keep-alive\r\n"
CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"
JSON = [(b"content-type", b"application/json")]
INTERNAL_ERROR: Final = error_json(ApiError.code, "internal error")  # 500 internal_error


def request_id_from(raw: bytes | None) -> tuple[str, bytes]:
    """(id, its bytes) of a request whose x-request-id header is `raw`: the client's when
    `acceptable_request_id` accepts it (one rule for the whole project), else a new one."""
    if raw is not None:
        text = raw.decode("latin-1")  # one character per byte: a non-ASCII byte stays non-ASCII, and is refused
        if acceptable_request_id(text):
            return text, raw
    text = new_request_id()
    return text, text.encode("ascii")


class _Date:
    """The `date` header line of the current second (an object, not two globals: the compiled build reads its
    attributes natively)."""

    __slots__ = ("second", "line")

    def __init__(self) -> None:
        self.second = -1
        self.line = b""


_DATE: Final = _Date()
_now: Final = time


def date_header() -> bytes:
    """The `date` header line, formatted once per second."""
    now = int(_now())
    cached = _DATE
    if now != cached.second:
        cached.line = b"date: " + formatdate(now, usegmt=True).encode("ascii") + b"\r\n"
        cached.second = now
    return cached.line


def status_line(status: int) -> bytes:
    line = STATUS_LINES.get(status)
    return line if line is not None else b"HTTP/1.1 %d \r\n" % status  # the reason phrase may be empty


def encode(
    status: int, headers: list[tuple[bytes, bytes]], body: bytes, request_id: bytes, connection: bytes, head: bool
) -> bytes:
    """A whole answer as one bytes object: one join, one format for the server's own headers."""
    parts = [STATUS_LINES.get(status) or status_line(status)]
    own_id = True
    for name, value in headers:
        if name == X_REQUEST_ID:
            own_id = False
        # Four appends (native list operations in the compiled build) cost less than `+=` of a new tuple.
        parts.append(name)
        parts.append(b": ")
        parts.append(value)
        parts.append(b"\r\n")
    if status >= 200 and status != 204 and status != 304:
        cached = _DATE
        date = cached.line if int(_now()) == cached.second else date_header()  # date_header's common case, inline
        if own_id:
            parts.append(
                b"content-length: %d\r\n%sx-request-id: %s\r\n%s\r\n" % (len(body), date, request_id, connection)
            )
        else:
            parts.append(b"content-length: %d\r\n%s%s\r\n" % (len(body), date, connection))
        if body and not head:
            parts.append(body)
    elif own_id:
        parts.append(b"%sx-request-id: %s\r\n%s\r\n" % (date_header(), request_id, connection))
    else:
        parts.append(b"%s%s\r\n" % (date_header(), connection))
    return b"".join(parts)
