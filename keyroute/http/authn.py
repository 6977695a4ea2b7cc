"""Who is asking, for a data-plane call or an app request: the caller's credentials (Authorization, a client
certificate, or, on a node, the caller a member passes on) checked by a `keyroute.auth.authn.Authenticator`
and the store's permission checked once, in `Callers.admit` (called by keyroute.http.dataplane before any
handler runs).

    a request from a member      (nodes only: the cluster token, or a member certificate, proves it) the
                                 member checked its caller: trusted, under the name it passes on in
                                 X-Keyroute-Caller; a member certificate's other member headers must be
                                 its own role's and id's (keyroute.auth.security.check_member_headers),
                                 else 403
    Authorization: Bearer ...    a token of the token file, or a JWT
    a client certificate         (routers with --tls-client-ca) its SAN or subject CN, mapped by the token
                                 file's `certificate` entries

401 `unauthorized` (WWW-Authenticate: Bearer) without credentials or with bad ones; 403 `forbidden` naming the
store the caller may not read. Without access control there is no `Callers` at all: nothing is checked.

A JWT issuer's keys (`--jwt-jwks-url`, https:// only) are fetched here, on the signing keys' own thread
(keyroute.auth.authn.SigningKeys), each fetch within a total deadline (connecting, the head and the whole
body), on an event loop of its own: a read never waits for one.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from keyroute.api import HEADER_FORWARDED_BY, HEADER_HOPS, Forbidden, Unauthorized
from keyroute.auth.access import Identity
from keyroute.auth.authn import (
    DEFAULT_STORES_CLAIM,
    Authenticator,
    AuthnError,
    FetchDeadline,
    JwtPolicy,
    JwtVerifier,
    SigningKeys,
    TokenFile,
    check_jwks_url,
    parse_groups,
    read_document,
)
from keyroute.auth.cursor_key import CursorKey
from keyroute.auth.security import (
    SESSION_COOKIE,
    ClusterAuth,
    caller_session,
    caller_session_key,
    check_member_headers,
    cookie_value,
    read_caller_session,
)
from keyroute.http.asgi import TRANSPORT_EXTENSION
from keyroute.http.lifespan import StartupError
from keyroute.http.tls import peer_identity
from keyroute.runtime.settings import AccessSettings

log = logging.getLogger(__name__)

HEADER_CALLER = "x-keyroute-caller"
_CALLER = HEADER_CALLER.encode("ascii")
_AUTHORIZATION = b"authorization"
_MEMBER_AUTH = b"x-keyroute-auth"
_HOPS = HEADER_HOPS.encode("ascii")
_FORWARDED_BY = HEADER_FORWARDED_BY.encode("ascii")
# A member's request that names no caller.
MEMBER = Identity("member")


class Callers:
    """The access check of a router or node: `authenticator` for its callers; on a node, `members` (whose
    requests are trusted: they checked their callers)."""

    def __init__(
        self, authenticator: Authenticator, members: ClusterAuth | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        """`clock`: the wall clock (seconds since the epoch) admin login sessions are made and expire by."""
        self.authenticator = authenticator
        self.members = members if members is not None and members.enabled else None
        self._certificates = authenticator.tokens is not None
        # What admin callers' login sessions are keyed by (the app sets the cluster's key; None: no logins).
        self.cluster_key: CursorKey | None = None
        self._clock = clock

    @property
    def jwks_fetch_failures(self) -> int:
        """JWKS fetches that failed (the last good keys kept), for the metrics."""
        jwt = self.authenticator.jwt
        return jwt.keys.fetch_failures if jwt is not None else 0

    def close(self) -> None:
        """Stop refreshing the signing keys (at shutdown)."""
        if self.authenticator.jwt is not None:
            self.authenticator.jwt.keys.close()

    def admit(self, call: Any, now: float) -> None:
        """Set `call.identity` to its caller's, who may read `call.store`: else raises Unauthorized or
        Forbidden. `now` (monotonic) is when to look at the token file again."""
        authenticator = self.authenticator
        authenticator.poll(now)
        request = call.request
        members = self.members
        if members is not None:
            if members.certificates:
                peer = peer_identity(call.transport)
                member = peer is not None
                if peer is not None:
                    check_member_headers(peer, request.header(_HOPS), request.header(_FORWARDED_BY))
            else:
                member = members.is_member(request.header(_MEMBER_AUTH))
        else:
            member = False
        if member:
            named = request.header(_CALLER)
            call.identity = MEMBER if not named else Identity(named.decode("latin-1")[:200])
            return
        authorization = request.header(_AUTHORIZATION)
        identity = None
        if authorization is None and self._certificates:
            identity = authenticator.certificate(certificate_names(call.transport))
        if identity is None:
            identity = authenticator.identify(authorization)
        call.identity = identity  # a 403 is counted under its caller too
        if not identity.may_read(call.store):
            # A read of several stores (keyroute.http.multi_store) names them joined by ',' (no store name holds
            # one): every one of them is checked.
            stores = call.store.split(",")
            refused = [store for store in stores if not identity.may_read(store)]
            if len(stores) == 1:
                raise Forbidden(f"{identity.name!r} may not read store {call.store!r}")
            if refused:
                raise Forbidden(f"{identity.name!r} may not read store(s) {', '.join(map(repr, refused))}")

    def of_scope(self, scope: Any) -> Identity:
        """The caller of an app request (say, /routing) by its ASGI `scope`: its Authorization header, else
        the client certificate of its connection (as a data-plane read's, `admit`). Unauthorized if none."""
        authorization = _authorization(scope["headers"])
        if authorization is None and self._certificates:
            transport = (scope.get("extensions") or {}).get(TRANSPORT_EXTENSION)
            identity = self.authenticator.certificate(certificate_names(transport))
            if identity is not None:
                return identity
        return self.identify(authorization)

    def identify(self, authorization: bytes | None) -> Identity:
        """The caller an Authorization header (raw) names, the token file looked at again if it is time."""
        authenticator = self.authenticator
        authenticator.poll(time.monotonic())
        return authenticator.identify(authorization)

    def _session_key(self) -> bytes | None:
        cluster_key = self.cluster_key.value if self.cluster_key is not None else None
        return caller_session_key(cluster_key) if cluster_key else None

    def login(self, token: bytes) -> str | None:
        """A session cookie's value for the token-file caller whose token is `token`, when it has `admin`;
        None otherwise (or while the cluster's key is not known: sessions are keyed by it)."""
        tokens, key = self.authenticator.tokens, self._session_key()
        if tokens is None or key is None:
            return None
        self.authenticator.poll(time.monotonic())
        identity = tokens.identify(token)
        if identity is None or not identity.admin:
            return None
        return caller_session(key, identity.name, hashlib.sha256(token).digest(), self._clock())

    def of_session(self, cookie: bytes | None) -> Identity | None:
        """The admin caller a session cookie (`login`'s) in a raw Cookie header names, while that caller's
        token is in the token file with `admin` and the cookie has not expired; else None."""
        tokens, key = self.authenticator.tokens, self._session_key()
        if tokens is None or key is None:
            return None
        session = read_caller_session(cookie_value(cookie, SESSION_COOKIE), self._clock())
        if session is None:
            return None
        name, valid = session
        self.authenticator.poll(time.monotonic())
        for digest, identity in tokens.tokens.by_digest.items():
            if identity.name == name and identity.admin and valid(key, digest):
                return identity
        return None


def _authorization(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in headers:
        if name == _AUTHORIZATION:
            return bytes(value)
    return None


def certificate_names(transport: Any) -> tuple[str, ...]:
    """The names a TLS client certificate presented on `transport` goes by: its subject alternative names
    (DNS, URI, email), then its subject CN. Parsed once per connection; () without a certificate."""
    if transport is None:
        return ()
    ssl_object = transport.get_extra_info("ssl_object")
    if ssl_object is None:
        return ()
    names = getattr(ssl_object, "_keyroute_names", None)
    if names is None:
        certificate = ssl_object.getpeercert() or {}
        found = [value for kind, value in certificate.get("subjectAltName", ()) if kind in ("DNS", "URI", "email")]
        for rdn in certificate.get("subject", ()):
            found += [value for key, value in rdn if key == "commonName"]
        names = ssl_object._keyroute_names = tuple(found)
    return names


def admin_paths(access: AccessSettings) -> tuple[str, ...]:
    """The paths only the admin token or an admin caller may use: /admin, and /metrics with
    --metrics-require-token, or with access control on unless --metrics-open (the metrics' labels name every
    store and caller, which a caller's 403s withhold)."""
    access_control = bool(access.access_tokens or access.jwt_issuer)
    closed = access.metrics_require_token or (access_control and not access.metrics_open)
    return ("/admin", "/metrics") if closed else ("/admin",)


def callers_of(
    access: AccessSettings,
    members: ClusterAuth,
    name: str,
    trust_members: bool,
    clock: Callable[[], float] = time.time,
) -> Callers | None:
    """The access check `access` configures (None: none, every caller may read every store), said in one log
    line by the process `name` (a node: `trust_members`, whose requests `members` tells). StartupError (one
    line) for files that do not load, or without a way for members to prove themselves to nodes. `clock`: the
    wall clock of admin login sessions."""
    if not access.access_tokens and not access.jwt_issuer:
        log.info(
            "%s: access control is off: every caller may read every store (no --access-tokens, --jwt-issuer)", name
        )
        return None
    if not members.enabled:
        raise StartupError(
            "access control needs --cluster-secret or --member-ca: nodes trust the callers routers and other "
            "nodes pass on only from members that prove themselves"
        )
    try:
        tokens = TokenFile(access.access_tokens) if access.access_tokens else None
        jwt = _jwt(access) if access.jwt_issuer else None
    except AuthnError as exc:
        raise StartupError(str(exc)) from None
    authenticator = Authenticator(tokens, jwt)
    if jwt is not None:
        jwt.keys.start()
    log.info("%s: access control is on: callers identified by %s", name, authenticator.describe())
    return Callers(authenticator, members if trust_members else None, clock)


def fetch_jwks(url: str) -> Callable[[FetchDeadline], bytes]:
    """What fetches the JWKS at `url` (https://, or http:// where allowed) within a deadline: on an event loop
    of its own (a thread of its own when called on a running loop, as at start-up), the whole fetch cancelled
    when the deadline passes, and the body checked against it piece by piece as it arrives."""

    async def fetch(deadline: FetchDeadline) -> bytes:
        what = f"the JWKS at {url}"
        try:
            async with (
                asyncio.timeout(deadline.remaining()),
                httpx.AsyncClient(timeout=httpx.Timeout(deadline.remaining()), follow_redirects=False) as client,
                client.stream("GET", url, headers={"accept": "application/json"}) as answer,
            ):
                if answer.status_code != 200:
                    raise AuthnError(f"{what} answered HTTP {answer.status_code}")
                received = bytearray()
                async for chunk in answer.aiter_bytes():
                    deadline.collect(received, chunk, what)
                return bytes(received)
        except TimeoutError:
            raise deadline.passed(what) from None
        except httpx.HTTPError as exc:
            raise AuthnError(f"{what} could not be fetched: {type(exc).__name__}: {str(exc)[:200]}") from None

    def run(deadline: FetchDeadline) -> bytes:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(fetch(deadline))
        with ThreadPoolExecutor(1, thread_name_prefix="jwks-fetch") as pool:
            return pool.submit(asyncio.run, fetch(deadline)).result()

    return run


def read_jwks_file(path: str) -> Callable[[FetchDeadline], bytes]:
    """What reads the JWKS file `path` (local: no deadline to keep)."""

    def read(deadline: FetchDeadline) -> bytes:
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as exc:
            raise AuthnError(f"cannot read the JWKS file {path}: {exc.strerror or exc}") from None

    return read


def _jwt(access: AccessSettings) -> JwtVerifier:
    if bool(access.jwt_jwks_url) == bool(access.jwt_jwks_file):
        raise AuthnError("--jwt-issuer needs one of --jwt-jwks-url or --jwt-jwks-file")
    if access.jwt_jwks_url:
        url = access.jwt_jwks_url
        check_jwks_url(url, access.jwt_jwks_allow_http)
        load_keys, source = fetch_jwks(url), f"the JWKS at {url}"
    else:
        load_keys, source = read_jwks_file(access.jwt_jwks_file), f"the JWKS file {access.jwt_jwks_file}"

    groups = None
    if access.jwt_groups_claim:
        if not access.jwt_groups_file:
            raise AuthnError("--jwt-groups-claim needs --jwt-groups-file (which stores each group may read)")
        groups = parse_groups(read_document(access.jwt_groups_file, "group mapping"), access.jwt_groups_file)
    policy = JwtPolicy(
        access.jwt_issuer,
        access.jwt_audience,
        stores_claim=access.jwt_stores_claim or DEFAULT_STORES_CLAIM,
        groups_claim=access.jwt_groups_claim,
        groups=groups or {},
    )
    return JwtVerifier(policy, SigningKeys(load_keys, refresh_s=access.jwt_jwks_refresh_s, source=source))


__all__ = ["HEADER_CALLER", "MEMBER", "Callers", "Unauthorized", "callers_of", "certificate_names"]
