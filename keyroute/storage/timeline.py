"""Stores that keep many rows per key, in time order: history stores and windowed stores.

A history store keeps every row of a key (bounded by its retention); a windowed store keeps one aggregate
per key and time window. Both are a *timeline* per key: entries ordered by a time (the store's `order_by`
column, or a window's start), read as a range of that time. The partition still depends on the key alone,
so a key's whole timeline lives in one partition and a timeline read is one hop, like a get.

LMDB layout of a timeline partition: one entry per row (or window), under

    key part  +  time (8 bytes)  +  sequence (4 bytes)

- key part: `=` + the serialized key with every 0x00 byte written 0x00 0x01, then 0x00 0x00. That keeps
  keys in their byte order (a key sorts before the keys it prefixes) and makes no key part a prefix of
  another's, so one key's entries are exactly the LMDB keys that start with its key part. A key too long
  for LMDB's 511-byte keys is `#` + its SHA-256 instead (as `lmdb_layout.db_key` does).
- time: the int64 time with its sign bit flipped, big-endian (so negative times sort first).
- sequence: big-endian uint32 telling rows of one key with equal time apart (their order in the build).

The value of an entry is the JSON the answer carries: a history row (its value columns and the order_by
column), or a window `{"start", "end", "value"}`.

Times are int64 in the store's time unit: microseconds since the epoch for a `timestamp` column, days since
the epoch for a `date` column, and the column's own integers for an `integer` one (taken as milliseconds
since the epoch where a duration applies: retention and windows).
"""

from __future__ import annotations

import base64
import datetime as dt
import enum
import hashlib
import hmac
import json
import re
import struct
from dataclasses import dataclass
from typing import Any

from keyroute.api import integer_text, query_params

# The tags and key limit of keyroute.storage.lmdb_layout (which imports the snapshot module, which imports this
# one): a timeline's key parts are tagged as value stores' keys are.
TAG_KEY = b"="
TAG_HASHED = b"#"
LMDB_MAX_KEY_BYTES = 511
_SIGN = 1 << 63
_TIME_SEQ = struct.Struct(">QI")
SUFFIX_BYTES = _TIME_SEQ.size  # time + sequence
KEY_END = b"\x00\x00"
_ESCAPED_ZERO = b"\x00\x01"
HASHED_PART_BYTES = 1 + hashlib.sha256().digest_size
# The longest `=` key part that leaves room for the suffix in an LMDB key.
_MAX_KEY_PART = LMDB_MAX_KEY_BYTES - SUFFIX_BYTES
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_SEQUENCE = (1 << 32) - 1


class StoreKind(enum.StrEnum):
    """What a store keeps per key."""

    VALUE = "value"  # one value (latest row or aggregate)
    HISTORY = "history"  # every row, in order_by order
    WINDOWED = "windowed"  # one aggregate per time window


class TimeType(enum.StrEnum):
    """The type of a timeline's time column, and so its unit."""

    TIMESTAMP = "timestamp"  # microseconds since 1970-01-01T00:00:00Z
    DATE = "date"  # days since 1970-01-01
    INTEGER = "integer"  # the column's integers (milliseconds since the epoch for durations)


# One unit of each time type, in microseconds (for durations).
_UNIT_US = {TimeType.TIMESTAMP: 1, TimeType.DATE: 86_400_000_000, TimeType.INTEGER: 1_000}


class TimelineError(ValueError):
    """A timeline setting or bound that is not valid; the message says which and why."""


# -- durations -------------------------------------------------------------------------------------------

_DURATION = re.compile(
    r"\s*(\d+)\s*(ms|milliseconds?|s|secs?|seconds?|m|mins?|minutes?|h|hours?|d|days?|w|weeks?)\s*", re.IGNORECASE
)
_DURATION_US = {
    "ms": 1_000,
    "s": 1_000_000,
    "m": 60_000_000,
    "h": 3_600_000_000,
    "d": 86_400_000_000,
    "w": 604_800_000_000,
}


def parse_duration_us(text: str) -> int:
    """A duration such as "5 minutes", "90s", "7 days", in microseconds (positive)."""
    match = _DURATION.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise TimelineError(f'{text!r} is not a duration (e.g. "500 ms", "30 seconds", "5 minutes", "7 days")')
    count, unit = int(match.group(1)), match.group(2).lower()
    key = "ms" if unit.startswith("millis") or unit == "ms" else unit[0]
    micros = count * _DURATION_US[key]
    if micros <= 0:
        raise TimelineError(f"{text!r}: a duration must be positive")
    return micros


def duration_in_units(text: str, time_type: TimeType) -> int:
    """A duration as a whole number of `time_type` units (a date timeline's durations are whole days)."""
    micros = parse_duration_us(text)
    unit = _UNIT_US[time_type]
    if micros % unit:
        whole = "whole days" if time_type is TimeType.DATE else "whole milliseconds"
        raise TimelineError(f"{text!r}: a {time_type.value} timeline's durations are {whole}")
    return micros // unit


# -- the store's timeline, as published ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Timeline:
    """A history or windowed store's timeline, as its store record and manifests carry it.

    `column` is the time column (the spec's `order_by`); windowed stores also have `window` and `advance`
    (in time units; equal for tumbling windows). `retention` is the spec's text, for people to read."""

    kind: StoreKind
    column: str
    time_type: TimeType
    window: int | None = None
    advance: int | None = None
    retention: str | None = None

    def __post_init__(self) -> None:
        if self.kind is StoreKind.VALUE:
            raise TimelineError("a value store has no timeline")
        if self.kind is StoreKind.WINDOWED:
            if not self.window or not self.advance or self.window <= 0 or not 0 < self.advance <= self.window:
                raise TimelineError("a windowed timeline needs 0 < advance <= window")
        elif self.window is not None or self.advance is not None:
            raise TimelineError("only a windowed timeline has a window")

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"kind": self.kind.value, "column": self.column, "time_type": self.time_type.value}
        if self.window is not None:
            doc["window"] = self.window
            doc["advance"] = self.advance
        if self.retention is not None:
            doc["retention"] = self.retention
        return doc

    @classmethod
    def from_dict(cls, doc: Any) -> Timeline:
        if not isinstance(doc, dict):
            raise TimelineError(f"a timeline is an object, got {doc!r}")
        try:
            window, advance = doc.get("window"), doc.get("advance")
            return cls(
                kind=StoreKind(doc["kind"]),
                column=str(doc["column"]),
                time_type=TimeType(doc["time_type"]),
                window=None if window is None else int(window),
                advance=None if advance is None else int(advance),
                retention=None if doc.get("retention") is None else str(doc["retention"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise TimelineError(f"not a valid timeline: {doc!r} ({exc})") from exc

    # -- times as text -----------------------------------------------------------------------------------

    def parse_time(self, text: str, name: str) -> int:
        """A query bound (`from`, `to`) in this timeline's unit: ISO 8601 for a timestamp (UTC unless it
        says otherwise) or date timeline, a decimal integer for an integer one. A timestamp bound may also be
        a decimal integer: milliseconds since the epoch, as live records and Kafka timestamps count (ISO
        8601 always has its dashes, so the two never meet)."""
        if self.time_type is TimeType.TIMESTAMP:
            millis = integer_text(text, signed=True)
            if millis is not None:
                if not INT64_MIN // 1000 <= millis <= INT64_MAX // 1000:
                    raise TimelineError(f"{name}={text!r} is out of range as milliseconds since the epoch")
                return millis * 1000
            try:
                return parse_time(text, self.time_type, name)
            except TimelineError:
                raise TimelineError(
                    f"{name}={text[:40]!r} is not a time: ISO 8601 (e.g. 2024-06-11T10:00:00Z, "
                    "2024-06-11T12:00:00+02:00, 2024-06-11) or milliseconds since the epoch (e.g. 1718100000000)"
                ) from None
        return parse_time(text, self.time_type, name)

    def show_time(self, value: int) -> str:
        return show_time(value, self.time_type)


def parse_time(text: str, time_type: TimeType, name: str) -> int:
    if time_type is TimeType.INTEGER:
        value = integer_text(text, signed=True)
        if value is None:
            raise TimelineError(f"{name}={text!r} is not an integer (this store orders by an integer column)")
        if not INT64_MIN <= value <= INT64_MAX:
            raise TimelineError(f"{name}={text!r} is out of the 64-bit range")
        return value
    if time_type is TimeType.DATE:
        try:
            day = dt.date.fromisoformat(text)
        except ValueError:
            raise TimelineError(f"{name}={text!r} is not a date (YYYY-MM-DD)") from None
        return (day - dt.date(1970, 1, 1)).days
    try:
        moment = dt.datetime.fromisoformat(text)
    except ValueError:
        raise TimelineError(
            f"{name}={text!r} is not an ISO 8601 time (e.g. 2024-06-11T10:00:00Z, 2024-06-11T12:00:00+02:00)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    delta = moment - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


# -- ordering values written as text ---------------------------------------------------------------------
#
# The one definition of which texts are times (or integers) wherever rows are ordered: the build reads a text
# column with these patterns and Spark's cast (keyroute.pipeline.timeline), the live fold with
# `parse_order_text`; both give the same instant for every text, or refuse it alike. Written once, as
# patterns Java's and Python's regular expressions read the same way (classes, groups, `?`, `{m,n}`).
#
# Timestamps: ISO 8601's extended format, as Spark's cast reads it: a date, optionally `T` (or a space) and
# hh:mm, then optionally :ss with a fraction of up to 9 digits (kept to microseconds, the rest cut) and a zone
# offset (Z, +02:00, +0200, +02; at most 18 hours, as Java's); an offset needs the seconds. No offset: UTC.
TIMESTAMP_PATTERN = (
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})"
    r"(?:[T ]([0-9]{2}):([0-9]{2})(?::([0-9]{2})(?:\.([0-9]{1,9}))?(Z|([+-])([0-9]{2})(?::?([0-9]{2}))?)?)?)?"
)
DATE_PATTERN = r"([0-9]{4})-([0-9]{2})-([0-9]{2})"
INTEGER_PATTERN = r"[+-]?[0-9]{1,19}"
_ORDER_TEXT = {
    TimeType.TIMESTAMP: re.compile(TIMESTAMP_PATTERN),
    TimeType.DATE: re.compile(DATE_PATTERN),
    TimeType.INTEGER: re.compile(INTEGER_PATTERN, re.ASCII),
}
_MAX_OFFSET_MINUTES = 18 * 60
_MONTH_DAYS = (31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


def java_pattern(pattern: str) -> str:
    """A pattern above as Spark's `rlike` must be given it: the whole text (Java's `$` would also match before
    a final line break, which Spark's cast then trims away)."""
    return f"^(?:{pattern})\\z"


def parse_order_text(text: str, time_type: TimeType) -> int | None:
    """An ordering value's text as an int64 in `time_type`'s unit (microseconds or days since the epoch in
    the proleptic Gregorian calendar, or the integer), exactly as the build reads it; None when the text is
    not one (or not a valid date, time, offset or 64-bit integer)."""
    match = _ORDER_TEXT[time_type].fullmatch(text)
    if match is None:
        return None
    if time_type is TimeType.INTEGER:
        value = int(text)
        return value if INT64_MIN <= value <= INT64_MAX else None
    days = _civil_days(int(match[1]), int(match[2]), int(match[3]))
    if days is None or time_type is TimeType.DATE:
        return days
    hour, minute, second = int(match[4] or 0), int(match[5] or 0), int(match[6] or 0)
    if hour > 23 or minute > 59 or second > 59:
        return None
    offset = 0
    if match[9] is not None:
        hours, minutes = int(match[10]), int(match[11] or 0)
        offset = hours * 60 + minutes
        if minutes > 59 or offset > _MAX_OFFSET_MINUTES:
            return None
        if match[9] == "-":
            offset = -offset
    seconds = days * 86_400 + hour * 3_600 + minute * 60 + second - offset * 60
    return seconds * 1_000_000 + int((match[7] or "").ljust(6, "0")[:6])


def _civil_days(year: int, month: int, day: int) -> int | None:
    """Days from 1970-01-01 to a date of the proleptic Gregorian calendar (year 0 included, as Spark's), or
    None for a date that does not exist."""
    if not 1 <= month <= 12:
        return None
    leap = year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
    if not 1 <= day <= _MONTH_DAYS[month - 1] + (1 if month == 2 and leap else 0):
        return None
    # Howard Hinnant's days_from_civil: years start in March, so February's length is the last thing counted.
    y = year - 1 if month <= 2 else year
    era = y // 400
    year_of_era = y - era * 400
    day_of_year = (153 * (month + (-3 if month > 2 else 9)) + 2) // 5 + day - 1
    day_of_era = year_of_era * 365 + year_of_era // 4 - year_of_era // 100 + day_of_year
    return era * 146_097 + day_of_era - 719_468


def show_time(value: int, time_type: TimeType) -> str:
    """A time as the bounds are written (ISO 8601 in UTC, a date, or the integer)."""
    if time_type is TimeType.INTEGER:
        return str(value)
    try:
        if time_type is TimeType.DATE:
            return (dt.date(1970, 1, 1) + dt.timedelta(days=value)).isoformat()
        moment = dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(microseconds=value)
        return moment.isoformat().replace("+00:00", "Z")
    except OverflowError:
        return str(value)


# -- LMDB keys ---------------------------------------------------------------------------------------------


def escape_key(key: bytes) -> bytes:
    """The serialized key as a key part holds it: every 0x00 byte written 0x00 0x01 (order kept)."""
    return key.replace(b"\x00", _ESCAPED_ZERO) if b"\x00" in key else key


def key_part(key: bytes) -> bytes:
    """The key part of every entry of the key whose serialized bytes are `key` (see the module docstring)."""
    escaped = escape_key(key)
    if 1 + len(escaped) + len(KEY_END) <= _MAX_KEY_PART:
        return TAG_KEY + escaped + KEY_END
    return TAG_HASHED + hashlib.sha256(key).digest()


def key_parts(keys: Any) -> Any:
    """`key_part` of every key in a pyarrow binary array (null stays null), as a binary array."""
    import pyarrow as pa

    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks()
    return pa.array([None if k is None else key_part(k) for k in keys.cast(pa.binary()).to_pylist()], pa.binary())


def entry_key(part: bytes, time: int, sequence: int) -> bytes:
    """The LMDB key of the entry at (`time`, `sequence`) of the key whose key part is `part`."""
    return part + _TIME_SEQ.pack((time + (1 << 64)) % (1 << 64) ^ _SIGN, sequence)


def time_bytes(time: int) -> bytes:
    """The 8 bytes of `time` in an entry key (sign bit flipped, big-endian)."""
    return ((time + (1 << 64)) % (1 << 64) ^ _SIGN).to_bytes(8, "big")


def split_entry(lmdb_key: bytes) -> tuple[bytes, int, int]:
    """(key part, time, sequence) of an entry key; TimelineError if it is not one."""
    if len(lmdb_key) < 1 + SUFFIX_BYTES or lmdb_key[:1] not in (TAG_KEY, TAG_HASHED):
        raise TimelineError(f"LMDB key {bytes(lmdb_key[:40])!r} is not a timeline entry")
    part = bytes(lmdb_key[:-SUFFIX_BYTES])
    if part[:1] == TAG_HASHED:
        if len(part) != HASHED_PART_BYTES:
            raise TimelineError(f"LMDB key {bytes(lmdb_key[:40])!r} is not a timeline entry")
    elif not part.endswith(KEY_END) or not _well_escaped(part[1 : -len(KEY_END)]):
        raise TimelineError(f"LMDB key {bytes(lmdb_key[:40])!r} is not a timeline entry")
    flipped, sequence = _TIME_SEQ.unpack(lmdb_key[-SUFFIX_BYTES:])
    raw = flipped ^ _SIGN
    return part, raw - (1 << 64) if raw >= _SIGN else raw, sequence


def _well_escaped(escaped: bytes) -> bool:
    index = escaped.find(b"\x00")
    while index != -1:
        if escaped[index + 1 : index + 2] != b"\x01":
            return False
        index = escaped.find(b"\x00", index + 2)
    return True


def key_of_part(part: bytes) -> bytes | None:
    """The serialized key of a `=` key part, or None for a hashed one."""
    if part[:1] != TAG_KEY:
        return None
    return part[1 : -len(KEY_END)].replace(_ESCAPED_ZERO, b"\x00")


def key_of_entry(lmdb_key: bytes) -> bytes | None:
    """The serialized key of an entry key, or None for a hashed one; TimelineError if it is not an entry."""
    return key_of_part(split_entry(lmdb_key)[0])


# -- cursors ---------------------------------------------------------------------------------------------

CURSOR_VERSION = 1
_TAG_BYTES = 12
_MALFORMED = "cursor is malformed (not one this API returned)"


class CursorError(TimelineError):
    """A cursor that is malformed, altered, or given with another query than the one it continues."""


def _payload(body: list[Any], query: tuple[Any, ...]) -> bytes:
    return json.dumps([body, list(query)], separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def seal(context: bytes, secret: bytes, body: list[Any], query: tuple[Any, ...]) -> str:
    """An opaque token of `body` (a JSON list) tagged with HMAC-SHA256 over the body and `query` (what the
    request asked), keyed by `context` and `secret` (the cluster's member token, when set): it is accepted
    back only unchanged and only with the same query. Timeline and range cursors are such tokens."""
    tag = hmac.new(context + b"\x00" + secret, _payload(body, query), hashlib.sha256).digest()[:_TAG_BYTES]
    token = json.dumps(body, separators=(",", ":")).encode("ascii") + b"." + tag
    return base64.urlsafe_b64encode(token).rstrip(b"=").decode("ascii")


def unseal(context: bytes, secret: bytes, query: tuple[Any, ...], text: str, max_chars: int) -> list[Any]:
    """The body of a token `seal` made with the same context, secret and query; CursorError otherwise."""
    if not text or len(text) > max_chars or not re.fullmatch(r"[A-Za-z0-9_-]+", text):
        raise CursorError(_MALFORMED)
    try:
        token = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        raw_body, dot, tag = token[: -_TAG_BYTES - 1], token[-_TAG_BYTES - 1 : -_TAG_BYTES], token[-_TAG_BYTES:]
        body = json.loads(raw_body)
        if dot != b"." or not isinstance(body, list):
            raise ValueError("not a token")
    except ValueError:
        raise CursorError(_MALFORMED) from None
    expected = hmac.new(context + b"\x00" + secret, _payload(body, query), hashlib.sha256).digest()[:_TAG_BYTES]
    if not hmac.compare_digest(tag, expected):
        raise CursorError("cursor does not continue this query (it was altered, or comes from another one)")
    return body


def make_cursor(secret: bytes, query: tuple[Any, ...], version: int, after: tuple[int, int]) -> str:
    """An opaque cursor continuing `query` (what the request asked: store, key, kind, bounds, order) after
    the entry at `after` (time, sequence) of `version` (see `seal`)."""
    return seal(b"keyroute-cursor", secret, [CURSOR_VERSION, version, after[0], after[1]], query)


def read_cursor(secret: bytes, query: tuple[Any, ...], text: str) -> tuple[int, tuple[int, int]]:
    """(version, (time, sequence)) of a cursor `make_cursor` made for this same `query`; CursorError if it
    is malformed, altered, or belongs to another query."""
    body = unseal(b"keyroute-cursor", secret, query, text, 512)
    if not (len(body) == 4 and all(type(v) is int for v in body) and body[0] == CURSOR_VERSION):
        raise CursorError(_MALFORMED)
    _, version, time, sequence = body
    if not (INT64_MIN <= time <= INT64_MAX and 0 <= sequence <= MAX_SEQUENCE):
        raise CursorError(_MALFORMED)
    return version, (time, sequence)


# -- queries ---------------------------------------------------------------------------------------------

DEFAULT_LIMIT = 100
MAX_LIMIT = 10_000
HISTORY = "history"
WINDOWS = "windows"
# What each timeline read is asked on, and the store kind that answers it.
READ_KINDS = {HISTORY: StoreKind.HISTORY, WINDOWS: StoreKind.WINDOWED}
_PARAMETERS = ("from", "to", "limit", "order", "cursor", "min_offset", "fields")


class QueryError(TimelineError):
    """A timeline read's query that is not valid (400 bad_request); the message names the parameter."""


@dataclass(frozen=True, slots=True)
class TimelineQuery:
    """A timeline read as asked: entries of one key with `low` <= time < `high` (None: unbounded), at most
    `limit` of them, newest first when `descending`, continuing after `cursor` when given. For a windows
    read, the bounds select windows overlapping [from, to): `low`/`high` are already bounds on the start."""

    read: str
    low: int | None
    high: int | None
    limit: int
    descending: bool
    cursor: str | None
    bounds: tuple[str | None, str | None]  # from and to as given (what a cursor is bound to)
    min_offset: int | None = None  # live stores: answer from a state that has applied at least this offset

    def cursor_query(self, store: str, key: str) -> tuple[Any, ...]:
        """What a cursor continuing this read is bound to (the limit may change from page to page)."""
        return (store, key, self.read, self.bounds[0], self.bounds[1], "desc" if self.descending else "asc")


def parse_query(read: str, raw_query: bytes, timeline: Timeline) -> TimelineQuery:
    """The query string of a `history` or `windows` read (raw, percent-encoded) on a store with `timeline`."""
    given = query_params(raw_query, _PARAMETERS, QueryError)
    low = None if not given.get("from") else _bound(timeline, given["from"], "from")
    high = None if not given.get("to") else _bound(timeline, given["to"], "to")
    if low is not None and high is not None and low > high:
        raise QueryError(f"from={given['from']!r} is after to={given['to']!r}")
    limit = DEFAULT_LIMIT
    if "limit" in given:
        given_limit = integer_text(given["limit"])
        if given_limit is None or not 1 <= given_limit <= MAX_LIMIT:
            raise QueryError(f"limit={given['limit']!r}: expected an integer from 1 to {MAX_LIMIT}")
        limit = given_limit
    order = given.get("order", "asc") or "asc"
    if order not in ("asc", "desc"):
        raise QueryError(f"order={order!r}: expected 'asc' or 'desc'")
    if read == WINDOWS and low is not None:
        # A window [start, start + window) overlaps [from, to) when start > from - window.
        assert timeline.window is not None
        low = max(low - timeline.window + 1, INT64_MIN)
    cursor = given.get("cursor") or None
    min_offset = None
    if "min_offset" in given:
        text = given["min_offset"]
        min_offset = integer_text(text)
        if min_offset is None or min_offset > INT64_MAX:
            raise QueryError(f"min_offset={text!r}: expected an integer from 0 to 2^63-1")
    bounds = (given.get("from"), given.get("to"))
    return TimelineQuery(read, low, high, limit, order == "desc", cursor, bounds, min_offset)


def _bound(timeline: Timeline, text: str, name: str) -> int:
    try:
        return timeline.parse_time(text, name)
    except QueryError:
        raise
    except TimelineError as exc:
        raise QueryError(str(exc)) from None


# --- finding entries in an ordered key space (an LMDB cursor: set_range, key, next, prev, last) ------------


def first_after(cursor: Any, key: bytes) -> bool:
    """Position `cursor` at the least LMDB key greater than `key`; False if there is none."""
    if not cursor.set_range(key):
        return False
    return bool(cursor.next()) if cursor.key() == key else True


def last_before(cursor: Any, key: bytes) -> bool:
    """Position `cursor` at the greatest LMDB key less than `key`; False if there is none."""
    return bool(cursor.prev() if cursor.set_range(key) else cursor.last())


def last_at_or_before(cursor: Any, key: bytes) -> bool:
    """Position `cursor` at the greatest LMDB key at most `key`; False if there is none."""
    if cursor.set_range(key):
        return True if cursor.key() == key else bool(cursor.prev())
    return bool(cursor.last())
