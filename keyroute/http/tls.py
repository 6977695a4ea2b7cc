"""TLS on keyroute's wires: the server's context (HTTPS on data and admin ports, client certificates when a CA
is given), reloaded when its files change, and the context members connect to nodes with.

Contexts are stdlib `ssl`: TLS 1.2 at least, ALPN `http/1.1`, OpenSSL's default ciphers. A server context is
rebuilt whenever one of its files changes (their inode, size or modification time is polled every few
seconds, following symbolic links, so the symlink swap of a Kubernetes Secret volume counts): the new one
serves new connections (the server listens anew with it; an SNI callback hands it to any handshake still
accepted with the previous one), while connections already open keep theirs, so none is dropped. Sessions
made before a reload do not resume after it: a replaced certificate or client CA revokes them. A rotated
pair that does not load leaves the previous context in use and says so in one line. `TlsError` is one line
naming the file and the reason; nothing here logs a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from keyroute.core.security import member_role
from keyroute.core.settings import TlsSettings
from keyroute.http.lifespan import StartupError

log = logging.getLogger(__name__)

ALPN = ["http/1.1"]
# How often the certificate files are looked at for a rotation.
POLL_S = 2.0
# A client that connects and never finishes its handshake is let go after this long.
HANDSHAKE_TIMEOUT_S = 10.0


class TlsError(Exception):
    """A certificate, key or CA file that cannot be used: one line naming the file and the reason."""


def _read(path: str, what: str) -> None:
    """Raises TlsError when `path` cannot be read (missing, unreadable, a directory)."""
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as exc:
        raise TlsError(f"cannot read the {what} {path}: {(exc.strerror or str(exc)).lower()}") from None


def _reason(exc: ssl.SSLError) -> str:
    """OpenSSL's reason, without the library tag and source line ("key values mismatch")."""
    reason = getattr(exc, "verify_message", None) or exc.reason or exc.strerror or str(exc)
    return str(reason).replace("_", " ").lower()


def _load_chain(ctx: ssl.SSLContext, cert: str, key: str) -> None:
    _read(cert, "TLS certificate")
    _read(key, "TLS key")
    try:
        ctx.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise TlsError(
            f"the TLS certificate {cert} and key {key} cannot be used together ({_reason(exc)}): "
            "expected a PEM certificate (chain) and its PEM private key"
        ) from None


def _load_ca(ctx: ssl.SSLContext, path: str, what: str) -> None:
    _read(path, what)
    try:
        ctx.load_verify_locations(cafile=path)
    except ssl.SSLError as exc:
        raise TlsError(f"the {what} {path} holds no PEM certificate ({_reason(exc)})") from None


def _modern(ctx: ssl.SSLContext) -> ssl.SSLContext:
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(ALPN)
    return ctx


def server_context(tls: TlsSettings, require_ca: str = "") -> ssl.SSLContext:
    """The context a server listens with: `tls.cert`/`tls.key`; with `require_ca`, clients are asked for a
    certificate, and one that is presented must chain to that CA file (the handshake fails otherwise). A
    client may present none (the kubelet's probes do not): the server then answers it only on the probe paths
    (`without_certificate`, keyroute.http.protocol). Raises TlsError."""
    ctx = _modern(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))
    _load_chain(ctx, tls.cert, tls.key)
    if require_ca:
        _load_ca(ctx, require_ca, "client CA file")
        ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


def without_certificate(transport: Any) -> bool:
    """Whether `transport` is a TLS connection whose client presented no certificate (its handshake is
    complete: a certificate presented was verified then)."""
    ssl_object = transport.get_extra_info("ssl_object")
    return ssl_object is not None and not ssl_object.getpeercert()


# The origin (scheme, host and port) a connection being opened goes to, set by `MemberTls(origin)` in the
# task that opens it: the transport, made in that task, starts its handshake in a copy of its context.
_ORIGIN: ContextVar[str] = ContextVar("keyroute_tls_origin", default="")


class ResumingContext(ssl.SSLContext):
    """A client context that offers each origin the TLS session of an earlier connection to it, so that
    a reconnect resumes (an abbreviated handshake: no certificate sent or verified again) instead of a full
    handshake. Sessions are kept per origin (`_ORIGIN`, else the server name), the last resumable one."""

    def wrap_bio(  # type: ignore[override]
        self,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
        server_side: bool = False,
        server_hostname: str | None = None,
        session: ssl.SSLSession | None = None,
    ) -> ssl.SSLObject:
        if server_side:
            return super().wrap_bio(incoming, outgoing, server_side, server_hostname, session)
        key = _ORIGIN.get() or server_hostname or ""
        sessions: dict[str, Any] = self.__dict__.setdefault("_keyroute_sessions", {})
        last, resumable = sessions.get(key, (None, None))
        if last is not None:
            latest = last.session  # a TLS 1.3 ticket comes after the handshake: look again now
            if latest is not None and (latest.has_ticket or latest.id):
                resumable = latest
        if session is None:
            session = resumable
        sslobj = super().wrap_bio(incoming, outgoing, server_side, server_hostname, session)
        sessions[key] = (sslobj, resumable)
        return sslobj


def member_context(tls: TlsSettings) -> ssl.SSLContext:
    """The context routers and nodes connect to nodes with: nodes' certificates verified against
    `tls.member_ca` (the system's CAs without one) and their host names checked; with a member CA, this
    process's own certificate is presented. Sessions are resumed on reconnects (`ResumingContext`).
    Raises TlsError."""
    ctx = _modern(ResumingContext(ssl.PROTOCOL_TLS_CLIENT))
    if tls.member_ca:
        _load_ca(ctx, tls.member_ca, "member CA file")
        if tls.cert:
            _load_chain(ctx, tls.cert, tls.key)
    else:
        ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
    return ctx


def file_stamp(paths: tuple[str, ...]) -> tuple[Any, ...]:
    """What tells a change of `paths`: each one's device, inode, size and modification time (None: absent)."""
    stamps: list[Any] = []
    for path in paths:
        try:
            st = os.stat(path)  # follows symbolic links: a swapped link is a new inode
        except OSError:
            stamps.append(None)
        else:
            stamps.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(stamps)


class FilePoller:
    """Something made from `files` and made again when they change: `changed()` says whether they did
    since last seen; `watch(loop)` calls `check()` every `poll_s` on that loop until `close()`."""

    def __init__(self, files: tuple[str, ...], poll_s: float = POLL_S) -> None:
        self.files = tuple(f for f in files if f)
        self.poll_s = poll_s
        self._seen = file_stamp(self.files)
        self._timer: asyncio.TimerHandle | None = None

    def changed(self) -> bool:
        stamp = file_stamp(self.files)
        if stamp == self._seen:
            return False
        self._seen = stamp
        return True

    def check(self) -> bool:
        """Make the thing again if its files changed; whether it did."""
        raise NotImplementedError

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        self.close()
        self._timer = loop.call_later(self.poll_s, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            self.check()
        finally:
            self._timer = loop.call_later(self.poll_s, self._tick, loop)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class ReloadingContext(FilePoller):
    """A TLS context made by `build()` from `files`, made again when one of them changes. `context` is the
    current one. `watch(loop)` polls the files every `poll_s` on that loop until `close()`; `check()` polls
    once (what the timer calls)."""

    def __init__(
        self, build: Callable[[], ssl.SSLContext], files: tuple[str, ...], name: str, poll_s: float = POLL_S
    ) -> None:
        self._build = build
        self.name = name
        super().__init__(files, poll_s)
        self.context = self._made()  # raises TlsError: nothing is served

    def _made(self) -> ssl.SSLContext:
        return self._build()

    def check(self) -> bool:
        """Load the files again if they changed since last seen; whether a new context is in use."""
        if not self.changed():
            return False
        try:
            context = self._made()
        except TlsError as exc:
            log.warning("%s keeps its previous TLS certificate: the rotated files do not load: %s", self.name, exc)
            return False
        self.context = context
        log.info("%s uses a new TLS certificate from %s", self.name, ", ".join(self.files))
        return True


class ServerTls(ReloadingContext):
    """The server's TLS context, reloaded on rotation. `listener` is what the server listens with; the SNI
    callback of every context made hands each new handshake the current one.

    A handshake switched that way still resumes sessions by the listener's session cache and ticket keys
    (OpenSSL decides a resumption before the SNI callback runs, with the context the connection was accepted
    with), so a session from before a reload would outlive it: a client whose certificate the new client CA
    no longer accepts would resume its old session, certificate and all. So the server listens anew with
    every new context (`on_reload`, keyroute.http.server): its session cache and ticket keys are new, and
    sessions made before do not resume."""

    def __init__(self, tls: TlsSettings, require_ca: str = "", name: str = "the server", poll_s: float = POLL_S):
        self.listener: ssl.SSLContext | None = None
        # Called (on the event loop) after a new context came in use: the server then listens with it.
        self.on_reload: Callable[[], None] | None = None
        super().__init__(lambda: server_context(tls, require_ca), (tls.cert, tls.key, require_ca), name, poll_s)
        self.listener = self.context

    def check(self) -> bool:
        reloaded = super().check()
        if reloaded and self.on_reload is not None:
            self.on_reload()
        return reloaded

    def _made(self) -> ssl.SSLContext:
        context = self._build()
        context.sni_callback = self._choose
        return context

    def _choose(self, ssl_object: Any, server_name: str | None, context: ssl.SSLContext) -> None:
        current = self.context
        if current is not context:
            ssl_object.context = current


class MemberTls(ReloadingContext):
    """The context routers and nodes connect to nodes with (`member_context`); call it, with the origin
    about to be connected to, for the current one (what FastUpstream's `tls` takes): its files are looked
    at again, for a rotation, when a connection is opened at least `poll_s` after the last look (no timer:
    members open connections seldom)."""

    def __init__(
        self, tls: TlsSettings, name: str, poll_s: float = POLL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        files = (tls.member_ca, tls.cert, tls.key) if tls.member_ca else ()
        super().__init__(lambda: member_context(tls), files, name, poll_s)
        self._clock = clock
        self._looked = clock()

    def __call__(self, origin: str = "") -> ssl.SSLContext:
        _ORIGIN.set(origin)  # the session to offer is this origin's
        now = self._clock()
        if now - self._looked >= self.poll_s:
            self._looked = now
            self.check()
        return self.context


def member_tls(tls: TlsSettings, name: str) -> MemberTls | None:
    """What a router or node (`name`) connects to nodes over TLS with: None without a member CA (https://
    nodes are then refused). Raises StartupError (one line) when the files do not load."""
    if not tls.member_ca:
        return None
    try:
        return MemberTls(tls, name)
    except TlsError as exc:
        raise StartupError(str(exc)) from None


def describe(exc: BaseException) -> str:
    """A failed TLS connection's reason, in a few words: "the certificate has expired", "the host name is
    not the certificate's", "the certificate is self-signed", "the certificate is not from a trusted CA"."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        message = str(exc.verify_message or "").lower()
        if "expired" in message:
            return "its certificate has expired"
        if "hostname mismatch" in message or "ip address mismatch" in message:
            return f"its certificate is not for this host ({exc.verify_message})"
        if "self-signed" in message or "self signed" in message:
            return "its certificate is self-signed (not from a trusted CA)"
        return f"its certificate is not from a trusted CA ({exc.verify_message})"
    if isinstance(exc, ssl.SSLError):
        return f"TLS failed: {_reason(exc)}"
    return str(exc)


# The role named by a peer's certificate, by TLS connection (an SSLObject): parsed once per connection.
_NO_ROLE = ""


def peer_role(transport: Any) -> str | None:
    """ "router" or "node" when the TLS peer of `transport` presented a member certificate (the handshake
    verified its chain against the server's CA), else None (no TLS, no certificate, another role)."""
    if transport is None:
        return None
    ssl_object = transport.get_extra_info("ssl_object")
    if ssl_object is None:
        return None
    role = getattr(ssl_object, "_keyroute_role", None)
    if role is None:
        role = member_role(ssl_object.getpeercert()) or _NO_ROLE
        ssl_object._keyroute_role = role
    return role or None


def call_peer_role(call: Any) -> str | None:
    """`peer_role` of the connection a data-plane call (keyroute.http.dataplane.Call) came on."""
    return peer_role(call._exchange._conn._transport)
