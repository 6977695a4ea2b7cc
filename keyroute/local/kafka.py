"""Hold what a Kafka consumer is assigned: store partition p is topic partition p, so an application that
consumes a topic keyed like a store can hold exactly the store partitions of its own assignment."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from keyroute.local.replica import LocalReplica


def follow_assignment(
    replica: LocalReplica, store: str, topic: str | None = None
) -> dict[str, Callable[[Any, list[Any]], None]]:
    """`on_assign`, `on_revoke` and `on_lost` callbacks for confluent-kafka's `Consumer.subscribe` that keep
    `replica` holding the partitions of `store` the consumer is assigned (of `topic` only, when given), with
    either the eager or the cooperative protocol:

        consumer.subscribe(["bookings"], **follow_assignment(replica, "bookings"))
    """
    held: set[int] = set()

    def chosen(partitions: list[Any]) -> set[int]:
        return {tp.partition for tp in partitions if topic is None or tp.topic == topic}

    def on_assign(consumer: Any, partitions: list[Any]) -> None:
        eager = _eager(consumer)
        if eager:
            held.clear()
        held.update(chosen(partitions))
        replica.set_partitions(store, sorted(held))

    def on_revoke(consumer: Any, partitions: list[Any]) -> None:
        held.difference_update(chosen(partitions))
        # Eager: the whole assignment is revoked before every rebalance and mostly given back at once; the
        # partitions stay held until `on_assign` says which are not (no reload of what comes back).
        if not _eager(consumer):
            replica.set_partitions(store, sorted(held))

    def on_lost(consumer: Any, partitions: list[Any]) -> None:
        held.difference_update(chosen(partitions))
        replica.set_partitions(store, sorted(held))

    return {"on_assign": on_assign, "on_revoke": on_revoke, "on_lost": on_lost}


def _eager(consumer: Any) -> bool:
    """Whether the consumer's assignment is replaced whole on each rebalance (the eager protocol)."""
    try:
        return str(consumer.rebalance_protocol()).upper() != "COOPERATIVE"
    except Exception:  # not a confluent-kafka consumer: callbacks of the eager kind
        return True
