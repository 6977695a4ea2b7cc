"""The cluster's cursor key in the session's ZooKeeper: created once whoever races to create it, followed by
every reader when it changes, and kept when it vanishes (absence is not deletion)."""

from __future__ import annotations

import threading

import pytest

from keyroute.auth.cursor_key import KEY_BYTES, CursorKey, ensure_cursor_key
from keyroute.cluster import zk, zk_layout
from keyroute.runtime.settings import ZkSettings
from tests.util import wait_for

pytestmark = pytest.mark.integration


def test_racing_nodes_agree_on_one_key_and_readers_follow_it(zk_settings: ZkSettings) -> None:
    clients = [zk.connect(zk_settings) for _ in range(3)]
    try:
        found: list[bytes] = []
        start = threading.Barrier(len(clients))

        def create(client: object) -> None:
            start.wait()
            found.append(ensure_cursor_key(client))

        threads = [threading.Thread(target=create, args=(c,)) for c in clients]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert len(found) == 3 and len(set(found)) == 1 and len(found[0]) == KEY_BYTES
        assert clients[0].get(zk_layout.CURSOR_KEY)[0] == found[0]

        following = CursorKey()
        following.watch(clients[1])
        assert following.value == found[0]
        clients[0].set(zk_layout.CURSOR_KEY, b"n" * KEY_BYTES)  # replaced: followed at once
        wait_for(lambda: following.value == b"n" * KEY_BYTES, timeout_s=10, message="the new key followed")
        clients[0].delete(zk_layout.CURSOR_KEY)  # gone: the last key known stays
        following._changed(None, None)  # what the watch is told of the deletion, whenever it comes
        assert following.value == b"n" * KEY_BYTES
        renewed = CursorKey()
        renewed.ensure(clients[2])  # the next node to join creates a new one, which every follower takes
        assert renewed.value not in (None, found[0], b"n" * KEY_BYTES)
        wait_for(lambda: following.value == renewed.value, timeout_s=10, message="the recreated key followed")
    finally:
        for client in clients:
            zk.close(client)


def test_a_reader_that_watches_before_any_node_joined_takes_the_key_when_it_appears(zk_settings: ZkSettings) -> None:
    writer = zk.connect(zk_settings)
    reader = zk.connect(zk_settings, ensure_layout=False)
    try:
        early = CursorKey()
        early.watch(reader)
        assert early.value is None
        key = ensure_cursor_key(writer)
        wait_for(lambda: early.value == key, timeout_s=10, message="the key once created")
    finally:
        zk.close(reader)
        zk.close(writer)
