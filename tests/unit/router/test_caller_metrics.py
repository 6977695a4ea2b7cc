"""Reads by caller (identity) and store on routers and nodes: bounded labels, statuses, latency, and what the
data plane passes them (named callers and 401s only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from keyroute.api import ApiError
from keyroute.auth.access import ANONYMOUS, Identity
from keyroute.http.admission import Admission
from keyroute.http.dataplane import Call, RoutedDataPlane
from keyroute.http.routing import Route, RouteTable
from keyroute.runtime.metrics import OTHER_CALLER, UNKNOWN_STORE, CallerReads
from keyroute.state_node.metrics import NodeMetrics
from tests.unit.http.test_dataplane import StandInExchange
from tests.unit.router.fakes import build_map, store_record
from tests.unit.router.test_metrics import parse, sample
from tests.unit.router.test_metrics_workers import publish, scrape, value, worker

CALLERS = "keyroute_router_caller_requests"
DURATION = "keyroute_router_caller_request_duration_seconds"


def test_reads_by_caller_count_each_status_and_time_each_read_in_one_entry() -> None:
    reads = CallerReads()
    reads.add("web", "s", 200, 0.002)
    reads.add("web", "s", 200, 0.004)
    reads.add("web", "s", 429, 0.0001)
    reads.add("batch", "s", 503, 0.0001)
    statuses, histogram = reads.entries["web", "s"]
    assert statuses == {200: 2, 429: 1} and histogram.count == 3 and histogram.sum == 0.0061
    assert reads.sums()["batch"]["s"]["statuses"] == {"503": 1}


def test_identities_beyond_the_cap_share_one_label_and_configured_names_keep_theirs() -> None:
    reads = CallerReads(cap=3, names=["configured"])
    for i in range(50):
        reads.add(f"caller-{i}", "s", 200, 0.001)
    reads.add("configured", "s", 403, 0.001)
    assert {name for name, _ in reads.entries} == {"configured", "caller-0", "caller-1", OTHER_CALLER}
    assert reads.entries[OTHER_CALLER, "s"][0] == {200: 48}
    assert reads.entries["configured", "s"][0] == {403: 1}


def test_the_router_exports_reads_by_identity_store_and_status_with_latency() -> None:
    from keyroute.router.metrics import RouterMetrics

    m = RouterMetrics()
    m.map_installed(build_map([store_record("s", 4)], {"a": {"s": [0, 1, 2, 3]}}))
    m.caller_answered("web", "s", 200, 0.003)
    m.caller_answered("web", "s", 403, 0.0002)
    m.caller_answered("batch", "s", 503, 0.0001)
    m.caller_answered("batch", "made-up", 429, 0.0001)
    families = parse(m.render())
    assert sample(families, CALLERS, f"{CALLERS}_total", identity="web", store="s", status="200") == 1
    assert sample(families, CALLERS, f"{CALLERS}_total", identity="web", store="s", status="403") == 1
    assert sample(families, CALLERS, f"{CALLERS}_total", identity="batch", store="s", status="503") == 1
    assert sample(families, CALLERS, f"{CALLERS}_total", identity="batch", store=UNKNOWN_STORE, status="429") == 1
    assert sample(families, DURATION, f"{DURATION}_count", identity="web", store="s") == 2
    assert sample(families, DURATION, f"{DURATION}_bucket", identity="web", store="s", le="0.0025") == 1


def test_router_workers_sum_their_reads_by_caller(tmp_path: Path) -> None:
    one, two = worker(tmp_path, 1), worker(tmp_path, 2)
    for m in (one, two):
        m.caller_answered("web", "s", 200, 0.001)
    two.caller_answered("web", "s", 503, 0.001)
    publish(two)
    samples = scrape(one)
    assert value(samples, f"{CALLERS}_total", identity="web", store=UNKNOWN_STORE, status="200") == 2
    assert value(samples, f"{CALLERS}_total", identity="web", store=UNKNOWN_STORE, status="503") == 1
    assert value(samples, f"{DURATION}_count", identity="web", store=UNKNOWN_STORE) == 3


def test_the_node_exports_reads_by_identity_and_store() -> None:
    m = NodeMetrics()
    m.caller_answered("web", "s", 200, 0.001)  # no map watched yet: every store is unknown
    families = parse(m.render().decode())
    name = "keyroute_node_caller_requests"
    assert sample(families, name, f"{name}_total", identity="web", store=UNKNOWN_STORE, status="200") == 1
    name = "keyroute_node_caller_request_duration_seconds"
    assert sample(families, name, f"{name}_count", identity="web", store=UNKNOWN_STORE) == 1


class Unauthenticated(ApiError, status=401, code="unauthorized"): ...


class Plane(RoutedDataPlane):
    """Callers named after the key (`anonymous`: ANONYMOUS); `/batch` answers as a batch does."""

    def __init__(self) -> None:
        self.by_caller: list[tuple[str, str, int]] = []
        self.counted: list[tuple[str, str, int]] = []
        super().__init__(
            Admission(),
            lambda *c: self.counted.append(c),
            caller_answered=lambda name, store, status, seconds: self.by_caller.append((name, store, status)),
        )

    def _key(self, call: Call, store: str, key: str) -> Any:
        name, _, status = key.partition("-")
        call.admit_as(ANONYMOUS if name == "anonymous" else Identity(name))
        if status == "401":
            raise Unauthenticated("no token")
        call.answer(int(status), [], b"")

    def _batch(self, call: Call, store: str) -> Any:
        call.admit_as(Identity("batch"))
        call.answer_counted(200, [], b"{}")

    routes = RouteTable(
        [
            Route("/stores/{store}/keys/{key}", ("GET",), _key, "key"),
            Route("/stores/{store}/batch-get", ("POST",), _batch, "batch"),
        ]
    )


def test_the_data_plane_passes_named_callers_answers_and_every_401_by_caller() -> None:
    plane = Plane()
    for method, path in [
        ("GET", b"/stores/s/keys/web-200"),
        ("GET", b"/stores/s/keys/web-404"),
        ("GET", b"/stores/s/keys/anonymous-200"),  # a cluster without access control: not by caller
        ("GET", b"/stores/s/keys/anonymous-401"),  # no identity proven: counted under anonymous
        ("POST", b"/stores/t/batch-get"),  # counted by its handler per key, by caller once
    ]:
        plane.handle(StandInExchange(method, path))  # type: ignore[arg-type]
    assert plane.by_caller == [
        ("web", "s", 200),
        ("web", "s", 404),
        ("anonymous", "s", 401),
        ("batch", "t", 200),
    ]
    assert len(plane.counted) == 4  # the batch is counted by its handler, not here
