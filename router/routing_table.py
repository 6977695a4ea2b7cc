"""The router's routing view: the current partition map plus what is derived from it once per change.

Immutable and replaced whole (one attribute assignment) on every map update, so readers never lock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NoReturn

from keyroute.api import (
    ApiError,
    BadKey,
    NoPartitionMap,
    PartitionUnavailable,
    StoreNotFound,
    bad_batch_key,
)
from keyroute.cluster.partition_map import PartitionMap
from keyroute.keys.key_format import KeyFormatError
from keyroute.keys.key_location import Endpoint, KeyLocation, StoreLocator
from keyroute.runtime.native import caused


def _locators(partition_map: PartitionMap, names: Iterable[str]) -> dict[str, StoreLocator]:
    return {name: locator for name in names if (locator := StoreLocator.of_map(partition_map, name)) is not None}


@dataclass(frozen=True, slots=True)
class RoutingTable:
    """Says which nodes serve a key (`locate`) from one partition map, with no ZooKeeper call.

    `last_known` keeps, for a partition nobody serves in this map, the nodes that served it in an
    earlier one. They are asked before answering 503: a node whose ZooKeeper session expired (say,
    both replicas after a slow ZooKeeper restart) still holds its data and answers until it has
    registered again; one that really let go forwards the read or refuses it, as for any stale route.
    """

    map: PartitionMap
    # Precomputed: readiness probes ask often and `PartitionMap.complete` walks every partition.
    complete: bool
    last_known: Mapping[tuple[str, int], tuple[Endpoint, ...]] = field(default_factory=dict)
    # Stores every partition of which has been served at some point (in this map or an earlier one).
    ever_complete: frozenset[str] = frozenset()
    ready: bool = False
    # Per store, its keys' locations precomputed per partition; a store missing here (a malformed record)
    # is answered by `locate` with the error a read of it gets.
    reads: dict[str, StoreLocator] = field(default_factory=dict)
    # Stores whose every partition is served now.
    complete_stores: frozenset[str] = frozenset()

    @classmethod
    def of(cls, partition_map: PartitionMap, previous: RoutingTable | None = None) -> RoutingTable:
        """The table of `partition_map`. Derived from `previous` in proportion to the change when the map was
        derived from previous's map (its `delta` says which partitions may route differently), else whole."""
        delta = partition_map.delta
        if previous is not None and delta is not None and delta.parent == previous.map.seq:
            return cls._derived(partition_map, previous, delta.stores)
        last_known: dict[tuple[str, int], tuple[Endpoint, ...]] = {}
        if previous is not None:
            for name, store in partition_map.stores.items():
                before = previous.map.stores.get(name)
                if before is None or before.partitions != store.partitions:
                    continue
                for p, endpoints in enumerate(partition_map.routes.get(name, ())):
                    if not endpoints:
                        known = previous.map.serving_endpoints(name, p) or previous.last_known.get((name, p))
                        if known:
                            last_known[(name, p)] = known
        complete_now = frozenset(name for name in partition_map.stores if partition_map.store_complete(name))
        earlier = previous.ever_complete if previous is not None else frozenset()
        reads = _locators(partition_map, partition_map.stores)
        return cls._made(partition_map, last_known, earlier, reads, complete_now)

    @classmethod
    def _derived(
        cls, partition_map: PartitionMap, previous: RoutingTable, changed: Mapping[str, frozenset[int] | None]
    ) -> RoutingTable:
        before_map = previous.map
        touched = changed.keys() | (before_map.stores.keys() ^ partition_map.stores.keys())
        if not touched:
            return cls(
                partition_map,
                previous.complete,
                previous.last_known,
                previous.ever_complete,
                True,
                previous.reads,
                previous.complete_stores,
            )
        last_known = dict(previous.last_known)
        complete_now = set(previous.complete_stores)
        reads = dict(previous.reads)
        for name in touched:
            store = partition_map.stores.get(name)
            before = before_map.stores.get(name)
            if store is None or before is None or before.partitions != store.partitions:
                # Gone, new or reshaped: nothing known of its partitions carries over (as in a whole build).
                for key in [key for key in last_known if key[0] == name]:
                    del last_known[key]
            else:
                routes = partition_map.routes.get(name, ())
                partitions = changed.get(name)
                for p in range(len(routes)) if partitions is None else partitions:
                    if routes[p]:
                        last_known.pop((name, p), None)
                    elif known := before_map.serving_endpoints(name, p) or previous.last_known.get((name, p)):
                        last_known[(name, p)] = known
            if store is None:
                reads.pop(name, None)
                complete_now.discard(name)
                continue
            if partition_map.store_complete(name):
                complete_now.add(name)
            else:
                complete_now.discard(name)
            if (locator := StoreLocator.of_map(partition_map, name)) is not None:
                reads[name] = locator
            else:
                reads.pop(name, None)
        return cls._made(partition_map, last_known, previous.ever_complete, reads, frozenset(complete_now))

    @classmethod
    def _made(
        cls,
        partition_map: PartitionMap,
        last_known: dict[tuple[str, int], tuple[Endpoint, ...]],
        earlier: frozenset[str],
        reads: dict[str, StoreLocator],
        complete_now: frozenset[str],
    ) -> RoutingTable:
        ever = (earlier & frozenset(partition_map.stores)) | complete_now
        complete = bool(partition_map.stores) and len(complete_now) == len(partition_map.stores)
        # Ready means this router can proxy: it has a map (from ZooKeeper, or the last one while ZooKeeper is
        # away). A partition without a serving replica answers its own 503s; it never takes a router (and
        # with it every partition that could be served) out of the load balancer. Data health is a metric.
        return cls(partition_map, complete, MappingProxyType(last_known), ever, True, reads, complete_now)

    def last_known_endpoints(self, store: str, partition: int) -> tuple[Endpoint, ...]:
        return self.last_known.get((store, partition), ())

    @classmethod
    def empty(cls) -> RoutingTable:
        # Before the first read nothing is known, and that is stale by definition; nothing can be proxied.
        return dataclasses.replace(cls.of(PartitionMap.empty().marked_stale(True)), ready=False)

    @property
    def stale(self) -> bool:
        return self.map.stale

    @property
    def generation(self) -> int:
        return self.map.generation

    def has_store(self, store_name: str) -> bool:
        return store_name in self.map.stores

    def unknown_store(self, store_name: str) -> ApiError:
        """What a read of a store this map does not have answers: 404, or 503 before any map was read."""
        if not self.ready:
            return NoPartitionMap("this router has not read the partition map yet (is ZooKeeper reachable?)")
        return StoreNotFound.named(store_name, self.map.stores)

    def bad_batch_key(self, store_name: str, raw: object) -> ApiError:
        """The entry's error for a batch-get key that is no JSON form the store's keys take (1.5, null)."""
        store = self.map.stores.get(store_name)
        return bad_batch_key(store_name, store.key_format.value if store is not None else "string", raw)

    def locate(self, store_name: str, key_text: str) -> KeyLocation:
        """Where a key lives: its partition and the nodes assigned and serving it (preferred first; none
        serving is a location too). Raises StoreNotFound (NoPartitionMap before the first map), BadKey (the
        key does not fit the store's key format) or PartitionUnavailable (a store record with no partitions)."""
        locator = self.reads.get(store_name)
        if locator is None:
            self._unlocated(store_name)
        try:
            return locator.locate(key_text)
        except KeyFormatError as exc:
            raise caused(BadKey(str(exc)), exc)  # noqa: B904 (`from exc` loses the cause when compiled)

    def _unlocated(self, store_name: str) -> NoReturn:
        """Raise what a read of a store without a locator gets."""
        store = self.map.stores.get(store_name)
        if store is None:
            raise self.unknown_store(store_name)
        # A malformed store record would otherwise make the partitioner raise a bare ValueError.
        raise PartitionUnavailable(f"store {store_name!r} is published with {store.partitions} partitions")

    def serving_of(self, store_name: str, key_text: str) -> tuple[int, tuple[Endpoint, ...]]:
        """`locate`'s partition and serving nodes, without building the KeyLocation (a single-key read needs
        no more; `StoreLocator.serving_of`). Raises as `locate` does."""
        locator = self.reads.get(store_name)
        if locator is None:
            return self._unlocated(store_name)
        try:
            return locator.serving_of(key_text)
        except KeyFormatError as exc:
            raise caused(BadKey(str(exc)), exc)  # noqa: B904 (`from exc` loses the cause when compiled)
