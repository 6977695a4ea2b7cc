"""The embedded ZooKeeper's TLS settings: the zoo.cfg it writes, the key store it makes, and one-line errors
for unusable files (all before any JVM starts)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trustme

from keyroute.cli import main
from keyroute.dev.zookeeper_server import ServerTls, write_config


@pytest.fixture
def pems(tmp_path: Path) -> dict[str, Path]:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    files = {"cert": tmp_path / "server.crt", "key": tmp_path / "server.key", "ca": tmp_path / "ca.crt"}
    cert.cert_chain_pems[0].write_to_path(files["cert"])
    cert.private_key_pem.write_to_path(files["key"])  # an EC key in SEC 1 form ("EC PRIVATE KEY")
    ca.cert_pem.write_to_path(files["ca"])
    return files


def cfg(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line)


def test_a_tls_only_server_with_client_certificates(pems: dict[str, Path], tmp_path: Path) -> None:
    tls = ServerTls(2281, pems["cert"], pems["key"], pems["ca"], plaintext=False)
    written = cfg(write_config(tmp_path / "zk", 2181, tls=tls))
    assert "clientPort" not in written
    assert written["secureClientPort"] == "2281" and written["secureClientPortAddress"] == "127.0.0.1"
    assert written["serverCnxnFactory"] == "org.apache.zookeeper.server.NettyServerCnxnFactory"
    assert written["ssl.clientAuth"] == "need" and written["ssl.trustStore.type"] == "PEM"
    assert written["authProvider.x509"] == "org.apache.zookeeper.server.auth.X509AuthenticationProvider"
    store = Path(written["ssl.keyStore.location"])
    text = store.read_text()
    # The key in PKCS #8 (ZooKeeper's PEM reader takes no other form), then the certificate.
    assert text.startswith("-----BEGIN PRIVATE KEY-----") and text.rstrip().endswith("-----END CERTIFICATE-----")
    assert store.stat().st_mode & 0o077 == 0


def test_without_a_client_ca_no_certificate_is_asked_and_plaintext_stays(pems: dict[str, Path], tmp_path: Path) -> None:
    written = cfg(write_config(tmp_path / "zk", 2181, tls=ServerTls(2281, pems["cert"], pems["key"])))
    assert written["clientPort"] == "2181" and written["ssl.clientAuth"] == "none"
    assert "ssl.trustStore.location" not in written
    assert "secureClientPort" not in cfg(write_config(tmp_path / "plain", 2181))


@pytest.mark.parametrize(
    ("given", "said"),
    [
        (["--tls-cert", "{missing}", "--tls-key", "{key}"], "cannot read --tls-cert {missing}: No such file"),
        (["--tls-cert", "{ca}", "--tls-key", "{key}"], "are not a PEM certificate and its unencrypted PEM key"),
        (["--tls-cert", "{cert}", "--tls-key", "{key}", "--tls-client-ca", "{key}"], "holds no PEM certificate"),
        (["--tls-cert", "{cert}"], "--secure-port needs --tls-cert and --tls-key"),
    ],
)
def test_unusable_tls_files_are_one_line_and_exit_1(
    given: list[str], said: str, pems: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    names = {**{k: str(v) for k, v in pems.items()}, "missing": str(tmp_path / "missing.crt")}
    args = ["zookeeper", "--data-dir", str(tmp_path / "zk"), "--port", "0", "--secure-port", "0"]
    assert main([*args, *(a.format(**names) for a in given)], env={}) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said.format(**names) in err, err
