"""Balancer (least outstanding requests in flight), RetryBudget and LatencyQuantile: pure bookkeeping."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from keyroute.cluster.partition_map import Endpoint
from keyroute.router.backoff import NodeBackoff
from keyroute.router.balancer import Balancer, LatencyQuantile, RetryBudget

A, B, C, D = (Endpoint(n, f"http://{n}:1", 1) for n in "abcd")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class NoRandomness(random.Random):
    def random(self) -> float:
        raise AssertionError("no random draw was expected")


def firsts(balancer: Balancer, endpoints: tuple[Endpoint, ...], times: int) -> Counter[str]:
    return Counter(balancer.order(endpoints)[0].node_id for _ in range(times))


def load(balancer: Balancer, **in_flight: int) -> None:
    for node_id, count in in_flight.items():
        for _ in range(count):
            balancer.request_sent(f"http://{node_id}:1")


def test_every_order_holds_each_replica_exactly_once() -> None:
    balancer = Balancer(rng=random.Random(1))
    load(balancer, a=3, c=1)
    for endpoints in [(A,), (A, B), (A, B, C), (A, B, C, D)]:
        for _ in range(200):
            order = balancer.order(endpoints)
            assert sorted(ep.node_id for ep in order) == sorted(ep.node_id for ep in endpoints)


def test_one_replica_needs_no_randomness_and_nothing_is_no_replica() -> None:
    balancer = Balancer(rng=NoRandomness())
    assert balancer.order((A,)) == (A,)
    assert balancer.order(()) == ()


def test_of_two_replicas_the_one_with_fewer_requests_in_flight_always_leads() -> None:
    balancer = Balancer(rng=NoRandomness())  # a difference in load is decided without a draw
    load(balancer, a=2, b=1)
    assert balancer.order((A, B)) == (B, A)
    load(balancer, b=2)
    assert balancer.order((A, B)) == (A, B)


def test_the_least_loaded_of_any_number_of_replicas_always_leads() -> None:
    balancer = Balancer(rng=NoRandomness())  # no tie for the lightest nor the next: no draw
    load(balancer, a=5, b=1)  # c idle
    counts = firsts(balancer, (A, B, C), 3000)
    # `a` never leads; `c`, the idlest, always does (with two choices `b` led a third of the reads).
    assert counts["a"] == 0 and counts["b"] == 0
    assert counts["c"] == 3000
    load(balancer, c=3, d=2)
    assert balancer.order((A, B, C, D)) == (B, D, A, C)


def test_equal_load_is_spread_evenly() -> None:
    balancer = Balancer(rng=random.Random(7))
    two = firsts(balancer, (A, B), 4000)
    assert 1800 <= two["a"] <= 2200 and two["a"] + two["b"] == 4000
    three = firsts(balancer, (A, B, C), 3000)
    assert all(900 <= three[n] <= 1100 for n in "abc"), three


def test_in_flight_requests_spread_a_burst_over_the_replicas() -> None:
    # Reads that start before any answers: each one's request counts against its node for the next.
    balancer = Balancer(rng=random.Random(3))
    for _ in range(300):
        balancer.request_sent(balancer.order((A, B, C))[0].url)
    assert all(90 <= balancer.in_flight[ep.url] <= 110 for ep in (A, B, C)), balancer.in_flight


def test_the_next_lightest_comes_second_then_the_rest_in_map_order() -> None:
    balancer = Balancer(rng=random.Random(5))
    load(balancer, a=9, b=8, c=1, d=2)
    loads = {A: 9, B: 8, C: 1, D: 2}
    seconds: Counter[str] = Counter()
    for _ in range(2000):
        order = balancer.order((A, B, C, D))
        assert loads[order[0]] < loads[order[1]]  # lighter first
        rest = [ep for ep in (A, B, C, D) if ep not in order[:2]]
        assert list(order[2:]) == rest
        seconds[order[1].node_id] += 1
    # The lightest replica leads every read, so it is never the runner-up; the next lightest always is.
    assert seconds["c"] == 0 and seconds["d"] == 2000 and seconds["a"] == 0


def test_ties_for_the_lightest_and_the_next_are_drawn_evenly() -> None:
    balancer = Balancer(rng=random.Random(13))
    load(balancer, a=4, b=1, c=1, d=1)
    orders = Counter(balancer.order((A, B, C, D))[:2] for _ in range(6000))
    # b, c, d tie: each ordered pair of two of them equally often, `a` never among the first two.
    assert set(orders) == {(x, y) for x in (B, C, D) for y in (B, C, D) if x is not y}
    assert all(850 <= n <= 1150 for n in orders.values()), orders


def test_in_flight_counts_go_up_and_down_and_idle_nodes_leave_no_entry() -> None:
    balancer = Balancer()
    balancer.request_sent(A.url)
    balancer.request_sent(A.url)
    balancer.request_sent(B.url)
    assert balancer.in_flight == {A.url: 2, B.url: 1}
    balancer.request_ended(A.url)
    balancer.request_ended(B.url)
    assert balancer.in_flight == {A.url: 1}
    balancer.request_ended(A.url)
    balancer.request_ended(A.url)  # one too many (never happens) must not go negative
    assert balancer.in_flight == {}


def test_backed_off_replicas_go_last_whatever_their_load() -> None:
    clock = Clock()
    backoff = NodeBackoff(backoff_s=2.0, clock=clock)
    balancer = Balancer(backoff, random.Random(11))
    load(balancer, b=4, c=4)  # `a` is idle, but it just failed
    backoff.failed(A, "refused")
    for _ in range(200):
        order = balancer.order((A, B, C))
        assert order[-1] is A and set(order[:2]) == {B, C}
    assert balancer.order((A, B)) == (B, A)
    clock.now += 2.5  # back-off over: the idle replica leads again
    assert balancer.order((A, B)) == (A, B)


def test_when_every_replica_is_backed_off_all_are_still_tried_in_map_order() -> None:
    backoff = NodeBackoff(clock=Clock())
    balancer = Balancer(backoff, NoRandomness())
    backoff.failed(A, "refused")
    backoff.failed(B, "refused")
    assert balancer.order((A, B)) == (A, B)
    assert balancer.order((B, A)) == (B, A)


# -- the retry budget -------------------------------------------------------------------------------------


def test_a_fresh_budget_allows_its_burst_then_nothing_until_reads_refill_it() -> None:
    budget = RetryBudget(ratio=0.1, burst=3.0)
    assert [budget.try_spend() for _ in range(4)] == [True, True, True, False]
    for _ in range(9):
        budget.deposit()
    assert not budget.try_spend()  # 0.9 tokens: not a whole hedge
    budget.deposit()
    assert budget.try_spend()
    assert not budget.try_spend()


def test_deposits_stop_at_the_burst() -> None:
    budget = RetryBudget(ratio=0.5, burst=2.0)
    for _ in range(100):
        budget.deposit()
    assert budget.tokens == 2.0
    assert [budget.try_spend() for _ in range(3)] == [True, True, False]


def test_failovers_take_tokens_when_there_are_some_but_never_go_into_debt() -> None:
    budget = RetryBudget(ratio=0.1, burst=2.0)
    budget.spend_failover()
    assert budget.tokens == 1.0
    budget.spend_failover()
    budget.spend_failover()  # still sent (the method cannot refuse); the bucket is just empty
    assert budget.tokens == 0.0
    assert not budget.try_spend()


@pytest.mark.parametrize("ratio", [0.0, 0.05, 0.1, 0.25])
def test_hedges_never_exceed_the_ratio_of_primary_requests_plus_the_burst(ratio: float) -> None:
    budget = RetryBudget(ratio=ratio, burst=10.0)
    rng = random.Random(9)
    primaries = hedges = 0
    for _ in range(10_000):
        budget.deposit()
        primaries += 1
        if rng.random() < 0.6 and budget.try_spend():  # a slow node: most reads would like a hedge
            hedges += 1
    assert hedges <= ratio * primaries + 10
    assert hedges >= ratio * primaries - 1  # and the budget is really usable, not stuck


def test_a_negative_budget_is_refused() -> None:
    with pytest.raises(ValueError):
        RetryBudget(ratio=-0.1)


# -- the latency quantile ---------------------------------------------------------------------------------


def test_no_threshold_before_enough_samples() -> None:
    quantile = LatencyQuantile(recompute_every=64)
    for _ in range(63):
        quantile.record(0.01)
    assert quantile.value_s is None
    quantile.record(0.01)
    assert quantile.value_s == pytest.approx(0.01)


def test_the_quantile_of_recent_latencies() -> None:
    quantile = LatencyQuantile(0.95, window=1000, recompute_every=100)
    samples = [ms / 1000 for ms in range(1, 1001)]  # 1 ms .. 1000 ms
    random.Random(2).shuffle(samples)
    for s in samples:
        quantile.record(s)
    assert quantile.value_s == pytest.approx(0.951, abs=0.002)


def test_old_latencies_leave_the_window() -> None:
    quantile = LatencyQuantile(0.95, window=128, recompute_every=64, ceiling_s=10.0)
    for _ in range(128):
        quantile.record(0.5)
    assert quantile.value_s == pytest.approx(0.5)
    for _ in range(128):
        quantile.record(0.004)
    assert quantile.value_s == pytest.approx(0.004)


def test_the_threshold_is_clamped() -> None:
    fast = LatencyQuantile(recompute_every=8, window=8, floor_s=0.002, ceiling_s=1.0)
    slow = LatencyQuantile(recompute_every=8, window=8, floor_s=0.002, ceiling_s=1.0)
    for _ in range(8):
        fast.record(0.0001)
        slow.record(30.0)
    assert fast.value_s == 0.002 and slow.value_s == 1.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"quantile": 1.0},
        {"quantile": 0.0},
        {"floor_s": 0.0},
        {"floor_s": 2.0, "ceiling_s": 1.0},
        {"window": 0},
        {"window": 8, "recompute_every": 9},
    ],
)
def test_nonsense_quantile_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        LatencyQuantile(**kwargs)  # type: ignore[arg-type]
