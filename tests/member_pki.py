"""Certificates of a test CA (trustme) that trustme cannot issue itself: ones naming a SPIFFE URI."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import trustme
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def issue_with_uri(ca: trustme.CA, uri: str, *dns_names: str) -> tuple[bytes, bytes]:
    """A leaf certificate of `ca` (PEM) naming the URI `uri` and `dns_names` (an IP address as one), and its
    key (PEM, PKCS #8)."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem.bytes())
    ca_key = serialization.load_pem_private_key(ca.private_key_pem.bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(uri)]
    for name in dns_names:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            names.append(x509.DNSName(name))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "member")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def write_with_uri(root: Path, name: str, ca: trustme.CA, uri: str, *dns_names: str) -> tuple[str, str]:
    """`issue_with_uri`, written to `root`/`name`.crt and .key: their paths."""
    cert, key = issue_with_uri(ca, uri, *dns_names)
    cert_path, key_path = root / f"{name}.crt", root / f"{name}.key"
    cert_path.write_bytes(cert)
    key_path.write_bytes(key)
    return str(cert_path), str(key_path)
