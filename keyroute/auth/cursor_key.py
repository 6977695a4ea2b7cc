"""The key range and timeline cursors are signed with: 32 random bytes per cluster, at /cursor-key in
ZooKeeper.

Every configuration has it, whatever proves members to each other (a cluster secret, member certificates,
or nothing in a demo): the first node to join creates it (a create that fails when it exists, so racing
nodes agree on one key) and every router and node watches it. It is as secret as ZooKeeper's reads: with
ZooKeeper credentials (`--zk-auth`, x509 identities) the znode has the layout's ACL, writer ALL and reader
READ, so only members read it; a ZooKeeper open to the world shows it to whoever reaches ZooKeeper, who
could sign cursors (and write every record anyway).

A cursor binds a read to a version and a position; one that was forged could pin a version or a key the
reader did not reach by paging. A key that vanishes from ZooKeeper (a wiped or restored ensemble) is kept
until a new one appears: absence is not deletion. A new key makes the cursors handed out before it answer
400 `bad_cursor`: the read starts again.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException, NodeExistsError, NoNodeError

from keyroute.cluster import zk_layout

log = logging.getLogger(__name__)

KEY_BYTES = 32


def ensure_cursor_key(client: KazooClient) -> bytes:
    """The cluster's cursor key, created (random) unless it exists; racing creators agree on one."""
    for _ in range(3):
        try:
            raw, _ = client.get(zk_layout.CURSOR_KEY)
            if raw:
                return bytes(raw)
        except NoNodeError:
            pass
        try:
            key = secrets.token_bytes(KEY_BYTES)
            client.create(zk_layout.CURSOR_KEY, key, makepath=True)
            log.info("created the cluster's cursor key at %s", zk_layout.CURSOR_KEY)
            return key
        except NodeExistsError:
            continue  # another node's: read it
    raise RuntimeError(f"{zk_layout.CURSOR_KEY} keeps changing or is empty")


class CursorKey:
    """The cursor key a router or node signs with: `value` (None until known). `watch(client)` follows
    /cursor-key (kazoo re-reads it after a reconnect); `ensure(client)` also creates it (nodes)."""

    __slots__ = ("value", "_watch")

    def __init__(self, value: bytes | None = None) -> None:
        self.value = value
        self._watch: Any = None

    def ensure(self, client: KazooClient) -> None:
        """Create the key unless it exists, then follow it (off the event loop: this reads ZooKeeper)."""
        self.value = ensure_cursor_key(client)
        self.watch(client)

    def watch(self, client: KazooClient) -> None:
        """Follow /cursor-key on `client` (reads it once now, off the event loop). A key this identity may
        not read is said in one line, and cursors are then refused until a restart reads it."""
        try:
            self._watch = client.DataWatch(zk_layout.CURSOR_KEY, self._changed)
        except KazooException as exc:
            log.warning(
                "cannot read the cluster's cursor key %s (%s): range and timeline reads answer 503 "
                "until this process can (check the ZooKeeper identity's ACL)",
                zk_layout.CURSOR_KEY,
                type(exc).__name__,
            )

    def _changed(self, data: bytes | None, stat: Any) -> None:
        if data:  # gone or empty: the last key known stays in use (absence is not deletion)
            self.value = bytes(data)
