"""The integration tests' cluster harness, as kazoo ships `kazoo.testing`: keyroute members (nodes, routers) as
real processes that a module starts once and its tests share, a ZooKeeper chroot or a store name of its own
for each test that needs one, and what a test does to a member: kill it, stop it, restart it on the same
port and data, freeze it (SIGSTOP) and thaw it, or expire its ZooKeeper session.

A cluster started for a module (`scope="module"` fixtures) serves the tests that only read it, or that each
work in a namespace of their own (their own store, their own chroot); a test that kills or freezes a member
of a shared cluster leaves it as it found it (`Member.frozen()`, `Member.restart()`), or starts its own."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from kazoo.client import KazooClient

from keyroute.runtime.settings import ZkSettings
from tests.util import Proc, wait_for


class Member(Proc):
    """One `keyroute` process of a cluster (a node or a router) by name, with the URL it answers on; what a
    test does to it keeps its port and data directory, so `restart()` brings back the same member."""

    def __init__(
        self, name: str, args: Sequence[str], log_path: Path, url: str, env: dict[str, str] | None = None
    ) -> None:
        super().__init__(args, log_path, env)
        self.name = name
        self.url = url
        self._frozen = False

    def start(self) -> Member:
        super().start()
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None, f"{self.name} was never started"
        return self.popen.pid

    def kill(self) -> None:
        """SIGKILL: no clean-up, its ZooKeeper records stay until its session expires."""
        self.thaw()
        self.kill9()

    def restart(self, timeout_s: float = 15.0) -> Member:
        """Stop it (SIGTERM) if it runs, then start it again with the same arguments: same port, same data."""
        self.thaw()
        self.stop(timeout_s)
        return self.start()

    def freeze(self) -> None:
        """SIGSTOP: it answers nothing and sends nothing (no ZooKeeper heartbeat either) until `thaw()`."""
        os.kill(self.pid, signal.SIGSTOP)
        self._frozen = True

    def thaw(self) -> None:
        if self._frozen:
            self._frozen = False
            if self.alive:
                os.kill(self.pid, signal.SIGCONT)

    @contextmanager
    def frozen(self) -> Iterator[Member]:
        """Frozen for the block, thawed after it whatever happens (a shared cluster is left as it was)."""
        self.freeze()
        try:
            yield self
        finally:
            self.thaw()

    def stop(self, timeout_s: float = 15.0) -> int | None:
        self.thaw()  # a frozen process would not act on SIGTERM
        return super().stop(timeout_s)

    def expire(self, client: KazooClient, ephemeral_path: str, timeout_s: float = 60.0) -> None:
        """Expire its ZooKeeper session the way a long pause does: frozen until ZooKeeper drops the session
        (seen as its ephemeral record at `ephemeral_path` gone, or owned by another session), then thawed; it
        then finds its session expired and must register again."""
        stat = client.exists(ephemeral_path)
        assert stat is not None and stat.ephemeralOwner, f"{ephemeral_path} is not an ephemeral record"
        session = stat.ephemeralOwner

        def dropped() -> bool:
            now = client.exists(ephemeral_path)
            return now is None or now.ephemeralOwner != session

        with self.frozen():
            wait_for(dropped, timeout_s=timeout_s, interval_s=0.2, message=f"{self.name}'s session to expire")


def chroot(connect_string: str, prefix: str = "t", session_timeout_s: float = 4.0) -> ZkSettings:
    """A ZooKeeper chroot no other test uses, on the session's server: a namespace of the test's own."""
    return ZkSettings(
        hosts=connect_string, chroot=f"/{prefix}-{uuid.uuid4().hex[:12]}", session_timeout_s=session_timeout_s
    )


def store_name(prefix: str = "s") -> str:
    """A store name no other test uses: a namespace of the test's own inside a shared cluster."""
    return f"{prefix}_{uuid.uuid4().hex[:10]}"
