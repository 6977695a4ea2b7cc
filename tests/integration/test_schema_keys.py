"""Schema Registry keys routed exactly: keys written by confluent-kafka's real serializers (Avro, Protobuf,
JSON Schema; string, long and record keys) through a Producer to the mock broker, with their schemas in the
development registry process. `keyroute partition` and a router must put every key on the partition the
producer chose."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import confluent_kafka
import httpx
import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient

from keyroute.dev.kafka_mock import MockKafka
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.runtime.settings import ZkSettings
from tests.schema_keys import VALUES, key_text, serializer
from tests.util import Proc, free_port, wait_for

pytestmark = pytest.mark.integration

PARTITIONS = 7  # not a power of two: a sign slip in the hash shows
FORMATS = [KeyFormat.AVRO, KeyFormat.PROTOBUF, KeyFormat.JSON_SCHEMA]
KINDS = ["string", "long", "record"]


@dataclass(frozen=True)
class Produced:
    topic: str
    subject: str
    values: list[Any]
    partitions: list[int]  # where the producer put each key, in value order


def produce(kafka: MockKafka, topic: str, registry_url: str, fmt: KeyFormat, kind: str, values: list[Any]) -> Produced:
    """Register the key schema and write one record per key value, as a Kafka Streams estate's producer does
    (Java-compatible murmur2 partitioner); the partition each record went to."""
    registry = SchemaRegistryClient({"url": registry_url})
    write, _ = serializer(fmt, kind, registry, topic)
    producer = confluent_kafka.Producer({"bootstrap.servers": kafka.bootstrap_servers, "partitioner": "murmur2_random"})
    delivered: dict[int, int] = {}

    def on_delivery(i: int) -> Callable[[Any, Any], None]:
        def done(err: Any, msg: Any) -> None:
            assert err is None, err
            delivered[i] = msg.partition()

        return done

    for i, value in enumerate(values):
        producer.produce(topic, key=write(value), value=json.dumps({"n": i}).encode(), on_delivery=on_delivery(i))
    assert producer.flush(30) == 0
    return Produced(topic, f"{topic}-key", values, [delivered[i] for i in range(len(values))])


def cli_partitions(registry_url: str, fmt: KeyFormat, subject: str, texts: list[str]) -> list[dict[str, Any]]:
    args = ["--partitions", str(PARTITIONS), "--key-format", fmt.value]
    args += ["--schema-registry", registry_url, "--key-subject", subject]
    done = subprocess.run(
        [sys.executable, "-m", "keyroute", "partition", *args],
        input="".join(f"{t}\n" for t in texts).encode(),
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    return [json.loads(line) for line in done.stdout.decode().splitlines()]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_keyroute_partition_agrees_with_the_producer(
    fmt: KeyFormat, kind: str, kafka: MockKafka, kafka_topic: Callable[[int], str], schema_registry: str
) -> None:
    produced = produce(kafka, kafka_topic(PARTITIONS), schema_registry, fmt, kind, VALUES[kind])
    texts = [key_text(kind, value) for value in produced.values]
    answers = cli_partitions(schema_registry, fmt, produced.subject, texts)
    assert [a["partition"] for a in answers] == produced.partitions
    # The producer spread them: equal partitions everywhere would prove nothing.
    assert len(set(produced.partitions)) > 1


def test_a_key_that_does_not_fit_is_one_line_and_exit_1(
    kafka: MockKafka, kafka_topic: Callable[[int], str], schema_registry: str
) -> None:
    produced = produce(kafka, kafka_topic(PARTITIONS), schema_registry, KeyFormat.AVRO, "record", VALUES["record"][:1])
    args = ["--partitions", str(PARTITIONS), "--key-format", "avro", "--schema-registry", schema_registry]
    done = subprocess.run(
        [sys.executable, "-m", "keyroute", "partition", *args, "--key-subject", produced.subject],
        input=b'{"region": "eu", "id": "seven"}\n',
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1
    (line,) = done.stdout.decode().splitlines()
    assert json.loads(line)["error"] == "bad_key" and "'id'" in json.loads(line)["message"]
    missing = subprocess.run(
        [sys.executable, "-m", "keyroute", "partition", *args, "--key-subject", "no-such-subject", "k"],
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert missing.returncode == 1
    assert missing.stderr.decode().count("\n") == 1 and "no-such-subject" in missing.stderr.decode()


# --- through a router ---------------------------------------------------------------------------------------

# One store per format, covering each kind once: what the build, the node's files and the router's routing
# must agree on with the producer.
ROUTED = {"avro_records": (KeyFormat.AVRO, "record"), "proto_longs": (KeyFormat.PROTOBUF, "long")}
ROUTED["json_strings"] = (KeyFormat.JSON_SCHEMA, "string")


@dataclass
class RoutedCluster:
    router_url: str
    produced: dict[str, Produced]


@pytest.fixture
def routed(
    tmp_path: Path,
    zk_settings: ZkSettings,
    spark: Any,
    kafka: MockKafka,
    kafka_topic: Callable[[int], str],
    schema_registry: str,
) -> Iterator[RoutedCluster]:
    from keyroute.pipeline.build import build

    produced: dict[str, Produced] = {}
    spec = ""
    for store, (fmt, kind) in ROUTED.items():
        produced[store] = produce(kafka, kafka_topic(PARTITIONS), schema_registry, fmt, kind, VALUES[kind])
        source = tmp_path / f"{store}.json"
        source.write_text(
            "".join(json.dumps({"k": v, "n": i}) + "\n" for i, v in enumerate(produced[store].values)), "utf-8"
        )
        spec += f"""
[stores.{store}]
source = {json.dumps(str(source))}
format = "json"
key = "k"
key_format = "{fmt.value}"
key_subject = "{produced[store].subject}"
partitions = {PARTITIONS}
mode = "latest"
order_by = "n"
schema_registry = {{ url = "{schema_registry}" }}
"""
    (tmp_path / "stores.toml").write_text(spec, "utf-8")
    build(tmp_path / "stores.toml", zk_settings, str(tmp_path / "snapshots"), spark=spark)

    zk = zk_settings.connect_string
    port, router_port = free_port(), free_port()
    node = Proc(
        ["node", "--zk", zk, "--node-id", "n1", "--port", str(port), "--data-dir", str(tmp_path / "n1")],
        tmp_path / "n1.log",
    ).start()
    router = Proc(["router", "--zk", zk, "--port", str(router_port)], tmp_path / "router.log").start()
    router_url = f"http://127.0.0.1:{router_port}"
    try:
        wait_for(
            lambda: httpx.get(router_url + "/readyz", timeout=5).json().get("complete") is True,
            timeout_s=120,
            message="the router to see every partition served",
        )
        yield RoutedCluster(router_url, produced)
    finally:
        for proc in (router, node):
            proc.stop()
        print(node.output()[-3000:], router.output()[-3000:])


def test_the_router_reads_every_key_on_the_producers_partition(routed: RoutedCluster) -> None:
    """One build for both checks (Spark's time is the suite's scarcest): exact routing, then bad keys."""
    with httpx.Client(timeout=10, trust_env=False) as http:
        for store, produced in routed.produced.items():
            kind = ROUTED[store][1]
            for i, (value, partition) in enumerate(zip(produced.values, produced.partitions, strict=True)):
                text = key_text(kind, value)
                resp = http.get(f"{routed.router_url}/stores/{store}/keys/{quote(text, safe='')}")
                assert resp.status_code == 200, (store, text, resp.text)
                assert resp.json()["partition"] == partition, (store, text)
                assert resp.json()["value"] == {"n": i}
                assert resp.headers["x-keyroute-partition"] == str(partition)
            texts = [key_text(kind, value) for value in produced.values]
            batch = http.post(f"{routed.router_url}/stores/{store}/batch-get", json={"keys": texts})
            assert batch.status_code == 200, batch.text
            entries = batch.json()["results"]
            assert [e["partition"] for e in entries] == produced.partitions
            assert [e["value"] for e in entries] == [{"n": i} for i in range(len(texts))]
    # A key that does not fit the key schema: 400 bad_key naming the field; the others keep answering.
    bad = quote('{"region": "eu", "id": "seven"}', safe="")
    resp = httpx.get(f"{routed.router_url}/stores/avro_records/keys/{bad}", timeout=10)
    assert resp.status_code == 400
    assert resp.json()["error"] == "bad_key" and "'id'" in resp.json()["message"]
    resp = httpx.get(f"{routed.router_url}/stores/proto_longs/keys/twelve", timeout=10)
    assert resp.status_code == 400 and resp.json()["error"] == "bad_key"
    # Their order is their framed bytes', no order of their texts: no key ranges, said plainly.
    resp = httpx.get(f"{routed.router_url}/stores/avro_records/range", timeout=10)
    assert resp.status_code == 400 and resp.json()["error"] == "wrong_store_kind", resp.text
    # The router keeps answering the keys that fit.
    good = key_text("record", VALUES["record"][0])
    assert httpx.get(f"{routed.router_url}/stores/avro_records/keys/{quote(good, safe='')}").status_code == 200


# --- live topics ------------------------------------------------------------------------------------------


def test_live_records_keyed_under_another_key_schema_id_are_counted_not_applied(
    tmp_path: Path, zk_settings: ZkSettings, kafka: MockKafka, kafka_topic: Callable[[int], str], schema_registry: str
) -> None:
    from tests.integration.test_live_node import LATEST, LiveNode, publish_live_store
    from tests.integration.test_live_node import PARTITIONS as LIVE_PARTITIONS

    topic = kafka_topic(LIVE_PARTITIONS)
    registry = SchemaRegistryClient({"url": schema_registry})
    write, registered = serializer(KeyFormat.AVRO, "string", registry, topic)
    keys = {f"u{i}": write(f"u{i}") for i in range(12)}
    # The producer moves to another key schema (a record key: a new id, and other bytes for every key).
    write_other, _ = serializer(KeyFormat.AVRO, "record", registry, f"{topic}-v2")
    moved = {f"w{i}": write_other({"region": "eu", "id": i}) for i in range(5)}
    schema = registered()
    publish_live_store(tmp_path, zk_settings, "clicks", topic, kafka.bootstrap_servers, LATEST, key_schema=schema)
    node = LiveNode(tmp_path, zk_settings, kafka.bootstrap_servers, topic).start()
    try:
        placed = {}
        for text, data in [*keys.items(), *moved.items()]:
            placed[text] = partition_for(Partitioner.MURMUR2, data, LIVE_PARTITIONS)
            value = json.dumps({"ts": 1, "page": f"/{text}"}).encode()
            node.producer.produce(topic, key=data, value=value, partition=placed[text])
        node.flush()
        total = len(keys) + len(moved)
        node.wait(
            lambda: sum(row.get("offset", -1) + 1 for row in node.live("clicks").values()) == total,
            "every record to be read",
        )
        for text in keys:
            resp = node.read("clicks", text)
            assert resp.status_code == 200, resp.text
            assert resp.json()["value"] == {"ts": 1, "page": f"/{text}"}
            assert resp.json()["partition"] == placed[text]

        def skipped() -> Counter[str]:
            counts: Counter[str] = Counter()
            for row in node.live("clicks").values():
                counts.update(row["skipped"])
            return counts

        node.wait(lambda: skipped() == {"key_schema_changed": len(moved)}, "the moved keys to be counted")
        assert node.metric("keyroute_node_live_skipped_records_total", reason="key_schema_changed") == len(moved)
    finally:
        node.close()


def test_a_build_whose_key_subject_is_missing_fails_naming_store_and_subject(
    tmp_path: Path, schema_registry: str
) -> None:
    from keyroute.pipeline.build import with_key_schemas
    from keyroute.pipeline.errors import SpecError
    from keyroute.pipeline.spec import load_spec

    spec = tmp_path / "stores.toml"
    spec.write_text(
        f"""
[stores.bookings]
source = "events.json"
format = "json"
key = "k"
key_format = "avro"
key_subject = "no-such-subject-key"
partitions = 3
mode = "latest"
order_by = "n"
schema_registry = {{ url = "{schema_registry}" }}
""",
        "utf-8",
    )
    with pytest.raises(SpecError) as err:
        with_key_schemas(load_spec(spec), {})
    assert str(err.value).startswith("store 'bookings': key subject 'no-such-subject-key' is not in the schema")
