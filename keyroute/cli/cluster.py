"""`keyroute cluster` (the cluster's identity and policy) and `keyroute zk` (back up, restore and lock
keyroute's records in ZooKeeper)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from keyroute.cli.options import (
    _Parser,
    _zk_options,
    zk_settings_of,
)
from keyroute.runtime.settings import (
    ZkSettings,
)

if TYPE_CHECKING:
    from kazoo.client import KazooClient


def add_cluster(p: _Parser, sub: Any) -> list[argparse.ArgumentParser]:
    """`keyroute cluster id|policy`."""
    cluster = sub.add_parser("cluster", help="the cluster's identity and security policy in ZooKeeper")
    cluster_sub = cluster.add_subparsers(dest="cluster_command", required=True, metavar="ACTION")
    _zk_options(p, cluster_sub.add_parser("id", help="print the cluster id of a chroot (JSON)"), writes=False)
    _policy_parser(p, cluster_sub)
    return []


def add_zk(p: _Parser, sub: Any) -> list[argparse.ArgumentParser]:
    """`keyroute zk dump|restore|lock-root`."""
    zkb = sub.add_parser("zk", help="back up and restore keyroute's records in ZooKeeper")
    zkb_sub = zkb.add_subparsers(dest="zk_command", required=True, metavar="ACTION")
    zk_dump = zkb_sub.add_parser(
        "dump", help="write the chroot's persistent records (not nodes' ephemeral ones) to one JSON file"
    )
    _zk_options(p, zk_dump, writes=False)
    p.option(zk_dump, "--out", required=True, help="file to write the dump to (- for standard output)")
    zk_restore = zkb_sub.add_parser(
        "restore", help="write a dump into a chroot without a cluster id (a new or wiped ZooKeeper)"
    )
    _zk_options(p, zk_restore, writes=True)
    p.option(zk_restore, "--in", dest="in_file", required=True, help="a file `keyroute zk dump` wrote")
    p.flag(zk_restore, "--force", help="also write over a chroot that holds the dump's own cluster id")
    zk_lock = zkb_sub.add_parser(
        "lock-root",
        help="let only the writer identity create at ZooKeeper's root (everyone may still read it): on an "
        "ensemble keyroute does not share with other applications",
    )
    _zk_options(p, zk_lock, writes=True)
    return [zk_dump, zk_restore]


def _policy_parser(p: _Parser, cluster_sub: Any) -> None:
    policy = cluster_sub.add_parser(
        "policy", help="what every router and node must have configured to serve (docs/security.md#cluster-policy)"
    )
    policy_sub = policy.add_subparsers(dest="policy_command", required=True, metavar="ACTION")
    given = policy_sub.add_parser(
        "set", help="write the cluster policy (the whole of it: a requirement not given is dropped); prints it (JSON)"
    )
    _zk_options(p, given, writes=True)
    p.flag(given, "--require-access-control", help="every member must check callers (--access-tokens or --jwt-issuer)")
    p.option(
        given,
        "--member-auth",
        default="none",
        metavar="none|secret|mtls",
        help="how members must prove themselves to each other: the cluster secret (or mutual TLS), or mutual TLS",
    )
    p.option(
        given,
        "--require-tls",
        default="",
        metavar="WIRE[,WIRE...]",
        help="wires every member must encrypt: client (HTTPS to callers), member (--member-ca), zookeeper",
    )
    _zk_options(p, policy_sub.add_parser("show", help="print the cluster policy (JSON)"), writes=False)


def cmd_cluster(args: argparse.Namespace) -> int:
    if args.cluster_command == "policy":
        return cmd_cluster_policy(args)
    from keyroute.cluster.cluster_identity import ClusterIdError, read_cluster_id
    from keyroute.cluster.zk import close

    zk_settings = zk_settings_of(args)
    if (client := _connect("keyroute cluster id", zk_settings, ensure_layout=False)) is None:
        return 1
    try:
        found = read_cluster_id(client)
    except ClusterIdError as exc:
        print(f"keyroute cluster id: {exc}", file=sys.stderr)
        return 1
    finally:
        close(client)
    if found is None:
        print(f"keyroute cluster id: chroot {zk_settings.chroot or '/'} has no cluster id", file=sys.stderr)
        return 1
    print(json.dumps({"cluster_id": found.id, "created_at": found.created_at}))
    return 0


def cmd_cluster_policy(args: argparse.Namespace) -> int:
    from kazoo.exceptions import NoAuthError

    from keyroute.cluster.cluster_policy import ClusterPolicy, PolicyError, read_policy, write_policy
    from keyroute.cluster.zk import close

    what = f"keyroute cluster policy {args.policy_command}"
    zk_settings = zk_settings_of(args)
    where = zk_settings.chroot or "/"
    wanted = None
    if args.policy_command == "set":  # the options are checked before ZooKeeper is touched
        try:
            wanted = ClusterPolicy.of_options(args.require_access_control, args.member_auth, args.require_tls)
        except PolicyError as exc:
            print(f"{what}: {exc}", file=sys.stderr)
            return 1
    if (client := _connect(what, zk_settings, ensure_layout=wanted is not None)) is None:
        return 1
    try:
        if wanted is None and _chroot_missing(what, client, zk_settings):
            return 1
        try:
            found = read_policy(client)
        except PolicyError as exc:
            if wanted is None:
                print(f"{what}: {exc}", file=sys.stderr)
                return 1
            found = None  # setting the policy again is how a broken record is mended
        if wanted is not None:
            write_policy(client, wanted)
    except NoAuthError:
        verb = "change" if wanted is not None else "read"
        print(f"{what}: this ZooKeeper identity may not {verb} the cluster policy at {where}", file=sys.stderr)
        return 1
    finally:
        close(client)
    if wanted is None:
        shown = found if found is not None else ClusterPolicy()
        print(json.dumps({"chroot": where, "recorded": found is not None, **shown.describe()}))
        return 0
    if not zk_settings.has_identity:
        print(
            f"{what}: warning: without a ZooKeeper identity (--zk-auth, or --zk-tls-cert) the policy is "
            "world-writable: anyone who reaches ZooKeeper can loosen it",
            file=sys.stderr,
        )
    previous = None if found is None else found.describe()
    print(json.dumps({"chroot": where, "recorded": True, **wanted.describe(), "previous": previous}))
    return 0


def cmd_zk(args: argparse.Namespace) -> int:
    from kazoo.exceptions import KazooException
    from kazoo.handlers.threading import KazooTimeoutError

    from keyroute.cli.zk_backup import Dump, ZkBackupError, dump, restore
    from keyroute.cluster.zk import close
    from keyroute.runtime.logs import describe

    what = f"keyroute zk {args.zk_command}"
    zk_settings = zk_settings_of(args)
    if args.zk_command == "lock-root":
        return _lock_root(what, zk_settings)
    where = zk_settings.chroot or "/"
    backup: Dump | None = None
    if args.zk_command == "restore":  # the dump is read and checked before ZooKeeper is touched
        try:
            backup = Dump.parse(Path(args.in_file).read_bytes())
        except OSError as exc:
            print(f"{what}: cannot read {args.in_file}: {exc.strerror or exc}", file=sys.stderr)
            return 1
        except ZkBackupError as exc:
            print(f"{what}: {args.in_file}: {exc}", file=sys.stderr)
            return 1
    if (client := _connect(what, zk_settings, ensure_layout=backup is not None)) is None:
        return 1
    try:
        if backup is None:
            if _chroot_missing(what, client, zk_settings):
                return 1
            taken = dump(client, zk_settings.chroot)
        else:
            restored = restore(client, backup, where, force=args.force)
    except ZkBackupError as exc:
        print(f"{what}: {exc}", file=sys.stderr)
        return 1
    except (KazooException, KazooTimeoutError) as exc:  # say, the connection lost midway; or no permission
        print(f"{what}: ZooKeeper at {zk_settings.hosts} refused or failed: {describe(exc)}", file=sys.stderr)
        return 1
    finally:
        close(client)
    if backup is not None:
        summary = {"chroot": where, "cluster_id": backup.cluster_id, **restored.describe()}
        print(json.dumps(summary))
        return 0
    try:
        _write_atomically(args.out, taken.to_bytes())
    except OSError as exc:
        print(f"{what}: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    if taken.cluster_id is None:
        print(f"{what}: chroot {where} has no cluster id (dumped all the same)", file=sys.stderr)
    summary = {"chroot": where, "cluster_id": taken.cluster_id, "znodes": len(taken.znodes), "out": args.out}
    print(json.dumps(summary), file=sys.stderr if args.out == "-" else sys.stdout)
    return 0


def _connect(what: str, zk_settings: ZkSettings, *, ensure_layout: bool) -> KazooClient | None:
    """A started ZooKeeper client for command `what`; None once why there is none is said on stderr."""
    from keyroute.cluster.zk import ZkUnavailableError, connect

    try:
        return connect(zk_settings, ensure_layout=ensure_layout)
    except ZkUnavailableError as exc:
        print(f"{what}: {exc}", file=sys.stderr)
        return None


def _chroot_missing(what: str, client: KazooClient, zk_settings: ZkSettings) -> bool:
    """Whether the chroot a reading command names is absent (then said on stderr): nothing to read there."""
    if zk_settings.chroot and client.exists("/") is None:
        print(f"{what}: chroot {zk_settings.chroot} does not exist on ZooKeeper {zk_settings.hosts}", file=sys.stderr)
        return True
    return False


def _lock_root(what: str, zk_settings: ZkSettings) -> int:
    from kazoo.exceptions import KazooException
    from kazoo.handlers.threading import KazooTimeoutError

    from keyroute.cluster.zk import ZkUnavailableError, lock_root
    from keyroute.runtime.logs import describe

    try:
        acl = lock_root(zk_settings)
    except ZkUnavailableError as exc:
        print(f"{what}: {exc}", file=sys.stderr)
        return 1
    except (KazooException, KazooTimeoutError) as exc:
        print(f"{what}: ZooKeeper at {zk_settings.hosts} refused or failed: {describe(exc)}", file=sys.stderr)
        return 1
    print(json.dumps({"root_acl": acl}))
    return 0


def _write_atomically(out: str, content: bytes) -> None:
    """`content` to file `out` (whole or not at all: written beside it, then renamed), or stdout for "-"."""
    if out == "-":
        sys.stdout.buffer.write(content)
        sys.stdout.flush()
        return
    target = Path(out)
    partial = target.with_name(f".{target.name}.partial")
    try:
        with open(partial, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
