"""The router's routing view: the current partition map plus what is derived from it once per change.

Immutable and replaced whole (one attribute assignment) on every map update, so readers never lock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from keyroute.core.api import ApiError, BadKey, NoPartitionMap, PartitionUnavailable, StoreNotFound
from keyroute.core.key_format import KeyFormat, KeyFormatError, parse_key
from keyroute.core.partition_map import Endpoint, KeyRoute, PartitionMap
from keyroute.core.partitioner import Partitioner, murmur2, partition_for

# What a single-key read needs of a store, derived once per map (`RoutingTable.locate`): its partition
# count, whether its keys are strings hashed with murmur2 (the common case, computed inline), its
# partitioner, and the endpoints serving each partition.
_StoreRoutes = tuple[int, bool, Partitioner, tuple[tuple[Endpoint, ...], ...]]


def _store_routes(partition_map: PartitionMap, name: str) -> _StoreRoutes | None:
    store = partition_map.stores[name]
    if not 1 <= store.partitions <= 0x7FFFFFFF:
        return None  # `resolve` raises what it must (Kafka's partition count is an int)
    routes = partition_map.routes.get(name, ())
    if len(routes) != store.partitions:
        routes = tuple(routes[p] if p < len(routes) else () for p in range(store.partitions))
    plain = store.key_format is KeyFormat.STRING and store.partitioner is Partitioner.MURMUR2
    return (store.partitions, plain, store.partitioner, routes)


@dataclass(frozen=True, slots=True)
class RoutingTable:
    """Answers "which nodes serve this key?" from one partition map, with no ZooKeeper call.

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
    # Per store, what `locate` needs (see _StoreRoutes); a store missing here is located by `resolve`.
    reads: Mapping[str, _StoreRoutes] = field(default_factory=dict)
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
        reads = {name: routes for name in partition_map.stores if (routes := _store_routes(partition_map, name))}
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
            if (entry := _store_routes(partition_map, name)) is not None:
                reads[name] = entry
            else:
                reads.pop(name, None)
        return cls._made(partition_map, last_known, previous.ever_complete, reads, frozenset(complete_now))

    @classmethod
    def _made(
        cls,
        partition_map: PartitionMap,
        last_known: dict[tuple[str, int], tuple[Endpoint, ...]],
        earlier: frozenset[str],
        reads: dict[str, _StoreRoutes],
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
        return StoreNotFound(f"no store named {store_name!r}")

    def resolve(self, store_name: str, key_text: str) -> KeyRoute:
        """The route of one key; raises StoreNotFound (NoPartitionMap before the first map) or BadKey (the key
        does not fit the store's format)."""
        store = self.map.stores.get(store_name)
        if store is None:
            raise self.unknown_store(store_name)
        try:
            key = parse_key(store.key_format, key_text)
        except KeyFormatError as exc:
            raise BadKey(str(exc)) from exc
        if store.partitions < 1:
            # A malformed store record would otherwise make the partitioner raise a bare ValueError.
            raise PartitionUnavailable(f"store {store_name!r} is published with no partitions")
        return self.map.route(store, key.data)

    def locate(self, store_name: str, key_text: str) -> tuple[int, tuple[Endpoint, ...]]:
        """(partition, serving endpoints) of one key: what `resolve` says of it, without building a KeyRoute
        (a single-key read needs no more). Raises as `resolve` does."""
        reads = self.reads.get(store_name)
        if reads is not None:
            partitions, plain, partitioner, serving = reads
            if plain:
                try:
                    data = key_text.encode("utf-8")
                except UnicodeEncodeError:
                    pass  # `resolve` says why
                else:
                    # Kafka's toPositive(murmur2(key)) % partitions, as `partition_for` computes it.
                    partition = (murmur2(data) & 0x7FFFFFFF) % partitions
                    return partition, serving[partition]
            else:
                store = self.map.stores[store_name]
                try:
                    key = parse_key(store.key_format, key_text)
                except KeyFormatError as exc:
                    raise BadKey(str(exc)) from exc
                partition = partition_for(partitioner, key.data, partitions)
                return partition, serving[partition]
        route = self.resolve(store_name, key_text)
        return route.partition, route.serving
