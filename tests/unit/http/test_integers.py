"""Integers in requests, read by one rule (keyroute.api): in a JSON body any JSON number with no
fractional part (as JSON Schema 2020-12 counts integers), in a query string decimal digits only. The rule
is the same for every integer field: a batch-get's bounds (tests/unit/http/test_forwarding.py has the
body), `min_offset`, a timeline's `limit`, `from` and `to`, a range's `limit` and `version`."""

from __future__ import annotations

from typing import Any

import pytest

from keyroute.api import (
    BadRequest,
    integer_text,
    json_integer,
    loads_json,
    parse_min_offset,
    text_integer,
)
from keyroute.keys.key_format import KeyFormat
from keyroute.storage.ranges import RangeQueryError, parse_partition_range, parse_range_query
from keyroute.storage.timeline import QueryError, StoreKind, Timeline, TimeType, parse_query

HISTORY = Timeline(StoreKind.HISTORY, "ts", TimeType.INTEGER)
# Spelled as integers by no query string: signs, spaces, fractions, exponents, other digits, nothing.
# (An empty `from` or `to` is no bound at all, so "" is only in the first list.)
NOT_DIGITS = ["+5", " 5", "5 ", "5.0", "1e3", "0x10", "５", "²", "-", "5\n", "1_000"]


@pytest.mark.parametrize(("text", "value"), [("0", 0), ("5", 5), ("0005", 5), ("9" * 19, int("9" * 19))])
def test_a_query_integer_is_decimal_digits(text: str, value: int) -> None:
    assert integer_text(text) == value and integer_text(text, signed=True) == value
    assert integer_text("-" + text, signed=True) == -value and integer_text("-" + text) is None


@pytest.mark.parametrize("text", [*NOT_DIGITS, "", "1" * 20, "--5"])
def test_anything_else_is_no_query_integer(text: str) -> None:
    assert integer_text(text) is None and integer_text(text, signed=True) is None


@pytest.mark.parametrize("text", NOT_DIGITS)
def test_every_integer_query_parameter_refuses_what_is_not_digits(text: str) -> None:
    with pytest.raises(BadRequest, match="min_offset must be an offset"):
        parse_min_offset(text)
    for query in (f"limit={text}", f"from={text}", f"to={text}", f"min_offset={text}"):
        with pytest.raises(QueryError):
            parse_query("history", query.encode(), HISTORY)
    with pytest.raises(RangeQueryError):
        parse_range_query(f"limit={text}".encode(), KeyFormat.STRING)
    with pytest.raises(RangeQueryError):
        parse_partition_range(f"version={text}".encode(), KeyFormat.STRING)


def test_every_integer_query_parameter_takes_the_same_digits() -> None:
    assert parse_min_offset("0042") == 42
    query = parse_query("history", b"from=-0005&to=0007&limit=0003&min_offset=0009", HISTORY)
    assert (query.low, query.high, query.limit, query.min_offset) == (-5, 7, 3, 9)
    assert parse_range_query(b"limit=0003", KeyFormat.STRING).limit == 3
    assert parse_partition_range(b"version=0012&limit=2", KeyFormat.STRING).version == 12


def test_a_query_integer_out_of_its_range_says_the_range() -> None:
    with pytest.raises(BadRequest, match=r"^limit must be an integer from 1 to 100, got '101'$"):
        text_integer("101", "limit", 1, 100)
    assert text_integer("-3", "delta", -5, 5) == -3
    with pytest.raises(QueryError, match="limit"):
        parse_query("history", b"limit=0", HISTORY)
    with pytest.raises(RangeQueryError, match="version"):
        parse_partition_range(b"version=0", KeyFormat.STRING)


@pytest.mark.parametrize(
    ("text", "value"),
    [("14571", 14571), ("14571.0", 14571), ("1.4571e4", 14571), ("145710e-1", 14571), ("-0.0", 0),
     ("9223372036854775807.0", (1 << 63) - 1), ("14571.5", 14571.5), ("1e-3", 0.001),
     ("1e-400", 0.0), ("0e99999999999999999999", 0)],
)  # fmt: skip
def test_a_body_number_with_no_fractional_part_is_read_as_the_exact_integer(text: str, value: Any) -> None:
    read = loads_json(f'{{"n": {text}}}')["n"]
    assert read == value and type(read) is type(value)


@pytest.mark.parametrize(
    ("text", "reason"),
    [("1e400", "beyond the range of a double"), ("-1e400", "beyond the range of a double"),
     ("7" * 1001, "1001 characters"), ("0." + "7" * 999, "1001 characters"), ("NaN", "NaN is not a JSON number"),
     ("Infinity", "Infinity is not a JSON number")],
)  # fmt: skip
def test_a_body_number_beyond_a_double_too_long_or_not_a_number_is_refused_naming_why(text: str, reason: str) -> None:
    with pytest.raises(BadRequest, match=reason):
        loads_json(f'{{"n": {text}}}')


@pytest.mark.parametrize("value", [14571.5, True, False, None, "5", [5], -1, 101, float("inf"), float("nan"), 1e300])
def test_a_body_integer_field_refuses_fractions_booleans_and_values_out_of_range(value: Any) -> None:
    with pytest.raises(BadRequest, match=r"^limit must be an integer from 0 to 100, got "):
        json_integer(value, "limit", 0, 100)


def test_a_body_integer_field_takes_an_integral_float_from_a_plainly_parsed_body_too() -> None:
    assert json_integer(7.0, "limit", 0, 100) == 7 and type(json_integer(7.0, "limit", 0, 100)) is int
    assert json_integer(7, "limit", 0, 100) == 7
