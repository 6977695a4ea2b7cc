"""Callers' credentials (keyroute.auth.authn): the token file (TOML or JSON, tokens as given or as SHA-256
digests, certificates, reloaded on change, a broken file keeping the previous tokens), JWTs (asymmetric
algorithms only, `none` and HS256-with-the-public-key refused, iss/aud/exp/nbf, stores from a claim or from
groups, the caller named apart from tokens) and the Authenticator's cache. The signing keys' refreshes:
test_signing_keys.py."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from keyroute.api import Unauthorized
from keyroute.auth.access import Identity
from keyroute.auth.authn import (
    Authenticator,
    AuthnError,
    JwtPolicy,
    JwtVerifier,
    SigningKeys,
    TokenFile,
    parse_groups,
)

ISSUER, AUDIENCE = "https://issuer.test", "keyroute"
RSA_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
EC_KEY = ec.generate_private_key(ec.SECP256R1())
ED_KEY = ed25519.Ed25519PrivateKey.generate()


def jwk_of(key: Any, kid: str) -> dict[str, Any]:
    algorithm = {rsa.RSAPrivateKey: jwt.algorithms.RSAAlgorithm, ec.EllipticCurvePrivateKey: jwt.algorithms.ECAlgorithm}
    for kind, alg in algorithm.items():
        if isinstance(key, kind):
            jwk = json.loads(alg.to_jwk(key.public_key()))
            break
    else:
        jwk = json.loads(jwt.algorithms.OKPAlgorithm.to_jwk(key.public_key()))
    return {**jwk, "kid": kid}


JWKS = {"keys": [jwk_of(RSA_KEY, "rsa"), jwk_of(EC_KEY, "ec"), jwk_of(ED_KEY, "ed")]}


def token(key: Any = RSA_KEY, alg: str = "RS256", kid: str = "rsa", **claims: Any) -> str:
    now = int(time.time())
    body = {"iss": ISSUER, "aud": AUDIENCE, "sub": "svc", "exp": now + 300, "keyroute_stores": ["a"], **claims}
    return jwt.encode(body, key, algorithm=alg, headers={"kid": kid})


def keys_of(document: Any) -> SigningKeys:
    return SigningKeys(lambda deadline: json.dumps(document).encode() if not isinstance(document, bytes) else document)


def verifier(**policy: Any) -> JwtVerifier:
    return JwtVerifier(JwtPolicy(ISSUER, AUDIENCE, **policy), keys_of(JWKS))


def test_a_token_file_in_toml_or_json_names_tokens_digests_and_certificates(tmp_path: Path) -> None:
    toml = tmp_path / "tokens.toml"
    digest = hashlib.sha256(b"t-two").hexdigest()
    toml.write_text(
        '[[tokens]]\nname = "one"\ntoken = "t-one"\nstores = ["a", "b"]\n\n'
        f'[[tokens]]\nname = "two"\nsha256 = "{digest}"\nstores = "*"\nadmin = true\n\n'
        '[[tokens]]\nname = "svc"\ncertificate = "svc.example"\nstores = "a"\n'
    )
    as_json = tmp_path / "tokens.json"
    as_json.write_text(json.dumps({"tokens": [{"name": "one", "token": "t-one", "stores": ["a", "b"]}]}))
    for path in (toml, as_json):
        assert TokenFile(str(path)).identify(b"t-one") == Identity("one", frozenset({"a", "b"}))
    tokens = TokenFile(str(toml))
    assert tokens.identify(b"t-two") == Identity("two", None, admin=True)
    assert tokens.identify(b"t-three") is None and tokens.identify(digest.encode()) is None
    assert Authenticator(tokens).certificate(["other", "svc.example"]) == Identity("svc", frozenset({"a"}))


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("tokens = 3", "no list of tokens"),
        ('[[tokens]]\ntoken = "x"\nstores = "*"', "needs a name"),
        ('[[tokens]]\nname = "n"\ntoken = "x"', "stores missing"),
        ('[[tokens]]\nname = "n"\nstores = "*"', "exactly one of token"),
        ('[[tokens]]\nname = "n"\ntoken = "x"\ncertificate = "c"\nstores = "*"', "exactly one of token"),
        ('[[tokens]]\nname = "n"\nsha256 = "abc"\nstores = "*"', "64 hex digits"),
        ('[[tokens]]\nname = "n"\ntoken = "x"\nstores = 3', "stores must be"),
        ('[[tokens]]\nname = "n"\ntoken = "x"\nstores = "*"\nadmin = "yes"', "admin must be"),
        (
            '[[tokens]]\nname = "n"\ntoken = "x"\nstores = "*"\n[[tokens]]\nname = "m"\ntoken = "x"\nstores = "*"',
            "same",
        ),
        ("[[tokens]\nname = ", "neither valid TOML nor JSON"),
    ],
)
def test_a_token_file_that_does_not_fit_is_refused_in_one_line(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(text)
    with pytest.raises(AuthnError, match=says) as refused:
        TokenFile(str(path))
    assert "\n" not in str(refused.value)


def test_a_changed_token_file_is_used_and_a_broken_one_keeps_the_previous_tokens(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text('[[tokens]]\nname = "one"\ntoken = "t-one"\nstores = ["a"]\n')
    authenticator = Authenticator(TokenFile(str(path)), poll_s=1.0)
    assert authenticator.identify(b"Bearer t-one").name == "one"
    path.write_text('[[tokens]]\nname = "one"\ntoken = "t-new"\nstores = ["a"]\n')
    os.utime(path, ns=(1, 1))  # a change however fast the file system's clock
    authenticator.poll(time.monotonic() + 2)
    assert authenticator.identify(b"Bearer t-new").name == "one"
    with pytest.raises(Unauthorized):
        authenticator.identify(b"Bearer t-one")  # its cached identity went with the old file
    path.write_text("not = [valid")
    authenticator.poll(time.monotonic() + 4)
    assert authenticator.identify(b"Bearer t-new").name == "one"
    assert "keeping the previous tokens" in caplog.text


def test_the_authenticator_refuses_missing_malformed_and_unknown_credentials(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text('[[tokens]]\nname = "one"\ntoken = "t-one"\nstores = ["a"]\n')
    authenticator = Authenticator(TokenFile(str(path)))
    assert authenticator.identify(b"bearer  t-one").name == "one"  # the scheme in any case
    for header in (None, b"", b"Basic dDpvbmU=", b"t-one", b"Bearer t-on", b"Bearer " + b"x" * 20000):
        with pytest.raises(Unauthorized) as refused:
            authenticator.identify(header)
        assert refused.value.status == 401 and refused.value.headers["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.parametrize(
    ("key", "alg", "kid"), [(RSA_KEY, "RS256", "rsa"), (EC_KEY, "ES256", "ec"), (ED_KEY, "EdDSA", "ed")]
)
def test_a_jwt_signed_by_the_issuers_key_names_its_subject_and_stores(key: Any, alg: str, kid: str) -> None:
    identity, expires = verifier().verify(token(key, alg, kid))
    assert identity == Identity("jwt:svc", frozenset({"a"})) and expires > time.time()


def test_jwts_with_another_algorithm_issuer_audience_or_time_are_refused() -> None:
    check = verifier()
    public_pem = RSA_KEY.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    now = int(time.time())
    unsigned = jwt.encode({"iss": ISSUER, "aud": AUDIENCE, "sub": "x", "exp": now + 60}, None, algorithm="none")
    forged = jwt.api_jws.PyJWS()  # HS256 with the public key as the secret: PyJWT's own encoder refuses a PEM key
    forged._algorithms["HS256"].prepare_key = lambda key: key  # type: ignore[attr-defined]
    payload = json.dumps({"iss": ISSUER, "aud": AUDIENCE, "sub": "x", "exp": now + 60}).encode()
    hs256 = forged.encode(payload, public_pem, algorithm="HS256", headers={"kid": "rsa"})
    for bad, says in [
        (unsigned, "not accepted"),
        (hs256, "not accepted"),
        (token(RSA_KEY, "RS256", "ec"), "does not fit"),  # an RSA signature under the EC key's id
        (token(EC_KEY, "ES256", "rsa"), "does not fit"),
        (token(rsa.generate_private_key(public_exponent=65537, key_size=2048)), "not valid"),
        (token(exp=now - 3600), "expired"),
        (token(nbf=now + 3600), "not valid"),
        (token(iss="https://other.test"), "not valid"),
        (token(aud="other"), "not valid"),
        (token(sub=""), "subject"),
        ("a.b.c", "not a valid JWT"),
    ]:
        with pytest.raises(Unauthorized, match=says):
            check.verify(bad)
    # Within the leeway, a token just expired still reads.
    assert check.verify(token(exp=now - 5))[0].name == "jwt:svc"


def test_a_key_that_names_its_algorithm_verifies_that_one_only() -> None:
    named = {"keys": [{**jwk_of(RSA_KEY, "rsa"), "alg": "RS256"}]}
    check = JwtVerifier(JwtPolicy(ISSUER, AUDIENCE), keys_of(named))
    assert check.verify(token())[0].name == "jwt:svc"
    with pytest.raises(Unauthorized, match="does not fit"):
        check.verify(token(RSA_KEY, "PS256"))
    assert verifier().verify(token(RSA_KEY, "PS256"))[0].name == "jwt:svc"  # a key naming none: its family


def test_stores_come_from_the_claim_or_from_groups() -> None:
    assert verifier().verify(token(keyroute_stores="*"))[0].stores is None
    assert verifier().verify(token(keyroute_stores="a b"))[0].stores == {"a", "b"}
    assert verifier().verify(token(keyroute_stores=3))[0].stores == frozenset()
    groups = parse_groups({"groups": {"readers": ["a"], "more": ["b", "c"], "ops": "*"}}, "groups.toml")
    by_groups = verifier(groups_claim="groups", groups=groups)
    assert by_groups.verify(token(groups=["readers", "more", "x"]))[0].stores == {"a", "b", "c"}
    assert by_groups.verify(token(groups=["ops"]))[0].stores is None
    assert by_groups.verify(token())[0].stores == frozenset()


def test_a_verified_jwt_is_cached_until_it_expires() -> None:
    now = [time.time()]
    check = verifier()
    verified: list[str] = []
    verify = check.verify_with_key
    check.verify_with_key = lambda text: verified.append(text) or verify(text)  # type: ignore[method-assign]
    authenticator = Authenticator(jwt=check, clock=lambda: now[0])
    header = b"Bearer " + token(exp=int(now[0]) + 60).encode()
    assert authenticator.identify(header).name == "jwt:svc"
    assert authenticator.identify(header).name == "jwt:svc"  # from the cache
    assert len(verified) == 1
    now[0] += 61
    assert authenticator.identify(header).name == "jwt:svc"  # past its expiry, verified again (the leeway)
    assert len(verified) == 2


def test_a_jwks_without_a_usable_key_or_that_does_not_load_is_refused() -> None:
    with pytest.raises(AuthnError, match="no usable signing key"):
        JwtVerifier(JwtPolicy(ISSUER), keys_of({"keys": [{"kty": "oct", "k": "c2VjcmV0"}]}))
    with pytest.raises(AuthnError, match="does not load"):
        JwtVerifier(JwtPolicy(ISSUER), keys_of(b"{"))


def test_a_jwt_subject_and_a_token_of_the_same_name_are_two_callers(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text('[[tokens]]\nname = "svc"\ntoken = "t-svc"\nstores = ["b"]\n')
    authenticator = Authenticator(TokenFile(str(path)), verifier())
    as_token = authenticator.identify(b"Bearer t-svc")
    as_jwt = authenticator.identify(b"Bearer " + token(sub="svc").encode())
    assert (as_token.name, as_jwt.name) == ("svc", "jwt:svc")
    assert as_token.stores == {"b"} and as_jwt.stores == {"a"}
    # A token file cannot name a token as a JWT subject is named.
    path.write_text('[[tokens]]\nname = "jwt:svc"\ntoken = "t-svc"\nstores = "*"\n')
    with pytest.raises(AuthnError, match="JWT subject's"):
        TokenFile(str(path))
