"""The router as a process: keyroute's HTTP server around the router's app and data plane (or several worker
processes sharing the port, see router/workers.py), stopped cleanly by SIGTERM or SIGINT.

Called by `keyroute router`; returns the process exit code.
"""

from __future__ import annotations

import functools
import logging
import socket
from collections.abc import Callable

from starlette.applications import Starlette

from keyroute.auth.security import MemberIdentity
from keyroute.http.server import HttpServer
from keyroute.http.server import run as serve
from keyroute.http.tls import PeerCheck, TlsError, member_context, server_context
from keyroute.router import workers
from keyroute.router.app import create_app
from keyroute.router.dataplane import RouterDataPlane
from keyroute.router.limits import server_limits
from keyroute.runtime.logs import describe
from keyroute.runtime.settings import RouterSettings

log = logging.getLogger(__name__)


def run(settings: RouterSettings, *, setup: Callable[[], object] | None = None) -> int:
    """Serve until stopped: in this process, or in `settings.workers` processes sharing the port, each of
    which calls `setup` (say, logging) first, since it starts afresh."""
    if settings.workers <= 1:
        return _serve(settings, None, None)
    tls = settings.http.tls
    if tls.enabled:  # unusable files are said once, here, rather than by every worker
        try:
            server_context(tls, tls.client_ca)
            member_context(tls, MemberIdentity("router", settings.member_id))
        except TlsError as exc:
            log.error("router did not start: %s", describe(exc))
            return 1
    host, port, admin_port = settings.http.host, settings.http.port, settings.http.admin_port
    sock = admin_sock = None
    try:
        sock = workers.bind(host, port)
        if admin_port is not None:
            admin_sock = workers.bind(host, admin_port)
    except OSError as exc:
        taken = port if sock is None else admin_port
        if sock is not None:
            sock.close()
        reason = (exc.strerror or str(exc)).lower()
        log.error("router did not start: cannot listen on %s port %s: %s", host, taken, reason)
        return 1
    scheme = "https" if settings.http.tls.enabled else "http"
    return workers.run(functools.partial(_worker, settings, setup), settings.workers, sock, admin_sock, scheme)


def _worker(
    settings: RouterSettings,
    setup: Callable[[], object] | None,
    sock: socket.socket,
    admin_sock: socket.socket | None = None,
) -> int:
    if setup is not None:
        setup()
    return _serve(settings, [sock], [admin_sock] if admin_sock is not None else None)


def server(settings: RouterSettings, app: Starlette | None = None) -> HttpServer:
    """The router's HTTP server: its app (admin, health, metrics; `create_app(settings)` unless given) and
    its data plane (everything under /stores/), built once the app's lifespan has made the proxy."""
    app = create_app(settings) if app is None else app
    return HttpServer(
        app,
        server_limits(settings),
        data_plane=RouterDataPlane.factory(settings.limits.max_key_bytes),
        # Requests the server refuses itself (400, 408, 413, 417, 431), counted with admission's refusals.
        on_refusal=app.state.admission.refused,
        name="router",
        tls=settings.http.tls,
        require_ca=settings.http.tls.client_ca,
        # A router serves callers: a certificate claiming a member's identity is refused here.
        peer_check=PeerCheck(clients_only=True),
    )


def _serve(
    settings: RouterSettings, sockets: list[socket.socket] | None, admin_sockets: list[socket.socket] | None
) -> int:
    # httpx (the upstream when tests inject a transport) logs every request at INFO: failures are logged here.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().getEffectiveLevel()))
    # A failed start has been said by the server, in one line (port taken, ZooKeeper refusing credentials).
    http = settings.http
    code = serve(
        server(settings), http.host, http.port, sockets, admin_port=http.admin_port, admin_sockets=admin_sockets
    )
    if code == 0:
        log.info("router stopped")
    return code
