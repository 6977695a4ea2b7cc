"""keyroute_tls_certificate_not_after_seconds: when each certificate a router or node presents ends, by role
(server, zookeeper-client) and file, read from the file at each scrape, so that a renewed certificate shows
at once and the expiry alert (components/monitoring) clears without a restart."""

from __future__ import annotations

import datetime
from pathlib import Path

import trustme
from prometheus_client.parser import text_string_to_metric_families

from keyroute.router.metrics import RouterMetrics
from keyroute.runtime.metrics import certificate_not_after, certificates_in_use, tls_certificates_family
from keyroute.runtime.settings import TlsSettings, ZkTls
from keyroute.state_node.metrics import NodeMetrics

NAME = "keyroute_tls_certificate_not_after_seconds"


def write_certificate(path: Path, ca: trustme.CA, not_after: datetime.datetime) -> float:
    """A leaf certificate of `ca` ending at `not_after`, written to `path` with its chain; its end in seconds."""
    leaf = ca.issue_cert("keyroute-node.n1.cluster", not_after=not_after)
    path.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
    return not_after.replace(microsecond=0).timestamp()


def samples(text: str) -> dict[tuple[str, str], float]:
    [family] = [f for f in text_string_to_metric_families(text) if f.name == NAME]
    assert family.type == "gauge"
    return {(s.labels["role"], s.labels["path"]): s.value for s in family.samples}


def test_the_certificates_in_use_are_the_served_one_and_the_one_presented_to_zookeeper(tmp_path: Path) -> None:
    tls = TlsSettings(cert="/etc/keyroute/tls/tls.crt", key="/etc/keyroute/tls/tls.key")
    zk = ZkTls(ca=tmp_path / "ca.crt", cert=Path("/etc/keyroute/tls/zk.crt"), key=Path("/etc/keyroute/tls/zk.key"))
    assert certificates_in_use(tls, zk) == {
        "server": "/etc/keyroute/tls/tls.crt",
        "zookeeper-client": "/etc/keyroute/tls/zk.crt",
    }
    # TLS off on a wire: nothing for it.
    assert certificates_in_use(TlsSettings(), ZkTls(ca=tmp_path / "ca.crt")) == {}
    assert certificates_in_use(tls, None) == {"server": "/etc/keyroute/tls/tls.crt"}


def test_the_end_is_the_leaf_s_read_again_at_each_scrape(tmp_path: Path) -> None:
    ca = trustme.CA()
    path = tmp_path / "tls.crt"
    first = write_certificate(path, ca, datetime.datetime(2031, 5, 4, 3, 2, 1, tzinfo=datetime.UTC))
    assert certificate_not_after(str(path)) == first
    renewed = write_certificate(path, ca, datetime.datetime(2031, 8, 2, tzinfo=datetime.UTC))
    assert certificate_not_after(str(path)) == renewed != first
    # A file that cannot be read or is no certificate has no end to show (the process says why itself).
    assert certificate_not_after(str(tmp_path / "missing.crt")) is None
    (tmp_path / "junk.crt").write_text("not a certificate\n")
    assert certificate_not_after(str(tmp_path / "junk.crt")) is None
    family = tls_certificates_family({"server": str(path), "zookeeper-client": str(tmp_path / "missing.crt")})
    assert [(s.labels, s.value) for s in family.samples] == [({"role": "server", "path": str(path)}, renewed)]


def test_routers_and_nodes_export_the_end_of_each_certificate_they_present(tmp_path: Path) -> None:
    ca = trustme.CA()
    served = write_certificate(tmp_path / "tls.crt", ca, datetime.datetime(2030, 1, 2, tzinfo=datetime.UTC))
    to_zookeeper = write_certificate(tmp_path / "zk.crt", ca, datetime.datetime(2029, 6, 7, tzinfo=datetime.UTC))
    certificates = {"server": str(tmp_path / "tls.crt"), "zookeeper-client": str(tmp_path / "zk.crt")}
    expected = {
        ("server", certificates["server"]): served,
        ("zookeeper-client", certificates["zookeeper-client"]): to_zookeeper,
    }
    router = RouterMetrics()
    router.certificates = certificates
    assert samples(router.render()) == expected
    node = NodeMetrics()
    node.certificates = certificates
    assert samples(node.render().decode()) == expected
    # Without TLS the family is there, empty.
    assert samples(RouterMetrics().render()) == {} == samples(NodeMetrics().render().decode())
