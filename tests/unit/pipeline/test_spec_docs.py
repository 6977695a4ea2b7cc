"""The spec examples of docs/configuration.md and the README parse as the pipeline reads them: each TOML block
that defines stores is a spec the build accepts, and the Iceberg, Delta and Hive examples give the Spark
settings they show (configuration only: their jars are not installed here)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from keyroute.pipeline.spec import Spec, parse_spec

ROOT = Path(__file__).resolve().parents[3]
_TOML_BLOCK = re.compile(r"^```toml\n(.*?)^```", re.MULTILINE | re.DOTALL)


def spec_blocks(doc: str) -> list[str]:
    text = (ROOT / doc).read_text(encoding="utf-8")
    # A fragment showing one table is no spec: a block is one when it defines a store's key and partitions.
    return [block for block in _TOML_BLOCK.findall(text) if "key = " in block and "partitions = " in block]


BLOCKS = [(doc, block) for doc in ("docs/configuration.md", "README.md") for block in spec_blocks(doc)]


def parsed(block: str) -> Spec:
    return parse_spec(tomllib.loads(block), base_dir=ROOT, origin="example")


@pytest.mark.parametrize(("doc", "block"), BLOCKS, ids=[f"{doc}-{i}" for i, (doc, _) in enumerate(BLOCKS)])
def test_every_spec_example_parses(doc: str, block: str) -> None:
    assert parsed(block).stores


def test_the_catalog_examples_read_tables_and_queries_with_their_spark_settings() -> None:
    blocks = [parsed(block) for block in spec_blocks("docs/configuration.md") if "[spark]" in block]
    confs = [spec.spark.conf for spec in blocks]
    assert len(blocks) == 4, "the built-in catalog, Hive metastore, Iceberg and Delta examples"
    assert confs[0] == {"spark.sql.warehouse.dir": "/data/warehouse"}
    assert [store.source_table or store.source_sql is not None for store in blocks[0].stores] == [
        "shop.orders",
        True,
        False,
    ]
    assert blocks[0].store("shipments").options == {"delimiter": ";", "header": "true", "multiLine": "true"}
    assert confs[1]["spark.sql.catalogImplementation"] == "hive"
    assert confs[1]["spark.hadoop.hive.metastore.uris"].startswith("thrift://")
    assert confs[2]["spark.sql.catalog.lake"] == "org.apache.iceberg.spark.SparkCatalog"
    assert confs[2]["spark.jars.packages"].startswith("org.apache.iceberg:iceberg-spark-runtime-")
    assert confs[3]["spark.sql.catalog.spark_catalog"] == "org.apache.spark.sql.delta.catalog.DeltaCatalog"
    assert confs[3]["spark.jars.packages"].startswith("io.delta:delta-spark_")
