"""Projections (`fields=a,b.c`): what a read's fields select from a value, how they are parsed from a query,
and which are refused (400) for a store's record."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keyroute.api import BadRequest
from keyroute.cluster.partition_map import StoreRecord
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.storage.projection import Projection, UnknownFields, fields_of_query, json_projection, parse_fields
from keyroute.storage.timeline import StoreKind, Timeline, TimeType

VALUE = {"fare": 12.5, "city": "Oslo", "trip": {"from": "OSL", "to": "BER", "legs": {"n": 2}}, "none": None}


def project(text: str, value: Any = VALUE) -> Any:
    return json.loads(parse_fields(text).apply(json.dumps(value).encode()))


def record(columns: tuple[str, ...], timeline: Timeline | None = None) -> StoreRecord:
    return StoreRecord("s", 2, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/snap", columns, timeline=timeline)


def test_top_level_fields_keep_the_given_order() -> None:
    assert list(project("city,fare")) == ["city", "fare"]
    assert project("city,fare") == {"city": "Oslo", "fare": 12.5}


def test_nested_paths_build_the_nested_objects() -> None:
    assert project("trip.to,fare") == {"trip": {"to": "BER"}, "fare": 12.5}
    assert project("trip.to,trip.from") == {"trip": {"to": "BER", "from": "OSL"}}
    assert project("trip.legs.n") == {"trip": {"legs": {"n": 2}}}


def test_a_path_under_a_field_given_whole_is_the_whole_fields() -> None:
    assert project("trip.to,trip") == {"trip": VALUE["trip"]}
    assert parse_fields("trip.to,trip,trip").text == "trip"


def test_a_path_a_value_lacks_is_left_out_but_a_null_column_is_kept() -> None:
    assert project("trip.nope,fare") == {"fare": 12.5}
    assert project("city.x") == {}  # city is not an object
    assert project("none") == {"none": None}
    assert project("missing") == {}


def test_a_value_that_is_not_an_object_is_answered_as_it_is() -> None:
    assert project("a", [1, 2]) == [1, 2]


def test_window_entries_project_their_value() -> None:
    window = {"start": 1, "end": 2, "value": {"n": 3, "total": 9}}
    out = json.loads(parse_fields("n").apply_window(json.dumps(window).encode()))
    assert out == {"start": 1, "end": 2, "value": {"n": 3}}


@pytest.mark.parametrize("text", ["", "a,,b", "a.", ".a", "a..b", ",".join(["x"] * 101), ".".join(["x"] * 9)])
def test_malformed_fields_are_bad_requests(text: str) -> None:
    with pytest.raises(BadRequest):
        parse_fields(text)


def test_fields_from_a_query_string() -> None:
    assert fields_of_query(b"") is None
    assert fields_of_query(b"min_offset=3") is None
    assert fields_of_query(b"prefields=a") is None
    fields = fields_of_query(b"min_offset=3&fields=trip.to%2Cfare")
    assert fields is not None and fields.paths == (("trip", "to"), ("fare",))
    with pytest.raises(BadRequest, match="more than once"):
        fields_of_query(b"fields=a&fields=b")
    with pytest.raises(BadRequest):
        fields_of_query(b"fields=%ff")


def test_a_projection_is_passed_on_as_the_same_query() -> None:
    fields = parse_fields("trip.to,f ü")
    again = fields_of_query(fields.query()[1:].encode())
    assert again == fields


def test_a_projection_with_an_avro_answer_is_refused() -> None:
    assert json_projection(b"fields=a", None) is not None
    with pytest.raises(BadRequest, match="JSON only"):
        json_projection(b"fields=a", b"application/avro")


def test_unknown_fields_are_named() -> None:
    fields = parse_fields("fare,trip.to,nope,also.not")
    with pytest.raises(UnknownFields) as raised:
        fields.check_record("s", record(("fare", "trip")))
    assert raised.value.status == 400 and raised.value.code == "unknown_fields"
    assert "'nope'" in raised.value.message and "'also.not'" in raised.value.message
    assert "'fare'" not in raised.value.message
    parse_fields("fare,trip.anything").check_record("s", record(("fare", "trip")))


def test_a_history_stores_time_column_is_a_field_and_a_record_without_columns_checks_nothing() -> None:
    history = Timeline(StoreKind.HISTORY, "at", TimeType.TIMESTAMP)
    parse_fields("at,fare").check_record("s", record(("fare",), history))
    with pytest.raises(UnknownFields):
        parse_fields("at").check_record("s", record(("fare",)))
    parse_fields("anything").check_record("s", record(()))


_NAMES = st.sampled_from(["a", "b", "c", "d"])
_VALUES: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.integers() | st.text(max_size=3),
    lambda inner: st.dictionaries(_NAMES, inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_NAMES, _VALUES, max_size=4), st.lists(st.lists(_NAMES, min_size=1, max_size=3), min_size=1))
def test_a_projection_holds_exactly_the_values_at_its_paths(value: dict[str, Any], paths: list[list[str]]) -> None:
    fields = parse_fields(",".join(".".join(p) for p in paths))
    out = fields.project(value)

    def at(obj: Any, path: tuple[str, ...]) -> tuple[bool, Any]:
        for name in path:
            if not isinstance(obj, dict) or name not in obj:
                return False, None
            obj = obj[name]
        return True, obj

    for path in fields.paths:
        present, wanted = at(value, path)
        got_present, got = at(out, path)
        assert got_present == present and got == wanted

    def leaves(obj: Any, prefix: tuple[str, ...]) -> list[tuple[str, ...]]:
        if prefix in fields.paths or not isinstance(obj, dict):
            return [prefix]
        return [leaf for name, inner in obj.items() for leaf in leaves(inner, (*prefix, name))]

    # Nothing else: every leaf of the projection is one of the paths asked for.
    assert all(leaf in fields.paths for leaf in leaves(out, ()) if leaf)
    assert isinstance(fields, Projection)


def test_an_integer_beyond_64_bits_is_answered_exactly_and_large_floats_stay_floats() -> None:
    raw = b'{"big":123456789012345678901234567890,"neg":-99999999999999999999,"f":1e30,"n":{"x":[1,2e300,%d]}}' % (
        10**25
    )
    for text in ("big,neg,f", "n", "n.x,big"):
        got = parse_fields(text).apply(raw)
        assert got.startswith(b"{") and json.loads(got) == parse_fields(text).project(json.loads(raw))
    assert json.loads(parse_fields("big").apply(raw)) == {"big": 123456789012345678901234567890}
    assert type(json.loads(parse_fields("f").apply(raw))["f"]) is float
    assert json.loads(parse_fields("n").apply(raw)) == {"n": {"x": [1, 2e300, 10**25]}}
    window = b'{"start":1,"end":%d,"value":{"big":%d,"f":1.5}}' % (10**20, 10**22)
    assert json.loads(parse_fields("big").apply_window(window)) == {"start": 1, "end": 10**20, "value": {"big": 10**22}}


def test_a_projection_is_parsed_once_per_fields_value() -> None:
    first = fields_of_query(b"fields=fare,trip.to")
    assert first is not None
    assert fields_of_query(b"fields=fare,trip.to") is first
    assert fields_of_query(b"min_offset=4&fields=fare,trip.to") is first
    assert fields_of_query(b"fields=fare,trip.to&min_offset=5") is first
    assert fields_of_query(b"fields=fare") is not first
    with pytest.raises(BadRequest, match="more than once"):
        fields_of_query(b"fields=fare,trip.to&fields=fare,trip.to")  # a seen value, repeated: still refused


def test_a_projection_checked_against_a_record_is_checked_again_against_a_new_one() -> None:
    fields = parse_fields("fare,trip")
    old = record(("fare", "trip"))
    fields.check_record("s", old)
    fields.check_record("s", old)
    with pytest.raises(UnknownFields, match="'trip'"):
        fields.check_record("s", record(("fare",)))  # the store's next version dropped a column
    with pytest.raises(UnknownFields):
        fields.check_record("other", record(("fare",)))
    fields.check_record("s", old)
