"""The stored values of format 2: `compact_values` gives, for any JSON text, the bytes `compact_value` gives
(what a node makes of format 1's rows), whether or not it parses the text; a value handed over as its
struct is spelled by Arrow's kernels into the bytes `compact_value` gives for Spark's JSON of it."""

from __future__ import annotations

import decimal
import json
import math
from typing import Any

import numpy
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyroute.pipeline.lmdb_files import (
    VALUE_JSON,
    VALUE_STRUCT,
    _spelled,
    compact_values,
    spell_values,
    spelled_fields,
    struct_texts,
    struct_values,
)
from keyroute.storage.snapshot import SnapshotError, compact_value

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
    power = decimal.Decimal(shortest).adjusted()
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


def test_each_batch_comes_with_the_spelling_of_its_own_values() -> None:
    # Each batch is paired with its own values' spelling; empty batches are skipped.
    texts = [['{"a":1}', '{"a":1.50}'], [], ['{"a": 2}'], ['{"a":3}', '{"a":4}', '{"a":NaN}'], ['{"a":5}']]
    batches = [
        pa.RecordBatch.from_pydict(
            {VALUE_JSON: pa.array(t, pa.string())}, schema=pa.schema([(VALUE_JSON, pa.string())])
        )
        for t in texts
    ]
    paired = list(_spelled(iter(batches)))
    assert [b.column(VALUE_JSON).to_pylist() for b, _ in paired] == [t for t in texts if t]  # empty ones skipped
    assert [s.redo.to_pylist() for _, s in paired] == [[False, True], [True], [False, False, True], [False]]
    for batch, spelled in paired:
        values = batch.column(VALUE_JSON)
        assert spelled.stored() == compact_values(values) == [compact_value(v) for v in values.to_pylist()]


def test_a_failed_spelling_fails_the_task() -> None:
    batches = [pa.RecordBatch.from_pydict({"other": pa.array(["{}"])})]  # no value column
    with pytest.raises(KeyError):
        list(_spelled(iter(batches)))


# --- values handed over as their struct ---------------------------------------------------------------------

# Doubles where spellings part: Python's plain range ends (1e-4, 1e16), Arrow's (1e-6 .. 1e21 with other
# digit counts), integral doubles (Arrow writes no ".0"), -0.0, subnormals, the largest, 15 to 17 digits.
EDGE_DOUBLES = [
    0.0, -0.0, 1.0, -3.0, 0.5, 1e-4, 9.9999e-5, 1e-5, 1e-7, 1.5e-10, 5e-324, 2.2250738585072014e-308,
    1e15, 9999999999999998.0, 1e16, 1.234567890123456e14, 123456789012345.6, 1e21, 1e22, 1e23,
    1.7976931348623157e308, 0.1, 0.30000000000000004, 822.2209650546942, 12345678.125, 100.0, 1e7, 1e-3,
    float("nan"), float("inf"), float("-inf"),
]  # fmt: skip
EDGE_STRINGS = ["", "plain", "ü 日本", 'quote "', "back\\slash", "line\nbreak", "\x00\x1f\x7f", "\u2028", "a,b: {c}"]

_FIELD_VALUES: dict[str, Any] = {
    "b": st.booleans(),
    "i8": st.integers(-(2**7), 2**7 - 1),
    "i16": st.integers(-(2**15), 2**15 - 1),
    "i32": st.integers(-(2**31), 2**31 - 1),
    "i64": st.integers(-(2**63), 2**63 - 1),
    "d": st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from(EDGE_DOUBLES)
    | st.builds(round, st.floats(-1e9, 1e9), st.integers(0, 4))
    | st.builds(float, st.integers(-(2**60), 2**60)),
    "s": st.text(max_size=8) | st.sampled_from(EDGE_STRINGS),
}
_ARROW_TYPES = {"b": pa.bool_(), "i8": pa.int8(), "i16": pa.int16(), "i32": pa.int32(), "i64": pa.int64(),
                "d": pa.float64(), "s": pa.string()}  # fmt: skip


def spark_text(row: dict[str, Any] | None) -> str:
    """Spark's `to_json` of a row of these types (ignoreNullFields false): not-finite doubles as strings,
    doubles in Java's spelling, strings escaped as Jackson escapes them."""
    if row is None:
        return "null"

    def one(value: Any) -> str:
        if isinstance(value, float):
            text = java_double(value)
            return json.dumps(text) if text in ("NaN", "Infinity", "-Infinity") else text
        return json.dumps(value, ensure_ascii=False)

    return "{" + ",".join(f"{json.dumps(k, ensure_ascii=False)}:{one(v)}" for k, v in row.items()) + "}"


@st.composite
def struct_batches(draw: Any) -> tuple[pa.StructArray, list[dict[str, Any] | None]]:
    kinds = draw(st.lists(st.sampled_from(sorted(_FIELD_VALUES)), min_size=1, max_size=5))
    names = draw(st.lists(st.text(max_size=4), min_size=len(kinds), max_size=len(kinds), unique=True))
    rows = draw(
        st.lists(
            st.none()
            | st.tuples(*(st.none() | _FIELD_VALUES[k] for k in kinds)).map(lambda t: dict(zip(names, t, strict=True))),  # noqa: B023
            min_size=1,
            max_size=12,
        )
    )
    # Strings as Spark hands them over: string, or large_string with useLargeVarTypes on.
    text_type = draw(st.sampled_from([pa.string(), pa.large_string()]))
    fields = [pa.field(n, text_type if k == "s" else _ARROW_TYPES[k]) for n, k in zip(names, kinds, strict=True)]
    structs = pa.array(rows, pa.struct(fields))
    return structs, rows


@settings(max_examples=400, deadline=None)
@given(struct_batches(), st.integers(0, 3))
def test_structs_are_spelled_as_compact_value_spells_sparks_json(
    batch: tuple[pa.StructArray, list[dict[str, Any] | None]], cut: int
) -> None:
    structs, rows = batch
    cut = min(cut, len(rows) - 1)  # an offset slice, as a run of a partition is
    structs, rows = structs.slice(cut), rows[cut:]
    expected = [compact_value(spark_text(row)) for row in rows]
    table = pa.RecordBatch.from_arrays([structs], names=[VALUE_STRUCT])
    assert spell_values(table).stored() == expected
    assert struct_values(structs) == expected  # the one-by-one way agrees on every row, redone or not


def test_ordinary_values_are_spelled_by_the_kernels_alone() -> None:
    # Values as stores hold them (no escapes, doubles in Python's plain range) are never redone.
    rows = [
        {"ts": 1712345678901, "route": "LHR-JFK", "fare": 123.45, "seats": 3, "ok": True},
        {"ts": -1, "route": "ü 日本", "fare": 100.0, "seats": None, "ok": False},
        {"ts": 0, "route": None, "fare": -0.0, "seats": 0, "ok": None},
        {"ts": 2**63 - 1, "route": "", "fare": 0.0001, "seats": -(2**31), "ok": True},
        {"ts": 5, "route": "a, b: {c}", "fare": 123456789.0, "seats": 1, "ok": True},
    ]
    types = [pa.int64(), pa.string(), pa.float64(), pa.int32(), pa.bool_()]
    structs = pa.array(rows, pa.struct([pa.field(n, t) for n, t in zip(rows[0], types, strict=True)]))
    texts, redo = struct_texts(structs)
    assert redo.to_pylist() == [False] * len(rows)
    assert [t.encode() for t in texts.to_pylist()] == [compact_value(spark_text(r)) for r in rows]


@pytest.mark.parametrize(
    "row",
    [
        {"d": float("nan")},
        {"d": float("-inf")},
        {"d": 1e16},
        {"d": 1e-5},
        {"d": 1.234567890123456e14},
        {"s": 'say "hi"'},
        {"s": "tab\there"},
    ],
)
def test_fields_the_kernels_cannot_vouch_for_are_redone(row: dict[str, Any]) -> None:
    [(name, value)] = row.items()
    structs = pa.array([row], pa.struct([pa.field(name, pa.float64() if name == "d" else pa.string())]))
    texts, redo = struct_texts(structs)
    assert redo.to_pylist() == [True]
    assert spell_values(pa.RecordBatch.from_arrays([structs], names=[VALUE_STRUCT])).stored() == [
        compact_value(spark_text(row))
    ]


@pytest.mark.parametrize("text_type", [pa.string(), pa.large_string()])
def test_invalid_utf8_is_redone_with_replacement_characters(text_type: pa.DataType) -> None:
    # Spark decodes a string's invalid UTF-8 with U+FFFD when it writes JSON; so does the redone value.
    raw = pa.array([b"ok", b"bad \xff end", b"\xe2\x82", None], pa.binary())
    structs = pa.StructArray.from_arrays([raw.cast(text_type, safe=False)], names=["s"])
    texts, redo = struct_texts(structs)
    assert redo.to_pylist() == [False, True, True, False]
    assert struct_values(structs) == [b'{"s":"ok"}', '{"s":"bad \ufffd end"}'.encode(), '{"s":"\ufffd"}'.encode(),
                                      b'{"s":null}']  # fmt: skip


@pytest.mark.parametrize(
    ("names", "types"),
    [
        ([], []),
        (["a", "a"], [pa.int64(), pa.int64()]),
        (["a"], [pa.float32()]),
        (["a"], [pa.decimal128(10, 2)]),
        (["a"], [pa.timestamp("us")]),
        (["a"], [pa.binary()]),
        (["a"], [pa.list_(pa.int64())]),
        (["a"], [None]),
    ],
)
def test_other_values_are_not_spelled_from_their_struct(names: list[str], types: list[Any]) -> None:
    assert not spelled_fields(names, types)
    if types and None not in types:
        struct_type = pa.struct([pa.field(n, t) for n, t in zip(names, types, strict=True)])
        structs = pa.array([dict.fromkeys(names)], struct_type)
        with pytest.raises(SnapshotError):
            struct_texts(structs)
