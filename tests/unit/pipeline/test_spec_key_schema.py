"""The store spec's Schema Registry key fields: key_subject / key_schema_id, key_message, schema_registry."""

from __future__ import annotations

from pathlib import Path

import pytest

from keyroute.keys.key_format import KeyFormat
from keyroute.keys.schema_registry import RegistrySettings
from keyroute.pipeline.spec import load_spec
from tests.unit.pipeline.test_spec import LATEST, spec_error, with_fields, write_spec

REGISTRY = '{ url = "http://127.0.0.1:8081" }'


def test_avro_keys_by_subject(tmp_path: Path) -> None:
    text = with_fields(LATEST, key_format='"avro"', key_subject='"bookings-key"', schema_registry=REGISTRY)
    store = load_spec(write_spec(tmp_path, text)).store("bookings")
    assert store.key_format is KeyFormat.AVRO
    assert (store.key_subject, store.key_schema_id, store.key_message) == ("bookings-key", None, "")
    assert store.schema_registry == RegistrySettings("http://127.0.0.1:8081")
    assert store.key_schema is None  # resolved by the build


def test_protobuf_keys_by_id_with_a_message(tmp_path: Path) -> None:
    text = with_fields(
        LATEST, key_format='"protobuf"', key_schema_id="12", key_message='"keys.K"', schema_registry=REGISTRY
    )
    store = load_spec(write_spec(tmp_path, text)).store("bookings")
    assert (store.key_subject, store.key_schema_id, store.key_message) == (None, 12, "keys.K")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"key_format": '"avro"', "schema_registry": REGISTRY}, "needs 'key_subject' or 'key_schema_id'"),
        (
            {"key_format": '"avro"', "key_subject": '"s"', "key_schema_id": "3", "schema_registry": REGISTRY},
            "needs 'key_subject' or 'key_schema_id' (one of them)",
        ),
        ({"key_format": '"avro"', "key_subject": '"s"'}, "needs a [stores.bookings.schema_registry] table"),
        ({"key_format": '"json_schema"', "key_schema_id": '"x"', "schema_registry": REGISTRY}, "'key_schema_id'"),
        ({"key_subject": '"s"'}, "'key_subject' applies to key_format avro, protobuf or json_schema"),
        ({"schema_registry": REGISTRY}, "'schema_registry' applies to key_format avro, protobuf or json_schema"),
        (
            {"key_format": '"avro"', "key_subject": '"s"', "schema_registry": '{ url = "ftp://x" }'},
            "is not an http(s) URL",
        ),
        (
            {"key_format": '"avro"', "key_subject": '"s"', "key_message": '"M"', "schema_registry": REGISTRY},
            "'key_message' applies to key_format 'protobuf'",
        ),
    ],
)
def test_key_schema_mistakes_name_the_store_and_the_field(tmp_path: Path, fields: dict[str, str], message: str) -> None:
    err = spec_error(tmp_path, with_fields(LATEST, **fields))
    assert err.store == "bookings"
    assert message in str(err)


def test_keys_are_read_from_the_live_values_registry_without_a_table_of_their_own(tmp_path: Path) -> None:
    text = """
[stores.clicks]
key = "user"
key_format = "protobuf"
key_subject = "clicks-key"
partitions = 4
mode = "latest"
order_by = "ts"

[stores.clicks.live]
topic = "clicks"
bootstrap_servers = "127.0.0.1:9092"
value_format = "avro"
schema_registry = { url = "http://127.0.0.1:8081" }
"""
    store = load_spec(write_spec(tmp_path, text)).store("clicks")
    assert store.schema_registry == RegistrySettings("http://127.0.0.1:8081")
