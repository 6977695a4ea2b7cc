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
    _zk,
    _zk_options,
)
from keyroute.cli.serving import _admin_port_option, _http_settings, _limits, _serving_options, _tls_options
from keyroute.keys.schema_registry import SECRETS_DIR_VARIABLE
from keyroute.runtime.settings import (
    NodeSettings,
)
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
    p.option(node, "--host", default="127.0.0.1", help="address to listen on")
    p.option(node, "--advertise-url", default="", help="URL other members use to reach this node")
    p.option(node, "--data-dir", type=Path, required=True, help="where the node keeps its loaded partitions")
    p.option(
        node,
        "--zone",
        default="",
        help="failure domain this node runs in (availability zone, rack): a partition's replicas go to different "
        "zones when there are enough (in Kubernetes: the Node's topology.kubernetes.io/zone label, see --zone-file)",
    )
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
    # The node's waits and timeouts, as --help lists them: (flag, type, default, help).
    for flag, kind, default, text in (
        ("--zk-session-timeout-s", float, 10.0, "ZooKeeper session timeout"),
        (
            "--drain-timeout-s",
            float,
            60.0,
            "on SIGTERM, how long to wait for other nodes to serve this node's partitions",
        ),
        (
            "--restart-grace-s",
            _non_negative_float,
            120.0,
            "on SIGTERM, how long this node's partitions stay assigned to it while it restarts (0: hand them over; "
            "`keyroute node-drain` makes the next stop a departure)",
        ),
        (
            "--version-grace-s",
            float,
            300.0,
            "how long a replaced version's files stay on disk (a rollback meanwhile reuses them)",
        ),
        ("--forward-timeout-s", float, 5.0, "timeout for one request to another node"),
        (
            "--min-offset-wait-ms",
            float,
            500.0,
            "how long a read with min_offset waits for a live partition to apply it (then 503 not_up_to_bound)",
        ),
    ):
        p.option(node, flag, type=kind, default=default, help=text)
    p.option(
        node,
        "--live-batch-records",
        type=int,
        default=2000,
        help="records a live store's consumer takes per call; each partition's share goes in one LMDB transaction",
    )
    p.option(
        node,
        "--live-sync-ms",
        type=_non_negative_float,
        default=1000.0,
        help="how often a live partition's commits are flushed to disk (0: after every commit); a process crash "
        "loses nothing either way",
    )
    _serving_options(p, node)
    p.option(
        node,
        "--quota-file",
        default="",
        help="TOML file of read quotas per identity and store (reads/s, split among the nodes serving the store) "
        "for reads made straight to this node (direct mode), re-read when it changes; needs --cluster-secret or "
        "--member-ca; none: no quotas",
    )
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
    from keyroute.http.quotas import quota_file_error
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
        zk=_zk(args),
        http=_http_settings(args, advertise_url=args.advertise_url),
        zone=zone,
        drain_timeout_s=args.drain_timeout_s,
        restart_grace_s=args.restart_grace_s,
        version_grace_s=args.version_grace_s,
        forward_timeout_s=args.forward_timeout_s,
        min_offset_wait_ms=args.min_offset_wait_ms,
        live_batch_records=args.live_batch_records,
        live_sync_ms=args.live_sync_ms,
        **_limits(args),
        quota_file=args.quota_file,
    )
    if settings.quota_file and (refused := quota_file_error(settings.quota_file)) is not None:
        print(f"keyroute node: {refused}", file=sys.stderr)
        return 1
    return run(settings)


def cmd_node_drain(args: argparse.Namespace) -> int:
    from keyroute.cluster.zk import ZkUnavailableError, close, connect
    from keyroute.state_node.registration import request_drain

    try:
        client = connect(_zk(args), ensure_layout=False)
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
