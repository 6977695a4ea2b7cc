"""Who may steer forwarding (cluster members) and who may read admin endpoints (holders of a bearer token).

Two ways to tell members, chosen per cluster:
- a shared cluster secret: one Kubernetes Secret mounted as KEYROUTE_CLUSTER_SECRET into routers and nodes,
  no certificate authority; members send a token derived from it (`ClusterAuth`). Members' traffic is then
  plain HTTP: anyone who can sniff pod traffic sees values and the token, and can replay it; every member
  presents the same token, so one compromised pod speaks for all. Run inside a private network
  (NetworkPolicy). Rotation: each member accepts a list of secrets and sends with the first.
- mutual TLS (`--member-ca`): traffic between members is encrypted, and a member is told by its certificate:
  one of the member CA that names a role and an id (`member_identity`: node n1, router r1) is that member
  and nothing more: a router's may not forward as a node, node n1's may not speak for node n2
  (`check_member_headers`); the token is then not looked at. Certificates are rotated in place, without a
  restart (keyroute.http.tls).
Either check is cheap enough for every proxied read: a constant-time compare of precomputed bytes, or the
role of the connection's peer certificate, read once per connection.

Admin access: the admin token as `Authorization: Bearer`, or a browser's session cookie (`keyroute_admin`)
set by POST /admin/login: not the token but an expiry and a MAC of it keyed by the token, so the cookie
neither reveals the token nor outlives its expiry or the token's removal from the list. With access control,
a token-file caller with `admin = true` logs in too: its cookie names the caller and carries a MAC of the
expiry, the name and its token's digest, keyed by a key every router and node shares (derived from the
cluster's key in ZooKeeper, keyroute.auth.cursor_key), so it is good on every member, and never outlives the
caller's token, its `admin`, or its expiry (`caller_session`, `read_caller_session`).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from keyroute.api import Forbidden, Unauthorized

# The token members present is derived from the secret, so the secret itself never travels and one secret
# can later derive other tokens (say, a versioned one) without them being interchangeable.
_MEMBER_TOKEN_CONTEXT = b"keyroute member token v1"


_SESSION_CONTEXT = b"keyroute admin session v1"
# The admin session cookie: its name, and how long one login lasts.
SESSION_COOKIE = "keyroute_admin"
SESSION_LIFETIME_S = 12 * 3600


def split_secrets(text: str) -> tuple[str, ...]:
    """A comma-separated list of secrets (the first one in use, the others still accepted during a
    rotation), surrounding spaces and empty entries dropped. "" gives none."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def member_token(secret: str) -> str:
    """The `x-keyroute-auth` value every member holding `secret` sends: HMAC-SHA256 of a fixed context."""
    return hmac.new(secret.encode("utf-8"), _MEMBER_TOKEN_CONTEXT, hashlib.sha256).hexdigest()


# A member certificate names its role and its id in a subject alternative name: a DNS name whose first label
# is the role's and whose second is the id, in a domain of the operator's choice (`keyroute-node.n1.cluster`,
# `keyroute-router.r1.cluster`), or a SPIFFE URI (`spiffe://example.org/keyroute/node/n1`).
MEMBER_ROLES = ("router", "node")
_ROLE_BY_DNS_LABEL = {f"keyroute-{role}": role for role in MEMBER_ROLES}
_SPIFFE_PATH = "/keyroute/"
# A DNS label (RFC 1123): what a node id in a DNS name can be; a SPIFFE path segment may hold more.
_DNS_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
_SPIFFE_SEGMENT = re.compile(r"[A-Za-z0-9._-]+")


@dataclass(frozen=True, slots=True)
class MemberIdentity:
    """What a member certificate names: its `role` ("router" or "node") and the member's `id` (a node's
    --node-id, a router's --router-id). A certificate grants exactly this identity, nothing beyond it."""

    role: str
    id: str

    def __str__(self) -> str:
        return f"{self.role} {self.id}"


def _role_claim(kind: str, value: str) -> MemberIdentity | str | None:
    """The identity one subject alternative name claims; "" for a name that claims a member role but is
    malformed (no id, no domain after it, an id that is no DNS label); None for a name that claims none."""
    if kind == "DNS":
        labels = value.split(".")
        role = _ROLE_BY_DNS_LABEL.get(labels[0].lower())
        if role is None:
            return None
        if len(labels) < 3 or not all(labels[2:]) or _DNS_LABEL.fullmatch(labels[1]) is None:
            return ""
        return MemberIdentity(role, labels[1])
    if kind == "URI" and value.startswith("spiffe://"):
        domain, slash, path = value[len("spiffe://") :].partition("/")
        if not (slash + path).startswith(_SPIFFE_PATH):
            return None
        role, _, name = path[len(_SPIFFE_PATH) - 1 :].partition("/")
        if not domain or role not in MEMBER_ROLES or _SPIFFE_SEGMENT.fullmatch(name) is None:
            return ""
        return MemberIdentity(role, name)
    return None


def _claims(certificate: dict[str, Any] | None) -> tuple[set[MemberIdentity | str], set[MemberIdentity | str]]:
    """The member identities a certificate's names claim: (by SPIFFE URIs, by DNS names)."""
    uris: set[MemberIdentity | str] = set()
    dns: set[MemberIdentity | str] = set()
    if not certificate:
        return uris, dns
    for kind, value in certificate.get("subjectAltName", ()):
        claim = _role_claim(kind, value)
        if claim is not None:
            (dns if kind == "DNS" else uris).add(claim)
    return uris, dns


def member_identity(certificate: dict[str, Any] | None) -> MemberIdentity | None:
    """The member identity a peer certificate (as `ssl.SSLObject.getpeercert()` gives it) names in its
    subject alternative names, or None: no member role named, a malformed one, or names of two identities
    (a certificate is one member). A SPIFFE ID, when the certificate has one for keyroute, is the identity
    and its DNS names are then host names only (a Service named keyroute-router.NAMESPACE.svc is not a
    router's id); without one, its DNS names are. Its chain is for the TLS handshake (and
    `keyroute.http.tls`) to check."""
    uris, dns = _claims(certificate)
    claims = uris or dns
    if len(claims) != 1:
        return None
    [claim] = claims
    return claim if isinstance(claim, MemberIdentity) else None


def names_member_role(certificate: dict[str, Any] | None) -> bool:
    """Whether a certificate claims a member role at all, well formed or not (what a client's may not)."""
    uris, dns = _claims(certificate)
    return bool(uris or dns)


def member_role(certificate: dict[str, Any] | None) -> str | None:
    """The role ("router" or "node") of `member_identity(certificate)`, or None."""
    identity = member_identity(certificate)
    return identity.role if identity is not None else None


def check_member_headers(identity: MemberIdentity, hops: bytes | None, forwarded_by: bytes | None) -> None:
    """Raises Forbidden when a member's request carries member headers its certificate's `identity` may not
    send: a hop count or `X-Keyroute-Forwarded-By` (what a forwarding node sends) from a router, or a node
    naming another node as the one forwarding. `hops`, `forwarded_by`: the raw header values (None: absent)."""
    if identity.role == "router":
        if hops is not None or forwarded_by is not None:
            raise Forbidden(f"the certificate of {identity} may not forward as a node (x-keyroute-hops)")
    elif forwarded_by is not None and forwarded_by.decode("latin-1") != identity.id:
        raise Forbidden(
            f"the certificate of {identity} may not speak for node {forwarded_by.decode('latin-1')[:100]!r}"
        )


class ClusterAuth:
    """Tells a cluster member's request from a client's by its `x-keyroute-auth` header.

    Without a secret (local demo, tests) every request counts as a member's: member headers are
    honoured from anyone, which lets any client that reaches a node stop it from forwarding. With one,
    only requests carrying the token do; everything else is a client request whose member headers are
    ignored. `secret` may be a comma-separated list (a rotation): a member sends the first one's token and
    accepts the token of any. With `certificates` (mutual TLS between members), a request is a member's
    when its TLS peer's certificate names a member identity (`role`, from `member_role`), whatever the
    token; what that member may send is `check_member_headers`'s.
    """

    __slots__ = ("enabled", "token", "certificates", "_accepted")

    def __init__(self, secret: str = "", certificates: bool = False) -> None:
        secrets = split_secrets(secret)
        self.enabled = bool(secrets) or certificates
        self.certificates = certificates
        self.token = member_token(secrets[0]) if secrets else ""
        self._accepted = tuple(member_token(s).encode("ascii") for s in secrets)

    def is_member(self, presented: str | bytes | None, role: str | None = None) -> bool:
        """Whether a request is a member's: by the token it `presented`, or (with certificates) by the
        `role` its peer's certificate names."""
        if self.certificates:
            return role in MEMBER_ROLES
        if not self.enabled:
            return True
        if presented is None:
            return False
        if isinstance(presented, str):
            # Header values arrive as latin-1 text; compare_digest refuses non-ASCII str, so compare bytes.
            presented = presented.encode("latin-1", "replace")
        # Every accepted token is compared (no early exit): the time taken says nothing of which matched.
        found = False
        for token in self._accepted:
            found |= hmac.compare_digest(presented, token)
        return found

    def headers(self) -> dict[str, str]:
        """What a member adds to every request it sends to another member."""
        return {"x-keyroute-auth": self.token} if self.enabled else {}


def _session_mac(token: bytes, expires: int) -> str:
    return hmac.new(token, _SESSION_CONTEXT + b"|%d" % expires, hashlib.sha256).hexdigest()


class BearerAuth:
    """Admin access: `Authorization: Bearer <token>`, or the session cookie a login set; disabled
    (everything allowed) without a token. `token` may be a comma-separated list (a rotation): any of them
    is accepted, and a session cookie made from the first one. `clock` (seconds since the epoch) is for
    tests."""

    __slots__ = ("enabled", "_expected", "_clock")

    def __init__(self, token: str = "", clock: Callable[[], float] = time.time) -> None:
        tokens = split_secrets(token)
        self.enabled = bool(tokens)
        self._expected = tuple(t.encode("utf-8") for t in tokens)
        self._clock = clock

    def accepts(self, presented: bytes) -> bool:
        """Whether `presented` is one of the admin tokens (each compared in constant time, no early exit)."""
        found = False
        for expected in self._expected:
            found |= hmac.compare_digest(presented, expected)
        return found

    def session(self) -> str:
        """A new session cookie's value: its expiry and a MAC of it keyed by the (first) admin token."""
        expires = int(self._clock()) + SESSION_LIFETIME_S
        return f"{expires}.{_session_mac(self._expected[0], expires)}" if self.enabled else ""

    def valid_session(self, value: bytes | str | None) -> bool:
        """Whether a session cookie's value was made by `session` with one of the tokens and has not expired."""
        if not self.enabled or not value:
            return False
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        expiry, dot, mac = text.strip().partition(".")
        if not dot or not expiry.isdigit() or len(expiry) > 12 or int(expiry) <= self._clock():
            return False
        presented = mac.encode("latin-1", "replace")
        found = False
        for token in self._expected:
            found |= hmac.compare_digest(presented, _session_mac(token, int(expiry)).encode("ascii"))
        return found

    def check(self, authorization: bytes | None, cookie: bytes | None = None) -> None:
        """Raises Unauthorized unless `authorization` (the raw header value) carries an admin token or the
        `cookie` header a valid session cookie."""
        if not self.enabled:
            return
        if authorization is None:
            if self.valid_session(cookie_value(cookie, SESSION_COOKIE)):
                return
            raise Unauthorized(
                "this endpoint needs an `Authorization: Bearer <admin token>` header or a login at /admin/login",
                invalid_token=cookie_value(cookie, SESSION_COOKIE) is not None,
            )
        scheme, _, presented = authorization.strip().partition(b" ")
        # The scheme is case-insensitive (RFC 9110 section 11.1); the token is compared in constant time.
        if scheme.lower() != b"bearer" or not self.accepts(presented.strip()):
            raise Unauthorized("the bearer token is not the admin token", invalid_token=True)


_CALLER_SESSION_CONTEXT = b"keyroute caller session v1"
_CALLER_SESSION_KEY_CONTEXT = b"keyroute caller session key v1"
_CALLER_SESSION_PREFIX = "c1"


def caller_session_key(cluster_key: bytes) -> bytes:
    """The key caller sessions are signed with, derived from the cluster's key (never used as it is)."""
    return hmac.new(cluster_key, _CALLER_SESSION_KEY_CONTEXT, hashlib.sha256).digest()


def _caller_mac(key: bytes, name: str, digest: bytes, expires: int) -> str:
    message = b"|".join((_CALLER_SESSION_CONTEXT, b"%d" % expires, digest, name.encode("utf-8")))
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def caller_session(key: bytes, name: str, digest: bytes, now: float) -> str:
    """A session cookie's value for the caller `name`, whose token's SHA-256 is `digest`: it lasts
    SESSION_LIFETIME_S from `now` (seconds since the epoch)."""
    expires = int(now) + SESSION_LIFETIME_S
    encoded = base64.urlsafe_b64encode(name.encode("utf-8")).rstrip(b"=").decode("ascii")
    return f"{_CALLER_SESSION_PREFIX}.{expires}.{encoded}.{_caller_mac(key, name, digest, expires)}"


def read_caller_session(value: str | None, now: float) -> tuple[str, Callable[[bytes, bytes], bool]] | None:
    """(the caller a session cookie's value names, what checks it given the session key and that caller's
    token digest), or None for a value that is no caller session or has expired."""
    if not value:
        return None
    parts = value.strip().split(".")
    if len(parts) != 4 or parts[0] != _CALLER_SESSION_PREFIX or not parts[1].isdigit() or len(parts[1]) > 12:
        return None
    expires = int(parts[1])
    if expires <= now or len(parts[2]) > 400:
        return None
    try:
        name = base64.urlsafe_b64decode(parts[2] + "=" * (-len(parts[2]) % 4)).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return None
    presented = parts[3].encode("latin-1", "replace")

    def valid(key: bytes, digest: bytes) -> bool:
        return hmac.compare_digest(presented, _caller_mac(key, name, digest, expires).encode("ascii"))

    return name, valid


def cookie_value(header: bytes | None, name: str) -> str | None:
    """The value of cookie `name` in a raw `Cookie` header (the first one), None when absent."""
    if not header:
        return None
    wanted = name.encode("ascii")
    for pair in header.split(b";"):
        key, eq, value = pair.strip().partition(b"=")
        if eq and key == wanted:
            return value.strip().strip(b'"').decode("latin-1")
    return None
