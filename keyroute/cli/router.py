"""`keyroute router`: run a router."""

from __future__ import annotations

import argparse
import functools
from typing import Any

from keyroute.cli.options import (
    _non_negative_float,
    _Parser,
    _percent,
    _positive_int,
    _zk_options,
    quota_file_refused,
    zk_settings_of,
)
from keyroute.cli.serving import _admin_port_option, _serving_options, _tls_options, http_settings_of, limits_of
from keyroute.runtime.logs import configure as configure_logs
from keyroute.runtime.settings import (
    HttpSettings,
    RouterSettings,
    ZkSettings,
)


def _hedge_after_ms(text: str) -> float | None:
    """`auto` (None: derived from observed latencies) or a number of milliseconds, 0 meaning never."""
    if text.strip().lower() == "auto":
        return None
    try:
        return _non_negative_float(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number of milliseconds: {exc}") from None


def add_router(p: _Parser, sub: Any) -> list[argparse.ArgumentParser]:
    """`keyroute router`."""
    router = sub.add_parser("router", help="run a router")
    _zk_options(p, router, writes=False)
    p.option(router, "--port", type=int, required=True, help="HTTP port")
    _admin_port_option(p, router)
    _tls_options(p, router, router=True)
    p.setting(router, HttpSettings, "host")
    p.setting(router, RouterSettings, "router_id")
    p.setting(router, RouterSettings, "upstream_timeout_s", type=float)
    p.setting(router, ZkSettings, "session_timeout_s", type=float)
    p.setting(router, RouterSettings, "upstream_connect_timeout_s", type=float)
    _serving_options(p, router, RouterSettings)
    p.setting(router, RouterSettings, "hedge_after_ms", type=_hedge_after_ms)
    p.setting(router, RouterSettings, "retry_budget_percent", type=_percent)
    p.setting(router, RouterSettings, "stall_after_ms", type=_non_negative_float)
    p.setting(router, RouterSettings, "workers", type=_positive_int)
    p.setting(router, RouterSettings, "quota_file")
    return [router]


def cmd_router(args: argparse.Namespace) -> int:
    from keyroute.router.service import run

    settings = RouterSettings(
        zk=zk_settings_of(args),
        http=http_settings_of(args),
        upstream_timeout_s=args.upstream_timeout_s,
        upstream_connect_timeout_s=args.upstream_connect_timeout_s,
        **limits_of(args),
        hedge_after_ms=args.hedge_after_ms,
        retry_budget_percent=args.retry_budget_percent,
        stall_after_ms=args.stall_after_ms,
        workers=args.workers,
        quota_file=args.quota_file,
        router_id=args.router_id,
    )
    if quota_file_refused("keyroute router", settings.quota_file):
        return 1
    # Worker processes start afresh and set up their logging as this process did.
    return run(
        settings,
        setup=functools.partial(configure_logs, args.log_format, str(args.log_level), fields={"service": "router"}),
    )
