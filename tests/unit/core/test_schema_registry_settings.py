"""keyroute.keys.schema_registry: the spec's `schema_registry` table, the client configuration it makes, and the
cached fetch (against the session's development registry process)."""

from __future__ import annotations

import json
import uuid

import certifi
import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient

from keyroute.keys.schema_registry import (
    RegistrySettings,
    RegistrySettingsError,
    RegistryUnavailable,
    SchemaFetcher,
    UnknownSchema,
)
from tests.util import free_port

RECORD = json.dumps({"type": "record", "name": "R", "fields": [{"name": "a", "type": "long"}]})


def test_parse_keeps_the_clients_option_names_and_secrets_as_references() -> None:
    settings = RegistrySettings.parse(
        {
            "url": "https://a:8081, https://b:8081",
            "basic.auth.user.info": "${SR_USER}",
            "ssl.ca.location": certifi.where(),
            "timeout": 5,
        }
    )
    assert settings.url == "https://a:8081,https://b:8081"
    assert RegistrySettings.from_json(json.loads(json.dumps(settings.to_json()))) == settings
    conf = settings.client_conf({"SR_USER": "ann:secret"})
    assert conf == {
        "url": "https://a:8081,https://b:8081",
        "basic.auth.user.info": "ann:secret",
        "ssl.ca.location": certifi.where(),
        "timeout": 5.0,
    }
    SchemaRegistryClient(conf)  # the client takes it as it is
    bearer = RegistrySettings.parse({"url": "http://r:8081", "bearer.auth.token": "${TOKEN}"})
    conf = bearer.client_conf({"TOKEN": "t0k"})
    assert conf["bearer.auth.credentials.source"] == "STATIC_TOKEN" and conf["bearer.auth.token"] == "t0k"
    SchemaRegistryClient(conf)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({}, "schema_registry.url is required"),
        ({"url": "registry:8081"}, "is not an http(s) URL"),
        ({"url": "https://u:p@r:8081"}, "carries credentials"),
        ({"url": "http://r", "basic.auth.user.info": "ann:secret"}, "is a secret"),
        ({"url": "http://r", "ssl.key.password": "pw"}, "is a secret"),
        ({"url": "http://r", "ssl.ca.locaton": "/x"}, "unknown option 'ssl.ca.locaton'"),
        ({"url": "http://r", "timeout": "ten"}, "timeout must be a number"),
        ({"url": "http://r", "basic.auth.user.info": "${A}", "bearer.auth.token": "${B}"}, "not both"),
        ("http://r", "must be a table"),
    ],
)
def test_parse_refuses_with_the_option_named(table: object, message: str) -> None:
    with pytest.raises(RegistrySettingsError) as err:
        RegistrySettings.parse(table)
    assert message in str(err.value)


def test_an_unset_reference_is_named() -> None:
    settings = RegistrySettings.parse({"url": "http://r", "basic.auth.user.info": "${SR_USER}"})
    with pytest.raises(RegistrySettingsError, match=r"names \$\{SR_USER\}, which is not set"):
        settings.client_conf({})
    with pytest.raises(RegistrySettingsError, match="USER:PASSWORD"):
        settings.client_conf({"SR_USER": "no-colon"})


def test_fetch_is_cached_and_failures_are_classified(schema_registry: str) -> None:
    subject = f"s-{uuid.uuid4().hex[:10]}"
    writer = SchemaRegistryClient({"url": schema_registry})
    schema_id = writer.register_schema(subject, Schema(RECORD, "AVRO"))
    now = [0.0]
    fetcher = SchemaFetcher(RegistrySettings(schema_registry), {}, latest_ttl_s=10, clock=lambda: now[0])
    assert fetcher.by_id(schema_id).schema_str == RECORD
    assert fetcher.latest(subject).schema_id == schema_id
    assert fetcher.version(subject, 1).version == 1
    with pytest.raises(UnknownSchema, match="schema id 99999"):
        fetcher.by_id(99999)
    with pytest.raises(UnknownSchema, match="subject"):
        fetcher.latest(f"{subject}-none")

    newer = json.dumps(
        {
            **json.loads(RECORD),
            "fields": [{"name": "a", "type": "long"}, {"name": "b", "type": "string", "default": ""}],
        }
    )
    new_id = writer.register_schema(subject, Schema(newer, "AVRO"))
    assert fetcher.latest(subject).schema_id == schema_id  # still within its time to live
    now[0] = 11.0
    assert fetcher.latest(subject).schema_id == new_id

    down = SchemaFetcher(RegistrySettings(f"http://127.0.0.1:{free_port()}", {"max.retries": "0"}), {})
    with pytest.raises(RegistryUnavailable):
        down.by_id(1)
    # an id once fetched is answered without the registry
    fetcher.client = down.client
    assert fetcher.by_id(schema_id).schema_str == RECORD
