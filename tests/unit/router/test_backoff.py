"""NodeBackoff: a node that just failed is tried last for a while, never skipped."""

from __future__ import annotations

from keyroute.cluster.partition_map import Endpoint
from keyroute.router.backoff import NodeBackoff

A, B, C = (Endpoint(n, f"http://{n}:1", 1) for n in "abc")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_without_failures_the_map_order_is_kept_as_is() -> None:
    endpoints = (A, B, C)
    assert NodeBackoff().order(endpoints) is endpoints


def test_a_failed_node_goes_last_until_its_backoff_expires() -> None:
    clock = Clock()
    backoff = NodeBackoff(backoff_s=2.0, clock=clock)
    backoff.failed(A, "refused")
    assert backoff.order((A, B, C)) == (B, C, A)
    clock.now += 1.9
    assert backoff.order((A, B, C)) == (B, C, A)
    clock.now += 0.2
    assert backoff.order((A, B, C)) == (A, B, C)


def test_a_success_ends_the_backoff_at_once() -> None:
    backoff = NodeBackoff(clock=Clock())
    backoff.failed(B, "reset")
    assert backoff.order((A, B, C)) == (A, C, B)
    backoff.succeeded(B)
    assert backoff.order((A, B, C)) == (A, B, C)


def test_when_every_replica_failed_all_are_still_tried_in_map_order() -> None:
    backoff = NodeBackoff(clock=Clock())
    for ep in (A, B):
        backoff.failed(ep, "refused")
    assert backoff.order((A, B)) == (A, B)
    assert backoff.order((C, A, B)) == (C, A, B)
