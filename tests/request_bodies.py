"""Request bodies as a client may send them, for the tests that every body is read or refused with a 4xx:
nesting of any depth (closed or never closed), numbers in every form JSON allows and some it does not (huge
exponents, NaN and Infinity literals, thousands of digits), and batches of any size."""

from __future__ import annotations

import json

from hypothesis import strategies as st

from keyroute.api import MAX_JSON_DEPTH

# Past every limit, for certain: the bodies an outside fuzzer sent (a 500 and a RecursionError traceback).
DEEP_BODIES = [b'{"keys": ' + b"[" * 100_000, b'{"keys": ' + b'{"a": ' * 50_000]

# Numbers as a client may write them, the odd forms by name.
ODD_NUMBERS = [
    "1e999999",
    "-1e400",
    "1e-400",
    "0e99999999999999999999999",
    "1e99999999999999999999999",
    "1e-99999999999999999999999",
    "-0",
    "-0.0e-5",
    "1E+2",
    "14571.0",
    "1.4571e4",
    "9223372036854775807",
    "9223372036854775808.0e0",
    "NaN",
    "Infinity",
    "-Infinity",
]
digits = st.integers(1, 12_000).map(lambda n: "7" * n)
numbers = st.one_of(
    st.sampled_from(ODD_NUMBERS),
    st.integers().map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(json.dumps),
    digits,
    st.tuples(digits, digits).map(lambda t: f"{t[0]}.{t[1][:50]}"),
    st.tuples(st.integers(-(10**25), 10**25), st.sampled_from("eE"), st.integers(-(10**25), 10**25)).map(
        lambda t: f"{t[0]}{t[1]}{t[2]}"
    ),
)
strings = st.text(max_size=10).map(json.dumps) | st.sampled_from(['"[[[["', '"}}]]"', '"\\"[{"'])
openers = st.sampled_from(["[", '{"a":', '{"[":'])


def nested(parts: tuple[list[str], str]) -> str:
    """A value inside `opens` (outermost first), each closed as it was opened."""
    opens, inner = parts
    closes = "".join("]" if o == "[" else "}" for o in reversed(opens))
    return "".join(opens) + inner + closes


values = st.tuples(st.lists(openers, max_size=3 * MAX_JSON_DEPTH), numbers | strings).map(nested)


def batch(keys: list[str], bound: str | None) -> bytes:
    extra = f', "min_offset": {bound}' if bound is not None else ""
    return f'{{"keys": [{", ".join(keys)}]{extra}}}'.encode()


def bodies(max_keys: int) -> st.SearchStrategy[bytes]:
    """Any body, batches of up to `max_keys` + 20 keys."""
    return st.one_of(
        st.tuples(st.lists(values, max_size=max_keys + 20), st.none() | numbers).map(lambda t: batch(*t)),
        values.map(str.encode),
        st.tuples(openers, st.integers(0, 3000)).map(lambda t: (t[0] * t[1]).encode()),  # nested, never closed
    )
