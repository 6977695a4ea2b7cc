"""keyroute.pipeline.spec for live stores: the `[stores.NAME.live]` table, hybrid sources with offsets, and
every mistake named with its store and field.

Pure: no Spark, no Kafka.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from keyroute.keys.schema_registry import RegistrySettings
from keyroute.pipeline.errors import SpecError
from keyroute.pipeline.live import live_config
from keyroute.pipeline.spec import LiveSpec, Mode, SourceFormat, load_spec, parse_spec
from keyroute.storage.live import DEFAULT_CATCH_UP_RECORDS, Aggregate, LiveConfig, Merge

LIVE_ONLY_TOML = """
[stores.positions]
key = "asset"
partitions = 6
mode = "aggregate"
aggregations = { trades = "count(*)", volume = "sum(qty)", last_price = "max_by(price, ts)" }

[stores.positions.live]
topic = "trades"
bootstrap_servers = "kafka-0:9092,kafka-1:9092"
kafka = { "security.protocol" = "SASL_SSL", "sasl.password" = "${KAFKA_PASSWORD}", "fetch.max.bytes" = 1048576 }
start = "latest"
on_bad_record = "stop"
catch_up_records = 0
"""

LATEST_LIVE: dict[str, Any] = {
    "key": "customer",
    "partitions": 4,
    "mode": "latest",
    "order_by": "ts",
    "live": {"topic": "bookings", "bootstrap_servers": "127.0.0.1:9092"},
}
HYBRID: dict[str, Any] = {
    **LATEST_LIVE,
    "source": "archive",
    "format": "parquet",
    "source_partition_column": "kafka_partition",
    "source_offset_column": "kafka_offset",
}
AGGREGATE_LIVE: dict[str, Any] = {
    "key": "asset",
    "partitions": 4,
    "mode": "aggregate",
    "aggregations": {"n": "count(*)", "last": "max_by(price, ts)"},
    "live": {"topic": "trades", "bootstrap_servers": "127.0.0.1:9092"},
}


def parse(table: dict[str, Any], tmp_path: Path) -> Any:
    return parse_spec({"stores": {"s": table}}, base_dir=tmp_path).stores[0]


def changed(base: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """`base` with fields replaced (None removes one); `live__name` reaches into the live table."""
    table = copy.deepcopy(base)
    for name, value in fields.items():
        target, field = (table["live"], name[len("live__") :]) if name.startswith("live__") else (table, name)
        if value is None:
            target.pop(field, None)
        else:
            target[field] = value
    return table


def test_live_only_store_from_toml(tmp_path: Path) -> None:
    path = tmp_path / "stores.toml"
    path.write_text(LIVE_ONLY_TOML, encoding="utf-8")
    store = load_spec(path).stores[0]
    assert store.source is None and store.format is None
    assert store.live == LiveSpec(
        topic="trades",
        bootstrap_servers="kafka-0:9092,kafka-1:9092",
        kafka={"security.protocol": "SASL_SSL", "sasl.password": "${KAFKA_PASSWORD}", "fetch.max.bytes": "1048576"},
        start="latest",
        on_bad_record="stop",
        catch_up_records=0,
    )
    assert store.snapshot_format == 2
    assert store.merge() == Merge(
        "aggregate",
        "asset",
        aggregates=(
            Aggregate("trades", "count", None),
            Aggregate("volume", "sum", "qty"),
            Aggregate("last_price", "max_by", "price", "ts"),
        ),
    )


def test_live_defaults(tmp_path: Path) -> None:
    store = parse(LATEST_LIVE, tmp_path)
    assert store.live == LiveSpec("bookings", "127.0.0.1:9092")
    assert (store.live.start, store.live.on_bad_record) == ("earliest", "skip")
    assert store.live.catch_up_records == DEFAULT_CATCH_UP_RECORDS
    assert store.live.kafka == {}
    assert store.source_offset_column is None
    assert store.merge() == Merge("latest", "customer", order_by="ts", columns=None)
    # The batch part's answer columns, when the pipeline knows them, are what the fold keeps.
    assert store.merge(("ts", "route")).columns == ("ts", "route")


def test_hybrid_store(tmp_path: Path) -> None:
    store = parse(HYBRID, tmp_path)
    assert store.source == str(tmp_path / "archive")
    assert store.format is SourceFormat.PARQUET
    assert store.mode is Mode.LATEST
    assert (store.source_partition_column, store.source_offset_column) == ("kafka_partition", "kafka_offset")
    assert store.live is not None and store.live.start == "earliest"


def test_batch_stores_have_no_live_part(tmp_path: Path) -> None:
    table = changed(HYBRID, live=None, source_offset_column=None)
    store = parse(table, tmp_path)
    assert store.live is None and store.source_offset_column is None


@pytest.mark.parametrize(
    ("table", "message"),
    [
        # the live table itself
        (changed(LATEST_LIVE, live="trades"), "'live' must be a table ([stores.s.live]), got 'trades'"),
        (changed(LATEST_LIVE, live__topics="x"), "unknown field 'live.topics' (did you mean 'live.topic'?)"),
        (
            changed(LATEST_LIVE, live__group="x"),
            "unknown field 'live.group' (expected some of: topic, bootstrap_servers, kafka, start, "
            "on_bad_record, catch_up_records, value_format, schema_registry)",
        ),
        (
            changed(LATEST_LIVE, live__value_format="xml"),
            "unknown value_format 'xml' (expected one of: json, avro, protobuf, json_schema)",
        ),
        (
            changed(LATEST_LIVE, live__value_format="avro"),
            'value_format "avro" needs a schema_registry table (url = ...)',
        ),
        (
            changed(LATEST_LIVE, live__schema_registry={"url": "http://r:8081"}),
            'a schema_registry table is for value_format "avro", "protobuf" or "json_schema"',
        ),
        (
            changed(
                LATEST_LIVE,
                live__value_format="avro",
                live__schema_registry={"url": "http://r:8081", "basic.auth.user.info": "ann:pw"},
            ),
            'live.schema_registry.basic.auth.user.info is a secret: write it as "${ENV_VAR}" and set that variable '
            "where the registry is read (secrets are never written to manifests or ZooKeeper)",
        ),
        (
            changed(LATEST_LIVE, live__value_format="avro", live__schema_registry={"uri": "http://r"}),
            "live.schema_registry: unknown option 'uri' (options: basic.auth.user.info, bearer.auth.identity.pool.id, "
            "bearer.auth.logical.cluster, bearer.auth.token, max.retries, retries.max.wait.ms, retries.wait.ms, "
            "ssl.ca.location, ssl.certificate.location, ssl.key.location, ssl.key.password, timeout, url)",
        ),
        (changed(LATEST_LIVE, live__topic=None), "missing required field 'live.topic'"),
        (changed(LATEST_LIVE, live__topic=""), "'live.topic' must be a non-empty string, got ''"),
        (changed(LATEST_LIVE, live__bootstrap_servers=None), "missing required field 'live.bootstrap_servers'"),
        (
            changed(LATEST_LIVE, live__bootstrap_servers=["a:9092"]),
            "'live.bootstrap_servers' must be a non-empty string, got ['a:9092']",
        ),
        (changed(LATEST_LIVE, live__kafka="x"), "'live.kafka' must be a table of consumer settings, got 'x'"),
        (
            changed(LATEST_LIVE, live__kafka={"sasl.password": "hunter2"}),
            "'live.kafka': kafka setting 'sasl.password' is a secret: write it as \"${ENV_VAR}\" and set that "
            "variable on the nodes (secrets are never written to manifests or ZooKeeper)",
        ),
        (
            changed(LATEST_LIVE, live__kafka={"group.id": "mine"}),
            "'live.kafka': kafka setting 'group.id' is keyroute's own (bootstrap_servers is its own field)",
        ),
        (
            changed(LATEST_LIVE, live__kafka={"x": [1]}),
            "'live.kafka': kafka setting 'x' must be a string, number or boolean",
        ),
        (changed(LATEST_LIVE, live__start="now"), "unknown live.start 'now' (expected one of: earliest, latest)"),
        (changed(LATEST_LIVE, live__start=0), "'live.start' must be a non-empty string, got 0"),
        (
            changed(HYBRID, live__start="earliest"),
            "'live.start' is for a live store without 'source'; a hybrid store's versions start where its "
            "source ends ('source_offset_column')",
        ),
        (
            changed(LATEST_LIVE, live__on_bad_record="ignore"),
            "unknown live.on_bad_record 'ignore' (expected one of: skip, stop)",
        ),
        (
            changed(LATEST_LIVE, live__catch_up_records=-1),
            "'live.catch_up_records' must be an integer of at least 0, got -1",
        ),
        (
            changed(LATEST_LIVE, live__catch_up_records=True),
            "'live.catch_up_records' must be an integer of at least 0, got True",
        ),
        (
            changed(LATEST_LIVE, live__catch_up_records="10"),
            "'live.catch_up_records' must be an integer of at least 0, got '10'",
        ),
        # a source or a live table
        (
            changed(LATEST_LIVE, live=None),
            "missing required field 'source' (or 'source_table', 'source_sql', or a [stores.NAME.live] table: "
            "a live store)",
        ),
        (
            changed(LATEST_LIVE, format="json"),
            "'format' describes 'source', which a live store without 'source' does not have",
        ),
        (changed(HYBRID, format=None), "missing required field 'format'"),
        # what a live store needs
        (
            changed(LATEST_LIVE, snapshot_format=1),
            "'snapshot_format' must be 2 for a live store (nodes apply the topic to format-2 files), got 1",
        ),
        (
            changed(LATEST_LIVE, order_by=None),
            "mode 'latest' needs 'order_by' (the column whose greatest value wins)",
        ),
        (
            changed(AGGREGATE_LIVE, aggregations={"n": "count(*)", "avg": "avg(price)"}),
            "'aggregations': aggregation 'avg' = 'avg(price)' cannot be merged one record at a time; a live "
            "store accepts only: count(*), count(col), sum(col), min(col), max(col), max_by(col, ord), "
            "min_by(col, ord)",
        ),
        (
            changed(AGGREGATE_LIVE, aggregations={"d": "count(DISTINCT price)"}),
            "'aggregations': aggregation 'd' = 'count(DISTINCT price)' cannot be merged one record at a "
            "time; a live store accepts only: count(*), count(col), sum(col), min(col), max(col), "
            "max_by(col, ord), min_by(col, ord)",
        ),
        # offsets of a hybrid store's source
        (
            changed(HYBRID, source_offset_column=None),
            "a live store with 'source' (the topic's archive) needs 'source_offset_column' and "
            "'source_partition_column': where each partition's archive ends, so nodes replay the topic from "
            "the next offset",
        ),
        (
            changed(HYBRID, live=None),
            "'source_offset_column' only applies to a live store ([stores.NAME.live])",
        ),
        (
            changed(LATEST_LIVE, source_offset_column="kafka_offset"),
            "'source_offset_column' names a column of 'source', which this store does not have",
        ),
        (
            changed(HYBRID, source_partition_column=None),
            "'source_offset_column' needs 'source_partition_column' (an offset is within a partition)",
        ),
        (changed(HYBRID, source_offset_column="customer"), "'source_offset_column' names the key column 'customer'"),
        (
            changed(HYBRID, source_offset_column="kafka_partition"),
            "'source_offset_column' and 'source_partition_column' both name 'kafka_partition'",
        ),
        (changed(HYBRID, source_offset_column=7), "'source_offset_column' must be a non-empty string, got 7"),
    ],
)
def test_live_mistakes_name_the_store_and_the_field(tmp_path: Path, table: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as err:
        parse(table, tmp_path)
    assert str(err.value) == f"store 's': {message}"
    assert err.value.store == "s"


def test_every_mergeable_aggregate_is_accepted(tmp_path: Path) -> None:
    aggregations = {
        "n": "count(*)",
        "priced": "count(price)",
        "volume": "sum(qty)",
        "low": "min(price)",
        "high": "MAX(price)",
        "last": "max_by(price, ts)",
        "first": "min_by(`price`, ts)",
    }
    store = parse(changed(AGGREGATE_LIVE, aggregations=aggregations), tmp_path)
    assert [a.function for a in store.merge().aggregates] == ["count", "count", "sum", "min", "max", "max_by", "min_by"]


def test_registry_values_reach_the_manifest(tmp_path: Path) -> None:
    registry = {"url": "https://registry:8081", "bearer.auth.token": "${SR_TOKEN}", "timeout": 5}
    store = parse(changed(LATEST_LIVE, live__value_format="avro", live__schema_registry=registry), tmp_path)
    assert store.live is not None and store.live.value_format == "avro"
    assert store.live.schema_registry == RegistrySettings(
        "https://registry:8081", {"bearer.auth.token": "${SR_TOKEN}", "timeout": "5"}
    )
    config = live_config(store, (0, 0, 0, 0))
    assert (config.value_format, config.schema_registry) == ("avro", store.live.schema_registry)
    again = LiveConfig.from_json(json.loads(json.dumps(config.to_json())))
    assert again == config
    # a JSON store's manifest is as before (nodes that do not know the registry formats read it)
    plain = live_config(parse(LATEST_LIVE, tmp_path), (0, 0, 0, 0)).to_json()
    assert "value_format" not in plain and "schema_registry" not in plain
