"""RoutingTable: a key resolves to the partition Kafka's producer would pick and to the nodes serving it."""

from __future__ import annotations

import pytest

from keyroute.api import BadKey, NoPartitionMap, PartitionUnavailable, StoreNotFound
from keyroute.cluster.partition_map import Assignment
from keyroute.keys.key_format import KeyFormat, KeyFormatError
from keyroute.keys.partitioner import Partitioner, key_hash, partition_for
from keyroute.router.routing_table import RoutingTable
from tests.unit.router.fakes import build_map, node_url, store_record

KEYS = ["21", "foobar", "a/b", "100%", "東京", "", "key with spaces", "x" * 300]


def test_a_key_routes_to_the_partition_of_its_serialized_bytes_and_the_node_serving_it() -> None:
    store = store_record("bookings", 12)
    table = RoutingTable.of(build_map([store], {"a": {"bookings": range(0, 6)}, "b": {"bookings": range(6, 12)}}))
    for key in KEYS:
        route = table.locate("bookings", key)
        expected = partition_for(Partitioner.MURMUR2, key.encode("utf-8"), 12)
        assert route.partition == expected
        assert route.hash == key_hash(Partitioner.MURMUR2, key.encode("utf-8"))
        assert [ep.node_id for ep in route.serving] == ["a" if expected < 6 else "b"]
        assert route.serving[0].url == node_url("a" if expected < 6 else "b")
        assert (route.store, route.key, route.available) == ("bookings", key, True)


def test_a_known_kafka_vector_lands_where_the_java_client_puts_it() -> None:
    # Kafka's UtilsTest: murmur2(b"21") == -973932308, so toPositive(...) % 12 == 8.
    table = RoutingTable.of(build_map([store_record("s", 12)], {"a": {"s": range(12)}}))
    route = table.locate("s", "21")
    assert route.hash == -973932308
    assert route.partition == (-973932308 & 0x7FFFFFFF) % 12


def test_integer_keys_hash_their_big_endian_bytes_whatever_their_spelling() -> None:
    store = store_record("accounts", 8, key_format=KeyFormat.INT64)
    table = RoutingTable.of(build_map([store], {"a": {"accounts": range(8)}}))
    expected = partition_for(Partitioner.MURMUR2, (42).to_bytes(8, "big", signed=True), 8)
    assert table.locate("accounts", "42").partition == expected
    assert table.locate("accounts", "0042").partition == expected
    assert table.locate("accounts", "0042") == table.locate("accounts", "42")  # the key's canonical text
    assert table.locate("accounts", "0042").key == "42"


def test_other_partitioners_are_honoured() -> None:
    store = store_record("s", 7, partitioner=Partitioner.CRC32)
    table = RoutingTable.of(build_map([store], {"a": {"s": range(7)}}))
    for key in KEYS:
        assert table.locate("s", key).partition == partition_for(Partitioner.CRC32, key.encode(), 7)


def test_a_key_that_does_not_fit_the_format_is_a_bad_key_with_the_reason_chained() -> None:
    store = store_record("accounts", 8, key_format=KeyFormat.INT64)
    table = RoutingTable.of(build_map([store], {"a": {"accounts": range(8)}}))
    for text in ["abc", str(2**63), "1.5"]:
        with pytest.raises(BadKey) as caught:
            table.locate("accounts", text)
        assert isinstance(caught.value.__cause__, KeyFormatError)
        assert caught.value.status == 400 and caught.value.code == "bad_key"


def test_a_key_that_is_not_text_of_a_string_store_is_a_bad_key() -> None:
    table = RoutingTable.of(build_map([store_record("s", 4)], {"a": {"s": range(4)}}))
    with pytest.raises(BadKey) as caught:
        table.locate("s", "lone \udc80 surrogate")
    assert isinstance(caught.value.__cause__, KeyFormatError)


def test_a_store_published_with_no_partitions_is_unavailable_not_a_crash() -> None:
    table = RoutingTable.of(build_map([store_record("s", 0)], {}))
    with pytest.raises(PartitionUnavailable):
        table.locate("s", "k")


def test_an_unknown_store_is_store_not_found() -> None:
    table = RoutingTable.of(build_map([store_record("s", 4)], {"a": {"s": range(4)}}))
    with pytest.raises(StoreNotFound):
        table.locate("nope", "k")
    assert table.has_store("s") and not table.has_store("nope")


def test_store_not_found_names_the_stores_that_exist_and_the_closest() -> None:
    stores = [store_record(name, 2) for name in ("trips", "bookings", "fares_5m")]
    table = RoutingTable.of(build_map(stores, {"a": {s.name: range(2) for s in stores}}))
    with pytest.raises(StoreNotFound) as raised:
        table.locate("trip", "k")
    assert raised.value.message == "no store named 'trip'; did you mean 'trips'? (stores: bookings, fares_5m, trips)"
    many = [store_record(f"s{i:02d}", 1) for i in range(12)]
    crowded = RoutingTable.of(build_map(many, {"a": {s.name: range(1) for s in many}}))
    with pytest.raises(StoreNotFound) as raised:
        crowded.locate("zzz", "k")
    assert raised.value.message.endswith("(stores: s00, s01, s02, s03, s04, s05, s06, s07, s08, s09 and 2 more)")
    assert "did you mean" not in raised.value.message
    empty = RoutingTable.of(build_map([], {"a": {}}))
    with pytest.raises(StoreNotFound, match=r"no store named 'x' \(no store is published\)"):
        empty.locate("x", "k")


def test_serving_replicas_come_preferred_first_and_unserved_partitions_have_none() -> None:
    store = store_record("s", 2)
    assignment = Assignment(generation=3, stores={"s": (("b", "a"), ("a", "b"))})
    table = RoutingTable.of(build_map([store], {"a": {"s": [0]}, "b": {"s": [0]}}, assignment))
    key_p0 = next(k for k in (f"k{i}" for i in range(100)) if partition_for(Partitioner.MURMUR2, k.encode(), 2) == 0)
    key_p1 = next(k for k in (f"k{i}" for i in range(100)) if partition_for(Partitioner.MURMUR2, k.encode(), 2) == 1)
    route = table.locate("s", key_p0)
    assert [ep.node_id for ep in route.serving] == ["b", "a"]
    assert route.assigned == ("b", "a")
    unserved = table.locate("s", key_p1)
    assert unserved.serving == () and unserved.assigned == ("a", "b")
    assert not table.complete


def test_complete_only_when_every_partition_of_every_store_is_served() -> None:
    stores = [store_record("s", 3), store_record("t", 2)]
    partial = RoutingTable.of(build_map(stores, {"a": {"s": range(3), "t": [0]}}))
    full = RoutingTable.of(build_map(stores, {"a": {"s": range(3), "t": [0]}, "b": {"t": [1]}}))
    assert not partial.complete and full.complete
    assert full.generation == 7 and not full.stale


def test_before_any_map_the_table_is_empty_stale_and_not_complete() -> None:
    table = RoutingTable.empty()
    assert table.stale and not table.complete
    # Not "no such store": before a first map the router cannot tell (503, retry), unlike once it has one.
    with pytest.raises(NoPartitionMap) as raised:
        table.locate("s", "k")
    assert raised.value.status == 503 and raised.value.headers == {"Retry-After": "1"}
    with pytest.raises(StoreNotFound):
        RoutingTable.of(build_map([store_record("t", 4)], {})).locate("s", "k")


def test_a_partition_nobody_announces_keeps_the_nodes_that_served_it_last() -> None:
    store = store_record("s", 4)
    first = RoutingTable.of(build_map([store], {"a": {"s": range(4)}, "b": {"s": [0]}}))
    assert first.last_known == {}
    # a's serving record is gone (its session expired, say): partitions 1-3 are announced by nobody.
    second = RoutingTable.of(build_map([store], {"b": {"s": [0]}}), first)
    assert [ep.node_id for ep in second.map.serving_endpoints("s", 0)] == ["b"]
    assert second.last_known_endpoints("s", 0) == ()
    assert [ep.node_id for ep in second.last_known_endpoints("s", 2)] == ["a"]
    assert not second.complete  # readiness stays honest
    # Carried over while nobody announces them, forgotten once somebody does.
    third = RoutingTable.of(build_map([store], {"b": {"s": [0, 1]}}), second)
    assert [ep.node_id for ep in third.last_known_endpoints("s", 2)] == ["a"]
    assert third.last_known_endpoints("s", 1) == ()
    # A store published again with another shape, or deleted, carries nothing over.
    reshaped = RoutingTable.of(build_map([store_record("s", 8)], {"b": {"s": [0]}}), third)
    assert reshaped.last_known == {}


def test_serving_of_says_what_locate_says_of_partition_and_serving_and_raises_alike() -> None:
    # The single-key read's lean lookup: the same partition and replicas as the KeyLocation, the same errors.
    stores = [
        store_record("strings", 6),
        store_record("numbers", 5, key_format=KeyFormat.INT64),
        store_record("crc", 3, partitioner=Partitioner.CRC32),
        store_record("empty", 0),
    ]
    served = {"a": {"strings": [0, 2, 4], "numbers": range(5), "crc": [1]}, "b": {"strings": range(6)}}
    table = RoutingTable.of(build_map(stores, served))
    keys = ["k", "", "東京", "a/b", "12", "-7", str(2**63), "1.5", "lone \udc80 surrogate"]
    compared = 0
    for store in ("strings", "numbers", "crc", "empty", "nope"):
        for key in keys:
            try:
                location = table.locate(store, key)
            except Exception as exc:  # noqa: BLE001 - whatever it is, serving_of raises the same
                with pytest.raises(type(exc)) as caught:
                    table.serving_of(store, key)
                assert str(caught.value) == str(exc)
                assert type(caught.value.__cause__) is type(exc.__cause__)
                continue
            assert table.serving_of(store, key) == (location.partition, location.serving)
            compared += 1
    assert compared >= 15
