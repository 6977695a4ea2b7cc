"""Where a key lives: `KeyLocation`, the one value that says which partition and which nodes hold a key.

`StoreLocator` holds what locating a key of one store needs, precomputed once per partition map: the
router's routing table and the client's direct routing (from `GET /admin/partition-map`) both use it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from keyroute.keys.key_format import Key, KeyFormat, parse_key
from keyroute.keys.key_schema import KeyCodec, KeySchema
from keyroute.keys.partitioner import Partitioner, key_hash, murmur2, murmur2_bits, partition_of_hash

if TYPE_CHECKING:
    from keyroute.cluster.partition_map import PartitionMap, StoreRecord

# Kafka's partition count is a Java int: a store record with more partitions is malformed.
_MAX_PARTITIONS = 0x7FFFFFFF


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A node that serves a partition, and the version it serves."""

    node_id: str
    url: str
    version: int


@dataclass(frozen=True, slots=True)
class KeyLocation:
    """Where one key of one store lives (Kafka Streams' `KeyQueryMetadata`).

    `key` is the key's canonical text, `hash` its partitioner's hash (as operators are shown it),
    `partition` the partition Kafka's producer would send it to. `assigned` lists the node ids the
    assignment gives that partition and `serving` the nodes serving its routable version, with that
    version; both preferred replica first. No node serving it (`available` false) is a value too, never
    an exception: the caller decides what that means (503, the nodes that served it last, the router).
    """

    store: str
    key: str
    partition: int
    hash: int
    assigned: tuple[str, ...]
    serving: tuple[Endpoint, ...]

    @property
    def available(self) -> bool:
        return bool(self.serving)


_new = object.__new__
# A frozen dataclass's __init__ sets each field through object.__setattr__; a single-key read locates its
# key on the router's (and the node's) hot path, where the slots' own setters build the same value in
# about half the time.
_SET_STORE, _SET_KEY, _SET_PARTITION, _SET_HASH, _SET_ASSIGNED, _SET_SERVING = (
    getattr(KeyLocation, name).__set__ for name in ("store", "key", "partition", "hash", "assigned", "serving")
)


def key_location(
    store: str, key: str, partition: int, hash_value: int, assigned: tuple[str, ...], serving: tuple[Endpoint, ...]
) -> KeyLocation:
    """`KeyLocation(store, key, partition, hash_value, assigned, serving)`, built the fast way."""
    location = _new(KeyLocation)
    _SET_STORE(location, store)
    _SET_KEY(location, key)
    _SET_PARTITION(location, partition)
    _SET_HASH(location, hash_value)
    _SET_ASSIGNED(location, assigned)
    _SET_SERVING(location, serving)
    return location


def _per_partition(entries: Sequence[tuple[Any, ...]], partitions: int) -> tuple[tuple[Any, ...], ...]:
    if isinstance(entries, tuple) and len(entries) == partitions:
        return entries
    return tuple(entries[p] if p < len(entries) else () for p in range(partitions))


@dataclass(frozen=True, slots=True)
class StoreLocator:
    """Locates the keys of one store: its shape, and per partition its assigned and serving nodes.

    Built once per partition map (`of_map`, or `of_description` from `GET /admin/partition-map`), so a
    lookup hashes the key and allocates one `KeyLocation`. `locate_key` is the definition; keys of the
    common kind (strings hashed with murmur2) are hashed inline.
    """

    name: str
    partitions: int
    partitioner: Partitioner
    key_format: KeyFormat
    # One entry per partition, preferred replica first; a partition nobody is assigned or serves has ().
    assigned: tuple[tuple[str, ...], ...]
    serving: tuple[tuple[Endpoint, ...], ...]
    # Schema Registry keys: the schema keys are serialized with (its codec is built once, then shared).
    key_schema: KeySchema | None = None
    plain: bool = field(init=False)
    # The key schema's serializer, looked up once here rather than on every read.
    codec: KeyCodec | None = field(init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.partitions <= _MAX_PARTITIONS:
            raise ValueError(f"store {self.name!r}: partition count must be between 1 and {_MAX_PARTITIONS}")
        # Whatever the records held, one entry per partition. A map's own tuples are kept as they are (no
        # copy: a change to one partition costs in proportion to the change).
        object.__setattr__(self, "assigned", _per_partition(self.assigned, self.partitions))
        object.__setattr__(self, "serving", _per_partition(self.serving, self.partitions))
        plain = self.key_format is KeyFormat.STRING and self.partitioner is Partitioner.MURMUR2
        object.__setattr__(self, "plain", plain)
        object.__setattr__(self, "codec", None if self.key_schema is None else self.key_schema.codec)

    @classmethod
    def of_map(cls, partition_map: PartitionMap, name: str) -> StoreLocator | None:
        """The locator of store `name` of `partition_map`; None when its record has no usable partition
        count (what a read of it answers is the caller's to say)."""
        store = partition_map.stores[name]
        if not 1 <= store.partitions <= _MAX_PARTITIONS:
            return None
        return cls.of_record(partition_map, store)

    @classmethod
    def of_record(cls, partition_map: PartitionMap, store: StoreRecord) -> StoreLocator:
        """The locator of the store `store` describes, placed as `partition_map` places its name (nowhere,
        when the map does not have it); raises ValueError when its partition count is not usable."""
        name = store.name
        return cls(
            name,
            store.partitions,
            store.partitioner,
            store.key_format,
            partition_map.assignment.stores.get(name, ()),
            partition_map.routes.get(name, ()),
            store.key_schema,
        )

    @classmethod
    def of_description(cls, name: str, store: Mapping[str, Any]) -> StoreLocator:
        """The locator of one store of `PartitionMap.describe()` (`GET /admin/partition-map`'s
        `stores[name]`); raises KeyError, TypeError or ValueError when it is not one."""
        entries = store["partition_map"]
        return cls(
            name,
            int(store["partitions"]),
            Partitioner(store["partitioner"]),
            KeyFormat(store["key_format"]),
            tuple(tuple(str(n) for n in entry.get("assigned", ())) for entry in entries),
            tuple(
                tuple(
                    Endpoint(str(s.get("node", s["url"])), str(s["url"]), int(s.get("version", 0)))
                    for s in entry["serving"]
                )
                for entry in entries
            ),
            None if store.get("key_schema") is None else KeySchema.from_dict(store["key_schema"]),
        )

    def serving_of(self, key_text: str) -> tuple[int, tuple[Endpoint, ...]]:
        """`locate(key_text)`'s partition and serving nodes, without building the KeyLocation: all a
        single-key read needs, on the router's hot path. Raises as `locate` does."""
        if self.plain:
            try:
                data = key_text.encode("utf-8")
            except UnicodeEncodeError:
                pass  # `locate` says why
            else:
                partition = (murmur2_bits(data) & 0x7FFFFFFF) % self.partitions  # `locate_key`, inline
                return partition, self.serving[partition]
        location = self.locate(key_text)
        return location.partition, location.serving

    def locate(self, key_text: str) -> KeyLocation:
        """Where the key written `key_text` lives; raises KeyFormatError when it does not fit the store's
        key format."""
        if self.plain:
            try:
                data = key_text.encode("utf-8")
            except UnicodeEncodeError:
                parse_key(KeyFormat.STRING, key_text)  # raises KeyFormatError, saying why
                raise
            # `locate_key`, inline for the common kind (a key's text is its bytes; Kafka's
            # toPositive(murmur2(key)) % partitions): tests/property/test_key_location_props.py pins it.
            hash_value = murmur2(data)
            partition = (hash_value & 0x7FFFFFFF) % self.partitions
            return key_location(
                self.name, key_text, partition, hash_value, self.assigned[partition], self.serving[partition]
            )
        codec = self.codec
        return self.locate_key(parse_key(self.key_format, key_text) if codec is None else codec.parse(key_text))

    def locate_key(self, key: Key) -> KeyLocation:
        """Where `key` (parsed in the store's key format) lives: the one definition of a key's location,
        which every other way of locating a key gives (`locate`, `serving_of`, `PartitionMap.locate`, the
        router's read path)."""
        hash_value = key_hash(self.partitioner, key.data)
        partition = partition_of_hash(self.partitioner, hash_value, self.partitions)
        return key_location(
            self.name, key.text, partition, hash_value, self.assigned[partition], self.serving[partition]
        )
