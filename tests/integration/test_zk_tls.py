"""ZooKeeper over TLS: `keyroute zookeeper` serving its TLS client port alone and requiring client
certificates, keyroute's clients connecting with the CA and their certificates, and x509 ACLs (identities
taken from certificates' subject DNs) keeping the ACL model of docs/security.md.

The session's ZooKeeper is plaintext; this module starts one more server, a TLS-only one, because that
server is the thing under test. Certificates come from trustme, made afresh for each run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import socket
import ssl
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trustme
from kazoo.exceptions import NoAuthError

from keyroute.client import Client
from keyroute.cluster import zk, zk_layout
from keyroute.cluster.zk_tls import subject_dn
from keyroute.dev.zookeeper_server import four_letter_word, is_serving
from keyroute.runtime.settings import ZkSettings, ZkTls
from tests.integration.small_cluster import ROWS, STORE, small_cluster
from tests.util import Proc, free_port, wait_for

pytestmark = pytest.mark.integration

# Characters Java escapes in a DN (and Python's RFC 4514 writer does not, '#' inside a value): the x509
# identity keyroute computes must still be the one ZooKeeper authenticates.
WRITER_CN = 'keyroute-writer #1, eu+"a"'
READER_CN = "keyroute-reader"


@dataclasses.dataclass(frozen=True)
class TlsZooKeeper:
    hosts: str
    folder: Path
    ca: Path
    authority: trustme.CA

    def pem(self, name: str) -> tuple[Path, Path]:
        return self.folder / f"{name}.crt", self.folder / f"{name}.key"

    def issue(self, name: str, *identities: str) -> tuple[str, str]:
        """A certificate of the same CA, for `identities`, as files."""
        _write(self.authority.issue_cert(*identities), self.folder, name)
        return str(self.folder / f"{name}.crt"), str(self.folder / f"{name}.key")

    def context(self, cert: tuple[str, str]) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca)
        ctx.load_cert_chain(*cert)
        return ctx

    def settings(self, who: str | None, **kwargs: object) -> ZkSettings:
        cert, key = self.pem(who) if who else (None, None)
        return ZkSettings(
            hosts=self.hosts,
            chroot=f"/t-{uuid.uuid4().hex[:12]}",
            session_timeout_s=4.0,
            connect_timeout_s=10.0,
            tls=ZkTls(self.ca, cert, key),
            **kwargs,  # type: ignore[arg-type]
        )


def _write(cert: trustme.LeafCert, folder: Path, name: str) -> None:
    cert.cert_chain_pems[0].write_to_path(folder / f"{name}.crt")
    cert.private_key_pem.write_to_path(folder / f"{name}.key")


@pytest.fixture(scope="module")
def tls_zk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsZooKeeper]:
    folder = tmp_path_factory.mktemp("zk-tls")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(folder / "ca.crt")
    _write(ca.issue_cert("127.0.0.1", "localhost"), folder, "server")
    _write(ca.issue_cert("keyroute-writer", common_name=WRITER_CN), folder, "writer")
    _write(ca.issue_cert("keyroute-reader", common_name=READER_CN), folder, "reader")
    _write(ca.issue_cert("stranger", common_name="stranger"), folder, "stranger")
    other = trustme.CA()  # a CA ZooKeeper does not trust, and a server certificate keyroute does not
    other.cert_pem.write_to_path(folder / "other-ca.crt")
    _write(other.issue_cert("keyroute-writer", common_name=WRITER_CN), folder, "foreign")
    port, secure_port = free_port(), free_port()
    proc = Proc(
        [
            "zookeeper",
            *("--port", str(port), "--secure-port", str(secure_port), "--tls-only"),
            *("--data-dir", str(folder / "data")),
            *("--tls-cert", str(folder / "server.crt"), "--tls-key", str(folder / "server.key")),
            *("--tls-client-ca", str(folder / "ca.crt")),
        ],
        folder / "zookeeper.log",
    ).start()
    probe = ssl.create_default_context(cafile=folder / "ca.crt")
    probe.load_cert_chain(folder / "reader.crt", folder / "reader.key")
    try:
        wait_for(
            lambda: is_serving("127.0.0.1", secure_port, probe) or not proc.alive,
            timeout_s=60,
            message="keyroute zookeeper to serve over TLS",
        )
        assert proc.alive, proc.output()
        assert f"NettyServerCnxnFactory: binding to port /127.0.0.1:{secure_port}" in proc.output()
        # The plaintext port is off.
        with pytest.raises(OSError):
            four_letter_word("127.0.0.1", port, "ruok")
        yield TlsZooKeeper(f"127.0.0.1:{secure_port}", folder, folder / "ca.crt", ca)
    finally:
        proc.stop()


def keyroute(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "keyroute", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_a_client_with_the_ca_and_a_certificate_connects_and_writes(tls_zk: TlsZooKeeper) -> None:
    client = zk.connect(tls_zk.settings("writer"))
    try:
        client.create(zk_layout.store_path("probe"), b"{}")
        assert client.get(zk_layout.store_path("probe"))[0] == b"{}"
    finally:
        zk.close(client)


def test_a_plaintext_client_is_refused_on_the_tls_port(tls_zk: TlsZooKeeper) -> None:
    plain = dataclasses.replace(tls_zk.settings(None), tls=None, connect_timeout_s=2.0)
    with pytest.raises(zk.ZkUnavailableError, match="cannot reach ZooKeeper"):
        zk.connect(plain, ensure_layout=False)


def test_a_client_without_a_certificate_is_refused_in_one_line(tls_zk: TlsZooKeeper) -> None:
    with pytest.raises(zk.ZkUnavailableError, match=r"^TLS with ZooKeeper at .* failed \(.*\)$"):
        zk.connect(tls_zk.settings(None), ensure_layout=False)
    # A certificate from a CA ZooKeeper does not trust: the same.
    foreign = dataclasses.replace(tls_zk.settings(None), tls=ZkTls(tls_zk.ca, *tls_zk.pem("foreign")))
    with pytest.raises(zk.ZkUnavailableError, match="^TLS with ZooKeeper"):
        zk.connect(foreign, ensure_layout=False)
    # The command line: one line naming ZooKeeper and the reason, exit 1, no traceback.
    done = keyroute("zk", "dump", "--zk", tls_zk.hosts + "/x", "--zk-tls-ca", str(tls_zk.ca), "--out", "-")
    assert done.returncode == 1, done
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"TLS with ZooKeeper at {tls_zk.hosts} failed" in done.stderr


def test_an_untrusted_server_certificate_is_refused_in_one_line(tls_zk: TlsZooKeeper) -> None:
    cert, key = tls_zk.pem("writer")
    done = keyroute(
        *("zk", "dump", "--zk", tls_zk.hosts + "/x", "--out", "-"),
        *("--zk-tls-ca", str(tls_zk.folder / "other-ca.crt"), "--zk-tls-cert", str(cert), "--zk-tls-key", str(key)),
    )
    assert done.returncode == 1, done
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert "TLS with ZooKeeper" in done.stderr and "certificate verify failed" in done.stderr, done.stderr


def test_missing_tls_files_are_one_line(tls_zk: TlsZooKeeper, tmp_path: Path) -> None:
    done = keyroute("zk", "dump", "--zk", tls_zk.hosts, "--zk-tls-ca", str(tmp_path / "nope.crt"), "--out", "-")
    assert done.returncode == 1, done
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert "ZooKeeper TLS CA" in done.stderr and "nope.crt" in done.stderr


def test_x509_acls_keep_the_reader_to_reading_and_everyone_else_out(tls_zk: TlsZooKeeper) -> None:
    reader_dn = subject_dn(tls_zk.pem("reader")[0])
    writer_settings = tls_zk.settings("writer", reader_dn=reader_dn)
    writer = zk.connect(writer_settings)
    chroot = writer_settings.chroot
    try:
        writer.create(zk_layout.store_path("fares"), b"v1")
        acl, _ = writer.get_acls(zk_layout.store_path("fares"))
        assert {(e.perms, e.id.scheme, e.id.id) for e in acl} == {
            (31, "x509", subject_dn(tls_zk.pem("writer")[0])),
            (1, "x509", reader_dn),
        }
        assert '\\#1\\, eu\\+\\"a\\"' in subject_dn(tls_zk.pem("writer")[0])  # as Java escapes it

        # The routers' identity reads, and may not write, what the writers own.
        reader = zk.connect(dataclasses.replace(tls_zk.settings("reader"), chroot=chroot), ensure_layout=False)
        try:
            assert reader.get(zk_layout.store_path("fares"))[0] == b"v1"
            with pytest.raises(NoAuthError):
                reader.set(zk_layout.store_path("fares"), b"hijacked")
            with pytest.raises(NoAuthError):
                reader.create(zk_layout.store_path("other"), b"{}")
        finally:
            zk.close(reader)
        # As a writer it is refused at once, in one line.
        as_writer = dataclasses.replace(tls_zk.settings("reader"), chroot=chroot)
        with pytest.raises(zk.ZkAccessError, match="x509 identity 'CN=keyroute-reader"):
            zk.connect(as_writer)

        # Another certificate of the same CA: connected, but it may not even read.
        stranger = zk.connect(dataclasses.replace(tls_zk.settings("stranger"), chroot=""), ensure_layout=False)
        try:
            with pytest.raises(NoAuthError):
                stranger.get(chroot + zk_layout.store_path("fares"))
        finally:
            zk.close(stranger)
        assert writer.get(zk_layout.store_path("fares"))[0] == b"v1"
    finally:
        zk.close(writer)


def test_a_cluster_on_tls_everywhere_answers_every_key(tls_zk: TlsZooKeeper, tmp_path: Path) -> None:
    """ZooKeeper with client TLS (identities from certificates), 3 nodes and a router on HTTPS with mutual
    TLS between them, the router requiring client certificates: every key answers (small_cluster checks
    each through the router), and the Python client reads them over HTTPS."""
    reader_dn = subject_dn(tls_zk.pem("reader")[0])
    settings = tls_zk.settings("writer", reader_dn=reader_dn)  # the harness publishes as the writer
    writer_cert, writer_key = (str(p) for p in tls_zk.pem("writer"))
    reader_cert, reader_key = (str(p) for p in tls_zk.pem("reader"))

    def own(name: str) -> list[str]:
        role = "router" if name == "router" else "node"
        cert, key = tls_zk.issue(f"member-{name}", "127.0.0.1", f"keyroute-{role}.{name}.cluster")
        # Towards ZooKeeper, nodes are the writer (granting the routers' DN READ), the router the reader.
        zk_cert, zk_key = (reader_cert, reader_key) if role == "router" else (writer_cert, writer_key)
        extra = ["--router-id", name] if role == "router" else ["--zk-reader-dn", reader_dn]
        return ["--tls-cert", cert, "--tls-key", key, "--zk-tls-cert", zk_cert, "--zk-tls-key", zk_key, *extra]

    client = tls_zk.issue("https-client", "client.example")
    ca = str(tls_zk.ca)
    with small_cluster(
        tmp_path,
        settings,
        extra_args=["--member-ca", ca, "--zk-tls-ca", ca],
        router_args=["--tls-client-ca", ca],
        own_args=own,
        scheme="https",
        http_options={"verify": tls_zk.context(client)},
        node_ids=("n1", "n2", "n3"),
    ) as cluster:
        assert set(cluster.node_urls) == {"n1", "n2", "n3"}
        with Client(cluster.router_url, verify=ca, cert=client) as kr:
            assert all(kr.get(STORE, key).value == ROWS[key] for key in ROWS)
        # What a node registered is the writer's, readable by the router's identity only.
        reader = zk.connect(dataclasses.replace(tls_zk.settings("reader"), chroot=settings.chroot), ensure_layout=False)
        try:
            acl, _ = reader.get_acls(zk_layout.node_path("n1"))
        finally:
            zk.close(reader)
        assert {(e.perms, e.id.id) for e in acl} == {(31, subject_dn(tls_zk.pem("writer")[0])), (1, reader_dn)}


@contextmanager
def tls_listener(cert: trustme.LeafCert) -> Iterator[int]:
    """A TLS port on 127.0.0.1 presenting `cert`: what a client meets before any ZooKeeper word is said."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    cert.configure_cert(ctx)
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.settimeout(5)
            with contextlib.suppress(OSError), ctx.wrap_socket(conn, server_side=True):
                pass
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        server.close()


@pytest.mark.parametrize(
    ("identities", "not_after", "reason"),
    [
        (("127.0.0.1",), datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC), "certificate has expired"),
        (("zookeeper.elsewhere.example",), None, "mismatch"),
    ],
)
def test_an_expired_or_wrong_host_server_certificate_is_refused_in_one_line(
    tls_zk: TlsZooKeeper, identities: tuple[str, ...], not_after: datetime.datetime | None, reason: str
) -> None:
    kwargs = {"not_before": datetime.datetime(2019, 1, 1, tzinfo=datetime.UTC), "not_after": not_after}
    cert = tls_zk.authority.issue_cert(*identities, **(kwargs if not_after else {}))
    with tls_listener(cert) as port:
        settings = dataclasses.replace(tls_zk.settings("writer"), hosts=f"127.0.0.1:{port}", connect_timeout_s=60)
        with pytest.raises(zk.ZkUnavailableError) as refused:
            zk.connect(settings, ensure_layout=False)
    message = str(refused.value)
    assert message.startswith(f"TLS with ZooKeeper at 127.0.0.1:{port} failed (") and reason in message, message
    assert "\n" not in message and "_ssl.c" not in message  # OpenSSL's source line is no help to a user
