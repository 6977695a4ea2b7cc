"""The partition map: stores, nodes, desired placement (assignment) and actual placement (serving).

Every record is a frozen value serialised as JSON in ZooKeeper. `PartitionMap` joins them into one
immutable snapshot with routes precomputed, replaced whole whenever ZooKeeper changes; readers never lock.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from keyroute.core.key_format import KeyFormat
from keyroute.core.partitioner import Partitioner, key_hash, partition_of_hash
from keyroute.core.timeline import Timeline


class RecordError(ValueError):
    """A record in ZooKeeper could not be decoded."""


def _load(raw: bytes, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordError(f"{what}: not valid JSON ({exc})") from exc
    if not isinstance(obj, dict):
        raise RecordError(f"{what}: expected a JSON object")
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
    # History and windowed stores (keyroute.core.timeline); None for a store of one value per key.
    timeline: Timeline | None = None

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
            }
        )

    @classmethod
    def from_json(cls, raw: bytes) -> StoreRecord:
        obj = _load(raw, "store record")
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

    def to_json(self) -> bytes:
        record: dict[str, object] = {"node_id": self.node_id, "url": self.url, "leaving": self.leaving}
        if self.zone:
            record["zone"] = self.zone
        return _dump(record)

    @classmethod
    def from_json(cls, raw: bytes) -> NodeRecord:
        obj = _load(raw, "node record")
        try:
            zone = obj.get("zone")
            return cls(
                node_id=str(obj["node_id"]),
                url=str(obj["url"]),
                leaving=obj.get("leaving") is True,
                zone=zone if isinstance(zone, str) else "",
            )
        except KeyError as exc:
            raise RecordError(f"node record: missing {exc}") from exc


@dataclass(frozen=True, slots=True)
class Assignment:
    """Desired placement, written by the controller: replicas per partition per store.

    `stores[store][p]` lists the node ids that should serve partition p, preferred replica first.
    """

    generation: int
    stores: Mapping[str, tuple[tuple[str, ...], ...]] = field(default_factory=dict)

    def replicas(self, store: str, partition: int) -> tuple[str, ...]:
        per_partition = self.stores.get(store, ())
        return per_partition[partition] if partition < len(per_partition) else ()

    def partitions_of(self, node_id: str) -> dict[str, frozenset[int]]:
        owned: dict[str, frozenset[int]] = {}
        for store, per_partition in self.stores.items():
            mine = frozenset(p for p, nodes in enumerate(per_partition) if node_id in nodes)
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
        obj = _load(raw, "assignment")
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
        obj = _load(raw, "serving record")
        try:
            stores = {
                str(s): {int(p): int(v) for p, v in dict(parts).items()}
                for s, parts in dict(obj.get("stores", {})).items()
            }
            return cls(node_id=str(obj["node_id"]), url=str(obj["url"]), stores=stores)
        except (KeyError, TypeError, ValueError) as exc:
            raise RecordError(f"serving record: {exc!r}") from exc


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A node that serves a partition, and the version it serves."""

    node_id: str
    url: str
    version: int


@dataclass(frozen=True, slots=True)
class KeyRoute:
    """Where one key lives: partition, hash, and the nodes serving its routable version (preferred first)."""

    store: str
    partition: int
    hash: int
    assigned: tuple[str, ...]
    serving: tuple[Endpoint, ...]

    @property
    def available(self) -> bool:
        return bool(self.serving)


@dataclass(frozen=True, slots=True)
class PartitionMap:
    """One consistent snapshot of the cluster, built from ZooKeeper records.

    `generation` is the highest ZooKeeper modification id among the records read, so two maps can be
    ordered across processes. `routes[store][p]` is precomputed: the endpoints serving partition p of
    the version chosen by `_routable`, so the hot path is two index lookups.
    """

    stores: Mapping[str, StoreRecord]
    nodes: Mapping[str, NodeRecord]
    assignment: Assignment
    serving: Mapping[str, ServingRecord]
    generation: int = 0
    built_at: float = 0.0
    stale: bool = False
    routes: Mapping[str, tuple[tuple[Endpoint, ...], ...]] = field(default_factory=dict)

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
        # One pass over the serving records (not one per store), one Endpoint per node and version.
        holders: dict[str, dict[int, list[Endpoint]]] = {name: {} for name in stores}
        for record in serving.values():
            endpoints: dict[int, Endpoint] = {}
            for name, partitions in record.stores.items():
                per_store = holders.get(name)
                if per_store is None:
                    continue
                limit = stores[name].partitions
                for partition, version in partitions.items():
                    if 0 <= partition < limit:
                        ep = endpoints.get(version)
                        if ep is None:
                            ep = endpoints[version] = Endpoint(record.node_id, record.url, version)
                        per_store.setdefault(partition, []).append(ep)
        routes: dict[str, tuple[tuple[Endpoint, ...], ...]] = {}
        for name, store in stores.items():
            per_store = holders[name]
            replicas = assignment.stores.get(name, ())
            routes[name] = tuple(
                _routable(per_store[p], store.version, replicas[p] if p < len(replicas) else ())
                if p in per_store
                else ()
                for p in range(store.partitions)
            )
        return cls(
            stores=MappingProxyType(dict(stores)),
            nodes=MappingProxyType(dict(nodes)),
            assignment=assignment,
            serving=MappingProxyType(dict(serving)),
            generation=generation,
            built_at=time.time() if built_at is None else built_at,
            routes=MappingProxyType(routes),
        )

    @classmethod
    def empty(cls) -> PartitionMap:
        return cls.build({}, {}, EMPTY_ASSIGNMENT, {})

    def marked_stale(self, stale: bool) -> PartitionMap:
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
        )

    def serving_endpoints(self, store: str, partition: int) -> tuple[Endpoint, ...]:
        per_partition = self.routes.get(store, ())
        return per_partition[partition] if 0 <= partition < len(per_partition) else ()

    def route(self, store: StoreRecord, key_data: bytes) -> KeyRoute:
        hash_value = key_hash(store.partitioner, key_data)
        partition = partition_of_hash(store.partitioner, hash_value, store.partitions)
        return KeyRoute(
            store=store.name,
            partition=partition,
            hash=hash_value,
            assigned=self.assignment.replicas(store.name, partition),
            serving=self.serving_endpoints(store.name, partition),
        )

    def live_nodes(self) -> frozenset[str]:
        """Registered nodes that are not leaving: the ones the controller assigns partitions to."""
        return frozenset(node_id for node_id, record in self.nodes.items() if not record.leaving)

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
        return bool(self.stores) and all(
            all(eps for eps in self.routes.get(name, ())) and len(self.routes.get(name, ())) == s.partitions
            for name, s in self.stores.items()
        )

    def describe(self, now: float | None = None) -> dict[str, Any]:
        """The operator's view served at /admin/partition-map."""
        now = time.time() if now is None else now
        return {
            "generation": self.generation,
            "assignment_generation": self.assignment.generation,
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
                    "version": store.version,
                    "replication_factor": store.replication_factor,
                    "value_columns": list(store.value_columns),
                    "published_at": store.published_at,
                    "retained_versions": list(store.retained_versions),
                    **({} if store.timeline is None else {"timeline": store.timeline.to_dict()}),
                    "partition_map": [
                        {
                            "partition": p,
                            "assigned": list(self.assignment.replicas(name, p)),
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


def _routable(endpoints: list[Endpoint], published: int, assigned: tuple[str, ...]) -> tuple[Endpoint, ...]:
    """Only one version of a partition is routable at a time, so answers never mix versions.

    That is the published version when some node serves it, else the newest version served (a new
    version is still loading, or the store was rolled back and the older version is not loaded yet).
    Within it, assigned replicas come first in assignment order (preferred replica first), then any
    other holder (a node still serving a partition it is handing over, e.g. one that is leaving).
    """
    if not endpoints:
        return ()
    if len(endpoints) == 1:
        return (endpoints[0],)  # its version is the only one served
    versions = {ep.version for ep in endpoints}
    chosen = published if published in versions else max(versions)
    rank = {node_id: i for i, node_id in enumerate(assigned)}
    current = [ep for ep in endpoints if ep.version == chosen]
    current.sort(key=lambda ep: (rank.get(ep.node_id, len(rank)), ep.node_id))
    return tuple(current)
