"""`keyroute router`: run a router."""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any

from keyroute.cli.options import (
    _non_negative_float,
    _Parser,
    _percent,
    _positive_int,
    _zk,
    _zk_options,
)
from keyroute.cli.serving import _admin_port_option, _http_settings, _limits, _serving_options, _tls_options
from keyroute.runtime.logs import configure as configure_logs
from keyroute.runtime.settings import (
    DEFAULT_STALL_AFTER_MS,
    RouterSettings,
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
    p.option(router, "--host", default="127.0.0.1", help="address to listen on")
    p.option(
        router,
        "--router-id",
        default="",
        help="this router's id, which its member certificate names (keyroute-router.ID.DOMAIN); default: the host "
        "name (on Kubernetes, the pod name)",
    )
    p.option(router, "--upstream-timeout-s", type=float, default=5.0, help="timeout for one request to a node")
    p.option(router, "--zk-session-timeout-s", type=float, default=10.0, help="ZooKeeper session timeout")
    p.option(router, "--upstream-connect-timeout-s", type=float, default=1.0, help="timeout for connecting to a node")
    _serving_options(p, router)
    p.option(
        router,
        "--hedge-after-ms",
        type=_hedge_after_ms,
        default="auto",
        help="send a single-key read not answered within this many ms to a second replica too; "
        "auto: the p95 of recent node latencies (2 ms to 1 s); 0: never",
    )
    p.option(
        router,
        "--retry-budget-percent",
        type=_percent,
        default=10.0,
        help="hedges allowed as a percentage of reads (plus a burst of 10); failovers after errors always go",
    )
    p.option(
        router,
        "--stall-after-ms",
        type=_non_negative_float,
        default=DEFAULT_STALL_AFTER_MS,
        help="a read none of whose requests has replied within this many ms goes to the next replica, "
        "whatever the retry budget (a frozen node); 0: never",
    )
    p.option(
        router,
        "--workers",
        type=_positive_int,
        default=1,
        help="router processes sharing the port, each with its own map watcher (about one per spare core)",
    )
    p.option(
        router,
        "--quota-file",
        default="",
        help="TOML file of read quotas per identity and store (reads/s, split among the routers up), "
        "re-read when it changes; none: no quotas",
    )
    return [router]


def cmd_router(args: argparse.Namespace) -> int:
    from keyroute.http.quotas import quota_file_error
    from keyroute.router.service import run

    settings = RouterSettings(
        zk=_zk(args),
        http=_http_settings(args),
        upstream_timeout_s=args.upstream_timeout_s,
        upstream_connect_timeout_s=args.upstream_connect_timeout_s,
        **_limits(args),
        hedge_after_ms=args.hedge_after_ms,
        retry_budget_percent=args.retry_budget_percent,
        stall_after_ms=args.stall_after_ms,
        workers=args.workers,
        quota_file=args.quota_file,
        router_id=args.router_id,
    )
    if settings.quota_file and (refused := quota_file_error(settings.quota_file)) is not None:
        print(f"keyroute router: {refused}", file=sys.stderr)
        return 1
    # Worker processes start afresh and set up their logging as this process did.
    return run(
        settings,
        setup=functools.partial(configure_logs, args.log_format, str(args.log_level), fields={"service": "router"}),
    )
