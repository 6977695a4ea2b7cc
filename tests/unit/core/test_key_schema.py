"""Schema Registry keys: keyroute makes, from a key's text, exactly the bytes confluent-kafka's serializers
write (checked against the real serializers and an in-process mock registry)."""

from __future__ import annotations

import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry._sync.mock_schema_registry_client import MockSchemaRegistryClient

from keyroute.keys.key_format import KeyFormat, KeyFormatError, key_from_data, key_from_value, parse_key
from keyroute.keys.key_schema import KeySchema, KeySchemaChanged, zigzag_varint
from tests.schema_keys import VALUES, key_text, serializer

FORMATS = [KeyFormat.AVRO, KeyFormat.PROTOBUF, KeyFormat.JSON_SCHEMA]
KINDS = ["string", "long", "record"]


@pytest.fixture
def registry() -> SchemaRegistryClient:
    # In process, one store per client: confluent-kafka's own mock of the registry, for unit tests.
    return MockSchemaRegistryClient({"url": "mock://localhost"})


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_key_text_serializes_to_the_producers_bytes(fmt: KeyFormat, kind: str, registry: SchemaRegistryClient) -> None:
    write, registered = serializer(fmt, kind, registry, f"t-{fmt.value}-{kind}")
    produced = [write(value) for value in VALUES[kind]]
    schema = registered()
    for value, data in zip(VALUES[kind], produced, strict=True):
        text = key_text(kind, value)
        key = parse_key(fmt, text, schema)
        assert key.data == data, (fmt, kind, value)
        assert key_from_value(fmt, value, schema).data == data
        back = key_from_data(fmt, data, schema)
        assert back == key
        assert parse_key(fmt, back.text, schema) == key


def test_avro_string_key_is_prefix_zigzag_length_and_utf8() -> None:
    schema = KeySchema(KeyFormat.AVRO, 258, '"string"')
    assert parse_key(KeyFormat.AVRO, "hé", schema).data == b"\x00\x00\x00\x01\x02" + bytes([6]) + "hé".encode()
    assert zigzag_varint(-1) == b"\x01" and zigzag_varint(64) == b"\x80\x01"


def test_record_key_text_is_canonical_in_schema_field_order(registry: SchemaRegistryClient) -> None:
    write, registered = serializer(KeyFormat.AVRO, "record", registry, "t")
    data = write({"region": "eu", "id": 7})
    key = parse_key(KeyFormat.AVRO, '{"id": 7, "region": "eu"}', registered())
    assert key.data == data
    assert key.text == '{"region":"eu","id":7,"channel":null}'


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_a_record_key_that_does_not_fit_names_the_field(fmt: KeyFormat, registry: SchemaRegistryClient) -> None:
    _, registered = serializer(fmt, "record", registry, "t")
    write, _ = serializer(fmt, "record", registry, "t")
    write({"region": "eu", "id": 1})
    schema = registered()
    with pytest.raises(KeyFormatError, match="'id'"):
        parse_key(fmt, '{"region": "eu", "id": "seven"}', schema)
    with pytest.raises(KeyFormatError, match="'colour'"):
        parse_key(fmt, '{"region": "eu", "id": 1, "colour": "red"}', schema)
    with pytest.raises(KeyFormatError, match="JSON object"):
        parse_key(fmt, "eu-1", schema)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_a_long_key_that_is_not_a_number_is_refused(fmt: KeyFormat, registry: SchemaRegistryClient) -> None:
    write, registered = serializer(fmt, "long", registry, "t")
    write(1)
    with pytest.raises(KeyFormatError, match="not a valid"):
        parse_key(fmt, "twelve", registered())
    with pytest.raises(KeyFormatError, match="does not fit|must be"):
        parse_key(fmt, str(2**63), registered())


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_bytes_under_another_schema_id_are_a_schema_change(fmt: KeyFormat, registry: SchemaRegistryClient) -> None:
    write, registered = serializer(fmt, "string", registry, "t")
    data = write("alice")
    schema = registered()
    other = KeySchema(fmt, schema.schema_id + 1, schema.schema)
    with pytest.raises(KeySchemaChanged) as err:
        key_from_data(fmt, data, other)
    assert err.value.schema_id == schema.schema_id
    with pytest.raises(KeyFormatError, match="wire format"):
        key_from_data(fmt, b"alice", schema)


def test_schema_formats_need_the_store_key_schema() -> None:
    with pytest.raises(KeyFormatError, match="key schema"):
        parse_key(KeyFormat.AVRO, "alice")


def test_a_schema_that_cannot_make_keys_is_refused() -> None:
    with pytest.raises(ValueError, match="not supported"):
        KeySchema(KeyFormat.AVRO, 1, '{"type": "array", "items": "string"}').codec  # noqa: B018
    with pytest.raises(ValueError, match="FileDescriptorProto"):
        KeySchema(KeyFormat.PROTOBUF, 1, 'syntax = "proto3"; message K { string id = 1; }').codec  # noqa: B018


def test_key_schema_round_trips_through_its_record_form() -> None:
    schema = KeySchema(KeyFormat.PROTOBUF, 9, "AAAA", "keys.K")
    assert KeySchema.from_dict(schema.to_dict()) == schema


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_a_string_key_with_a_lone_surrogate_is_refused(fmt: KeyFormat, registry: SchemaRegistryClient) -> None:
    write, registered = serializer(fmt, "string", registry, "t")
    write("a")
    with pytest.raises(KeyFormatError, match="lone surrogate"):
        parse_key(fmt, "a\udc80", registered())


def test_a_json_schema_with_constraints_is_checked_by_its_validator() -> None:
    schema = KeySchema(KeyFormat.JSON_SCHEMA, 3, '{"type": "string", "maxLength": 3}')
    assert parse_key(KeyFormat.JSON_SCHEMA, "abc", schema).data == b'\x00\x00\x00\x00\x03"abc"'
    with pytest.raises(KeyFormatError, match="too long"):
        parse_key(KeyFormat.JSON_SCHEMA, "abcd", schema)


def test_store_records_and_manifests_carry_the_key_schema() -> None:
    from keyroute.cluster.partition_map import StoreRecord
    from keyroute.keys.partitioner import Partitioner
    from keyroute.storage.snapshot import Manifest

    schema = KeySchema(KeyFormat.AVRO, 12, '"string"')
    record = StoreRecord("s", 3, Partitioner.MURMUR2, KeyFormat.AVRO, 1, "/snap", key_schema=schema)
    assert StoreRecord.from_json(record.to_json()) == record
    plain = StoreRecord("s", 3, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/snap")
    assert b"key_schema" not in plain.to_json()  # records of other stores are as before
    manifest = Manifest("s", 1, 3, Partitioner.MURMUR2, KeyFormat.AVRO, ("v",), (0, 0, 0), key_schema=schema)
    assert Manifest.from_json(manifest.to_json()).key_schema == schema
