"""Batch sources beyond JSON, CSV and parquet files, on real Spark and a real ZooKeeper: ORC files and tables,
reader options, tables of the session's catalog (saved into its warehouse directory), Spark SQL joining two
of them, and the spec's `[spark]` settings. Each store must hold exactly what the same data gives from JSON
files: the versions are compared partition by partition, key by key, byte for byte."""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from keyroute.dev.kafka_mock import MockKafka
from keyroute.keys.key_format import KeyFormat, parse_key
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.pipeline.build import PublishedVersion, build
from keyroute.pipeline.errors import DataError, PipelineError, SpecError
from keyroute.runtime.settings import ZkSettings
from keyroute.storage.snapshot import read_manifest
from tests.integration import test_live_pipeline as live_pipeline
from tests.integration.test_pipeline import (
    Row,
    assert_nothing_published,
    assert_snapshot,
    booking_events,
    expected_latest,
    partition_rows,
    run_cli,
    write_csv,
    write_jsonl,
    write_spec,
)

pytestmark = pytest.mark.integration

PARTITIONS = 4
COLUMNS = ["ts", "route", "fare", "seats"]
JOINED_COLUMNS = [*COLUMNS, "tier", "since"]


def kafka_partition(key: str) -> int:
    return partition_for(Partitioner.MURMUR2, parse_key(KeyFormat.STRING, key).data, PARTITIONS)


@pytest.fixture(scope="module")
def lake(spark: SparkSession, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Bookings (with the Kafka partition each was produced to) and customers as JSON lines files, and the
    same data as tables of the session's catalog in a database of their own: bookings as a parquet and as an
    ORC table, customers as an ORC table."""
    rng = random.Random(32)
    bookings = [{**row, "kafka_partition": kafka_partition(row["customer_id"])} for row in booking_events(rng, 900)]
    keys = sorted({row["customer_id"] for row in bookings})
    # Some customers have no record: the join drops their bookings.
    customers = [
        {"customer_id": key, "tier": rng.choice(["gold", "silver", None]), "since": rng.randrange(2000, 2026)}
        for key in keys
        if rng.random() < 0.8
    ]
    by_customer = {row["customer_id"]: row for row in customers}
    joined = [{**row, **by_customer[row["customer_id"]]} for row in bookings if row["customer_id"] in by_customer]
    files = tmp_path_factory.mktemp("lake")
    write_jsonl(files / "bookings.json", bookings)
    write_jsonl(files / "customers.json", customers)
    write_jsonl(files / "joined.json", joined)
    database = f"kr_{uuid.uuid4().hex[:10]}"
    spark.sql(f"CREATE DATABASE {database}")
    read = spark.read.json(str(files / "bookings.json"))
    read.write.format("parquet").saveAsTable(f"{database}.bookings")
    read.write.format("orc").saveAsTable(f"{database}.bookings_orc")
    spark.read.json(str(files / "customers.json")).write.format("orc").saveAsTable(f"{database}.customers")
    yield {"db": database, "files": files, "bookings": bookings, "joined": joined}
    spark.sql(f"DROP DATABASE {database} CASCADE")


def with_spark_table(spec: Path, conf: dict[str, str]) -> None:
    """Put a [spark] table of `conf` at the top of the spec file."""
    table = "".join(f'"{name}" = "{value}"\n' for name, value in conf.items())
    spec.write_text("[spark]\n" + table + "\n" + spec.read_text())


def latest(source: dict[str, Any], columns: list[str] = COLUMNS, **more: Any) -> dict[str, Any]:
    store = {"key": "customer_id", "partitions": PARTITIONS, "mode": "latest", "order_by": "ts", "columns": columns}
    return {**source, **store, **more}


def totals(source: dict[str, Any]) -> dict[str, Any]:
    aggregations = {"bookings": "count(*)", "seats": "sum(seats)", "top_fare": "max(fare)", "last": "max_by(route, ts)"}
    return {**source, "key": "customer_id", "partitions": PARTITIONS, "mode": "aggregate", "aggregations": aggregations}


def assert_latest(published: PublishedVersion, events: list[Row], columns: list[str] = COLUMNS) -> None:
    """The version holds each key's latest event (as the JSON lines files build it, test_pipeline.py)."""
    assert_snapshot(
        published,
        partitioner=Partitioner.MURMUR2,
        key_format=KeyFormat.STRING,
        partitions=PARTITIONS,
        value_columns=columns,
        expected=expected_latest(events, "customer_id", "ts", columns),
    )


def assert_same_version(built: PublishedVersion, reference: PublishedVersion) -> None:
    """Both versions hold the same keys in the same partitions with byte-identical values."""
    manifest, expected = read_manifest(Path(built.snapshot)), read_manifest(Path(reference.snapshot))
    assert manifest.value_columns == expected.value_columns
    assert (manifest.rows, manifest.key_format, manifest.partitioner) == (
        expected.rows,
        expected.key_format,
        expected.partitioner,
    )
    assert built.rows == reference.rows > 0
    for partition in range(PARTITIONS):
        rows = partition_rows(Path(built.snapshot), manifest, partition)
        assert rows == partition_rows(Path(reference.snapshot), expected, partition), f"{built.store} p{partition}"


def test_tables_orc_sql_and_reader_options_hold_what_json_files_hold(
    spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path, lake: dict[str, Any]
) -> None:
    db, files = lake["db"], lake["files"]
    write_csv(tmp_path / "bookings.csv", lake["bookings"])
    (tmp_path / "bookings.ssv").write_text((tmp_path / "bookings.csv").read_text().replace(",", ";"))
    spark.table(f"{db}.bookings_orc").write.orc(str(tmp_path / "orc"))
    sql = f"""
        -- every booking of a known customer (bookings: a parquet table; customers: an ORC one), with its tier
        SELECT b.*, c.tier, c.since
        FROM {db}.bookings AS b JOIN {db}.customers AS c ON b.customer_id = c.customer_id;
    """
    stores = {
        "json": latest({"source": str(files / "bookings.json"), "format": "json"}),
        "sql_joined": latest({"source_sql": sql}, JOINED_COLUMNS),
        # audited: the partition each record was produced to is checked, as for files
        "orc_table": latest({"source_table": f"{db}.bookings_orc"}, source_partition_column="kafka_partition"),
        "orc_files": latest({"source": "orc", "format": "orc", "options": {"mergeSchema": True}}),
        "csv_semicolons": latest(
            {"source": "bookings.ssv", "format": "csv", "options": {"delimiter": ";", "header": True}}
        ),
    }
    spec = write_spec(tmp_path / "stores.toml", stores)
    # The session's own warehouse directory, as a path (the session holds it as a file: URI): nothing to change.
    warehouse = spark.conf.get("spark.sql.warehouse.dir").removeprefix("file:")
    with_spark_table(spec, {"spark.sql.warehouse.dir": warehouse})

    published = {p.store: p for p in build(spec, zk_settings, str(tmp_path / "out"), spark=spark)}

    assert_latest(published["json"], lake["bookings"])
    assert_latest(published["sql_joined"], lake["joined"], JOINED_COLUMNS)
    assert published["sql_joined"].rows < published["json"].rows  # the join dropped customers without a record
    for store in ("orc_table", "orc_files", "csv_semicolons"):
        assert_same_version(published[store], published["json"])


def derby_catalog(name: str, url: str) -> dict[str, str]:
    """The settings of a catalog `name`: Spark's JDBC catalog on the Derby database at `url` (Derby ships
    with Spark)."""
    return {
        f"spark.sql.catalog.{name}": "org.apache.spark.sql.execution.datasources.v2.jdbc.JDBCTableCatalog",
        f"spark.sql.catalog.{name}.url": url,
        f"spark.sql.catalog.{name}.driver": "org.apache.derby.jdbc.EmbeddedDriver",
    }


def write_catalog_table(spark: SparkSession, conf: dict[str, str], lake: dict[str, Any]) -> None:
    """The bookings as table shop.bookings of the catalog `conf` configures, set for the write only."""
    catalog = next(iter(conf)).removeprefix("spark.sql.catalog.")
    for name, value in conf.items():
        spark.conf.set(name, value)
    try:
        spark.sql(f"CREATE NAMESPACE {catalog}.shop")
        bookings = spark.table(f"{lake['db']}.bookings").select("customer_id", *COLUMNS)
        bookings.writeTo(f"{catalog}.shop.bookings").create()
    finally:
        for name in conf:
            spark.conf.unset(name)


def test_the_spark_table_sets_a_catalog_for_the_build_and_puts_it_back(
    spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path, lake: dict[str, Any]
) -> None:
    """A catalog the session does not have, configured only by the spec: Spark's JDBC catalog on an in-memory
    Derby database (Derby ships with Spark). The table is written through another catalog name on the same
    database, which the test drops before the build."""
    catalog = f"kr_lake_{uuid.uuid4().hex[:8]}"
    conf = derby_catalog(catalog, f"jdbc:derby:memory:{catalog};create=true")
    write_catalog_table(spark, {name.replace(catalog, f"{catalog}_writer"): v for name, v in conf.items()}, lake)
    stores = {"derby": latest({"source_table": f"{catalog}.shop.bookings"})}
    spec = write_spec(tmp_path / "stores.toml", stores)
    with_spark_table(spec, conf)

    published = {p.store: p for p in build(spec, zk_settings, str(tmp_path / "out"), spark=spark)}

    assert_latest(published["derby"], lake["bookings"])
    assert all(spark.conf.get(name, None) is None for name in conf), "the session's settings are put back"


def test_a_hybrid_store_reads_the_topics_archive_from_a_table(
    spark: SparkSession,
    zk_settings: ZkSettings,
    kafka: MockKafka,
    kafka_topic: Callable[[int], str],
    tmp_path: Path,
    lake: dict[str, Any],
) -> None:
    """The archive's partition and offset columns work from a table as from files: audited, and each
    partition's version ends at its greatest archived offset."""
    topic = kafka_topic(live_pipeline.PARTITIONS)
    records = [(f"k{i % 17}", {"ts": i, "qty": i % 5}) for i in range(120)]
    placed = live_pipeline.produce(kafka, topic, records)
    archive = [
        {"k": key, **value, "kafka_partition": partition, "kafka_offset": offset}
        for (key, value), (partition, offset) in zip(records, placed, strict=True)
        if offset < 2 * partition  # a cut that differs per partition, none at all for partition 0
    ]
    write_jsonl(tmp_path / "archive.json", archive)
    table = f"{lake['db']}.archive_{uuid.uuid4().hex[:8]}"
    spark.read.json(str(tmp_path / "archive.json")).write.format("orc").saveAsTable(table)
    fields = {
        "source_table": table,
        "key": "k",
        "partitions": live_pipeline.PARTITIONS,
        "mode": "latest",
        "order_by": "ts",
        "source_partition_column": "kafka_partition",
        "source_offset_column": "kafka_offset",
    }
    live = {"topic": topic, "bootstrap_servers": kafka.bootstrap_servers}
    spec = live_pipeline.build_spec(tmp_path, "hybrid", fields, live)

    [published] = build(spec, zk_settings, str(tmp_path / "out"), spark=spark)

    assert published.live_offsets == tuple(2 * p for p in range(live_pipeline.PARTITIONS))
    assert published.rows == len({row["k"] for row in archive}) > 0


def test_a_setting_the_running_session_cannot_take_is_refused_before_any_store_is_built(
    spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path, lake: dict[str, Any]
) -> None:
    store = latest({"source_table": f"{lake['db']}.bookings"})
    running = spark.conf.get("spark.sql.warehouse.dir")
    for setting, value, message in [
        (
            "spark.sql.warehouse.dir",
            str(tmp_path / "warehouse"),
            f"the Spark session already runs with {running!r}, and Spark cannot change it in a running session",
        ),
        (
            "spark.jars.packages",
            "io.delta:delta-spark_2.13:4.0.0",
            "the Spark session already runs without it, and Spark cannot change it in a running session",
        ),
    ]:
        spec = tmp_path / "stores.toml"
        write_spec(spec, {"bookings": store})
        # Put after another setting the session does take: that one is put back when the build is refused.
        with_spark_table(spec, {"spark.sql.ansi.enabled": "false", setting: value})
        with pytest.raises(SpecError) as err:
            build(spec, zk_settings, str(tmp_path / "out"), spark=spark)
        assert str(err.value) == f"spec {str(spec)!r}: [spark] {setting!r} = {value!r}: {message}"
        assert_nothing_published(zk_settings, tmp_path / "out", ["bookings"])
        assert spark.conf.get("spark.sql.ansi.enabled") == "true"
    assert spark.conf.get("spark.sql.warehouse.dir") == running


def test_a_missing_table_bad_sql_or_a_missing_column_fails_the_build_in_one_line(
    spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path, lake: dict[str, Any]
) -> None:
    db = lake["db"]
    cases: list[tuple[dict[str, Any], type[PipelineError], str]] = [
        (
            latest({"source_table": f"{db}.nope"}),
            DataError,
            f"cannot read source_table '{db}.nope': [TABLE_OR_VIEW_NOT_FOUND] The table or view `{db}`.`nope` "
            "cannot be found.",
        ),
        (
            latest({"source_sql": f"SELECT * FROM {db}.bookings JOIN {db}.nope USING (customer_id)"}),
            DataError,
            "cannot read source_sql: [TABLE_OR_VIEW_NOT_FOUND] The table or view",
        ),
        (
            latest({"source_sql": f"SELEC * FROM {db}.bookings"}),
            DataError,
            "cannot read source_sql: [PARSE_SYNTAX_ERROR] Syntax error at or near 'SELEC'. SQLSTATE: 42601 "
            "(line 1, pos 0)",
        ),
        (
            # Only a query is read: another statement is a syntax error, never run.
            latest({"source_sql": f"DROP TABLE {db}.customers"}),
            DataError,
            "cannot read source_sql: [PARSE_SYNTAX_ERROR] Syntax error at or near 'DROP'. SQLSTATE: 42601 "
            "(line 1, pos 0)",
        ),
        (
            latest({"source_sql": f"SELECT customer_id AS id, ts, route, fare, seats FROM {db}.bookings"}),
            DataError,
            "key column 'customer_id' is not in the source; available: 'id', 'ts', 'route', 'fare', 'seats'",
        ),
        (
            latest({"source_sql": f"SELECT customer_id, route, fare, seats FROM {db}.bookings"}),
            DataError,
            "order_by column 'ts' is not in the source",
        ),
        (
            totals({"source_sql": f"SELECT customer_id, ts, route, fare FROM {db}.bookings"}),
            SpecError,
            "aggregation 'seats' = 'sum(seats)' is not a valid Spark SQL aggregate",
        ),
    ]
    for store, error, message in cases:
        spec = write_spec(tmp_path / "stores.toml", {"broken": store})
        with pytest.raises(error) as err:
            build(spec, zk_settings, str(tmp_path / "out"), spark=spark)
        assert str(err.value).startswith(f"store 'broken': {message}"), str(err.value)
        assert "\n" not in str(err.value)
        assert_nothing_published(zk_settings, tmp_path / "out", ["broken"])
    assert spark.catalog.tableExists(f"{db}.customers")


@pytest.mark.parametrize(
    ("store", "spark", "message"),
    [
        (
            latest({"source_table": "db.t", "source_sql": "SELECT * FROM db.t"}),
            "",
            "store 'lost': give one of 'source', 'source_table' or 'source_sql', not both 'source_table' and "
            "'source_sql'",
        ),
        (
            latest({"source_table": "db.t"}),
            '"spark.sql.shuffle.partitions" = [8]',
            "spec {spec!r}: [spark] 'spark.sql.shuffle.partitions' must be a string, boolean or number, got [8]",
        ),
    ],
)
def test_cli_names_the_store_or_setting_in_one_line(
    zk_settings: ZkSettings, tmp_path: Path, store: dict[str, Any], spark: str, message: str
) -> None:
    """`keyroute pipeline build` in its own process: a spec mistake is found before Spark starts."""
    spec = write_spec(tmp_path / "stores.toml", {"lost": store})
    spec.write_text(f"[spark]\n{spark}\n\n" + spec.read_text())
    done = subprocess.run(
        [sys.executable, "-m", "keyroute", "pipeline", "build", "--spec", str(spec), "--output", str(tmp_path / "out")]
        + ["--zk", zk_settings.connect_string],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr.splitlines() == ["keyroute pipeline build: " + message.format(spec=str(spec))]


def test_cli_starts_its_session_with_the_spark_table(
    spark: SparkSession, zk_settings: ZkSettings, tmp_path: Path, lake: dict[str, Any]
) -> None:
    """`keyroute pipeline build` in its own process starts Spark with the spec's settings: a JDBC catalog on a
    Derby database on disk, which this process writes and then closes (Derby lets one process open it)."""
    database = tmp_path / "derby"
    conf = derby_catalog("lake", f"jdbc:derby:{database};create=true")
    write_catalog_table(spark, {name.replace("lake", "kr_cli_writer"): v for name, v in conf.items()}, lake)
    with contextlib.suppress(Exception):  # Derby answers a shutdown with an exception
        spark.sparkContext._jvm.java.sql.DriverManager.getConnection(f"jdbc:derby:{database};shutdown=true")
    (tmp_path / "spec").mkdir()
    spec = write_spec(tmp_path / "spec" / "stores.toml", {"derby": latest({"source_table": "lake.shop.bookings"})})
    with_spark_table(spec, conf)
    done = run_cli(spec, zk_settings, str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    [line] = [json.loads(line) for line in done.stdout.splitlines()]
    published = PublishedVersion(line["store"], line["version"], line["snapshot"], line["rows"], line["partitions"])
    assert_latest(published, lake["bookings"])
