"""The client's settings and their defaults: timeouts, retries, back-off, answer formats, and TLS (what
servers are verified with, and the certificate the client presents)."""

from __future__ import annotations

import os
import ssl

import httpx

from keyroute.formats.avro_answers import AVRO

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_RETRIES = 3
# Keep-alive connections enough for many reads in flight (per node in direct mode), for the httpx clients (a
# caller's transport, and map reads): httpx's default keeps 20 and would close and reopen connections under a
# higher concurrency.
LIMITS = httpx.Limits(max_connections=256, max_keepalive_connections=256)
MAX_RETRY_WAIT_S = 2.0
# A node that failed (connection) is skipped for this long; a map newer than what answers show is re-read at
# most this often.
NODE_BACKOFF_S = 1.0
MAP_RELOAD_MIN_S = 0.05
# How reads are answered (`answer_format`): what each asks for in its Accept header.
ANSWER_FORMATS = {"json": "application/json", "avro": AVRO}
Format = str | None  # an answer format for one read: "json", "avro", or None for the client's


# A client certificate: one PEM file holding certificate and key, or (certificate file, key file).
ClientCert = str | tuple[str, str]


def tls_context(verify: str | bool, cert: ClientCert | None) -> ssl.SSLContext:
    """What the client verifies servers with: `verify` a CA bundle file (or directory) for https:// routers
    and nodes, True for the system's CAs (httpx's: certifi's bundle), False for none (tests only); `cert`
    presented when a router (or, in direct mode, a node) asks for a client certificate. One context, shared
    by every connection of either wire."""
    if verify is True:
        context = httpx.create_ssl_context(trust_env=False)
    elif verify is False:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    elif isinstance(verify, str | os.PathLike) and os.path.isdir(verify):
        context = ssl.create_default_context(capath=os.fspath(verify))
    else:
        context = ssl.create_default_context(cafile=os.fspath(verify))
    context.set_alpn_protocols(["http/1.1"])
    if cert is not None:
        certfile, keyfile = (cert, None) if isinstance(cert, str | os.PathLike) else cert
        context.load_cert_chain(certfile, keyfile)
    return context
