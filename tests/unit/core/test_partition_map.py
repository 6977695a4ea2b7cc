from __future__ import annotations

import dataclasses
import json

import pytest

from keyroute.cluster.partition_map import (
    Assignment,
    Endpoint,
    NodeRecord,
    PartitionMap,
    RecordError,
    ServingRecord,
    StoreRecord,
)
from keyroute.keys.key_format import KeyFormat, parse_key
from keyroute.keys.key_location import KeyLocation, StoreLocator
from keyroute.keys.partitioner import Partitioner, murmur2, partition_for


def store(name: str = "bookings", partitions: int = 4, version: int = 2) -> StoreRecord:
    return StoreRecord(
        name=name,
        partitions=partitions,
        partitioner=Partitioner.MURMUR2,
        key_format=KeyFormat.STRING,
        version=version,
        snapshot=f"/snap/{name}/v{version}",
        value_columns=("ts", "fare"),
        replication_factor=2,
    )


def test_records_round_trip_through_json() -> None:
    s = store()
    assert StoreRecord.from_json(s.to_json()) == s
    n = NodeRecord("n1", "http://127.0.0.1:9001")
    assert NodeRecord.from_json(n.to_json()) == n
    a = Assignment(7, {"bookings": (("n1", "n2"), ("n2", "n1"))})
    assert Assignment.from_json(a.to_json()) == a
    r = ServingRecord("n1", "http://127.0.0.1:9001", {"bookings": {0: 2, 3: 1}})
    back = ServingRecord.from_json(r.to_json())
    assert back.stores == {"bookings": {0: 2, 3: 1}}


@pytest.mark.parametrize("raw", [b"", b"[]", b"{", b'{"name": 1}', b"\xff"])
def test_malformed_records_raise_record_error(raw: bytes) -> None:
    with pytest.raises(RecordError):
        StoreRecord.from_json(raw)


def test_routes_use_the_published_version_and_preferred_replica_first() -> None:
    s = store(partitions=2, version=2)
    serving = {
        "n1": ServingRecord("n1", "http://n1", {"bookings": {0: 2, 1: 1}}),
        "n2": ServingRecord("n2", "http://n2", {"bookings": {0: 2, 1: 2}}),
        "n3": ServingRecord("n3", "http://n3", {"bookings": {0: 1}}),
    }
    assignment = Assignment(3, {"bookings": (("n2", "n1"), ("n1", "n2"))})
    pmap = PartitionMap.build({"bookings": s}, {}, assignment, serving)
    assert [ep.node_id for ep in pmap.serving_endpoints("bookings", 0)] == ["n2", "n1"]
    # n1 still serves version 1 of partition 1: never mixed with version 2.
    assert [(ep.node_id, ep.version) for ep in pmap.serving_endpoints("bookings", 1)] == [("n2", 2)]
    assert pmap.complete


def test_an_older_version_is_routed_while_the_published_one_is_not_served_yet() -> None:
    s = store(partitions=1, version=3)
    serving = {"n1": ServingRecord("n1", "http://n1", {"bookings": {0: 2}})}
    pmap = PartitionMap.build({"bookings": s}, {}, Assignment(1, {"bookings": (("n1",),)}), serving)
    assert [(ep.node_id, ep.version) for ep in pmap.serving_endpoints("bookings", 0)] == [("n1", 2)]


def test_locate_hashes_key_bytes_over_all_partitions_even_if_unserved() -> None:
    s = store(partitions=12)
    serving = {"n1": ServingRecord("n1", "http://n1", {"bookings": {0: 2}})}
    pmap = PartitionMap.build({"bookings": s}, {}, Assignment(1, {}), serving)
    data = b"customer-17"
    location = pmap.locate(s, parse_key(KeyFormat.STRING, "customer-17"))
    assert location.partition == partition_for(Partitioner.MURMUR2, data, 12)
    assert location.hash == murmur2(data)
    assert location.key == "customer-17" and location.store == "bookings"
    assert not location.available and location.assigned == ()
    assert not pmap.complete


def test_a_key_location_names_the_key_its_partition_and_its_nodes_preferred_first() -> None:
    s = dataclasses.replace(store(partitions=3, version=2), key_format=KeyFormat.INT64)
    serving = {
        "n1": ServingRecord("n1", "http://n1", {"bookings": {0: 2, 1: 2, 2: 2}}),
        "n2": ServingRecord("n2", "http://n2", {"bookings": {0: 2, 1: 2}}),
    }
    assignment = Assignment(3, {"bookings": (("n2", "n1"), ("n1", "n2"), ("n1", "n2"))})
    pmap = PartitionMap.build({"bookings": s}, {}, assignment, serving)
    key = parse_key(KeyFormat.INT64, "0042")
    partition = partition_for(Partitioner.MURMUR2, (42).to_bytes(8, "big", signed=True), 3)
    location = pmap.locate(s, key)
    assert location.key == "42" and location.partition == partition and location.available
    assert location.assigned == assignment.replicas("bookings", partition)
    assert location.serving == pmap.serving_endpoints("bookings", partition)
    assert [ep.node_id for ep in location.serving] == [n for n in location.assigned if n in serving]
    assert isinstance(location, KeyLocation) and isinstance(location.serving[0], Endpoint)
    with pytest.raises(dataclasses.FrozenInstanceError):
        location.partition = 0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("key_format", "partitioner", "keys"),
    [
        (KeyFormat.STRING, Partitioner.MURMUR2, [f"customer-{i}" for i in range(300)] + ["", "東京", "a/b"]),
        (KeyFormat.STRING, Partitioner.CRC32, [f"k{i}" for i in range(300)]),
        (KeyFormat.INT32, Partitioner.FNV1A, [str(i * 7919 - 10**6) for i in range(300)]),
        (KeyFormat.UUID, Partitioner.MURMUR2, [f"00000000-0000-0000-0000-{i:012X}" for i in range(300)]),
        (KeyFormat.BYTES, Partitioner.MURMUR2, ["AAE", "_wA", "", "a2V5"]),
    ],
)
def test_a_store_locator_of_the_map_or_of_its_description_locates_keys_as_the_map_does(
    key_format: KeyFormat, partitioner: Partitioner, keys: list[str]
) -> None:
    s = dataclasses.replace(store(partitions=7), key_format=key_format, partitioner=partitioner)
    serving = {
        "n1": ServingRecord("n1", "http://n1", {"bookings": {p: 2 for p in range(7) if p != 5}}),
        "n2": ServingRecord("n2", "http://n2", {"bookings": {p: 2 for p in range(7) if p % 2}}),
        "n3": ServingRecord("n3", "http://n3", {"bookings": {p: 2 for p in range(7) if p % 3 == 0}}),
    }
    orders = [("n1", "n2", "n3"), ("n2", "n1"), ("n3", "n1"), ("n2", "n3", "n1"), ("n1",), ("n2",), ("n3", "n2")]
    pmap = PartitionMap.build({"bookings": s}, {}, Assignment(4, {"bookings": tuple(orders)}), serving)
    of_map = StoreLocator.of_map(pmap, "bookings")
    described = json.loads(json.dumps(pmap.describe()))["stores"]["bookings"]
    of_description = StoreLocator.of_description("bookings", described)
    assert of_map is not None and of_map == of_description
    seen = set()
    for text in keys:
        location = pmap.locate(s, parse_key(key_format, text))
        assert of_map.locate(text) == of_description.locate(text) == location
        seen.add(location.partition)
    assert len(seen) > 1 or len(keys) < 7


def test_describe_lists_assigned_and_serving_per_partition() -> None:
    s = store(partitions=2)
    serving = {"n1": ServingRecord("n1", "http://n1", {"bookings": {0: 2, 1: 2}})}
    nodes = {"n1": NodeRecord("n1", "http://n1")}
    pmap = PartitionMap.build(
        {"bookings": s}, nodes, Assignment(5, {"bookings": (("n1",), ("n1",))}), serving, generation=99
    )
    doc = json.loads(json.dumps(pmap.describe()))
    assert doc["generation"] == 99 and doc["assignment_generation"] == 5
    entry = doc["stores"]["bookings"]
    assert entry["partitioner"] == "murmur2" and entry["version"] == 2
    assert entry["partition_map"][1] == {
        "partition": 1,
        "assigned": ["n1"],
        "serving": [{"node": "n1", "url": "http://n1", "version": 2}],
    }
    assert doc["nodes"]["n1"]["serving"] == {"bookings": 2}
    assert pmap.marked_stale(True).describe()["stale"] is True


def test_store_records_carry_their_retained_versions() -> None:
    s = dataclasses.replace(store(version=3), retained={1: "/a", 2: "/b"})
    back = StoreRecord.from_json(s.to_json())
    assert back == s and back.retained_versions == (1, 2, 3)
    assert back.snapshot_of(3) == s.snapshot and back.snapshot_of(1) == "/a" and back.snapshot_of(9) is None
    # Records written before retention existed read as retaining nothing but the current version.
    old = json.loads(store().to_json())
    del old["retained"]
    assert StoreRecord.from_json(json.dumps(old).encode()).retained_versions == (2,)
    with pytest.raises(RecordError):
        StoreRecord.from_json(json.dumps({**old, "retained": {"0": "/x"}}).encode())


def test_node_records_say_whether_the_node_is_leaving() -> None:
    assert NodeRecord.from_json(b'{"node_id": "n1", "url": "http://n1"}').leaving is False
    leaving = NodeRecord("n1", "http://n1", leaving=True)
    assert NodeRecord.from_json(leaving.to_json()) == leaving


def test_node_records_carry_the_nodes_zone_and_records_without_one_read_as_no_zone() -> None:
    zoned = NodeRecord("n1", "http://n1", zone="eu-west-1b")
    assert NodeRecord.from_json(zoned.to_json()) == zoned
    assert json.loads(zoned.to_json())["zone"] == "eu-west-1b"
    assert "zone" not in json.loads(NodeRecord("n1", "http://n1").to_json())  # records as before zones
    assert NodeRecord.from_json(b'{"node_id": "n1", "url": "http://n1", "zone": 7}').zone == ""


def test_only_a_live_assigned_holder_at_the_published_version_counts_as_serving_elsewhere() -> None:
    s = store(partitions=1, version=2)
    nodes = {n: NodeRecord(n, f"http://{n}") for n in ("a", "b", "c")}

    def pmap(
        assigned: tuple[str, ...], serving: dict[str, int], leaving: tuple[str, ...] = ()
    ) -> PartitionMap:
        records = {n: ServingRecord(n, f"http://{n}", {"bookings": {0: v}}) for n, v in serving.items()}
        members = {n: NodeRecord(n, r.url, leaving=n in leaving) for n, r in nodes.items()}
        return PartitionMap.build({"bookings": s}, members, Assignment(1, {"bookings": (assigned,)}), records)

    # The partition moves from {a, b} to {c}: a and b see each other serving it, which is not enough,
    # or both would let go before c has loaded it.
    moving = pmap(("c",), {"a": 2, "b": 2})
    assert not moving.served_elsewhere("bookings", 0, "a")
    assert not moving.served_elsewhere("bookings", 0, "b")
    assert pmap(("c",), {"a": 2, "b": 2, "c": 2}).served_elsewhere("bookings", 0, "a")
    # From {a, b} to {b, c}: b serving it is not enough for a, c must serve it too (b may crash).
    assert not pmap(("b", "c"), {"a": 2, "b": 2}).served_elsewhere("bookings", 0, "a")
    assert pmap(("b", "c"), {"a": 2, "b": 2, "c": 2}).served_elsewhere("bookings", 0, "a")
    assert not pmap(("c",), {"a": 2, "c": 1}).served_elsewhere("bookings", 0, "a")  # an older version
    assert not pmap(("c",), {"a": 2, "c": 2}, leaving=("c",)).served_elsewhere("bookings", 0, "a")
    assert pmap(("c",), {}).served_elsewhere("gone", 0, "a")  # a deleted store has nothing to hand over
    assert pmap(("a",), {"a": 2}, leaving=("b",)).live_nodes() == frozenset({"a", "c"})
    doc = pmap(("a",), {"a": 2}, leaving=("b",)).describe()
    assert doc["nodes"]["b"]["leaving"] is True and doc["stores"]["bookings"]["retained_versions"] == [2]
