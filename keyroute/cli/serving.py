"""The options routers and nodes share: request limits, access control, TLS, the admin port; and the settings
they make."""

from __future__ import annotations

import argparse
from typing import Any

from keyroute.auth.authn import AuthnError, check_jwks_url
from keyroute.cli.options import (
    _Parser,
    _positive_float,
    _secret_file_option,
    _secret_text,
)
from keyroute.runtime.settings import (
    AccessSettings,
    HttpSettings,
    RequestLimits,
    TlsSettings,
)


def _serving_options(p: _Parser, parser: argparse.ArgumentParser) -> None:
    """Request limits and access control, the same for routers and nodes."""
    limits = RequestLimits()
    p.option(
        parser,
        "--cluster-secret",
        type=_secret_text,
        secret=True,
        help="shared by every router and node (a Kubernetes Secret); with it, forwarding headers count only "
        "from members proving they hold it. Empty: anyone may send them (local use only). NEW,OLD during a "
        "rotation: members send with the first and accept any",
    )
    _secret_file_option(p, parser, "--cluster-secret")
    p.option(
        parser,
        "--admin-token",
        type=_secret_text,
        secret=True,
        help="token /admin/* requires (Authorization: Bearer TOKEN, or the cookie of a login at /admin/login); "
        "NEW,OLD during a rotation (either is accepted); empty: admin endpoints are open",
    )
    _secret_file_option(p, parser, "--admin-token")
    p.flag(parser, "--metrics-require-token", help="/metrics also requires the admin token")
    p.flag(
        parser,
        "--metrics-open",
        help="with access control on, /metrics answers scrapers without credentials (otherwise it needs an "
        "admin caller or the admin token: its labels name every store and caller)",
    )
    p.option(
        parser,
        "--access-tokens",
        default="",
        help="TOML or JSON file of callers' tokens and certificates, each with its stores (re-read when it "
        "changes); with it (or --jwt-issuer) every read needs a caller allowed its store. Empty: open",
    )
    p.option(parser, "--jwt-issuer", default="", help="accept JWTs from this issuer (`iss`) as bearer tokens")
    p.option(parser, "--jwt-audience", default="", help="the `aud` JWTs must name (empty: not checked)")
    p.option(parser, "--jwt-jwks-url", default="", help="where the issuer's signing keys (JWKS) are fetched")
    p.option(parser, "--jwt-jwks-file", default="", help="the issuer's signing keys (JWKS), from a file")
    p.option(
        parser,
        "--jwt-jwks-refresh-s",
        type=_positive_float,
        default=AccessSettings().jwt_jwks_refresh_s,
        help="fetch the JWKS again this often, in the background: a key removed from it stops authenticating "
        "within one period",
    )
    p.flag(parser, "--jwt-jwks-allow-http", help="accept an http:// --jwt-jwks-url (tests and local issuers only)")
    p.option(parser, "--jwt-stores-claim", default="keyroute_stores", help="the JWT claim listing its stores")
    p.option(parser, "--jwt-groups-claim", default="", help="the JWT claim listing its groups (instead of stores)")
    p.option(parser, "--jwt-groups-file", default="", help="TOML or JSON file: the stores each group may read")
    p.option(parser, "--max-batch-keys", type=int, default=1000, help="keys in one batch-get (413 beyond)")
    p.option(
        parser,
        "--max-key-bytes",
        type=int,
        default=limits.max_key_bytes,
        help="longest key in bytes, UTF-8 after percent-decoding (414, or 400 for a batch entry); 0: no limit",
    )
    p.option(
        parser,
        "--max-body-bytes",
        type=int,
        default=limits.max_body_bytes,
        help="largest request body (413 body_too_large); 0: no limit",
    )
    p.option(
        parser,
        "--max-header-bytes",
        type=int,
        default=limits.max_header_bytes,
        help="largest request line plus headers (431 headers_too_large); 0: no limit",
    )
    p.option(
        parser,
        "--max-concurrent-requests",
        type=int,
        default=limits.max_concurrent_requests,
        help="requests in progress at once; beyond it 503 overloaded with Retry-After at once, never queued; "
        "0: no limit",
    )
    p.option(
        parser,
        "--max-concurrent-per-caller",
        type=int,
        default=limits.max_concurrent_per_caller,
        help="requests in progress at once of one authenticated caller (503 overloaded beyond it); 0: only its "
        "fair share once the process is saturated",
    )
    p.option(
        parser,
        "--body-timeout-s",
        type=float,
        default=limits.body_timeout_s,
        help="a request body must arrive whole within this many seconds (408 body_timeout); 0: no limit",
    )


def _admin_port(text: str) -> int | None:
    """A port number, or empty (an unset variable): none."""
    text = text.strip()
    if not text:
        return None
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, not {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is between 1 and 65535, not {text!r}")
    return port


def _admin_port_option(p: _Parser, parser: argparse.ArgumentParser) -> None:
    p.option(
        parser,
        "--admin-port",
        type=_admin_port,
        # Taken as text from KEYROUTE_ADMIN_PORT and converted by argparse: a bad value is a usage error.
        secret=True,
        help="serve /admin/* and /metrics (and the probes, the API document) on this second port only; the "
        "data port then answers them 404. Unset: everything on --port",
    )


def _tls_options(p: _Parser, parser: argparse.ArgumentParser, *, router: bool) -> None:
    """HTTPS on every port this service listens on, and mutual TLS between members (docs/configuration.md)."""
    p.option(
        parser,
        "--tls-cert",
        default="",
        help="PEM certificate (chain) to serve HTTPS with on every port; reloaded when the file changes",
    )
    p.option(parser, "--tls-key", default="", help="PEM private key of --tls-cert")
    p.option(
        parser,
        "--tls-client-ca",
        default="",
        help="PEM CA file: clients must present a certificate chaining to it (mutual TLS with clients); a client "
        "certificate naming a member role is refused"
        if router
        else "PEM CA file of clients reading nodes directly, beside --member-ca (a different CA): its "
        "certificates are callers', never members'",
    )
    p.option(
        parser,
        "--member-ca",
        default="",
        help="PEM CA file of the cluster's members: connect to nodes over TLS presenting --tls-cert, and (nodes) "
        "require every client's certificate to chain to it, honouring member headers from routers and nodes only",
    )


def _http_settings(args: argparse.Namespace, **kwargs: Any) -> HttpSettings:
    if args.admin_port is not None and args.admin_port == args.port:
        raise SystemExit(f"keyroute {args.command}: --admin-port must differ from --port ({args.port})")
    try:
        tls = TlsSettings(
            cert=args.tls_cert, key=args.tls_key, client_ca=getattr(args, "tls_client_ca", ""), member_ca=args.member_ca
        )
    except ValueError as exc:
        raise SystemExit(f"keyroute {args.command}: {exc}") from None
    advertised = kwargs.get("advertise_url", "")
    if tls.enabled and advertised.lower().startswith("http://"):
        raise SystemExit(f"keyroute {args.command}: --advertise-url {advertised} is http://, but --tls-cert is HTTPS")
    return HttpSettings(host=args.host, port=args.port, admin_port=args.admin_port, tls=tls, **kwargs)


_ACCESS_OPTIONS = (
    "access_tokens",
    "jwt_issuer",
    "jwt_audience",
    "jwt_jwks_url",
    "jwt_jwks_file",
    "jwt_stores_claim",
    "jwt_groups_claim",
    "jwt_groups_file",
)


def _limits(args: argparse.Namespace) -> dict[str, Any]:
    """The settings fields `_serving_options` fills, for NodeSettings and RouterSettings alike."""
    for name in (
        "max_batch_keys",
        "max_key_bytes",
        "max_body_bytes",
        "max_header_bytes",
        "max_concurrent_requests",
        "max_concurrent_per_caller",
    ):
        if getattr(args, name) < 0:
            raise SystemExit(f"keyroute {args.command}: --{name.replace('_', '-')} must not be negative")
    if not args.body_timeout_s >= 0:
        raise SystemExit(f"keyroute {args.command}: --body-timeout-s must not be negative")
    if args.jwt_jwks_url:
        try:
            check_jwks_url(args.jwt_jwks_url, args.jwt_jwks_allow_http)
        except AuthnError as exc:
            raise SystemExit(f"keyroute {args.command}: {exc}") from None
    return {
        "max_batch_keys": max(1, args.max_batch_keys),
        "limits": RequestLimits(
            max_key_bytes=args.max_key_bytes,
            max_body_bytes=args.max_body_bytes,
            max_header_bytes=args.max_header_bytes,
            max_concurrent_requests=args.max_concurrent_requests,
            max_concurrent_per_caller=args.max_concurrent_per_caller,
            body_timeout_s=args.body_timeout_s,
        ),
        "access": AccessSettings(
            cluster_secret=args.cluster_secret or "",
            admin_token=args.admin_token or "",
            metrics_require_token=args.metrics_require_token,
            metrics_open=args.metrics_open,
            **{name: getattr(args, name) or "" for name in _ACCESS_OPTIONS},
            jwt_jwks_refresh_s=args.jwt_jwks_refresh_s,
            jwt_jwks_allow_http=args.jwt_jwks_allow_http,
        ),
    }
