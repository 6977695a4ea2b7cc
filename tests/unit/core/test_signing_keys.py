"""An issuer's signing keys (keyroute.auth.authn.SigningKeys) on an injected monotonic clock: a fetch past its
total deadline abandoned and the last good keys kept; the keys fetched again every period; a key the issuer
removed forgotten with the identities it verified; a token with an unknown key id refused at once, its fetch
left to the background and rate-limited; and the background thread itself."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from keyroute.api import Unauthorized
from keyroute.auth.authn import Authenticator, FetchDeadline, JwtPolicy, JwtVerifier, SigningKeys
from tests.util import wait_for

ISSUER, AUDIENCE = "https://issuer.test", "keyroute"
RSA_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
EC_KEY = ec.generate_private_key(ec.SECP256R1())
OTHER_EC_KEY = ec.generate_private_key(ec.SECP256R1())


def jwk_of(key: Any, kid: str) -> dict[str, Any]:
    if isinstance(key, rsa.RSAPrivateKey):
        return {**json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key())), "kid": kid}
    return {**json.loads(jwt.algorithms.ECAlgorithm.to_jwk(key.public_key())), "kid": kid}


def token(key: Any = RSA_KEY, kid: str = "rsa", **claims: Any) -> str:
    alg = "RS256" if isinstance(key, rsa.RSAPrivateKey) else "ES256"
    body = {"iss": ISSUER, "aud": AUDIENCE, "sub": "svc", "exp": int(time.time()) + 300, "keyroute_stores": ["a"]}
    return jwt.encode({**body, **claims}, key, algorithm=alg, headers={"kid": kid})


class Clock:
    """Monotonic seconds that move only when the test says."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Issuer:
    """The JWKS an issuer publishes, fetched through `fetch` (counted). `trickle_s`: each byte of the answer
    takes that long to arrive (on the clock), as from a server trickling it; `failure`: raised instead;
    `raw`: these bytes answered instead; `during`: called in the middle of a fetch."""

    def __init__(self, clock: Clock, *keys: dict[str, Any]) -> None:
        self.clock = clock
        self.keys = list(keys)
        self.fetches = 0
        self.bytes_sent = 0
        self.trickle_s = 0.0
        self.failure: Exception | None = None
        self.raw: bytes | None = None
        self.during: Callable[[], None] = lambda: None

    def fetch(self, deadline: FetchDeadline) -> bytes:
        self.fetches += 1
        self.during()
        if self.failure is not None:
            raise self.failure
        received = bytearray()
        for chunk in self._answer():
            deadline.collect(received, chunk, "the JWKS")
        return bytes(received)

    def _answer(self) -> Iterator[bytes]:
        body = self.raw if self.raw is not None else json.dumps({"keys": self.keys}).encode()
        if not self.trickle_s:
            self.bytes_sent += len(body)
            yield body
            return
        for i in range(len(body)):
            self.clock.now += self.trickle_s
            self.bytes_sent += 1
            yield body[i : i + 1]


def keys_of(issuer: Issuer, **options: Any) -> SigningKeys:
    keys = SigningKeys(issuer.fetch, clock=issuer.clock, **options)
    keys.load()
    return keys


def test_a_trickled_fetch_is_abandoned_at_its_total_deadline_and_the_last_good_keys_are_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    issuer = Issuer(clock, jwk_of(RSA_KEY, "rsa"))
    keys = keys_of(issuer, refresh_s=300, deadline_s=5)
    check = JwtVerifier(JwtPolicy(ISSUER, AUDIENCE), keys)
    issuer.keys = [jwk_of(EC_KEY, "ec")]
    issuer.trickle_s = 1.5  # a byte every 1.5 s: each read would be within a per-read timeout
    issuer.bytes_sent = 0
    started = clock.now
    with caplog.at_level(logging.WARNING):
        assert keys.refresh() is False
    # Abandoned at the deadline (the 4th byte arrives at 6 s), not after the whole answer.
    assert issuer.bytes_sent == 4 and clock.now - started == 6.0
    assert keys.fetch_failures == 1 and list(keys.current) == ["rsa"]
    assert check.verify(token())[0].name == "jwt:svc"  # the last good keys
    [line] = [r.getMessage() for r in caplog.records if "keeping the last good" in r.getMessage()]
    assert "5 s deadline: abandoned" in line and "\n" not in line


def test_a_fetch_that_returns_after_its_deadline_is_not_used() -> None:
    clock = Clock()
    issuer = Issuer(clock, jwk_of(RSA_KEY, "rsa"))
    keys = keys_of(issuer, deadline_s=5)
    issuer.keys = [jwk_of(EC_KEY, "ec")]

    def block() -> None:
        clock.now += 7  # one read that blocked past the deadline, then the whole answer

    issuer.during = block
    assert keys.refresh() is False and list(keys.current) == ["rsa"] and keys.fetch_failures == 1


@pytest.mark.parametrize(
    ("failure", "says"),
    [
        (OSError("connection refused"), "OSError: connection refused"),
        (b"{", "does not load"),
        ({"keys": [{"kty": "oct", "k": "c2VjcmV0"}]}, "no usable signing key"),
    ],
)
def test_a_refresh_that_fails_keeps_the_last_good_keys_and_says_why_in_one_line(
    failure: Any, says: str, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    issuer = Issuer(clock, jwk_of(RSA_KEY, "rsa"))
    keys = keys_of(issuer)
    if isinstance(failure, Exception):
        issuer.failure = failure
    else:
        issuer.raw = failure if isinstance(failure, bytes) else json.dumps(failure).encode()
    with caplog.at_level(logging.WARNING):
        assert keys.refresh() is False
    assert list(keys.current) == ["rsa"] and keys.fetch_failures == 1
    [line] = [r.getMessage() for r in caplog.records]
    assert says in line and "\n" not in line


def test_the_keys_are_fetched_again_every_period() -> None:
    clock = Clock()
    issuer = Issuer(clock, jwk_of(RSA_KEY, "rsa"))
    keys = keys_of(issuer, refresh_s=300)
    assert issuer.fetches == 1
    clock.now += 299
    assert keys.step() == pytest.approx(1.0) and issuer.fetches == 1  # not yet due: the wait until it is
    issuer.keys.append(jwk_of(EC_KEY, "ec"))
    clock.now += 1
    assert keys.step() == pytest.approx(300.0) and issuer.fetches == 2
    assert set(keys.current) == {"rsa", "ec"}
    clock.now += 300
    keys.step()
    assert issuer.fetches == 3


def test_a_key_the_issuer_removed_stops_authenticating_within_one_period_cached_or_not() -> None:
    clock = Clock()
    issuer = Issuer(clock, jwk_of(RSA_KEY, "rsa"), jwk_of(EC_KEY, "ec"))
    keys = keys_of(issuer, refresh_s=300)
    check = JwtVerifier(JwtPolicy(ISSUER, AUDIENCE), keys)
    verified: list[str] = []
    verify = check.verify_with_key
    check.verify_with_key = lambda text: verified.append(text) or verify(text)  # type: ignore[method-assign]
    authenticator = Authenticator(jwt=check)
    by_rsa, by_ec = (b"Bearer " + token(k, kid).encode() for k, kid in ((RSA_KEY, "rsa"), (EC_KEY, "ec")))
    assert authenticator.identify(by_rsa).name == authenticator.identify(by_ec).name == "jwt:svc"
    assert len(verified) == 2
    issuer.keys = [jwk_of(RSA_KEY, "rsa")]  # the issuer removes the EC key
    clock.now += 300
    keys.step()
    authenticator.poll(time.monotonic())  # as before every read
    with pytest.raises(Unauthorized, match="unknown key"):
        authenticator.identify(by_ec)
    assert authenticator.identify(by_rsa).name == "jwt:svc" and len(verified) == 3  # still cached: one more
    # A key id whose key changed is a removed key too: what the old key verified is forgotten.
    issuer.keys = [jwk_of(OTHER_EC_KEY, "rsa")]
    clock.now += 300
    keys.step()
    authenticator.poll(time.monotonic())
    with pytest.raises(Unauthorized):
        authenticator.identify(by_rsa)


def test_an_unknown_key_id_is_refused_at_once_and_fetched_in_the_background_at_most_every_interval() -> None:
    clock = Clock()
    issuer = Issuer(clock, jwk_of(RSA_KEY, "rsa"))
    keys = keys_of(issuer, refresh_s=300, unknown_kid_s=30)
    check = JwtVerifier(JwtPolicy(ISSUER, AUDIENCE), keys)
    issuer.keys.append(jwk_of(EC_KEY, "ec"))  # the issuer adds a key and signs with it at once
    clock.now += 10
    with pytest.raises(Unauthorized, match="unknown key"):
        check.verify(token(EC_KEY, "ec"))
    assert issuer.fetches == 1  # nothing fetched on the read's path, and too soon to ask
    keys.step()
    assert issuer.fetches == 1
    clock.now += 25  # 35 s after the last fetch
    with pytest.raises(Unauthorized, match="unknown key"):
        check.verify(token(EC_KEY, "ec"))  # answered at once all the same
    for kid in ("ec", "x", "y"):  # one fetch asked for, however many unknown key ids come meanwhile
        with pytest.raises(Unauthorized):
            check.verify(token(EC_KEY, kid))
    assert issuer.fetches == 1
    keys.step()  # the background thread's turn
    assert issuer.fetches == 2
    assert check.verify(token(EC_KEY, "ec"))[0].name == "jwt:svc"
    with pytest.raises(Unauthorized, match="unknown key"):
        check.verify(token(EC_KEY, "nope"))
    keys.step()
    assert issuer.fetches == 2  # the last fetch was just now


def test_one_fetch_at_a_time_even_when_it_takes_its_whole_deadline() -> None:
    clock = Clock()
    issuer = Issuer(clock, jwk_of(RSA_KEY, "rsa"))
    keys = keys_of(issuer, refresh_s=300, unknown_kid_s=1, deadline_s=5)
    asked: list[bool] = []

    def meanwhile() -> None:
        clock.now += 3  # still in flight 3 s later: another unknown key id asks in vain
        asked.append(keys.ask())

    issuer.during = meanwhile
    clock.now += 2
    assert keys.ask() is True and keys.ask() is False
    keys.step()
    assert asked == [False]
    clock.now += 1
    assert keys.ask() is True


def test_the_background_thread_fetches_when_asked_and_stops_when_closed() -> None:
    fetched: list[float] = []
    document = {"keys": [jwk_of(RSA_KEY, "rsa")]}

    def fetch(deadline: FetchDeadline) -> bytes:
        fetched.append(time.monotonic())
        return json.dumps(document).encode()

    keys = SigningKeys(fetch, refresh_s=3600, unknown_kid_s=0.0)
    check = JwtVerifier(JwtPolicy(ISSUER, AUDIENCE), keys)
    keys.start()
    assert keys.refreshing
    try:
        document["keys"].append(jwk_of(EC_KEY, "ec"))
        with pytest.raises(Unauthorized):
            check.verify(token(EC_KEY, "ec"))
        wait_for(lambda: "ec" in keys.current, timeout_s=30, message="the new key fetched in the background")
        assert check.verify(token(EC_KEY, "ec"))[0].name == "jwt:svc" and len(fetched) == 2
    finally:
        keys.close()
    wait_for(lambda: not keys.refreshing, timeout_s=30, message="the refresh thread ended")
