"""Callers and their stores on a real cluster (two `keyroute node` processes and a `keyroute router`, the
session's ZooKeeper): a token for one store reads it and gets 403 on another, through the router and directly
on a node, for every read kind; a JWT signed by the issuer's key reads, an expired or wrongly signed one is 401;
the token file rotated takes effect without a restart; /routing shows a caller only the stores it may read."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import ssl
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
import trustme
from cryptography.hazmat.primitives.asymmetric import rsa

from keyroute.client import Client, Forbidden
from keyroute.dev.zookeeper_server import EmbeddedZooKeeper
from keyroute.runtime.settings import ZkSettings
from tests.integration.small_cluster import ADMIN_TOKEN, SECRET, STORE, SmallCluster, expected, key_path, small_cluster
from tests.util import wait_for

pytestmark = pytest.mark.integration

OTHER = "elsewhere"  # a store the A reader may not read
ISSUER = "https://issuer.test"
AUDIENCE = "keyroute"
READER_A, READER_B = "reader-a-t0ken", "reader-b-t0ken"
AUDITOR = "aud1tor-t0ken"  # an admin caller whose token is not the admin token


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def write_tokens(path: Path, b_stores: list[str]) -> None:
    path.write_text(
        f"""
[[tokens]]
name = "ops"
token = "{ADMIN_TOKEN}"
stores = "*"
admin = true

[[tokens]]
name = "auditor"
token = "{AUDITOR}"
stores = []
admin = true

[[tokens]]
name = "team-a"
token = "{READER_A}"
stores = ["{STORE}"]

[[tokens]]
name = "team-b"
sha256 = "{hashlib.sha256(READER_B.encode()).hexdigest()}"
stores = {json.dumps(b_stores)}
""",
        encoding="utf-8",
    )


def _jwk(key: rsa.RSAPrivateKey, kid: str) -> dict[str, Any]:
    numbers = key.public_key().public_numbers()

    def b64(n: int) -> str:
        return base64.urlsafe_b64encode(n.to_bytes((n.bit_length() + 7) // 8, "big")).rstrip(b"=").decode()

    return {"kty": "RSA", "kid": kid, "use": "sig", "alg": "RS256", "n": b64(numbers.n), "e": b64(numbers.e)}


KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
ROGUE = rsa.generate_private_key(public_exponent=65537, key_size=2048)


def make_jwt(key: rsa.RSAPrivateKey = KEY, *, exp_in_s: float = 300, kid: str = "k1", **claims: Any) -> str:
    now = int(time.time())
    body = {"iss": ISSUER, "aud": AUDIENCE, "sub": "svc-jwt", "iat": now, "exp": now + exp_in_s, **claims}
    return jwt.encode(body, key, algorithm="RS256", headers={"kid": kid})


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("access-files") / "tokens.toml"
    write_tokens(path, [OTHER])
    return path


@pytest.fixture(scope="module")
def cluster(
    zk_server: EmbeddedZooKeeper, tmp_path_factory: pytest.TempPathFactory, tokens_file: Path
) -> Iterator[SmallCluster]:
    zk_settings = ZkSettings(hosts=zk_server.connect_string, chroot=f"/t-{uuid.uuid4().hex[:12]}", session_timeout_s=4)
    tmp_path = tmp_path_factory.mktemp("access-control")
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps({"keys": [_jwk(KEY, "k1")]}), encoding="utf-8")
    args = ["--cluster-secret", SECRET, "--access-tokens", str(tokens_file), "--admin-token", ADMIN_TOKEN]
    args += ["--jwt-issuer", ISSUER, "--jwt-audience", AUDIENCE, "--jwt-jwks-file", str(jwks)]
    with small_cluster(tmp_path, zk_settings, extra_args=args, http_options={"headers": bearer(ADMIN_TOKEN)}) as c:
        yield c


KEY_TEXT = "C001"


def reads(base: str, store: str, node: bool) -> list[tuple[str, str, Any]]:
    """Every read kind of `store`: (method, path, JSON body)."""
    key = key_path(KEY_TEXT, store)
    range_path = f"/stores/{store}/partitions/0/range" if node else f"/stores/{store}/range"
    return [
        ("GET", key, None),
        ("HEAD", key, None),
        ("GET", key + "/history", None),
        ("GET", key + "/windows", None),
        ("POST", f"/stores/{store}/batch-get", {"keys": [KEY_TEXT, "C002"]}),
        ("GET", range_path, None),
        ("GET", f"/stores/{store}/schema", None),
    ]


def urls(cluster: SmallCluster) -> list[tuple[str, bool]]:
    return [(cluster.router_url, False), *((url, True) for url in cluster.node_urls.values())]


def test_a_reader_reads_its_store_and_gets_403_on_another_through_the_router_and_on_each_node(
    cluster: SmallCluster,
) -> None:
    with httpx.Client(timeout=10, trust_env=False) as http:
        for base, node in urls(cluster):
            for method, path, body in reads(base, STORE, node):
                r = http.request(method, base + path, json=body, headers=bearer(READER_A))
                assert r.status_code not in (401, 403), (base, method, path, r.text)
                # (A node's range read of a partition it does not serve is a 503 that names it.)
                assert r.status_code < 500 or "does not serve partition" in r.text, (base, method, path, r.text)
                r = http.request(method, base + path, json=body, headers=bearer(READER_B))
                assert r.status_code == 403, (base, method, path, r.text)
                if method != "HEAD":
                    assert r.json()["error"] == "forbidden" and STORE in r.json()["message"], r.text
                r = http.request(method, base + path, json=body)
                assert r.status_code == 401, (base, method, path, r.text)
                assert r.headers["www-authenticate"].startswith("Bearer"), r.headers
            for method, path, body in reads(base, OTHER, node):
                r = http.request(method, base + path, json=body, headers=bearer(READER_A))
                assert r.status_code == 403, (base, method, path, r.text)
            # The read itself is answered: the key's value, whichever node holds it (forwarded between members).
            r = http.get(base + key_path(KEY_TEXT), headers=bearer(READER_A))
            assert r.status_code == 200 and r.json()["value"] == expected(KEY_TEXT)["value"], r.text


def test_the_python_client_sends_its_token_in_router_and_direct_modes(cluster: SmallCluster) -> None:
    want = expected(KEY_TEXT)["value"]
    for routing in ("router", "direct"):
        with Client(cluster.router_url, token=READER_A, routing=routing) as client:
            value = client.get(STORE, KEY_TEXT)
            assert value.value == want and (routing == "router" or value.node in cluster.node_urls), value
        with Client(cluster.router_url, token=READER_B, routing=routing) as client, pytest.raises(Forbidden):
            client.get(STORE, KEY_TEXT)


def test_jwts_signed_by_the_issuer_read_and_expired_or_foreign_ones_are_401(cluster: SmallCluster) -> None:
    path = key_path(KEY_TEXT)
    with httpx.Client(timeout=10, trust_env=False) as http:
        for base, _ in urls(cluster):
            good = make_jwt(keyroute_stores=[STORE])
            assert http.get(base + path, headers=bearer(good)).status_code == 200
            assert http.get(base + path, headers=bearer(make_jwt(keyroute_stores=[OTHER]))).status_code == 403
            for bad in (
                make_jwt(exp_in_s=-3600, keyroute_stores=[STORE]),  # expired (beyond the leeway)
                make_jwt(ROGUE, keyroute_stores=[STORE]),  # signed by another key under the issuer's kid
                make_jwt(ROGUE, kid="k9", keyroute_stores=[STORE]),  # an unknown key
                make_jwt(keyroute_stores=[STORE], iss="https://other.test"),
                make_jwt(keyroute_stores=[STORE], aud="someone-else"),
                jwt.encode({"iss": ISSUER, "sub": "x", "exp": time.time() + 60}, None, algorithm="none"),
            ):
                r = http.get(base + path, headers=bearer(bad))
                assert r.status_code == 401, (base, r.text)
                assert r.json()["error"] == "unauthorized", r.text


def test_routing_shows_a_reader_only_the_stores_it_may_read(cluster: SmallCluster) -> None:
    with httpx.Client(timeout=10, trust_env=False) as http:
        everything = http.get(cluster.router_url + "/routing", headers=bearer(ADMIN_TOKEN)).json()
        assert STORE in everything["stores"] and STORE in everything["store_names"]
        mine = http.get(cluster.router_url + "/routing", headers=bearer(READER_A)).json()
        assert set(mine["stores"]) == {STORE}
        theirs = http.get(cluster.router_url + "/routing", headers=bearer(READER_B)).json()
        assert theirs["stores"] == {} and theirs["store_names"] == []
        assert http.get(cluster.router_url + "/routing").status_code == 401
        # /admin is for admin callers: a reader's token is not enough.
        assert http.get(cluster.router_url + "/admin/partition-map", headers=bearer(READER_A)).status_code == 403


def refused_reads(exposition: str, prefix: str, outcome: str) -> int:
    """The reads a process counted under `outcome` in its /metrics exposition, over every store and kind."""
    found = re.findall(rf'^{prefix}_requests_total{{[^}}]*outcome="{outcome}"[^}}]*}} (\S+)$', exposition, re.M)
    return int(sum(float(n) for n in found))


def test_metrics_need_an_admin_caller_and_count_refused_callers_under_their_outcomes(cluster: SmallCluster) -> None:
    with httpx.Client(timeout=10, trust_env=False) as http:
        for base, node in urls(cluster):
            assert http.get(base + key_path(KEY_TEXT, OTHER), headers=bearer(READER_A)).status_code == 403
            assert http.get(base + key_path(KEY_TEXT)).status_code == 401
            # Its labels name every store and caller: only an admin caller (or the admin token) reads it.
            missing = http.get(base + "/metrics")
            assert missing.status_code == 401 and missing.json()["error"] == "unauthorized", (base, missing.text)
            refused = http.get(base + "/metrics", headers=bearer(READER_A))
            assert refused.status_code == 403 and refused.json()["error"] == "forbidden", (base, refused.text)
            answer = http.get(base + "/metrics", headers=bearer(AUDITOR))
            assert answer.status_code == 200, (base, answer.text)
            prefix = "keyroute_node" if node else "keyroute_router"
            for outcome in ("forbidden", "unauthorized"):
                assert refused_reads(answer.text, prefix, outcome) >= 1, (base, outcome)


def test_a_rotated_token_file_takes_effect_without_a_restart_and_a_broken_one_is_ignored(
    cluster: SmallCluster, tokens_file: Path
) -> None:
    path = key_path(KEY_TEXT)
    with httpx.Client(timeout=10, trust_env=False) as http:

        def b_reads_everywhere() -> bool:
            return all(http.get(b + path, headers=bearer(READER_B)).status_code == 200 for b, _ in urls(cluster))

        try:
            assert http.get(cluster.router_url + path, headers=bearer(READER_B)).status_code == 403
            write_tokens(tokens_file, [OTHER, STORE])
            wait_for(b_reads_everywhere, timeout_s=30, interval_s=0.2, message="the new token file in use")
            tokens_file.write_text("[[tokens]]\nname = 'broken", encoding="utf-8")  # not TOML: kept the last
            deadline = time.monotonic() + 3  # more than one poll of the file (every 2 s)
            while time.monotonic() < deadline:
                assert b_reads_everywhere()
            assert "keeping the previous tokens" in cluster.logs()
        finally:
            write_tokens(tokens_file, [OTHER])
            wait_for(
                lambda: http.get(cluster.router_url + path, headers=bearer(READER_B)).status_code == 403,
                timeout_s=30,
                message="the original token file in use",
            )


def test_a_client_certificate_names_its_caller_on_a_router_requiring_certificates(
    zk_server: EmbeddedZooKeeper, tmp_path: Path
) -> None:
    ca = trustme.CA()
    ca_file = str(tmp_path / "ca.pem")
    ca.cert_pem.write_to_path(ca_file)

    def issue(name: str, *identities: str) -> tuple[str, str]:
        issued = ca.issue_cert(*identities)
        cert, key = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
        issued.cert_chain_pems[0].write_to_path(str(cert))
        issued.private_key_pem.write_to_path(str(key))
        return str(cert), str(key)

    def context(cert: tuple[str, str]) -> ssl.SSLContext:
        made = ssl.create_default_context(cafile=ca_file)
        made.load_cert_chain(*cert)
        return made

    tokens = tmp_path / "tokens.toml"
    write_tokens(tokens, [OTHER])
    with tokens.open("a", encoding="utf-8") as f:
        f.write('\n[[tokens]]\nname = "ops-cert"\ncertificate = "ops.example"\nstores = "*"\n')
        f.write(f'\n[[tokens]]\nname = "reader-cert"\ncertificate = "reader.example"\nstores = ["{STORE}"]\n')
    router_cert = issue("router", "127.0.0.1", "localhost")
    ops, reader, nobody = issue("ops", "ops.example"), issue("reader", "reader.example"), issue("x", "x.example")
    zk_settings = ZkSettings(hosts=zk_server.connect_string, chroot=f"/t-{uuid.uuid4().hex[:12]}", session_timeout_s=4)
    args = ["--cluster-secret", SECRET, "--access-tokens", str(tokens), "--admin-token", ADMIN_TOKEN]
    router_args = ["--tls-cert", router_cert[0], "--tls-key", router_cert[1], "--tls-client-ca", ca_file]
    with small_cluster(
        tmp_path / "cluster",
        zk_settings,
        extra_args=args,
        router_args=router_args,
        scheme="https",  # the router's (the nodes serve plain HTTP here: their URLs are not used)
        http_options={"verify": context(ops)},
    ) as cluster:
        router = cluster.router_url
        with httpx.Client(timeout=10, trust_env=False, verify=context(reader)) as http:
            assert http.get(router + key_path(KEY_TEXT)).json()["value"] == expected(KEY_TEXT)["value"]
            r = http.get(router + key_path(KEY_TEXT, OTHER))
            assert r.status_code == 403 and r.json()["error"] == "forbidden", r.text
            # A bearer token, when sent, names the caller instead of the certificate.
            assert http.get(router + key_path(KEY_TEXT), headers=bearer(READER_B)).status_code == 403
            # /routing (what direct mode routes with) knows the caller by its certificate too.
            r = http.get(router + "/routing")
            assert r.status_code == 200 and set(r.json()["stores"]) == {STORE}, r.text
        with httpx.Client(timeout=10, trust_env=False, verify=context(nobody)) as http:
            r = http.get(router + key_path(KEY_TEXT))
            assert r.status_code == 401 and r.json()["error"] == "unauthorized", r.text
            r = http.get(router + "/routing")
            assert r.status_code == 401 and r.json()["error"] == "unauthorized", r.text
