"""The blocking client's wire: HTTP/1.1 keep-alive connections on plain sockets, pooled per origin.

httpx spends ~0.5 ms of CPU on each request (benchmarks/RESULTS.md, "Reads from Python"); a read needs much
less: the request's bytes joined once and sent with one `sendall`; the common answer (a final status, a
Content-Length, the head in the first bytes received) read from its head directly, any other by httptools'
parser (keyroute.http's); headers looked up in the head when asked for; the connection kept for the next
read. This is the blocking sibling of the member wire (keyroute.http.fast_upstream, which `AsyncClient` uses).

A failure is raised as httpx's transport exception of its kind (`ConnectError`, `ConnectTimeout`,
`ReadTimeout`, `WriteTimeout`, `ReadError`, `WriteError`, `RemoteProtocolError`): the client's decisions
read "no answer" the same way whichever wire carried the request. `timeout` bounds each operation (connect,
send, each receive), as httpx's timeout does. A reused connection that the server had closed before any byte
of the answer (the keep-alive race) is replaced and the request sent once more: the client only reads, so
that is always safe. Safe to use from several threads: a connection carries one exchange at a time.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import struct
import sys
import zlib
from collections.abc import Mapping
from time import monotonic
from typing import Any
from urllib.parse import urlencode, urlsplit

import httptools
import httpx

from keyroute.client._models import Answer

# Shorter than the servers' keep-alive timeout (5 s, keyroute.http.exchange's ServerLimits): we let an idle
# connection go before the server does, so the keep-alive race is rare.
IDLE_EXPIRY_S = 4.0
# Not more: a receive buffer past glibc malloc's mmap threshold (128 KiB) costs a map and an unmap per read
# (~13 µs of CPU each time, measured), whatever arrived.
_RECV_SIZE = 64 * 1024
# Send and receive timeouts kept by the kernel (SO_RCVTIMEO, SO_SNDTIMEO as Linux takes them: a timeval of two
# longs); elsewhere Python's socket timeout.
_KERNEL_TIMEOUTS = sys.platform == "linux"
# Headers the wire writes itself (framing); a caller's would contradict it.
_FRAMING = frozenset({"host", "content-length", "transfer-encoding", "connection"})


class _Closed(Exception):
    """The server closed the connection (or reset it) before the answer was complete."""

    def __init__(self, received: bool, cause: BaseException | None = None) -> None:
        super().__init__("the server closed the connection")
        self.received = received
        self.cause = cause


class _Connection:
    """One socket to the origin. The common answer (HTTP/1.1, a final status, a Content-Length, the head in
    the first bytes received) is read by `exchange` itself; anything else by httptools' parser, which calls
    back into this object."""

    __slots__ = (
        "body",
        "complete",
        "framed",
        "head",
        "idle_since",
        "lines",
        "parser",
        "reusable",
        "sock",
        "status",
    )

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.parser: Any = None  # made for the first answer that needs it
        self.idle_since = 0.0
        self.reusable = True
        self.status = 0
        self.head = b""
        self.lines: list[bytes] = []
        self.body: list[bytes] = []
        self.complete = self.framed = False

    def exchange(self, request: bytes) -> None:
        """Send `request`; return once its whole answer is in `status`, `head` and `body`."""
        sock = self.sock
        try:
            sock.sendall(request)
        except (TimeoutError, BlockingIOError) as exc:  # BlockingIOError: the kernel's timeout (_KERNEL_TIMEOUTS)
            raise httpx.WriteTimeout(f"sending the request timed out: {exc}") from exc
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise _Closed(False, exc) from exc
        except OSError as exc:
            raise httpx.WriteError(str(exc) or type(exc).__name__) from exc
        data = self._recv(False)
        end = data.find(b"\r\n\r\n")
        if end > 0 and data.startswith(b"HTTP/1.1 ") and data[9] != 49:  # 49: "1", an informational status
            line_end = data.find(b"\r\n")
            head = data[line_end : end + 2]
            lowered = head.lower()
            at = lowered.find(b"\r\ncontent-length:")
            if at >= 0 and lowered.find(b"\r\ntransfer-encoding:") < 0:
                try:
                    length = int(head[at + 17 : head.index(b"\r\n", at + 17)])
                    status = int(data[9:12])
                except ValueError:
                    length = status = -1  # the parser says what is wrong
                if length >= 0 and 200 <= status <= 999:
                    if status == 204 or status == 304:
                        length = 0  # no body, whatever the length says
                    body = data[end + 4 :]
                    if len(body) < length:
                        chunks = [body]
                        size = len(body)
                        while size < length:
                            more = self._recv(True)
                            chunks.append(more)
                            size += len(more)
                        body = b"".join(chunks)
                    if len(body) != length:
                        self.reusable = False  # bytes beyond the answer: out of step, never reused
                        body = body[:length]
                    at = lowered.find(b"\r\nconnection:")
                    if at >= 0 and b"close" in lowered[at : lowered.find(b"\r\n", at + 2)]:
                        self.reusable = False
                    self.status, self.head, self.body = status, head, [body]
                    return
        self._parse(data)

    def _recv(self, received: bool) -> bytes:
        try:
            data = self.sock.recv(_RECV_SIZE)
        except (TimeoutError, BlockingIOError) as exc:
            raise httpx.ReadTimeout(f"no complete answer in time: {exc}") from exc
        except ConnectionResetError as exc:
            raise _Closed(received, exc) from exc
        except OSError as exc:
            raise httpx.ReadError(str(exc) or type(exc).__name__) from exc
        if not data:
            raise _Closed(received)
        return data

    def _parse(self, data: bytes) -> None:
        """The answer that begins with `data`, read by httptools' parser (chunked bodies, informational
        answers first, a body that ends with the connection, malformed answers)."""
        parser = self.parser
        if parser is None:
            parser = self.parser = httptools.HttpResponseParser(self)
        self.lines = []
        self.body = []
        self.complete = self.framed = False
        self.status = 0
        while True:
            try:
                parser.feed_data(data)
            except httptools.HttpParserUpgrade as exc:
                self.reusable = False
                raise httpx.RemoteProtocolError("the server switched protocols on a read") from exc
            except httptools.HttpParserError as exc:
                self.reusable = False
                raise httpx.RemoteProtocolError(f"malformed answer: {exc}") from exc
            if self.complete:
                return
            try:
                data = self._recv(True)
            except _Closed:
                if self.status >= 200 and not self.framed:
                    # A body without Content-Length or chunking ends where the connection ends.
                    self.reusable = False
                    self.head = b"".join(self.lines) + b"\r\n"
                    return
                raise

    def close(self) -> None:
        self.reusable = False
        with contextlib.suppress(OSError):
            self.sock.close()

    # -- httptools' callbacks -----------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.lines.append(b"\r\n" + name + b": " + value)
        lowered = name.lower()
        if lowered == b"content-length" or lowered == b"transfer-encoding":
            self.framed = True

    def on_headers_complete(self) -> None:
        if self.complete:
            self.reusable = False
            raise httptools.HttpParserError("a second answer to one request")
        self.status = self.parser.get_status_code()
        self.head = b"".join(self.lines) + b"\r\n"

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.status < 200:
            # An informational answer (never asked for): the real one follows.
            self.lines = []
            self.body = []
            self.framed = False
            return
        self.complete = True
        if not self.parser.should_keep_alive():
            self.reusable = False


class Origin:
    """The wire to one base URL (a router's, or a node's in direct mode): its idle connections, most
    recently used last, and what every request to it carries (`headers`: the client's own)."""

    def __init__(self, url: str, timeout: float, tls: ssl.SSLContext | None, headers: Mapping[str, str]) -> None:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https") or not parts.hostname:
            raise httpx.UnsupportedProtocol(f"only http:// and https:// URLs are supported, not {url!r}")
        if parts.username is not None or parts.password is not None:
            raise httpx.UnsupportedProtocol(f"credentials in a URL are not supported: {url!r}")
        self.url = url
        self.host = parts.hostname
        self.tls = tls if scheme == "https" else None
        self.port = parts.port or (443 if scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/")
        self.timeout = timeout
        self.idle: list[_Connection] = []
        self.closed = False
        self.host_line = b" HTTP/1.1\r\nhost: " + parts.netloc.encode("ascii") + b"\r\n"
        self.headers = {name.lower(): value for name, value in headers.items()}
        self.block = _header_block(self.headers)
        # Blocks of requests that add or replace headers (an Accept, an If-None-Match), by those headers.
        self._blocks: dict[tuple[tuple[str, str], ...], bytes] = {}

    def request(
        self,
        method: str,
        path: str,
        *,
        params: Any = None,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
    ) -> Answer:
        """Send one request (a GET, or a POST of `json`) and read its whole answer."""
        target = self.prefix + path
        if params:
            target += "?" + urlencode(params)
        block = self.block if not headers else self._block(headers)
        if json is None:
            request = b"".join((method.encode("ascii"), b" ", target.encode("ascii"), self.host_line, block, b"\r\n"))
        else:
            body = _json_body(json)
            head = b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
            request = b"".join(
                (method.encode("ascii"), b" ", target.encode("ascii"), self.host_line, block, head, body)
            )
        return self.send(request, target)

    def send(self, request: bytes, target: str) -> Answer:
        """Send the request's bytes on an idle connection (a new one when none is at hand); the answer."""
        conn = self._take()
        reused = conn is not None
        while True:
            if conn is None:
                conn = self._connect()
            try:
                conn.exchange(request)
            except _Closed as closed:
                conn.close()
                if reused and not closed.received:
                    conn, reused = None, False  # the keep-alive race: once more, on a new connection
                    continue
                if closed.received:
                    raise httpx.RemoteProtocolError("the server closed the connection mid-answer") from closed.cause
                raise httpx.RemoteProtocolError("the server closed the connection without answering") from (
                    closed.cause
                )
            except BaseException:
                conn.close()
                raise
            break
        chunks = conn.body
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        # Taken before the connection is given back: another thread may start its next exchange at once.
        answer = Answer(conn.status, conn.head, body, target)
        if conn.reusable and not self.closed:
            conn.idle_since = monotonic()
            self.idle.append(conn)
        else:
            conn.close()
        coding = answer.raw(b"content-encoding")
        if coding is not None:
            answer.content = _decoded(body, coding)
        return answer

    def close(self) -> None:
        self.closed = True
        while self.idle:
            self.idle.pop().close()

    def _take(self) -> _Connection | None:
        idle = self.idle
        while idle:
            try:
                conn = idle.pop()
            except IndexError:  # another thread took the last one
                return None
            if monotonic() - conn.idle_since < IDLE_EXPIRY_S:
                return conn
            # Expired: so is every older one.
            conn.close()
            while idle:
                try:
                    idle.pop(0).close()
                except IndexError:
                    break
        return None

    def _connect(self) -> _Connection:
        if self.closed:
            raise httpx.ConnectError(f"the client is closed: {self.url}")
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connecting to {self.url} timed out") from exc
        except OSError as exc:
            raise httpx.ConnectError(str(exc) or type(exc).__name__) from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_hostname=self.host)
            elif _KERNEL_TIMEOUTS and self.timeout is not None and self.timeout > 0:
                # The kernel times each send and receive out (a blocking socket): Python's own timeout would
                # poll() before every one of them, a system call more per send and per receive.
                seconds = int(self.timeout)
                timeval = struct.pack("ll", seconds, max(1, int((self.timeout - seconds) * 1e6)))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
                sock.settimeout(None)
        except TimeoutError as exc:
            sock.close()
            raise httpx.ConnectTimeout(f"the TLS handshake with {self.url} timed out") from exc
        except OSError as exc:  # ssl.SSLError is one
            sock.close()
            raise httpx.ConnectError(str(exc) or type(exc).__name__) from exc
        return _Connection(sock)

    def _block(self, headers: Mapping[str, str]) -> bytes:
        key = tuple(headers.items())
        block = self._blocks.get(key)
        if block is None:
            merged = {**self.headers, **{name.lower(): value for name, value in headers.items()}}
            block = _header_block(merged)
            if len(self._blocks) >= 64:  # a caller varying headers (ETags) must not grow it without bound
                self._blocks.clear()
            self._blocks[key] = block
        return block


def _header_block(headers: Mapping[str, str]) -> bytes:
    """Request-head lines of `headers` (CR, LF and NUL refused: they would break the head)."""
    lines = []
    for name, value in headers.items():
        if name in _FRAMING:
            continue
        if any(c in value for c in "\r\n\x00") or not name.isascii() or not name.isprintable() or " " in name:
            raise ValueError(f"invalid header {name!r}")
        lines.append(f"{name}: {value}\r\n")
    return "".join(lines).encode("latin-1")


def _json_body(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")


def _decoded(body: bytes, coding: bytes) -> bytes:
    """The body with its content coding undone (the client asks for gzip and deflate, as httpx did)."""
    coding = coding.strip().lower()
    try:
        if coding in (b"gzip", b"x-gzip"):
            return zlib.decompress(body, 16 + zlib.MAX_WBITS)
        if coding == b"deflate":
            try:
                return zlib.decompress(body)
            except zlib.error:  # raw deflate, without the zlib wrapper
                return zlib.decompress(body, -zlib.MAX_WBITS)
        if coding == b"identity":
            return body
    except zlib.error as exc:
        raise httpx.DecodingError(f"the answer's {coding.decode('latin-1')} body is broken: {exc}") from exc
    raise httpx.DecodingError(f"unsupported content-encoding {coding.decode('latin-1')!r}")
