"""keyroute.local's history, windows and bounded reads of live stores, against a real `keyroute node` on
librdkafka's mock broker: every answer equals the node's (read with keyroute.client) for the same key."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from keyroute.client import Client, KeyrouteError, Unavailable, WrongStoreKind
from keyroute.dev.kafka_mock import MockKafka
from keyroute.local import LocalReplica
from keyroute.runtime.settings import ZkSettings
from keyroute.storage.live import Aggregate, Merge
from keyroute.storage.timeline import StoreKind, Timeline, TimeType
from tests.integration.test_live_node import (
    HISTORY,
    HISTORY_TIMELINE,
    PARTITIONS,
    LiveNode,
    keys_of,
    partition,
    publish_live_store,
)
from tests.util import wait_for

pytestmark = pytest.mark.integration

WINDOWED = Merge(
    "windowed",
    "user",
    order_by="ts",
    aggregates=(Aggregate("n", "count", None), Aggregate("last", "max_by", "page", "ts")),
    time_type="integer",
    window=10,
    advance=5,
)
WINDOWED_TIMELINE = Timeline(StoreKind.WINDOWED, "ts", TimeType.INTEGER, window=10, advance=5)


def test_history_windows_and_bounded_reads_equal_the_nodes(
    tmp_path: Path, zk_settings: ZkSettings, kafka: MockKafka, kafka_topic: Callable[[int], str]
) -> None:
    visits, per10 = kafka_topic(PARTITIONS), kafka_topic(PARTITIONS)
    bootstrap = kafka.bootstrap_servers
    publish_live_store(tmp_path, zk_settings, "visits", visits, bootstrap, HISTORY, timeline=HISTORY_TIMELINE)
    publish_live_store(tmp_path, zk_settings, "per10", per10, bootstrap, WINDOWED, timeline=WINDOWED_TIMELINE)
    node = LiveNode(tmp_path, zk_settings, bootstrap, visits).start()
    keys = [*keys_of(0, 3), *keys_of(1, 3)]
    try:
        with (
            Client(node.url) as client,
            LocalReplica(zk_settings, ["visits", "per10"], tmp_path / "local", registry=None) as replica,
        ):
            replica.wait_ready(timeout_s=60)
            for i in range(300):
                key = keys[i % len(keys)]
                ts = (i * 7) % 53
                node.produce(key, {"user": key, "ts": ts, "page": f"/p{i}"})
                node.producer.produce(per10, key=key.encode(), partition=partition(key),
                                      value=f'{{"user": "{key}", "ts": {ts}, "page": "/p{i}"}}'.encode())  # fmt: skip
            node.flush()

            def applied(store: str) -> bool:
                status = replica.status()[store]
                return sum(row["offset"] + 1 for row in status.values()) == 300

            wait_for(lambda: applied("visits") and applied("per10"), timeout_s=60, message="the records applied")
            for store in ("visits", "per10"):
                wait_for(
                    lambda store=store: all(client.get(store, k).offset == replica.get(store, k).offset for k in keys),
                    timeout_s=60,
                    message=f"the node to apply {store}",
                )
            for key in keys:
                assert _same(replica.get("visits", key), client.get("visits", key))
                for bounds in ({}, {"start": 10, "end": 30}, {"order": "desc"}, {"start": 50}):
                    local = list(replica.history("visits", key, **bounds))
                    remote = list(client.history("visits", key, page_size=7, **bounds))
                    assert local == remote and local, (key, bounds)
                for bounds in ({}, {"start": 13, "end": 15}, {"end": 5}):
                    assert list(replica.windows("per10", key, **bounds)) == list(client.windows("per10", key, **bounds))
                assert _same(replica.get("per10", key), client.get("per10", key))
            with pytest.raises(WrongStoreKind):
                list(replica.windows("visits", keys[0]))

            # Read your own write: a read bounded by the next offset waits for the record produced meanwhile.
            key = keys[0]
            offset = replica.get("visits", key).offset
            assert offset is not None
            got: dict[str, Any] = {}
            reader = threading.Thread(
                target=lambda: got.setdefault("v", replica.get("visits", key, min_offset=offset + 1))
            )
            reader.start()
            node.produce(key, {"user": key, "ts": 1000, "page": "/mine"})
            node.flush()
            reader.join()
            assert got["v"].value["page"] == "/mine" and got["v"].offset >= offset + 1
            assert list(replica.history("visits", key, min_offset=offset + 1))[-1]["page"] == "/mine"
            with pytest.raises(Unavailable) as far:
                replica.get("visits", key, min_offset=offset + 10**6)
            assert far.value.code == "not_up_to_bound"
    finally:
        node.close()


def _same(local: Any, cluster: Any) -> bool:
    if isinstance(local, KeyrouteError) or isinstance(cluster, KeyrouteError):
        return type(local) is type(cluster)
    return (local.store, local.key, local.partition, local.version, local.value, local.offset) == (
        cluster.store,
        cluster.key,
        cluster.partition,
        cluster.version,
        cluster.value,
        cluster.offset,
    )
