"""The partition map: stores, nodes, desired placement (assignment) and actual placement (serving).

Every record is a frozen value serialised as JSON in ZooKeeper. `PartitionMap` joins them into one
immutable snapshot with routes precomputed, replaced whole whenever ZooKeeper changes; readers never lock.
`MapBuilder` derives each new snapshot from the last one: a change recomputes only the routes it touches
(one node's serving record: that node's partitions), and says which in `PartitionMap.delta`, so what is
derived from a map downstream (a router's routing table) can follow in proportion to the change too.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from keyroute.cluster.colocation import colocation_groups
from keyroute.keys.key_format import Key, KeyFormat
from keyroute.keys.key_location import Endpoint, KeyLocation, StoreLocator
from keyroute.keys.key_schema import KeySchema
from keyroute.keys.partitioner import Partitioner
from keyroute.storage.timeline import Timeline
from keyroute.storage.ttl import Ttl

# `PartitionMap.locator`'s mark of a store whose locator is not made yet (None is a locator: none usable).
_UNKNOWN: Any = object()

__all__ = [
    "EMPTY_ASSIGNMENT",
    "PARTITION_STATES",
    "Assignment",
    "Endpoint",
    "KeyLocation",
    "MapBuilder",
    "MapDelta",
    "NodeRecord",
    "PartitionMap",
    "RecordError",
    "ServingRecord",
    "StoreRecord",
]


# What the operator's views say of one partition (`PartitionMap.partition_state`), worst first.
UNSERVED = "unserved"
LOADING = "loading"
UNDER_REPLICATED = "under_replicated"
SERVED = "served"
PARTITION_STATES = (UNSERVED, LOADING, UNDER_REPLICATED, SERVED)


class RecordError(ValueError):
    """A record in ZooKeeper could not be decoded."""


def json_object(raw: bytes, what: str, error: type[Exception] = RecordError) -> dict[str, Any]:
    """The JSON object a record (or a file) holds: `error`, in one line naming `what`, when `raw` is not
    UTF-8 JSON or not an object. Every record of ours is one object, read by this."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{what}: not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise error(f"{what}: expected a JSON object")
    return obj


def _dump(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8")


@dataclass(frozen=True, slots=True)
class StoreRecord:
    """A store as published by the pipeline: its shape and the version nodes should serve.

    `retained` maps every version that may still be rolled back to (the current one included) to its
    snapshot directory; the pipeline keeps the last N there, `keyroute store rollback` picks from it.
    `live`: the store follows a Kafka topic (its versions' manifests say which and from which offsets).
    """

    name: str
    partitions: int
    partitioner: Partitioner
    key_format: KeyFormat
    version: int
    snapshot: str
    value_columns: tuple[str, ...] = ()
    replication_factor: int = 1
    published_at: float = 0.0
    retained: Mapping[int, str] = field(default_factory=dict)
    live: bool = False
    # History and windowed stores (keyroute.storage.timeline); None for a store of one value per key.
    timeline: Timeline | None = None
    # Schema Registry keys (key_format avro/protobuf/json_schema): the key schema (id and text) every reader
    # serializes keys with, so none asks the registry on the read path.
    key_schema: KeySchema | None = None
    # How old a value (history row) may be and still be served (keyroute.storage.ttl); None: forever.
    ttl: Ttl | None = None
    # The store this one is co-located with: partition p of both on the same replicas (a co-location group).
    colocate_with: str | None = None

    @property
    def retained_versions(self) -> tuple[int, ...]:
        """Versions that can be made current again, oldest first (the current one always among them)."""
        return tuple(sorted({*self.retained, self.version}))

    def snapshot_of(self, version: int) -> str | None:
        if version == self.version:
            return self.snapshot
        return self.retained.get(version)

    def to_json(self) -> bytes:
        return _dump(
            {
                "name": self.name,
                "partitions": self.partitions,
                "partitioner": self.partitioner.value,
                "key_format": self.key_format.value,
                "version": self.version,
                "snapshot": self.snapshot,
                "value_columns": list(self.value_columns),
                "replication_factor": self.replication_factor,
                "published_at": self.published_at,
                "retained": {str(v): path for v, path in sorted(self.retained.items())},
                "live": self.live,
                **({} if self.timeline is None else {"timeline": self.timeline.to_dict()}),
                **({} if self.key_schema is None else {"key_schema": self.key_schema.to_dict()}),
                **({} if self.ttl is None else {"ttl": self.ttl.to_dict()}),
                **({} if self.colocate_with is None else {"colocate_with": self.colocate_with}),
            }
        )

    @classmethod
    def from_json(cls, raw: bytes) -> StoreRecord:
        obj = json_object(raw, "store record")
        try:
            live = obj.get("live", False)
            if not isinstance(live, bool):
                raise ValueError(f"'live' must be true or false, got {live!r}")
            record = cls(
                name=str(obj["name"]),
                partitions=int(obj["partitions"]),
                partitioner=Partitioner(obj["partitioner"]),
                key_format=KeyFormat(obj["key_format"]),
                version=int(obj["version"]),
                snapshot=str(obj["snapshot"]),
                value_columns=tuple(obj.get("value_columns", ())),
                replication_factor=int(obj.get("replication_factor", 1)),
                published_at=float(obj.get("published_at", 0.0)),
                retained={int(v): str(path) for v, path in dict(obj.get("retained", {})).items()},
                live=live,
                timeline=None if obj.get("timeline") is None else Timeline.from_dict(obj["timeline"]),
                key_schema=None if obj.get("key_schema") is None else KeySchema.from_dict(obj["key_schema"]),
                ttl=None if obj.get("ttl") is None else Ttl.from_dict(obj["ttl"]),
                colocate_with=None if obj.get("colocate_with") is None else str(obj["colocate_with"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RecordError(f"store record: {exc!r}") from exc
        if record.partitions < 1 or record.version < 1 or record.replication_factor < 1:
            raise RecordError(
                f"store record {record.name!r}: partitions, version and replication factor must be >= 1"
            )
        if any(v < 1 for v in record.retained):
            raise RecordError(f"store record {record.name!r}: retained versions must be >= 1")
        return record


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """A live state node (ephemeral): its id, the URL it advertises, and whether it is leaving.

    A leaving node (SIGTERM received) still serves what it holds, but the controller assigns it nothing:
    its partitions move to other nodes, then it de-announces and exits.
    """

    node_id: str
    url: str
    leaving: bool = False
    # The failure domain (availability zone, rack) the node runs in; "" = none given. The controller puts a
    # partition's replicas in different zones when it can.
    zone: str = ""
    # What its data directory held when it registered: (store, version, partitions) with complete files. A
    # placement hint: a replica the controller must place goes to a node that holds it when it can.
    holds: tuple[tuple[str, int, tuple[int, ...]], ...] = ()

    def to_json(self) -> bytes:
        record: dict[str, object] = {"node_id": self.node_id, "url": self.url, "leaving": self.leaving}
        if self.zone:
            record["zone"] = self.zone
        if self.holds:
            held: dict[str, dict[str, list[int]]] = {}
            for store, version, partitions in self.holds:
                held.setdefault(store, {})[str(version)] = sorted(partitions)
            record["holds"] = held
        return _dump(record)

    def held_at(self, store: str, version: int) -> tuple[int, ...]:
        """The partitions of `store` at `version` this node's data directory held when it registered."""
        for name, held_version, partitions in self.holds:
            if name == store and held_version == version:
                return partitions
        return ()

    @classmethod
    def from_json(cls, raw: bytes) -> NodeRecord:
        obj = json_object(raw, "node record")
        try:
            zone = obj.get("zone")
            return cls(
                node_id=str(obj["node_id"]),
                url=str(obj["url"]),
                leaving=obj.get("leaving") is True,
                zone=zone if isinstance(zone, str) else "",
                holds=_holds(obj.get("holds")),
            )
        except KeyError as exc:
            raise RecordError(f"node record: missing {exc}") from exc


@dataclass(frozen=True, slots=True)
class Assignment:
    """Desired placement, written by the controller: replicas per partition per store.

    `stores[store][p]` lists the node ids that should serve partition p, preferred replica first.
    `generation` is the assignment generation: the controller raises it by one on every write (it is not
    the map generation).
    """

    generation: int
    stores: Mapping[str, tuple[tuple[str, ...], ...]] = field(default_factory=dict)
    # Per store, each node's partitions there: built on first use, as the same assignment is asked again
    # on every map until the controller writes a new one (a map changes far more often than the assignment).
    _by_node: dict[str, dict[str, frozenset[int]]] = field(default_factory=dict, compare=False, repr=False)

    def replicas(self, store: str, partition: int) -> tuple[str, ...]:
        per_partition = self.stores.get(store, ())
        return per_partition[partition] if partition < len(per_partition) else ()

    def partitions_of(self, node_id: str) -> dict[str, frozenset[int]]:
        owned: dict[str, frozenset[int]] = {}
        for store, per_partition in self.stores.items():
            index = self._by_node.get(store)
            if index is None:
                collected: dict[str, set[int]] = {}
                for p, nodes in enumerate(per_partition):
                    for n in nodes:
                        collected.setdefault(n, set()).add(p)
                index = {n: frozenset(ps) for n, ps in collected.items()}
                self._by_node[store] = index  # a race only builds the same index twice
            mine = index.get(node_id)
            if mine:
                owned[store] = mine
        return owned

    def to_json(self) -> bytes:
        return _dump(
            {
                "generation": self.generation,
                "stores": {s: [list(r) for r in reps] for s, reps in self.stores.items()},
            }
        )

    @classmethod
    def from_json(cls, raw: bytes) -> Assignment:
        obj = json_object(raw, "assignment")
        try:
            stores = {
                str(s): tuple(tuple(str(n) for n in reps) for reps in per_partition)
                for s, per_partition in dict(obj.get("stores", {})).items()
            }
            return cls(generation=int(obj["generation"]), stores=stores)
        except (KeyError, TypeError, ValueError) as exc:
            raise RecordError(f"assignment: {exc!r}") from exc


EMPTY_ASSIGNMENT = Assignment(generation=0)


@dataclass(frozen=True, slots=True)
class ServingRecord:
    """Actual placement (ephemeral): the partitions a node has loaded and serves, with versions."""

    node_id: str
    url: str
    stores: Mapping[str, Mapping[int, int]] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return _dump(
            {
                "node_id": self.node_id,
                "url": self.url,
                "stores": {
                    s: {str(p): v for p, v in sorted(parts.items())} for s, parts in self.stores.items()
                },
            }
        )

    @classmethod
    def from_json(cls, raw: bytes) -> ServingRecord:
        obj = json_object(raw, "serving record")
        try:
            stores = {
                str(s): {int(p): int(v) for p, v in dict(parts).items()}
                for s, parts in dict(obj.get("stores", {})).items()
            }
            return cls(node_id=str(obj["node_id"]), url=str(obj["url"]), stores=stores)
        except (KeyError, TypeError, ValueError) as exc:
            raise RecordError(f"serving record: {exc!r}") from exc


@dataclass(frozen=True, slots=True)
class PartitionMap:
    """One consistent snapshot of the cluster, built from ZooKeeper records.

    `generation` is the map generation: the highest ZooKeeper modification id among the records read, so
    two maps can be ordered across processes (answers carry it in X-Keyroute-Generation); the assignment
    has its own, `assignment.generation`. `routes[store][p]` is precomputed: the endpoints serving
    partition p of the version chosen by `_routable`, so the hot path is two index lookups.
    """

    stores: Mapping[str, StoreRecord]
    nodes: Mapping[str, NodeRecord]
    assignment: Assignment
    serving: Mapping[str, ServingRecord]
    generation: int = 0
    built_at: float = 0.0
    stale: bool = False
    routes: Mapping[str, tuple[tuple[Endpoint, ...], ...]] = field(default_factory=dict)
    # Stores with a tombstone (/deleted/{store}, `keyroute store delete`), each with the highest version it
    # deleted: only those versions may be dropped (see `deletes`).
    deleted: Mapping[str, int] = field(default_factory=dict)
    # Stores whose record vanished from ZooKeeper without a tombstone: their last record read is kept in
    # `stores` (absence is not deletion), so reads still route and nodes keep what they hold.
    orphaned: frozenset[str] = frozenset()
    # Identifies this map within the process; `delta` (None: built from scratch) names the map it was
    # derived from and what may route differently since.
    seq: int = field(default_factory=lambda: next(_SEQ), compare=False)
    delta: MapDelta | None = field(default=None, compare=False)
    _memo: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(
        cls,
        stores: Mapping[str, StoreRecord],
        nodes: Mapping[str, NodeRecord],
        assignment: Assignment,
        serving: Mapping[str, ServingRecord],
        generation: int = 0,
        built_at: float | None = None,
    ) -> PartitionMap:
        builder = MapBuilder()
        for name, store in stores.items():
            builder.set_store(name, store)
        for node_id, node in nodes.items():
            builder.set_node(node_id, node)
        for node_id, record in serving.items():
            builder.set_serving(node_id, record)
        builder.set_assignment(assignment)
        return builder.build(generation, built_at)

    @classmethod
    def empty(cls) -> PartitionMap:
        return cls.build({}, {}, EMPTY_ASSIGNMENT, {})

    def marked_stale(self, stale: bool) -> PartitionMap:
        """The same map, saying whether it may be out of date (derived from this one: nothing routes differently)."""
        if stale == self.stale:
            return self
        return PartitionMap(
            self.stores,
            self.nodes,
            self.assignment,
            self.serving,
            self.generation,
            self.built_at,
            stale,
            self.routes,
            self.deleted,
            self.orphaned,
            delta=MapDelta(self.seq, MappingProxyType({})),
        )

    def deletes(self, store: str, version: int) -> bool:
        """Whether the store's tombstone covers `version` (a version published after the deletion is not)."""
        return version <= self.deleted.get(store, 0)

    def serving_endpoints(self, store: str, partition: int) -> tuple[Endpoint, ...]:
        per_partition = self.routes.get(store, ())
        return per_partition[partition] if 0 <= partition < len(per_partition) else ()

    def locate(self, store: StoreRecord, key: Key) -> KeyLocation:
        """Where `key` (parsed in the store's key format) of `store` lives in this map: its store's locator's
        answer (`StoreLocator.locate_key`). Raises ValueError for a store record without a usable partition
        count."""
        if self.stores.get(store.name) is store:
            locator = self.locator(store.name)
        else:  # a record this map does not hold (a store not published yet): its locator, made now
            locator = StoreLocator.of_record(self, store)
        if locator is None:
            raise ValueError(f"store {store.name!r} is published with {store.partitions} partitions")
        return locator.locate_key(key)

    def locator(self, name: str) -> StoreLocator | None:
        """What locates the keys of store `name` in this map, made once per map (None: its record has no
        usable partition count)."""
        locators: dict[str, StoreLocator | None] | None = self._memo.get("locators")
        if locators is None:
            locators = self._memo["locators"] = {}
        locator = locators.get(name, _UNKNOWN)
        if locator is _UNKNOWN:
            locator = locators[name] = StoreLocator.of_map(self, name)
        return locator

    def live_nodes(self) -> frozenset[str]:
        """Registered nodes that are not leaving: the ones the controller assigns partitions to."""
        live = self._memo.get("live_nodes")
        if live is None:
            live = self._memo["live_nodes"] = frozenset(n for n, record in self.nodes.items() if not record.leaving)
        return live

    def served_elsewhere(self, store: str, partition: int, node_id: str) -> bool:
        """Whether every live node assigned the partition (other than `node_id`, and at least one) serves
        it at the store's published version: what a node must see before it lets go of a partition it
        is not assigned (make before break).

        Only assigned holders count. When a partition moves from {A, B} to {C, D}, A and B each see
        the other still serving it; were that enough, both would let go before C or D had loaded it.
        And all of them: when it moves from {A, B} to {B, C}, A keeps it until C serves it too, so the
        partition never has fewer copies than its replication factor asks for (B may crash meanwhile)."""
        record = self.stores.get(store)
        if record is None:
            return True
        live = self.live_nodes()
        holders = [n for n in self.assignment.replicas(store, partition) if n != node_id and n in live]
        return bool(holders) and all(
            n in self.serving and self.serving[n].stores.get(store, {}).get(partition) == record.version
            for n in holders
        )

    @property
    def complete(self) -> bool:
        """Every partition of every store is served by at least one node."""
        return bool(self.stores) and all(self.store_complete(name) for name in self.stores)

    def store_complete(self, name: str) -> bool:
        """Every partition of the store is served by at least one node."""
        store = self.stores.get(name)
        routes = self.routes.get(name, ())
        return store is not None and len(routes) == store.partitions and all(routes)

    def partition_state(self, store: str, partition: int) -> str:
        """One partition as the operator's views count it: `unserved` (nobody serves it), `loading` (served,
        but not at the store's published version: a new version is loading or a rollback is under way),
        `under_replicated` (served at the published version by fewer nodes than the replication factor
        asks for) or `served`."""
        record = self.stores[store]
        endpoints = self.serving_endpoints(store, partition)
        return _state_of(endpoints, record.version, record.replication_factor)

    def store_states(self, store: str) -> dict[str, int]:
        """How many partitions of the store are in each state of `PARTITION_STATES` (all of them named)."""
        record = self.stores[store]
        counts = dict.fromkeys(PARTITION_STATES, 0)
        version, rf = record.version, record.replication_factor
        routes = self.routes.get(store, ())
        for p in range(record.partitions):
            counts[_state_of(routes[p] if p < len(routes) else (), version, rf)] += 1
        return counts

    def describe(self, now: float | None = None, assignment: Assignment | None = None) -> dict[str, Any]:
        """The operator's view served at /admin/partition-map (with `assignment`, that one's replicas: a
        node's map holds only its own share)."""
        now = time.time() if now is None else now
        assignment = self.assignment if assignment is None else assignment
        groups = colocation_groups({name: store.colocate_with for name, store in self.stores.items()})
        return {
            "generation": self.generation,
            "assignment_generation": assignment.generation,
            "age_s": round(max(0.0, now - self.built_at), 3),
            "stale": self.stale,
            "complete": self.complete,
            "nodes": {
                node_id: {
                    "url": record.url,
                    "leaving": record.leaving,
                    "zone": record.zone or None,
                    "serving": {
                        s: len(parts) for s, parts in self.serving[node_id].stores.items()
                    }
                    if node_id in self.serving
                    else {},
                }
                for node_id, record in sorted(self.nodes.items())
            },
            "stores": {
                name: {
                    "partitions": store.partitions,
                    "partitioner": store.partitioner.value,
                    "key_format": store.key_format.value,
                    **({} if store.key_schema is None else {"key_schema": store.key_schema.to_dict()}),
                    "version": store.version,
                    "replication_factor": store.replication_factor,
                    "value_columns": list(store.value_columns),
                    "published_at": store.published_at,
                    "retained_versions": list(store.retained_versions),
                    **({} if store.timeline is None else {"timeline": store.timeline.to_dict()}),
                    **({} if store.ttl is None else {"ttl": store.ttl.text}),
                    **({} if store.colocate_with is None else {"colocate_with": store.colocate_with}),
                    **({"colocation_group": groups[name]} if name in groups else {}),
                    # Its record is gone from ZooKeeper without a tombstone: this is the last one read.
                    **({"orphaned": True} if name in self.orphaned else {}),
                    "partition_map": [
                        {
                            "partition": p,
                            "assigned": list(assignment.replicas(name, p)),
                            "serving": [
                                {"node": ep.node_id, "url": ep.url, "version": ep.version}
                                for ep in self.serving_endpoints(name, p)
                            ],
                        }
                        for p in range(store.partitions)
                    ],
                }
                for name, store in sorted(self.stores.items())
            },
        }


_SEQ: itertools.count[int] = itertools.count(1)


def _state_of(endpoints: tuple[Endpoint, ...], version: int, replication_factor: int) -> str:
    # Routes hold one version per partition (see `_routable`): the first endpoint's is every one's.
    if not endpoints:
        return UNSERVED
    if endpoints[0].version != version:
        return LOADING
    return UNDER_REPLICATED if len(endpoints) < replication_factor else SERVED


@dataclass(frozen=True, slots=True)
class MapDelta:
    """What may route differently in a map than in the map it was derived from (`parent`, a `seq`).

    `stores[name]` is the set of partitions of that store whose routes were recomputed, or None when the
    whole store was (its record came, went or changed shape or version). A store not named kept its routes
    (the very same tuples). Records that do not route (a node's zone, a store's retained versions) may have
    changed without a mention here."""

    parent: int
    stores: Mapping[str, frozenset[int] | None]


class MapBuilder:
    """The records of one cluster, and the routes they give, kept up to date one record at a time.

    `build()` returns an immutable `PartitionMap`; the next `build()` recomputes only the routes of the
    partitions whose holders, assigned replicas, store version or shape changed since the last one: a
    change to one node's serving record costs in proportion to that node's partitions, not the cluster.
    Not thread-safe: one thread (the map watcher's) owns a builder.
    """

    def __init__(self) -> None:
        self._stores: dict[str, StoreRecord] = {}
        self._nodes: dict[str, NodeRecord] = {}
        self._serving: dict[str, ServingRecord] = {}
        self._assignment = EMPTY_ASSIGNMENT
        # holders[store][partition][node_id]: the endpoint of each node holding the partition (any store
        # name and partition a node announces: a store record may come or grow later).
        self._holders: dict[str, dict[int, dict[str, Endpoint]]] = {}
        self._endpoints: dict[str, dict[int, Endpoint]] = {}  # one Endpoint per node and version
        self._routes: dict[str, tuple[tuple[Endpoint, ...], ...]] = {}
        self._dirty: dict[str, set[int] | None] = {}
        self._last: PartitionMap | None = None
        self._deleted: Mapping[str, int] = MappingProxyType({})
        self._orphaned: set[str] = set()

    @property
    def stores(self) -> Mapping[str, StoreRecord]:
        return self._stores

    @property
    def nodes(self) -> Mapping[str, NodeRecord]:
        return self._nodes

    @property
    def serving(self) -> Mapping[str, ServingRecord]:
        return self._serving

    @property
    def assignment(self) -> Assignment:
        return self._assignment

    def _touch(self, store: str, partition: int | None) -> None:
        """Mark a partition's routes (None: the whole store's) to be recomputed by the next build."""
        if store not in self._dirty:
            self._dirty[store] = None if partition is None else {partition}
            return
        dirty = self._dirty[store]
        if dirty is None:
            return
        if partition is None:
            self._dirty[store] = None
        else:
            dirty.add(partition)

    def set_store(self, name: str, record: StoreRecord | None, *, keep: bool = False) -> None:
        """A store's record as read (None: gone). With `keep`, a record that is gone while the store has no
        tombstone covering its version stays in the map as last read, marked orphaned, until such a tombstone
        or a new record comes."""
        old = self._stores.get(name)
        if record is None:
            if old is None:
                return
            if keep and old.version > self._deleted.get(name, 0):
                self._orphaned.add(name)
                return
            self._orphaned.discard(name)
            del self._stores[name]
            self._touch(name, None)
            return
        self._orphaned.discard(name)
        self._stores[name] = record
        if (
            old is None
            or old.partitions != record.partitions
            or old.version != record.version
            or old.partitioner != record.partitioner
            or old.key_format != record.key_format
            or old.key_schema != record.key_schema
        ):
            self._touch(name, None)

    @property
    def orphaned(self) -> frozenset[str]:
        return frozenset(self._orphaned)

    def set_deleted(self, deleted: Mapping[str, int]) -> None:
        """The stores with a tombstone, each with the highest version it deleted; an orphaned record at a
        version one of them covers goes now."""
        self._deleted = MappingProxyType(dict(deleted))
        for name in sorted(self._orphaned):
            if self._stores[name].version <= self._deleted.get(name, 0):
                self.set_store(name, None)

    def set_node(self, node_id: str, record: NodeRecord | None) -> None:
        if record is None:
            self._nodes.pop(node_id, None)
        else:
            self._nodes[node_id] = record

    def set_serving(self, node_id: str, record: ServingRecord | None) -> None:
        old = self._serving.get(node_id)
        if record is None:
            if old is not None:
                del self._serving[node_id]
                self._drop_holder(old, old.stores)
                self._endpoints.pop(node_id, None)
            return
        self._serving[node_id] = record
        if old is None or old.url != record.url or old.node_id != record.node_id:
            if old is not None:
                self._drop_holder(old, old.stores)
                self._endpoints.pop(node_id, None)
            self._add_holder(record, record.stores)
            return
        if old.stores == record.stores:
            return
        for name in old.stores.keys() | record.stores.keys():
            before = old.stores.get(name, {})
            after = record.stores.get(name, {})
            if before == after:
                continue
            gone = {p: v for p, v in before.items() if after.get(p) != v}
            came = {p: v for p, v in after.items() if before.get(p) != v}
            self._drop_holder(old, {name: gone})
            self._add_holder(record, {name: came})

    def _drop_holder(self, record: ServingRecord, stores: Mapping[str, Mapping[int, int]]) -> None:
        for name, partitions in stores.items():
            per_store = self._holders.get(name)
            if per_store is None:
                continue
            for partition in partitions:
                held = per_store.get(partition)
                if held is not None and held.pop(record.node_id, None) is not None:
                    if not held:
                        del per_store[partition]
                    self._touch(name, partition)
            if not per_store:
                del self._holders[name]

    def _add_holder(self, record: ServingRecord, stores: Mapping[str, Mapping[int, int]]) -> None:
        endpoints = self._endpoints.setdefault(record.node_id, {})
        node_id = record.node_id
        for name, partitions in stores.items():
            if not partitions:
                continue
            per_store = self._holders.setdefault(name, {})
            for partition, version in partitions.items():
                if partition < 0:
                    continue
                ep = endpoints.get(version)
                if ep is None:
                    ep = endpoints[version] = Endpoint(node_id, record.url, version)
                held = per_store.get(partition)
                if held is None:
                    per_store[partition] = {node_id: ep}
                else:
                    held[node_id] = ep
                self._touch(name, partition)

    def set_assignment(self, assignment: Assignment) -> None:
        old = self._assignment
        self._assignment = assignment
        if old is assignment:
            return
        for name in old.stores.keys() | assignment.stores.keys():
            before = old.stores.get(name, ())
            after = assignment.stores.get(name, ())
            if before is after:
                continue
            if len(before) != len(after):
                self._touch(name, None)
                continue
            for p, (was, now) in enumerate(zip(before, after, strict=True)):
                if was != now:
                    self._touch(name, p)

    def build(self, generation: int = 0, built_at: float | None = None) -> PartitionMap:
        """The map of the records as they are now, at map generation `generation` (derived from the last
        one built: see MapDelta)."""
        routes = self._routes
        changed: dict[str, frozenset[int] | None] = {}
        for name, dirty in self._dirty.items():
            store = self._stores.get(name)
            if store is None:
                if routes.pop(name, None) is not None:
                    changed[name] = None
                continue
            held = self._holders.get(name, {})
            replicas = self._assignment.stores.get(name, ())
            version = store.version
            current = routes.get(name)
            if dirty is None or current is None or len(current) != store.partitions:
                routes[name] = tuple(
                    _routable(held[p], version, replicas[p] if p < len(replicas) else ()) if p in held else ()
                    for p in range(store.partitions)
                )
                changed[name] = None
                continue
            inside = [p for p in dirty if p < store.partitions]
            if not inside:
                continue
            per_partition = list(current)
            for p in inside:
                per_partition[p] = (
                    _routable(held[p], version, replicas[p] if p < len(replicas) else ()) if p in held else ()
                )
            routes[name] = tuple(per_partition)
            changed[name] = frozenset(inside)
        self._dirty = {}
        last = self._last
        built = PartitionMap(
            stores=MappingProxyType(dict(self._stores)),
            nodes=MappingProxyType(dict(self._nodes)),
            assignment=self._assignment,
            serving=MappingProxyType(dict(self._serving)),
            generation=generation,
            built_at=time.time() if built_at is None else built_at,
            routes=MappingProxyType(dict(routes)),
            deleted=self._deleted,
            orphaned=frozenset(self._orphaned),
            delta=None if last is None else MapDelta(last.seq, MappingProxyType(changed)),
        )
        self._last = built
        return built


def _routable(held: Mapping[str, Endpoint], published: int, assigned: tuple[str, ...]) -> tuple[Endpoint, ...]:
    """Only one version of a partition is routable at a time, so answers never mix versions.

    That is the published version when some node serves it, else the newest version served (a new
    version is still loading, or the store was rolled back and the older version is not loaded yet).
    Within it, assigned replicas come first in assignment order (preferred replica first), then any
    other holder (a node still serving a partition it is handing over, e.g. one that is leaving).
    """
    if not held:
        return ()
    if len(held) == 1:
        return tuple(held.values())  # its version is the only one served
    endpoints = held.values()
    versions = {ep.version for ep in endpoints}
    chosen = published if published in versions else max(versions)
    rank = {node_id: i for i, node_id in enumerate(assigned)}
    current = [ep for ep in endpoints if ep.version == chosen]
    current.sort(key=lambda ep: (rank.get(ep.node_id, len(rank)), ep.node_id))
    return tuple(current)


def _holds(raw: Any) -> tuple[tuple[str, int, tuple[int, ...]], ...]:
    """A node record's `holds` ({store: {"<version>": [partitions]}}); what cannot be read is left out (a hint)."""
    if not isinstance(raw, dict):
        return ()
    held = []
    for store, versions in sorted(raw.items()):
        if not isinstance(store, str) or not isinstance(versions, dict):
            continue
        for version, partitions in sorted(versions.items()):
            if not isinstance(version, str) or not version.isdigit() or not isinstance(partitions, list):
                continue
            parts = tuple(sorted({p for p in partitions if isinstance(p, int) and not isinstance(p, bool) and p >= 0}))
            if parts:
                held.append((store, int(version), parts))
    return tuple(held)
