"""Reads that know how fresh they are, on real processes: `keyroute node` x2 and `keyroute router` on a real
ZooKeeper. A batch store refuses `min_offset` (400 not_live) and a malformed one is a 400 at every member;
the admin partition map of routers and nodes shows what `/live/{node_id}` records report (read on request,
cached about a second). With a live store built by `keyroute pipeline build` on librdkafka's mock broker:
produce a record, then a read through the router with `min_offset` = its offset returns it."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from keyroute.cluster import zk, zk_layout
from keyroute.cluster.partition_map import StoreRecord
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.runtime.settings import ZkSettings
from tests.integration.small_cluster import STORE, SmallCluster, key_path, partition, small_cluster
from tests.util import Proc, free_port, wait_for

KEY = "C001"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, zk_server: Any) -> Iterator[SmallCluster]:
    settings = ZkSettings(
        hosts=zk_server.connect_string, chroot=f"/live-reads-{time.monotonic_ns()}", session_timeout_s=4.0
    )
    with small_cluster(tmp_path_factory.mktemp("live-reads"), settings, replication_factor=2) as running:
        running.zk = settings  # type: ignore[attr-defined]
        yield running


def test_a_batch_store_refuses_min_offset_as_not_live_through_router_and_node(cluster: SmallCluster) -> None:
    with httpx.Client(timeout=10, trust_env=False) as http:
        for base in (cluster.router_url, *cluster.node_urls.values()):
            plain = http.get(base + key_path(KEY))
            assert plain.status_code == 200 and "x-keyroute-offset" not in plain.headers
            bounded = http.get(base + key_path(KEY) + "?min_offset=3")
            assert bounded.status_code == 400 and bounded.json()["error"] == "not_live", (base, bounded.text)
            batch = http.post(base + f"/stores/{STORE}/batch-get", json={"keys": [KEY], "min_offset": 0})
            assert batch.status_code == 200 and batch.json()["results"][0]["error"] == "not_live"


@pytest.mark.parametrize("query", ["min_offset=", "min_offset=-2", "min_offset=x", "min_offset=1&min_offset=1"])
def test_a_malformed_min_offset_is_400_bad_request_everywhere(cluster: SmallCluster, query: str) -> None:
    with httpx.Client(timeout=10, trust_env=False) as http:
        for base in (cluster.router_url, *cluster.node_urls.values()):
            response = http.get(base + key_path(KEY) + "?" + query)
            assert response.status_code == 400 and response.json()["error"] == "bad_request", (base, response.text)
            batch = http.post(base + f"/stores/{STORE}/batch-get", json={"keys": [KEY], "min_offsets": {"9": 1}})
            assert batch.status_code == 400 and batch.json()["error"] == "bad_request"


def test_the_partition_map_shows_each_replicas_live_report(cluster: SmallCluster) -> None:
    """A report as a node writes it (here by the test, for a node id of its own, so it never races the
    cluster's nodes), for a store published as live: routers and nodes show it under the partition, the store
    says it is live. (Reports are read only while some store is live.)"""
    settings: ZkSettings = cluster.zk  # type: ignore[attr-defined]
    p = partition(KEY)
    report = {
        "version": 1,
        "offset": 41,
        "lag_records": 2,
        "lag_ms": 12.5,
        "state": "live",
        "applied": 42,
        "skipped": {"misplaced": 1},
        "error": None,
    }
    client = zk.connect(settings)
    store_path = zk_layout.store_path(STORE)
    published, _ = client.get(store_path)
    client.set(store_path, dataclasses.replace(StoreRecord.from_json(published), live=True).to_json())
    try:
        record = {"stores": {STORE: {str(p): report}}, "updated_at": time.time()}
        client.create("/live/n-test", json.dumps(record).encode(), makepath=True, ephemeral=True)

        def shown(base: str, offset: int) -> dict[str, Any] | None:
            view = httpx.get(base + "/admin/partition-map?detail=all", timeout=10).json()
            store = view["stores"][STORE]
            entries = store["partition_map"][p].get("live", [])
            return store if store.get("live") and [e.get("offset") for e in entries] == [offset] else None

        for base in (cluster.router_url, *cluster.node_urls.values()):
            store = wait_for(lambda base=base: shown(base, 41), timeout_s=10, message=f"the report on {base}")
            entry = store["partition_map"][p]["live"][0]
            assert {k: entry[k] for k in report} == report and entry["node"] == "n-test"
            assert entry["reported_age_s"] >= 0
            assert all(e.get("live") == [] for e in store["partition_map"] if e["partition"] != p)
        # A newer report shows (the read is cached for max_age_s by the reader's clock, and no longer:
        # tests/unit/core/test_live_status.py proves that with an injected clock).
        record["stores"][STORE][str(p)]["offset"] = 50  # type: ignore[index]
        client.set("/live/n-test", json.dumps(record).encode())
        wait_for(lambda: shown(cluster.router_url, 50), timeout_s=10, message="the newer report")
    finally:
        try:
            client.delete("/live/n-test")
            client.set(store_path, published)
        finally:
            zk.close(client)
    # Nothing reported and the store not published as live: the store is not shown as live.
    wait_for(
        lambda: (
            "live"
            not in httpx.get(cluster.router_url + "/admin/partition-map?detail=all", timeout=10).json()["stores"][STORE]
        ),
        timeout_s=10,
        message="the report to go",
    )


# -- a live store, end to end -----------------------------------------------------------------------------

LIVE_STORE = "clicks"
LIVE_PARTITIONS = 4


def _node_side_present() -> bool:
    return importlib.util.find_spec("keyroute.replica.live") is not None


@pytest.mark.skipif(not _node_side_present(), reason="nodes do not consume live stores yet (keyroute.replica.live)")
def test_a_produced_record_is_read_through_the_router_with_min_offset_at_its_offset(
    tmp_path: Path, zk_settings: ZkSettings
) -> None:
    from confluent_kafka import Producer

    from keyroute.dev.kafka_mock import MockKafka

    with MockKafka() as kafka:
        topic = f"clicks-{time.monotonic_ns()}"
        kafka.create_topic(topic, LIVE_PARTITIONS)
        spec = tmp_path / "stores.toml"
        spec.write_text(
            f"""
[stores.{LIVE_STORE}]
key = "user"
partitions = {LIVE_PARTITIONS}
replication_factor = 2
mode = "latest"
order_by = "ts"
columns = ["ts", "page"]

[stores.{LIVE_STORE}.live]
topic = "{topic}"
bootstrap_servers = "{kafka.bootstrap_servers}"
start = "earliest"
"""
        )
        connect = zk_settings.connect_string
        build = Proc(
            ["pipeline", "build", "--spec", str(spec), "--zk", connect, "--output", str(tmp_path / "snapshots"),
             "--master", "local[1]"],
            tmp_path / "pipeline.log",
        ).start()  # fmt: skip
        assert build.popen is not None
        try:
            assert build.popen.wait(timeout=280) == 0, build.output()[-6000:]
        finally:
            build.stop()

        procs: list[Proc] = []
        try:
            for node_id in ("n1", "n2"):
                args = ["node", "--zk", connect, "--node-id", node_id, "--port", str(free_port())]
                args += ["--data-dir", str(tmp_path / f"data-{node_id}"), "--zk-session-timeout-s", "4"]
                procs.append(Proc(args, tmp_path / f"{node_id}.log").start())
            router_port = free_port()
            procs.append(Proc(["router", "--zk", connect, "--port", str(router_port)], tmp_path / "router.log").start())
            router = f"http://127.0.0.1:{router_port}"
            wait_for(
                lambda: httpx.get(router + "/readyz", timeout=5).json().get("complete") is True,
                timeout_s=90,
                interval_s=0.2,
                message="the router to be ready",
            )

            producer = Producer({"bootstrap.servers": kafka.bootstrap_servers, "log_level": 3})
            delivered: list[Any] = []

            def produce(user: str, value: dict[str, Any]) -> tuple[int, int]:
                p = partition_for(Partitioner.MURMUR2, user.encode(), LIVE_PARTITIONS)
                producer.produce(topic, key=user.encode(), value=json.dumps(value).encode(), partition=p,
                                 on_delivery=lambda err, msg: delivered.append((err, msg)))  # fmt: skip
                producer.flush(10)
                err, msg = delivered.pop()
                assert err is None, err
                return msg.partition(), msg.offset()

            with httpx.Client(timeout=10, trust_env=False) as http:
                for ts in (1, 2, 3):
                    p, offset = produce("u1", {"ts": ts, "page": f"/p{ts}"})
                    answer = http.get(router + f"/stores/{LIVE_STORE}/keys/u1?min_offset={offset}")
                    assert answer.status_code == 200, answer.text
                    assert answer.json()["value"] == {"ts": ts, "page": f"/p{ts}"}
                    assert int(answer.headers["x-keyroute-offset"]) >= offset
                    assert int(answer.headers["x-keyroute-lag"]) >= 0
                    batch = http.post(
                        router + f"/stores/{LIVE_STORE}/batch-get",
                        json={"keys": ["u1"], "min_offsets": {str(p): offset}},
                    ).json()["results"]
                    assert batch[0]["status"] == 200 and batch[0]["value"]["ts"] == ts
                    assert batch[0]["offset"] >= offset
                # A bound no replica can reach: 503 not_up_to_bound after the bounded wait, with Retry-After.
                far = http.get(router + f"/stores/{LIVE_STORE}/keys/u1?min_offset={offset + 1000}")
                assert far.status_code == 503 and far.json()["error"] == "not_up_to_bound"
                assert far.headers["retry-after"] == "1" and int(far.headers["x-keyroute-offset"]) >= offset

                def reported() -> bool:
                    view = http.get(router + "/admin/partition-map?detail=all").json()["stores"][LIVE_STORE]
                    entries = view["partition_map"][p]["live"]
                    return bool(view.get("live")) and len(entries) == 2 and all(e["offset"] >= offset for e in entries)

                wait_for(reported, timeout_s=15, message="both replicas' reports in the partition map")
        finally:
            for proc in procs:
                proc.stop()
