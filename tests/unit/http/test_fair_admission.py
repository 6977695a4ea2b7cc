"""Fair shedding: each named caller's share of a process's concurrency, once the caller is known
(`Admission.admit_caller`), and the data plane's place for it (`Call.admit_as`). Counts are driven directly:
no server, no sleeps."""

from __future__ import annotations

from typing import Any

import pytest

from keyroute.api import Overloaded
from keyroute.auth.access import ANONYMOUS, Identity
from keyroute.http.admission import Admission
from keyroute.http.dataplane import Call, RoutedDataPlane
from keyroute.http.routing import Route, RouteTable
from tests.unit.http.test_dataplane import StandInExchange, error_of


def admitted(admission: Admission, name: str) -> Overloaded | None:
    """One request of `name` through both steps, as the data plane takes them; its place kept on success."""
    refusal = admission.admit_head("/stores/", 0, [])
    if refusal is not None:
        return refusal  # type: ignore[return-value]
    refusal = admission.admit_caller(name)
    if refusal is not None:
        admission.release()
    return refusal


def test_a_caller_alone_keeps_the_reserve_free_and_a_newcomer_takes_it_while_the_flooder_is_shed() -> None:
    admission = Admission(max_concurrent_requests=16, retry_after_s=2)
    assert admission.reserve == 2
    for _ in range(14):
        assert admitted(admission, "batch") is None
    shed = admitted(admission, "batch")
    assert isinstance(shed, Overloaded) and shed.status == 503 and shed.code == "overloaded"
    assert shed.headers == {"Retry-After": "2"} and "'batch' has 14 requests in progress" in shed.message
    assert admission.active == 14 and admission.per_caller == {"batch": 14}
    # A second caller is under its share (14 places / 2 callers): it takes the reserve, the flooder is shed.
    assert admitted(admission, "web") is None
    assert isinstance(admitted(admission, "batch"), Overloaded)
    assert admitted(admission, "web") is None
    assert admission.active == 16 and admission.per_caller == {"batch": 14, "web": 2}
    # The process is full: everyone is refused by the process-wide limit, as before.
    assert isinstance(admitted(admission, "web"), Overloaded)
    assert (admission.overloaded, admission.shed_callers) == (3, 2)
    # As the flooder's requests end, it may take places again up to the reserve, then its share holds it.
    for _ in range(7):
        admission.release()
        admission.release_caller("batch")
    for _ in range(5):
        assert admitted(admission, "batch") is None
    assert admission.active == 14 and admission.per_caller == {"batch": 12, "web": 2}
    assert isinstance(admitted(admission, "batch"), Overloaded)  # saturated, and over 14 places / 2 callers
    assert admitted(admission, "web") is None


def test_a_caller_under_its_share_is_admitted_while_capacity_remains() -> None:
    admission = Admission(max_concurrent_requests=8)  # reserve 1: saturated from the 8th request on
    for name in ("a", "a", "a", "b", "b", "b", "c"):
        assert admitted(admission, name) is None
    # Saturated: the share is 7 places / 3 callers = 2; c holds 1, a and b hold 3.
    assert isinstance(admitted(admission, "a"), Overloaded)
    assert isinstance(admitted(admission, "b"), Overloaded)
    assert admitted(admission, "c") is None
    assert admission.active == 8


def test_a_configured_share_per_caller_applies_at_any_load_and_the_fair_one_below_it_under_load() -> None:
    admission = Admission(max_concurrent_requests=100, max_concurrent_per_caller=3)
    for _ in range(3):
        assert admitted(admission, "a") is None
    assert isinstance(admitted(admission, "a"), Overloaded)
    assert admitted(admission, "b") is None
    # Unlimited process, capped callers.
    admission = Admission(max_concurrent_requests=0, max_concurrent_per_caller=2)
    assert admission.reserve == 0
    assert [admitted(admission, "a") is None for _ in range(3)] == [True, True, False]
    # The fair share under load is the smaller one.
    admission = Admission(max_concurrent_requests=4, max_concurrent_per_caller=3)  # reserve 1
    for name in ("a", "a", "b"):
        assert admitted(admission, name) is None
    assert isinstance(admitted(admission, "a"), Overloaded)  # saturated: share 3 // 2 = 1 < 3


def test_counts_leave_nothing_behind_and_a_limit_of_one_has_no_reserve() -> None:
    admission = Admission(max_concurrent_requests=1)
    assert admission.reserve == 0
    assert admitted(admission, "a") is None
    assert isinstance(admitted(admission, "b"), Overloaded)  # the process-wide limit
    admission.release()
    admission.release_caller("a")
    assert admission.per_caller == {} and admission.active == 0 and admission.shed_callers == 0
    admission.release_caller("never")  # a name never counted: nothing to do
    assert admission.per_caller == {}


class Plane(RoutedDataPlane):
    """A handler that names its caller after the key (`anonymous` for ANONYMOUS) and answers later."""

    def __init__(self, admission: Admission) -> None:
        self.counted: list[tuple[str, str, int]] = []
        super().__init__(admission, lambda *c: self.counted.append(c))
        self.later: list[Call] = []

    def _key(self, call: Call, store: str, key: str) -> Any:
        refusal = call.admit_as(ANONYMOUS if key == "anonymous" else Identity(key))
        if refusal is not None:
            raise refusal
        self.later.append(call)

    routes = RouteTable([Route("/stores/{store}/keys/{key}", ("GET",), _key, "key")])


def handled(plane: Plane, path: bytes) -> StandInExchange:
    exchange = StandInExchange("GET", path)
    plane.handle(exchange)  # type: ignore[arg-type]
    return exchange


def test_the_data_plane_sheds_a_named_caller_over_its_share_and_gives_both_places_back_at_the_end() -> None:
    admission = Admission(max_concurrent_requests=4)  # reserve 1
    plane = Plane(admission)
    for _ in range(3):
        assert handled(plane, b"/stores/s/keys/batch").answers == []
    status, body, headers = error_of(handled(plane, b"/stores/s/keys/batch"))
    assert (status, body["error"], headers[b"retry-after"]) == (503, "overloaded", b"1")
    assert plane.counted == [("s", "key", 503)]  # a read refused: counted under its store
    assert handled(plane, b"/stores/s/keys/web").answers == []
    assert admission.active == 4 and admission.per_caller == {"batch": 3, "web": 1}
    assert [call.identity.name for call in plane.later] == ["batch"] * 3 + ["web"]
    plane.later[0].answer(200, [], b"")
    plane.later[3].answer(200, [], b"")
    assert admission.active == 2 and admission.per_caller == {"batch": 2}


@pytest.mark.parametrize("limit", [1, 4])
def test_anonymous_callers_are_admitted_as_before_up_to_the_whole_limit(limit: int) -> None:
    admission = Admission(max_concurrent_requests=limit)
    plane = Plane(admission)
    for _ in range(limit):
        assert handled(plane, b"/stores/s/keys/anonymous").answers == []
    status, body, _ = error_of(handled(plane, b"/stores/s/keys/anonymous"))
    assert (status, body["error"]) == (503, "overloaded")
    assert admission.per_caller == {} and admission.shed_callers == 0 and plane.counted == []
    for call in plane.later:
        call.answer(200, [], b"")
    assert admission.active == 0


class StandInCallers:
    """Access control as the data plane sees it (keyroute.http.authn.Callers.admit): the caller is the
    request's `x-caller` header."""

    def admit(self, call: Call, now: float) -> None:
        call.identity = Identity(call.request.header(b"x-caller").decode())


class CheckedPlane(RoutedDataPlane):
    """A key read (the table's fast route) and a batch-get (resolved by the table), both answered later."""

    def __init__(self, admission: Admission) -> None:
        super().__init__(admission, lambda *c: None)
        self.callers = StandInCallers()  # type: ignore[assignment]
        self.later: list[Call] = []

    def _key(self, call: Call, store: str, key: str) -> None:
        self.later.append(call)

    def _batch(self, call: Call, store: str) -> None:
        self.later.append(call)

    routes = RouteTable(
        [
            Route("/stores/{store}/keys/{key}", ("GET",), _key, "key"),
            Route("/stores/{store}/batch-get", ("POST",), _batch, "batch"),
        ]
    )


def test_with_access_control_every_route_takes_the_callers_share_once_it_is_identified() -> None:
    admission = Admission(max_concurrent_requests=4)  # reserve 1
    plane = CheckedPlane(admission)

    def send(method: str, path: bytes, caller: bytes) -> StandInExchange:
        exchange = StandInExchange(method, path)
        exchange.request.headers.append((b"x-caller", caller))
        plane.handle(exchange)  # type: ignore[arg-type]
        return exchange

    assert send("GET", b"/stores/s/keys/k", b"batch").answers == []
    assert send("POST", b"/stores/s/batch-get", b"batch").answers == []
    assert send("GET", b"/stores/s/keys/k", b"batch").answers == []
    status, body, _ = error_of(send("POST", b"/stores/s/batch-get", b"batch"))
    assert (status, body["error"]) == (503, "overloaded")
    assert send("POST", b"/stores/s/batch-get", b"web").answers == []
    assert admission.per_caller == {"batch": 3, "web": 1} and admission.active == 4
    for call in plane.later:
        call.answer(200, [], b"")
    assert admission.per_caller == {} and admission.active == 0
