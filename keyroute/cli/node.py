"""`keyroute node` (run a state node), `keyroute node-drain` and `keyroute zone-from-node` (a node's init
container)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from keyroute.cli.options import (
    _non_negative_float,
    _Parser,
    _positive_float,
    _secrets_dir_option,
    _zk_options,
    quota_file_refused,
    zk_settings_of,
)
from keyroute.cli.serving import _admin_port_option, _serving_options, _tls_options, http_settings_of, limits_of
from keyroute.keys.schema_registry import SECRETS_DIR_VARIABLE
from keyroute.runtime.settings import HttpSettings, NodeSettings, ZkSettings
from keyroute.zone import (
    SERVICE_ACCOUNT_DIR,
    ZONE_LABELS,
    ZoneError,
    in_cluster_api_url,
    node_zone,
    write_zone,
    zone_from_node,
)

_log = logging.getLogger("keyroute.cli")


def add_node(p: _Parser, sub: Any) -> list[argparse.ArgumentParser]:
    """`keyroute node`."""
    node = sub.add_parser("node", help="run a state node")
    _zk_options(p, node, writes=True)
    _secrets_dir_option(p, node)
    p.option(node, "--node-id", required=True, help="unique, stable node id (e.g. the pod name)")
    p.option(node, "--port", type=int, required=True, help="HTTP port")
    _admin_port_option(p, node)
    _tls_options(p, node, router=False)
    p.setting(node, HttpSettings, "host")
    p.setting(node, HttpSettings, "advertise_url")
    p.option(node, "--data-dir", type=Path, required=True, help="where the node keeps its loaded partitions")
    p.setting(node, NodeSettings, "zone")
    p.option(
        node,
        "--zone-file",
        type=Path,
        help="when --zone is empty, read the zone from this file at start (in Kubernetes: written by the init "
        "container `keyroute zone-from-node`); an empty file gives no zone",
    )
    p.flag(
        node,
        "--require-zone",
        help="refuse to start without a zone (from --zone or --zone-file): replicas would spread over nodes only",
    )
    # The node's waits and timeouts, as --help lists them.
    p.setting(node, ZkSettings, "session_timeout_s", type=float)
    p.setting(node, NodeSettings, "drain_timeout_s", type=float)
    p.setting(node, NodeSettings, "restart_grace_s", type=_non_negative_float)
    p.setting(node, NodeSettings, "version_grace_s", type=float)
    p.setting(node, NodeSettings, "expiry_sweep_s", type=_non_negative_float)
    p.setting(node, NodeSettings, "forward_timeout_s", type=float)
    p.setting(node, NodeSettings, "min_offset_wait_ms", type=float)
    p.setting(node, NodeSettings, "live_batch_records", type=int)
    p.setting(node, NodeSettings, "live_sync_ms", type=_non_negative_float)
    _serving_options(p, node, NodeSettings)
    p.setting(node, NodeSettings, "quota_file")
    return [node]


def add_node_drain(p: _Parser, sub: Any) -> list[argparse.ArgumentParser]:
    """`keyroute node-drain`."""
    drain = sub.add_parser(
        "node-drain",
        help="make a node's next stop a departure (scale-down, decommission): its partitions are handed over "
        "rather than held for its restart",
    )
    _zk_options(p, drain, writes=True)
    p.option(drain, "--node-id", required=True, help="the node to drain")
    return []


def add_zone_from_node(p: _Parser, sub: Any) -> list[argparse.ArgumentParser]:
    """`keyroute zone-from-node`."""
    zone = sub.add_parser(
        "zone-from-node",
        help="write the zone label of the Kubernetes Node this pod runs on to a file (an init container's job)",
    )
    p.option(
        zone, "--output", type=Path, required=True, help="file to write the zone to (empty when the Node has none)"
    )
    p.option(zone, "--node-name", default="", help="the Kubernetes Node's name (downward API: spec.nodeName)")
    p.option(
        zone,
        "--api-url",
        default=in_cluster_api_url(p.env),
        help="the Kubernetes API server (default: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT)",
    )
    p.option(
        zone,
        "--service-account-dir",
        type=Path,
        default=SERVICE_ACCOUNT_DIR,
        help="where the pod's service-account token (token) and the cluster's CA (ca.crt) are mounted",
    )
    p.option(zone, "--timeout-s", type=_positive_float, default=10.0, help="timeout for the request to the API server")
    return [zone]


def cmd_node(args: argparse.Namespace) -> int:
    from keyroute.state_node.service import run

    # A live partition resolves its Kafka settings' `${NAME}` references from the process's environment (when
    # it connects): the folder given as a flag goes there, at this edge, once.
    if args.secrets_dir is not None:
        os.environ[SECRETS_DIR_VARIABLE] = str(args.secrets_dir)

    try:
        zone = node_zone(args.zone, args.zone_file, args.require_zone)
    except ZoneError as exc:
        print(f"keyroute node: {exc}", file=sys.stderr)
        return 1
    if not zone:
        _log.warning(
            "this node has no zone (--zone, --zone-file): the controller spreads its partitions' replicas over "
            "nodes only, and a zone's outage may take every replica of a partition"
        )
    settings = NodeSettings(
        node_id=args.node_id,
        data_dir=args.data_dir,
        zk=zk_settings_of(args),
        http=http_settings_of(args, advertise_url=args.advertise_url),
        zone=zone,
        drain_timeout_s=args.drain_timeout_s,
        restart_grace_s=args.restart_grace_s,
        version_grace_s=args.version_grace_s,
        expiry_sweep_s=args.expiry_sweep_s,
        forward_timeout_s=args.forward_timeout_s,
        min_offset_wait_ms=args.min_offset_wait_ms,
        live_batch_records=args.live_batch_records,
        live_sync_ms=args.live_sync_ms,
        **limits_of(args),
        quota_file=args.quota_file,
    )
    if quota_file_refused("keyroute node", settings.quota_file):
        return 1
    return run(settings)


def cmd_node_drain(args: argparse.Namespace) -> int:
    from keyroute.cluster.zk import ZkUnavailableError, close, connect
    from keyroute.state_node.registration import request_drain

    try:
        client = connect(zk_settings_of(args), ensure_layout=False)
    except ZkUnavailableError as exc:
        print(f"keyroute node-drain: {exc}", file=sys.stderr)
        return 1
    try:
        at = request_drain(client, args.node_id)
    finally:
        close(client)
    print(json.dumps({"node_id": args.node_id, "drain_requested_at": at}))
    return 0


def cmd_zone_from_node(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # its one INFO line per request says nothing more
    try:
        found = zone_from_node(args.node_name, args.api_url, args.service_account_dir, timeout_s=args.timeout_s)
        write_zone(args.output, found.zone)
    except ZoneError as exc:
        print(f"keyroute zone-from-node: {exc}", file=sys.stderr)
        return 1
    if found.zone:
        _log.info("zone %s (label %s of node %s) written to %s", found.zone, found.label, found.node_name, args.output)
    else:
        _log.warning(
            "node %s has no %s label: %s is empty, this keyroute node will have no zone",
            found.node_name,
            " or ".join(ZONE_LABELS),
            args.output,
        )
    return 0
