"""The router's /metrics: valid Prometheus text, bounded labels, histogram buckets, and request ids."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from keyroute.cluster.partition_map import PartitionMap
from keyroute.router.metrics import RouterMetrics
from keyroute.runtime.metrics import UNKNOWN_STORE, Histogram, outcome
from tests.unit.router.fakes import FakeNode, build_map, store_record
from tests.unit.router.test_app import router

STORES = [store_record("s", 4), store_record("t", 2)]


def parse(text: str) -> dict[str, Any]:
    """name -> family, with every sample of the text (the parser fails on anything malformed)."""
    return {family.name: family for family in text_string_to_metric_families(text)}


def sample(families: dict[str, Any], family: str, name: str | None = None, **labels: str) -> float:
    matches = [s.value for s in families[family].samples if s.name == (name or family) and s.labels == labels]
    assert len(matches) == 1, (family, name, labels, families[family].samples)
    return float(matches[0])


def test_the_exposition_is_valid_prometheus_text_with_every_family() -> None:
    m = RouterMetrics()
    m.map_installed(build_map(STORES, {"a": {"s": [0, 1, 2], "t": [0, 1]}, "b": {"s": [0]}}, generation=9))
    m.map_generation = 9
    m.count("s", "key", 200)
    m.count("s", "key", 404)
    m.count("s", "key", 400)
    m.count("s", "key", 503)
    m.count("s", "key", 500)
    m.count_results("t", "batch", [{"status": 200}, {"status": 200}, {"status": 404}])
    m.misroutes = 3
    m.hedges = 2
    m.observe_upstream("a", 0.0007)

    families = parse(m.render())

    assert families["keyroute_router_requests"].type == "counter"
    for status_outcome in ("found", "not_found", "bad_request", "unavailable", "error"):
        assert (
            sample(
                families,
                "keyroute_router_requests",
                "keyroute_router_requests_total",
                store="s",
                kind="key",
                outcome=status_outcome,
            )
            == 1
        )
    assert (
        sample(
            families,
            "keyroute_router_requests",
            "keyroute_router_requests_total",
            store="t",
            kind="batch",
            outcome="found",
        )
        == 2
    )
    assert sample(families, "keyroute_router_misroutes", "keyroute_router_misroutes_total") == 3
    assert sample(families, "keyroute_router_hedges", "keyroute_router_hedges_total") == 2
    assert sample(families, "keyroute_router_map_generation") == 9
    assert families["keyroute_router_map_generation"].type == "gauge"
    assert families["keyroute_router_upstream_latency_seconds"].type == "histogram"
    # One gauge per partition: the number of nodes reads of it go to.
    replicas = {
        (s.labels["store"], s.labels["partition"]): s.value
        for s in families["keyroute_router_partition_serving_replicas"].samples
    }
    assert replicas == {("s", "0"): 2, ("s", "1"): 1, ("s", "2"): 1, ("s", "3"): 0, ("t", "0"): 1, ("t", "1"): 1}


def test_apps_use_registries_of_their_own() -> None:
    before = {f.name for f in REGISTRY.collect()}
    first, second = RouterMetrics(), RouterMetrics()
    first.misroutes = 1
    assert sample(parse(first.render()), "keyroute_router_misroutes", "keyroute_router_misroutes_total") == 1
    assert sample(parse(second.render()), "keyroute_router_misroutes", "keyroute_router_misroutes_total") == 0
    assert {f.name for f in REGISTRY.collect()} == before


def test_store_names_the_map_does_not_know_share_one_label() -> None:
    m = RouterMetrics()
    m.map_installed(build_map(STORES, {"a": {"s": [0, 1, 2, 3]}}))
    for i in range(500):
        m.count(f"made-up-{i}", "key", 404)
    m.count_results("nope", "batch", [{"status": 404}] * 3)
    m.count("s", "key", 200)

    requests = parse(m.render())["keyroute_router_requests"].samples
    assert {s.labels["store"] for s in requests} == {"s", UNKNOWN_STORE}
    assert (
        sample(
            parse(m.render()),
            "keyroute_router_requests",
            "keyroute_router_requests_total",
            store=UNKNOWN_STORE,
            kind="key",
            outcome="not_found",
        )
        == 500
    )


def test_before_any_map_every_store_is_unknown() -> None:
    m = RouterMetrics()
    m.count("s", "key", 503)
    assert {k[0] for k in m.requests.counts} == {UNKNOWN_STORE}


def test_histogram_buckets_are_cumulative_and_bounds_inclusive() -> None:
    h = Histogram((0.001, 0.01, 0.1))
    for value in (0.0005, 0.001, 0.002, 0.01, 0.05, 7.0):
        h.observe(value)
    assert h.cumulative() == [("0.001", 2), ("0.01", 4), ("0.1", 5), ("+Inf", 6)]
    assert h.count == 6 and h.sum == pytest.approx(7.0635)

    m = RouterMetrics()
    for seconds in (0.0004, 0.0004, 0.003, 30.0):
        m.observe_upstream("a", seconds)
    m.observe_upstream("b", 0.2)
    families = parse(m.render())
    name = "keyroute_router_upstream_latency_seconds"
    assert sample(families, name, name + "_bucket", node="a", le="0.0005") == 2
    assert sample(families, name, name + "_bucket", node="a", le="0.005") == 3
    assert sample(families, name, name + "_bucket", node="a", le="5.0") == 3
    assert sample(families, name, name + "_bucket", node="a", le="+Inf") == 4
    assert sample(families, name, name + "_count", node="a") == 4
    assert sample(families, name, name + "_sum", node="a") == pytest.approx(30.0038)
    assert sample(families, name, name + "_bucket", node="b", le="0.1") == 0
    assert sample(families, name, name + "_bucket", node="b", le="0.25") == 1


def test_outcomes_follow_the_status_answered() -> None:
    assert [outcome(s) for s in (200, 404, 400, 413, 503, 500, 502, 401, 403, 429)] == [
        "found",
        "not_found",
        "bad_request",
        "bad_request",
        "unavailable",
        "error",
        "error",
        "unauthorized",
        "forbidden",
        "quota_exceeded",
    ]


def test_request_durations_by_store_and_status_class() -> None:
    m = RouterMetrics()
    m.map_installed(build_map(STORES, {"a": {"s": [0, 1, 2, 3]}}))
    m.observe_request("s", 200, 0.0005)  # a bound belongs to its own bucket
    m.observe_request("s", 200, 0.003)
    m.observe_request("s", 404, 0.002)
    m.observe_request("s", 503, 7.0)
    m.observe_request("made-up", 404, 0.001)

    families = parse(m.render())
    name = "keyroute_router_request_duration_seconds"
    assert families[name].type == "histogram"
    assert sample(families, name, name + "_bucket", store="s", code_class="2xx", le="0.0005") == 1
    assert sample(families, name, name + "_bucket", store="s", code_class="2xx", le="0.005") == 2
    assert sample(families, name, name + "_sum", store="s", code_class="2xx") == pytest.approx(0.0035)
    assert sample(families, name, name + "_count", store="s", code_class="4xx") == 1
    assert sample(families, name, name + "_bucket", store="s", code_class="5xx", le="5.0") == 0
    assert sample(families, name, name + "_bucket", store="s", code_class="5xx", le="+Inf") == 1
    assert sample(families, name, name + "_count", store=UNKNOWN_STORE, code_class="4xx") == 1


def test_version_age_comes_from_the_publish_time_and_records_without_one_have_none() -> None:
    now = 1_800_000_000.0
    published = dataclasses.replace(store_record("s", 4), published_at=now - 3600)
    m = RouterMetrics(clock=lambda: now)
    m.map_installed(build_map([published, store_record("t", 2)], {"a": {"s": [0], "t": [0]}}))

    samples = parse(m.render())["keyroute_store_version_age_seconds"].samples
    assert [s.labels for s in samples] == [{"store": "s"}]
    assert samples[0].value == 3600


def test_map_age_and_staleness() -> None:
    fresh = build_map(STORES, {"a": {"s": [0]}})
    now = [fresh.built_at + 5]
    m = RouterMetrics(clock=lambda: now[0])
    m.map_installed(fresh)
    families = parse(m.render())
    assert sample(families, "keyroute_router_map_stale_seconds") == 0
    assert sample(families, "keyroute_router_map_age_seconds") == pytest.approx(5)

    now[0] += 10
    m.map_installed(fresh.marked_stale(True))
    assert m.stale_since == now[0]
    now[0] += 10
    m.map_installed(fresh.marked_stale(True))  # still stale: the time it went stale stays
    assert m.stale_since == now[0] - 10
    now[0] += 30
    families = parse(m.render())
    assert sample(families, "keyroute_router_map_stale_seconds") == pytest.approx(40)
    assert sample(families, "keyroute_router_map_age_seconds") == pytest.approx(55)
    m.map_installed(fresh)
    assert m.stale_since is None
    assert sample(parse(m.render()), "keyroute_router_map_stale_seconds") == 0


def test_router_app_serves_the_exposition_and_answers_with_request_ids() -> None:
    node = FakeNode("a", {("s", "k"): {"v": 1}})

    async def scenario() -> None:
        # Over real sockets, through the router's own server: key reads and batches on the data plane,
        # /metrics on the application behind it.
        async with router(build_map(STORES, {"a": {"s": [0, 1, 2, 3]}}), node) as r:
            client = r.client
            ok = await client.get("/stores/s/keys/k", headers={"x-request-id": "client-1"})
            missing = await client.get("/stores/s/keys/nope")
            unknown = await client.get("/stores/zzz/keys/k", headers={"x-request-id": "bad id with spaces"})
            batch = await client.post("/stores/s/batch-get", json={"keys": ["k", "nope"]})
            scraped = await client.get("/metrics")

        assert ok.status_code == 200 and ok.headers.get_list("x-request-id") == ["client-1"]
        assert node.received[0].headers["x-request-id"] == "client-1"
        generated = missing.headers["x-request-id"]
        assert missing.status_code == 404 and generated and generated != "client-1"
        assert node.received[1].headers["x-request-id"] == generated
        # An unusable client id is replaced, also on an error the router answers itself.
        assert unknown.status_code == 404 and unknown.headers["x-request-id"] not in ("", "bad id with spaces")
        assert batch.headers["x-request-id"] not in (generated, unknown.headers["x-request-id"])

        assert scraped.headers["content-type"].startswith("text/plain; version=")
        families = parse(scraped.text)
        name, total = "keyroute_router_requests", "keyroute_router_requests_total"
        assert sample(families, name, total, store="s", kind="key", outcome="found") == 1
        assert sample(families, name, total, store="s", kind="key", outcome="not_found") == 1
        assert sample(families, name, total, store=UNKNOWN_STORE, kind="key", outcome="not_found") == 1
        assert sample(families, name, total, store="s", kind="batch", outcome="found") == 1
        assert sample(families, name, total, store="s", kind="batch", outcome="not_found") == 1
        latency = "keyroute_router_upstream_latency_seconds"
        assert sample(families, latency, latency + "_count", node="a") == 3
        # Each request timed once from its admission to its answer (the batch once, not per key).
        duration = "keyroute_router_request_duration_seconds"
        assert sample(families, duration, duration + "_count", store="s", code_class="2xx") == 2
        assert sample(families, duration, duration + "_count", store="s", code_class="4xx") == 1
        assert sample(families, duration, duration + "_count", store=UNKNOWN_STORE, code_class="4xx") == 1

    asyncio.run(scenario())


Answered = tuple[str, str, int, float]  # store, kind, status, seconds
REQUESTS = "keyroute_router_requests"
DURATION = "keyroute_router_request_duration_seconds"


def answered_both_ways(rounds: list[tuple[PartitionMap, list[Answered]]]) -> dict[str, Any]:
    """The rendering after each round's map is installed and its answers counted with `answered`, having
    checked that it equals the rendering of `count` + `observe_request` for the same answers."""
    apart, together = RouterMetrics(), RouterMetrics()
    for installed, answers in rounds:
        for m in (apart, together):
            m.map_installed(installed)
        for store, kind, status, seconds in answers:
            apart.count(store, kind, status)
            apart.observe_request(store, status, seconds)
            together.answered(store, kind, status, seconds)
    rendered, expected = parse(together.render()), parse(apart.render())
    for family in (REQUESTS, DURATION):
        assert rendered[family] == expected[family]
    return rendered


def test_answered_counts_and_times_as_count_and_observe_request_do() -> None:
    # The data plane's one call per answer renders exactly what its two calls render.
    answers = [("s", "key", 200, 0.0005), ("s", "timeline", 404, 0.003), ("made-up", "key", 404, 0.001)]
    answers += [("s", "key", 503, 7.0), ("s", "range", 500, 0.02)]
    rendered = answered_both_ways([(build_map(STORES, {"a": {"s": [0, 1, 2, 3]}}), answers)])
    assert sample(rendered, DURATION, DURATION + "_count", store=UNKNOWN_STORE, code_class="4xx") == 1
    assert sample(rendered, REQUESTS, REQUESTS + "_total", store="s", kind="key", outcome="unavailable") == 1


def test_answered_follows_the_installed_map_as_count_and_observe_request_do() -> None:
    # `answered` keeps what it updates per store label: a new map that adds a store or drops one moves its
    # reads to the right label from the next answer on, as the two separate calls do, and repeated answers
    # add up.
    only_s = build_map(STORES[:1], {"a": {"s": [0, 1, 2, 3]}})
    only_t = build_map(STORES[1:], {"a": {"t": [0, 1]}})
    answers: list[Answered] = [("s", "key", 200, 0.001), ("t", "key", 200, 0.002), ("s", "key", 404, 0.003)] * 3
    rendered = answered_both_ways([(installed, answers) for installed in (only_s, only_t, only_s)])
    total = REQUESTS + "_total"
    # "s" known under two of the three maps, "t" under one; the rest of their reads are the unknown store's.
    assert sample(rendered, REQUESTS, total, store="s", kind="key", outcome="found") == 6
    assert sample(rendered, REQUESTS, total, store="t", kind="key", outcome="found") == 3
    assert sample(rendered, REQUESTS, total, store=UNKNOWN_STORE, kind="key", outcome="found") == 9
    assert sample(rendered, DURATION, DURATION + "_count", store=UNKNOWN_STORE, code_class="4xx") == 3
