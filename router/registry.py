"""Routers that are up, as ZooKeeper knows them: each router process (each worker of one, since each
enforces its own quotas) holds an ephemeral znode `/routers/{id}` (keyroute.cluster.zk_layout) saying its URL,
and watches the set. Quotas are split among the routers up (keyroute/http/quotas.py `Quotas.set_routers`); the
partition map lists them.

`/routers` is created by the writers with the layout (keyroute.cluster.zk), its ACL letting the reader
identity routers connect with create and delete children. A record has the ACL of the identity that made
it (the reader: ALL; nobody else, not even the writers, may read it, though they may list and delete it;
world-open without identities), since ZooKeeper does not show a reader the writers' digest to grant it.

A router that cannot register (a cluster whose writers predate `/routers`, an ACL that refuses it) says
so once and counts itself alone: it then enforces every quota in full. A chroot that holds no cluster at all
(a typo in --zk, or a cluster whose first node has not started) is not such a case: the map source says that
in one line of its own (keyroute.cluster.cluster_identity), so the registry says nothing and registers once
the writers have made `/routers` there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import KazooException, NodeExistsError, NoNodeError
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.recipe.watchers import ChildrenWatch

from keyroute.cluster import zk_layout

log = logging.getLogger(__name__)

# How long a stopping router waits for ZooKeeper to remove its record.
STOP_TIMEOUT_S = 2.0


def router_id() -> str:
    """A name no other router process takes: host, process id and a random part (a restarted container
    has the same host name and process id while its previous session's znode may still be there)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class RouterRegistry:
    """This router's registration (`start` with a connected client, off the event loop) and the routers up
    (`routers`: id and URL of each, sorted; `version` changes with them), each change handed to
    `on_change(count)` on the watch's thread."""

    def __init__(self, url: str, on_change: Callable[[int], None], rid: str | None = None) -> None:
        self.id = rid or router_id()
        self.url = url
        self.on_change = on_change
        self.routers: list[dict[str, Any]] = []
        self.version = 0
        self._client: KazooClient | None = None
        self._lock = threading.Lock()
        self._registered = False

    def start(self, client: KazooClient) -> None:
        self._client = client
        if self._register():
            self._watch(client)

    def _watch(self, client: KazooClient) -> None:
        client.add_listener(self._on_state)
        ChildrenWatch(client, zk_layout.ROUTERS, self._changed)

    def _when_made(self, _event: Any = None) -> None:
        """`/routers` was made in a chroot that had no cluster: register now (on a kazoo thread)."""
        client = self._client
        if client is not None and not self._registered and self._register():
            self._watch(client)

    def _no_cluster_yet(self, client: KazooClient) -> bool:
        """Whether the chroot holds no cluster record (then `/routers` is watched for, to register once made)."""
        try:
            if client.exists(zk_layout.CLUSTER) is not None:
                return False
            if client.exists(zk_layout.ROUTERS, watch=lambda event: client.handler.spawn(self._when_made)):
                client.handler.spawn(self._when_made)  # made meanwhile
        except KazooException:
            return False
        return True

    def _register(self) -> bool:
        client = self._client
        assert client is not None
        record = json.dumps({"url": self.url, "started_at": time.time()}).encode()
        try:
            client.create(zk_layout.router_path(self.id), record, ephemeral=True)
        except NodeExistsError:
            pass
        except (NoNodeError, KazooException) as exc:
            if not self._registered and isinstance(exc, NoNodeError) and self._no_cluster_yet(client):
                log.debug("no cluster in this chroot yet: this router registers once %s is made", zk_layout.ROUTERS)
            elif not self._registered:
                log.warning(
                    "this router cannot register in ZooKeeper at %s (%s): it enforces every quota in full",
                    zk_layout.ROUTERS,
                    type(exc).__name__,
                )
            return False
        self._registered = True
        return True

    def _on_state(self, state: str) -> None:
        # A new session after one was lost: the ephemeral record went with the old one.
        if state == KazooState.CONNECTED and self._client is not None:
            self._client.handler.spawn(self._register)

    def _changed(self, children: list[str]) -> bool | None:
        client = self._client
        if client is None:
            return False  # stopped: no more watching
        routers = []
        for child in sorted(children):
            try:
                data, _ = client.get(zk_layout.router_path(child))
                url = json.loads(data).get("url")
            except (NoNodeError, ValueError, AttributeError, KazooException):
                url = None
            routers.append({"id": child, "url": url})
        with self._lock:
            self.routers = routers
            self.version += 1
        self.on_change(len(routers))
        return None

    def stop(self) -> None:
        """Stop watching and remove this router's record (its session's end would too, later)."""
        client, self._client = self._client, None
        if client is None:
            return
        client.remove_listener(self._on_state)
        if self._registered:
            # Bounded: with ZooKeeper unreachable kazoo would hold the call until it is back, and the router
            # must stop all the same (its session's end removes the record).
            with contextlib.suppress(KazooException, KazooTimeoutError):  # NoNodeError too: gone already
                client.delete_async(zk_layout.router_path(self.id)).get(timeout=STOP_TIMEOUT_S)


async def register_when_connected(
    connecting: asyncio.Task[None], client_of: Callable[[], Any], registry: RouterRegistry
) -> None:
    """Register `registry` once `connecting` (the map source's start) has succeeded, with the ZooKeeper
    session `client_of()` then gives (None: a source without one, in tests: nothing to register with)."""
    await asyncio.wait({connecting})
    if connecting.cancelled() or connecting.exception() is not None:
        return
    client = client_of()
    if client is not None:
        await asyncio.to_thread(registry.start, client)
