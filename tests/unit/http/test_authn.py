"""The access check as routers and nodes build it (keyroute.http.authn.callers_of): off without a token file or a
JWT issuer, a one-line start-up error for what does not load (an http:// JWKS URL unless allowed) or for a
cluster whose members cannot prove themselves; /admin open to an admin caller and closed to the others
(keyroute.http.admission); a JWKS fetched from a real server, a trickled one abandoned at its deadline."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from keyroute.api import Forbidden, Unauthorized
from keyroute.auth.authn import SigningKeys
from keyroute.auth.cursor_key import CursorKey
from keyroute.auth.security import SESSION_COOKIE, SESSION_LIFETIME_S, BearerAuth, ClusterAuth
from keyroute.http.admission import Admission
from keyroute.http.authn import callers_of, fetch_jwks
from keyroute.http.lifespan import StartupError
from keyroute.runtime.settings import AccessSettings
from tests.jwks_server import JwksServer
from tests.util import wait_for

MEMBERS = ClusterAuth("s3cret")


@pytest.fixture
def tokens(tmp_path: Path) -> str:
    path = tmp_path / "tokens.toml"
    path.write_text(
        '[[tokens]]\nname = "ops"\ntoken = "t-ops"\nstores = "*"\nadmin = true\n\n'
        '[[tokens]]\nname = "reader"\ntoken = "t-reader"\nstores = ["a"]\n'
    )
    return str(path)


def test_without_tokens_or_an_issuer_access_control_is_off_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        assert callers_of(AccessSettings(), ClusterAuth(), "router", trust_members=False) is None
    assert "access control is off" in caplog.text


@pytest.mark.parametrize(
    ("access", "members", "says"),
    [
        (AccessSettings(access_tokens="{tokens}"), ClusterAuth(), "needs --cluster-secret or --member-ca"),
        (AccessSettings(access_tokens="/nowhere/tokens.toml"), MEMBERS, "cannot read the token file"),
        (AccessSettings(jwt_issuer="https://i.test"), MEMBERS, "one of --jwt-jwks-url or --jwt-jwks-file"),
        (
            AccessSettings(jwt_issuer="https://i.test", jwt_jwks_file="/nowhere/jwks.json"),
            MEMBERS,
            "cannot read the JWKS file",
        ),
        (
            AccessSettings(
                jwt_issuer="https://i.test", jwt_jwks_url="http://127.0.0.1:9/jwks", jwt_jwks_allow_http=True
            ),
            MEMBERS,
            "could not be fetched",
        ),
        (
            AccessSettings(jwt_issuer="https://i.test", jwt_jwks_url="https://127.0.0.1:9/jwks"),
            MEMBERS,
            "could not be fetched",
        ),
        (
            AccessSettings(jwt_issuer="https://i.test", jwt_jwks_url="http://issuer.test/jwks"),
            MEMBERS,
            r"is http://: signing keys are fetched over https:// only \(--jwt-jwks-allow-http",
        ),
        (
            AccessSettings(jwt_issuer="https://i.test", jwt_jwks_url="issuer.test/jwks"),
            MEMBERS,
            "is not an https:// URL",
        ),
    ],
)
def test_what_does_not_load_stops_the_start_in_one_line(
    tokens: str, access: AccessSettings, members: ClusterAuth, says: str
) -> None:
    if access.access_tokens == "{tokens}":
        access = AccessSettings(access_tokens=tokens)
    with pytest.raises(StartupError, match=says) as refused:
        callers_of(access, members, "node n1", trust_members=True)
    assert "\n" not in str(refused.value)


def test_admin_takes_the_admin_token_or_an_admin_caller_and_refuses_the_others(tokens: str) -> None:
    callers = callers_of(AccessSettings(access_tokens=tokens), MEMBERS, "router", trust_members=False)
    for admin_token in ("", "the-admin-token"):
        admission = Admission(admin=BearerAuth(admin_token))
        admission.identify_admins(callers)

        def admit(*headers: tuple[bytes, bytes], admission: Admission = admission) -> object:
            refusal = admission.admit_head("/admin/partition-map", 30, list(headers))
            if refusal is None:
                admission.release()
            return refusal

        assert admit((b"authorization", b"Bearer t-ops")) is None
        assert isinstance(admit((b"authorization", b"Bearer t-reader")), Forbidden)
        assert isinstance(admit((b"authorization", b"Bearer nobody")), Unauthorized)
        assert isinstance(admit(), Unauthorized)
        if admin_token:
            assert admit((b"authorization", b"Bearer the-admin-token")) is None
        assert admission.admit_head("/healthz", 10, []) is None  # outside /admin: no credentials needed
        admission.release()


def test_a_jwks_url_is_read_whole_even_from_a_running_loop_and_a_trickled_one_is_abandoned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = {**json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key())), "kid": "k1"}
    with JwksServer([jwk], trickle_interval_s=0.5) as server:
        keys = SigningKeys(fetch_jwks(server.url), deadline_s=2, source=f"the JWKS at {server.url}")

        async def at_start() -> None:
            keys.load()  # as a router's or node's start-up does: on its event loop

        asyncio.run(at_start())
        assert list(keys.current) == ["k1"] and server.counts() == (1, 1, 0)
        server.trickle = True
        with caplog.at_level(logging.WARNING):
            assert keys.refresh() is False
        assert list(keys.current) == ["k1"] and keys.fetch_failures == 1
        wait_for(lambda: server.counts() == (2, 1, 1), timeout_s=30, message="the trickled fetch abandoned")
        assert "2 s deadline: abandoned" in caplog.text


def test_an_admin_callers_session_lasts_as_long_as_its_token_its_admin_and_its_expiry(tokens: str) -> None:
    now = [1_700_000_000.0]
    callers = callers_of(
        AccessSettings(access_tokens=tokens), MEMBERS, "router", trust_members=False, clock=lambda: now[0]
    )
    assert callers is not None
    assert callers.login(b"t-ops") is None  # the cluster's key not known yet: no sessions
    callers.cluster_key = CursorKey(b"k" * 32)
    assert callers.login(b"t-reader") is None and callers.login(b"nope") is None  # no admin; no caller
    value = callers.login(b"t-ops")
    assert value is not None and "t-ops" not in value
    cookie = f"other=1; {SESSION_COOKIE}={value}".encode()
    identity = callers.of_session(cookie)
    assert identity is not None and identity.name == "ops" and identity.admin
    # Another MAC, or another cluster's key, makes no session.
    altered = cookie[:-4] + (b"0000" if not cookie.endswith(b"0000") else b"1111")
    assert callers.of_session(altered) is None
    callers.cluster_key = CursorKey(b"j" * 32)
    assert callers.of_session(cookie) is None
    callers.cluster_key = CursorKey(b"k" * 32)
    # It expires...
    now[0] += SESSION_LIFETIME_S
    assert callers.of_session(cookie) is None
    now[0] -= SESSION_LIFETIME_S
    assert callers.of_session(cookie) is not None
    # ...and ends with the caller's admin (or its token) leaving the token file.
    path = Path(tokens)
    path.write_text(path.read_text().replace("admin = true", "admin = false"))
    assert callers.authenticator.tokens is not None and callers.authenticator.tokens.check()
    assert callers.of_session(cookie) is None
