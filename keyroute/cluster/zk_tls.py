"""ZooKeeper over TLS, client side: kazoo's TLS options from `ZkTls`, checked before the first connection,
and the `x509` identity a client certificate gives on a server running ZooKeeper's X509AuthenticationProvider.

The server names a certificate's owner by its subject DN as Java writes it
(`X500Principal.getName()`, RFC 2253): `CN=keyroute-node,O=example`, most specific first, with
`, = + < > # ; " \\` escaped wherever they appear. `subject_dn` writes it the same way, so that the ACLs a
writer sets name exactly the identity the server authenticates.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

from keyroute.runtime.settings import ZkTls

# The attribute types Java's RFC 2253 form names by keyword; any other is written as its OID.
_KEYWORDS = {
    "2.5.4.3": "CN",
    "2.5.4.6": "C",
    "2.5.4.7": "L",
    "2.5.4.8": "ST",
    "2.5.4.10": "O",
    "2.5.4.11": "OU",
    "2.5.4.9": "STREET",
    "0.9.2342.19200300.100.1.25": "DC",
    "0.9.2342.19200300.100.1.1": "UID",
}
_SPECIAL = ',=+<>#;"\\'


class ZkTlsError(ValueError):
    """A TLS file for ZooKeeper cannot be used (missing, unreadable, not PEM, key not matching)."""


def kazoo_options(tls: ZkTls | None) -> dict[str, Any]:
    """KazooClient's keyword arguments for `tls`: server certificates verified against the CA, host names
    checked, this process's certificate presented when it has one. ZkTlsError when a file is unusable."""
    if tls is None:
        return {}
    check_files(tls)
    options: dict[str, Any] = {"use_ssl": True, "verify_certs": True, "check_hostname": True, "ca": str(tls.ca)}
    if tls.cert is not None and tls.key is not None:
        options |= {"certfile": str(tls.cert), "keyfile": str(tls.key)}
    return options


def check_files(tls: ZkTls) -> None:
    """Load the CA and the certificate with its key as kazoo will, to say in one line what is wrong now
    rather than at every connection attempt."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # not the system's CAs: loading them takes ~0.1 s
    try:
        context.load_verify_locations(tls.ca)
    except (OSError, ValueError) as exc:
        raise ZkTlsError(f"cannot use the ZooKeeper TLS CA {tls.ca} (--zk-tls-ca): {_reason(exc)}") from None
    if tls.cert is None or tls.key is None:
        return
    try:
        context.load_cert_chain(tls.cert, tls.key)
    except OSError as exc:
        raise ZkTlsError(
            f"cannot use the ZooKeeper TLS certificate {tls.cert} with key {tls.key} "
            f"(--zk-tls-cert, --zk-tls-key): {_reason(exc)}"
        ) from None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return exc.reason.lower().replace("_", " ") if exc.reason else str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)


def subject_dn(cert: Path) -> str:
    """The subject DN of the PEM certificate `cert` as ZooKeeper's x509 provider names its owner."""
    from cryptography import x509

    try:
        name = x509.load_pem_x509_certificate(cert.read_bytes()).subject
    except OSError as exc:
        raise ZkTlsError(f"cannot read the ZooKeeper TLS certificate {cert}: {_reason(exc)}") from None
    except ValueError as exc:
        raise ZkTlsError(f"{cert} is not a PEM certificate: {exc}") from None
    return ",".join("+".join(_attribute(attr) for attr in rdn) for rdn in reversed(list(name.rdns)))


def _attribute(attr: Any) -> str:
    oid = attr.oid.dotted_string
    keyword = _KEYWORDS.get(oid)
    if keyword is None:  # Java: the OID, and the value's DER encoding in hex
        raw = attr.value.encode("utf-8") if isinstance(attr.value, str) else bytes(attr.value)
        return f"{oid}=#{_der(attr._type.value, raw).hex()}"
    return f"{keyword}={_escape(str(attr.value))}"


def _der(tag: int, content: bytes) -> bytes:
    size = len(content)
    if size < 0x80:
        return bytes([tag, size]) + content
    length = size.to_bytes((size.bit_length() + 7) // 8, "big")
    return bytes([tag, 0x80 | len(length)]) + length + content


def _escape(value: str) -> str:
    out = "".join("\\" + c if c in _SPECIAL else c for c in value)
    if out.startswith(" "):
        out = "\\" + out
    if out.endswith(" ") and not out.endswith("\\ "):
        out = out[:-1] + "\\ "
    return out
