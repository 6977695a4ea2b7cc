"""A cluster on TLS everywhere over HTTP: two nodes and a router serving HTTPS, mutual TLS between members
(--member-ca), client certificates required on the router. Every key answers; a client without a certificate
gets only the probes (as the kubelet's HTTPS probes do) and 403 for a read, on the router and on a node; a
certificate from another CA is refused by nodes, and a member-CA certificate that names no
member role cannot steer forwarding; a certificate rotated on disk is served to new connections while a
kept-alive one goes on; the Python client reads over HTTPS through the router and directly from nodes; the
router's and nodes' /metrics show when the certificate each serves ends."""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import trustme
from cryptography import x509
from prometheus_client.parser import text_string_to_metric_families

from keyroute.client import Client
from keyroute.runtime.settings import ZkSettings
from keyroute.storage.ranges import make_range_cursor
from tests.integration.small_cluster import (
    PARTITIONS,
    ROWS,
    STORE,
    SmallCluster,
    expected,
    key_path,
    partition,
    small_cluster,
)
from tests.util import free_port, wait_for

pytestmark = pytest.mark.integration


class Pki:
    """The cluster's CA and every certificate of the test, as files under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca = trustme.CA()
        self.ca_file = str(root / "member-ca.pem")
        self.ca.cert_pem.write_to_path(self.ca_file)

    def issue(self, name: str, *identities: str, ca: trustme.CA | None = None) -> tuple[str, str]:
        issued = (ca or self.ca).issue_cert(*identities)
        cert, key = self.root / f"{name}.crt", self.root / f"{name}.key"
        issued.cert_chain_pems[0].write_to_path(str(cert))
        issued.private_key_pem.write_to_path(str(key))
        return str(cert), str(key)

    def context(self, cert: tuple[str, str] | None) -> ssl.SSLContext:
        """A client's: the cluster's CA trusted, `cert` presented."""
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if cert is not None:
            ctx.load_cert_chain(*cert)
        return ctx

    @contextmanager
    def connect(self, port: int, cert: tuple[str, str] | None) -> Iterator[ssl.SSLSocket]:
        """A TLS connection to 127.0.0.1:`port` presenting `cert`."""
        ctx = self.context(cert)
        with (
            socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
        ):
            yield tls


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    (tmp_path / "pki").mkdir()
    return Pki(tmp_path / "pki")


@pytest.fixture
def cluster(tmp_path: Path, zk_settings: ZkSettings, pki: Pki) -> Iterator[SmallCluster]:
    def own(name: str) -> list[str]:
        role = "router" if name == "router" else "node"
        cert, key = pki.issue(name, "127.0.0.1", "localhost", f"keyroute-{role}.{name}.cluster")
        return ["--tls-cert", cert, "--tls-key", key, *(["--router-id", name] if role == "router" else [])]

    client = pki.issue("client", "client.example")
    with small_cluster(
        tmp_path / "cluster",
        zk_settings,
        extra_args=["--member-ca", pki.ca_file],
        router_args=["--tls-client-ca", pki.ca_file],
        own_args=own,
        scheme="https",
        http_options={"verify": pki.context(client)},
    ) as c:
        yield c


def get_over(ctx: ssl.SSLContext, url: str, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    with httpx.Client(verify=ctx, timeout=10, trust_env=False) as http:
        return http.get(url + path, headers=headers)


def serial_served(pki: Pki, port: int, cert: tuple[str, str]) -> int:
    with pki.connect(port, cert) as tls:
        return int(tls.getpeercert()["serialNumber"], 16)


def test_a_tls_cluster_serves_members_and_certified_clients_only(
    tmp_path: Path, cluster: SmallCluster, pki: Pki
) -> None:
    client = (str(pki.root / "client.crt"), str(pki.root / "client.key"))
    nodes = cluster.node_urls
    assert all(url.startswith("https://") for url in nodes.values())
    # The nodes registered https:// addresses: the router reached them over TLS for every key (small_cluster).
    r = get_over(pki.context(client), cluster.router_url, "/readyz")
    assert r.status_code == 200 and r.json()["complete"] is True

    # No client certificate, as the kubelet probes: /healthz and /readyz answer, on the router and on a node;
    # a read is refused with 403 (the node's names its member CA option), and the connection closed after it.
    for url, option in ((cluster.router_url, "--tls-client-ca"), (nodes["n1"], "--member-ca")):
        assert get_over(pki.context(None), url, "/healthz").status_code == 200
        assert get_over(pki.context(None), url, "/readyz").status_code == 200
        r = get_over(pki.context(None), url, key_path("C001"))
        assert r.status_code == 403 and r.json()["error"] == "client_certificate_required"
        assert option in r.json()["message"] and r.headers["connection"] == "close"
    # A node certificate from another CA: the nodes refuse it.
    rogue = pki.issue("rogue", "127.0.0.1", "keyroute-node.n9.cluster", ca=trustme.CA())
    with pytest.raises(httpx.TransportError):
        get_over(pki.context(rogue), nodes["n1"], key_path("C001"))

    # A certificate of the cluster's CA without a member role reads from a node, but its hop count is a
    # client's: the node forwards the read anyway. A member's certificate makes the same hop count count.
    member = pki.issue("member", "127.0.0.1", "keyroute-node.n9.cluster")
    serving = cluster.serving()
    key = next(k for k in ROWS if serving[partition(k)] == ["n1"])
    forged = {"x-keyroute-hops": "1"}
    r = get_over(pki.context(client), nodes["n2"], key_path(key), forged)
    assert r.status_code == 200 and r.json() == expected(key)
    assert r.headers["x-keyroute-forwarded-by"] == "n2"
    r = get_over(pki.context(member), nodes["n2"], key_path(key), forged)
    assert r.status_code == 503 and r.json()["error"] == "partition_unavailable"

    # The Python client over HTTPS, through the router and directly from the nodes.
    with Client(cluster.router_url, verify=pki.ca_file, cert=client) as kr:
        assert all(kr.get("bookings", k).value == ROWS[k] for k in ROWS)
    with Client(cluster.router_url, verify=pki.ca_file, cert=client, routing="direct") as kr:
        assert all(kr.get("bookings", k).value == ROWS[k] for k in ROWS)
        assert kr.stats["direct"] == len(ROWS)

    # Range cursors are signed with the cluster's key, though there is no cluster secret: one signed with the
    # empty key is refused.
    r = get_over(pki.context(client), cluster.router_url, f"/stores/{STORE}/range?limit=1")
    assert r.status_code == 200 and "next" in r.json(), r.text
    paged = get_over(
        pki.context(client), cluster.router_url, f"/stores/{STORE}/range?limit=1&cursor={r.json()['next']}"
    )
    assert paged.status_code == 200 and paged.json()["keys"][0]["key"] > r.json()["keys"][0]["key"], paged.text
    forged = make_range_cursor(b"", (STORE, None, None, None), [1] * PARTITIONS, r.json()["keys"][0]["key"].encode())
    r = get_over(pki.context(client), cluster.router_url, f"/stores/{STORE}/range?limit=1&cursor={forged}")
    assert r.status_code == 400 and r.json()["error"] == "bad_cursor", r.text

    # Each member's /metrics shows when the certificate it serves ends, as the file says.
    for url, name in ((cluster.router_url, "router"), (nodes["n1"], "n1")):
        served = pki.root / f"{name}.crt"
        not_after = x509.load_pem_x509_certificate(served.read_bytes()).not_valid_after_utc.timestamp()
        assert certificate_ends(get_over(pki.context(client), url, "/metrics").text) == {
            ("server", str(served)): not_after
        }

    # Plain HTTP on the router's TLS port: the connection ends (never a hang).
    port = int(cluster.router_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as plain:
        plain.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        received = b""
        while chunk := plain.recv(65536):
            received += chunk
    assert received == b"" or received[:1] == b"\x15" or received.startswith(b"HTTP/1.1 400")

    # The router's certificate rotated on disk: new connections get it, an open keep-alive one goes on.
    before = serial_served(pki, port, client)
    with pki.connect(port, client) as kept:
        request = f"GET {key_path('C002')} HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n".encode()
        kept.sendall(request)
        assert read_head(kept).startswith(b"HTTP/1.1 200 OK")
        pki.issue("router", "127.0.0.1", "localhost", "keyroute-router.router.cluster")
        wait_for(lambda: serial_served(pki, port, client) != before, timeout_s=30, message="the new certificate")
        kept.sendall(request)
        assert read_head(kept).startswith(b"HTTP/1.1 200 OK")
    assert "uses a new TLS certificate" in cluster.procs[-1].output()


def certificate_ends(exposition: str) -> dict[tuple[str, str], float]:
    """(role, file) -> end of each certificate keyroute_tls_certificate_not_after_seconds shows."""
    [family] = [
        f for f in text_string_to_metric_families(exposition) if f.name == "keyroute_tls_certificate_not_after_seconds"
    ]
    return {(s.labels["role"], s.labels["path"]): s.value for s in family.samples}


def read_head(sock: ssl.SSLSocket) -> bytes:
    """An answer's head and as much of its body as came with it (enough to see its status)."""
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(65536)
        if not chunk:
            break
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    length = next(
        (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")),
        0,
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return received


@pytest.mark.parametrize(
    "command",
    [["node", "--node-id", "n1", "--data-dir", "data", "--member-ca", "CA"], ["router", "--workers", "2"]],
    ids=["node", "router-workers"],
)
def test_a_member_whose_certificate_is_missing_does_not_start(tmp_path: Path, pki: Pki, command: list[str]) -> None:
    missing = str(tmp_path / "gone.crt")
    args = [pki.ca_file if a == "CA" else str(tmp_path / a) if a == "data" else a for a in command]
    done = subprocess.run(
        [sys.executable, "-m", "keyroute", *args, "--zk", "127.0.0.1:1", "--port", str(free_port())]
        + ["--tls-cert", missing, "--tls-key", missing],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() + done.stdout.splitlines() if "did not start" in line]
    assert len(lines) == 1 and f"cannot read the TLS certificate {missing}" in lines[0], done.stderr
    assert "Traceback" not in done.stderr + done.stdout
