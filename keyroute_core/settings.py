"""Typed settings for every keyroute service, built once at the edge (the CLI) and passed inward.

No module reads the environment on its own; units are part of every timing name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True, slots=True)
class ZkSettings:
    """Where the ZooKeeper ensemble is and how long a session may go silent."""

    hosts: str = "127.0.0.1:2181"
    chroot: str = ""
    session_timeout_s: float = 10.0
    connect_timeout_s: float = 15.0

    @classmethod
    def parse(cls, connect: str, **kwargs: float) -> ZkSettings:
        """Split `host:port[,host:port...][/chroot]` into hosts and chroot."""
        connect = connect.strip()
        if not connect:
            raise ValueError("ZooKeeper address is empty (expected HOST:PORT[/chroot])")
        hosts, slash, chroot = connect.partition("/")
        if not hosts:
            raise ValueError(f"ZooKeeper address {connect!r} names no host")
        chroot = ("/" + chroot.strip("/")) if slash and chroot.strip("/") else ""
        return cls(hosts=hosts, chroot=chroot, **kwargs)

    @property
    def connect_string(self) -> str:
        return self.hosts + self.chroot


@dataclass(frozen=True, slots=True)
class HttpSettings:
    """Where a service listens and the address other members use to reach it."""

    host: str = "127.0.0.1"
    port: int = 8080
    advertise_url: str = ""

    @property
    def url(self) -> str:
        if self.advertise_url:
            return self.advertise_url.rstrip("/")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"


@dataclass(frozen=True, slots=True)
class NodeSettings:
    """A state node: identity, storage and how it reaches its peers."""

    node_id: str
    data_dir: Path
    zk: ZkSettings = field(default_factory=ZkSettings)
    http: HttpSettings = field(default_factory=HttpSettings)
    forward_timeout_s: float = 5.0
    max_batch_keys: int = 1000
    lmdb_map_size_bytes: int = 1 << 34
    # On SIGTERM: how long to wait for other nodes to serve this node's partitions before leaving anyway.
    drain_timeout_s: float = 60.0
    # How long a superseded version's files stay on disk (a rollback within it reuses them at once).
    version_grace_s: float = 300.0


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """A router: where it listens and how patiently it talks to nodes."""

    zk: ZkSettings = field(default_factory=ZkSettings)
    http: HttpSettings = field(default_factory=HttpSettings)
    upstream_timeout_s: float = 5.0
    upstream_connect_timeout_s: float = 1.0
    max_batch_keys: int = 1000
    unavailable_retry_after_s: int = 1
