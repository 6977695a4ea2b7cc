"""Test helpers: wait on a condition with a deadline (never a fixed sleep), free ports, processes, and
keyroute's own HTTP server on a thread."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from keyroute.http import HttpServer

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T | None],
    timeout_s: float = 30.0,
    interval_s: float = 0.05,
    message: str = "condition",
) -> T:
    """Poll `predicate` until it returns something truthy; return it, or fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last_error: BaseException | None = None
    while True:
        try:
            result = predicate()
            if result:
                return result
        except Exception as exc:  # the condition may raise until the system is up
            last_error = exc
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {message} (last error: {last_error!r})")
        time.sleep(interval_s)


async def wait_until(
    predicate: Callable[[], Any], timeout_s: float = 10.0, interval_s: float = 0.01, message: str = ""
) -> Any:
    """`wait_for` in a coroutine: poll `predicate` (sync, or returning an awaitable) until it gives something
    truthy, letting the event loop run in between; return it, or AssertionError after `timeout_s`. The
    predicate may raise until the system is up (the last error is in the failure message)."""
    deadline = time.monotonic() + timeout_s
    last_error: BaseException | None = None
    while True:
        try:
            result = predicate()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return result
        except Exception as exc:
            last_error = exc
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"timed out after {timeout_s}s waiting for {message or predicate!r} (last error: {last_error!r})"
            )
        await asyncio.sleep(interval_s)


_handed_out: set[int] = set()


def free_port() -> int:
    """A port nothing listens on now and that this process has not handed out before: the caller binds it
    later (often in a child process), and until then the kernel may offer it again."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port


class Proc:
    """A `keyroute ...` subprocess with its output in a log file; stopped (or killed) on exit."""

    def __init__(self, args: Sequence[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.args = list(args)
        self.log_path = log_path
        self._env = {**os.environ, **(env or {})}
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        log = open(self.log_path, "ab")
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "keyroute", *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self._env,
        )
        log.close()
        return self

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill9(self) -> None:
        assert self.popen is not None
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=10)

    def stop(self, timeout_s: float = 15.0) -> int | None:
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode

    def output(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""


@contextmanager
def serve_in_thread(server: HttpServer, host: str = "127.0.0.1") -> Iterator[int]:
    """`server` (keyroute.http) started on its own event loop in a daemon thread, on any free port of `host`;
    yields the bound port once it listens, and stops the server (gracefully) on exit."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    failure: list[BaseException] = []

    def serve() -> None:
        asyncio.set_event_loop(loop)
        try:
            try:
                loop.run_until_complete(server.start(host=host, port=0))
            except BaseException as exc:  # handed to the caller's thread
                failure.append(exc)
                return
            finally:
                started.set()
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    thread = threading.Thread(target=serve, name="http-server", daemon=True)
    thread.start()
    if not started.wait(timeout=10):
        raise AssertionError("the server did not start within 10s")
    if failure:
        thread.join(timeout=10)
        raise failure[0]
    try:
        yield server.port
    finally:
        try:
            asyncio.run_coroutine_threadsafe(server.stop(grace_s=5.0), loop).result(timeout=15)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)


class TcpProxy:
    """A TCP relay on 127.0.0.1 to `target` (host, port) that a test can cut: `cut()` closes every relayed
    connection and closes each new one at once (counted in `refused`), `restore()` relays again. Stands in
    for a network outage without stopping the server behind it (the session's ZooKeeper)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.refused = 0
        self._cut = threading.Event()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._closed = False
        threading.Thread(target=self._accept, name="tcp-proxy", daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cut(self) -> None:
        self._cut.set()
        with self._lock:
            conns, self._open = self._open, set()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def restore(self) -> None:
        self._cut.clear()

    def close(self) -> None:
        self._closed = True
        self.cut()
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._cut.is_set():
                self.refused += 1
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._open.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for conn in (src, dst):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            src.close()  # this thread reads it; the other direction's thread closes `dst`
