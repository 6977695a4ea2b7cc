"""`ttl` in the spec: a duration on a latest store whose values carry its order_by, or a history store;
anything else is a SpecError naming the store and saying why, and the store's record carries it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.pipeline.publish import store_record
from keyroute.pipeline.spec import load_spec
from keyroute.pipeline.writer import WrittenVersion
from keyroute.storage.snapshot import Manifest
from keyroute.storage.ttl import Ttl
from tests.unit.pipeline.test_publish import STORE
from tests.unit.pipeline.test_spec import AGGREGATE, LATEST, spec_error, with_fields, write_spec


def test_a_latest_store_takes_a_ttl(tmp_path: Path) -> None:
    store = load_spec(write_spec(tmp_path, with_fields(LATEST, ttl='"7 days"'))).stores[0]
    assert store.ttl == "7 days"
    assert load_spec(write_spec(tmp_path, LATEST)).stores[0].ttl is None
    with_columns = with_fields(LATEST, ttl='"36 hours"', columns='["ts", "fare"]')
    assert load_spec(write_spec(tmp_path, with_columns)).stores[0].ttl == "36 hours"


def test_a_history_store_takes_a_ttl(tmp_path: Path) -> None:
    history = with_fields(LATEST, mode='"history"', ttl='"30 days"', columns='["fare"]')
    assert load_spec(write_spec(tmp_path, history)).stores[0].ttl == "30 days"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (with_fields(LATEST, ttl='"soon"'), "'ttl'"),
        (with_fields(LATEST, ttl="7"), "'ttl' must be a duration text"),
        (with_fields(LATEST, ttl='"7 days"', columns='["fare"]'), "add it to 'columns'"),
        (with_fields(AGGREGATE, ttl='"7 days"'), "values have no time of their own"),
    ],
)
def test_a_ttl_a_store_cannot_apply_is_refused_saying_why(tmp_path: Path, text: str, says: str) -> None:
    error = spec_error(tmp_path, text)
    assert "bookings" in str(error) and says in str(error), str(error)


def test_the_record_carries_the_ttl_and_the_column_that_ages_values(tmp_path: Path) -> None:
    manifest = Manifest("bookings", 4, 12, Partitioner.MURMUR2, KeyFormat.STRING, ("ts", "fare"), (1,) * 12)
    written = WrittenVersion("bookings", 4, tmp_path / "v4", manifest)
    record = store_record(dataclasses.replace(STORE, ttl="7 days"), written, published_at=1.0)
    assert record.ttl == Ttl("7 days", 7 * 86_400_000_000, "ts")
    assert store_record(STORE, written, published_at=1.0).ttl is None
