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

Member identities (keyroute.auth.security.member_identity) are held here on every wire: a member's own
certificate must name its role and id, and be the member CA's, or it does not start (`member_tls`); a server
refuses a client whose certificate claims a member identity it does not grant (`PeerCheck`: any, on a
router's port; one not issued by the member CA, on a node that also trusts a clients' CA); a member connecting
to a node holds it to the node id registered at that address (`MemberTls.check_peer`); and a request's peer
identity is read once per connection (`peer_identity`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import ssl
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes

from keyroute.api import ApiError
from keyroute.auth.security import MemberIdentity, member_identity, names_member_role
from keyroute.http.errors import MemberCertificateRefused
from keyroute.http.lifespan import StartupError
from keyroute.runtime.settings import TlsSettings

log = logging.getLogger(__name__)

ALPN = ["http/1.1"]
_SHA256 = hashes.SHA256()
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


def ca_files(require_ca: str | tuple[str, ...]) -> tuple[str, ...]:
    """The CA files `require_ca` names (one path, or several: a node's member CA and clients' CA)."""
    return tuple(f for f in ((require_ca,) if isinstance(require_ca, str) else require_ca) if f)


def server_context(tls: TlsSettings, require_ca: str | tuple[str, ...] = "") -> ssl.SSLContext:
    """The context a server listens with: `tls.cert`/`tls.key`; with `require_ca` (a CA file, or several),
    clients are asked for a certificate, and one that is presented must chain to one of those CAs (the
    handshake fails otherwise). A client may present none (the kubelet's probes do not): the server then
    answers it only on the probe paths (`without_certificate`, keyroute.http.protocol). Raises TlsError."""
    ctx = _modern(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))
    _load_chain(ctx, tls.cert, tls.key)
    for path in ca_files(require_ca):
        _load_ca(ctx, path, "client CA file")
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


def member_context(tls: TlsSettings, expect: MemberIdentity | None = None) -> ssl.SSLContext:
    """The context routers and nodes connect to nodes with: nodes' certificates verified against
    `tls.member_ca` (the system's CAs without one) and their host names checked; with a member CA, this
    process's own certificate is presented, and must name `expect` (this process's role and id) when given.
    Sessions are resumed on reconnects (`ResumingContext`). Raises TlsError."""
    ctx = _modern(ResumingContext(ssl.PROTOCOL_TLS_CLIENT))
    if tls.member_ca:
        _load_ca(ctx, tls.member_ca, "member CA file")
        if tls.cert:
            _load_chain(ctx, tls.cert, tls.key)
            if expect is not None:
                check_own_identity(tls.cert, expect, tls.member_ca)
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

    def __init__(
        self,
        tls: TlsSettings,
        require_ca: str | tuple[str, ...] = "",
        name: str = "the server",
        poll_s: float = POLL_S,
    ):
        self.listener: ssl.SSLContext | None = None
        files = (tls.cert, tls.key, *ca_files(require_ca))
        # Called (on the event loop) after a new context came in use: the server then listens with it.
        self.on_reload: Callable[[], None] | None = None
        super().__init__(lambda: server_context(tls, require_ca), files, name, poll_s)
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
        self,
        tls: TlsSettings,
        name: str,
        poll_s: float = POLL_S,
        clock: Callable[[], float] = time.monotonic,
        expect: MemberIdentity | None = None,
    ) -> None:
        files = (tls.member_ca, tls.cert, tls.key) if tls.member_ca else ()
        super().__init__(lambda: member_context(tls, expect), files, name, poll_s)
        self._clock = clock
        self._looked = clock()
        # The partition map this process routes by (`registered`): what says which node registered an
        # address. None: any node's certificate is accepted.
        self.peers: Callable[[], Any] | None = None

    def check_peer(self, origin: str, transport: Any) -> str | None:
        """Why the node just connected to at `origin` is refused, or None: its certificate must name a node,
        and (with `peers`) a node that registered that address in the map, never another (a machine that
        wrote another node's records in ZooKeeper cannot take its reads)."""
        identity = peer_identity(transport)
        if identity is None or identity.role != "node":
            return f"its certificate names {identity or 'no member identity'}, not a node"
        peers = self.peers
        if peers is None:
            return None
        registered = registered_at(peers(), origin)
        if registered and identity.id not in registered:
            return f"its certificate names {identity}, but {', '.join(sorted(registered))} registered that address"
        return None

    def __call__(self, origin: str = "") -> ssl.SSLContext:
        _ORIGIN.set(origin)  # the session to offer is this origin's
        now = self._clock()
        if now - self._looked >= self.poll_s:
            self._looked = now
            self.check()
        return self.context


def registered_at(peers: Any, origin: str) -> set[str]:
    """The ids of the nodes whose records in partition map `peers` (keyroute.cluster.partition_map.PartitionMap)
    give an address at `origin` (scheme://host:port); empty when none (or no map)."""
    found: set[str] = set()
    target = url_origin(origin)
    for records in (getattr(peers, "serving", None) or {}, getattr(peers, "nodes", None) or {}):
        for node_id, record in records.items():
            if url_origin(record.url) == target:
                found.add(node_id)
    return found


@functools.lru_cache(maxsize=1024)
def url_origin(url: str) -> str:
    """scheme://host:port of `url`, the port spelled out (how connections are pooled and looked up)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.scheme}://{parts.hostname}:{port}"


def member_tls(tls: TlsSettings, name: str, expect: MemberIdentity | None = None) -> MemberTls | None:
    """What a router or node (`name`) connects to nodes over TLS with: None without a member CA (https://
    nodes are then refused). Raises StartupError (one line) when the files do not load, or when its own
    certificate does not name `expect` (its role and id; a rotated one that does not is not used either)."""
    try:
        if expect is not None and expect.role == "node" and tls.client_ca:
            check_separate_cas(tls)
        if not tls.member_ca:
            return None
        return MemberTls(tls, name, expect=expect)
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


# -- member identities ----------------------------------------------------------------------------------


def _chain(path: str) -> list[x509.Certificate]:
    """The certificates of a PEM certificate (chain) file, the leaf first."""
    _read(path, "TLS certificate")
    with open(path, "rb") as f:
        data = f.read()
    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError:
        raise TlsError(f"the TLS certificate {path} holds no PEM certificate") from None


def _issued_by(leaf: x509.Certificate, issuers: list[x509.Certificate]) -> x509.Certificate | None:
    """The one of `issuers` that signed `leaf`, if any."""
    for ca in issuers:
        if leaf.issuer != ca.subject:
            continue
        try:
            leaf.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature):
            continue
        return ca
    return None


def _chains_to(chain: list[x509.Certificate], roots: list[x509.Certificate]) -> bool:
    """Whether the leaf of `chain` is issued by one of `roots`, directly or through the chain's others."""
    current, rest = chain[0], chain[1:]
    for _ in range(len(chain)):
        if _issued_by(current, roots) is not None:
            return True
        step = _issued_by(current, rest)
        if step is None:
            return False
        current = step
        rest = [c for c in rest if c is not step]
    return False


def _alt_names(certificate: x509.Certificate) -> dict[str, Any]:
    """A certificate's DNS and URI subject alternative names as `ssl.SSLObject.getpeercert()` lists them."""
    try:
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return {}
    found = [("DNS", n) for n in names.get_values_for_type(x509.DNSName)]
    found += [("URI", n) for n in names.get_values_for_type(x509.UniformResourceIdentifier)]
    return {"subjectAltName": tuple(found)}


def identity_hint(expect: MemberIdentity) -> str:
    """How a certificate names `expect`, for messages."""
    return (
        f"a DNS name keyroute-{expect.role}.{expect.id}.<domain> or a URI "
        f"spiffe://<trust domain>/keyroute/{expect.role}/{expect.id}"
    )


def check_own_identity(cert: str, expect: MemberIdentity, member_ca: str = "") -> None:
    """Raises TlsError (one line) unless the certificate in file `cert` names exactly `expect`, and (with
    `member_ca`) is issued by a CA of that file: a member presents its own role and id, never another's,
    from the CA its peers hold members to."""
    chain = _chain(cert)
    named = member_identity(_alt_names(chain[0]))
    if named != expect:
        found = f"names {named}" if named is not None else "names no member identity (or a malformed or ambiguous one)"
        raise TlsError(f"the TLS certificate {cert} {found}, not {expect}: expected {identity_hint(expect)}")
    if member_ca and not _chains_to(chain, _certificates(member_ca)):
        raise TlsError(f"the TLS certificate {cert} of {expect} is not issued by the member CA {member_ca}")


def check_separate_cas(tls: TlsSettings) -> None:
    """Raises TlsError unless a node's clients' CA (`tls.client_ca`) comes with a member CA and shares no
    certificate with it: a certificate of a CA trusted for both would be a member's whatever it was issued
    for."""
    if not tls.member_ca:
        raise TlsError("--tls-client-ca on a node needs --member-ca (the CA of routers' and nodes' certificates)")
    try:
        common = {c.fingerprint(_SHA256) for c in _certificates(tls.member_ca)}
        common &= {c.fingerprint(_SHA256) for c in _certificates(tls.client_ca)}
    except TlsError:
        return  # said by the context that loads them
    if common:
        raise TlsError(
            f"--tls-client-ca {tls.client_ca} and --member-ca {tls.member_ca} hold the same CA: clients' and "
            "members' certificates must come from different CAs"
        )


def _certificates(path: str) -> list[x509.Certificate]:
    try:
        with open(path, "rb") as f:
            return x509.load_pem_x509_certificates(f.read())
    except (OSError, ValueError) as exc:
        raise TlsError(f"the CA file {path} does not load ({exc})") from None


class PeerCheck(FilePoller):
    """What a server refuses a TLS client for, by its certificate, once per connection (`__call__` with the
    connection's transport, after the handshake: an error to answer every request with, or None).

    `clients_only` (a router's port, which serves callers): a certificate claiming a member identity is
    refused, whichever CA issued it. Otherwise (a node, serving members and callers): a certificate claiming
    one must name exactly one well-formed identity, and, when the node also trusts a clients' CA
    (`client_ca`), be issued by a CA of `member_ca` (the handshake only proved it chains to one of the two);
    a certificate that claims none is a caller's. The CA files are read again when they change."""

    def __init__(
        self, member_ca: str = "", client_ca: str = "", clients_only: bool = False, poll_s: float = POLL_S
    ) -> None:
        self.clients_only = clients_only
        self.member_ca = member_ca
        # Issuers are checked only where the handshake cannot tell members' CA from clients'.
        self.issuers_checked = bool(member_ca and client_ca and not clients_only)
        super().__init__((member_ca,) if self.issuers_checked else (), poll_s)
        self._members: list[x509.Certificate] = self._read_members() if self.issuers_checked else []

    def _read_members(self) -> list[x509.Certificate]:
        try:
            return _certificates(self.member_ca)
        except TlsError:
            return []  # the server's context, loading the same file, says why and does not start

    def check(self) -> bool:
        """Read the member CA file again if it changed; whether it did (one that does not load is not used)."""
        if not self.changed():
            return False
        members = self._read_members()
        if not members:
            log.warning("the member CA file %s does not load: keeping the previous one", self.member_ca)
            return False
        self._members = members
        return True

    def __call__(self, transport: Any) -> ApiError | None:
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is None:
            return None
        certificate = ssl_object.getpeercert()
        if not certificate or not names_member_role(certificate):
            return None
        if self.clients_only:
            return MemberCertificateRefused(
                "this port serves clients: a certificate that names a member role (keyroute-node, keyroute-router)"
                " is not a client's"
            )
        identity = member_identity(certificate)
        if identity is None:
            return MemberCertificateRefused(
                "the client certificate claims a member role but names no single well-formed member identity: "
                "keyroute-<role>.<id>.<domain> or spiffe://<trust domain>/keyroute/<role>/<id>"
            )
        if self.issuers_checked:
            self.check()
            if not self._issued_by_member_ca(ssl_object.getpeercert(binary_form=True)):
                return MemberCertificateRefused(
                    f"the certificate of {identity} is not issued by this node's --member-ca: "
                    "a certificate of the clients' CA names no member"
                )
        return None

    def _issued_by_member_ca(self, der: bytes) -> bool:
        try:
            leaf = x509.load_der_x509_certificate(der)
        except ValueError:
            return False
        return _issued_by(leaf, self._members) is not None


# The identity named by a peer's certificate, by TLS connection (an SSLObject): parsed once per connection.
_NO_IDENTITY = MemberIdentity("", "")


def peer_identity(transport: Any) -> MemberIdentity | None:
    """The member identity the TLS peer of `transport` presented a certificate for (the handshake verified
    its chain against the server's CAs, `PeerCheck` that a member's is the member CA's), else None (no TLS,
    no certificate, no member identity)."""
    if transport is None:
        return None
    ssl_object = transport.get_extra_info("ssl_object")
    if ssl_object is None:
        return None
    identity = getattr(ssl_object, "_keyroute_identity", None)
    if identity is None:
        identity = member_identity(ssl_object.getpeercert()) or _NO_IDENTITY
        ssl_object._keyroute_identity = identity
    return identity if identity is not _NO_IDENTITY else None


def peer_role(transport: Any) -> str | None:
    """ "router" or "node": the role of `peer_identity(transport)`, else None."""
    identity = peer_identity(transport)
    return identity.role if identity is not None else None


def call_peer_identity(call: Any) -> MemberIdentity | None:
    """`peer_identity` of the connection a data-plane call (keyroute.http.dataplane.Call) came on."""
    return peer_identity(call.transport)


def call_peer_role(call: Any) -> str | None:
    """`peer_role` of the connection a data-plane call (keyroute.http.dataplane.Call) came on."""
    return peer_role(call.transport)
