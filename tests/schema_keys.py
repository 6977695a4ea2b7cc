"""Keys serialized by confluent-kafka's real Schema Registry serializers, for the key-schema tests.

`SERIALIZERS[kind]` makes, for one registry client, a function from a key value to the bytes the producer's
key serializer writes, and the `KeySchema` a build would record for it (id and registered text).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from keyroute.keys.key_format import KeyFormat
from keyroute.keys.key_schema import KeySchema

AVRO_SCHEMAS = {
    "string": '"string"',
    "long": '"long"',
    "record": orjson.dumps(
        {
            "type": "record",
            "name": "BookingKey",
            "fields": [
                {"name": "region", "type": "string"},
                {"name": "id", "type": "long"},
                {"name": "channel", "type": ["null", "string"], "default": None},
            ],
        }
    ).decode(),
}
JSON_SCHEMAS = {
    "string": '{"type": "string"}',
    "long": '{"type": "integer"}',
    "record": orjson.dumps(
        {
            "type": "object",
            "properties": {"region": {"type": "string"}, "id": {"type": "integer"}},
            "required": ["region", "id"],
            "additionalProperties": False,
        }
    ).decode(),
}
# Protobuf keys are messages: one scalar field for a primitive key, several for a record key.
PROTO_FIELDS = {
    "string": [("id", "TYPE_STRING")],
    "long": [("id", "TYPE_INT64")],
    "record": [("region", "TYPE_STRING"), ("id", "TYPE_INT64")],
}

# Key values as a producer holds them, and the text a reader writes for them.
VALUES: dict[str, list[Any]] = {
    "string": ["alice", "", "ünïcödé ✓", "x" * 300, "{not json", *(f"customer-{i:04d}" for i in range(0, 2000, 97))],
    "long": [0, 1, -1, 42, 2**63 - 1, -(2**63), 1 << 40, *range(1000, 1600, 29)],
    "record": [
        {"region": "eu", "id": 7},
        {"region": "", "id": -3},
        {"region": "ap-südost", "id": 2**62},
        *({"region": ("eu", "us", "ap")[i % 3], "id": i * 7919} for i in range(20)),
    ],
}


def key_text(kind: str, value: Any) -> str:
    if kind == "record":
        return orjson.dumps(value).decode()
    return str(value)


def _proto_class(kind: str, name: str) -> type:
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    proto = descriptor_pb2.FileDescriptorProto(name=f"{name}.proto", package="keys", syntax="proto3")
    message = proto.message_type.add(name=name)
    for number, (field, kind_name) in enumerate(PROTO_FIELDS[kind], start=1):
        message.field.add(
            name=field,
            number=number,
            type=getattr(descriptor_pb2.FieldDescriptorProto, kind_name),
            label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
        )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"keys.{name}"))


def serializer(
    fmt: KeyFormat, kind: str, registry: Any, topic: str
) -> tuple[Callable[[Any], bytes], Callable[[], KeySchema]]:
    """(value -> the key bytes the producer writes to `topic`, () -> the key schema registered for it)."""
    from confluent_kafka.serialization import MessageField, SerializationContext

    ctx = SerializationContext(topic, MessageField.KEY)
    if fmt is KeyFormat.AVRO:
        from confluent_kafka.schema_registry.avro import AvroSerializer

        avro = AvroSerializer(registry, AVRO_SCHEMAS[kind])
        write = lambda value: avro(value, ctx)  # noqa: E731
    elif fmt is KeyFormat.JSON_SCHEMA:
        from confluent_kafka.schema_registry.json_schema import JSONSerializer

        js = JSONSerializer(JSON_SCHEMAS[kind], registry)
        write = lambda value: js(value, ctx)  # noqa: E731
    else:
        from confluent_kafka.schema_registry.protobuf import ProtobufSerializer

        cls = _proto_class(kind, f"{kind.capitalize()}Key")
        pb = ProtobufSerializer(cls, registry, {"use.deprecated.format": False})
        fields = [f for f, _ in PROTO_FIELDS[kind]]
        write = lambda value: pb(cls(**(value if kind == "record" else {fields[0]: value})), ctx)  # noqa: E731

    def schema() -> KeySchema:
        registered = registry.get_latest_version(f"{topic}-key")
        return KeySchema(fmt, registered.schema_id, registered.schema.schema_str)

    return write, schema
