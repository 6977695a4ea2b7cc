"""Orderings in the spec and the live fold's configuration: `order_by_type` for every mode that orders rows
(keyroute.pipeline.spec), the ordering arguments of max_by/min_by found in SQL text
(keyroute.pipeline.order_args), and the types a live store's records are ordered as (StoreSpec.merge, the
manifest's Merge). Pure: no Spark."""

from __future__ import annotations

from pathlib import Path

import pytest

from keyroute.pipeline.order_args import ordering_arguments, ordering_column, replace_orderings
from keyroute.pipeline.spec import load_spec
from keyroute.storage.live import Aggregate, Merge
from keyroute.storage.timeline import TimeType
from tests.unit.pipeline.test_spec import AGGREGATE, LATEST, spec_error, with_fields, write_spec


@pytest.mark.parametrize(
    ("base", "fields"),
    [
        (LATEST, {"order_by_type": '"timestamp"'}),
        (AGGREGATE, {"aggregations": '{ last = "max_by(price, ts)" }', "order_by_type": '"date"'}),
        (AGGREGATE, {"aggregations": '{ first = "MIN_BY(price, `event time`) * 2" }', "order_by_type": '"integer"'}),
    ],
)
def test_order_by_type_applies_to_every_store_that_orders_rows(
    tmp_path: Path, base: str, fields: dict[str, str]
) -> None:
    [store] = load_spec(write_spec(tmp_path, with_fields(base, **fields))).stores
    assert store.order_by_type is TimeType(fields["order_by_type"].strip('"'))


def test_order_by_type_on_an_aggregate_without_max_by_or_min_by_is_refused(tmp_path: Path) -> None:
    text = with_fields(AGGREGATE, aggregations='{ n = "count(*)", top = "max(ts)" }', order_by_type='"timestamp"')
    assert str(spec_error(tmp_path, text)) == (
        "store 'bookings': 'order_by_type' applies to a store that orders rows: modes 'latest', 'history' and "
        "'windowed', or aggregations with max_by or min_by"
    )


@pytest.mark.parametrize(
    ("expression", "arguments"),
    [
        ("max_by(price, ts)", ["ts"]),
        ("MIN_BY( x , `event time`) + max_by(y, coalesce(a, b))", ["`event time`", "coalesce(a, b)"]),
        ("max_by(concat('max_by(', x), ts)", ["ts"]),  # a call in a string literal is no call
        ("max_by(`a,b`, ts)", ["ts"]),  # nor a comma in a quoted name
        ("my_max_by(a, b) + t.max_by(a, b)", []),
        ("count(*)", []),
        ("max_by(a, b, 3)", ["b"]),
        ("max_by(a)", []),
    ],
)
def test_the_ordering_arguments_of_max_by_and_min_by_are_found_in_sql(expression: str, arguments: list[str]) -> None:
    assert ordering_arguments([expression]) == arguments


def test_ordering_arguments_are_replaced_where_they_are_and_columns_named() -> None:
    replaced = replace_orderings("max_by(p, ts) - min_by(q,`ts`) + max_by(r, x)", {"ts": "`T`", "`ts`": "`T`"})
    assert replaced == "max_by(p, `T`) - min_by(q, `T`) + max_by(r, x)"
    assert [ordering_column(a) for a in ("ts", " `event time` ", "coalesce(a, b)", "1")] == [
        "ts",
        "event time",
        None,
        None,
    ]


LIVE = """
[stores.bookings.live]
topic = "bookings"
bootstrap_servers = "kafka:9092"
"""


def test_a_live_store_s_records_are_ordered_as_the_build_found_else_as_declared(tmp_path: Path) -> None:
    latest = with_fields(LATEST, source="", format="", order_by_type='"timestamp"') + LIVE
    [store] = load_spec(write_spec(tmp_path, latest)).stores
    assert store.merge().time_type == "timestamp"
    assert store.merge(order_types={"ts": TimeType.INTEGER}).time_type == "integer"
    assert store.merge(order_types={"ts": None}).time_type is None  # a number column

    aggregate = (
        with_fields(
            AGGREGATE,
            source="",
            format="",
            aggregations='{ n = "count(*)", last = "max_by(price, ts)", first = "min_by(price, seq)" }',
        )
        + LIVE
    )
    [store] = load_spec(write_spec(tmp_path, aggregate)).stores
    assert [a.by_type for a in store.merge().aggregates] == [None, None, None]
    merge = store.merge(order_types={"ts": TimeType.TIMESTAMP, "seq": TimeType.INTEGER})
    assert [a.by_type for a in merge.aggregates] == [None, "timestamp", "integer"]


def test_ordering_types_travel_in_the_manifest_and_older_manifests_still_read() -> None:
    merge = Merge(
        "aggregate", "k", aggregates=(Aggregate("n", "count", None), Aggregate("last", "max_by", "p", "ts", "date"))
    )
    assert Merge.from_json(merge.to_json()) == merge
    assert "by_type" not in merge.to_json()["aggregates"][0]
    latest = Merge("latest", "k", order_by="ts", time_type="timestamp")
    assert Merge.from_json(latest.to_json()) == latest
    older = {"mode": "latest", "key_column": "k", "order_by": "ts", "columns": None, "aggregates": []}
    assert Merge.from_json(older).time_type is None
    assert "time_type" not in Merge.from_json(older).to_json()
    with pytest.raises(ValueError, match="unknown ordering type"):
        Aggregate.from_json({"name": "x", "function": "max_by", "column": "p", "by": "ts", "by_type": "text"})
