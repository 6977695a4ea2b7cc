"""/metrics and X-Request-ID on a real cluster: ZooKeeper, two node processes, one router process.

Traffic of every kind goes through the router and straight to a node that must forward; the counters
scraped before and after must have moved by exactly what was sent. Snapshots are written by hand.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from keyroute.cluster import zk, zk_layout
from keyroute.cluster.partition_map import StoreRecord
from keyroute.keys.key_format import KeyFormat, parse_key
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.runtime.metrics import UNKNOWN_STORE
from keyroute.runtime.settings import ZkSettings
from tests.integration.test_node import write_snapshot
from tests.util import Proc, free_port, wait_for

pytestmark = pytest.mark.integration

BOOKINGS = {f"C{i:03d}": {"fare": i} for i in range(40)}
POSITIONS = {str(n): {"qty": n} for n in (1, 2, 3, 42)}
STORES: dict[str, tuple[dict[str, Any], KeyFormat, int]] = {
    "bookings": (BOOKINGS, KeyFormat.STRING, 4),
    "positions": (POSITIONS, KeyFormat.INT64, 2),
}
ALL_PARTITIONS = {(store, p) for store, (_, _, partitions) in STORES.items() for p in range(partitions)}
NODES = ("n1", "n2")


def partition_of(store: str, text: str) -> int:
    _, fmt, partitions = STORES[store]
    return partition_for(Partitioner.MURMUR2, parse_key(fmt, text).data, partitions)


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(http: httpx.Client, url: str) -> Samples:
    response = http.get(url + "/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def series(samples: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


@dataclass
class Cluster:
    tmp: Path
    zk_settings: ZkSettings
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=10.0, trust_env=False))
    procs: dict[str, Proc] = field(default_factory=dict)
    urls: dict[str, str] = field(default_factory=dict)

    def start(self, name: str, args: list[str]) -> None:
        port = free_port()
        argv = [*args, "--zk", self.zk_settings.connect_string, "--port", str(port)]
        self.procs[name] = Proc(argv, self.tmp / f"{name}.log", env={"KEYROUTE_LOG_FORMAT": "json"}).start()
        self.urls[name] = f"http://127.0.0.1:{port}"

    def owners(self) -> dict[tuple[str, int], str] | None:
        """(store, partition) -> the one node serving it, once the router sees every partition served by
        exactly its assigned node and both nodes serve some (before the second node has joined, the first
        one's assignment of everything to itself also satisfies the first condition)."""
        pmap = self.http.get(self.urls["router"] + "/admin/partition-map?detail=all").json()
        out = {}
        for store, record in pmap["stores"].items():
            for entry in record["partition_map"]:
                serving = [s["node"] for s in entry["serving"]]
                if len(serving) != 1 or serving != entry["assigned"]:
                    return None
                out[(store, entry["partition"])] = serving[0]
        return out if set(out) == ALL_PARTITIONS and set(out.values()) == set(NODES) else None

    def key(self, name: str, store: str, text: str, **kwargs: Any) -> httpx.Response:
        return self.http.get(f"{self.urls[name]}/stores/{store}/keys/{quote(text, safe='')}", **kwargs)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.alive and proc.popen is not None:
                proc.popen.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            proc.stop()
        self.http.close()

    def logs(self) -> str:
        return "\n".join(f"----- {n} -----\n{p.output()[-5000:]}" for n, p in self.procs.items())


@pytest.fixture
def cluster(tmp_path: Path, zk_settings: ZkSettings) -> Iterator[Cluster]:
    client = zk.connect(zk_settings)
    for store, (_, fmt, partitions) in STORES.items():
        rows, fmt, partitions = STORES[store]
        snapshot = write_snapshot(tmp_path / "snapshots", store, rows, fmt, partitions)
        record = StoreRecord(store, partitions, Partitioner.MURMUR2, fmt, 1, snapshot, ("v",), 1, 1.0)
        client.create(zk_layout.store_path(store), record.to_json(), makepath=True)
    c = Cluster(tmp_path, zk_settings)
    try:
        for node_id in NODES:
            data = str(tmp_path / f"data-{node_id}")
            c.start(node_id, ["node", "--node-id", node_id, "--data-dir", data, "--version-grace-s", "1"])
        c.start("router", ["router"])
        yield c
    finally:
        c.close()
        print(c.logs())  # shown only when the test failed
        zk.close(client)


def test_metrics_count_what_was_sent_and_request_ids_round_trip(cluster: Cluster) -> None:
    c = cluster
    http = c.http
    owners = wait_for(c.owners, timeout_s=60, interval_s=0.2, message="every partition served by its node")

    # A key that node `outsider` must forward to `owner` (once it has let go of any copy it loaded first).
    text = "C007"
    owner = owners[("bookings", partition_of("bookings", text))]
    outsider = next(n for n in NODES if n != owner)
    wait_for(
        lambda: c.key(outsider, "bookings", text).headers.get("x-keyroute-hops") == "1",
        timeout_s=30,
        message=f"{outsider} to forward {text}",
    )
    wait_for(lambda: http.get(c.urls["router"] + "/readyz").json().get("complete") is True, message="router ready")

    names = ("router", *NODES)
    before = {name: scrape(http, c.urls[name]) for name in names}

    # -- traffic through the router -------------------------------------------------------------------
    router = c.urls["router"]
    for key in BOOKINGS:
        assert c.key("router", "bookings", key).status_code == 200
    supplied = c.key("router", "bookings", "C001", headers={"x-request-id": "client-abc.123"})
    assert supplied.status_code == 200 and supplied.headers.get_list("x-request-id") == ["client-abc.123"]
    generated = c.key("router", "bookings", "C002", headers={"x-request-id": "has spaces, so replaced"})
    assert generated.status_code == 200
    missing = c.key("router", "bookings", "no-such-key")
    assert missing.status_code == 404 and missing.json()["error"] == "key_not_found"
    bad = c.key("router", "positions", "not-a-number")
    assert bad.status_code == 400 and bad.json()["error"] == "bad_key"
    unknown = c.key("router", "no-such-store", "k")
    assert unknown.status_code == 404 and unknown.json()["error"] == "store_not_found"
    batch = http.post(router + "/stores/bookings/batch-get", json={"keys": ["C010", "C020", "C030", "nope"]})
    assert [r["status"] for r in batch.json()["results"]] == [200, 200, 200, 404]

    # The router made up the ids it sent on (same process prefix as an error it answered itself), and the
    # node echoed them: had an id not reached the node, the node's own would have come back.
    router_prefix = unknown.headers["x-request-id"].split("-")[0]
    for response in (generated, missing, bad, batch):
        assert response.headers["x-request-id"].split("-")[0] == router_prefix, response.headers
    assert len({r.headers["x-request-id"] for r in (generated, missing, bad, batch, unknown)}) == 5

    # -- straight to a node that must forward once -----------------------------------------------------
    forwarded = c.key(outsider, "bookings", text, headers={"x-request-id": "trace-fwd-1"})
    assert forwarded.status_code == 200 and forwarded.headers["x-keyroute-forwarded-by"] == outsider
    assert forwarded.headers["x-keyroute-node"] == owner
    # The owner echoed the id the outsider passed on; the outsider relayed that answer as it was.
    assert forwarded.headers.get_list("x-request-id") == ["trace-fwd-1"]
    outsider_prefix = c.key(outsider, "no-such-store", "k").headers["x-request-id"].split("-")[0]
    forwarded_generated = c.key(outsider, "bookings", text)
    assert forwarded_generated.headers["x-keyroute-forwarded-by"] == outsider
    assert forwarded_generated.headers["x-request-id"].split("-")[0] == outsider_prefix != router_prefix

    after = {name: scrape(http, c.urls[name]) for name in names}

    # -- the router's counters -------------------------------------------------------------------------
    rb, ra = before["router"], after["router"]
    total = "keyroute_router_requests_total"
    found_keys = len(BOOKINGS) + 2
    assert delta(rb, ra, total, store="bookings", kind="key", outcome="found") == found_keys
    assert delta(rb, ra, total, store="bookings", kind="key", outcome="not_found") == 1
    assert delta(rb, ra, total, store="positions", kind="key", outcome="bad_request") == 1
    assert delta(rb, ra, total, store=UNKNOWN_STORE, kind="key", outcome="not_found") == 1
    assert delta(rb, ra, total, store="bookings", kind="batch", outcome="found") == 3
    assert delta(rb, ra, total, store="bookings", kind="batch", outcome="not_found") == 1
    assert not [labels for labels in series(ra, total) if dict(labels)["store"] == "no-such-store"]
    assert delta(rb, ra, "keyroute_router_batch_requests_total") == 1
    assert delta(rb, ra, "keyroute_router_upstream_failures_total") == 0
    assert delta(rb, ra, "keyroute_router_misroutes_total") == 0
    upstream = delta(rb, ra, "keyroute_router_upstream_requests_total")
    # Every key read that reached a node (found or missing), plus one request per node of the batch.
    batch_nodes = len({owners[("bookings", partition_of("bookings", k))] for k in ("C010", "C020", "C030", "nope")})
    assert upstream == found_keys + 1 + batch_nodes
    latency_count = sum(delta(rb, ra, "keyroute_router_upstream_latency_seconds_count", node=n) for n in NODES)
    latency_inf = sum(
        delta(rb, ra, "keyroute_router_upstream_latency_seconds_bucket", node=n, le="+Inf") for n in NODES
    )
    assert latency_count == latency_inf == upstream
    # Each request timed once, from admission to answer, by store and status class (the batch once).
    duration = "keyroute_router_request_duration_seconds_count"
    assert delta(rb, ra, duration, store="bookings", code_class="2xx") == found_keys + 1
    assert delta(rb, ra, duration, store="bookings", code_class="4xx") == 1
    assert delta(rb, ra, duration, store="positions", code_class="4xx") == 1
    assert delta(rb, ra, duration, store=UNKNOWN_STORE, code_class="4xx") == 1
    assert (
        delta(rb, ra, "keyroute_router_request_duration_seconds_bucket", store="bookings", code_class="2xx", le="+Inf")
        == found_keys + 1
    )
    # Every published store's version has an age, from its record's publish time.
    ages = series(ra, "keyroute_store_version_age_seconds")
    assert {dict(labels)["store"] for labels in ages} == {store for store, _ in ALL_PARTITIONS}
    assert all(age >= 0 for age in ages.values())
    assert value(ra, "keyroute_router_map_generation") > 0 and value(ra, "keyroute_router_map_stale") == 0
    assert value(ra, "keyroute_router_map_stale_seconds") == 0
    replicas = series(ra, "keyroute_router_partition_serving_replicas")
    assert {(dict(k)["store"], int(dict(k)["partition"])) for k in replicas} == ALL_PARTITIONS
    assert set(replicas.values()) == {1.0}

    # -- the nodes' counters ---------------------------------------------------------------------------
    node_total = "keyroute_node_requests_total"

    def node_sum(name: str, **labels: str) -> float:
        return sum(delta(before[n], after[n], name, **labels) for n in NODES)

    # The router's key reads land on the owners; the two forwarded reads count on both nodes.
    assert node_sum(node_total, store="bookings", kind="key", outcome="found") == found_keys + 2 * 2
    assert node_sum(node_total, store="bookings", kind="key", outcome="not_found") == 1
    assert node_sum(node_total, store="bookings", kind="batch", outcome="found") == 3
    assert node_sum(node_total, store="bookings", kind="batch", outcome="not_found") == 1
    assert node_sum(node_total, store=UNKNOWN_STORE, kind="key", outcome="not_found") == 1  # the outsider's
    assert node_sum(node_total, store="positions", kind="key", outcome="bad_request") == 0  # the router's
    # Timed per request: the forwarded reads on both nodes, the batch once per node it reached.
    node_duration = "keyroute_node_request_duration_seconds_count"
    assert node_sum(node_duration, store="bookings", code_class="2xx") == found_keys + 2 * 2 + batch_nodes
    assert node_sum(node_duration, store="bookings", code_class="4xx") == 1
    assert node_sum(node_duration, store=UNKNOWN_STORE, code_class="4xx") == 1
    ob, oa = before[outsider], after[outsider]
    wb, wa = before[owner], after[owner]
    assert delta(ob, oa, "keyroute_node_forwards_total") == 2
    assert delta(ob, oa, "keyroute_node_forward_failures_total") == 0
    assert delta(ob, oa, "keyroute_node_answers_total", source="forwarded") == 2
    assert delta(wb, wa, "keyroute_node_forwarded_in_total") == 2
    assert delta(wb, wa, "keyroute_node_forwards_total") == 0
    assert delta(ob, oa, "keyroute_node_forwarded_in_total") == 0
    local = node_sum("keyroute_node_answers_total", source="local")
    assert local == found_keys + 1 + 4 + 2  # router key reads, the missing key, the batch, the forwarded

    # Every partition served by exactly one node, at version 1; every load ended in "loaded".
    serving: dict[tuple[str, int], list[str]] = {}
    for n in NODES:
        for labels, v in series(after[n], "keyroute_node_partition_serving").items():
            if v == 1:
                serving.setdefault((dict(labels)["store"], int(dict(labels)["partition"])), []).append(n)
        assert set(series(after[n], "keyroute_node_partition_version").values()) == {1.0}
        assert value(after[n], "keyroute_node_map_generation") > 0
        assert value(after[n], "keyroute_node_ready") == 1
    assert serving == {pid: [node] for pid, node in owners.items()}
    loaded = sum(value(after[n], "keyroute_node_partition_load_seconds_count", outcome="loaded") for n in NODES)
    assert loaded >= len(ALL_PARTITIONS)
    assert sum(value(after[n], "keyroute_node_partition_load_seconds_count", outcome="failed") for n in NODES) == 0

    # -- JSON lines in the processes' logs (KEYROUTE_LOG_FORMAT=json) ---------------------------------
    for n in NODES:
        lines = [json.loads(line) for line in c.procs[n].output().splitlines() if line.strip()]
        assert lines and all({"ts", "level", "logger", "msg"} <= set(line) for line in lines)
        assert {line["node"] for line in lines} == {n}
        assert any(line["msg"].startswith("loaded ") for line in lines)
