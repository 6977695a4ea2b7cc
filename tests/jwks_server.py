"""A JWT issuer's key server for tests and benchmarks: a JWKS over plain HTTP on 127.0.0.1, on a free port,
answered whole or trickled (its head at once, then one byte of the body every `trickle_interval_s`, as a
key server that froze routers and nodes did). It counts the fetches it saw, those it answered whole, and
those the fetching side abandoned (closed the connection before the body was whole); and the trickled
answers begun and ended, so that a test can tell that something happened while one was in progress."""

from __future__ import annotations

import json
import select
import socket
import threading
from typing import Any


class JwksServer:
    """Serves `{"keys": keys}` at any path until `close`. Set `trickle` (and `trickle_interval_s`) and `keys`
    at any time: each fetch reads them when it starts."""

    def __init__(self, keys: list[dict[str, Any]], trickle_interval_s: float = 1.0) -> None:
        self.keys = list(keys)
        self.trickle = False
        self.trickle_interval_s = trickle_interval_s
        self.fetches = self.served = self.abandoned = 0
        self.trickles_begun = self.trickles_ended = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._threads: list[threading.Thread] = []
        accepting = threading.Thread(target=self._accept, name="jwks-server", daemon=True)
        accepting.start()
        self._threads.append(accepting)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/.well-known/jwks.json"

    def counts(self) -> tuple[int, int, int]:
        """(fetches, served whole, abandoned by the fetching side)."""
        with self._lock:
            return self.fetches, self.served, self.abandoned

    def trickle_marks(self) -> tuple[int, int]:
        """(trickled answers begun, ended): a span between a reading (b0, _) taken before it and (_, e1)
        taken after it lay wholly within a trickled answer when b0 > e1 (one begun before it had not ended)."""
        with self._lock:
            return self.trickles_begun, self.trickles_ended

    def _accept(self) -> None:
        self._listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            worker = threading.Thread(target=self._answer, args=(conn,), name="jwks-fetch", daemon=True)
            worker.start()
            self._threads.append(worker)

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            head = b""
            try:
                while b"\r\n\r\n" not in head:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    head += chunk
            except OSError:
                return
            with self._lock:
                self.fetches += 1
            body = json.dumps({"keys": self.keys}).encode()
            answer_head = (
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
                b"content-length: " + str(len(body)).encode() + b"\r\n\r\n"
            )
            try:
                if not self.trickle:
                    conn.sendall(answer_head + body)
                    with self._lock:
                        self.served += 1
                    return
                with self._lock:
                    self.trickles_begun += 1
                try:
                    conn.sendall(answer_head)
                    for i in range(len(body)):
                        conn.sendall(body[i : i + 1])
                        # Wait for the next byte's turn, watching for the other side closing meanwhile.
                        readable, _, _ = select.select([conn], [], [], self.trickle_interval_s)
                        if self._stop.is_set():
                            return
                        if readable and not conn.recv(1):
                            raise ConnectionResetError
                finally:
                    with self._lock:
                        self.trickles_ended += 1
                with self._lock:
                    self.served += 1
            except OSError:
                with self._lock:
                    self.abandoned += 1

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def __enter__(self) -> JwksServer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
