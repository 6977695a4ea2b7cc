"""How a router groups one key's stores by the nodes that serve them (keyroute.router.multi_read.plan), on
routing tables built from hand-made partition maps: co-located stores make one group, whatever their order;
a store served elsewhere makes a group of its own; what cannot be read is an entry at once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from keyroute.cluster.partition_map import Assignment, NodeRecord, PartitionMap, ServingRecord, StoreRecord
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.router.multi_read import plan
from keyroute.router.routing_table import RoutingTable

NODES = ("a", "b", "c")


def store(name: str, partitions: int = 4, colocate_with: str | None = None) -> StoreRecord:
    return StoreRecord(
        name, partitions, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/nowhere", ("v",), 2, colocate_with=colocate_with
    )


@dataclass
class Metrics:
    unavailable: int = 0


@dataclass
class FakeProxy:
    """What `plan` asks of a `keyroute.router.proxy.Proxy`: its table, a partition's replicas in order."""

    table: RoutingTable
    metrics: Metrics = field(default_factory=Metrics)

    def serving(self, store: str, partition: int) -> Any:
        return self.table.map.serving_endpoints(store, partition)


def proxy(serving: dict[str, dict[str, dict[int, int]]], stores: list[StoreRecord]) -> FakeProxy:
    """A proxy whose map has `stores`, each node serving (store -> partition -> version) as given."""
    records = {s.name: s for s in stores}
    assignment = Assignment(1, {s.name: tuple(() for _ in range(s.partitions)) for s in stores})
    m = PartitionMap.build(
        records,
        {n: NodeRecord(n, f"http://{n}") for n in NODES},
        assignment,
        {n: ServingRecord(n, f"http://{n}", held) for n, held in serving.items()},
        generation=1,
    )
    return FakeProxy(RoutingTable.of(m, None))


KEY = "C042"
P = partition_for(Partitioner.MURMUR2, KEY.encode(), 4)
Q = partition_for(Partitioner.MURMUR2, KEY.encode(), 6)


def test_co_located_stores_make_one_group_with_the_replicas_serving_all() -> None:
    stores = [store("s"), store("t", colocate_with="s"), store("u", colocate_with="s")]
    # a and b serve partition P of all three; c serves P of s only.
    both = {P: 1}
    fake = proxy(
        {"a": {"s": both, "t": both, "u": both}, "b": {"s": both, "t": both, "u": both}, "c": {"s": both}}, stores
    )
    for order in (["s", "t", "u"], ["u", "s", "t"], ["t", "u"]):
        entries, groups = plan(fake, KEY, order)
        assert entries == {}
        (group,) = groups
        assert group.stores == tuple(order) and group.key == KEY
        assert sorted(ep.node_id for ep in group.replicas) == ["a", "b"]


def test_a_store_served_elsewhere_is_a_group_of_its_own() -> None:
    stores = [store("s"), store("t", colocate_with="s"), store("other", partitions=6)]
    fake = proxy({"a": {"s": {P: 1}, "t": {P: 1}}, "b": {"other": {Q: 1}}}, stores)
    entries, groups = plan(fake, KEY, ["s", "other", "t"])
    assert entries == {}
    assert [(g.stores, [ep.node_id for ep in g.replicas]) for g in groups] == [(("s", "t"), ["a"]), (("other",), ["b"])]


def test_what_cannot_be_read_is_an_entry_at_once() -> None:
    stores = [store("s"), store("t", colocate_with="s")]
    fake = proxy({"a": {"s": {P: 1}}}, stores)  # nobody serves partition P of t
    entries, groups = plan(fake, KEY, ["s", "nope", "t"])
    assert [g.stores for g in groups] == [("s",)]
    assert entries["nope"]["status"] == 404 and entries["nope"]["error"] == "store_not_found"
    assert entries["t"]["status"] == 503 and entries["t"]["error"] == "partition_unavailable"
    assert fake.metrics.unavailable == 1
