"""The development Schema Registry (keyroute.dev.schema_registry_dev) driven by confluent-kafka's real
SchemaRegistryClient and serializers over HTTP (the session's registry process), plus its rules in-process."""

from __future__ import annotations

import json
import socket
import uuid
from pathlib import Path

import httpx
import pytest
from confluent_kafka.schema_registry import Schema, SchemaReference, SchemaRegistryClient, SchemaRegistryError
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONDeserializer, JSONSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer, ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from keyroute.cli import main
from keyroute.dev.schema_registry_dev import Registry, RegistryError, avro_incompatibility
from tests.util import Proc, free_port, wait_for

EVENT = {
    "type": "record",
    "name": "Event",
    "namespace": "demo",
    "fields": [{"name": "user", "type": "string"}, {"name": "amount", "type": "long"}],
}


def _with_field(schema: dict, field: dict) -> str:
    return json.dumps({**schema, "fields": [*schema["fields"], field]})


@pytest.fixture
def client(schema_registry: str) -> SchemaRegistryClient:
    return SchemaRegistryClient({"url": schema_registry})


@pytest.fixture
def topic() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


def test_avro_serializer_registers_and_deserializer_reads_by_id(client: SchemaRegistryClient, topic: str) -> None:
    ctx = SerializationContext(topic, MessageField.VALUE)
    data = AvroSerializer(client, json.dumps(EVENT))({"user": "ann", "amount": 2**40}, ctx)
    assert data[0] == 0
    schema_id = int.from_bytes(data[1:5], "big")
    fresh = SchemaRegistryClient({"url": client._rest_client.base_urls[0]})  # no cache: fetched by id over HTTP
    assert AvroDeserializer(fresh)(data, ctx) == {"user": "ann", "amount": 2**40}
    latest = fresh.get_latest_version(f"{topic}-value")
    assert (latest.schema_id, latest.version, latest.schema.schema_type) == (schema_id, 1, "AVRO")
    assert fresh.get_versions(f"{topic}-value") == [1]
    assert f"{topic}-value" in fresh.get_subjects()
    # the same schema under another subject keeps its id; registering it again is the same version
    assert fresh.register_schema(f"{topic}-other", Schema(json.dumps(EVENT), "AVRO")) == schema_id
    assert fresh.register_schema(f"{topic}-value", Schema(json.dumps(EVENT), "AVRO")) == schema_id
    found = fresh.lookup_schema(f"{topic}-value", Schema(json.dumps(EVENT), "AVRO"))
    assert (found.schema_id, found.version) == (schema_id, 1)
    versions = httpx.get(f"{client._rest_client.base_urls[0]}/schemas/ids/{schema_id}/versions").json()
    assert {"subject": f"{topic}-value", "version": 1} in versions
    assert {"subject": f"{topic}-other", "version": 1} in versions


def test_protobuf_and_json_schema_serializers_round_trip(client: SchemaRegistryClient, topic: str) -> None:
    proto = descriptor_pb2.FileDescriptorProto(name=f"{topic}.proto", package="demo", syntax="proto3")
    message = proto.message_type.add(name="Event")
    message.field.add(name="user", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING, label=1)
    message.field.add(name="amount", number=2, type=descriptor_pb2.FieldDescriptorProto.TYPE_INT64, label=1)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    event = message_factory.GetMessageClass(pool.FindMessageTypeByName("demo.Event"))
    ctx = SerializationContext(topic, MessageField.VALUE)
    data = ProtobufSerializer(event, client, {"use.deprecated.format": False})(event(user="bo", amount=7), ctx)
    decoded = ProtobufDeserializer(event, {"use.deprecated.format": False})(data, ctx)
    assert (decoded.user, decoded.amount) == ("bo", 7)
    assert client.get_latest_version(f"{topic}-value").schema.schema_type == "PROTOBUF"

    schema = json.dumps({"type": "object", "properties": {"user": {"type": "string"}, "amount": {"type": "integer"}}})
    jctx = SerializationContext(f"{topic}-j", MessageField.VALUE)
    jdata = JSONSerializer(schema, client)({"user": "cy", "amount": 3}, jctx)
    assert JSONDeserializer(None, schema_registry_client=client)(jdata, jctx) == {"user": "cy", "amount": 3}
    assert client.get_latest_version(f"{topic}-j-value").schema.schema_type == "JSON"


def test_references_resolve(client: SchemaRegistryClient, topic: str) -> None:
    money = {"type": "record", "name": "Money", "namespace": "demo", "fields": [{"name": "cents", "type": "long"}]}
    client.register_schema(f"{topic}-money", Schema(json.dumps(money), "AVRO"))
    price = {"name": "price", "type": "demo.Money"}
    order = {"type": "record", "name": "Order", "namespace": "demo", "fields": [price]}
    refs = [SchemaReference("demo.Money", f"{topic}-money", 1)]
    schema_id = client.register_schema(f"{topic}-order", Schema(json.dumps(order), "AVRO", refs))
    assert [r.subject for r in client.get_schema(schema_id).references] == [f"{topic}-money"]
    with pytest.raises(SchemaRegistryError) as err:  # without the reference the name is unknown
        client.register_schema(f"{topic}-order2", Schema(json.dumps(order), "AVRO"))
    assert err.value.error_code == 42201


def test_backward_compatibility_for_avro(client: SchemaRegistryClient, topic: str) -> None:
    subject = f"{topic}-value"
    client.register_schema(subject, Schema(json.dumps(EVENT), "AVRO"))
    with_default = _with_field(EVENT, {"name": "note", "type": "string", "default": ""})
    without_default = _with_field(EVENT, {"name": "note", "type": "string"})
    assert client.test_compatibility(subject, Schema(with_default, "AVRO"))
    assert not client.test_compatibility(subject, Schema(without_default, "AVRO"))
    with pytest.raises(SchemaRegistryError) as err:
        client.register_schema(subject, Schema(without_default, "AVRO"))
    assert (err.value.http_status_code, err.value.error_code) == (409, 409)
    assert "note" in err.value.error_message
    assert client.register_schema(subject, Schema(with_default, "AVRO")) != client.get_version(subject, 1).schema_id
    removed = json.dumps({**EVENT, "fields": [EVENT["fields"][0]]})  # dropping a field: still BACKWARD
    client.register_schema(subject, Schema(removed, "AVRO"))
    assert client.get_versions(subject) == [1, 2, 3]
    client.set_compatibility(subject, "NONE")
    assert client.get_compatibility(subject) == "NONE"
    assert client.test_compatibility(subject, Schema(without_default, "AVRO"))


def test_avro_rules() -> None:
    old = json.dumps(EVENT)
    widened = json.dumps({**EVENT, "fields": [EVENT["fields"][0], {"name": "amount", "type": "double"}]})
    assert avro_incompatibility(widened, old, "BACKWARD") is None  # long is promoted to double
    assert "double cannot be read as long" in avro_incompatibility(widened, old, "FORWARD")
    nullable = json.dumps({**EVENT, "fields": [EVENT["fields"][0], {"name": "amount", "type": ["null", "long"]}]})
    assert avro_incompatibility(nullable, old, "BACKWARD") is None
    assert avro_incompatibility(nullable, old, "FULL") is not None  # null cannot be read as long
    assert avro_incompatibility(old, old, "FULL_TRANSITIVE") is None


def test_errors_have_the_registry_shape(client: SchemaRegistryClient, schema_registry: str, topic: str) -> None:
    cases = [
        (lambda: client.get_latest_version(f"{topic}-none"), 404, 40401),
        (lambda: client.get_schema(987654), 404, 40403),
        (lambda: client.register_schema(f"{topic}-bad", Schema("{not json", "AVRO")), 422, 42201),
        (lambda: client.register_schema(f"{topic}-bad", Schema('{"type": "nope"}', "AVRO")), 422, 42201),
    ]
    for call, status, code in cases:
        with pytest.raises(SchemaRegistryError) as err:
            call()
        assert (err.value.http_status_code, err.value.error_code) == (status, code)
    client.register_schema(f"{topic}-value", Schema(json.dumps(EVENT), "AVRO"))
    with pytest.raises(SchemaRegistryError) as err:
        client.get_version(f"{topic}-value", 9)
    assert err.value.error_code == 40402
    answer = httpx.get(f"{schema_registry}/subjects/{topic}-value/versions/x")
    assert answer.status_code == 422 and answer.json()["error_code"] == 42202
    answer = httpx.put(f"{schema_registry}/config/{topic}-value", json={"compatibility": "SIDEWAYS"})
    assert answer.status_code == 422 and answer.json()["error_code"] == 42203


def test_delete_soft_then_permanent(client: SchemaRegistryClient, topic: str) -> None:
    subject = f"{topic}-value"
    schema_id = client.register_schema(subject, Schema(json.dumps(EVENT), "AVRO"))
    assert client.delete_subject(subject) == [1]
    assert subject not in client.get_subjects()
    assert client.get_schema(schema_id).schema_str  # ids stay readable: old records still decode
    assert client.delete_subject(subject, permanent=True) == [1]
    client.register_schema(subject, Schema(json.dumps(EVENT), "AVRO"))
    assert client.delete_version(subject, 1) == 1


def test_state_persists_in_the_data_file(tmp_path: Path) -> None:
    data = tmp_path / "registry.json"
    registry = Registry(data)
    first = registry.register("a-value", {"schema": json.dumps(EVENT)})
    registry.set_level("a-value", {"compatibility": "FULL"})
    again = Registry(data)
    assert again.get_version("a-value", "latest", False) == first
    assert again.get_level("a-value", False) == {"compatibilityLevel": "FULL"}
    assert again.register("b-value", {"schema": json.dumps(EVENT)})["id"] == first["id"]
    with pytest.raises(RegistryError):
        again.get_level("b-value", False)


def test_cli_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    assert main(["schema-registry", "--port", str(free_port()), "--data", str(broken)]) == 1
    err = capsys.readouterr().err
    assert "not a schema registry data file" in err and err.count("\n") == 1
    with socket.create_server(("127.0.0.1", 0)) as taken:
        assert main(["schema-registry", "--port", str(taken.getsockname()[1])]) == 1
    err = capsys.readouterr().err
    assert "cannot listen on" in err and err.count("\n") == 1
    with pytest.raises(SystemExit) as exit_:
        main(["schema-registry", "--port", "70000"])
    assert exit_.value.code == 2
    assert "a port is between 1 and 65535" in capsys.readouterr().err


def test_process_keeps_schemas_across_a_restart(tmp_path: Path) -> None:
    port, data = free_port(), tmp_path / "registry.json"
    url = f"http://127.0.0.1:{port}"
    for round_ in range(2):
        proc = Proc(["schema-registry", "--port", str(port), "--data", str(data)], tmp_path / "log").start()
        try:
            wait_for(lambda: httpx.get(f"{url}/subjects", timeout=2).status_code == 200, message="the registry")
            client = SchemaRegistryClient({"url": url})
            if round_ == 0:
                schema_id = client.register_schema("kept-value", Schema(json.dumps(EVENT), "AVRO"))
            else:
                assert client.get_latest_version("kept-value").schema_id == schema_id
        finally:
            proc.stop()
