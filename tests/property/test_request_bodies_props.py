"""The one decoder of request bodies (keyroute.api.loads_json, through the batch-get parser routers and nodes
share) over bodies of any nesting depth, size and number form: it answers what the standard decoder reads, or a
4xx ApiError naming what is wrong; never another exception (a RecursionError, Python's limit on an int's digits,
decimal's InvalidOperation)."""

from __future__ import annotations

import json
import math
from decimal import Decimal
from pathlib import Path
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from keyroute.api import MAX_JSON_DEPTH, MAX_JSON_NUMBER_CHARS, ApiError, BadRequest, json_depth, loads_json
from keyroute.http.forwarding import parse_batch_request
from tests.request_bodies import DEEP_BODIES, bodies, nested, openers

MAX_KEYS = 100


def standard(body: bytes) -> Any | None:
    """What the standard decoder reads (numbers exactly), or None when it refuses the text or any limit of
    ours applies to it."""
    if json_depth(body) > MAX_JSON_DEPTH:
        return None
    try:
        return json.loads(body, parse_float=_exact_float, parse_int=_exact_int, parse_constant=_refused)
    except (ValueError, RecursionError, OverflowError):
        return None


def _exact(text: str) -> Decimal:
    if len(text) > MAX_JSON_NUMBER_CHARS:
        raise ValueError("too long for the reference")
    return Decimal(text)


def _exact_int(text: str) -> int:
    if len(text) > MAX_JSON_NUMBER_CHARS:
        raise ValueError("too long for the reference")
    return int(text)


def _exact_float(text: str) -> Decimal | float:
    value = float(text)
    if math.isinf(value):
        raise OverflowError(text)
    mantissa, _, exponent = text.lower().partition("e")
    if exponent and abs(int(exponent)) > 10**17:  # beyond Decimal: zero, or a float's underflow to zero
        return Decimal(0) if not mantissa.strip("-0.") else value
    return _exact(text)


def _refused(name: str) -> Any:
    raise ValueError(name)


def same(ours: Any, reference: Any) -> bool:
    """The decoded values agree: every number equal (as the reference reads it exactly, for an integral one;
    a float with a fraction as Python's float reads it)."""
    if isinstance(reference, list):
        return isinstance(ours, list) and len(ours) == len(reference) and all(map(same, ours, reference))
    if isinstance(reference, dict):
        return (
            isinstance(ours, dict)
            and ours.keys() == reference.keys()
            and all(same(ours[k], reference[k]) for k in reference)
        )
    if isinstance(reference, Decimal):
        if reference.adjusted() < 40 and reference == reference.to_integral_value():
            return ours.__class__ is int and ours == reference
        return ours.__class__ is float and ours == float(reference)
    return bool(ours == reference and ours.__class__ is reference.__class__)


@settings(max_examples=600, deadline=None)
@given(bodies(MAX_KEYS))
@example(DEEP_BODIES[0])
@example(DEEP_BODIES[1])
@example(b'{"keys": [' + b"1" * 10_000 + b"]}")
@example(b'{"keys": [NaN, Infinity]}')
@example(b'{"keys": [0e99999999999999999999999]}')
def test_a_body_is_read_as_the_standard_decoder_reads_it_or_refused_with_a_4xx(body: bytes) -> None:
    reference = standard(body)
    try:
        parsed = parse_batch_request(body, MAX_KEYS)
    except ApiError as exc:
        assert 400 <= exc.status < 500 and exc.message
        # Refused only for a reason: outside a limit, or not the batch-get form.
        if isinstance(reference, dict) and isinstance(reference.get("keys"), list) and "min_offset" not in reference:
            assert len(reference["keys"]) > MAX_KEYS, exc.message
        return
    # Read: the standard decoder agrees on every key and the body was within every limit.
    assert reference is not None and isinstance(reference, dict)
    assert same(parsed.keys, reference["keys"]) and len(parsed.keys) <= MAX_KEYS


@given(st.integers(0, 5 * MAX_JSON_DEPTH), openers)
def test_nesting_up_to_the_limit_is_read_and_deeper_is_refused_naming_the_limit(depth: int, opener: str) -> None:
    body = nested(([opener] * depth, "1")).encode()
    if depth <= MAX_JSON_DEPTH:
        value = loads_json(body)
        for _ in range(depth):
            value = value[0] if isinstance(value, list) else next(iter(value.values()))
        assert value == 1
        return
    try:
        loads_json(body)
    except BadRequest as exc:
        assert f"more than {MAX_JSON_DEPTH} deep" in exc.message and exc.status == 400
    else:
        raise AssertionError(f"{depth} levels were read")


json_values = st.recursive(
    st.none() | st.integers() | st.text(alphabet='[]{}"\\ab', max_size=6),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.text(alphabet='[]{}"\\ab', max_size=4), children, max_size=3)
    ),
    max_leaves=30,
)


def deepest(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(deepest, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(deepest, value.values()), default=0)
    return 0


@given(json_values, st.booleans())
def test_the_depth_counts_brackets_outside_strings_only(value: Any, ascii_only: bool) -> None:
    body = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert json_depth(body) == deepest(value)


def test_the_api_document_states_the_bounds_the_decoder_applies() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "http-api.md").read_text()
    assert f"nest at most {MAX_JSON_DEPTH} deep" in text
    assert f"at most {MAX_JSON_NUMBER_CHARS} characters" in text
