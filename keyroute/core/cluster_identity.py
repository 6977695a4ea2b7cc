"""The cluster's identity: /cluster in ZooKeeper, a random id and its creation time.

The first node to join an empty chroot creates it (a create that fails when it exists, so two first nodes
agree on one id); every node records the id it joined in its data directory and refuses a chroot with
another id or none (`keyroute.state_node.data_dir`). `keyroute store adopt` writes it into a rebuilt
ZooKeeper only when told to (`--new-cluster-id`, or `--cluster-id X` to restore the old one).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from kazoo.client import KazooClient
from kazoo.exceptions import NodeExistsError, NoNodeError

from keyroute.core import zk_layout


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
    try:
        raw, _ = client.get(zk_layout.CLUSTER)
    except NoNodeError:
        return None
    return ClusterId.from_json(raw)


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
