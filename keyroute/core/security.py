"""Who may steer forwarding (cluster members) and who may read admin endpoints (holders of a bearer token).

Both checks are a constant-time compare of precomputed bytes: cheap enough for every proxied read.

Why a shared cluster secret and not mutual TLS between members:
- operations stay simple: one Kubernetes Secret mounted as KEYROUTE_CLUSTER_SECRET into routers and nodes,
  no certificate authority, no issuing, no rotation before expiry, no reload of certificates in flight;
- pods keep talking plain HTTP (also over loopback in tests and the demo), so the data path keeps its
  lean HTTP/1.1 client and costs no TLS handshakes or record encryption per read;
- the check is one `hmac.compare_digest` per request, far inside the router's per-request CPU budget.
What we give up, and mTLS would give: members' traffic is not encrypted (anyone who can sniff pod
traffic sees values and the member token, and can then replay it), there is no per-member identity (every
member presents the same token, so one compromised pod speaks for all), and rotation means restarting
every member with the new secret. Run inside a private network (NetworkPolicy) and add a mesh with mTLS if
pod traffic itself must be protected.
"""

from __future__ import annotations

import hashlib
import hmac

from keyroute.core.api import Unauthorized

# The token members present is derived from the secret, so the secret itself never travels and one secret
# can later derive other tokens (say, a versioned one) without them being interchangeable.
_MEMBER_TOKEN_CONTEXT = b"keyroute member token v1"


def member_token(secret: str) -> str:
    """The `x-keyroute-auth` value every member holding `secret` sends: HMAC-SHA256 of a fixed context."""
    return hmac.new(secret.encode("utf-8"), _MEMBER_TOKEN_CONTEXT, hashlib.sha256).hexdigest()


class ClusterAuth:
    """Tells a cluster member's request from a client's by its `x-keyroute-auth` header.

    Without a secret (local demo, tests) every request counts as a member's: member headers are
    honoured from anyone, which lets any client that reaches a node stop it from forwarding. With one,
    only requests carrying the token do; everything else is a client request whose member headers are
    ignored.
    """

    __slots__ = ("enabled", "token", "_token_bytes")

    def __init__(self, secret: str = "") -> None:
        self.enabled = bool(secret)
        self.token = member_token(secret) if secret else ""
        self._token_bytes = self.token.encode("ascii")

    def is_member(self, presented: str | bytes | None) -> bool:
        if not self.enabled:
            return True
        if presented is None:
            return False
        if isinstance(presented, str):
            # Header values arrive as latin-1 text; compare_digest refuses non-ASCII str, so compare bytes.
            presented = presented.encode("latin-1", "replace")
        return hmac.compare_digest(presented, self._token_bytes)

    def headers(self) -> dict[str, str]:
        """What a member adds to every request it sends to another member."""
        return {"x-keyroute-auth": self.token} if self.enabled else {}


class BearerAuth:
    """`Authorization: Bearer <token>` for admin endpoints; disabled (everything allowed) without a token."""

    __slots__ = ("enabled", "_expected")

    def __init__(self, token: str = "") -> None:
        self.enabled = bool(token)
        self._expected = token.encode("utf-8")

    def check(self, authorization: bytes | None) -> None:
        """Raises Unauthorized unless `authorization` (the raw header value) carries the token."""
        if not self.enabled:
            return
        if authorization is None:
            raise Unauthorized("this endpoint needs an `Authorization: Bearer <admin token>` header")
        scheme, _, presented = authorization.strip().partition(b" ")
        # The scheme is case-insensitive (RFC 9110 section 11.1); the token is compared in constant time.
        if scheme.lower() != b"bearer" or not hmac.compare_digest(presented.strip(), self._expected):
            raise Unauthorized("the bearer token is not the admin token", invalid_token=True)
