"""keyroute.http.tls and the server over HTTPS: contexts, one-line errors, reload on rotation (also by a
symlink swap, as Kubernetes Secret volumes do), client certificates (and the probes answered without one),
plaintext on a TLS port, member roles."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import os
import shutil
import socket
import ssl
import subprocess
import types
from collections.abc import Iterator
from contextlib import asynccontextmanager as contextmanager_async
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest
import trustme
from starlette.applications import Starlette
from starlette.requests import Request as StarletteRequest
from starlette.responses import JSONResponse
from starlette.routing import Route

from keyroute.api import Forbidden
from keyroute.auth.security import (
    ClusterAuth,
    MemberIdentity,
    check_member_headers,
    member_identity,
    member_role,
    names_member_role,
)
from keyroute.cluster.partition_map import ServingRecord
from keyroute.http import HttpServer
from keyroute.http.exchange import Exchange, ServerLimits
from keyroute.http.fast_upstream import FastUpstream
from keyroute.http.lifespan import StartupError
from keyroute.http.tls import (
    MemberTls,
    PeerCheck,
    ServerTls,
    TlsError,
    describe,
    member_context,
    member_tls,
    peer_role,
    server_context,
)
from keyroute.http.upstream import UpstreamUnavailable
from keyroute.runtime.settings import TlsSettings
from tests.member_pki import write_with_uri
from tests.unit.http.harness import Answer, Plane, closed_by_server, get, starlette_app
from tests.unit.http.harness import read_answer as read_http_answer
from tests.util import serve_in_thread, wait_for


def pair(tmp_path: Path, ca: trustme.CA, name: str, *identities: str) -> TlsSettings:
    """A certificate for `identities` (127.0.0.1 by default) and its key, written under `tmp_path`."""
    issued = ca.issue_cert(*(identities or ("127.0.0.1",)))
    cert, key = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
    issued.cert_chain_pems[0].write_to_path(str(cert))
    issued.private_key_pem.write_to_path(str(key))
    return TlsSettings(cert=str(cert), key=str(key))


def ca_file(tmp_path: Path, ca: trustme.CA, name: str = "ca") -> str:
    path = tmp_path / f"{name}.pem"
    ca.cert_pem.write_to_path(str(path))
    return str(path)


def serial_served(port: int, ca_path: str, cert: tuple[str, str] | None = None) -> int:
    """The serial number of the certificate a new connection to `port` is served."""
    ctx = ssl.create_default_context(cafile=ca_path)
    if cert is not None:
        ctx.load_cert_chain(*cert)
    with tls_connection(port, ctx) as tls:
        return int(tls.getpeercert()["serialNumber"], 16)


@contextmanager
def tls_connection(port: int, ctx: ssl.SSLContext) -> Iterator[ssl.SSLSocket]:
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as sock,
    ):
        yield sock


def read_answer(sock: Any) -> bytes:
    received = b""
    while b"\r\n\r\n" not in received or not received.endswith(b" "):
        chunk = sock.recv(65536)
        if not chunk:
            break
        received += chunk
    return received


# -- contexts and their errors --------------------------------------------------------------------------


def test_a_server_context_speaks_tls_12_or_later(tmp_path: Path) -> None:
    ctx = server_context(pair(tmp_path, trustme.CA(), "s"))
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2
    assert ctx.verify_mode == ssl.CERT_NONE


def test_missing_and_unreadable_files_are_one_line(tmp_path: Path) -> None:
    tls = pair(tmp_path, trustme.CA(), "s")
    with pytest.raises(TlsError) as missing:
        server_context(TlsSettings(cert=str(tmp_path / "nope.crt"), key=tls.key))
    assert str(missing.value) == f"cannot read the TLS certificate {tmp_path / 'nope.crt'}: no such file or directory"
    with pytest.raises(TlsError) as no_ca:
        server_context(tls, require_ca=str(tmp_path))
    assert "client CA file" in str(no_ca.value) and "\n" not in str(no_ca.value)


def test_a_key_of_another_certificate_or_a_file_that_is_no_pem_is_refused(tmp_path: Path) -> None:
    ca = trustme.CA()
    one, other = pair(tmp_path, ca, "one"), pair(tmp_path, ca, "other")
    with pytest.raises(TlsError, match="cannot be used together .*key values mismatch"):
        server_context(TlsSettings(cert=one.cert, key=other.key))
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(TlsError, match="cannot be used together"):
        server_context(TlsSettings(cert=str(junk), key=one.key))
    with pytest.raises(TlsError, match="holds no PEM certificate"):
        member_context(TlsSettings(cert=one.cert, key=one.key, member_ca=str(junk)))


def test_settings_want_both_files_and_a_certificate_for_a_ca(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="go together"):
        TlsSettings(cert="a.crt")
    with pytest.raises(ValueError, match="need --tls-cert"):
        TlsSettings(member_ca="ca.pem")
    assert not TlsSettings().enabled


def test_describe_names_the_reason_in_a_few_words(tmp_path: Path) -> None:
    expired = ssl.SSLCertVerificationError(1, "certificate verify failed")
    expired.verify_message = "certificate has expired"
    assert describe(expired) == "its certificate has expired"
    wrong = ssl.SSLCertVerificationError(1, "x")
    wrong.verify_message = "Hostname mismatch, certificate is not valid for 'n1'."
    assert describe(wrong).startswith("its certificate is not for this host")
    selfsigned = ssl.SSLCertVerificationError(1, "x")
    selfsigned.verify_message = "self-signed certificate"
    assert "self-signed" in describe(selfsigned)
    untrusted = ssl.SSLCertVerificationError(1, "x")
    untrusted.verify_message = "unable to get local issuer certificate"
    assert describe(untrusted).startswith("its certificate is not from a trusted CA")


# -- rotation -----------------------------------------------------------------------------------------


def test_a_rotated_pair_is_a_new_context_and_an_invalid_one_keeps_the_previous(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ca = trustme.CA()
    tls = pair(tmp_path, ca, "s")
    reloading = ServerTls(tls, name="router")
    first = reloading.context
    assert reloading.check() is False  # nothing changed
    pair(tmp_path, ca, "s")  # same paths, a new certificate and key
    assert reloading.check() is True
    second = reloading.context
    assert second is not first and reloading.listener is first
    Path(tls.key).write_text("half-written\n")
    with caplog.at_level(logging.WARNING, logger="keyroute.http.tls"):
        assert reloading.check() is False
    assert reloading.context is second
    lines = [r.getMessage() for r in caplog.records if "keeps its previous TLS certificate" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("router keeps") and "\n" not in lines[0]
    assert reloading.check() is False  # said once per change, not at every look


def test_a_symlink_swap_as_a_secret_volume_makes_is_picked_up(tmp_path: Path) -> None:
    ca = trustme.CA()
    for version in ("v1", "v2"):
        (tmp_path / version).mkdir()
        pair(tmp_path / version, ca, "tls")
    volume = tmp_path / "volume"
    volume.mkdir()
    os.symlink(tmp_path / "v1", volume / "..data")
    for name in ("tls.crt", "tls.key"):
        os.symlink(f"..data/{name}", volume / name)
    reloading = ServerTls(TlsSettings(cert=str(volume / "tls.crt"), key=str(volume / "tls.key")))
    first = reloading.context
    os.symlink(tmp_path / "v2", volume / "..data_tmp")
    os.replace(volume / "..data_tmp", volume / "..data")  # what the kubelet does: one atomic rename
    assert reloading.check() is True and reloading.context is not first


def test_member_tls_looks_for_a_rotation_at_a_connect_once_its_poll_interval_passed(tmp_path: Path) -> None:
    ca = trustme.CA()
    tls = pair(tmp_path, ca, "r", "keyroute-router.r1.cluster")
    tls = TlsSettings(cert=tls.cert, key=tls.key, member_ca=ca_file(tmp_path, ca))
    now = [100.0]
    member = MemberTls(tls, "router", poll_s=2.0, clock=lambda: now[0])
    first = member()
    pair(tmp_path, ca, "r", "keyroute-router.r1.cluster")
    assert member() is first  # within the interval: not looked at
    now[0] += 2.0
    assert member() is not first


# -- the server over HTTPS ------------------------------------------------------------------------------


def test_the_server_answers_over_https_and_a_plaintext_request_is_closed(tmp_path: Path) -> None:
    ca = trustme.CA()
    ca_path = ca_file(tmp_path, ca)
    server = HttpServer(starlette_app(), data_plane=lambda state: Plane(), tls=pair(tmp_path, ca, "s"))
    with serve_in_thread(server) as port:
        ctx = ssl.create_default_context(cafile=ca_path)
        ctx.set_alpn_protocols(["h2", "http/1.1"])
        with tls_connection(port, ctx) as sock:
            assert sock.selected_alpn_protocol() == "http/1.1"
            assert sock.version() in ("TLSv1.2", "TLSv1.3")
            sock.sendall(get("/stores/t"))
            assert read_answer(sock).startswith(b"HTTP/1.1 200 OK\r\n")
        # Plain HTTP on the TLS port: a TLS alert or nothing, and the connection closed (never a hang).
        with socket.create_connection(("127.0.0.1", port), timeout=10) as plain:
            plain.sendall(get("/stores/t"))
            received = b""
            while chunk := plain.recv(65536):
                received += chunk
        assert received == b"" or received[:1] == b"\x15" or received.startswith(b"HTTP/1.1 400")


def test_a_presented_client_certificate_must_chain_to_the_client_ca(tmp_path: Path) -> None:
    ca, other = trustme.CA(), trustme.CA()
    ca_path = ca_file(tmp_path, ca)
    server = HttpServer(probed_app(), data_plane=lambda state: Plane(), tls=pair(tmp_path, ca, "s"), require_ca=ca_path)
    good = pair(tmp_path, ca, "client", "client.example")
    stranger = pair(tmp_path, other, "stranger", "client.example")
    long_ago = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
    issued = ca.issue_cert("client.example", not_before=long_ago, not_after=long_ago + datetime.timedelta(days=1))
    expired = (str(tmp_path / "expired.crt"), str(tmp_path / "expired.key"))
    issued.cert_chain_pems[0].write_to_path(expired[0])
    issued.private_key_pem.write_to_path(expired[1])
    alone = trustme.CA()  # its own certificate: self-signed
    self_signed = (str(tmp_path / "self.crt"), str(tmp_path / "self.key"))
    alone.cert_pem.write_to_path(self_signed[0])
    alone.private_key_pem.write_to_path(self_signed[1])
    with serve_in_thread(server) as port:
        assert serial_served(port, ca_path, (good.cert, good.key)) > 0
        assert answer_to(port, ca_path, (good.cert, good.key), "/stores/t").startswith(b"HTTP/1.1 200 OK")
        # A certificate that is presented is verified, whatever the path: no answer, not even a probe's.
        for cert in ((stranger.cert, stranger.key), expired, self_signed):
            assert answer_to(port, ca_path, cert, "/healthz") == b"", cert
        assert answer_to(port, ca_path, None, "/healthz").startswith(b"HTTP/1.1 200 OK")


def answer_to(port: int, ca_path: str, cert: tuple[str, str] | None, path: str) -> bytes:
    """The answer to a GET of `path` over a new TLS connection (presenting `cert`); b"" when the handshake
    is refused."""
    ctx = ssl.create_default_context(cafile=ca_path)
    if cert is not None:
        ctx.load_cert_chain(*cert)
    try:
        with tls_connection(port, ctx) as sock:
            sock.sendall(get(path))  # TLS 1.3: a refused certificate shows at the first read
            return read_answer(sock)
    except (ssl.SSLError, ConnectionError):
        return b""


def probed_app() -> Starlette:
    """The harness's app with probes, as routers and nodes have them: /healthz 200, /readyz 503."""

    async def healthz(request: StarletteRequest) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def readyz(request: StarletteRequest) -> JSONResponse:
        return JSONResponse({"ready": False}, status_code=503)

    app = starlette_app()
    app.router.routes.extend([Route("/healthz", healthz), Route("/readyz", readyz)])
    return app


@contextmanager_async
async def tls_client(port: int, ca_path: str, cert: TlsSettings | None = None) -> Any:
    ctx = ssl.create_default_context(cafile=ca_path)
    if cert is not None:
        ctx.load_cert_chain(cert.cert, cert.key)
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="127.0.0.1")
    try:
        yield reader, writer
    finally:
        writer.close()
        with suppress(OSError, ssl.SSLError):
            await writer.wait_closed()


def test_without_a_client_certificate_only_the_probes_answer_on_either_port(tmp_path: Path, arun: Any) -> None:
    ca = trustme.CA()
    ca_path = ca_file(tmp_path, ca)
    plane = Plane()
    server = HttpServer(probed_app(), data_plane=lambda state: plane, tls=pair(tmp_path, ca, "s"), require_ca=ca_path)
    client = pair(tmp_path, ca, "client", "client.example")

    async def refused(port: int, request: bytes) -> Answer:
        """The answer to `request`, sent after a probe on one connection without a certificate; the
        connection is closed after it."""
        async with tls_client(port, ca_path) as (reader, writer):
            writer.write(get("/healthz"))
            assert (await read_http_answer(reader)).status == 200
            writer.write(request)
            answer = await read_http_answer(reader)
            assert answer.header("connection") == "close"
            assert await closed_by_server(reader)
            return answer

    async def main() -> None:
        await server.start(port=0, admin_port=0)
        try:
            for port in (server.port, server.admin_port):
                assert port is not None
                async with tls_client(port, ca_path) as (reader, writer):
                    writer.write(get("/healthz") + get("/healthz", method="HEAD") + get("/readyz?verbose=1"))
                    assert (await read_http_answer(reader)).json() == {"status": "ok"}
                    head = await read_http_answer(reader, head=True)
                    assert head.status == 200 and head.body == b""
                    assert (await read_http_answer(reader)).status == 503  # /readyz answers, whatever it says
                for request in (get("/stores/t"), get("/hello"), get("/healthz", method="DELETE")):
                    answer = await refused(port, request)
                    assert answer.status == 403 and answer.json()["error"] == "client_certificate_required"
                    message = answer.json()["message"]
                    assert "--tls-client-ca" in message and "/healthz, /readyz" in message and "\n" not in message
            assert plane.handled == []  # no data read reached the data plane
            # A connection with a certificate is served as ever, on both ports.
            async with tls_client(server.port, ca_path, client) as (reader, writer):
                writer.write(get("/stores/t") + get("/hello"))
                assert (await read_http_answer(reader)).status == 200
                assert (await read_http_answer(reader)).status == 200
            assert server.refusals == {}  # a missing certificate is not a malformed request
        finally:
            await server.stop(grace_s=2.0)

    arun(main())


def test_a_rotated_certificate_serves_new_connections_and_keeps_open_ones(tmp_path: Path) -> None:
    ca = trustme.CA()
    ca_path = ca_file(tmp_path, ca)
    tls = pair(tmp_path, ca, "s")
    # The kept connection idles while the test waits for the rotation to be seen, which on a loaded machine can
    # outlast the default keep-alive timeout (an idle connection closed is not what this test is about).
    limits = ServerLimits(keep_alive_timeout_s=600.0)
    server = HttpServer(starlette_app(), limits=limits, data_plane=lambda state: Plane(), tls=tls)
    with serve_in_thread(server) as port:
        assert server.tls is not None
        server.tls.poll_s = 0.05  # the next look at the files comes soon
        before = serial_served(port, ca_path)
        ctx = ssl.create_default_context(cafile=ca_path)
        with tls_connection(port, ctx) as kept:
            kept.sendall(get("/stores/a"))
            assert read_answer(kept).startswith(b"HTTP/1.1 200 OK\r\n")
            pair(tmp_path, ca, "s")  # rotated on disk
            wait_for(lambda: serial_served(port, ca_path) != before, timeout_s=30, message="the new certificate")
            kept.sendall(get("/stores/b"))  # the connection opened before the rotation still answers
            assert read_answer(kept).startswith(b"HTTP/1.1 200 OK\r\n")


def test_a_server_whose_files_are_missing_does_not_start(tmp_path: Path) -> None:
    server = HttpServer(starlette_app(), tls=TlsSettings(cert=str(tmp_path / "a.crt"), key=str(tmp_path / "a.key")))
    with pytest.raises(TlsError, match="cannot read the TLS certificate"), serve_in_thread(server):
        pass


# -- member roles ---------------------------------------------------------------------------------------


def test_a_member_identity_is_a_role_and_an_id_from_dns_or_spiffe_names() -> None:
    def cert(*names: tuple[str, str]) -> dict[str, Any]:
        return {"subjectAltName": names}

    node, router = MemberIdentity("node", "n1"), MemberIdentity("router", "r1")
    assert member_identity(cert(("DNS", "n1.example"), ("DNS", "keyroute-node.n1.cluster"))) == node
    assert member_identity(cert(("DNS", "keyroute-router.r1.keyroute.svc"))) == router
    assert member_identity(cert(("URI", "spiffe://example.org/keyroute/node/n1"))) == node
    assert member_identity(cert(("URI", "spiffe://example.org/keyroute/router/r1"))) == router
    # The same identity twice (a DNS name and a URI) is one identity.
    assert member_identity(cert(("DNS", "keyroute-node.n1.c"), ("URI", "spiffe://td/keyroute/node/n1"))) == node
    assert member_role(cert(("DNS", "keyroute-node.n1.c"))) == "node"
    # A SPIFFE ID, when there is one, is the identity: the DNS names are host names (a router's Service).
    service = (("DNS", "keyroute-router"), ("DNS", "keyroute-router.keyroute.svc"))
    assert member_identity(cert(*service, ("URI", "spiffe://cluster.local/keyroute/router/r1"))) == router
    assert member_identity(cert(*service)) is None
    malformed = (
        (("DNS", "keyroute-node.n1"),),  # no domain after the id
        (("DNS", "keyroute-node"),),
        (("DNS", "keyroute-node..cluster"),),  # no id
        (("DNS", "keyroute-node.N_1.cluster"),),  # an id that is no DNS label
        (("URI", "spiffe://td/keyroute/node/"),),
        (("URI", "spiffe://td/keyroute/node/n1/x"),),
        (("URI", "spiffe://td/keyroute/client/c1"),),
        (("URI", "spiffe:///keyroute/node/n1"),),  # no trust domain
        (("DNS", "keyroute-node.n1.c"), ("DNS", "keyroute-node.n2.c")),  # two identities: none
        (("DNS", "keyroute-node.n1.c"), ("DNS", "keyroute-router.n1.c")),
        (("DNS", "keyroute-node.n1.c"), ("DNS", "keyroute-node.cluster")),  # one of them malformed
    )
    for names in malformed:
        assert member_identity(cert(*names)) is None, names
        assert names_member_role(cert(*names)), names
    for names in ((("DNS", "keyroute-client.c1.x"),), (("URI", "spiffe://td/other/node/x"),), (("DNS", "n1.x"),)):
        assert member_identity(cert(*names)) is None and not names_member_role(cert(*names)), names
    assert member_identity(None) is None and member_identity({}) is None and member_role(None) is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        node.id = "n2"  # type: ignore[misc]


def test_a_member_may_send_only_its_own_roles_and_ids_headers() -> None:
    node, router = MemberIdentity("node", "n1"), MemberIdentity("router", "r1")
    check_member_headers(node, b"1", b"n1")
    check_member_headers(node, b"1", None)
    check_member_headers(router, None, None)
    for identity, hops, by in ((node, b"1", b"n2"), (node, None, b"n2"), (router, b"1", None), (router, None, b"r1")):
        with pytest.raises(Forbidden):
            check_member_headers(identity, hops, by)


def test_with_member_certificates_the_role_decides_not_the_token() -> None:
    members = ClusterAuth("secret", certificates=True)
    assert members.enabled
    assert members.is_member(None, "node") and members.is_member(None, "router")
    assert not members.is_member(members.token, None)
    assert not members.is_member(members.token, "client")


# -- the wire between members ---------------------------------------------------------------------------


async def member_read(wire_tls: MemberTls, port: int) -> Any:
    """GET /stores/t from the node on `port` over a new FastUpstream (so a new connection) with `wire_tls`."""
    wire = FastUpstream(5.0, 5.0, tls=wire_tls)
    try:
        return await wire.get(f"https://127.0.0.1:{port}/stores/t", {})
    finally:
        await wire.aclose()


def test_members_reach_a_tls_node_and_name_its_certificate_when_refused(tmp_path: Path) -> None:
    ca, rogue = trustme.CA(), trustme.CA()
    member_ca = ca_file(tmp_path, ca)
    mine = pair(tmp_path, ca, "router", "keyroute-router.r1.cluster")
    wire_tls = MemberTls(TlsSettings(cert=mine.cert, key=mine.key, member_ca=member_ca), "router")
    node_tls = pair(tmp_path, ca, "node", "127.0.0.1", "keyroute-node.n1.cluster")
    node = TlsSettings(cert=node_tls.cert, key=node_tls.key, member_ca=member_ca)
    good = HttpServer(starlette_app(), data_plane=lambda state: Plane(), tls=node, require_ca=member_ca)
    stranger = HttpServer(
        starlette_app(), data_plane=lambda state: Plane(), tls=pair(tmp_path, rogue, "rogue", "127.0.0.1")
    )
    elsewhere = HttpServer(
        starlette_app(), data_plane=lambda state: Plane(), tls=pair(tmp_path, ca, "other", "node.example")
    )

    with serve_in_thread(good) as ok, serve_in_thread(stranger) as bad, serve_in_thread(elsewhere) as wrong:
        assert asyncio.run(member_read(wire_tls, ok)).status == 200
        with pytest.raises(UpstreamUnavailable) as untrusted:
            asyncio.run(member_read(wire_tls, bad))
        assert str(untrusted.value).startswith(f"TLS with https://127.0.0.1:{bad} failed: its certificate is not")
        assert "trusted CA" in str(untrusted.value)
        with pytest.raises(UpstreamUnavailable) as host:
            asyncio.run(member_read(wire_tls, wrong))
        assert "its certificate is not for this host" in str(host.value)
    # Without member TLS settings an https:// node is refused before any connection.
    with pytest.raises(ValueError, match="no TLS settings were given for members"):
        asyncio.run(FastUpstream().get("https://127.0.0.1:1/stores/t", {}))


def test_an_expired_or_self_signed_node_is_refused_with_its_reason(tmp_path: Path) -> None:
    ca = trustme.CA()
    member_ca = ca_file(tmp_path, ca)
    mine = pair(tmp_path, ca, "router", "keyroute-router.r1.cluster")
    wire_tls = MemberTls(TlsSettings(cert=mine.cert, key=mine.key, member_ca=member_ca), "router")
    long_ago = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
    issued = ca.issue_cert("127.0.0.1", not_before=long_ago, not_after=long_ago + datetime.timedelta(days=1))
    expired = TlsSettings(cert=str(tmp_path / "expired.crt"), key=str(tmp_path / "expired.key"))
    issued.cert_chain_pems[0].write_to_path(expired.cert)
    issued.private_key_pem.write_to_path(expired.key)
    alone = trustme.CA()  # its own certificate: self-signed
    self_signed = TlsSettings(cert=str(tmp_path / "self.crt"), key=str(tmp_path / "self.key"))
    alone.cert_pem.write_to_path(self_signed.cert)
    alone.private_key_pem.write_to_path(self_signed.key)

    for tls, reason in ((expired, "its certificate has expired"), (self_signed, "its certificate is self-signed")):
        server = HttpServer(starlette_app(), data_plane=lambda state: Plane(), tls=tls)
        with serve_in_thread(server) as port, pytest.raises(UpstreamUnavailable) as refused:
            asyncio.run(member_read(wire_tls, port))
        assert str(refused.value).startswith(f"TLS with https://127.0.0.1:{port} failed: {reason}")
        assert "\n" not in str(refused.value)


class RolePlane(Plane):
    """Answers with the member role its peer's certificate names (empty: none)."""

    def handle(self, exchange: Exchange) -> None:
        role = peer_role(exchange.transport) or ""
        exchange.answer(200, [(b"content-type", b"text/plain")], role.encode())


@pytest.mark.parametrize("loop_factory", ["asyncio", "uvloop"])
def test_a_reconnect_resumes_the_tls_session_and_keeps_the_peers_role(tmp_path: Path, loop_factory: str) -> None:
    ca = trustme.CA()
    member_ca = ca_file(tmp_path, ca)
    mine = pair(tmp_path, ca, "router", "keyroute-router.r1.cluster")
    wire_tls = MemberTls(TlsSettings(cert=mine.cert, key=mine.key, member_ca=member_ca), "router")
    node = pair(tmp_path, ca, "node", "127.0.0.1", "keyroute-node.n1.cluster")
    server = HttpServer(
        starlette_app(),
        data_plane=lambda state: RolePlane(),
        tls=TlsSettings(cert=node.cert, key=node.key, member_ca=member_ca),
        require_ca=member_ca,
    )

    run = asyncio.run if loop_factory == "asyncio" else pytest.importorskip("uvloop").run
    with serve_in_thread(server) as port:
        assert server.tls is not None and server.tls.listener is not None
        roles = [run(member_read(wire_tls, port)).body for _ in range(3)]  # each a new pool and connection
        stats = server.tls.listener.session_stats()
    assert roles == [b"router"] * 3  # a resumed session still names its certificate's role
    assert stats["accept_good"] == 3 and stats["hits"] == 2


# -- member identities on the wire ------------------------------------------------------------------------


def test_a_member_presents_only_a_certificate_naming_its_own_role_and_id(tmp_path: Path) -> None:
    ca = trustme.CA()
    member_ca = ca_file(tmp_path, ca)
    n1 = pair(tmp_path, ca, "n1", "127.0.0.1", "keyroute-node.n1.cluster")
    spiffe = TlsSettings(*write_with_uri(tmp_path, "spiffe", ca, "spiffe://example.org/keyroute/node/n1"))
    router = pair(tmp_path, ca, "r1", "keyroute-router.r1.cluster")
    nameless = pair(tmp_path, ca, "nameless", "127.0.0.1")
    me = MemberIdentity("node", "n1")
    for good in (n1, spiffe):
        member_context(TlsSettings(cert=good.cert, key=good.key, member_ca=member_ca), me)
    for bad, named in ((router, "names router r1, not node n1"), (nameless, "names no member identity")):
        with pytest.raises(TlsError) as refused:
            member_context(TlsSettings(cert=bad.cert, key=bad.key, member_ca=member_ca), me)
        assert named in str(refused.value) and "keyroute-node.n1.<domain>" in str(refused.value)
        assert "\n" not in str(refused.value)
    with pytest.raises(TlsError, match="names node n1, not node n2"):
        member_context(TlsSettings(cert=n1.cert, key=n1.key, member_ca=member_ca), MemberIdentity("node", "n2"))
    # The right names from another CA (say, the clients'): not a member's certificate.
    elsewhere = pair(tmp_path, trustme.CA(), "elsewhere", "127.0.0.1", "keyroute-node.n1.cluster")
    with pytest.raises(TlsError, match="is not issued by the member CA"):
        member_context(TlsSettings(cert=elsewhere.cert, key=elsewhere.key, member_ca=member_ca), me)
    # Through an intermediate CA whose certificate the chain file carries: the member CA's.
    intermediate = ca.create_child_ca()
    issued = intermediate.issue_cert("127.0.0.1", "keyroute-node.n1.cluster")
    chained = TlsSettings(cert=str(tmp_path / "chained.crt"), key=str(tmp_path / "chained.key"), member_ca=member_ca)
    (tmp_path / "chained.crt").write_bytes(b"".join(blob.bytes() for blob in issued.cert_chain_pems))
    issued.private_key_pem.write_to_path(chained.key)
    member_context(chained, me)


def test_a_nodes_clients_ca_must_differ_from_its_member_ca(tmp_path: Path) -> None:
    members, clients = trustme.CA(), trustme.CA()
    member_ca, client_ca = ca_file(tmp_path, members, "members"), ca_file(tmp_path, clients, "clients")
    n1 = pair(tmp_path, members, "n1", "127.0.0.1", "keyroute-node.n1.cluster")
    me = MemberIdentity("node", "n1")
    assert member_tls(TlsSettings(n1.cert, n1.key, client_ca=client_ca, member_ca=member_ca), "node n1", me)
    bundle = tmp_path / "bundle.pem"  # the member CA among others
    bundle.write_bytes(clients.cert_pem.bytes() + members.cert_pem.bytes())
    for settings, said in (
        (TlsSettings(n1.cert, n1.key, client_ca=member_ca, member_ca=member_ca), "hold the same CA"),
        (TlsSettings(n1.cert, n1.key, client_ca=str(bundle), member_ca=member_ca), "hold the same CA"),
        (TlsSettings(n1.cert, n1.key, client_ca=client_ca), "needs --member-ca"),
    ):
        with pytest.raises(StartupError, match=said):
            member_tls(settings, "node n1", me)


def answered(port: int, ca_path: str, cert: TlsSettings) -> bytes:
    """The whole answer to one GET /stores/t presenting `cert` (the connection closed after it)."""
    ctx = ssl.create_default_context(cafile=ca_path)
    ctx.load_cert_chain(cert.cert, cert.key)
    received = b""
    with tls_connection(port, ctx) as sock:
        sock.sendall(get("/stores/t", "connection: close"))
        while chunk := sock.recv(65536):
            received += chunk
    return received


def test_a_node_grants_member_identities_only_to_the_member_cas_certificates(tmp_path: Path) -> None:
    members, clients = trustme.CA(), trustme.CA()
    member_ca, client_ca = ca_file(tmp_path, members, "members"), ca_file(tmp_path, clients, "clients")
    own = pair(tmp_path, members, "node", "127.0.0.1", "keyroute-node.n1.cluster")
    node = TlsSettings(cert=own.cert, key=own.key, client_ca=client_ca, member_ca=member_ca)
    server = HttpServer(
        starlette_app(),
        data_plane=lambda state: RolePlane(),
        tls=node,
        require_ca=(member_ca, client_ca),
        peer_check=PeerCheck(member_ca, client_ca),
    )
    with serve_in_thread(server) as port:
        # A member certificate of the member CA: its role. A caller's of the clients' CA: none.
        assert answered(port, member_ca, pair(tmp_path, members, "n2", "keyroute-node.n2.c")).endswith(b"node")
        caller = answered(port, member_ca, pair(tmp_path, clients, "caller", "app.example"))
        assert caller.startswith(b"HTTP/1.1 200") and caller.endswith(b"\r\n\r\n")
        # The clients' CA naming a member role, or a malformed member name: refused, JSON, connection closed.
        claims = (("keyroute-node.n2.c", clients), ("keyroute-router.r1.c", clients), ("keyroute-node.x", members))
        for name, ca in claims:
            refused = answered(port, member_ca, pair(tmp_path, ca, "claim", name))
            assert refused.startswith(b"HTTP/1.1 403"), (name, refused)
            assert b'"error":"member_certificate_refused"' in refused.replace(b" ", b"")
            assert b"connection: close" in refused.lower()


def test_a_routers_port_refuses_every_certificate_naming_a_member_role(tmp_path: Path) -> None:
    ca = trustme.CA()
    client_ca = ca_file(tmp_path, ca)
    server = HttpServer(
        starlette_app(),
        data_plane=lambda state: RolePlane(),
        tls=pair(tmp_path, ca, "router", "127.0.0.1"),
        require_ca=client_ca,
        peer_check=PeerCheck(clients_only=True),
    )
    with serve_in_thread(server) as port:
        assert answered(port, client_ca, pair(tmp_path, ca, "caller", "app.example")).startswith(b"HTTP/1.1 200")
        claims = [pair(tmp_path, ca, "n1", "keyroute-node.n1.cluster"), pair(tmp_path, ca, "bad", "keyroute-node.n1")]
        claims.append(TlsSettings(*write_with_uri(tmp_path, "spiffe", ca, "spiffe://td/keyroute/router/r1")))
        for claim in claims:
            refused = answered(port, client_ca, claim)
            assert refused.startswith(b"HTTP/1.1 403") and b"member_certificate_refused" in refused, claim


def test_members_connect_only_to_a_node_certificate_of_the_node_registered_at_the_address(tmp_path: Path) -> None:
    ca = trustme.CA()
    member_ca = ca_file(tmp_path, ca)
    mine = pair(tmp_path, ca, "router", "keyroute-router.r1.cluster")
    wire_tls = MemberTls(TlsSettings(cert=mine.cert, key=mine.key, member_ca=member_ca), "router")

    def serving(tls: TlsSettings) -> HttpServer:
        return HttpServer(starlette_app(), data_plane=lambda state: Plane(), tls=tls, require_ca=member_ca)

    n1 = serving(pair(tmp_path, ca, "n1", "127.0.0.1", "keyroute-node.n1.cluster"))
    posing = serving(pair(tmp_path, ca, "posing", "127.0.0.1", "keyroute-router.r2.cluster"))
    with serve_in_thread(n1) as port, serve_in_thread(posing) as other:
        # Without a map any node's certificate is accepted, and no other role's.
        assert asyncio.run(member_read(wire_tls, port)).status == 200
        with pytest.raises(UpstreamUnavailable, match="its certificate names router r2, not a node"):
            asyncio.run(member_read(wire_tls, other))
        # With a map: the certificate must name the node registered at that address.
        url = f"https://127.0.0.1:{port}"
        registered = {"n1": ServingRecord("n1", url, {}), "n5": ServingRecord("n5", "https://10.0.0.5:8080", {})}
        wire_tls.peers = lambda: types.SimpleNamespace(serving=registered, nodes={})
        assert asyncio.run(member_read(wire_tls, port)).status == 200
        registered = {"n7": ServingRecord("n7", url + "/", {})}
        with pytest.raises(UpstreamUnavailable, match="names node n1, but n7 registered that address"):
            asyncio.run(member_read(wire_tls, port))


def test_a_node_on_tls_without_a_member_ca_asks_for_no_certificate(tmp_path: Path) -> None:
    ca = trustme.CA()
    server = HttpServer(
        starlette_app(),
        data_plane=lambda state: Plane(),
        tls=pair(tmp_path, ca, "node", "127.0.0.1"),
        require_ca=("", ""),  # what a node passes: its member CA and clients' CA, neither given
        peer_check=PeerCheck(),
    )
    with serve_in_thread(server) as port:
        assert answer_to(port, ca_file(tmp_path, ca), None, "/stores/t").startswith(b"HTTP/1.1 200 OK")


def resumed_answer(port: int, ctx: ssl.SSLContext, session: ssl.SSLSession | None, path: str) -> tuple[Any, bytes]:
    """((the session, whether it was resumed), the answer) of a GET of `path` over a new connection offering
    `session`; the answer is b"" when the handshake or the request is refused."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1", session=session) as sock:
            sock.sendall(get(path))
            answer = read_answer(sock)
            return (sock.session, sock.session_reused), answer
    except (ssl.SSLError, ConnectionError):
        return (None, False), b""
    finally:
        raw.close()


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_2])
def test_a_session_from_before_a_client_ca_change_does_not_resume(tmp_path: Path, version: ssl.TLSVersion) -> None:
    ca, successor = trustme.CA(), trustme.CA()
    ca_path = ca_file(tmp_path, ca)
    client_ca = ca_file(tmp_path, ca, "client-ca")
    server = HttpServer(
        probed_app(), data_plane=lambda state: Plane(), tls=pair(tmp_path, ca, "s"), require_ca=client_ca
    )
    client = pair(tmp_path, ca, "client", "client.example")
    ctx = ssl.create_default_context(cafile=ca_path)
    ctx.minimum_version = ctx.maximum_version = version
    ctx.load_cert_chain(client.cert, client.key)
    with serve_in_thread(server) as port:
        assert server.tls is not None
        server.tls.poll_s = 0.05
        (session, _), answer = resumed_answer(port, ctx, None, "/stores/t")
        assert answer.startswith(b"HTTP/1.1 200 OK") and session is not None
        (session, reused), answer = resumed_answer(port, ctx, session, "/stores/t")
        assert reused and answer.startswith(b"HTTP/1.1 200 OK")  # resumption works between reloads
        before = server.tls.context
        ca_file(tmp_path, successor, "client-ca")  # the client CA replaced: the client's certificate is revoked
        wait_for(lambda: server.tls is not None and server.tls.listener is not before, timeout_s=30, message="reload")
        (_, reused), answer = resumed_answer(port, ctx, session, "/stores/t")
        assert not reused
        assert answer == b""  # a full handshake, and the certificate of the replaced CA refused
        # Sessions of the new client CA resume again.
        renewed = pair(tmp_path, successor, "renewed", "client.example")
        ctx2 = ssl.create_default_context(cafile=ca_path)
        ctx2.minimum_version = ctx2.maximum_version = version
        ctx2.load_cert_chain(renewed.cert, renewed.key)
        (session, _), answer = resumed_answer(port, ctx2, None, "/stores/t")
        assert answer.startswith(b"HTTP/1.1 200 OK")
        (_, reused), answer = resumed_answer(port, ctx2, session, "/stores/t")
        assert reused and answer.startswith(b"HTTP/1.1 200 OK")


def test_an_app_request_over_tls_says_https(tmp_path: Path) -> None:
    """What makes a login's cookie Secure when the server itself speaks TLS (keyroute.http.admin_login)."""

    async def scheme(request: StarletteRequest) -> JSONResponse:
        return JSONResponse({"scheme": request.url.scheme})

    ca = trustme.CA()
    app = starlette_app()
    app.router.routes.append(Route("/scheme", scheme))
    request = get("/scheme", "connection: close")
    context = ssl.create_default_context(cafile=ca_file(tmp_path, ca))
    with serve_in_thread(HttpServer(app, tls=pair(tmp_path, ca, "s"))) as port, tls_connection(port, context) as tls:
        tls.sendall(request)
        assert read_answer(tls).endswith(b'{"scheme":"https"}')
    with serve_in_thread(HttpServer(app)) as port, socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        assert read_answer(sock).endswith(b'{"scheme":"http"}')


OPENSSL = shutil.which("openssl")


def s_client(port: int, ca_path: str, *args: str) -> str:
    """What `openssl s_client` prints for a GET of /stores/t (its session summary and the answer)."""
    command = [OPENSSL or "openssl", "s_client", "-connect", f"127.0.0.1:{port}", "-servername", "127.0.0.1"]
    request = get("/stores/t", "connection: close")
    done = subprocess.run(
        [*command, "-CAfile", ca_path, "-tls1_3", "-ign_eof", *args], input=request, capture_output=True, timeout=30
    )
    return done.stdout.decode("latin-1")


@pytest.mark.skipif(OPENSSL is None, reason="needs the openssl command")
def test_a_certless_client_with_a_saved_session_is_refused_once_the_client_ca_changed(tmp_path: Path) -> None:
    ca, successor = trustme.CA(), trustme.CA()
    ca_path, client_ca = ca_file(tmp_path, ca), ca_file(tmp_path, ca, "client-ca")
    server = HttpServer(
        probed_app(), data_plane=lambda state: Plane(), tls=pair(tmp_path, ca, "s"), require_ca=client_ca
    )
    client = pair(tmp_path, ca, "client", "client.example")
    saved = str(tmp_path / "session.pem")
    with serve_in_thread(server) as port:
        assert server.tls is not None
        server.tls.poll_s = 0.05
        first = s_client(port, ca_path, "-cert", client.cert, "-key", client.key, "-sess_out", saved)
        assert "HTTP/1.1 200 OK" in first and os.path.getsize(saved) > 0
        # The session carries the certificate: a client without one resumes it (and is served) until a reload.
        before = s_client(port, ca_path, "-sess_in", saved)
        assert "Reused, TLSv1.3" in before and "HTTP/1.1 200 OK" in before, before
        listener = server.tls.listener
        ca_file(tmp_path, successor, "client-ca")
        wait_for(lambda: server.tls is not None and server.tls.listener is not listener, timeout_s=30, message="reload")
        after = s_client(port, ca_path, "-sess_in", saved)
        assert "New, TLSv1.3" in after and "Reused" not in after, after
        assert "HTTP/1.1 403" in after and "client_certificate_required" in after, after
