"""What each role may do, cell by cell (docs/security.md, "What each role may do"), on a real cluster: two
`keyroute node` processes and a `keyroute router` on HTTPS with mutual TLS between members, the session's
ZooKeeper, access control and an admin token on, and two CAs: the members' (--member-ca) and the clients'
(--tls-client-ca). Every certificate is a real one of those CAs (trustme):

    caller     a certificate of the clients' CA (and, to read, a token of the token file)
    router     the router's certificate, keyroute-router.r1.cluster, of the members' CA
    node       a node's certificate, keyroute-node.n1.cluster or spiffe://cluster.local/keyroute/node/n2, of
               the members' CA
    operator   the admin token (over a caller's TLS connection)

and the certificates that must not work: one of the members' CA naming no role, one of the clients' CA
naming a member role, a node's certificate used for another node id, a router's used as a node's."""

from __future__ import annotations

import contextlib
import ssl
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme
from kazoo.exceptions import NoNodeError
from starlette.applications import Starlette

from keyroute.cluster import zk, zk_layout
from keyroute.cluster.partition_map import ServingRecord
from keyroute.dev.zookeeper_server import EmbeddedZooKeeper
from keyroute.http import HttpServer
from keyroute.runtime.settings import TlsSettings, ZkSettings
from tests.integration.small_cluster import (
    ADMIN_TOKEN,
    ROWS,
    STORE,
    SmallCluster,
    expected,
    key_path,
    partition,
    small_cluster,
)
from tests.member_pki import write_with_uri
from tests.util import free_port, serve_in_thread, wait_for

pytestmark = pytest.mark.integration

READER = "reader-t0ken"
Cert = tuple[str, str]


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


class Pki:
    """The members' CA, the clients' CA and every certificate of the test, as files under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.members, self.clients = trustme.CA(), trustme.CA()
        self.member_ca, self.client_ca = str(root / "members.pem"), str(root / "clients.pem")
        self.members.cert_pem.write_to_path(self.member_ca)
        self.clients.cert_pem.write_to_path(self.client_ca)

    def issue(self, name: str, ca: trustme.CA, *identities: str) -> Cert:
        issued = ca.issue_cert(*identities)
        cert, key = self.root / f"{name}.crt", self.root / f"{name}.key"
        issued.cert_chain_pems[0].write_to_path(str(cert))
        issued.private_key_pem.write_to_path(str(key))
        return str(cert), str(key)

    def context(self, cert: Cert) -> ssl.SSLContext:
        """A TLS client's context: the servers' CA (the members') trusted, `cert` presented."""
        ctx = ssl.create_default_context(cafile=self.member_ca)
        ctx.load_cert_chain(*cert)
        return ctx


class Certs:
    def __init__(self, pki: Pki) -> None:
        members, clients = pki.members, pki.clients
        self.n1 = pki.issue("n1", members, "127.0.0.1", "keyroute-node.n1.cluster")
        # Node n2 is named by a SPIFFE ID (its DNS names then are host names only).
        self.n2 = write_with_uri(pki.root, "n2", members, "spiffe://cluster.local/keyroute/node/n2", "127.0.0.1")
        self.router = pki.issue("router", members, "127.0.0.1", "keyroute-router.r1.cluster")
        self.caller = pki.issue("caller", clients, "app.example")
        # Not to be honoured: a members' CA certificate without a role, a clients' CA one naming node n1.
        self.nobody = pki.issue("nobody", members, "nobody.cluster")
        self.claim = pki.issue("claim", clients, "127.0.0.1", "keyroute-node.n1.cluster")
        self.claim_n3 = pki.issue("claim-n3", clients, "127.0.0.1", "keyroute-node.n3.cluster")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("member-roles-pki"))


@pytest.fixture(scope="module")
def certs(pki: Pki) -> Certs:
    return Certs(pki)


@pytest.fixture(scope="module")
def zk_chroot(zk_server: EmbeddedZooKeeper) -> ZkSettings:
    return ZkSettings(hosts=zk_server.connect_string, chroot=f"/t-{uuid.uuid4().hex[:12]}", session_timeout_s=4)


@pytest.fixture(scope="module")
def cluster(
    zk_chroot: ZkSettings, tmp_path_factory: pytest.TempPathFactory, pki: Pki, certs: Certs
) -> Iterator[SmallCluster]:
    tmp_path = tmp_path_factory.mktemp("member-roles")
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[[tokens]]\nname = "reader"\ntoken = "{READER}"\nstores = ["{STORE}"]\n', encoding="utf-8")
    own = {"n1": certs.n1, "n2": certs.n2, "router": certs.router}

    def own_args(name: str) -> list[str]:
        cert, key = own[name]
        return ["--tls-cert", cert, "--tls-key", key, *(["--router-id", "r1"] if name == "router" else [])]

    with small_cluster(
        tmp_path,
        zk_chroot,
        extra_args=["--member-ca", pki.member_ca, "--tls-client-ca", pki.client_ca]
        + ["--access-tokens", str(tokens), "--admin-token", ADMIN_TOKEN],
        own_args=own_args,
        scheme="https",
        http_options={"verify": pki.context(certs.caller), "headers": bearer(READER)},
    ) as c:
        yield c


def over(pki: Pki, cert: Cert, method: str, url: str, headers: dict[str, str], json: object = None) -> httpx.Response:
    with httpx.Client(verify=pki.context(cert), timeout=10, trust_env=False) as http:
        return http.request(method, url, headers=headers, json=json)


def key_served_by(cluster: SmallCluster, node: str) -> str:
    serving = cluster.serving()
    return next(k for k in ROWS if serving[partition(k)] == [node])


def test_only_members_read_a_store_without_a_caller_credential(cluster: SmallCluster, pki: Pki, certs: Certs) -> None:
    key = key_served_by(cluster, "n1")
    url = cluster.node_urls["n1"] + key_path(key)
    for cert in (certs.router, certs.n2):
        r = over(pki, cert, "GET", url, {})
        assert r.status_code == 200 and r.json() == expected(key), r.text
    assert over(pki, certs.caller, "GET", url, bearer(READER)).json() == expected(key)
    for cert, headers in ((certs.caller, {}), (certs.nobody, {}), (certs.caller, bearer(ADMIN_TOKEN))):
        r = over(pki, cert, "GET", url, headers)
        assert r.status_code == 401 and r.json()["error"] == "unauthorized", (cert, r.text)


def test_member_headers_count_only_within_the_certificates_role_and_id(
    cluster: SmallCluster, pki: Pki, certs: Certs
) -> None:
    key = key_served_by(cluster, "n1")
    url = cluster.node_urls["n2"] + key_path(key)  # n2 does not serve it: it forwards unless told it was
    hops = {"x-keyroute-hops": "1"}

    # A caller's hop count, or one from a members' CA certificate without a role: ignored, n2 forwards.
    for cert in (certs.caller, certs.nobody):
        r = over(pki, cert, "GET", url, {**hops, "x-keyroute-forwarded-by": "n1", **bearer(READER)})
        assert r.status_code == 200 and r.json() == expected(key), r.text
        assert r.headers["x-keyroute-forwarded-by"] == "n2"
    # Node n1's certificate forwarding as itself: honoured, n2 does not forward again.
    for headers in (hops, {**hops, "x-keyroute-forwarded-by": "n1"}):
        r = over(pki, certs.n1, "GET", url, headers)
        assert r.status_code == 503 and r.json()["error"] == "partition_unavailable", r.text
    # ...as another node, or a router's certificate forwarding as a node: refused.
    r = over(pki, certs.n1, "GET", url, {**hops, "x-keyroute-forwarded-by": "n2"})
    assert r.status_code == 403 and r.json()["error"] == "forbidden", r.text
    assert "node n1 may not speak for node 'n2'" in r.json()["message"]
    batch = over(
        pki,
        certs.n1,
        "POST",
        cluster.node_urls["n2"] + f"/stores/{STORE}/batch-get",
        {**hops, "x-keyroute-forwarded-by": "n2"},
        {"keys": [key]},
    )
    assert batch.status_code == 403 and batch.json()["error"] == "forbidden", batch.text
    r = over(pki, certs.router, "GET", url, hops)
    assert r.status_code == 403 and "router r1 may not forward as a node" in r.json()["message"], r.text
    # A router's own headers: honoured, the caller it names read for.
    r = over(pki, certs.router, "GET", url, {"x-keyroute-router": "1", "x-keyroute-caller": "reader"})
    assert r.status_code == 200 and r.json() == expected(key), r.text
    # The operator's admin token is no caller credential, and makes no member.
    r = over(pki, certs.caller, "GET", url, {**hops, **bearer(ADMIN_TOKEN)})
    assert r.status_code == 401, r.text


def test_admin_endpoints_are_the_operators_only(cluster: SmallCluster, pki: Pki, certs: Certs) -> None:
    for base in (cluster.node_urls["n1"], cluster.router_url):
        url = base + "/admin/partition-map"
        assert over(pki, certs.caller, "GET", url, bearer(ADMIN_TOKEN)).status_code == 200
        r = over(pki, certs.caller, "GET", url, bearer(READER))
        assert r.status_code == 403 and r.json()["error"] == "forbidden", r.text
        assert over(pki, certs.caller, "GET", url, {}).status_code == 401
    url = cluster.node_urls["n1"] + "/admin/partition-map"
    for cert in (certs.router, certs.n2, certs.nobody):
        r = over(pki, cert, "GET", url, {})
        assert r.status_code == 401 and r.json()["error"] == "unauthorized", (cert, r.text)


def test_a_certificate_naming_a_member_role_is_refused_where_it_is_no_members(
    cluster: SmallCluster, pki: Pki, certs: Certs
) -> None:
    key = key_served_by(cluster, "n1")
    # The router serves callers: a certificate of the clients' CA naming a member role is refused (403, the
    # connection closed); a member's certificate is not even a client's there (the members' CA is not its
    # --tls-client-ca: the handshake fails).
    r = over(pki, certs.claim, "GET", cluster.router_url + key_path(key), bearer(READER))
    assert r.status_code == 403 and r.json()["error"] == "member_certificate_refused", r.text
    assert r.headers["connection"] == "close"
    for cert in (certs.n1, certs.router):
        with pytest.raises(httpx.TransportError):
            over(pki, cert, "GET", cluster.router_url + key_path(key), bearer(READER))
    assert over(pki, certs.caller, "GET", cluster.router_url + key_path(key), bearer(READER)).status_code == 200
    # A node refuses the clients' CA naming node n1 (the real n1's certificate reads as a member).
    r = over(pki, certs.claim, "GET", cluster.node_urls["n2"] + key_path(key), {"x-keyroute-hops": "1"})
    assert r.status_code == 403 and r.json()["error"] == "member_certificate_refused", r.text
    assert "not issued by this node's --member-ca" in r.json()["message"]


def start(
    command: list[str], zk_settings: ZkSettings, cert: Cert, pki: Pki, tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-m", "keyroute", *command, "--zk", zk_settings.connect_string, "--port", str(free_port())]
    args += ["--tls-cert", cert[0], "--tls-key", cert[1], "--member-ca", pki.member_ca]
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=tmp_path)


@pytest.mark.parametrize(
    ("role", "who", "said"),
    [
        ("node", "n1", "names node n1, not node n3"),  # a node's certificate for another node id
        ("node", "router", "names router r1, not node n3"),  # a router's certificate acting as a node
        ("node", "nobody", "names no member identity"),  # no role
        ("node", "claim_n3", "is not issued by the member CA"),  # the clients' CA naming a member role
        ("router", "n1", "names node n1, not router r1"),
    ],
)
def test_a_member_starts_only_with_a_certificate_naming_its_own_role_and_id(
    cluster: SmallCluster, zk_chroot: ZkSettings, pki: Pki, certs: Certs, tmp_path: Path, role: str, who: str, said: str
) -> None:
    command = (
        ["node", "--node-id", "n3", "--data-dir", str(tmp_path / "n3")]
        if role == "node"
        else ["router", "--router-id", "r1"]
    )
    done = start(command, zk_chroot, getattr(certs, who), pki, tmp_path)
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() + done.stdout.splitlines() if "did not start" in line]
    assert len(lines) == 1 and said in lines[0], done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    client = zk.connect(zk_chroot, ensure_layout=False)
    try:
        assert sorted(client.get_children(zk_layout.NODES)) == ["n1", "n2"]  # n3 registered nothing
    finally:
        zk.close(client)


class Counting:
    """A data plane that counts what reaches it (a machine posing as a node: nothing may)."""

    def __init__(self) -> None:
        self.requests = 0

    def accepts(self, method: str, path: bytes) -> bool:
        return True

    def handle(self, exchange: Any) -> None:
        self.requests += 1
        exchange.answer(200, [(b"content-type", b"application/json")], b'{"posing": true}')


def test_a_node_registering_another_nodes_id_gets_none_of_its_reads(
    cluster: SmallCluster, zk_chroot: ZkSettings, pki: Pki, certs: Certs
) -> None:
    """A machine with node n9's certificate (and the ZooKeeper writer's credentials, which every node shares)
    registers an address as node n7's, serving n1's partitions: routers and nodes connect to it, find a
    certificate of n9 at n7's address, and send every read to n1 instead."""
    served = cluster.serving()
    held = {p for p, nodes in served.items() if nodes == ["n1"]}
    keys = [k for k in ROWS if partition(k) in held]
    plane = Counting()
    n9 = pki.issue("n9", pki.members, "127.0.0.1", "keyroute-node.n9.cluster")
    posing = HttpServer(
        Starlette(),
        data_plane=lambda state: plane,
        tls=TlsSettings(cert=n9[0], key=n9[1]),
        require_ca=pki.member_ca,
    )
    client = zk.connect(zk_chroot, ensure_layout=False)
    try:
        with serve_in_thread(posing) as port:
            url = f"https://127.0.0.1:{port}"
            record = ServingRecord("n7", url, {STORE: dict.fromkeys(held, 1)})
            client.create(zk_layout.serving_path("n7"), record.to_json(), ephemeral=True, makepath=True)
            wait_for(
                lambda: any("n7" in nodes for nodes in cluster.serving().values()),
                timeout_s=30,
                message="the router to see n7's serving record",
            )
            with httpx.Client(verify=pki.context(certs.caller), timeout=10, trust_env=False) as http:
                for _ in range(3):
                    for key in keys:
                        r = http.get(cluster.router_url + key_path(key), headers=bearer(READER))
                        assert r.status_code == 200 and r.json() == expected(key), r.text
                        assert r.headers["x-keyroute-node"] == "n1"
                        # n2 does not hold the key: it forwards, to n1 or n7; only n1 answers.
                        r = http.get(cluster.node_urls["n2"] + key_path(key), headers=bearer(READER))
                        assert r.status_code == 200 and r.headers["x-keyroute-node"] == "n1", r.text
            assert plane.requests == 0
    finally:
        with contextlib.suppress(NoNodeError):
            client.delete(zk_layout.serving_path("n7"))
        zk.close(client)
    said = f"TLS with {url} failed: its certificate names node n9, but n7 registered that address"
    wait_for(lambda: said in cluster.logs(), timeout_s=10, message="the refusal in the router's log")
