"""The router's routing view: the current partition map plus what is derived from it once per change.

Immutable and replaced whole (one attribute assignment) on every map update, so readers never lock.
"""

from __future__ import annotations

from dataclasses import dataclass

from keyroute_core.api import BadKey, PartitionUnavailable, StoreNotFound
from keyroute_core.key_format import KeyFormatError, parse_key
from keyroute_core.partition_map import KeyRoute, PartitionMap


@dataclass(frozen=True, slots=True)
class RoutingTable:
    """Answers "which nodes serve this key?" from one partition map, with no ZooKeeper call."""

    map: PartitionMap
    # Precomputed: readiness probes ask often and `PartitionMap.complete` walks every partition.
    complete: bool

    @classmethod
    def of(cls, partition_map: PartitionMap) -> RoutingTable:
        return cls(map=partition_map, complete=partition_map.complete)

    @classmethod
    def empty(cls) -> RoutingTable:
        # Before the first read nothing is known, and that is stale by definition.
        return cls.of(PartitionMap.empty().marked_stale(True))

    @property
    def stale(self) -> bool:
        return self.map.stale

    @property
    def generation(self) -> int:
        return self.map.generation

    def has_store(self, store_name: str) -> bool:
        return store_name in self.map.stores

    def resolve(self, store_name: str, key_text: str) -> KeyRoute:
        """The route of one key; raises StoreNotFound or BadKey (the key does not fit the store's format)."""
        store = self.map.stores.get(store_name)
        if store is None:
            raise StoreNotFound(f"no store named {store_name!r}")
        try:
            key = parse_key(store.key_format, key_text)
        except KeyFormatError as exc:
            raise BadKey(str(exc)) from exc
        if store.partitions < 1:
            # A malformed store record would otherwise make the partitioner raise a bare ValueError.
            raise PartitionUnavailable(f"store {store_name!r} is published with no partitions")
        return self.map.route(store, key.data)
