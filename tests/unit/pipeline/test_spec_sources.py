"""keyroute.pipeline.spec: where a store's batch part is read from (files in a format with reader options, a
catalog table, a Spark SQL query) and the spec's `[spark]` settings, each mistake named with its store or
setting. Pure: no Spark."""

from __future__ import annotations

from pathlib import Path

import pytest

from keyroute.pipeline.errors import SpecError
from keyroute.pipeline.spec import SourceFormat, load_spec

BASE = """
key = "customer_id"
partitions = 4
mode = "latest"
order_by = "ts"
"""


def spec_text(source: str, spark: str = "", extra: str = "") -> str:
    return spark + "\n[stores.bookings]\n" + source.strip() + "\n" + BASE + extra


def load(tmp_path: Path, text: str):  # type: ignore[no-untyped-def]
    path = tmp_path / "stores.toml"
    path.write_text(text, encoding="utf-8")
    return load_spec(path)


def spec_error(tmp_path: Path, text: str) -> str:
    with pytest.raises(SpecError) as err:
        load(tmp_path, text)
    return str(err.value)


def test_orc_files_with_reader_options_as_the_text_spark_takes(tmp_path: Path) -> None:
    options = """
[stores.bookings.options]
mergeSchema = true
recursiveFileLookup = "true"
maxFilesPerTrigger = 10
samplingRatio = 0.5
"""
    text = spec_text('source = "data/bookings"\nformat = "ORC"', extra=options)
    store = load(tmp_path, text).store("bookings")
    assert store.format is SourceFormat.ORC
    assert store.source == str(tmp_path / "data" / "bookings")
    assert store.options == {
        "mergeSchema": "true",
        "recursiveFileLookup": "true",
        "maxFilesPerTrigger": "10",
        "samplingRatio": "0.5",
    }
    assert (store.source_table, store.source_sql, store.batch) == (None, None, True)
    assert store.describe_source() == f"source {store.source!r}"


def test_csv_options_inline(tmp_path: Path) -> None:
    text = spec_text('source = "e.csv"\nformat = "csv"\noptions = { delimiter = ";", header = false }')
    store = load(tmp_path, text).store("bookings")
    assert store.options == {"delimiter": ";", "header": "false"}


def test_a_catalog_table(tmp_path: Path) -> None:
    store = load(tmp_path, spec_text('source_table = "shop.bookings"')).store("bookings")
    assert (store.source, store.format, store.source_table, store.source_sql) == (None, None, "shop.bookings", None)
    assert store.batch and store.options == {}
    assert store.describe_source() == "source_table 'shop.bookings'"


def test_a_spark_sql_query(tmp_path: Path) -> None:
    sql = "SELECT b.*, c.tier FROM shop.bookings b JOIN shop.customers c USING (customer_id)"
    store = load(tmp_path, spec_text(f'source_sql = """\n{sql}\n"""')).store("bookings")
    assert store.source_sql == sql + "\n"
    assert store.batch and store.describe_source() == "source_sql"


def test_a_hybrid_store_may_read_its_archive_from_a_table(tmp_path: Path) -> None:
    text = spec_text(
        'source_table = "lake.trades_archive"',
        extra='source_partition_column = "p"\nsource_offset_column = "o"\n'
        '[stores.bookings.live]\ntopic = "t"\nbootstrap_servers = "k:9092"\n',
    )
    store = load(tmp_path, text).store("bookings")
    assert store.live is not None and store.source_offset_column == "o"


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            'source = "e.json"\nformat = "json"\nsource_table = "db.t"',
            "give one of 'source', 'source_table' or 'source_sql', not both 'source' and 'source_table'",
        ),
        (
            'source_table = "db.t"\nsource_sql = "SELECT 1"',
            "give one of 'source', 'source_table' or 'source_sql', not both 'source_table' and 'source_sql'",
        ),
        (
            'source_table = "db.t"\nformat = "parquet"',
            "'format' describes the files of 'source'; a store read from 'source_table' takes none",
        ),
        (
            'source_sql = "SELECT 1"\noptions = { header = true }',
            "'options' describes the files of 'source'; a store read from 'source_sql' takes none",
        ),
        ('source_table = ""', "'source_table' must be a non-empty string, got ''"),
        ("source_sql = 1", "'source_sql' must be a non-empty string, got 1"),
        ('source = "e.json"', "missing required field 'format'"),
        (
            'source = "e.json"\nformat = "json"\noptions = "header"',
            "'options' must be a table of Spark reader options, got 'header'",
        ),
        (
            'source = "e.json"\nformat = "json"\noptions = { header = [1] }',
            "'options.header' must be a string, boolean or number (the text Spark's reader takes), got [1]",
        ),
        (
            'source = "e.json"\nformat = "json"\noptions = { dateFormat = 2024-01-01 }',
            "'options.dateFormat' must be a string, boolean or number (the text Spark's reader takes), got "
            "datetime.date(2024, 1, 1)",
        ),
        (
            'source = "e.json"\nformat = "json"\noptions = { sep = { a = 1 } }',
            "'options.sep' must be a string, boolean or number (the text Spark's reader takes), got {'a': 1}",
        ),
        ('source_tabel = "db.t"', "unknown field 'source_tabel' (did you mean 'source_table'?)"),
    ],
)
def test_source_mistakes_name_the_store(tmp_path: Path, source: str, message: str) -> None:
    assert spec_error(tmp_path, spec_text(source)) == f"store 'bookings': {message}"


def test_the_spark_table_reads_quoted_and_dotted_names_as_text(tmp_path: Path) -> None:
    spark = """
[spark]
"spark.sql.catalog.lake" = "org.apache.iceberg.spark.SparkCatalog"
"spark.sql.catalog.lake.type" = "hadoop"
"spark.sql.catalog.lake.warehouse" = "s3a://bucket/warehouse"
"spark.sql.warehouse.dir" = "warehouse"
spark.sql.catalogImplementation = "hive"
spark.hadoop.hive.metastore.uris = "thrift://metastore:9083"
"spark.sql.shuffle.partitions" = 64
"spark.sql.adaptive.enabled" = false
"spark.memory.fraction" = 0.5
"""
    spec = load(tmp_path, spec_text('source_table = "lake.db.bookings"', spark=spark))
    assert spec.spark.conf == {
        "spark.sql.catalog.lake": "org.apache.iceberg.spark.SparkCatalog",
        "spark.sql.catalog.lake.type": "hadoop",
        "spark.sql.catalog.lake.warehouse": "s3a://bucket/warehouse",
        # relative to the spec file, as sources are
        "spark.sql.warehouse.dir": str(tmp_path / "warehouse"),
        "spark.sql.catalogImplementation": "hive",
        "spark.hadoop.hive.metastore.uris": "thrift://metastore:9083",
        "spark.sql.shuffle.partitions": "64",
        "spark.sql.adaptive.enabled": "false",
        "spark.memory.fraction": "0.5",
    }


def test_a_spec_without_a_spark_table_sets_nothing(tmp_path: Path) -> None:
    assert load(tmp_path, spec_text('source_table = "t"')).spark.conf == {}


@pytest.mark.parametrize(
    ("spark", "message"),
    [
        ('spark = "local"', "'spark' must be a table ([spark]) of Spark settings, got 'local'"),
        (
            '[spark]\n"sql.warehouse.dir" = "/w"',
            "[spark] 'sql.warehouse.dir': Spark settings are named spark.* (e.g. 'spark.sql.warehouse.dir')",
        ),
        (
            '[spark]\n"spark.jars" = ["a.jar"]',
            "[spark] 'spark.jars' must be a string, boolean or number, got ['a.jar']",
        ),
        (
            '[spark]\n"spark.master" = "local[4]"',
            "[spark] 'spark.master' cannot be set in a spec: use the --master option",
        ),
        (
            '[spark]\n"spark.sql.session.timeZone" = "Europe/Paris"',
            "[spark] 'spark.sql.session.timeZone' cannot be set in a spec: keyroute reads and writes times in UTC",
        ),
        (
            '[spark]\n"spark.sql.ansi.enabled" = true\nspark.sql.ansi.enabled = false',
            "[spark] 'spark.sql.ansi.enabled' is set twice (once quoted, once as dotted keys)",
        ),
        (
            "[sparks]\n",
            "unknown top-level key 'sparks' (did you mean 'spark'?) (only [spark] and [stores.NAME] tables)",
        ),
    ],
)
def test_spark_table_mistakes_name_the_setting(tmp_path: Path, spark: str, message: str) -> None:
    path = tmp_path / "stores.toml"
    assert spec_error(tmp_path, spec_text('source_table = "t"', spark=spark)) == f"spec {str(path)!r}: {message}"
