"""keyroute.pipeline.live.check_value_schema: a build of a store with registry values fails before any Spark
work when the topic's value subject is not registered or its latest schema lacks a column the store needs
(against the session's development registry process)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient

from keyroute.pipeline.errors import SpecError, TopicError
from keyroute.pipeline.live import check_value_schema
from keyroute.pipeline.spec import parse_spec
from tests.util import free_port


def _store(tmp_path: Path, topic: str, url: str, value_format: str = "avro"):  # type: ignore[no-untyped-def]
    table = {
        "key": "user",
        "partitions": 2,
        "mode": "aggregate",
        "aggregations": {"n": "count(*)", "spent": "sum(amount)"},
        "live": {
            "topic": topic,
            "bootstrap_servers": "127.0.0.1:9092",
            "value_format": value_format,
            "schema_registry": {"url": url, "max.retries": 0},
        },
    }
    return parse_spec({"stores": {"payments": table}}, base_dir=tmp_path).stores[0]


def _record(*fields: str) -> str:
    return json.dumps({"type": "record", "name": "P", "fields": [{"name": f, "type": "long"} for f in fields]})


def test_the_value_subject_and_its_columns_are_checked(tmp_path: Path, schema_registry: str) -> None:
    topic = f"pay-{uuid.uuid4().hex[:8]}"
    store = _store(tmp_path, topic, schema_registry)
    with pytest.raises(SpecError) as err:
        check_value_schema(store, {})
    assert f"subject '{topic}-value' is not in the schema registry" in str(err.value)
    assert err.value.store == "payments"

    client = SchemaRegistryClient({"url": schema_registry})
    client.register_schema(f"{topic}-value", Schema(_record("user", "amount"), "AVRO"))
    check_value_schema(store, {})  # the columns are there

    client.set_compatibility(f"{topic}-value", "NONE")
    without = client.register_schema(f"{topic}-value", Schema(_record("user", "cents"), "AVRO"))
    with pytest.raises(SpecError) as err:
        check_value_schema(store, {})
    assert str(err.value) == (
        f"store 'payments': subject '{topic}-value', latest version 2: schema id {without} has no field 'amount', "
        "which store 'payments' needs (aggregation 'spent'): a schema that removes it cannot be applied"
    )
    json_store = _store(tmp_path, topic, schema_registry, value_format="json_schema")
    with pytest.raises(SpecError, match=f"schema id {without} is AVRO, not JSON"):
        check_value_schema(json_store, {})


def test_an_unreachable_registry_fails_the_build(tmp_path: Path) -> None:
    store = _store(tmp_path, "pay", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(TopicError, match="the schema registry cannot be reached"):
        check_value_schema(store, {})
