"""This node's ephemeral records in ZooKeeper: /nodes/{id} (it is alive), /serving/{id} (what it serves)
and /live/{id} (the state of its live partitions, for the partition map).

They vanish with the session, so they are written again whenever a fresh map shows them missing.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Mapping
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NodeExistsError, NoNodeError

from keyroute.core import zk_layout
from keyroute.core.partition_map import NodeRecord, ServingRecord

log = logging.getLogger(__name__)


class Registration:
    """Writes and withdraws this node's ephemeral records. Every method blocks on ZooKeeper: call them
    from a worker thread when on the event loop."""

    def __init__(self, client: KazooClient, node_id: str, url: str) -> None:
        self._client = client
        self.node_id = node_id
        self.url = url
        # Once set, every (re-)registration says so: a session lost while draining must not make the
        # controller assign partitions to this node again.
        self.leaving = False

    def register_node(self) -> None:
        record = NodeRecord(self.node_id, self.url, leaving=self.leaving)
        self._put(zk_layout.node_path(self.node_id), record.to_json())

    def mark_leaving(self) -> None:
        """Rewrite /nodes/{id} as leaving: the controller then moves every partition away from this node."""
        self.leaving = True
        self.register_node()

    def publish_serving(self, stores: Mapping[str, Mapping[int, int]]) -> None:
        record = ServingRecord(self.node_id, self.url, {s: dict(parts) for s, parts in stores.items()})
        self._put(zk_layout.serving_path(self.node_id), record.to_json())

    def publish_live(self, report: Mapping[str, Any]) -> None:
        """Write /live/{id}: `{"stores": {store: {"<partition>": {...}}}, "updated_at": unix_s}`."""
        data = json.dumps(report, sort_keys=True, separators=(",", ":")).encode("utf-8")
        self._put(zk_layout.live_path(self.node_id), data)

    def withdraw_live(self) -> None:
        with contextlib.suppress(NoNodeError):
            self._client.delete(zk_layout.live_path(self.node_id))

    def withdraw_serving(self) -> None:
        """De-announce: routers stop sending reads here (the node may still answer stragglers)."""
        with contextlib.suppress(NoNodeError):
            self._client.delete(zk_layout.serving_path(self.node_id))

    def withdraw(self) -> None:
        """Delete the records now, serving first, so observers learn at once rather than at session end."""
        paths = (
            zk_layout.serving_path(self.node_id),
            zk_layout.live_path(self.node_id),
            zk_layout.node_path(self.node_id),
        )
        for path in paths:
            with contextlib.suppress(NoNodeError):
                self._client.delete(path)

    def _put(self, path: str, data: bytes) -> None:
        client = self._client
        try:
            client.create(path, data, ephemeral=True, makepath=True)
            return
        except NodeExistsError:
            pass
        try:
            _, stat = client.get(path)
        except NoNodeError:
            client.create(path, data, ephemeral=True, makepath=True)
            return
        if stat.ephemeralOwner != client.client_id[0]:
            # Left by this node's previous session (a restart after a crash, before that session expired):
            # the same node id is the same node, so the record is replaced by one this session owns.
            log.warning("replacing %s left by an earlier session of node %s", path, self.node_id)
            with contextlib.suppress(NoNodeError):
                client.delete(path, version=stat.version)
            client.create(path, data, ephemeral=True, makepath=True)
        else:
            client.set(path, data, version=stat.version)
