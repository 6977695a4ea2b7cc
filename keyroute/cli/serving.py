"""The options routers and nodes share: request limits, access control, TLS, the admin port; and the settings
they make."""

from __future__ import annotations

import argparse
from typing import Any

from keyroute.auth.authn import AuthnError, check_jwks_url
from keyroute.cli.options import (
    _Parser,
    _port,
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


def _serving_options(p: _Parser, parser: argparse.ArgumentParser, settings: type) -> None:
    """Request limits and access control, the same for routers and nodes (`settings`: RouterSettings or
    NodeSettings)."""
    p.setting(parser, AccessSettings, "cluster_secret", type=_secret_text, secret=True)
    _secret_file_option(p, parser, "--cluster-secret")
    p.setting(parser, AccessSettings, "admin_token", type=_secret_text, secret=True)
    _secret_file_option(p, parser, "--admin-token")
    p.setting(parser, AccessSettings, "metrics_require_token")
    p.setting(parser, AccessSettings, "metrics_open")
    for name in ("access_tokens", "jwt_issuer", "jwt_audience", "jwt_jwks_url", "jwt_jwks_file"):
        p.setting(parser, AccessSettings, name)
    p.setting(parser, AccessSettings, "jwt_jwks_refresh_s", type=_positive_float)
    p.setting(parser, AccessSettings, "jwt_jwks_allow_http")
    for name in ("jwt_stores_claim", "jwt_groups_claim", "jwt_groups_file"):
        p.setting(parser, AccessSettings, name)
    p.setting(parser, settings, "max_batch_keys", type=int)
    for name in (
        "max_key_bytes",
        "max_body_bytes",
        "max_header_bytes",
        "max_concurrent_requests",
        "max_concurrent_per_caller",
    ):
        p.setting(parser, RequestLimits, name, type=int)
    p.setting(parser, RequestLimits, "body_timeout_s", type=float)


def _admin_port(text: str) -> int | None:
    """A port number, or empty (an unset variable): none."""
    text = text.strip()
    return _port(text) if text else None


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
    p.setting(parser, TlsSettings, "cert")
    p.setting(parser, TlsSettings, "key")
    if router:
        p.setting(parser, TlsSettings, "client_ca")
    else:
        p.setting(
            parser,
            TlsSettings,
            "client_ca",
            help="PEM CA file of clients reading nodes directly, beside --member-ca (a different CA): its "
            "certificates are callers', never members'",
        )
    p.setting(parser, TlsSettings, "member_ca")


def http_settings_of(args: argparse.Namespace, **kwargs: Any) -> HttpSettings:
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


def limits_of(args: argparse.Namespace) -> dict[str, Any]:
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
