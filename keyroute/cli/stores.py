"""`keyroute pipeline build` (compute stores and publish new versions) and `keyroute store` (list, roll back,
delete and adopt published stores)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from keyroute.cli.options import (
    _environ_with_secrets_dir,
    _optional_path,
    _Parser,
    _positive_int,
    _secrets_dir_option,
    _without_pipeline_extra,
    _zk_options,
    zk_settings_of,
)
from keyroute.runtime.settings import (
    ZkSettings,
)

# The pipeline's default, repeated here so that `keyroute --help` does not import the pipeline.
DEFAULT_RETAIN = 3


def add_pipeline(p: _Parser, sub: Any) -> list[argparse.ArgumentParser]:
    """`keyroute pipeline build`."""
    pipe = sub.add_parser("pipeline", help="compute stores with Spark and publish new versions")
    pipe_sub = pipe.add_subparsers(dest="pipeline_command", required=True, metavar="ACTION")
    build = pipe_sub.add_parser("build", help="compute every store in the spec, write and publish a new version")
    p.option(build, "--spec", type=Path, required=True, help="store spec (TOML)")
    _zk_options(p, build, writes=True)
    p.option(build, "--output", required=True, help="snapshot root (path or file:// URI shared with the nodes)")
    p.option(build, "--master", help="Spark master (default: local[*])")
    p.option(
        build,
        "--spark-secret-file",
        type=_optional_path,
        metavar="FILE",
        help="shared secret: Spark's RPC authenticated and encrypted, shuffle files encrypted (on Kubernetes "
        "the same file must be mounted in the executors)",
    )
    p.option(
        build,
        "--retain",
        type=int,
        default=DEFAULT_RETAIN,
        help="versions of each store kept for a rollback, the new one included; older snapshots are removed",
    )

    _secrets_dir_option(p, build)
    return [build]


def add_store(p: _Parser, sub: Any) -> list[argparse.ArgumentParser]:
    """`keyroute store list|rollback|delete|adopt`."""
    store = sub.add_parser("store", help="list published stores, roll a store back to a retained version, delete one")
    store_sub = store.add_subparsers(dest="store_command", required=True, metavar="ACTION")
    listing = store_sub.add_parser("list", help="print each store's current and retained versions (JSON lines)")
    _zk_options(p, listing, writes=False)
    roll = store_sub.add_parser("rollback", help="make a retained version of a store current again")
    _zk_options(p, roll, writes=True)
    p.option(roll, "--store", required=True, help="store name")
    p.option(roll, "--version", type=int, required=True, help="a retained version (see `keyroute store list`)")
    p.flag(roll, "--no-verify", help="do not check the version's snapshot manifest from this machine")
    delete = store_sub.add_parser(
        "delete", help="delete a store: its record goes and a tombstone tells every node to drop its files"
    )
    _zk_options(p, delete, writes=True)
    p.option(delete, "--store", required=True, help="store name")
    _adopt_parser(p, store_sub)
    return [listing, roll]


def _names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected one or more store names separated by commas")
    return names


def _adopt_parser(p: _Parser, store_sub: Any) -> None:
    adopt = store_sub.add_parser(
        "adopt",
        help="publish again the complete versions an output location holds, into an empty or rebuilt ZooKeeper",
    )
    _zk_options(p, adopt, writes=True)
    p.option(adopt, "--output", required=True, help="the pipeline's --output: a directory or filesystem URI")
    p.option(
        adopt,
        "--store",
        type=_names,
        metavar="S[,S...]",
        help="adopt only these stores (default: every store found under --output)",
    )
    p.option(
        adopt,
        "--retain",
        type=_positive_int,
        default=DEFAULT_RETAIN,
        help="versions of each store to publish, the newest current and the others retained for a rollback",
    )
    p.option(
        adopt,
        "--replication-factor",
        type=_positive_int,
        default=1,
        help="replicas per partition of a store that has no record (the spec's value; manifests do not hold it)",
    )
    ids = p.exclusive(adopt)
    p.option(
        ids,
        "--cluster-id",
        help="when the chroot has no cluster id: restore this one (node.json of the nodes' data directories) so "
        "that those nodes may rejoin",
    )
    p.flag(
        ids,
        "--new-cluster-id",
        help="when the chroot has no cluster id: create a new one (nodes that joined the old cluster then refuse "
        "to start)",
    )


def cmd_pipeline(args: argparse.Namespace) -> int:
    if _without_pipeline_extra("keyroute pipeline build"):
        return 1
    from keyroute.pipeline.build import KafkaAccess, build
    from keyroute.pipeline.errors import PipelineError
    from keyroute.pipeline.publish import retaining

    if args.retain < 1:
        print("keyroute pipeline build: --retain must be at least 1", file=sys.stderr)
        return 2
    try:
        with retaining(args.retain):
            # Live stores' Kafka settings may name environment variables (secrets): resolved here, at the edge.
            kafka = KafkaAccess(_environ_with_secrets_dir(args))
            secret = args.spark_secret_file
            zk_settings = zk_settings_of(args)
            published = build(args.spec, zk_settings, args.output, args.master, kafka=kafka, spark_secret_file=secret)
    except PipelineError as exc:
        print(f"keyroute pipeline build: {exc}", file=sys.stderr)
        return 1
    for version in published:
        print(json.dumps(version.describe()))
    return 0


def cmd_store(args: argparse.Namespace) -> int:
    if args.store_command == "adopt":  # an operator's tool on the serving image: nothing of the pipeline's
        return cmd_adopt(args)
    from keyroute.cluster.zk import ZkUnavailableError, close, connect
    from keyroute.pipeline.errors import PipelineError
    from keyroute.pipeline.publish import delete_store, describe_store, list_stores, rollback

    what = f"keyroute store {args.store_command}"
    try:
        # Listing only reads: it creates nothing, so a read-only identity may list.
        client = connect(zk_settings_of(args), ensure_layout=args.store_command != "list")
    except ZkUnavailableError as exc:
        print(f"{what}: {exc}", file=sys.stderr)
        return 1
    try:
        if args.store_command == "list":
            records = list_stores(client)
            for record in records:
                print(json.dumps(describe_store(record), ensure_ascii=False))
            if not records:
                return _nothing_published(what, client, zk_settings_of(args))
            return 0
        if args.store_command == "delete":
            print(json.dumps(delete_store(client, args.store), ensure_ascii=False))
            return 0
        before = next((r for r in list_stores(client) if r.name == args.store), None)
        if before is not None and before.version == args.version:
            print(
                f"{what}: version {args.version} is already current for store {args.store!r}; nothing was changed",
                file=sys.stderr,
            )
            return 1
        record = rollback(client, args.store, args.version, verify=not args.no_verify)
    except PipelineError as exc:
        print(f"{what}: {exc}", file=sys.stderr)
        return 1
    finally:
        close(client)
    line = describe_store(record)
    line["previous_version"] = before.version if before is not None else None
    print(json.dumps(line, ensure_ascii=False))
    return 0


def _nothing_published(what: str, client: Any, zk: ZkSettings) -> int:
    """No store to list: 1 with one line when the chroot holds no cluster at all (likely a mistyped --zk),
    0 with a note when a cluster is there and has published nothing yet."""
    from keyroute.cluster import zk_layout
    from keyroute.cluster.cluster_identity import chroots_with_a_cluster, empty_chroot_message

    nodes = client.get_children(zk_layout.NODES) if client.exists(zk_layout.NODES) else []
    if client.exists(zk_layout.CLUSTER) is None and not nodes:
        print(f"{what}: {empty_chroot_message(zk, chroots_with_a_cluster(zk))}", file=sys.stderr)
        return 1
    print(f"{what}: no store is published at {zk.connect_string} yet", file=sys.stderr)
    return 0


def cmd_adopt(args: argparse.Namespace) -> int:
    from keyroute.cli.adopt import AdoptError, adopt
    from keyroute.cluster.cluster_identity import ClusterIdError, create_cluster_id, read_cluster_id
    from keyroute.cluster.zk import ZkUnavailableError, close, connect

    what = "keyroute store adopt"
    try:
        client = connect(zk_settings_of(args))
    except ZkUnavailableError as exc:
        print(f"{what}: {exc}", file=sys.stderr)
        return 1
    try:
        chroot = zk_settings_of(args).chroot or "/"
        found = read_cluster_id(client)
        if found is None and args.cluster_id is None and not args.new_cluster_id:
            print(
                f"{what}: chroot {chroot} has no cluster id: pass --cluster-id ID (the cluster_id in the nodes' "
                "node.json) to let those nodes rejoin, or --new-cluster-id for a new cluster",
                file=sys.stderr,
            )
            return 1
        if found is not None and (args.new_cluster_id or args.cluster_id not in (None, found.id)):
            print(f"{what}: chroot {chroot} already has cluster id {found.id}; nothing was changed", file=sys.stderr)
            return 1
        if found is None:
            created, _ = create_cluster_id(client, args.cluster_id)
            print(f"{what}: chroot {chroot} now has cluster id {created.id}", file=sys.stderr)
        results = adopt(
            client,
            args.output,
            args.store,
            retain=args.retain,
            replication_factor=args.replication_factor,
        )
    except (AdoptError, ClusterIdError) as exc:
        print(f"{what}: {exc}", file=sys.stderr)
        return 1
    finally:
        close(client)
    for result in results:
        for skipped in result.skipped:
            print(f"{what}: store {result.store!r}: skipped {skipped}", file=sys.stderr)
        print(json.dumps(result.describe(), ensure_ascii=False))
    return 1 if any(result.action == "skipped" for result in results) else 0
