"""Live stores whose values are written by confluent-kafka's real Avro, Protobuf and JSON Schema serializers, on
real processes: the session's development Schema Registry process, librdkafka's mock cluster and one
`keyroute node` process following three stores at once.

One node serves every store here (a lean cluster for several checks): each answer equals an independent fold
of the records as the test produced them, through a kill -9 mid-stream; the Avro schema evolves (a field added
with a default, then a field the store does not use removed) without a restart, and a schema that drops a
column the store needs is skipped and named; bad values are counted by reason; a registry cut off stalls the
partition (shown in its live status) until it answers again."""

from __future__ import annotations

import json
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from keyroute.dev.kafka_mock import MockKafka
from keyroute.keys.schema_registry import RegistrySettings
from keyroute.runtime.settings import ZkSettings
from keyroute.storage.live import Aggregate, Merge
from tests.integration.test_live_node import PARTITIONS, LiveNode, keys_of, partition, publish_live_store
from tests.util import TcpProxy

pytestmark = pytest.mark.integration

TOTALS = Merge(
    "aggregate",
    "user",
    aggregates=(
        Aggregate("n", "count", None),
        Aggregate("total", "sum", "amount"),
        Aggregate("page", "max_by", "page", "ts"),
    ),
)
LATEST = Merge("latest", "user", order_by="ts", columns=("ts", "page"))
CLICK = {
    "type": "record",
    "name": "Click",
    "namespace": "it",
    "fields": [
        {"name": "user", "type": "string"},
        {"name": "ts", "type": "long"},
        {"name": "page", "type": "string"},
        {"name": "amount", "type": "long"},
        {"name": "agent", "type": "string"},
    ],
}


def _avro_schema(fields: list[dict[str, Any]]) -> str:
    return json.dumps({**CLICK, "fields": fields})


def _proto_click() -> Any:
    proto = descriptor_pb2.FileDescriptorProto(
        name=f"click-{uuid.uuid4().hex[:6]}.proto", package="it", syntax="proto3"
    )
    message = proto.message_type.add(name="Click")
    F = descriptor_pb2.FieldDescriptorProto
    for number, (name, kind) in enumerate((("user", F.TYPE_STRING), ("ts", F.TYPE_INT64), ("page", F.TYPE_STRING)), 1):
        message.field.add(name=name, number=number, type=kind, label=F.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("it.Click"))


class Stores:
    """Three live stores on one node, their topics and serializers, and what the test produced."""

    def __init__(self, tmp: Path, zk_settings: ZkSettings, kafka: MockKafka, registry_url: str) -> None:
        self.registry = SchemaRegistryClient({"url": registry_url})
        self.proxy = TcpProxy(("127.0.0.1", int(registry_url.rsplit(":", 1)[1])))
        run = uuid.uuid4().hex[:8]
        self.topics = {name: f"{name}-{run}" for name in ("avro", "proto", "jsons")}
        for topic in self.topics.values():
            kafka.create_topic(topic, PARTITIONS)
        # The Avro store reaches the registry through a relay the test can cut; no retries inside one fetch.
        through_proxy = RegistrySettings(f"http://{self.proxy.address}", {"max.retries": "0", "timeout": "2"})
        direct = RegistrySettings(registry_url)
        publish = [
            ("totals", self.topics["avro"], TOTALS, "avro", through_proxy),
            ("clicks", self.topics["proto"], LATEST, "protobuf", direct),
            ("visits", self.topics["jsons"], LATEST, "json_schema", direct),
        ]
        for store, topic, merge, value_format, registry in publish:
            publish_live_store(
                tmp, zk_settings, store, topic, kafka.bootstrap_servers, merge,
                value_format=value_format, schema_registry=registry,
            )  # fmt: skip
        self.node = LiveNode(tmp, zk_settings, kafka.bootstrap_servers, self.topics["avro"])
        self.avro_fields = list(CLICK["fields"])
        self.avro = self._avro_serializer()
        click = _proto_click()
        proto = ProtobufSerializer(click, self.registry, {"use.deprecated.format": False})
        self.proto = lambda r: proto(click(**r), SerializationContext(self.topics["proto"], MessageField.VALUE))
        schema = {"type": "object", "properties": {"ts": {"type": "integer"}, "page": {"type": "string"}}}
        jsons = JSONSerializer(json.dumps(schema), self.registry)
        self.jsons = lambda r: jsons(r, SerializationContext(self.topics["jsons"], MessageField.VALUE))
        self.totals: dict[str, dict[str, Any]] = {}
        self.latest: dict[str, dict[str, dict[str, Any]]] = {"clicks": {}, "visits": {}}

    def _avro_serializer(self) -> Callable[[dict[str, Any]], bytes]:
        serializer = AvroSerializer(self.registry, _avro_schema(self.avro_fields))
        ctx = SerializationContext(self.topics["avro"], MessageField.VALUE)
        return lambda record: serializer(record, ctx)

    def evolve(self, fields: list[dict[str, Any]]) -> None:
        self.avro_fields = fields
        self.avro = self._avro_serializer()

    def produce(self, topic: str, key: str, value: bytes) -> None:
        self.node.producer.produce(topic, key=key.encode(), value=value, partition=partition(key))

    def click(self, key: str, ts: int, amount: int) -> None:
        """One record to each store, and its effect on the independent folds."""
        record = {
            "user": key,
            "ts": ts,
            "page": f"/p{ts % 7}",
            "amount": amount,
            "agent": "it",
            "ref": "r",
            "note": "n",
        }
        avro_record = {f["name"]: record[f["name"]] for f in self.avro_fields}
        self.produce(self.topics["avro"], key, self.avro(avro_record))
        held = self.totals.setdefault(key, {"n": 0, "total": 0, "page": None, "_ts": None})
        held["n"] += 1
        held["total"] += amount
        if held["_ts"] is None or ts >= held["_ts"]:
            held["page"], held["_ts"] = record["page"], ts
        for store, encode in (("clicks", self.proto), ("visits", self.jsons)):
            topic = self.topics["proto" if store == "clicks" else "jsons"]
            self.produce(topic, key, encode({"user": key, "ts": ts, "page": record["page"]}))
            best = self.latest[store].get(key)
            if best is None or ts >= best["ts"]:
                self.latest[store][key] = {"ts": ts, "page": record["page"]}

    def answers_match(self) -> bool:
        node = self.node
        for key, held in self.totals.items():
            if node.value("totals", key) != {k: v for k, v in held.items() if k != "_ts"}:
                return False
        return all(
            node.value(store, key) == value for store, held in self.latest.items() for key, value in held.items()
        )

    def close(self) -> None:
        self.node.close()
        self.proxy.close()


@pytest.fixture
def stores(tmp_path: Path, zk_settings: ZkSettings, kafka: MockKafka, schema_registry: str) -> Iterator[Stores]:
    running = Stores(tmp_path, zk_settings, kafka, schema_registry)
    try:
        yield running
    finally:
        running.close()


def test_registry_values_fold_exactly_through_evolution_bad_values_kill_9_and_a_registry_outage(
    stores: Stores,
) -> None:
    node = stores.node.start()
    keys = keys_of(0, 6) + keys_of(1, 6)
    ts = 0

    def stream(n: int, amount: int = 3) -> None:
        nonlocal ts
        for i in range(n):
            ts += 1
            stores.click(keys[i % len(keys)], ts if i % 5 else ts - 3, amount + i % 4)
            if i % 200 == 0:
                node.producer.poll(0)
        node.flush()

    stream(120)
    node.wait(stores.answers_match, "the first records of every store")

    # Evolution without a restart: a field added with a default, then a field the store does not use removed.
    added = [*CLICK["fields"], {"name": "ref", "type": "string", "default": "-"}]
    stores.evolve(added)
    stream(40)
    stores.evolve([f for f in added if f["name"] != "agent"])
    stream(40)
    node.wait(stores.answers_match, "records of the evolved schemas")
    versions = stores.registry.get_versions(f"{stores.topics['avro']}-value")
    assert len(versions) == 3

    # A schema that drops `amount` (summed by the store) is skipped and named; so are bad values.
    subject = f"{stores.topics['avro']}-value"
    stores.registry.set_compatibility(subject, "NONE")
    no_amount = [f for f in added if f["name"] not in ("amount", "agent")]
    dropped_id = stores.registry.register_schema(subject, Schema(_avro_schema(no_amount), "AVRO"))
    known_id = stores.avro({"user": "x", "ts": 0, "page": "/", "amount": 0, "ref": "-"})[:5]  # a readable schema
    stores.evolve(no_amount)
    (k0,) = keys_of(0, 1)
    good = stores.avro({"user": k0, "ts": 1, "page": "/x", "ref": "-"})
    avro_topic = stores.topics["avro"]
    stores.produce(avro_topic, k0, b'{"user": "plain json"}')  # not_wire_format
    stores.produce(avro_topic, k0, b"\x00" + (10**6).to_bytes(4, "big") + good[5:])  # unknown_schema
    stores.produce(avro_topic, k0, known_id + b"\xff")  # bad_payload
    stores.produce(avro_topic, k0, good)  # missing_column
    node.flush()
    expected_skips = {"bad_payload": 1, "missing_column": 1, "not_wire_format": 1, "unknown_schema": 1}
    status = node.wait(
        lambda: (s := node.live("totals").get(0)) and s.get("skipped") == expected_skips and s,
        "the bad values to be counted",
    )
    assert status["state"] == "live"
    assert f"schema id {dropped_id} has no field 'amount', which store 'totals' needs" in status["last_bad_record"]
    stores.evolve([f for f in added if f["name"] != "agent"])
    stream(24)
    node.wait(stores.answers_match, "good records after the bad ones")

    # The registry cut off while a schema id the node has never seen arrives: the partition stalls (shown in
    # its status) and resumes once the registry answers, with nothing lost or applied twice.
    stores.proxy.cut()
    stores.evolve([*[f for f in added if f["name"] != "agent"], {"name": "note", "type": "string", "default": ""}])
    stream(12)
    stalled = node.wait(
        lambda: [s for s in node.live("totals").values() if s["state"] == "stalled"],
        "a partition of the Avro store to stall",
    )
    assert "schema registry unreachable" in stalled[0]["error"]
    assert node.value("totals", keys[0]) != 503  # still served meanwhile
    stores.proxy.restore()
    node.wait(stores.answers_match, "the stalled partitions to resume", timeout_s=60)
    node.wait(lambda: all(s["state"] == "live" for s in node.live("totals").values()), "every partition live")

    # kill -9 while records stream into all three stores, then restart on the same files.
    streaming = threading.Thread(target=stream, args=(3000,))
    streaming.start()
    applied = node.live("totals")
    node.wait(
        lambda: (
            sum(s["applied"] for s in node.live("totals").values()) > sum(s["applied"] for s in applied.values()) + 200
        ),
        "applying mid-stream",
    )
    assert node.proc is not None
    node.proc.kill9()
    streaming.join()
    node.start()
    node.wait(stores.answers_match, "every answer after kill -9 equal to the independent fold", timeout_s=90)
    produced = Counter(partition(k) for k, held in stores.totals.items() for _ in range(held["n"]))
    offsets = {p: s["offset"] for p, s in node.live("totals").items()}
    # every record of the Avro topic applied once: the good ones counted, the 4 bad ones skipped in partition 0
    assert offsets == {p: produced[p] + (4 if p == 0 else 0) - 1 for p in range(PARTITIONS)}
