"""keyroute.formats.value_format: values written by confluent-kafka's real Avro, Protobuf and JSON Schema serializers
(registering with the session's development registry) read as the rows the same content gives as JSON."""

from __future__ import annotations

import datetime as dt
import decimal
import json
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, timestamp_pb2

from keyroute.formats.value_format import ValueDecoder, check_value_format
from keyroute.keys.schema_registry import RegistrySettings, RegistryUnavailable, SchemaFetcher
from keyroute.storage.live import BadRecord, Merge, Reason, loads_json
from tests.util import free_port

LATEST = Merge("latest", "user", order_by="ts", columns=None)
EVENT = {
    "type": "record",
    "name": "Event",
    "namespace": "demo",
    "fields": [
        {"name": "user", "type": "string"},
        {"name": "amount", "type": "long"},
        {"name": "count", "type": "int"},
        {"name": "price", "type": "double"},
        {"name": "ok", "type": "boolean"},
        {"name": "note", "type": ["null", "string"], "default": None},
        {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "at_us", "type": {"type": "long", "logicalType": "timestamp-micros"}},
        {"name": "day", "type": {"type": "int", "logicalType": "date"}},
        {"name": "cost", "type": {"type": "bytes", "logicalType": "decimal", "precision": 20, "scale": 2}},
        {"name": "whole", "type": {"type": "bytes", "logicalType": "decimal", "precision": 30, "scale": 0}},
        {"name": "id", "type": {"type": "string", "logicalType": "uuid"}},
        {"name": "blob", "type": "bytes"},
        {"name": "maybe_ts", "type": ["null", {"type": "long", "logicalType": "timestamp-millis"}], "default": None},
        {
            "name": "where",
            "type": {"type": "record", "name": "Where", "fields": [{"name": "city", "type": "string"}]},
        },
        {"name": "tags", "type": {"type": "array", "items": "string"}},
    ],
}
MOMENT = dt.datetime(2024, 6, 11, 10, 0, 0, 123000, tzinfo=dt.UTC)
RECORD = {
    "user": "ann",
    "amount": 2**40 + 1,
    "count": 7,
    "price": 12.5,
    "ok": True,
    "note": None,
    "ts": MOMENT,
    "at_us": MOMENT + dt.timedelta(microseconds=456),
    "day": dt.date(2024, 6, 11),
    "cost": decimal.Decimal("12.30"),
    "whole": decimal.Decimal("123456789012345678901234"),
    "id": uuid.UUID("12345678-1234-5678-1234-567812345678"),
    "blob": b"\x00\xff",
    "maybe_ts": MOMENT,
    "where": {"city": "Oslo"},
    "tags": ["a", "b"],
}
# The same record as a JSON producer writes it (as Spark's to_json shows those types), read by the JSON path.
AS_JSON = {
    "user": "ann",
    "amount": 2**40 + 1,
    "count": 7,
    "price": 12.5,
    "ok": True,
    "note": None,
    "ts": "2024-06-11T10:00:00.123Z",
    "at_us": "2024-06-11T10:00:00.123456Z",
    "day": "2024-06-11",
    "cost": 12.3,
    "whole": 123456789012345678901234,
    "id": "12345678-1234-5678-1234-567812345678",
    "blob": "AP8=",
    "maybe_ts": "2024-06-11T10:00:00.123Z",
    "where": {"city": "Oslo"},
    "tags": ["a", "b"],
}


class CountingFetcher(SchemaFetcher):
    """A SchemaFetcher that counts the ids it is asked for (to prove the decoder asks once per id)."""

    asked: list[int]

    def by_id(self, schema_id: int, fmt: str | None = None) -> Any:
        self.asked.append(schema_id)
        return super().by_id(schema_id, fmt)


@pytest.fixture
def client(schema_registry: str) -> SchemaRegistryClient:
    return SchemaRegistryClient({"url": schema_registry})


@pytest.fixture
def topic() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


def decoder(
    schema_registry: str, value_format: str, merge: Merge = LATEST, store: str = "events"
) -> tuple[ValueDecoder, list[int]]:
    asked: list[int] = []

    def make() -> SchemaFetcher:
        fetcher = CountingFetcher(RegistrySettings(schema_registry), {})
        fetcher.asked = asked
        return fetcher

    return ValueDecoder(value_format, make, store=store, merge=merge), asked


def avro(client: SchemaRegistryClient, topic: str, schema: dict[str, Any]) -> Callable[[dict[str, Any]], bytes]:
    serializer = AvroSerializer(client, json.dumps(schema))
    ctx = SerializationContext(topic, MessageField.VALUE)
    return lambda record: serializer(record, ctx)


def test_avro_reads_as_the_json_record(client: SchemaRegistryClient, schema_registry: str, topic: str) -> None:
    write = avro(client, topic, EVENT)
    values, asked = decoder(schema_registry, "avro")
    row = values.decode(write(RECORD))
    assert row == loads_json(json.dumps(AS_JSON).encode())
    assert type(row["amount"]) is int and type(row["whole"]) is int
    for i in range(3):
        assert values.decode(write({**RECORD, "count": i}))["count"] == i
    assert len(asked) == 1  # one registry question per schema id, not per record


def test_avro_time_of_an_integer_order_by_stays_an_integer(
    client: SchemaRegistryClient, schema_registry: str, topic: str
) -> None:
    history = Merge("history", "user", order_by="ts", columns=None, time_type="integer")
    row = decoder(schema_registry, "avro", history)[0].decode(avro(client, topic, EVENT)(RECORD))
    assert row["ts"] == int(MOMENT.timestamp() * 1000)
    assert row["at_us"] == "2024-06-11T10:00:00.123456Z"  # not the order_by: shown as text


def test_schema_evolution_and_a_removed_needed_column(
    client: SchemaRegistryClient, schema_registry: str, topic: str
) -> None:
    fields = [{"name": "ts", "type": "long"}, {"name": "page", "type": "string"}, {"name": "agent", "type": "string"}]
    base = {"type": "record", "name": "Click", "fields": fields}
    added = {**base, "fields": [*fields, {"name": "ref", "type": "string", "default": "-"}]}
    removed = {**base, "fields": [*fields[:2], added["fields"][3]]}  # agent gone: the store does not use it
    merge = Merge("latest", "user", order_by="ts", columns=("ts", "page"))
    values = decoder(schema_registry, "avro", merge, store="clicks")[0]
    first = {"ts": 1, "page": "/a", "agent": "curl"}
    assert values.decode(avro(client, topic, base)(first)) == first
    assert values.decode(avro(client, topic, added)({**first, "ref": "x"})) == {**first, "ref": "x"}
    third = {"ts": 3, "page": "/c", "ref": "y"}
    assert values.decode(avro(client, topic, removed)(third)) == third
    assert len(client.get_versions(f"{topic}-value")) == 3  # each a new schema id, accepted as BACKWARD

    client.set_compatibility(f"{topic}-value", "NONE")
    no_ts = {**base, "fields": fields[1:]}
    data = avro(client, topic, no_ts)({"page": "/c", "agent": "curl"})
    schema_id = int.from_bytes(data[1:5], "big")
    with pytest.raises(BadRecord) as err:
        values.decode(data)
    assert err.value.reason is Reason.MISSING_COLUMN
    assert str(err.value).startswith(f"schema id {schema_id} has no field 'ts', which store 'clicks' needs")


def test_bad_values_are_named(client: SchemaRegistryClient, schema_registry: str, topic: str) -> None:
    values = decoder(schema_registry, "avro")[0]
    good = avro(client, topic, EVENT)(RECORD)
    json_id = client.register_schema(f"{topic}-j", Schema('{"type": "object"}', "JSON"))
    cases = [
        (b'{"user": "ann"}', Reason.NOT_WIRE_FORMAT),
        (b"\x00\x00\x01", Reason.NOT_WIRE_FORMAT),
        (b"\x00" + (987654).to_bytes(4, "big") + good[5:], Reason.UNKNOWN_SCHEMA),
        (b"\x00" + json_id.to_bytes(4, "big") + b"{}", Reason.UNKNOWN_SCHEMA),
        (good[:12], Reason.BAD_PAYLOAD),
        (good + b"\x00", Reason.BAD_PAYLOAD),
    ]
    for value, reason in cases:
        with pytest.raises(BadRecord) as err:
            values.decode(value)
        assert err.value.reason is reason, value
    assert "schema id 987654" in str(pytest.raises(BadRecord, values.decode, cases[2][0]).value)
    assert values.decode(good)["user"] == "ann"  # and the next good record still reads


def test_an_unreachable_registry_is_not_a_bad_record(
    client: SchemaRegistryClient, schema_registry: str, topic: str
) -> None:
    data = avro(client, topic, EVENT)(RECORD)
    down = RegistrySettings(f"http://127.0.0.1:{free_port()}", {"max.retries": "0"})
    values = ValueDecoder("avro", lambda: SchemaFetcher(down, {}), store="events", merge=LATEST)
    with pytest.raises(RegistryUnavailable):
        values.decode(data)
    unset = RegistrySettings(schema_registry, {"basic.auth.user.info": "${KEYROUTE_TEST_UNSET}"})
    values = ValueDecoder("avro", lambda: SchemaFetcher(unset, {}), store="events", merge=LATEST)
    with pytest.raises(RegistryUnavailable, match="KEYROUTE_TEST_UNSET"):
        values.decode(data)


def _event_class() -> Any:
    proto = descriptor_pb2.FileDescriptorProto(name="events.proto", package="demo", syntax="proto3")
    proto.dependency.append("google/protobuf/timestamp.proto")
    F = descriptor_pb2.FieldDescriptorProto
    kind = proto.enum_type.add(name="Kind")
    kind.value.add(name="VIEW", number=0)
    kind.value.add(name="BUY", number=1)
    where = proto.message_type.add(name="Where")
    where.field.add(name="city", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    event = proto.message_type.add(name="Event")
    fields = [
        ("user", F.TYPE_STRING, None),
        ("amount", F.TYPE_INT64, None),
        ("price", F.TYPE_DOUBLE, None),
        ("kind", F.TYPE_ENUM, ".demo.Kind"),
        ("where", F.TYPE_MESSAGE, ".demo.Where"),
        ("at", F.TYPE_MESSAGE, ".google.protobuf.Timestamp"),
        ("blob", F.TYPE_BYTES, None),
    ]
    for number, (name, type_, type_name) in enumerate(fields, start=1):
        field = event.field.add(name=name, number=number, type=type_, label=F.LABEL_OPTIONAL)
        if type_name:
            field.type_name = type_name
    event.field.add(name="tags", number=9, type=F.TYPE_STRING, label=F.LABEL_REPEATED)
    pool = descriptor_pool.DescriptorPool()
    known = descriptor_pb2.FileDescriptorProto()
    timestamp_pb2.DESCRIPTOR.CopyToProto(known)
    pool.Add(known)
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("demo.Event"))


def test_protobuf_reads_as_the_json_record(client: SchemaRegistryClient, schema_registry: str, topic: str) -> None:
    event = _event_class()
    serializer = ProtobufSerializer(event, client, {"use.deprecated.format": False})
    message = event(user="bo", amount=2**40, price=2.5, kind=1, tags=["x"], blob=b"\x01")
    message.where.city = "Rome"
    message.at.FromDatetime(MOMENT.replace(tzinfo=None))
    data = serializer(message, SerializationContext(topic, MessageField.VALUE))
    values, asked = decoder(schema_registry, "protobuf", Merge("latest", "user", order_by="amount"))
    row = values.decode(data)
    assert row == {
        "user": "bo",
        "amount": 2**40,
        "price": 2.5,
        "kind": "BUY",
        "where": {"city": "Rome"},
        "at": "2024-06-11T10:00:00.123Z",
        "blob": "AQ==",
        "tags": ["x"],
    }
    empty = values.decode(serializer(event(user="cy"), SerializationContext(topic, MessageField.VALUE)))
    assert (empty["amount"], empty["where"], empty["kind"]) == (0, None, "VIEW")
    assert len(asked) == 1
    with pytest.raises(BadRecord) as err:
        values.decode(data[:6] + b"\xff\xff\xff")
    assert err.value.reason is Reason.BAD_PAYLOAD


def test_json_schema_reads_as_the_json_record(client: SchemaRegistryClient, schema_registry: str, topic: str) -> None:
    schema = {"type": "object", "properties": {"user": {"type": "string"}, "ts": {"type": "integer"}}}
    serializer = JSONSerializer(json.dumps(schema), client)
    data = serializer({"user": "di", "ts": 2**62}, SerializationContext(topic, MessageField.VALUE))
    values = decoder(schema_registry, "json_schema")[0]
    assert values.decode(data) == {"user": "di", "ts": 2**62}
    for payload in (b"[1]", b"{nope", b'{"user": "di", "ts": "not an integer"}'):
        with pytest.raises(BadRecord) as err:
            values.decode(data[:5] + payload)
        assert err.value.reason is Reason.BAD_PAYLOAD
    assert "does not match schema id" in str(err.value) and "'not an integer' is not of type 'integer'" in str(
        err.value
    )


def test_value_format_needs_a_registry_exactly_when_it_is_one() -> None:
    check_value_format("json", None)
    check_value_format("protobuf", RegistrySettings("http://r"))
    with pytest.raises(ValueError, match="needs a schema_registry"):
        check_value_format("json_schema", None)
    with pytest.raises(ValueError, match="unknown value_format"):
        check_value_format("thrift", None)


def test_protobuf_references_are_resolved(client: SchemaRegistryClient, schema_registry: str, topic: str) -> None:
    F = descriptor_pb2.FieldDescriptorProto
    money = descriptor_pb2.FileDescriptorProto(name=f"{topic}/money.proto", package="shop", syntax="proto3")
    cents = money.message_type.add(name="Money")
    cents.field.add(name="cents", number=1, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
    order = descriptor_pb2.FileDescriptorProto(name=f"{topic}/order.proto", package="shop", syntax="proto3")
    order.dependency.append(money.name)
    message = order.message_type.add(name="Order")
    message.field.add(name="id", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    message.field.add(name="price", number=2, type=F.TYPE_MESSAGE, label=F.LABEL_OPTIONAL, type_name=".shop.Money")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(money)
    pool.Add(order)
    cls = message_factory.GetMessageClass(pool.FindMessageTypeByName("shop.Order"))
    data = ProtobufSerializer(cls, client, {"use.deprecated.format": False})(
        cls(id="o1", price={"cents": 2**33}), SerializationContext(topic, MessageField.VALUE)
    )
    registered = client.get_latest_version(f"{topic}-value").schema
    assert [r.name for r in registered.references] == [money.name]  # the serializer registered the import
    merge = Merge("latest", "id", order_by="id")
    assert decoder(schema_registry, "protobuf", merge)[0].decode(data) == {"id": "o1", "price": {"cents": 2**33}}


ORDER_PROTO = """
syntax = "proto3";
package shop;
import "google/protobuf/timestamp.proto";
enum Kind { VIEW = 0; BUY = 1; }
message Order {
  string id = 1;
  int64 cents = 2;
  Kind kind = 3;
  map<string, int64> counts = 4;
  optional string note = 5;
  google.protobuf.Timestamp at = 6;
  oneof pay { string card = 7; int32 cash = 8; }
  message Line { string sku = 1; }
  repeated Line lines = 9;
}
"""


def _order_class() -> Any:
    """The message ORDER_PROTO describes, written out as a descriptor by hand (independent of the parser)."""
    F = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(name="order.proto", package="shop", syntax="proto3")
    proto.dependency.append("google/protobuf/timestamp.proto")
    kind = proto.enum_type.add(name="Kind")
    kind.value.add(name="VIEW", number=0)
    kind.value.add(name="BUY", number=1)
    order = proto.message_type.add(name="Order")
    entry = order.nested_type.add(name="CountsEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    entry.field.add(name="value", number=2, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
    order.nested_type.add(name="Line").field.add(name="sku", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    order.oneof_decl.add(name="pay")
    order.oneof_decl.add(name="_note")
    for name, number, type_, extra in (
        ("id", 1, F.TYPE_STRING, {}),
        ("cents", 2, F.TYPE_INT64, {}),
        ("kind", 3, F.TYPE_ENUM, {"type_name": ".shop.Kind"}),
        ("counts", 4, F.TYPE_MESSAGE, {"type_name": ".shop.Order.CountsEntry", "label": F.LABEL_REPEATED}),
        ("note", 5, F.TYPE_STRING, {"proto3_optional": True, "oneof_index": 1}),
        ("at", 6, F.TYPE_MESSAGE, {"type_name": ".google.protobuf.Timestamp"}),
        ("card", 7, F.TYPE_STRING, {"oneof_index": 0}),
        ("cash", 8, F.TYPE_INT32, {"oneof_index": 0}),
        ("lines", 9, F.TYPE_MESSAGE, {"type_name": ".shop.Order.Line", "label": F.LABEL_REPEATED}),
    ):
        order.field.add(name=name, number=number, type=type_, **{"label": F.LABEL_OPTIONAL, **extra})
    pool = descriptor_pool.DescriptorPool()
    known = descriptor_pb2.FileDescriptorProto()
    timestamp_pb2.DESCRIPTOR.CopyToProto(known)
    pool.Add(known)
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("shop.Order"))


def test_a_protobuf_schema_registered_as_proto_text_is_read(
    client: SchemaRegistryClient, schema_registry: str, topic: str
) -> None:
    schema_id = client.register_schema(f"{topic}-value", Schema(ORDER_PROTO, "PROTOBUF"))
    order = _order_class()
    message = order(id="o7", cents=2**35, kind=1, note="gift", cash=3)
    message.counts["a"] = 2
    message.lines.add(sku="s1")
    message.at.FromDatetime(MOMENT.replace(tzinfo=None))
    data = b"\x00" + schema_id.to_bytes(4, "big") + b"\x00" + message.SerializeToString()  # message index [0]
    values = decoder(schema_registry, "protobuf", Merge("latest", "id", order_by="cents"))[0]
    assert values.decode(data) == {
        "id": "o7",
        "cents": 2**35,
        "kind": "BUY",
        "counts": {"a": 2},
        "note": "gift",
        "at": "2024-06-11T10:00:00.123Z",
        "card": None,
        "cash": 3,
        "lines": [{"sku": "s1"}],
    }
    bare = values.decode(b"\x00" + schema_id.to_bytes(4, "big") + b"\x00" + order(id="o8").SerializeToString())
    assert (bare["note"], bare["card"], bare["cash"], bare["cents"]) == (None, None, None, 0)
