"""The stored values of format 2: `compact_values` gives, for any JSON text, the bytes `compact_value` gives
(what a node makes of format 1's rows), whether or not it parses the text."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyroute.core.snapshot import compact_value
from keyroute.pipeline.lmdb_files import VALUE_JSON, _matched_ahead, compact_values

# JSON values whose floats and strings reach every spelling question: escapes, control characters,
# non-ASCII, integers beyond 64 bits, floats of every size.
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.floats(-1e-3, 1e-3)
    | st.builds(round, st.floats(-1e9, 1e9), st.integers(0, 6))
    | st.text(max_size=8)
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)


def java_double(value: float) -> str:
    """Java's Double.toString (what Spark's to_json writes for a double): plain notation from 1e-3 up to
    1e7, else d.dddE[-]n; shortest digits, as Java 19 and later print them."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    if value == 0:
        return "-0.0" if math.copysign(1, value) < 0 else "0.0"
    if 1e-3 <= abs(value) < 1e7:
        text = repr(value)
        return text if "e" not in text else format(value, "f")
    shortest = repr(value)
    digits = shortest.split("e")[0].replace("-", "").replace(".", "").lstrip("0") or "0"
    mantissa = ("-" if value < 0 else "") + digits[0] + "." + (digits[1:].rstrip("0") or "0")
    power = int(f"{value:e}".split("e")[1])
    return f"{mantissa}E{power}"


def spell(value: Any, draw: Any) -> str:
    """`value` as JSON text, each number and separator spelled one of the ways a writer may spell it."""
    space = lambda: draw(st.sampled_from(["", "", "", " ", "\n\t"]))  # noqa: E731
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float):
        way = draw(st.sampled_from(["python", "java", "trailing", "digits16", "digits17", "exp", "plain"]))
        if way == "java" or math.isnan(value) or math.isinf(value):
            return java_double(value)
        if way == "trailing":
            text = repr(value)
            return text + "0" if "e" not in text and "." in text else text
        if way in ("digits16", "digits17"):
            return format(value, f".{way[-2:]}g")
        if way == "plain":
            return numpy.format_float_positional(value, trim="0")
        if way == "exp":
            return format(value, ".6e")
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=draw(st.booleans()))
    if isinstance(value, list):
        return "[" + ",".join(space() + spell(v, draw) + space() for v in value) + "]"
    return (
        "{"
        + ",".join(
            f"{space()}{json.dumps(k, ensure_ascii=False)}{space()}:{space()}{spell(v, draw)}{space()}"
            for k, v in value.items()
        )
        + "}"
    )


@settings(max_examples=400, deadline=None)
@given(st.lists(_values, min_size=1, max_size=6), st.data())
def test_compact_values_are_the_bytes_compact_value_gives(values: list[Any], data: st.DataObject) -> None:
    texts = [spell(value, data.draw) for value in values]
    assert compact_values(pa.array(texts, pa.string())) == [compact_value(text) for text in texts]


@pytest.mark.parametrize(
    "text",
    [
        '{"ts":1712345678901,"route":"LHR-JFK","fare":123.45,"seats":3}',
        '{"a":[1,2.5,-0.25,true,null],"b":{"c":"ü 日本"}}',
        '{"x":0.001,"y":9999999.5,"z":-12345678901234.5}',
    ],
)
def test_texts_already_compact_are_kept_as_they_are(text: str) -> None:
    assert compact_values(pa.array([text])) == [text.encode()] == [compact_value(text)]


@pytest.mark.parametrize(
    "text",
    [
        '{"fare":1.50}',
        '{"fare":1.0E10}',
        '{"fare":0.00001}',
        '{"fare":0.12345678901234567}',
        '{"fare":822.2209650546942}',  # 16 digits: the same double as 822.2209650546941
        '{"n":-0}',
        '{"t":"a\\u00e9"}',
        '{"a": 1}',
        ' {"a":1}',
        '{"a":[1 ,2]}',
        '{"a":NaN}',
    ],
)
def test_texts_spelled_otherwise_are_respelled(text: str) -> None:
    [stored] = compact_values(pa.array([text]))
    assert stored == compact_value(text)
    assert stored != text.encode() or text in ('{"a":NaN}',)


def test_each_batch_comes_with_the_matches_of_its_own_values() -> None:
    # The matches are computed a batch ahead, in a thread: each must still be paired with its own batch.
    texts = [['{"a":1}', '{"a":1.50}'], [], ['{"a": 2}'], ['{"a":3}', '{"a":4}', '{"a":NaN}'], ['{"a":5}']]
    batches = [
        pa.RecordBatch.from_pydict(
            {VALUE_JSON: pa.array(t, pa.string())}, schema=pa.schema([(VALUE_JSON, pa.string())])
        )
        for t in texts
    ]
    paired = list(_matched_ahead(iter(batches)))
    assert [b.column(VALUE_JSON).to_pylist() for b, _ in paired] == [t for t in texts if t]  # empty ones skipped
    assert [m.to_pylist() for _, m in paired] == [[False, True], [True], [False, False, True], [False]]
    for batch, matches in paired:
        values = batch.column(VALUE_JSON)
        assert (
            compact_values(values, matches) == compact_values(values) == [compact_value(v) for v in values.to_pylist()]
        )


def test_a_failed_match_fails_the_task() -> None:
    batches = [pa.RecordBatch.from_pydict({"other": pa.array(["{}"])})]  # no value column
    with pytest.raises(KeyError):
        list(_matched_ahead(iter(batches)))
