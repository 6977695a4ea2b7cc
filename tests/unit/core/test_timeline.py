"""The timeline layout (key parts, entry keys), bounds, durations, queries and cursors."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyroute.storage import lmdb_layout
from keyroute.storage.timeline import (
    INT64_MAX,
    INT64_MIN,
    LMDB_MAX_KEY_BYTES,
    MAX_LIMIT,
    SUFFIX_BYTES,
    TAG_HASHED,
    TAG_KEY,
    CursorError,
    QueryError,
    StoreKind,
    Timeline,
    TimelineError,
    TimeType,
    duration_in_units,
    entry_key,
    key_of_entry,
    key_part,
    make_cursor,
    parse_duration_us,
    parse_query,
    parse_time,
    read_cursor,
    show_time,
    split_entry,
    time_bytes,
)

keys = st.binary(max_size=40) | st.sampled_from([b"", b"\x00", b"\x00\x00", b"a\x00", b"a", b"a\x01", b"\xff"])
times = st.integers(INT64_MIN, INT64_MAX)
sequences = st.integers(0, (1 << 32) - 1)


def test_the_tags_and_limit_are_the_value_layout_s() -> None:
    assert (TAG_KEY, TAG_HASHED, LMDB_MAX_KEY_BYTES) == (
        lmdb_layout.TAG_KEY,
        lmdb_layout.TAG_HASHED,
        lmdb_layout.LMDB_MAX_KEY_BYTES,
    )


@given(keys, keys)
def test_key_parts_keep_key_order_and_none_prefixes_another(a: bytes, b: bytes) -> None:
    pa, pb = key_part(a), key_part(b)
    assert (pa < pb) == (a < b) and (pa == pb) == (a == b)
    if a != b:
        assert not pa.startswith(pb) and not pb.startswith(pa)


@given(keys, times, sequences, keys, times, sequences)
def test_entry_keys_sort_by_key_then_time_then_sequence(a: bytes, ta: int, sa: int, b: bytes, tb: int, sb: int) -> None:
    ea, eb = entry_key(key_part(a), ta, sa), entry_key(key_part(b), tb, sb)
    assert (ea < eb) == ((a, ta, sa) < (b, tb, sb))
    assert split_entry(ea) == (key_part(a), ta, sa)
    assert key_of_entry(ea) == a
    assert ea[len(key_part(a)) : -4] == time_bytes(ta)


def test_long_keys_are_hashed_and_every_entry_fits_lmdb() -> None:
    for length in (0, 200, 240, 249, 250, 400, 5000):
        for fill in (b"a", b"\x00"):
            part = key_part(fill * length)
            entry = entry_key(part, INT64_MAX, 1)
            assert len(entry) <= LMDB_MAX_KEY_BYTES
            if part[:1] == TAG_HASHED:
                assert key_of_entry(entry) is None and len(entry) == 33 + SUFFIX_BYTES
            else:
                assert key_of_entry(entry) == fill * length


@pytest.mark.parametrize(
    "bad", [b"", b"=ab", b"x" + b"\x00" * 20, b"=a\x00b\x00\x00" + b"\x00" * 12, b"#ab" + b"\x00" * 12]
)
def test_what_is_not_an_entry_key_says_so(bad: bytes) -> None:
    with pytest.raises(TimelineError, match="not a timeline entry"):
        split_entry(bad)


@pytest.mark.parametrize(
    ("text", "micros"),
    [("5 minutes", 300_000_000), ("90s", 90_000_000), ("1 ms", 1_000), ("7 days", 604_800_000_000),
     ("2 Weeks", 1_209_600_000_000), (" 3 h ", 10_800_000_000)],
)  # fmt: skip
def test_durations(text: str, micros: int) -> None:
    assert parse_duration_us(text) == micros


@pytest.mark.parametrize("text", ["", "5", "five minutes", "0 s", "-1 s", "1.5 h", "3 fortnights"])
def test_what_is_not_a_duration_is_refused(text: str) -> None:
    with pytest.raises(TimelineError):
        parse_duration_us(text)


def test_durations_in_each_time_unit() -> None:
    assert duration_in_units("5 minutes", TimeType.TIMESTAMP) == 300_000_000
    assert duration_in_units("5 minutes", TimeType.INTEGER) == 300_000  # milliseconds
    assert duration_in_units("2 days", TimeType.DATE) == 2
    with pytest.raises(TimelineError, match="whole days"):
        duration_in_units("36 h", TimeType.DATE)


@pytest.mark.parametrize(
    ("text", "time_type", "value"),
    [
        ("2024-06-11T10:00:00Z", TimeType.TIMESTAMP, 1_718_100_000_000_000),
        ("2024-06-11T12:00:00+02:00", TimeType.TIMESTAMP, 1_718_100_000_000_000),
        ("2024-06-11T10:00:00", TimeType.TIMESTAMP, 1_718_100_000_000_000),  # UTC unless it says otherwise
        ("2024-06-11T10:00:00.000001Z", TimeType.TIMESTAMP, 1_718_100_000_000_001),
        ("1969-12-31T23:59:59Z", TimeType.TIMESTAMP, -1_000_000),
        ("2024-06-11", TimeType.DATE, 19_885),
        ("-42", TimeType.INTEGER, -42),
        (str(INT64_MAX), TimeType.INTEGER, INT64_MAX),
    ],
)
def test_bounds_are_parsed_in_the_store_s_time_unit(text: str, time_type: TimeType, value: int) -> None:
    assert parse_time(text, time_type, "from") == value
    assert parse_time(show_time(value, time_type), time_type, "from") == value


@pytest.mark.parametrize(
    ("text", "time_type"),
    [("soon", TimeType.TIMESTAMP), ("2024-13-01", TimeType.DATE), ("1.5", TimeType.INTEGER),
     (str(INT64_MAX + 1), TimeType.INTEGER), ("2024-06-11T10:00:00Z", TimeType.INTEGER)],
)  # fmt: skip
def test_unparsable_bounds_name_the_parameter(text: str, time_type: TimeType) -> None:
    with pytest.raises(TimelineError, match="^to="):
        parse_time(text, time_type, "to")


HISTORY = Timeline(StoreKind.HISTORY, "ts", TimeType.INTEGER)
WINDOWED = Timeline(StoreKind.WINDOWED, "ts", TimeType.INTEGER, window=10, advance=5)


def test_timelines_round_trip_and_refuse_what_is_inconsistent() -> None:
    for timeline in (HISTORY, WINDOWED, Timeline(StoreKind.HISTORY, "d", TimeType.DATE, retention="30 days")):
        assert Timeline.from_dict(timeline.to_dict()) == timeline
    for doc in ({"kind": "value", "column": "c", "time_type": "date"}, {"kind": "history"}, "x",
                {"kind": "windowed", "column": "c", "time_type": "date", "window": 5, "advance": 6}):  # fmt: skip
        with pytest.raises(TimelineError):
            Timeline.from_dict(doc)


def test_queries_and_their_defaults() -> None:
    query = parse_query("history", b"", HISTORY)
    assert (query.low, query.high, query.limit, query.descending, query.cursor) == (None, None, 100, False, None)
    query = parse_query("history", b"from=-5&to=20&limit=7&order=desc", HISTORY)
    assert (query.low, query.high, query.limit, query.descending) == (-5, 20, 7, True)
    # Windows overlapping [from, to) start after from - window.
    query = parse_query("windows", b"from=100&to=200", WINDOWED)
    assert (query.low, query.high) == (91, 200)
    assert parse_query("history", b"from=3&to=3", HISTORY).low == 3  # an empty range is no error


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"from=5&to=4", "after"),
        (b"from=x", "from='x' is not an integer"),
        (b"limit=0", "limit"),
        (b"limit=" + str(MAX_LIMIT + 1).encode(), "limit"),
        (b"limit=ten", "limit"),
        (b"order=up", "order"),
        (b"from=1&from=2", "given twice"),
        (b"offset=1", "unknown query parameter 'offset'"),
        (b"from=%ff", "malformed"),
    ],
)
def test_bad_queries_say_which_parameter(raw: bytes, words: str) -> None:
    with pytest.raises(QueryError, match=words):
        parse_query("history", raw, HISTORY)


STAMPED = Timeline(StoreKind.HISTORY, "ts", TimeType.TIMESTAMP)


def test_a_timestamp_store_takes_epoch_milliseconds_as_bounds_too() -> None:
    iso = parse_query("history", b"from=2024-06-11T10:00:00Z&to=2024-06-11T10:00:01Z", STAMPED)
    millis = parse_query("history", b"from=1718100000000&to=1718100001000", STAMPED)
    assert (millis.low, millis.high) == (iso.low, iso.high) == (1_718_100_000_000_000, 1_718_100_001_000_000)
    assert parse_query("history", b"from=-1000", STAMPED).low == -1_000_000  # before 1970 too
    assert parse_query("windows", b"from=0", Timeline(StoreKind.WINDOWED, "ts", TimeType.TIMESTAMP, 10, 5)).low == -9
    with pytest.raises(QueryError, match="out of range as milliseconds"):
        parse_query("history", b"from=9223372036854776", STAMPED)
    # Anything else is told the two forms it may take.
    with pytest.raises(QueryError) as raised:
        parse_query("history", b"from=soon", STAMPED)
    assert str(raised.value) == (
        "from='soon' is not a time: ISO 8601 (e.g. 2024-06-11T10:00:00Z, 2024-06-11T12:00:00+02:00, 2024-06-11) "
        "or milliseconds since the epoch (e.g. 1718100000000)"
    )


QUERY = ("s", "k", "history", None, None, "asc")


@settings(max_examples=50)
@given(st.integers(1, 1 << 40), times, sequences, st.binary(max_size=8))
def test_cursors_round_trip_and_are_bound_to_their_query_and_secret(
    version: int, time: int, sequence: int, secret: bytes
) -> None:
    cursor = make_cursor(secret, QUERY, version, (time, sequence))
    assert read_cursor(secret, QUERY, cursor) == (version, (time, sequence))
    for other in (("s", "k2", *QUERY[2:]), (*QUERY[:5], "desc"), ("s", "k", "history", "1", None, "asc")):
        with pytest.raises(CursorError, match="another"):
            read_cursor(secret, other, cursor)
    with pytest.raises(CursorError):
        read_cursor(secret + b"x", QUERY, cursor)


@pytest.mark.parametrize("text", ["", "!!", "a" * 600, "eyJ4IjoxfQ", make_cursor(b"", QUERY, 1, (0, 0))[:-3]])
def test_malformed_cursors_are_refused(text: str) -> None:
    with pytest.raises(CursorError):
        read_cursor(b"", QUERY, text)


def test_an_altered_cursor_is_refused() -> None:
    cursor = make_cursor(b"", QUERY, 1, (5, 0))
    import base64
    import json

    raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
    body, tag = raw.split(b".", 1)
    forged_body: Any = json.loads(body)
    forged_body[2] = 6
    forged = base64.urlsafe_b64encode(json.dumps(forged_body, separators=(",", ":")).encode() + b"." + tag)
    with pytest.raises(CursorError, match="altered"):
        read_cursor(b"", QUERY, forged.rstrip(b"=").decode())
