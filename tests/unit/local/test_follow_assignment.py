"""keyroute.local.follow_assignment: the partitions a consumer is assigned are the ones the replica holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from keyroute.local import follow_assignment


@dataclass(frozen=True)
class TopicPartition:
    topic: str
    partition: int


class Consumer:
    def __init__(self, protocol: str) -> None:
        self.protocol = protocol

    def rebalance_protocol(self) -> str:
        return self.protocol


class Replica:
    def __init__(self) -> None:
        self.held: dict[str, list[int] | None] = {}

    def set_partitions(self, store: str, partitions: Any) -> None:
        self.held[store] = list(partitions)


def test_an_eager_assignment_replaces_the_held_partitions_without_letting_go_in_between() -> None:
    replica = Replica()
    callbacks = follow_assignment(replica, "bookings", topic="bookings")  # type: ignore[arg-type]
    consumer = Consumer("EAGER")
    callbacks["on_assign"](consumer, [TopicPartition("bookings", 3), TopicPartition("bookings", 1)])
    assert replica.held == {"bookings": [1, 3]}
    callbacks["on_revoke"](consumer, [TopicPartition("bookings", 3), TopicPartition("bookings", 1)])
    assert replica.held == {"bookings": [1, 3]}  # held until the next assignment says what goes
    callbacks["on_assign"](consumer, [TopicPartition("bookings", 0), TopicPartition("other", 5)])
    assert replica.held == {"bookings": [0]}


def test_a_cooperative_assignment_adds_and_takes_away_increments() -> None:
    replica = Replica()
    callbacks = follow_assignment(replica, "bookings")  # type: ignore[arg-type]
    consumer = Consumer("COOPERATIVE")
    callbacks["on_assign"](consumer, [TopicPartition("bookings", 0), TopicPartition("bookings", 2)])
    callbacks["on_assign"](consumer, [TopicPartition("bookings", 5)])
    assert replica.held == {"bookings": [0, 2, 5]}
    callbacks["on_lost"](consumer, [TopicPartition("bookings", 2)])
    assert replica.held == {"bookings": [0, 5]}
