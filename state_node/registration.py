"""This node's ephemeral records in ZooKeeper: /nodes/{id} (it is alive), /serving/{id} (what it serves)
and /live/{id} (the state of its live partitions, for the partition map).

They vanish with the session, so they are written again whenever a fresh map shows them missing. Two
persistent ones outlive it: /restarting/{id}, written when the node stops for a planned restart
(keyroute.state_node.restarts), and /draining/{id}, an operator's request that its next stop be a departure;
both are deleted when the node starts again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NodeExistsError, NoNodeError

from keyroute.cluster import zk_layout
from keyroute.cluster.partition_map import NodeRecord, RecordError, ServingRecord
from keyroute.state_node.restarts import PlannedRestart

log = logging.getLogger(__name__)


class NodeIdInUse(RuntimeError):
    """Another live ZooKeeper session holds this node id's registration: two processes would be one node."""


class Registration:
    """Writes and withdraws this node's ephemeral records. Every method blocks on ZooKeeper: call them
    from a worker thread when on the event loop."""

    def __init__(self, client: KazooClient, node_id: str, url: str, zone: str = "") -> None:
        self._client = client
        self.node_id = node_id
        self.url = url
        self.zone = zone
        # (store, version, partitions) on this node's disk at its start: a placement hint in its node record.
        self.holds: tuple[tuple[str, int, tuple[int, ...]], ...] = ()
        # Once set, every (re-)registration says so: a session lost while draining must not make the
        # controller assign partitions to this node again.
        self.leaving = False

    def claim(self, wait_s: float) -> None:
        """Return once no other process is this node; raise NodeIdInUse when one still is after `wait_s`.

        /nodes/{id} of another session is either this node's previous life (a crash or a restart before
        that session expired) or another process started with the same id. The first advertised this
        node's own URL, whose port this process now holds, so it is gone: the record is taken over at
        once. A record with another URL is waited on for up to `wait_s` (a session's timeout: a dead
        process's session has expired by then); if it is still there, its process is alive."""
        path = zk_layout.node_path(self.node_id)
        deadline = time.monotonic() + wait_s
        said = False
        while True:
            gone = threading.Event()
            try:
                data, stat = self._client.get(path, watch=lambda _event, gone=gone: gone.set())
            except NoNodeError:
                return
            if stat.ephemeralOwner == self._client.client_id[0]:
                return
            try:
                other = NodeRecord.from_json(data).url
            except RecordError:
                other = "an unreadable address"
            if other == self.url:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NodeIdInUse(
                    f"node id {self.node_id!r} is in use by a running node at {other}: "
                    "every node needs its own --node-id"
                )
            if not said:
                said = True
                log.warning(
                    "node id %s is registered by another session (at %s); waiting up to %.0f s for it to end",
                    self.node_id,
                    other,
                    wait_s,
                )
            gone.wait(remaining)

    def register_node(self) -> None:
        record = NodeRecord(self.node_id, self.url, leaving=self.leaving, zone=self.zone, holds=self.holds)
        self._put(zk_layout.node_path(self.node_id), record.to_json())

    def mark_leaving(self) -> None:
        """Rewrite /nodes/{id} as leaving: the controller then moves every partition away from this node."""
        self.leaving = True
        self.register_node()

    def mark_restarting(self, grace_s: float, at: float) -> None:
        """Write /restarting/{id}: this node stops at `at` (unix seconds) for a restart and asks the controller to
        keep its partitions where they are for `grace_s` seconds. Written before /nodes/{id} goes."""
        data = PlannedRestart(self.node_id, at, grace_s, self.zone).to_json()
        path = zk_layout.restarting_path(self.node_id)
        try:
            self._client.create(path, data, makepath=True)
        except NodeExistsError:
            self._client.set(path, data)

    def drain_requested(self) -> bool:
        """Whether an operator asked that this node's next stop hand its partitions over (`keyroute node-drain`)."""
        return self._client.exists(zk_layout.draining_path(self.node_id)) is not None

    def returned(self) -> None:
        """Once registered again (/nodes/{id} written): this node is back, its restart record and any drain
        request of its previous run are done with."""
        for path in (zk_layout.restarting_path(self.node_id), zk_layout.draining_path(self.node_id)):
            with contextlib.suppress(NoNodeError):
                self._client.delete(path)

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


def request_drain(client: KazooClient, node_id: str) -> float:
    """Write /draining/{node_id}: the node's next stop hands its partitions over rather than holding them for a
    restart (`keyroute node-drain`). Returns the time of the request (unix seconds)."""
    at = time.time()
    data = json.dumps({"node_id": node_id, "at": at}, sort_keys=True).encode("utf-8")
    path = zk_layout.draining_path(node_id)
    try:
        client.create(path, data, makepath=True)
    except NodeExistsError:
        client.set(path, data)
    return at
