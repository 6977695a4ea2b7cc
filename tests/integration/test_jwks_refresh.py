"""JWT signing keys on a real cluster (two `keyroute node` processes and a `keyroute router`, the session's
ZooKeeper), each process fetching them from a real key server of its own on 127.0.0.1 (tests/jwks_server.py):
while those servers trickle their answers a byte a second and tokens with unknown key ids keep arriving,
other callers' reads through the router and on each node are answered, correctly, while that process's
fetch is in progress (its server says a trickled answer begun before the read had not ended after it), every
unknown-key token is 401, and the trickled fetches are abandoned (each server sees its connection closed
before its answer was whole; the processes count and log it). Node n1 refreshes only hourly, so its fetches
are the ones unknown key ids ask for: a read answered during one shows that they are not on the request
path. The router and n2 refresh every 2 s: a key the issuer removes stops authenticating after a refresh, a
token already seen included. A JWT subject and a token of the same name are two callers."""

from __future__ import annotations

import base64
import re
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from keyroute.dev.zookeeper_server import EmbeddedZooKeeper
from keyroute.runtime.settings import ZkSettings
from tests.integration.small_cluster import ADMIN_TOKEN, SECRET, STORE, SmallCluster, expected, key_path, small_cluster
from tests.jwks_server import JwksServer
from tests.util import wait_for

pytestmark = pytest.mark.integration

ISSUER, AUDIENCE = "https://issuer.test", "keyroute"
READER = "svc-t0ken"  # the token of the caller named "svc", as the JWTs' subject is
KEY_1 = rsa.generate_private_key(public_exponent=65537, key_size=2048)
KEY_2 = rsa.generate_private_key(public_exponent=65537, key_size=2048)
KEY_TEXT = "C001"


def jwk(key: rsa.RSAPrivateKey, kid: str) -> dict[str, Any]:
    numbers = key.public_key().public_numbers()

    def b64(n: int) -> str:
        return base64.urlsafe_b64encode(n.to_bytes((n.bit_length() + 7) // 8, "big")).rstrip(b"=").decode()

    return {"kty": "RSA", "kid": kid, "use": "sig", "alg": "RS256", "n": b64(numbers.n), "e": b64(numbers.e)}


def make_jwt(key: rsa.RSAPrivateKey, kid: str, stores: list[str]) -> str:
    now = int(time.time())
    body = {"iss": ISSUER, "aud": AUDIENCE, "sub": "svc", "exp": now + 600, "keyroute_stores": stores}
    return jwt.encode(body, key, algorithm="RS256", headers={"kid": kid})


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


PROCESSES = ("router", "n1", "n2")
# n1 fetches on its own only hourly: during the test, only for the unknown key ids that ask.
REFRESH_S = {"router": "2", "n1": "3600", "n2": "2"}
PERIODIC = ("router", "n2")


@pytest.fixture(scope="module")
def issuers() -> Iterator[dict[str, JwksServer]]:
    """The issuer's key server, one per process (so that each one's fetches can be told apart)."""
    servers = {name: JwksServer([jwk(KEY_1, "k1"), jwk(KEY_2, "k2")], trickle_interval_s=1.0) for name in PROCESSES}
    try:
        yield servers
    finally:
        for server in servers.values():
            server.close()


def set_issuers(issuers: dict[str, JwksServer], *, trickle: bool | None = None, keys: list[Any] | None = None) -> None:
    for server in issuers.values():
        if trickle is not None:
            server.trickle = trickle
        if keys is not None:
            server.keys = keys


@pytest.fixture(scope="module")
def cluster(
    zk_server: EmbeddedZooKeeper, tmp_path_factory: pytest.TempPathFactory, issuers: dict[str, JwksServer]
) -> Iterator[SmallCluster]:
    zk_settings = ZkSettings(hosts=zk_server.connect_string, chroot=f"/t-{uuid.uuid4().hex[:12]}", session_timeout_s=4)
    tmp_path = tmp_path_factory.mktemp("jwks-refresh")
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(
        f'[[tokens]]\nname = "ops"\ntoken = "{ADMIN_TOKEN}"\nstores = "*"\nadmin = true\n\n'
        f'[[tokens]]\nname = "svc"\ntoken = "{READER}"\nstores = ["{STORE}"]\n',
        encoding="utf-8",
    )
    args = ["--cluster-secret", SECRET, "--access-tokens", str(tokens), "--admin-token", ADMIN_TOKEN]
    args += ["--jwt-issuer", ISSUER, "--jwt-audience", AUDIENCE, "--jwt-jwks-allow-http"]
    with small_cluster(
        tmp_path,
        zk_settings,
        extra_args=args,
        own_args=lambda name: ["--jwt-jwks-url", issuers[name].url, "--jwt-jwks-refresh-s", REFRESH_S[name]],
        http_options={"headers": bearer(ADMIN_TOKEN)},
    ) as c:
        yield c


def processes(cluster: SmallCluster) -> dict[str, str]:
    """Each process's name and base URL."""
    return {"router": cluster.router_url, **cluster.node_urls}


def bases(cluster: SmallCluster) -> list[str]:
    return list(processes(cluster).values())


def jwks_failures(http: httpx.Client, base: str) -> float:
    text = http.get(base + "/metrics", headers=bearer(ADMIN_TOKEN)).text
    found = re.search(r"^keyroute_jwks_fetch_failures_total (\S+)$", text, re.MULTILINE)
    assert found is not None, text[:2000]
    return float(found.group(1))


def test_reads_are_answered_while_unknown_key_ids_arrive_and_the_key_server_trickles(
    cluster: SmallCluster, issuers: dict[str, JwksServer]
) -> None:
    path = key_path(KEY_TEXT)
    want = expected(KEY_TEXT)["value"]
    good = make_jwt(KEY_1, "k1", [STORE])
    stop = threading.Event()
    unknown_answers: list[int] = []

    def unknown_key_ids() -> None:
        with httpx.Client(timeout=30, trust_env=False) as attacker:
            i = 0
            while not stop.is_set():
                for base in bases(cluster):
                    token = make_jwt(KEY_2, f"unknown-{i}", [STORE])
                    unknown_answers.append(attacker.get(base + path, headers=bearer(token)).status_code)
                    i += 1
                stop.wait(0.1)

    with httpx.Client(timeout=30, trust_env=False) as http:
        before = {base: jwks_failures(http, base) for base in bases(cluster)}
        abandoned_before = {name: server.counts()[2] for name, server in issuers.items()}
        set_issuers(issuers, trickle=True)
        attacker = threading.Thread(target=unknown_key_ids, daemon=True)
        attacker.start()
        answers: list[tuple[str, int, Any]] = []  # the other callers' reads: (where, status, value)
        during_fetch = dict.fromkeys(PROCESSES, 0)  # reads answered wholly within that process's trickled fetch
        try:

            def trickles_abandoned_everywhere() -> bool:
                for name, base in processes(cluster).items():
                    for credentials in (bearer(READER), bearer(good)):
                        begun, _ = issuers[name].trickle_marks()
                        r = http.get(base + path, headers=credentials)
                        _, ended = issuers[name].trickle_marks()
                        answers.append((base, r.status_code, r.json().get("value")))
                        during_fetch[name] += begun > ended
                return all(during_fetch.values()) and all(
                    jwks_failures(http, base) > before[base] for base in bases(cluster)
                )

            wait_for(trickles_abandoned_everywhere, timeout_s=120, interval_s=0.2, message="trickled fetches abandoned")
        finally:
            stop.set()
            attacker.join(timeout=60)
            set_issuers(issuers, trickle=False)
    wrong = [answer for answer in answers if answer[1:] != (200, want)]
    assert wrong == [], wrong[:5]
    assert unknown_answers and set(unknown_answers) == {401}, set(unknown_answers)
    for name, server in issuers.items():
        # Each key server saw a fetch given up before its answer was whole.
        assert server.counts()[2] > abandoned_before[name], (name, server.counts())
    assert "deadline: abandoned" in cluster.logs()


def test_a_removed_key_stops_authenticating_after_a_refresh_a_token_already_seen_included(
    cluster: SmallCluster, issuers: dict[str, JwksServer]
) -> None:
    path = key_path(KEY_TEXT)
    by_k1, by_k2 = make_jwt(KEY_1, "k1", [STORE]), make_jwt(KEY_2, "k2", [STORE])
    with httpx.Client(timeout=30, trust_env=False) as http:
        for base in bases(cluster):
            assert http.get(base + path, headers=bearer(by_k2)).status_code == 200  # seen: cached
        set_issuers(issuers, keys=[jwk(KEY_1, "k1")])  # the issuer removes k2
        try:

            def k2_refused_everywhere() -> bool:
                return all(http.get(base + path, headers=bearer(by_k2)).status_code == 401 for base in periodic)

            periodic = [processes(cluster)[name] for name in PERIODIC]
            wait_for(k2_refused_everywhere, timeout_s=60, interval_s=0.2, message="the removed key refused")
            for base in periodic:
                r = http.get(base + path, headers=bearer(by_k1))
                assert r.status_code == 200, (base, r.text)
        finally:
            set_issuers(issuers, keys=[jwk(KEY_1, "k1"), jwk(KEY_2, "k2")])


def test_a_jwt_subject_and_a_token_of_the_same_name_are_two_callers(cluster: SmallCluster) -> None:
    other = "elsewhere"
    with httpx.Client(timeout=30, trust_env=False) as http:
        for base in bases(cluster):
            assert http.get(base + key_path(KEY_TEXT), headers=bearer(READER)).status_code == 200
            r = http.get(base + key_path(KEY_TEXT, other), headers=bearer(make_jwt(KEY_1, "k1", [STORE])))
            assert r.status_code == 403 and "'jwt:svc' may not read store" in r.json()["message"], r.text
        metrics = http.get(cluster.router_url + "/metrics", headers=bearer(ADMIN_TOKEN)).text
    identities = set(re.findall(r'keyroute_router_caller_requests_total\{identity="([^"]+)"', metrics))
    assert {"svc", "jwt:svc"} <= identities, identities
