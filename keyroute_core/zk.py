"""Connecting to ZooKeeper: one kazoo client per process, chroot created when missing."""

from __future__ import annotations

import contextlib

from kazoo.client import KazooClient
from kazoo.exceptions import NodeExistsError
from kazoo.retry import KazooRetry

from keyroute_core import zk_layout
from keyroute_core.settings import ZkSettings


class ZkUnavailableError(RuntimeError):
    """ZooKeeper could not be reached within the connect timeout."""


def _retry() -> KazooRetry:
    return KazooRetry(max_tries=-1, delay=0.1, backoff=2, max_delay=2.0, ignore_expire=False)


def connect(settings: ZkSettings, *, ensure_layout: bool = True) -> KazooClient:
    """Start a kazoo client on `settings`, creating the chroot and keyroute's top-level paths."""
    if settings.chroot:
        root = KazooClient(hosts=settings.hosts, timeout=settings.session_timeout_s)
        _start(root, settings)
        try:
            root.ensure_path(settings.chroot)
        finally:
            root.stop()
            root.close()
    client = KazooClient(
        hosts=settings.connect_string,
        timeout=settings.session_timeout_s,
        connection_retry=_retry(),
    )
    _start(client, settings)
    if ensure_layout:
        for path in zk_layout.PERSISTENT_ROOTS:
            with contextlib.suppress(NodeExistsError):
                client.ensure_path(path)
    return client


def _start(client: KazooClient, settings: ZkSettings) -> None:
    try:
        client.start(timeout=settings.connect_timeout_s)
    except Exception as exc:  # kazoo raises its own timeout type; the caller needs one meaning
        client.close()
        raise ZkUnavailableError(
            f"cannot reach ZooKeeper at {settings.hosts} within {settings.connect_timeout_s}s"
        ) from exc


def close(client: KazooClient) -> None:
    try:
        client.stop()
    finally:
        client.close()
