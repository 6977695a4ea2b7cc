"""A backup of keyroute's records in ZooKeeper: `keyroute zk dump` and `keyroute zk restore`.

A dump is one JSON document of the persistent znodes under the chroot (keyroute.cluster.zk_layout): the cluster
id, store records, the placement and assigned records, tombstones, and the empty roots. Ephemeral znodes are
left out, since they belong to live sessions and their owners write them again: node registrations, serving
and live-status records, the controller election. Each znode is one entry, paths sorted:

    {"format": "keyroute-zk-dump", "format_version": 1, "created_at": 1764230000.0, "chroot": "/keyroute",
     "cluster_id": "4f0c...", "znodes": [
        {"path": "/cluster", "version": 0, "text": "{\\"created_at\\": ..., \\"id\\": \\"4f0c...\\"}"},
        {"path": "/stores/bookings", "version": 3, "text": "{...}"},
        {"path": "/something-binary", "version": 0, "base64": "AAEC"}, ...]}

`version` is the znode's data version when dumped, for the record: ZooKeeper numbers a restored znode's
versions afresh. Data that is UTF-8 text is kept as text, anything else as base64.

A restore writes a dump into a chroot that has no cluster identity (a new, or wiped, ZooKeeper), creating
what is missing and overwriting what is there; it refuses a chroot that has another cluster's identity, and
one with the dump's identity unless forced (`force`). A dump is read whole and checked before anything is
written.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError, NodeExistsError, NoNodeError

from keyroute.cluster import zk_layout
from keyroute.cluster.cluster_identity import ClusterId, ClusterIdError, read_cluster_id
from keyroute.cluster.partition_map import json_object

FORMAT = "keyroute-zk-dump"
FORMAT_VERSION = 1
# ZooKeeper's own subtree, present at the root of every ensemble: never keyroute's.
_ZOOKEEPER_OWN = "/zookeeper"


class ZkBackupError(ValueError):
    """A dump that cannot be read or written, or a chroot a restore may not write into; one line."""


@dataclass(frozen=True, slots=True)
class Znode:
    path: str  # relative to the chroot, starting with "/"
    data: bytes
    version: int = 0

    def to_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"path": self.path, "version": self.version}
        try:
            entry["text"] = self.data.decode("utf-8")
        except UnicodeDecodeError:
            entry["base64"] = base64.b64encode(self.data).decode("ascii")
        return entry

    @classmethod
    def from_json(cls, entry: Any, index: int) -> Znode:
        where = f"znode #{index + 1}"
        if not isinstance(entry, Mapping):
            raise ZkBackupError(f"{where} is not a JSON object")
        path = entry.get("path")
        if not isinstance(path, str) or not _valid_path(path):
            raise ZkBackupError(f"{where} has no valid absolute path (found {path!r})")
        version = entry.get("version", 0)
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ZkBackupError(f"{where} ({path}) has an invalid version {version!r}")
        if ("text" in entry) == ("base64" in entry):
            raise ZkBackupError(f"{where} ({path}) needs exactly one of `text` and `base64`")
        if "text" in entry:
            if not isinstance(entry["text"], str):
                raise ZkBackupError(f"{where} ({path}): `text` is not a string")
            data = entry["text"].encode("utf-8")
        else:
            try:
                data = base64.b64decode(str(entry["base64"]), validate=True)
            except (binascii.Error, ValueError):
                raise ZkBackupError(f"{where} ({path}): `base64` is not base64") from None
        return cls(path, data, version)


@dataclass(frozen=True, slots=True)
class Dump:
    znodes: tuple[Znode, ...]
    chroot: str = ""
    cluster_id: str | None = None
    created_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "created_at": self.created_at,
            "chroot": self.chroot,
            "cluster_id": self.cluster_id,
            "znodes": [z.to_json() for z in self.znodes],
        }

    def to_bytes(self) -> bytes:
        return (json.dumps(self.to_json(), ensure_ascii=False, indent=1) + "\n").encode("utf-8")

    @classmethod
    def parse(cls, raw: bytes) -> Dump:
        """A dump from its JSON text; ZkBackupError (one line) when it is not one."""
        doc = json_object(raw, "the dump", ZkBackupError)
        if doc.get("format") != FORMAT:
            raise ZkBackupError(f"not a keyroute ZooKeeper dump (no \"format\": \"{FORMAT}\")")
        if doc.get("format_version") != FORMAT_VERSION:
            found = doc.get("format_version")
            raise ZkBackupError(f"dump format version {found!r} is not one this keyroute reads ({FORMAT_VERSION})")
        entries = doc.get("znodes")
        if not isinstance(entries, list):
            raise ZkBackupError("the dump has no `znodes` list")
        znodes = tuple(Znode.from_json(entry, i) for i, entry in enumerate(entries))
        paths = [z.path for z in znodes]
        if len(set(paths)) != len(paths):
            duplicate = next(p for p in paths if paths.count(p) > 1)
            raise ZkBackupError(f"znode {duplicate} appears more than once")
        cluster_id = doc.get("cluster_id")
        if cluster_id is not None and not isinstance(cluster_id, str):
            raise ZkBackupError("`cluster_id` is not a string")
        recorded = next((z for z in znodes if z.path == zk_layout.CLUSTER), None)
        if recorded is not None:
            try:
                if ClusterId.from_json(recorded.data).id != cluster_id:
                    raise ZkBackupError(f"`cluster_id` {cluster_id!r} is not the id its {zk_layout.CLUSTER} holds")
            except ClusterIdError as exc:
                raise ZkBackupError(str(exc)) from None
        chroot = doc.get("chroot", "")
        created_at = doc.get("created_at", 0.0)
        return cls(
            tuple(sorted(znodes, key=lambda z: z.path)),
            chroot if isinstance(chroot, str) else "",
            cluster_id,
            float(created_at) if isinstance(created_at, int | float) else 0.0,
        )


def _valid_path(path: str) -> bool:
    if not path.startswith("/") or path == "/" or path.endswith("/") or "\x00" in path:
        return False
    return all(part not in ("", ".", "..") for part in path[1:].split("/"))


def _walk(client: KazooClient, path: str, unreadable: list[str]) -> Iterator[tuple[str, bytes, Any]]:
    """(path, data, stat) of every persistent znode under `path` (not `path` itself), parents first, children
    sorted. A persistent znode this identity may not read (or list) goes to `unreadable`; an ephemeral record
    under one of the layout's roots of them (zk_layout.EPHEMERAL_PARENTS) that it may not read is left out
    like every ephemeral one: a router's record is its own identity's, which not even the writers may read
    (ZooKeeper shows the reader no writer's digest to grant), and ZooKeeper gives no stat without READ."""
    try:
        children = client.get_children(path)
    except NoNodeError:  # deleted meanwhile
        return
    except NoAuthError:
        unreadable.append(path)
        return
    for child in sorted(children):
        child_path = f"{path.rstrip('/')}/{child}"
        if child_path == _ZOOKEEPER_OWN:
            continue
        try:
            data, stat = client.get(child_path)
        except NoNodeError:
            continue
        except NoAuthError:
            if path not in zk_layout.EPHEMERAL_PARENTS:
                unreadable.append(child_path)
            continue
        if stat.ephemeralOwner:  # a live session's, and without children
            continue
        yield child_path, data or b"", stat
        yield from _walk(client, child_path, unreadable)


def dump(client: KazooClient, chroot: str = "", clock: Any = time.time) -> Dump:
    """The persistent znodes under the client's chroot (`chroot` names it in the dump). Raises ZkBackupError
    (one line) when this identity may not read some of them: a backup is whole or not made."""
    unreadable: list[str] = []
    znodes = [Znode(path, data, int(stat.version)) for path, data, stat in _walk(client, "/", unreadable)]
    if unreadable:
        shown = ", ".join(unreadable[:3]) + (", ..." if len(unreadable) > 3 else "")
        raise ZkBackupError(
            f"{len(unreadable)} persistent record(s) under chroot {chroot or '/'} may not be read by this identity "
            f"(their ACL grants it no READ): {shown}; nothing was written"
        )
    try:
        found = read_cluster_id(client)
    except ClusterIdError:
        found = None
    return Dump(
        tuple(sorted(znodes, key=lambda z: z.path)),
        chroot,
        found.id if found is not None else None,
        float(clock()),
    )


@dataclass(frozen=True, slots=True)
class Restored:
    created: int
    overwritten: int
    unchanged: int

    def describe(self) -> dict[str, int]:
        return {"created": self.created, "overwritten": self.overwritten, "unchanged": self.unchanged}


def check_target(client: KazooClient, backup: Dump, where: str, force: bool) -> None:
    """Raises ZkBackupError unless `backup` may be restored into the client's chroot (named `where`)."""
    try:
        found = read_cluster_id(client)
    except ClusterIdError as exc:
        raise ZkBackupError(f"chroot {where}: {exc}; nothing was changed") from None
    if found is not None:
        if found.id != backup.cluster_id:
            raise ZkBackupError(
                f"chroot {where} belongs to cluster {found.id}, the dump to cluster {backup.cluster_id}; "
                "nothing was changed (restore into an empty chroot)"
            )
        if not force:
            raise ZkBackupError(
                f"chroot {where} already holds cluster {found.id} (the dump's); nothing was changed "
                "(pass --force to write the dump over it)"
            )
        return
    stores = _children(client, zk_layout.STORES)
    if stores and not force:
        raise ZkBackupError(
            f"chroot {where} has no cluster id but {len(stores)} store record(s) ({', '.join(stores[:5])}); "
            "nothing was changed (pass --force to write the dump over them)"
        )


def _children(client: KazooClient, path: str) -> list[str]:
    try:
        return sorted(client.get_children(path))
    except NoNodeError:
        return []


def restore(client: KazooClient, backup: Dump, where: str, *, force: bool = False) -> Restored:
    """Write `backup` into the client's chroot (named `where` in messages), after `check_target`. The
    cluster identity is written last: a restore cut short leaves a chroot nodes refuse to serve under, and
    that a second restore may complete."""
    check_target(client, backup, where, force)
    created = overwritten = unchanged = 0
    identity = [z for z in backup.znodes if z.path == zk_layout.CLUSTER]
    rest = [z for z in backup.znodes if z.path != zk_layout.CLUSTER]
    for znode in (*sorted(rest, key=lambda z: (z.path.count("/"), z.path)), *identity):
        try:
            client.create(znode.path, znode.data, makepath=True)
            created += 1
            continue
        except NodeExistsError:
            pass
        current, _ = client.get(znode.path)
        if znode.path == zk_layout.CLUSTER and (current or b"") != znode.data:
            try:
                other = ClusterId.from_json(current).id
            except ClusterIdError:
                other = None
            if other != backup.cluster_id:  # a node created a new identity meanwhile: never overwritten
                raise ZkBackupError(
                    f"chroot {where} got cluster id {other} while the dump was written (a node started?); stop "
                    "every node and restore again with --force"
                )
        if (current or b"") == znode.data:
            unchanged += 1
        else:
            client.set(znode.path, znode.data)
            overwritten += 1
    return Restored(created, overwritten, unchanged)
