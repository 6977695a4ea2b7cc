"""Keeping a process's ZooKeeper session usable when the ensemble behind it was restored or rebuilt.

ZooKeeper refuses a reconnecting client that has seen a newer transaction than the server holds ("client must
try another server"): after an ensemble comes back empty, or from a backup older than what a client saw, every
reconnect of a long-lived kazoo client is dropped and it stays SUSPENDED for good. kazoo keeps retrying with
the same session and the same last zxid, so the process serves its last map, marked stale, until restarted.

`SessionKeeper` notices and starts a fresh session, once the cluster is back:

    CONNECTED --(connection lost)--> DISCONNECTED --(behind_after_s without a session)--> probe
    probe: a separate, fresh client (no session, zxid 0) connects to the same hosts and reads the server's
           last zxid and the chroot's cluster record
      - the probe cannot connect either: ZooKeeper is down; wait (kazoo reconnects by itself when it is back)
      - the server is not behind this client: a slow or partitioned network; wait
      - the server is behind, but the chroot holds no cluster, or another cluster than this process's: wait,
        said once (a restore is needed first: docs/operations.md, "Restoring ZooKeeper")
      - the server is behind and holds this process's cluster: say so in one line and restart the client
        (kazoo's public `restart`: a new session, zxid 0). The session's listeners see LOST then CONNECTED,
        the path every process already takes after a session expiry: nodes register again, routers and nodes
        re-read and re-watch the whole map.

Nothing here deletes or writes a record; the keeper only replaces a session that cannot come back.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException, NoNodeError
from kazoo.handlers.threading import KazooTimeoutError

from keyroute.cluster import zk, zk_layout
from keyroute.runtime.logs import describe
from keyroute.runtime.settings import ZkSettings

log = logging.getLogger(__name__)

# How often the keeper looks at its client's state.
CHECK_INTERVAL_S = 1.0


@dataclass(frozen=True)
class ServerView:
    """What a fresh client saw of the ensemble: the server's last zxid and the chroot's cluster id
    (None: no cluster record)."""

    zxid: int
    cluster_id: str | None


def probe(settings: ZkSettings) -> ServerView | None:
    """Connect a fresh client (no session, no chroot, no retries) to `settings.hosts` and read the server's last
    zxid and the chroot's cluster id; None when it cannot connect or read."""
    client = zk.raw_client(settings)
    try:
        client.start(timeout=min(settings.connect_timeout_s, 5.0))
    except (KazooTimeoutError, KazooException, OSError):
        zk.close(client)
        return None
    try:
        client.exists("/")  # every reply carries the server's last zxid
        zxid = client.last_zxid
        try:
            data, _stat = client.get(settings.chroot + zk_layout.CLUSTER)
        except NoNodeError:
            return ServerView(zxid, None)
        try:
            cluster_id = json.loads(data)["id"]
        except (ValueError, KeyError, TypeError):
            return ServerView(zxid, None)
        return ServerView(zxid, str(cluster_id))
    except (KazooTimeoutError, KazooException, OSError):
        return None
    finally:
        zk.close(client)


class SessionKeeper:
    """Watches one long-lived client and replaces its session when the ensemble is behind it (see above).

    `cluster_id` tells the cluster this process belongs to (a node's data directory), or None when any cluster
    record will do (a router). `probe` and `clock` are injectable for tests."""

    def __init__(
        self,
        client: KazooClient,
        settings: ZkSettings,
        *,
        cluster_id: Callable[[], str | None] = lambda: None,
        behind_after_s: float | None = None,
        probe: Callable[[ZkSettings], ServerView | None] = probe,
        clock: Callable[[], float] = time.monotonic,
        check_interval_s: float = CHECK_INTERVAL_S,
    ) -> None:
        self._client = client
        self._settings = settings
        self._cluster_id = cluster_id
        # Waiting a session timeout first leaves an ordinary outage to kazoo's own reconnects.
        self._behind_after_s = settings.session_timeout_s if behind_after_s is None else behind_after_s
        self._probe = probe
        self._clock = clock
        self._interval_s = check_interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._disconnected_since: float | None = None
        self._said_waiting: str | None = None
        self.restarts = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="keyroute-zk-session-keeper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        # Not waited for long: a probe in progress may take seconds while ZooKeeper is down, and the thread
        # (a daemon) writes nothing; a stop must not wait on it.
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.check()
            except Exception as exc:  # the keeper must outlive any surprise; say it and look again
                log.warning("checking the ZooKeeper session failed (%s)", describe(exc))

    def check(self) -> bool:
        """One look (the thread calls it every `check_interval_s`); True when it restarted the session."""
        if self._client.connected:
            self._disconnected_since = None
            self._said_waiting = None
            return False
        now = self._clock()
        if self._disconnected_since is None:
            self._disconnected_since = now
            return False
        if now - self._disconnected_since < self._behind_after_s:
            return False
        ours = self._client.last_zxid
        view = self._probe(self._settings)
        if view is None or view.zxid >= ours:
            return False  # ZooKeeper is down, or not behind us: kazoo's own reconnects will do
        wanted = self._cluster_id()
        where = f"ZooKeeper at {self._settings.hosts}"
        if view.cluster_id is None or (wanted is not None and view.cluster_id != wanted):
            holds = "no keyroute cluster" if view.cluster_id is None else f"cluster {view.cluster_id}"
            waiting = (
                f"{where} is behind this process's session (its last transaction {view.zxid:#x}, ours {ours:#x}) "
                f"and holds {holds} at {self._settings.chroot or '/'}: serving what is known until the cluster is "
                "restored there (keyroute zk restore)"
            )
            if waiting != self._said_waiting:
                self._said_waiting = waiting
                log.warning("%s", waiting)
            return False
        if self._stop.is_set():
            return False
        log.warning(
            "%s was restored or rebuilt (its last transaction %#x is behind this process's %#x): "
            "starting a new ZooKeeper session",
            where,
            view.zxid,
            ours,
        )
        try:
            self._client.restart()
        except (KazooTimeoutError, KazooException, OSError) as exc:
            log.warning("starting a new ZooKeeper session failed (%s); trying again", describe(exc))
            return False
        self.restarts += 1
        self._disconnected_since = None
        self._said_waiting = None
        return True
