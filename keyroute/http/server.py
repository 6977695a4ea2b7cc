"""keyroute's HTTP/1.1 server: it binds, runs the ASGI app's lifespan around listening, accepts connections
(each a keyroute.http.protocol.Connection, whose docstring holds the behaviour contract) and stops gracefully.
The data plane is answered without ASGI (keyroute.http.exchange); everything else goes to the ASGI app.

With an admin port, the same server (same event loop, same app and lifespan) also listens there: the admin port
answers everything but the data plane (admin endpoints, /metrics, probes, the API document), and the data port
answers the admin paths (`admin_paths`) with 404 `not_found`, naming the admin port.

With TLS settings, both ports speak HTTPS only (keyroute.http.tls: contexts, client certificates, rotation);
a plaintext request there ends in a failed handshake, the connection closed. When client certificates are
required, a client that presents none still completes its handshake (the kubelet's HTTPS probes carry none),
but on that connection only GET and HEAD of /healthz and /readyz are answered: anything else gets 403
`client_certificate_required` and the connection is closed (keyroute.http.protocol)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from typing import Any

from keyroute.api import ApiError, NotFound
from keyroute.http.admission import send_error
from keyroute.http.asgi import ASGIApp, Receive, Scope, Send
from keyroute.http.exchange import DataPlane, ServerLimits
from keyroute.http.lifespan import Lifespan, StartupError
from keyroute.http.protocol import Connection, ServerState
from keyroute.http.tls import HANDSHAKE_TIMEOUT_S, ServerTls, TlsError, ca_files
from keyroute.runtime.logs import describe
from keyroute.runtime.settings import TlsSettings

log = logging.getLogger(__name__)


def url_of(sock: socket.socket, scheme: str = "http") -> str:
    """The http:// (or `scheme`) address a listening socket answers on."""
    host, port = sock.getsockname()[:2]
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def bind(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to (host, port), one per address the host resolves to, not yet listening: the port is
    ours (a second process gets "address in use" here, before it does anything else), but connections are
    refused rather than queued until `listen`. Raises OSError."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    seen: set[tuple[Any, ...]] = set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


# Served only on the admin port when there is one: every path equal to one of these or under it.
ADMIN_PATHS = ("/admin", "/metrics")


def is_admin_path(path: str, admin_paths: tuple[str, ...] = ADMIN_PATHS) -> bool:
    """Whether `path` (decoded) is one of `admin_paths` or lies under one."""
    return any(path == prefix or path.startswith(prefix + "/") for prefix in admin_paths)


class DataPortApp:
    """The ASGI app as the data port shows it when there is an admin port: the admin paths answer 404
    `not_found` (saying where they are), everything else goes to `app`. Lifespan messages pass through."""

    __slots__ = ("app", "admin_paths", "admin_port", "_headers")

    def __init__(
        self, app: ASGIApp, admin_paths: tuple[str, ...], error_headers: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        self.app = app
        self.admin_paths = admin_paths
        self.admin_port: int | None = None  # named in the 404's message once known
        self._headers = list(error_headers or ())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and is_admin_path(scope["path"], self.admin_paths):
            where = "the admin port" if self.admin_port is None else f"the admin port ({self.admin_port})"
            message = f"{scope['path']} is served on {where} only, not on this data port"
            await send_error(send, NotFound(message), self._headers)
            return
        await self.app(scope, receive, send)


class HttpServer:
    """keyroute's HTTP/1.1 server: the data plane answered directly, everything else by the ASGI app."""

    def __init__(
        self,
        app: ASGIApp,
        limits: ServerLimits = ServerLimits(),  # noqa: B008 (frozen: one shared default is safe)
        data_plane: Callable[[Any], DataPlane | None] | None = None,
        on_refusal: Callable[[str], None] | None = None,
        name: str = "the server",
        admin_paths: tuple[str, ...] = ADMIN_PATHS,
        error_headers: list[tuple[bytes, bytes]] | None = None,
        tls: TlsSettings | None = None,
        require_ca: str | tuple[str, ...] = "",
        require_ca_option: str = "--tls-client-ca",
        peer_check: Callable[[Any], ApiError | None] | None = None,
    ) -> None:
        """`app`: the Starlette app (admin, health, metrics). `data_plane(app_state)` is called once, after
        the lifespan's startup, with the app's `state` (starlette.datastructures.State: the lifespan put the
        service's objects there); it returns the DataPlane (None: everything goes to the app).
        `on_refusal(code)` is called, on the event loop, for every request the server refuses itself before
        any service code sees it, with the API error code of its answer: bad_request (400, malformed),
        body_timeout (408), body_too_large (413), expectation_failed (417), headers_too_large (431). The
        same counts are kept in `refusals`. `name` (e.g. "node n1") starts the lines it logs about itself.
        `admin_paths`: what only the admin port serves when `start` is given one (the data port answers them
        404, with `error_headers` added). `tls` (when enabled): serve HTTPS on every port, clients required to
        present a certificate chaining to the CA file `require_ca` when one is given (without one, only the
        probes answer; the 403 names `require_ca_option`, the option that gave the file); the files are
        loaded at `start` (TlsError: nothing is bound) and watched for a rotation while the server runs.
        `peer_check(transport)`, with TLS, is asked once per connection, after its handshake, whether its
        client's certificate is refused (keyroute.http.tls.PeerCheck): every request of that connection is
        then answered with the error it gives, and the connection closed."""
        self.name = name
        self.tls_settings = tls if tls is not None and tls.enabled else None
        self.require_ca = ca_files(require_ca)  # "" and ("", "") alike: no client certificate required
        # The option of the CA client certificates must chain to ("": none is required).
        self.certificate_option = require_ca_option if self.tls_settings is not None and self.require_ca else ""
        self.peer_check = peer_check if self.certificate_option else None
        self.tls: ServerTls | None = None
        self.app = app
        self.limits = limits
        # What every connection of this server shares with it (and with the others).
        self._shared = ServerState({}, self.certificate_option, self.peer_check, on_refusal)
        # error code -> requests the server refused itself with it
        self.refusals: dict[str, int] = self._shared.refusals
        self._data_plane_factory = data_plane
        self._dp: DataPlane | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._servers: list[asyncio.Server] = []
        self._admin_servers: list[asyncio.Server] = []
        # What the data port's connections run: the app, or (with an admin port) the app without admin paths.
        self._data_app: ASGIApp = app
        self._data_port_app = DataPortApp(app, tuple(admin_paths), error_headers)
        self._connections = self._shared.connections
        self._tasks = self._shared.tasks
        self._state = self._shared.lifespan_state
        self._lifespan: Lifespan | None = None
        self._stopping = False
        self._stop_requested: asyncio.Event | None = None
        self._stop_wanted = False
        # Held while the server listens anew with a reloaded TLS context (`_relisten`).
        self._relisten_lock: asyncio.Lock | None = None

    @property
    def data_plane(self) -> DataPlane | None:
        """The DataPlane `data_plane(app_state)` returned at start (None before, or when there is none)."""
        return self._dp

    @property
    def state(self) -> dict[str, Any]:
        """The lifespan state (ASGI `scope["state"]`); each request's scope gets a shallow copy."""
        return self._state

    async def start(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        sockets: list[socket.socket] | None = None,
        *,
        admin_port: int | None = None,
        admin_sockets: list[socket.socket] | None = None,
    ) -> None:
        """Bind the port (OSError when taken: nothing else has happened), lifespan startup (an exception there
        propagates, nothing listens), then listen. port 0 = any free port. The app's startup (a node joining
        its cluster) thus runs only once the port is known to be ours. `admin_port` (None: none; 0: any free
        one) or `admin_sockets`: a second port, on the same host, for the admin paths (see the module)."""
        if self._servers or self._lifespan is not None:
            raise RuntimeError("the server is already started")
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._stopping = False
        tls = self.tls
        if self.tls_settings is not None and tls is None:
            tls = self.tls = ServerTls(self.tls_settings, self.require_ca, self.name)  # TlsError: nothing bound
        listen_tls: dict[str, Any] = (
            {} if tls is None else {"ssl": tls.listener, "ssl_handshake_timeout": HANDSHAKE_TIMEOUT_S}
        )
        owned = not sockets
        admin_owned = not admin_sockets and admin_port is not None
        if owned:
            sockets = bind(host, port)
        try:
            if admin_owned:
                admin_sockets = bind(host, admin_port or 0)
        except BaseException:
            if owned:
                for sock in sockets or ():
                    sock.close()
            raise
        own = [*(sockets or () if owned else ()), *(admin_sockets or () if admin_owned else ())]
        self._data_app = self._data_port_app if admin_sockets else self.app
        lifespan = Lifespan(self.app, self._state)
        try:
            await lifespan.startup()
        except BaseException:
            for sock in own:
                sock.close()
            raise
        try:
            if self._data_plane_factory is not None:
                self._dp = self._data_plane_factory(self._app_state())
            for sock in sockets or ():
                server = await loop.create_server(self._connection, sock=sock, backlog=2048, **listen_tls)
                self._servers.append(server)
            for sock in admin_sockets or ():
                server = await loop.create_server(self._admin_connection, sock=sock, backlog=128, **listen_tls)
                self._servers.append(server)
                self._admin_servers.append(server)
        except BaseException:
            for server in self._servers:
                server.close()
            self._servers = []
            self._admin_servers = []
            self._dp = None
            await lifespan.shutdown()
            raise
        self._lifespan = lifespan
        if tls is not None:
            tls.on_reload = self._listen_anew
            tls.watch(loop)
        self._data_port_app.admin_port = self.admin_port
        # Sockets handed in are shared by worker processes: whoever handed them in says where it listens.
        data = [s for server in self._servers if server not in self._admin_servers for s in server.sockets]
        admin = [s for server in self._admin_servers for s in server.sockets]
        log.log(
            logging.INFO if owned else logging.DEBUG,
            "%s is listening on %s%s",
            self.name,
            ", ".join(url_of(s, self.scheme) for s in data),
            f" (admin: {', '.join(url_of(s, self.scheme) for s in admin)})" if admin else "",
        )

    @property
    def scheme(self) -> str:
        """ "https" when the server speaks TLS, else "http"."""
        return "http" if self.tls_settings is None else "https"

    def _app_state(self) -> Any:
        state = getattr(self.app, "state", None)
        if state is not None:
            return state
        from starlette.datastructures import State

        return State(self._state)

    def _listen_anew(self) -> None:
        """A new TLS context came in use: listen with it (`_relisten`)."""
        if self._loop is not None and not self._stopping:
            self._track(self._loop.create_task(self._relisten()))

    async def _relisten(self) -> None:
        """Listen on the same sockets with the current TLS context, then stop listening with the previous one:
        its session cache and ticket keys go with it, so no session made before the reload resumes
        (keyroute.http.tls.ServerTls). Connections already open keep going; none is refused meanwhile (both
        listen on the socket for a moment). One reload at a time: a later one waits for the earlier."""
        if self._relisten_lock is None:
            self._relisten_lock = asyncio.Lock()
        async with self._relisten_lock:
            tls, loop = self.tls, self._loop
            if tls is None or loop is None:
                return
            context = tls.context
            if tls.listener is context:
                return  # an earlier reload already listens with it
            listen_tls: dict[str, Any] = {"ssl": context, "ssl_handshake_timeout": HANDSHAKE_TIMEOUT_S}
            for server in list(self._servers):
                if self._stopping:
                    return
                admin = server in self._admin_servers
                listening = list(server.sockets)
                if len(listening) != 1:
                    continue
                # The same listening socket under another descriptor: closing the old server closes its own.
                sock = socket.socket(fileno=os.dup(listening[0].fileno()))
                try:
                    renewed = await loop.create_server(
                        self._admin_connection if admin else self._connection,
                        sock=sock,
                        backlog=128 if admin else 2048,
                        **listen_tls,
                    )
                except Exception as exc:
                    sock.close()
                    log.warning("%s keeps listening with its previous TLS context: %s", self.name, exc)
                    return
                if self._stopping:
                    renewed.close()
                    return
                self._servers[self._servers.index(server)] = renewed
                if admin:
                    self._admin_servers[self._admin_servers.index(server)] = renewed
                server.close()
            tls.listener = context

    def _connection(self) -> Connection:
        loop = self._loop
        assert loop is not None, "connections are made only while the server runs"
        return Connection(self.limits, self._shared, loop, self._data_app, self._dp)

    def _admin_connection(self) -> Connection:
        # The admin port: everything goes to the app (no data plane), the admin paths included.
        loop = self._loop
        assert loop is not None, "connections are made only while the server runs"
        return Connection(self.limits, self._shared, loop, self.app)

    def _track(self, task: asyncio.Task[None]) -> None:
        self._shared.track(task)

    @property
    def port(self) -> int:
        """The bound port (first listening socket)."""
        if not self._servers:
            raise RuntimeError("the server is not listening")
        return int(self._servers[0].sockets[0].getsockname()[1])

    @property
    def admin_port(self) -> int | None:
        """The bound admin port (None without one)."""
        if not self._admin_servers:
            return None
        return int(self._admin_servers[0].sockets[0].getsockname()[1])

    async def stop(self, grace_s: float = 30.0) -> None:
        """Stop accepting, let in-flight requests finish (up to grace_s), close idle and then all
        connections, run the lifespan's shutdown."""
        if self._stopping or self._lifespan is None:
            return
        self._stopping = True
        loop = asyncio.get_running_loop()
        if self.tls is not None:
            self.tls.close()
        for server in self._servers:
            server.close()
        all_closed = self._shared.all_closed = loop.create_future()
        for conn in list(self._connections):
            conn._shutdown()
        if self._connections:
            await asyncio.wait((all_closed,), timeout=grace_s)
        for conn in list(self._connections):
            conn._abort()
        if self._connections:
            await asyncio.wait((all_closed,), timeout=1.0)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        for server in self._servers:
            await asyncio.wait((loop.create_task(server.wait_closed()),), timeout=1.0)
        self._servers = []
        self._admin_servers = []
        self._shared.all_closed = None
        lifespan, self._lifespan = self._lifespan, None
        await lifespan.shutdown()
        self._dp = None

    def request_stop(self) -> None:
        """Make `run()` stop gracefully, from any thread (what SIGINT/SIGTERM do on the main thread)."""
        self._stop_wanted = True
        loop, event = self._loop, self._stop_requested
        if loop is not None and event is not None:
            loop.call_soon_threadsafe(event.set)

    async def _serve(
        self,
        host: str,
        port: int,
        sockets: list[socket.socket] | None,
        admin_port: int | None = None,
        admin_sockets: list[socket.socket] | None = None,
    ) -> int:
        loop = asyncio.get_running_loop()
        self._loop = loop
        stop = self._stop_requested = asyncio.Event()
        try:
            await self.start(host, port, sockets, admin_port=admin_port, admin_sockets=admin_sockets)
        except (StartupError, TlsError) as exc:
            log.error("%s did not start: %s", self.name, describe(exc))
            return 1
        except OSError as exc:
            reason = (exc.strerror or str(exc)).lower()
            ports = f"{port}" if admin_port is None else f"{port} (or admin port {admin_port})"
            log.error("%s did not start: cannot listen on %s port %s: %s", self.name, host or "*", ports, reason)
            return 1
        except Exception:
            log.exception("%s did not start", self.name)
            return 1
        if self._stop_wanted:
            stop.set()
        installed: list[signal.Signals] = []
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                try:
                    loop.add_signal_handler(sig, stop.set)
                except (NotImplementedError, RuntimeError, ValueError):
                    continue
                installed.append(sig)
        try:
            await stop.wait()
            log.info("stopping")
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)
        await self.stop()
        self._stop_wanted = False
        return 0


def _new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(
    server: HttpServer,
    host: str,
    port: int,
    sockets: list[socket.socket] | None = None,
    *,
    admin_port: int | None = None,
    admin_sockets: list[socket.socket] | None = None,
) -> int:
    """Blocking: serve on a new event loop (uvloop when installed) until SIGINT/SIGTERM (when called on the
    main thread), then stop gracefully. Exit code: 0 after a clean stop; 1 when startup failed (logged).
    `admin_port` / `admin_sockets`: see `HttpServer.start`."""
    loop = _new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(server._serve(host, port, sockets, admin_port, admin_sockets))
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
