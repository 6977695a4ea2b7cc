"""Where the router's partition maps come from: ZooKeeper watches in production, anything in tests.

The source pushes each new immutable map from its own thread; the app moves it onto the event loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

from kazoo.client import KazooClient

from keyroute.auth.cursor_key import CursorKey
from keyroute.cluster import zk
from keyroute.cluster.cluster_identity import EmptyChroot
from keyroute.cluster.cluster_policy import PolicyWatch
from keyroute.cluster.map_watcher import MapWatcher
from keyroute.cluster.partition_map import PartitionMap
from keyroute.cluster.zk_session import SessionKeeper
from keyroute.runtime.settings import ZkSettings


class MapSource(Protocol):
    def start(self, on_map: Callable[[PartitionMap], None]) -> None:
        """Begin pushing maps to `on_map` (may block while connecting; called off the event loop)."""

    def refresh(self) -> None:
        """Re-read now: a node told us our view is stale. Must not block."""

    def stop(self) -> None:
        """Stop pushing and release resources (may block)."""


class ZooKeeperMapSource:
    """A ZooKeeper session and a `MapWatcher` on it, owned by the router's lifespan; with `policy`, the
    router's check against the cluster policy, made when the session starts (before anything is read or
    written; keyroute.cluster.cluster_policy) and watched on it."""

    def __init__(self, settings: ZkSettings, policy: PolicyWatch | None = None) -> None:
        self._settings = settings
        self._policy = policy
        self._client: KazooClient | None = None
        self._watcher: MapWatcher | None = None
        self._keeper: SessionKeeper | None = None
        self._lock = threading.Lock()
        self._stopped = False
        self._empty = EmptyChroot(settings)
        # What the router signs range cursors with, followed once connected (keyroute.auth.cursor_key).
        self.cursor_key = CursorKey()

    def start(self, on_map: Callable[[PartitionMap], None]) -> None:
        """Connect and start watching (raises ZkUnavailableError when ZooKeeper cannot be reached in time).
        A `stop` while connecting wins: the session is closed and nothing is watched. UnmetPolicyError while
        the policy check is strict and this router does not satisfy the policy."""
        # Routers only read: they create nothing, so a read-only identity is enough.
        policy = self._policy
        client = zk.connect(self._settings, ensure_layout=False, check=None if policy is None else policy.require)
        with self._lock:
            if self._stopped:
                zk.close(client)
                return
            self._client = client

            def observed(new_map: PartitionMap) -> None:
                on_map(new_map)
                if not new_map.stale:  # after the hand-over: the check may read ZooKeeper
                    self._empty.observe(client, len(new_map.stores), len(new_map.nodes))

            self._watcher = MapWatcher(client, observed)
            self._watcher.start()
            # A ZooKeeper restored or rebuilt behind this session: a new session once a cluster is back there.
            self._keeper = SessionKeeper(client, self._settings)
            self._keeper.start()
            self.cursor_key.watch(client)

    @property
    def client(self) -> KazooClient | None:
        """The ZooKeeper session while started (the admin partition map reads live status with it)."""
        return self._client

    @property
    def empty_cluster(self) -> str | None:
        """The line saying that the chroot holds no cluster (no record, nodes or stores), None otherwise."""
        return self._empty.message

    @property
    def watcher(self) -> MapWatcher | None:
        """The running watcher (tests use it for fault injection: `hold_watches()`)."""
        return self._watcher

    def refresh(self) -> None:
        if self._watcher is not None:
            self._watcher.refresh()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            watcher, self._watcher = self._watcher, None
            keeper, self._keeper = self._keeper, None
            client, self._client = self._client, None
        try:
            if self._policy is not None:
                self._policy.stop()
            if keeper is not None:
                keeper.stop()
            if watcher is not None:
                watcher.stop()
        finally:
            if client is not None:
                zk.close(client)
