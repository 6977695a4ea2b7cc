"""The cluster's identity: /cluster in ZooKeeper, a random id and its creation time.

The first node to join an empty chroot creates it (a create that fails when it exists, so two first nodes
agree on one id); every node records the id it joined in its data directory and refuses a chroot with
another id or none (`keyroute.state_node.data_dir`). `keyroute store adopt` writes it into a rebuilt
ZooKeeper only when told to (`--new-cluster-id`, or `--cluster-id X` to restore the old one).

A chroot with no cluster record, no nodes and no stores is most often a mistyped `--zk`: `EmptyChroot` says
so once (naming the ZooKeeper address, the chroot and the top-level chroots that do hold a cluster) and keeps
the message for `/readyz` and the admin partition map while the chroot stays empty.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException, NodeExistsError
from kazoo.handlers.threading import KazooTimeoutError

from keyroute.cluster import zk_layout
from keyroute.cluster.zk import data_of
from keyroute.runtime.settings import ZkSettings

log = logging.getLogger(__name__)
# How many other chroots a "did you mean" names at most, of how many top-level paths looked at.
_MAX_SUGGESTIONS = 5
_MAX_SCANNED = 2000
_READ_TIMEOUT_S = 5.0


class ClusterIdError(ValueError):
    """/cluster holds something that is not a cluster identity."""


@dataclass(frozen=True, slots=True)
class ClusterId:
    id: str
    created_at: float

    def to_json(self) -> bytes:
        return json.dumps({"id": self.id, "created_at": self.created_at}, sort_keys=True).encode("utf-8")

    @classmethod
    def from_json(cls, raw: bytes) -> ClusterId:
        try:
            doc = json.loads(raw)
            found = cls(str(doc["id"]), float(doc.get("created_at", 0.0)))
        except (ValueError, TypeError, KeyError) as exc:
            raise ClusterIdError(f"{zk_layout.CLUSTER} is not a cluster identity: {exc!r}") from None
        if not found.id:
            raise ClusterIdError(f"{zk_layout.CLUSTER} holds an empty cluster id")
        return found


def new_cluster_id() -> str:
    return uuid.uuid4().hex


def read_cluster_id(client: KazooClient) -> ClusterId | None:
    """The chroot's cluster identity, None when it has none (a new, wiped or wrong chroot)."""
    raw = data_of(client, zk_layout.CLUSTER)
    return None if raw is None else ClusterId.from_json(raw)


def create_cluster_id(client: KazooClient, cluster_id: str | None = None) -> tuple[ClusterId, bool]:
    """Create /cluster unless it exists: (the chroot's identity, whether this call created it). Racing
    creators agree: the create fails for all but one, and the others read the winner's."""
    wanted = ClusterId(cluster_id or new_cluster_id(), time.time())
    try:
        client.create(zk_layout.CLUSTER, wanted.to_json(), makepath=True)
        return wanted, True
    except NodeExistsError:
        found = read_cluster_id(client)
        if found is None:  # deleted between the two calls: try once more
            return create_cluster_id(client, cluster_id)
        return found, False


def chroots_with_a_cluster(settings: ZkSettings, connect_timeout_s: float = 5.0) -> list[str]:
    """The top-level chroots of the ZooKeeper at `settings.hosts` that hold a keyroute cluster (a cluster
    record, or published stores), other than `settings.chroot`, the closest to it first. Empty when ZooKeeper's root may
    not be listed or cannot be reached: a suggestion, never a reason to fail."""
    from keyroute.cluster import zk  # only here: reading an identity needs no connection layer

    top = dataclasses.replace(settings, chroot="", connect_timeout_s=min(settings.connect_timeout_s, connect_timeout_s))
    try:
        client = zk.connect(top, ensure_layout=False)
    except zk.ZkUnavailableError:
        return []
    found: list[str] = []
    try:
        paths = [f"/{child}" for child in sorted(client.get_children("/")) if child != "zookeeper"]
        paths = [path for path in paths if path != settings.chroot][:_MAX_SCANNED]
        # Pipelined: one round trip for every chroot's cluster record, one more for the stores of the others.
        records = {path: client.exists_async(path + zk_layout.CLUSTER) for path in paths}
        rest = [path for path, pending in records.items() if not _settled(pending, found, path)]
        listings = {path: client.get_children_async(path + zk_layout.STORES) for path in rest}
        for path, pending in listings.items():
            _settled(pending, found, path)
    except (KazooException, KazooTimeoutError):
        pass
    finally:
        zk.close(client)
    # The likeliest typo first.
    return difflib.get_close_matches(settings.chroot, found, n=len(found), cutoff=0.0) if found else []


def _settled(pending: Any, found: list[str], path: str) -> bool:
    """Whether a pending read of `path`'s cluster record or store listing found something (then `path` is
    added to `found`); a read that fails (no such path, not readable) found nothing."""
    try:
        result = pending.get(timeout=_READ_TIMEOUT_S)
    except (KazooException, KazooTimeoutError):
        return False
    if result:  # a ZnodeStat, or a non-empty listing
        found.append(path)
        return True
    return False


def empty_chroot_message(settings: ZkSettings, others: list[str]) -> str:
    """The one line that says `settings.chroot` holds no cluster, with the chroots that do as suggestions."""
    where = f"ZooKeeper {settings.hosts} chroot {settings.chroot or '/'}"
    line = f"no keyroute cluster at {where}: no cluster record, no nodes, no stores"
    if others:
        shown = ", ".join(others[:_MAX_SUGGESTIONS]) + (", ..." if len(others) > _MAX_SUGGESTIONS else "")
        line += f" (did you mean {shown}? these chroots hold a keyroute cluster)"
    else:
        line += " (is --zk right? a new cluster starts with its first node)"
    return line


class EmptyChroot:
    """Whether the chroot a process watches holds no cluster at all: no cluster record, no nodes and no
    stores. `observe` is given each fresh map's counts (on the map watcher's thread); the first time the
    chroot is found empty a warning is logged, once per process, and `message` holds the line until a
    node, a store or the cluster record appears."""

    def __init__(self, settings: ZkSettings) -> None:
        self._settings = settings
        self._lock = threading.Lock()
        self._said = False
        self._others: list[str] | None = None
        self.message: str | None = None

    def observe(self, client: KazooClient, stores: int, nodes: int) -> None:
        if stores or nodes:
            self.message = None
            return
        try:
            has_record = client.exists(zk_layout.CLUSTER) is not None
        except (KazooException, KazooTimeoutError):
            return  # ZooKeeper went away meanwhile: the next fresh map asks again
        if has_record:
            self.message = None
            return
        with self._lock:
            if self._others is None:
                self._others = chroots_with_a_cluster(self._settings)
            self.message = empty_chroot_message(self._settings, self._others)
            if not self._said:
                self._said = True
                log.warning("%s", self.message)
