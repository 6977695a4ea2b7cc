"""The `keyroute` command: parses options (each also read from a KEYROUTE_* variable) and starts services.

The environment is read here, in the CLI, and nowhere else; everything inward receives typed settings. This
module builds the parser and runs a command; each command group has its module: node (node, node-drain,
zone-from-node), router, stores (pipeline build, store), cluster (cluster, zk), partition, and dev (demo,
zookeeper, schema-registry). options holds the parser's machinery and the options several groups share,
serving those of routers and nodes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence

from keyroute.cli import cluster, dev, node, partition, router, stores
from keyroute.cli.options import (
    DeclaredOption,
    _ArgumentParser,
    _check_zk_options,
    _Parser,
    _read_secret_files,
    _unrecognized,
    _unusable_zk_tls_files,
)
from keyroute.runtime.logs import FORMATS
from keyroute.runtime.logs import configure as configure_logs

# The settings each command builds from its options (the CLI's tests drive them directly).
from keyroute.cli.options import zk_settings_of  # noqa: F401  # isort: skip
from keyroute.cli.serving import http_settings_of, limits_of  # noqa: F401  # isort: skip


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    return _build(_Parser(env))


def declared_options(env: Mapping[str, str]) -> list[DeclaredOption]:
    """Every option of every command, as declared: what `--help` shows and docs/configuration.md lists."""
    p = _Parser(env)
    _build(p)
    return p.declared


def _build(p: _Parser) -> argparse.ArgumentParser:
    parser = _ArgumentParser(
        prog="keyroute",
        description=(
            "One-hop HTTP reads of partitioned state, split exactly as a Kafka producer splits a keyed topic."
        ),
    )
    p.option(parser, "--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    p.option(
        parser,
        "--log-format",
        default="text",
        choices=FORMATS,
        help="text (for a terminal) or json (one JSON object per line, for log collectors)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    leaves = [
        *dev.add_zookeeper(p, sub),
        *stores.add_pipeline(p, sub),
        *node.add_node(p, sub),
        *router.add_router(p, sub),
        *stores.add_store(p, sub),
        *node.add_node_drain(p, sub),
        *cluster.add_cluster(p, sub),
        *cluster.add_zk(p, sub),
        *node.add_zone_from_node(p, sub),
        *dev.add_demo(p, sub),
        *dev.add_schema_registry(p, sub),
        *partition.add_partition(p, sub),
    ]
    # The logging options are taken after the command too (`keyroute node --log-level DEBUG ...`).
    for leaf in leaves:
        leaf.add_argument("--log-level", default=argparse.SUPPRESS, help="as before the command")
        leaf.add_argument("--log-format", default=argparse.SUPPRESS, choices=FORMATS, help="as before the command")
    return parser


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "zookeeper": dev.cmd_zookeeper,
    "pipeline": stores.cmd_pipeline,
    "store": stores.cmd_store,
    "node": node.cmd_node,
    "router": router.cmd_router,
    "demo": dev.cmd_demo,
    "partition": partition.cmd_partition,
    "schema-registry": dev.cmd_schema_registry,
    "cluster": cluster.cmd_cluster,
    "zk": cluster.cmd_zk,
    "node-drain": node.cmd_node_drain,
    "zone-from-node": node.cmd_zone_from_node,
}


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    parser = build_parser(env)
    args, extras = parser.parse_known_args(argv)
    if extras:
        parser.exit(2, _unrecognized(parser, args, extras) + "\n")
    if (unreadable := _read_secret_files(args)) is not None:
        print(f"keyroute {args.command}: {unreadable}", file=sys.stderr)
        return 1
    _check_zk_options(parser, args)
    if (unusable := _unusable_zk_tls_files(args)) is not None:
        print(f"keyroute {args.command}: {unusable}", file=sys.stderr)
        return 1
    if args.log_format not in FORMATS:  # a value from the environment, which argparse does not check
        parser.error(f"--log-format (KEYROUTE_LOG_FORMAT) must be one of {', '.join(FORMATS)}")
    fields = {"service": args.command}
    if getattr(args, "node_id", None):
        fields["node"] = args.node_id
    configure_logs(args.log_format, str(args.log_level), fields=fields)
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`keyroute partition ... | head`): stop quietly, as other tools do. Python would
        # otherwise complain again when it flushes stdout at exit.
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE
