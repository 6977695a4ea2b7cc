"""Fuzzed credentials against the real access check (keyroute.http.authn.Callers over keyroute.auth.authn's
token file and JWT verifier) in front of the real data-plane skeleton, for every read kind: malformed, huge,
unicode and binary Authorization headers, JWTs with any algorithm (`none`, HS256 signed with the issuer's
public key, another key's), any issuer, audience, times and stores. Never a 5xx, and never a read without
permission: a handler runs only for the credentials that grant its store."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from keyroute.auth.authn import Authenticator, FetchDeadline, JwtPolicy, JwtVerifier, SigningKeys, TokenFile
from keyroute.auth.security import ClusterAuth
from keyroute.http.admission import Admission
from keyroute.http.authn import Callers
from keyroute.http.dataplane import JSON, Call, Route, RoutedDataPlane, store_routes
from keyroute.http.exchange import Request

EXAMPLES = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ISSUER, AUDIENCE = "https://issuer.test", "keyroute"
GOOD = rsa.generate_private_key(public_exponent=65537, key_size=2048)
ROGUE = rsa.generate_private_key(public_exponent=65537, key_size=2048)
EC_ROGUE = ec.generate_private_key(ec.SECP256R1())
PUBLIC_PEM = GOOD.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
TOKEN_A = "tok-a"
SECRET = "cluster-secret"

_folder = Path(tempfile.mkdtemp(prefix="authn-fuzz-"))
(_folder / "tokens.toml").write_text(
    f'[[tokens]]\nname = "a"\ntoken = "{TOKEN_A}"\nstores = ["a"]\n\n'
    '[[tokens]]\nname = "b"\ntoken = "tok-b"\nstores = ["b"]\n',
    encoding="utf-8",
)
_jwks = {"keys": [{**json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(GOOD.public_key())), "kid": "k1"}]}
_fetches: list[FetchDeadline] = []  # every JWKS fetch: the one at start, and none on a read's path
AUTHENTICATOR = Authenticator(
    TokenFile(str(_folder / "tokens.toml")),
    JwtVerifier(
        JwtPolicy(ISSUER, AUDIENCE),
        SigningKeys(lambda deadline: _fetches.append(deadline) or json.dumps(_jwks).encode(), refresh_s=3600),
    ),
)
CALLERS = Callers(AUTHENTICATOR, ClusterAuth(SECRET))


class Plane(RoutedDataPlane):
    """Every read kind, each answering 200 with whom it read for: reached only past the access check."""

    def __init__(self) -> None:
        super().__init__(Admission(max_concurrent_requests=0), lambda *counted: None)
        self.callers = CALLERS
        self.reads: list[tuple[str, str]] = []

    def _read(self, call: Call, store: str, *rest: str) -> None:
        assert call.identity is not None
        self.reads.append((store, call.identity.name))
        call.answer(200, list(JSON), b"{}")

    routes = store_routes(
        _read,
        _read,
        _read,
        _read,
        Route("/stores/{store}/range", ("GET",), _read),
        Route("/stores/{store}/schema", ("GET",), _read),
    )


PATHS = [
    ("GET", "/stores/{s}/keys/k1"),
    ("GET", "/stores/{s}/keys/k%2F1/history"),
    ("GET", "/stores/{s}/keys/k1/windows"),
    ("POST", "/stores/{s}/batch-get"),
    ("GET", "/stores/{s}/range"),
    ("GET", "/stores/{s}/schema"),
]


class StandInExchange:
    def __init__(self, method: str, path: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        self.request = Request(method, path, b"", headers, b'{"keys": ["k"]}', "rid", "1.1")
        self.answers: list[tuple[int, Any, bytes]] = []
        self.gone = False
        self._on_done: Any = None
        self.transport = None  # no TLS: no peer certificate

    def answer(self, status: int, headers: Any, body: bytes) -> None:
        self.answers.append((status, headers, body))
        if self._on_done is not None:
            self._on_done()


@st.composite
def jwts(draw: st.DrawFn) -> tuple[bytes, frozenset[str] | None]:
    """A JWT and the stores it should grant (None: it must be refused)."""
    now = int(time.time())
    key_name = draw(st.sampled_from(["good", "rogue", "ec", "hs-public", "none"]))
    kid = draw(st.sampled_from(["k1", "k2", None]))
    iss = draw(st.sampled_from([ISSUER, "https://evil.test", None]))
    aud = draw(st.sampled_from([AUDIENCE, "other", None]))
    exp = draw(st.sampled_from([now + 600, now - 600, None, "soon"]))
    nbf = draw(st.sampled_from([None, now - 10, now + 600]))
    sub = draw(st.sampled_from(["svc", "", None, 7]))
    stores = draw(st.sampled_from([["a"], ["b"], "*", "a b", [], None, 3, ["a", 4]]))
    claims = {"iss": iss, "aud": aud, "exp": exp, "nbf": nbf, "sub": sub, "keyroute_stores": stores}
    claims = {k: v for k, v in claims.items() if v is not None}
    headers = {"kid": kid} if kid else {}
    if key_name == "good":
        text = jwt.encode(claims, GOOD, algorithm="RS256", headers=headers)
    elif key_name == "rogue":
        text = jwt.encode(claims, ROGUE, algorithm="RS256", headers=headers)
    elif key_name == "ec":
        text = jwt.encode(claims, EC_ROGUE, algorithm="ES256", headers=headers)
    elif key_name == "hs-public":
        forger = jwt.api_jws.PyJWS()
        forger._algorithms["HS256"].prepare_key = lambda key: key  # type: ignore[attr-defined]
        text = forger.encode(json.dumps(claims).encode(), PUBLIC_PEM, algorithm="HS256", headers=headers)
    else:
        text = jwt.encode(claims, None, algorithm="none", headers=headers)
    valid = (
        key_name == "good"
        and kid in ("k1", None)
        and iss == ISSUER
        and aud == AUDIENCE
        and exp == now + 600
        and nbf != now + 600
        and sub == "svc"
    )
    granted: frozenset[str] | None = None
    if valid:
        granted = frozenset({"a", "b"}) if stores == "*" else frozenset({"a"}) if stores in (["a"], "a b") else None
        if stores == ["b"]:
            granted = frozenset({"b"})
    if draw(st.booleans()):  # tampered: one character of the signature changed
        head, _, signature = text.rpartition(".")
        if signature:
            flipped = "A" if signature[-1] != "A" else "B"
            text, granted = f"{head}.{signature[:-1]}{flipped}", None
    return b"Bearer " + text.encode(), granted


headers_values = st.one_of(
    st.just(None),
    st.binary(max_size=200),
    st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.text(max_size=100).map(lambda t: b"Bearer " + t.encode("utf-8", "surrogatepass")),
    st.binary(min_size=15_000, max_size=40_000).map(lambda b: b"Bearer " + b),
    st.sampled_from(
        [b"Bearer tok-a", b"bearer tok-a", b"Bearer tok-b", b"Bearer tok-a ", b"Bearer tok-", b"Basic tok-a"]
    ),
    st.sampled_from(["Bearer tök-a", "Bearer 東京", "Bearer a.b.c", "Bearer ..", "Bearer e30.e30.", "Bearer \x00"]).map(
        lambda t: t.encode("utf-8")
    ),
)


def expected_stores(authorization: bytes | None) -> frozenset[str] | None:
    """The stores a static token grants (None: none)."""
    if authorization is None or authorization[:7].lower() != b"bearer ":
        return None
    return {b"tok-a": frozenset({"a"}), b"tok-b": frozenset({"b"})}.get(authorization[7:].strip())


def check(authorization: bytes | None, granted: frozenset[str] | None, member: bool = False) -> None:
    for store in ("a", "b"):
        for method, path in PATHS:
            plane = Plane()
            headers = [(b"host", b"x")]
            if authorization is not None:
                headers.append((b"authorization", authorization))
            if member:
                headers.append((b"x-keyroute-auth", ClusterAuth(SECRET).token.encode()))
            exchange = StandInExchange(method, path.format(s=store).encode(), headers)
            plane.handle(exchange)  # type: ignore[arg-type]
            ((status, answer_headers, body),) = exchange.answers
            assert status < 500, (status, body)
            allowed = member or (granted is not None and store in granted)
            if allowed:
                assert status == 200 and plane.reads == [(store, plane.reads[0][1])], (status, body)
            else:
                assert status in (401, 403) and plane.reads == [], (status, body, authorization)
                assert json.loads(body)["error"] == ("unauthorized" if status == 401 else "forbidden")
                if status == 401:
                    assert dict(answer_headers)[b"www-authenticate"].startswith(b"Bearer")
    # Whatever a caller sent (an unknown key id included), the keys were not fetched on the read's path.
    assert len(_fetches) == 1


@EXAMPLES
@given(headers_values)
@example(b"Bearer tok-a")
@example(b"Bearer " + b"\xff" * 20)
def test_no_header_reads_without_permission_or_answers_5xx(authorization: bytes | None) -> None:
    check(authorization, expected_stores(authorization))


@EXAMPLES
@given(jwts())
def test_only_a_jwt_signed_by_the_issuers_key_with_valid_claims_reads_its_stores(
    pair: tuple[bytes, frozenset[str] | None],
) -> None:
    check(*pair)


@settings(max_examples=30, deadline=None)
@given(headers_values)
def test_a_members_read_is_trusted_whatever_it_carries(authorization: bytes | None) -> None:
    check(authorization, None, member=True)
