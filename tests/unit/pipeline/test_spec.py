"""keyroute.pipeline.spec: the TOML store spec parsed into frozen values, and every mistake named with its store.

Pure: no Spark, no ZooKeeper.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.pipeline.errors import PipelineError, SpecError
from keyroute.pipeline.spec import Mode, SourceFormat, Spec, StoreSpec, load_spec

CONTRACT_EXAMPLE = """
[stores.bookings]
source = "data/bookings"        # file or directory, any URI Spark can read
format = "json"                 # json (JSON lines) | csv | parquet
key = "customer_id"             # key column
key_format = "string"
partitions = 12
partitioner = "murmur2"
replication_factor = 2
mode = "latest"
order_by = "ts"
columns = ["ts", "route", "fare"]

[stores.positions]
source = "data/trades"
format = "json"
key = "asset"
partitions = 6
mode = "aggregate"
aggregations = { trades = "count(*)", volume = "sum(qty)", last_price = "max_by(price, ts)" }
"""

LATEST = """
[stores.bookings]
source = "events.json"
format = "json"
key = "customer_id"
partitions = 4
mode = "latest"
order_by = "ts"
"""

AGGREGATE = """
[stores.bookings]
source = "events.json"
format = "json"
key = "customer_id"
partitions = 4
mode = "aggregate"
aggregations = { n = "count(*)" }
"""


def write_spec(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "stores.toml"
    path.write_text(text, encoding="utf-8")
    return path


def with_fields(base: str, **fields: str) -> str:
    """`base` with fields replaced or added (value is TOML source text; "" removes the field)."""
    lines = base.strip().splitlines()
    for name, value in fields.items():
        lines = [line for line in lines if not line.startswith(f"{name} =")]
        if value:
            lines.append(f"{name} = {value}")
    return "\n".join(lines) + "\n"


def spec_error(tmp_path: Path, text: str) -> SpecError:
    with pytest.raises(SpecError) as err:
        load_spec(write_spec(tmp_path, text))
    return err.value


# --- what a valid spec gives ----------------------------------------------------------------------------


def test_contract_example_parses_into_frozen_values(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, CONTRACT_EXAMPLE))
    assert spec == Spec(
        stores=(
            StoreSpec(
                name="bookings",
                source=str(tmp_path.resolve() / "data" / "bookings"),
                format=SourceFormat.JSON,
                key="customer_id",
                key_format=KeyFormat.STRING,
                partitions=12,
                partitioner=Partitioner.MURMUR2,
                replication_factor=2,
                mode=Mode.LATEST,
                order_by="ts",
                columns=("ts", "route", "fare"),
            ),
            StoreSpec(
                name="positions",
                source=str(tmp_path.resolve() / "data" / "trades"),
                format=SourceFormat.JSON,
                key="asset",
                partitions=6,
                mode=Mode.AGGREGATE,
                aggregations={"trades": "count(*)", "volume": "sum(qty)", "last_price": "max_by(price, ts)"},
            ),
        )
    )
    assert spec.store("positions").partitions == 6
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.stores[0].partitions = 13  # type: ignore[misc]


def test_defaults(tmp_path: Path) -> None:
    store = load_spec(write_spec(tmp_path, LATEST)).stores[0]
    assert store.key_format is KeyFormat.STRING
    assert store.partitioner is Partitioner.MURMUR2
    assert store.replication_factor == 1
    assert store.columns is None  # every source column but the key
    assert store.aggregations == {}
    assert store.source_partition_column is None


def test_every_option_is_read(tmp_path: Path) -> None:
    text = with_fields(
        LATEST,
        format='"CSV"',
        key_format='"int64"',
        partitioner='"fnv1a"',
        replication_factor="3",
        columns='["ts", "fare"]',
        source_partition_column='"day"',
    )
    store = load_spec(write_spec(tmp_path, text)).stores[0]
    assert store.format is SourceFormat.CSV  # names are case-insensitive, like the CLI's
    assert store.key_format is KeyFormat.INT64
    assert store.partitioner is Partitioner.FNV1A
    assert store.replication_factor == 3
    assert store.columns == ("ts", "fare")
    assert store.source_partition_column == "day"


def test_relative_source_is_relative_to_the_spec_file_not_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec_dir = tmp_path / "conf"
    spec_dir.mkdir()
    monkeypatch.chdir(tmp_path)
    store = load_spec(write_spec(spec_dir, with_fields(LATEST, source='"../data/events.json"'))).stores[0]
    assert store.source == str(tmp_path.resolve() / "data" / "events.json")


@pytest.mark.parametrize(
    "source",
    ["/srv/data/events", "file:///srv/data/events", "s3a://bucket/events/", "hdfs://nn:8020/events/*.json"],
)
def test_absolute_paths_and_uris_are_kept(tmp_path: Path, source: str) -> None:
    store = load_spec(write_spec(tmp_path, with_fields(LATEST, source=f'"{source}"'))).stores[0]
    assert store.source == source


@pytest.mark.parametrize("name", ["bookings", "Bookings_2", "a.b-c", "x"])
def test_store_names_of_safe_characters_are_accepted(tmp_path: Path, name: str) -> None:
    spec = load_spec(write_spec(tmp_path, LATEST.replace("[stores.bookings]", f'[stores."{name}"]')))
    assert spec.stores[0].name == name


def test_aggregate_store(tmp_path: Path) -> None:
    store = load_spec(write_spec(tmp_path, AGGREGATE)).stores[0]
    assert store.mode is Mode.AGGREGATE
    assert store.aggregations == {"n": "count(*)"}
    assert store.order_by is None


# --- every mistake names the store and the problem ------------------------------------------------------


@pytest.mark.parametrize(
    ("base", "fields", "message"),
    [
        (LATEST, {"key": ""}, "missing required field 'key'"),
        (
            LATEST,
            {"source": ""},
            "missing required field 'source' (or 'source_table', 'source_sql', or a [stores.NAME.live] table: "
            "a live store)",
        ),
        (LATEST, {"format": ""}, "missing required field 'format'"),
        (LATEST, {"partitions": ""}, "missing required field 'partitions'"),
        (LATEST, {"mode": ""}, "missing required field 'mode'"),
        (
            LATEST,
            {"partitioner": '"murmur3"'},
            "unknown partitioner 'murmur3' (expected one of: murmur2, crc32, fnv1a)",
        ),
        (
            LATEST,
            {"key_format": '"long"'},
            "unknown key format 'long' (expected one of: string, int16, int32, int64, uuid, bytes, avro, protobuf, "
            "json_schema)",
        ),
        (LATEST, {"format": '"xml"'}, "unknown format 'xml' (expected one of: json, csv, parquet, orc)"),
        (LATEST, {"mode": '"sum"'}, "unknown mode 'sum' (expected one of: latest, aggregate, history, windowed)"),
        (
            LATEST,
            {"order_by": ""},
            "mode 'latest' needs 'order_by' (the column whose greatest value wins)",
        ),
        (
            AGGREGATE,
            {"aggregations": ""},
            "mode 'aggregate' needs a non-empty 'aggregations' table (name = \"expression\")",
        ),
        (
            AGGREGATE,
            {"aggregations": "{}"},
            "mode 'aggregate' needs a non-empty 'aggregations' table (name = \"expression\")",
        ),
        (LATEST, {"partitions": "0"}, "'partitions' must be an integer of at least 1, got 0"),
        (LATEST, {"partitions": "-3"}, "'partitions' must be an integer of at least 1, got -3"),
        (LATEST, {"partitions": "true"}, "'partitions' must be an integer of at least 1, got True"),
        (LATEST, {"partitions": '"12"'}, "'partitions' must be an integer of at least 1, got '12'"),
        (LATEST, {"partitions": "1.5"}, "'partitions' must be an integer of at least 1, got 1.5"),
        (
            LATEST,
            {"partitions": "2147483648"},
            "'partitions' must be at most 2147483647, got 2147483648",
        ),
        (
            LATEST,
            {"replication_factor": "0"},
            "'replication_factor' must be an integer of at least 1, got 0",
        ),
        (LATEST, {"key": '""'}, "'key' must be a non-empty string, got ''"),
        (LATEST, {"key": "7"}, "'key' must be a non-empty string, got 7"),
        (LATEST, {"columns": "[]"}, "'columns' must be a non-empty list of column names, got []"),
        (LATEST, {"columns": '"ts"'}, "'columns' must be a non-empty list of column names, got 'ts'"),
        (LATEST, {"columns": '["ts", "ts"]'}, "'columns' lists 'ts' more than once"),
        (
            LATEST,
            {"columns": '["ts", "customer_id"]'},
            "'columns' lists the key column 'customer_id'; values hold the other columns",
        ),
        (
            LATEST,
            {"aggregations": '{ n = "count(*)" }'},
            "'aggregations' only apply to modes 'aggregate' and 'windowed'",
        ),
        (AGGREGATE, {"order_by": '"ts"'}, "'order_by' only applies to mode 'latest'"),
        (
            AGGREGATE,
            {"columns": '["ts"]'},
            "'columns' only applies to mode 'latest' (aggregate values are the aggregations)",
        ),
        (
            AGGREGATE,
            {"aggregations": "{ n = 1 }"},
            "aggregation 'n' must be a Spark SQL aggregate expression, got 1",
        ),
        (
            AGGREGATE,
            {"aggregations": '{ customer_id = "max(ts)" }'},
            "aggregation 'customer_id' has the name of the key column",
        ),
        (
            LATEST,
            {"source_partition_column": '"customer_id"'},
            "'source_partition_column' names the key column 'customer_id'",
        ),
        (
            LATEST,
            {"source_partition_column": "3"},
            "'source_partition_column' must be a non-empty string, got 3",
        ),
    ],
)
def test_mistakes_name_the_store_and_the_problem(
    tmp_path: Path, base: str, fields: dict[str, str], message: str
) -> None:
    err = spec_error(tmp_path, with_fields(base, **fields))
    assert str(err) == f"store 'bookings': {message}"
    assert err.store == "bookings"
    assert isinstance(err, PipelineError)


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("partitoner", "partitioner"),
        ("order-by", "order_by"),
        ("order_bye", "order_by"),
        ("Key", "key"),
        ("aggregation", "aggregations"),
    ],
)
def test_an_unknown_field_close_to_a_known_one_says_which(tmp_path: Path, typo: str, meant: str) -> None:
    err = spec_error(tmp_path, LATEST + f'{typo} = "x"\n')
    assert str(err) == f"store 'bookings': unknown field {typo!r} (did you mean {meant!r}?)"


@pytest.mark.parametrize("unknown", ["bucket", "tags"])
def test_an_unknown_field_like_no_known_one_lists_them_all(tmp_path: Path, unknown: str) -> None:
    err = spec_error(tmp_path, LATEST + f'{unknown} = "x"\n')
    expected = (
        f"store 'bookings': unknown field {unknown!r} (expected some of: source, source_table, source_sql, format, "
        "options, key,"
    )
    assert str(err).startswith(expected)
    assert str(err).endswith("schema_registry)")


def test_error_names_the_store_at_fault_among_several(tmp_path: Path) -> None:
    second = LATEST.replace("[stores.bookings]", "[stores.positions]")
    second = second.replace("partitions = 4", "partitions = 0")
    err = spec_error(tmp_path, LATEST + second)
    assert str(err) == "store 'positions': 'partitions' must be an integer of at least 1, got 0"


@pytest.mark.parametrize("name", ["book ings", "a/b", "..", ".", "ü", "a:b", ""])
def test_store_names_that_cannot_be_a_znode_or_directory_are_refused(tmp_path: Path, name: str) -> None:
    err = spec_error(tmp_path, LATEST.replace("[stores.bookings]", f'[stores."{name}"]'))
    assert str(err) == f"store {name!r}: invalid store name (use only letters, digits, '_', '.' and '-')"


def test_store_must_be_a_table(tmp_path: Path) -> None:
    err = spec_error(tmp_path, "[stores]\nbookings = 3\n")
    assert str(err) == "store 'bookings': must be a table ([stores.NAME])"


# --- the file as a whole --------------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as err:
        load_spec(tmp_path / "nope.toml")
    assert str(err.value).startswith(f"spec {str(tmp_path / 'nope.toml')!r}: cannot be read")
    assert err.value.store is None


def test_invalid_toml(tmp_path: Path) -> None:
    err = spec_error(tmp_path, 'key = "a"\nkey = ')
    assert "not valid TOML" in str(err)


@pytest.mark.parametrize(
    ("text", "line", "header"),
    [
        ("[stores.bookings\nkey = ", 1, "[stores.bookings"),
        # The parser reads the key first and would call this a second declaration of stores.bookings.
        (LATEST + "\n[stores.bookings\nkey = 'b'\n", 10, "[stores.bookings"),
        (LATEST + "[stores.other  # the next store\n", 9, "[stores.other  # the next store"),
        ("[[stores.x]\n", 1, "[[stores.x]"),
    ],
)
def test_an_unclosed_table_header_is_named_with_its_line(tmp_path: Path, text: str, line: int, header: str) -> None:
    err = spec_error(tmp_path, text)
    path = str(tmp_path / "stores.toml")
    assert str(err) == f"spec {path!r}: line {line}: table header {header!r} is not closed (a ']' is missing)"
    assert "\n" not in str(err)


def test_a_multi_line_array_is_no_table_header(tmp_path: Path) -> None:
    err = spec_error(tmp_path, LATEST + "columns = [\n  [1, 2],\n  'ts',\n]\nbroken = \n")
    assert "not valid TOML" in str(err) and "table header" not in str(err)


def test_spec_without_stores(tmp_path: Path) -> None:
    err = spec_error(tmp_path, "# nothing here\n")
    assert "defines no stores" in str(err)


def test_unknown_top_level_key(tmp_path: Path) -> None:
    err = spec_error(tmp_path, 'store = "x"\n' + LATEST)
    assert "unknown top-level key 'store' (did you mean 'stores'?)" in str(err)
    err = spec_error(tmp_path, 'output = "x"\n' + LATEST)
    assert "unknown top-level key 'output' (only [spark] and [stores.NAME] tables)" in str(err)
