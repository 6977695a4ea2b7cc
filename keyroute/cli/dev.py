"""The development commands: `keyroute demo`, `keyroute zookeeper` and `keyroute schema-registry`. Each imports
its tool from keyroute.dev when it runs, never when the command line loads."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path
from typing import Any

from keyroute.cli.options import (
    _optional_path,
    _Parser,
    _port,
    _without_pipeline_extra,
)


def add_zookeeper(p: _Parser, sub: Any) -> list[argparse.ArgumentParser]:
    """`keyroute zookeeper`."""
    zk = sub.add_parser("zookeeper", help="run a real ZooKeeper server in the foreground (needs only Java)")
    p.option(zk, "--port", type=int, default=2181, help="client port")
    p.option(zk, "--host", default="127.0.0.1", help="address to listen on")
    p.option(zk, "--data-dir", type=Path, required=True, help="where ZooKeeper keeps its data")
    p.option(zk, "--secure-port", type=int, help="TLS client port (needs --tls-cert and --tls-key)")
    p.option(zk, "--tls-cert", type=_optional_path, metavar="PEM", help="the server's certificate (chain)")
    p.option(zk, "--tls-key", type=_optional_path, metavar="PEM", help="the key of --tls-cert")
    p.option(
        zk,
        "--tls-client-ca",
        type=_optional_path,
        metavar="PEM",
        help="require client certificates on the TLS port, chaining to this CA; a client is then known by its "
        "certificate's subject DN (x509 ACLs)",
    )
    p.flag(zk, "--tls-only", help="serve the TLS port alone: no plaintext client port")
    return [zk]


def add_demo(p: _Parser, sub: Any) -> list[argparse.ArgumentParser]:
    """`keyroute demo`."""
    demo = sub.add_parser("demo", help="run everything on this machine with generated sample data")
    p.option(demo, "--port", type=int, default=8080, help="router port")
    p.option(demo, "--workdir", type=Path, default=Path(".keyroute-demo"), help="where the demo keeps its files")
    p.option(demo, "--events", type=int, default=120_000, help="sample events per store")
    demo.add_argument(
        "action", nargs="?", choices=["kill-node"], help="kill-node N: SIGKILL the running demo's node-N (a crash)"
    )
    demo.add_argument("node", nargs="?", type=int, metavar="N", help="the node to kill (0, 1, 2)")
    return [demo]


def add_schema_registry(p: _Parser, sub: Any) -> list[argparse.ArgumentParser]:
    """`keyroute schema-registry`."""
    registry = sub.add_parser(
        "schema-registry",
        help="run a development Schema Registry (the REST API subset confluent-kafka's clients use; not for "
        "production)",
    )
    p.option(registry, "--port", type=_port, default=8081, help="port to listen on")
    p.option(registry, "--host", default="127.0.0.1", help="address to listen on")
    p.option(registry, "--data", type=Path, help="a JSON file the registry keeps its schemas in (default: memory)")
    return [registry]


def cmd_zookeeper(args: argparse.Namespace) -> int:
    from keyroute.dev.zookeeper_server import ServerTls, ZooKeeperLaunchError, check_port_free, command

    tls = None
    if args.secure_port is not None:
        if args.tls_cert is None or args.tls_key is None:
            print("keyroute zookeeper: --secure-port needs --tls-cert and --tls-key", file=sys.stderr)
            return 1
        tls = ServerTls(args.secure_port, args.tls_cert, args.tls_key, args.tls_client_ca, not args.tls_only)
    elif args.tls_only or args.tls_cert or args.tls_key or args.tls_client_ca:
        print("keyroute zookeeper: the TLS options need --secure-port (KEYROUTE_SECURE_PORT)", file=sys.stderr)
        return 1
    try:
        for port in [args.port] if tls is None or tls.plaintext else []:
            check_port_free(args.host, port)
        if tls is not None:
            check_port_free(args.host, tls.port)
        argv = command(args.data_dir.resolve(), args.port, args.host, tls=tls)
    except ZooKeeperLaunchError as exc:
        print(f"keyroute zookeeper: {exc}", file=sys.stderr)
        return 1
    sys.stdout.flush()
    os.execv(argv[0], argv)  # the JVM takes over this process: signals reach ZooKeeper directly
    return 0  # pragma: no cover


def cmd_schema_registry(args: argparse.Namespace) -> int:
    from keyroute.dev.schema_registry_dev import Registry, serve

    try:
        with socket.create_server((args.host, args.port)):
            pass
    except OSError as exc:
        print(f"keyroute schema-registry: cannot listen on {args.host}:{args.port}: {exc.strerror}", file=sys.stderr)
        return 1
    try:
        Registry(args.data)  # a data file that does not load is a usage error, not a traceback
    except ValueError as exc:
        print(f"keyroute schema-registry: {exc}", file=sys.stderr)
        return 1
    serve(args.host, args.port, args.data)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    if _without_pipeline_extra("keyroute demo"):
        return 1
    from keyroute.dev.demo import DemoSettings, kill_node, run

    if args.action == "kill-node":
        if args.node is None:
            print("keyroute demo kill-node: which node? e.g. `keyroute demo kill-node 1`", file=sys.stderr)
            return 1
        return kill_node(args.workdir.resolve(), args.node)
    return run(DemoSettings(router_port=args.port, workdir=args.workdir.resolve(), events=args.events))
