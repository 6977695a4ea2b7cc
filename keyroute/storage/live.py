"""Live stores: what a store that follows a Kafka topic is, and how one record changes one key.

Store partition p IS topic partition p (the pipeline proves the partitioner; `keyroute.keys.partitioner`),
so every replica serving p consumes p itself and folds its records, in offset order, into the same LMDB
environment the batch version was loaded into. This module is the one definition of that fold, shared by
the pipeline (which builds the batch part of a hybrid version in the same stored form) and the nodes
(which apply the topic on top):

    record key     the key serialized in the store's key format, as the producer wrote it
    record value   a JSON object carrying the store's columns; null (a tombstone) deletes the key
    latest         the record with the greatest `order_by` wins (ties: the later offset)
    aggregate      count(*), count(col), sum(col), min(col), max(col), max_by(col, ord), min_by(col, ord),
                   merged one record at a time (nulls ignored as Spark SQL ignores them)

Orderings (`order_by`, the `ord` of max_by/min_by, a timeline's time) compare typed values, read by
`order_value` exactly as the build reads the same values: ISO 8601 text by its instant whatever its offset,
never as text.

A live store's stored value is the value a read answers, as compact JSON, then, where the fold needs more
than that value (the winning `order_by` of `latest`, the ordering value of `max_by`/`min_by`), a NUL byte
and that merge state as compact JSON. JSON text never holds a raw NUL, so `value_bytes` cuts the state off
exactly.

The partition's progress lives beside its rows: the LMDB entry OFFSET_KEY holds the next offset to apply,
written in the same write transaction as the rows a batch of records changed, so a crash at any point
neither loses nor applies twice.
"""

from __future__ import annotations

import datetime as dt
import enum
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from keyroute.keys.key_format import KeyFormat, KeyFormatError, key_from_data
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.keys.schema_registry import RegistrySettings, env_reference, resolve_env
from keyroute.storage.timeline import INT64_MAX, INT64_MIN, TimeType, parse_order_text

# Kept in the partition's own LMDB database: `!` sorts before both key tags (`#`, `=`), and no key's
# LMDB key starts with it (keyroute.storage.lmdb_layout.db_key), so lookups and scans of keys never meet it.
META_TAG = b"!"
OFFSET_KEY = META_TAG + b"next-offset"
# Between a live value (what a read gets) and its merge state.
STATE_SEPARATOR = b"\0"

STARTS = ("earliest", "latest")
ON_BAD_RECORD = ("skip", "stop")
# How far behind the topic (in records) a partition may be when it is announced as serving.
DEFAULT_CATCH_UP_RECORDS = 1000

_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, check_circular=False, allow_nan=False)
# orjson reads a JSON integer beyond 64 bits as a float: text with a run of 19 or more digits is read by the
# standard library instead, which keeps every integer exact.
_LONG_DIGITS = re.compile(rb"[0-9]{19}")


class LiveSpecError(ValueError):
    """A live store that cannot be built as described; the message says what and how to fix it."""


class Reason(enum.StrEnum):
    """Why a record was not applied (the `reason` label of the skipped-records counter)."""

    MISPLACED = "misplaced"  # its key hashes to another partition
    NULL_KEY = "null_key"  # no key: it cannot be found by key
    BAD_KEY = "bad_key"  # the key bytes are not a key of the store's key format
    KEY_SCHEMA_CHANGED = "key_schema_changed"  # the key was written under another key schema id (live_keys)
    NOT_JSON = "not_json"  # the value is not UTF-8 JSON
    NOT_OBJECT = "not_object"  # the value is JSON but not an object
    MISSING_COLUMN = "missing_column"  # a column the store needs is absent
    BAD_TYPE = "bad_type"  # a column holds a value the fold cannot use (e.g. sum of a string)
    # Values written by Schema Registry serializers (keyroute.formats.value_format):
    NOT_WIRE_FORMAT = "not_wire_format"  # no magic byte and schema id
    UNKNOWN_SCHEMA = "unknown_schema"  # the registry does not know the schema id (or it is another format)
    BAD_PAYLOAD = "bad_payload"  # the bytes do not decode with their schema


class BadRecord(Exception):
    """A record that cannot be applied: `reason` for the counters, the message for the log."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# --- aggregates that merge one record at a time -----------------------------------------------------------

MERGEABLE = ("count(*)", "count(col)", "sum(col)", "min(col)", "max(col)", "max_by(col, ord)", "min_by(col, ord)")
_IDENT = r"`[^`]+`|[A-Za-z_][A-Za-z0-9_]*"
_AGGREGATE = re.compile(
    rf"\s*(?P<function>count|sum|min|max|max_by|min_by)\s*\(\s*(?P<arg>\*|{_IDENT})\s*"
    rf"(?:,\s*(?P<by>{_IDENT})\s*)?\)\s*",
    re.IGNORECASE | re.ASCII,
)
_TWO_ARGS = ("max_by", "min_by")


@dataclass(frozen=True, slots=True)
class Aggregate:
    """One output column of an aggregate store: `function` over `column` (None for count(*)), ordered by
    `by` for max_by/min_by."""

    name: str
    function: str
    column: str | None
    by: str | None = None
    # The type `by` is ordered as (keyroute.storage.timeline.TimeType's values; None: numbers), and so the unit
    # of the ordering value a max_by/min_by keeps in its merge state.
    by_type: str | None = None

    @property
    def has_state(self) -> bool:
        return self.by is not None

    def to_json(self) -> dict[str, Any]:
        doc = {"name": self.name, "function": self.function, "column": self.column, "by": self.by}
        if self.by_type is not None:
            doc["by_type"] = self.by_type
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Aggregate:
        by_type = _opt(doc.get("by_type"))
        if by_type is not None and by_type not in _TIME_TYPES:
            raise ValueError(f"unknown ordering type {by_type!r}")
        return cls(str(doc["name"]), str(doc["function"]), _opt(doc.get("column")), _opt(doc.get("by")), by_type)


def parse_aggregate(name: str, expression: str) -> Aggregate:
    """The mergeable aggregate an expression is; LiveSpecError (listing those that are) if it is not one."""
    match = _AGGREGATE.fullmatch(expression)
    if match is not None:
        function = match["function"].lower()
        arg, by = _unquote(match["arg"]), _unquote(match["by"]) if match["by"] else None
        two = function in _TWO_ARGS
        if (by is not None) == two and not (arg == "*" and (function != "count")):
            return Aggregate(name, function, None if arg == "*" else arg, by)
    raise LiveSpecError(
        f"aggregation {name!r} = {expression!r} cannot be merged one record at a time; a live store "
        f"accepts only: {', '.join(MERGEABLE)}"
    )


def _unquote(ident: str) -> str:
    return ident[1:-1] if ident.startswith("`") else ident


def _opt(value: Any) -> str | None:
    return None if value is None else str(value)


# --- the fold ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Merge:
    """How records fold into a key's stored value: mode `latest` (by `order_by`, keeping `columns`, or every
    field of the record but `key_column` when columns is None) or `aggregate` (`aggregates`, in order)."""

    mode: str
    key_column: str
    order_by: str | None = None
    columns: tuple[str, ...] | None = None
    aggregates: tuple[Aggregate, ...] = ()
    # Mode `latest`: `time_type` (None: numbers) is the type `order_by` is ordered as, and the unit of the winning
    # ordering value the merge state keeps (an int64 for a type; keyroute.storage.timeline).
    # Mode `history` (keyroute.storage.timeline): each record appends a row; its time is `order_by` read as
    # `time_type`; a key keeps its newest `retention_count` rows, or those within `retention_span` (time
    # units) of the partition's latest time.
    time_type: str | None = None
    retention_count: int | None = None
    retention_span: int | None = None
    # Mode `windowed`: each record is folded (`aggregates`) into every window it falls in: windows of
    # `window` time units starting on multiples of `advance`.
    window: int | None = None
    advance: int | None = None
    # Worked out once (every record is folded with them): whether stored values carry a merge state, the
    # columns a record must have, and per aggregate (name, function code, column, by).
    has_state: bool = field(init=False, repr=False, compare=False)
    _needed: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _plan: tuple[tuple[str, int, str | None, str | None, str | None], ...] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        needed: list[str] = []
        for agg in self.aggregates:
            needed += [c for c in (agg.column, agg.by) if c is not None and c not in needed]
        plan = tuple((a.name, _CODES[a.function], a.column, a.by, a.by_type) for a in self.aggregates)
        if self.mode in ("history", "windowed") and (self.order_by is None or self.time_type not in _TIME_TYPES):
            raise ValueError(f"a {self.mode} merge needs order_by and a time_type")
        if self.time_type is not None and self.time_type not in _TIME_TYPES:
            raise ValueError(f"unknown time_type {self.time_type!r}")
        if self.mode == "windowed" and not (self.window and self.advance and 0 < self.advance <= self.window):
            raise ValueError("a windowed merge needs 0 < advance <= window")
        has_state = self.mode == "latest" or any(a.has_state for a in self.aggregates)
        object.__setattr__(self, "has_state", has_state)
        object.__setattr__(self, "_needed", tuple(needed))
        object.__setattr__(self, "_plan", plan)

    def needed_columns(self) -> tuple[tuple[str, str], ...]:
        """The columns every record must have, each with what the store needs it for."""
        needed: list[tuple[str, str]] = []
        if self.order_by is not None:
            needed.append((self.order_by, "the store's order_by"))
        if self.mode in ("latest", "history"):
            needed += [(c, "a column of the store") for c in self.columns or () if c != self.order_by]
        for agg in self.aggregates:
            needed += [(c, f"aggregation {agg.name!r}") for c in (agg.column, agg.by) if c is not None]
        first: dict[str, str] = {}
        for column, why in needed:
            first.setdefault(column, why)
        return tuple(first.items())

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "mode": self.mode,
            "key_column": self.key_column,
            "order_by": self.order_by,
            "columns": None if self.columns is None else list(self.columns),
            "aggregates": [a.to_json() for a in self.aggregates],
        }
        if self.mode in ("history", "windowed") or self.time_type is not None:
            doc["time_type"] = self.time_type
            doc["retention_count"] = self.retention_count
            doc["retention_span"] = self.retention_span
        if self.mode == "windowed":
            doc["window"] = self.window
            doc["advance"] = self.advance
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Merge:
        mode = str(doc["mode"])
        if mode not in ("latest", "aggregate", "history", "windowed"):
            raise ValueError(f"unknown live merge mode {mode!r}")
        columns = doc.get("columns")
        count, span = doc.get("retention_count"), doc.get("retention_span")
        return cls(
            mode=mode,
            key_column=str(doc["key_column"]),
            order_by=_opt(doc.get("order_by")),
            columns=None if columns is None else tuple(str(c) for c in columns),
            aggregates=tuple(Aggregate.from_json(a) for a in doc.get("aggregates", ())),
            time_type=_opt(doc.get("time_type")),
            retention_count=None if count is None else int(count),
            retention_span=None if span is None else int(span),
            window=None if doc.get("window") is None else int(doc["window"]),
            advance=None if doc.get("advance") is None else int(doc["advance"]),
        )

    def apply(self, stored: bytes | None, row: Mapping[str, Any]) -> bytes | None:
        """The stored value after one record's row; None when the record changes nothing (an older
        `latest`). BadRecord when the row cannot be folded (then nothing changes)."""
        if self.mode == "latest":
            return self._latest(stored, row)
        return self._aggregate(stored, row)

    def history_row(self, row: Mapping[str, Any]) -> tuple[int, bytes]:
        """A history store's (time, stored row) of one record: the time in the timeline's unit, the row as
        the batch part spells it (order_by first, then the columns; a timestamp as Spark writes one)."""
        time, shown = self._time_of(row)
        order_by = self.order_by
        assert order_by is not None
        columns = self.columns
        if columns is None:
            key_column = self.key_column
            answer = {order_by: shown, **{n: v for n, v in row.items() if n != key_column and n != order_by}}
        else:
            try:
                answer = {order_by: shown, **{c: row[c] for c in columns if c != order_by}}
            except KeyError as exc:
                raise BadRecord(Reason.MISSING_COLUMN, f"no {exc.args[0]!r} (a column of the store)") from None
        return time, _dumps(answer)

    def record_time(self, row: Mapping[str, Any]) -> int:
        """A windowed store's record's time, in the timeline's unit."""
        return self._time_of(row)[0]

    def _time_of(self, row: Mapping[str, Any]) -> tuple[int, Any]:
        """A record's time in the timeline's unit, and as the batch part spells it."""
        order_by = self.order_by
        assert order_by is not None and self.time_type is not None
        try:
            raw = row[order_by]
        except KeyError:
            raise BadRecord(Reason.MISSING_COLUMN, f"no {order_by!r} (the store's order_by)") from None
        return _record_time(raw, self.time_type, order_by)

    def window_starts(self, time: int) -> range:
        """The starts of every window `time` falls in (start <= time < start + window), oldest first."""
        assert self.window is not None and self.advance is not None
        last = time - time % self.advance
        first = last - ((last - time + self.window - 1) // self.advance) * self.advance
        return range(first, last + 1, self.advance)

    def fold_window(self, stored: bytes | None, row: Mapping[str, Any], start: int) -> bytes:
        """A window's stored bytes after one record: {"start", "end", "value"} around the aggregations as
        mode `aggregate` folds them (and their merge state after NUL, when they keep one)."""
        assert self.window is not None and self.time_type is not None
        inner: bytes | None = None
        if stored is not None:
            cut = stored.find(STATE_SEPARATOR)
            answer = _loads(stored if cut < 0 else stored[:cut])
            inner = _dumps(answer["value"]) + (b"" if cut < 0 else stored[cut:])
        folded = self._aggregate(inner, row)
        cut = folded.find(STATE_SEPARATOR)
        value, state = (folded, b"") if cut < 0 else (folded[:cut], folded[cut:])
        head = _dumps(
            {"start": _shown_time(start, self.time_type), "end": _shown_time(start + self.window, self.time_type)}
        )
        return head[:-1] + b',"value":' + value + b"}" + state

    def initial_state(self, value: Mapping[str, Any], order: Any = None) -> bytes:
        """The stored bytes of a batch-built value (the pipeline's side of a hybrid version)."""
        return encode_stored(value, [order] if self.mode == "latest" else None)

    def _latest(self, stored: bytes | None, row: Mapping[str, Any]) -> bytes | None:
        order_by = self.order_by
        assert order_by is not None
        try:
            order = row[order_by]
        except KeyError:
            raise BadRecord(Reason.MISSING_COLUMN, f"no {order_by!r} (the store's order_by)") from None
        rank = order_value(order, self.time_type, order_by)
        if stored is not None:
            cut = stored.find(STATE_SEPARATOR)
            if cut >= 0:
                state = _loads(stored[cut + 1 :])
                # null orders first; a tie goes to this (the later) record
                if state and state[0] is not None and (rank is None or _held(state[0], self.time_type) > rank):
                    return None
        columns = self.columns
        if columns is None:
            key_column = self.key_column
            answer = {name: value for name, value in row.items() if name != key_column}
        else:
            try:
                answer = {c: row[c] for c in columns}
            except KeyError as exc:
                raise BadRecord(Reason.MISSING_COLUMN, f"no {exc.args[0]!r} (a column of the store)") from None
        return encode_stored(answer, [rank])

    def _aggregate(self, stored: bytes | None, row: Mapping[str, Any]) -> bytes:
        for wanted in self._needed:
            if wanted not in row:
                agg = next(a for a in self.aggregates if wanted in (a.column, a.by))
                raise BadRecord(Reason.MISSING_COLUMN, f"no {wanted!r} (aggregation {agg.name!r})")
        first = stored is None
        answer: dict[str, Any] = {}
        state: list[Any] | None = None
        if stored is not None:
            cut = stored.find(STATE_SEPARATOR)
            if cut < 0:
                answer = _loads(stored)
            else:
                answer, state = _loads(stored[:cut]), _loads(stored[cut + 1 :])
        out: dict[str, Any] = {}
        new_state: list[Any] | None = [] if self.has_state else None
        for i, (name, code, column, by, by_type) in enumerate(self._plan):
            current = answer.get(name)
            held = None
            if code == _COUNT:
                counted = 1 if column is None or row[column] is not None else 0
                current = (0 if first else int(current or 0)) + counted
            else:
                value = row[column]  # type: ignore[index]  # every function but count(*) has a column
                if code == _SUM:
                    if value is not None:
                        if value.__class__ not in _NUMBERS:
                            raise BadRecord(Reason.BAD_TYPE, f"{column!r} = {value!r} is not a number (sum)")
                        current = value if current is None else current + value
                        if current.__class__ is float and not math.isfinite(current):
                            raise BadRecord(Reason.BAD_TYPE, f"the sum of {column!r} overflows")
                elif code in (_MAX, _MIN):
                    if value is not None:
                        if current is None:
                            _rank(value, name)  # refuses what cannot be ordered
                            current = value
                        else:
                            newer, older = _rank(value, name), _rank(current, name)
                            if (newer > older) if code == _MAX else (newer < older):
                                current = value
                else:  # max_by / min_by: the column's value on the row with the greatest (least) ordering value
                    held = state[i] if state is not None and i < len(state) else None
                    order = order_value(row[by], by_type, by)  # type: ignore[index,arg-type]
                    if order is not None:
                        if held is None:
                            current, held = value, order
                        else:
                            older = _held(held, by_type)
                            if (order >= older) if code == _MAX_BY else (order <= older):
                                current, held = value, order
            out[name] = current
            if new_state is not None:
                new_state.append(held)
        return encode_stored(out, new_state)


_COUNT, _SUM, _MIN, _MAX, _MIN_BY, _MAX_BY = range(6)
_CODES = {"count": _COUNT, "sum": _SUM, "min": _MIN, "max": _MAX, "min_by": _MIN_BY, "max_by": _MAX_BY}
_NUMBERS = (int, float)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads_json(raw: bytes) -> Any:
    """JSON text as Python values, exactly (ValueError if it is not UTF-8 JSON; NaN and infinities are
    not JSON). Every record and every stored value is read here: orjson, which is several times faster than
    the standard library, unless the text has a number orjson would not keep exact."""
    if _LONG_DIGITS.search(raw) is None:
        return orjson.loads(raw)
    value = json.loads(raw, parse_constant=_refuse_constant)
    if _has_infinity(value):
        raise ValueError("a number is too large for a double")
    return value


_loads = loads_json


def _has_infinity(value: Any) -> bool:
    if value.__class__ is float:
        return not math.isfinite(value)
    if value.__class__ is dict:
        return any(_has_infinity(v) for v in value.values())
    if value.__class__ is list:
        return any(_has_infinity(v) for v in value)
    return False


def _dumps(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:  # an integer beyond 64 bits (a sum can grow past them): exact, slower
        return _COMPACT.encode(value).encode("utf-8")


def _held(value: Any, order_type: str | None) -> Any:
    """An ordering value a merge state keeps: what `order_value` made of a record's (an int64 for a type, a
    number without); a text, kept by a version built before orderings were typed, is refused."""
    kind = value.__class__
    if kind is int or (kind is float and order_type is None):
        return value
    raise BadRecord(
        Reason.BAD_TYPE,
        f"the stored ordering value {_shown(value)} is not {'an int64' if order_type else 'a number'} (a version "
        "built before orderings were typed: build the store again)",
    )


def _rank(value: Any, column: str) -> tuple[int, Any]:
    """The order min(col) and max(col) keep a column's values in, as Spark's min and max of the column do:
    null first, then numbers, then strings (as text: these are values, not orderings of rows, which
    `order_value` types). Booleans, arrays and objects are not orderable."""
    kind = value.__class__
    if kind is int:
        return (1, value)
    if kind is str:
        return (2, value)
    if kind is float:
        if math.isnan(value):
            raise BadRecord(Reason.BAD_TYPE, f"{column!r} is NaN")
        return (1, value)
    if value is None:
        return (0, 0)
    raise BadRecord(Reason.BAD_TYPE, f"{column!r} = {value!r} cannot be ordered (numbers and strings can)")


_TIME_TYPES = ("timestamp", "date", "integer")


def order_value(raw: Any, order_type: str | None, column: str) -> Any:
    """The value a record's ordering compares by, wherever the fold orders rows (the `order_by` of latest,
    history and windowed stores, the ordering of max_by and min_by): with a type, an int64 in its unit, as the
    build reads the same value (keyroute.storage.timeline): a `timestamp` from ISO 8601 text in any offset or
    from milliseconds since the epoch, a `date` from its `YYYY-MM-DD` text, an `integer` from itself or its
    decimal text; without a type (the build found a number column), the number. null stays None (ordered
    before every value). BadRecord (bad_type) for anything else: a text is never compared as text."""
    if raw is None:
        return None
    kind = raw.__class__
    if order_type is None:
        if kind is int or (kind is float and not math.isnan(raw)):
            return raw
        if kind is str:
            raise BadRecord(
                Reason.BAD_TYPE,
                f"{column!r} = {raw[:_SHOWN]!r} is text, and this store orders {column!r} as numbers; a store "
                'ordered by time text declares it: order_by_type = "timestamp" (or "date", "integer")',
            )
        raise BadRecord(Reason.BAD_TYPE, f"{column!r} = {raw!r} cannot be ordered (a number is needed)")
    value: int | None = None
    if kind is str:
        value = parse_order_text(raw, TimeType(order_type))
    elif order_type == "integer":
        value = raw if kind is int else None
    elif order_type == "timestamp" and (kind is int or (kind is float and math.isfinite(raw))):
        value = raw * 1000 if kind is int else int(round(raw * 1000))
    if value is None or not INT64_MIN <= value <= INT64_MAX:
        raise BadRecord(Reason.BAD_TYPE, f"{column!r} = {_shown(raw)} is not {_ORDER_TYPES[order_type]}")
    return value


_SHOWN = 100
_ORDER_TYPES = {
    "timestamp": "a timestamp: ISO 8601 (e.g. 2024-06-11T10:00:00Z, 2024-06-11T12:00:00.250+02:00) or "
    "milliseconds since the epoch",
    "date": "a date (YYYY-MM-DD)",
    "integer": "a 64-bit integer",
}


def _shown(raw: Any) -> str:
    text = repr(raw)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "…"


def _record_time(raw: Any, time_type: str, column: str) -> tuple[int, Any]:
    """A record's time as (int64 in the timeline's unit, the value its row shows): an integer column's
    integer; a date's "YYYY-MM-DD"; a timestamp shown as Spark writes timestamps (UTC, milliseconds)."""
    time = order_value(raw, time_type, column)
    if time is None:
        raise BadRecord(Reason.BAD_TYPE, f"{column!r} is null (the time)")
    if time_type == "integer":
        return time, time
    try:
        return time, _shown_time(time, time_type)
    except OverflowError:  # before year 1 (Spark reads year 0; Python's dates start at year 1)
        raise BadRecord(Reason.BAD_TYPE, f"{column!r} = {_shown(raw)} is out of range") from None


def _shown_time(value: int, time_type: str) -> Any:
    """A window bound as the batch part's JSON spells it (a timestamp as Spark writes one)."""
    if time_type == "integer":
        return value
    if time_type == "date":
        return (dt.date(1970, 1, 1) + dt.timedelta(days=value)).isoformat()
    moment = dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(microseconds=value)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


# --- stored bytes -----------------------------------------------------------------------------------------


def encode_stored(value: Mapping[str, Any], state: Sequence[Any] | None) -> bytes:
    """Compact JSON of the value, then (when the fold keeps one) NUL and the merge state. Values read by
    `_loads` are finite; only a sum can overflow to infinity, and `_aggregate` refuses that record."""
    body = _dumps(value)
    if state is None:
        return body
    return body + STATE_SEPARATOR + _dumps(list(state))


def value_bytes(stored: bytes) -> bytes:
    """The value a read of a key gets from what is stored for it (the `value` of a node's reply and so of
    the answer): everything before the merge state (all of a batch value)."""
    cut = stored.find(STATE_SEPARATOR)
    return stored if cut < 0 else stored[:cut]


def decode_state(stored: bytes) -> list[Any] | None:
    cut = stored.find(STATE_SEPARATOR)
    if cut < 0:
        return None
    state = _loads(stored[cut + 1 :])
    return state if isinstance(state, list) else None


# --- records ----------------------------------------------------------------------------------------------


# Keys a RecordReader has proven to be well-formed and of its partition, before it starts over.
KNOWN_KEYS = 1 << 17


class RecordReader:
    """Turns one Kafka record of partition `partition` into (key bytes, row or None for a tombstone); a value is
    a JSON object, or what `values` makes of it (a Schema Registry format).

    A key's format and partition are checked once: keys proven here are remembered (up to KNOWN_KEYS of
    them), since most records of a stream are about keys it has seen before."""

    __slots__ = ("key_format", "partitioner", "partitions", "partition", "_known", "_values")

    def __init__(
        self,
        key_format: KeyFormat,
        partitioner: Partitioner,
        partitions: int,
        partition: int,
        values: Callable[[bytes], dict[str, Any]] | None = None,
    ) -> None:
        self.key_format = key_format
        self.partitioner = partitioner
        self.partitions = partitions
        self.partition = partition
        self._known: set[bytes] = set()
        # How a value becomes a row when it is not a JSON object (keyroute.formats.value_format.ValueDecoder.decode).
        self._values = values

    def read(self, key: bytes | None, value: bytes | None) -> tuple[bytes, dict[str, Any] | None]:
        if key is None:
            raise BadRecord(Reason.NULL_KEY, "the record has no key")
        known = self._known
        if key not in known:
            self._prove(key)
            if len(known) >= KNOWN_KEYS:
                known.clear()
            known.add(key)
        if value is None:
            return key, None
        if self._values is not None:
            return key, self._values(value)
        try:
            row = _loads(value)
        except (UnicodeDecodeError, ValueError):
            raise BadRecord(Reason.NOT_JSON, "the value is not UTF-8 JSON") from None
        if row.__class__ is not dict:
            raise BadRecord(Reason.NOT_OBJECT, f"the value is JSON {type(row).__name__}, not an object")
        return key, row

    def _prove(self, key: bytes) -> None:
        try:
            key_from_data(self.key_format, key)
        except KeyFormatError as exc:
            raise BadRecord(Reason.BAD_KEY, str(exc)) from None
        owner = partition_for(self.partitioner, key, self.partitions)
        if owner != self.partition:
            raise BadRecord(Reason.MISPLACED, f"its key belongs to partition {owner}")


# --- what a version says about its topic ------------------------------------------------------------------


# Consumer settings that carry secrets: a spec must name an environment variable for them (`${NAME}`), so
# no secret is ever written to a manifest or to ZooKeeper; nodes read the variable when they connect.
SECRET_SETTINGS = frozenset(
    {
        "sasl.password",
        "sasl.oauthbearer.client.secret",
        "ssl.key.password",
        "ssl.keystore.password",
        "ssl.key.pem",
        "ssl_key",
    }
)


@dataclass(frozen=True, slots=True)
class LiveConfig:
    """The live part of a version's manifest: where its topic is, how to fold it, and where the version's
    batch part ends. `offsets[p]` is the next offset of topic partition p to apply on top of the batch part
    (resolved by the pipeline when it built the version, so every replica starts from the same offset)."""

    topic: str
    bootstrap_servers: str
    merge: Merge
    offsets: tuple[int, ...]
    kafka: Mapping[str, str] = field(default_factory=dict)
    on_bad_record: str = "skip"
    catch_up_records: int = DEFAULT_CATCH_UP_RECORDS
    # How record values are written (keyroute.formats.value_format) and, for the registry formats, where the
    # Schema Registry is.
    value_format: str = "json"
    schema_registry: RegistrySettings | None = None

    def consumer_settings(self, environ: Mapping[str, str]) -> dict[str, str]:
        """The client settings, `${NAME}` references resolved from `environ` (LiveSpecError if unset)."""
        return {
            name: resolve_env(f"kafka setting {name!r}", value, environ, LiveSpecError)
            for name, value in self.kafka.items()
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "bootstrap_servers": self.bootstrap_servers,
            "kafka": dict(sorted(self.kafka.items())),
            "merge": self.merge.to_json(),
            "offsets": list(self.offsets),
            "on_bad_record": self.on_bad_record,
            "catch_up_records": self.catch_up_records,
            **({"value_format": self.value_format} if self.value_format != "json" else {}),
            **({"schema_registry": self.schema_registry.to_json()} if self.schema_registry is not None else {}),
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> LiveConfig:
        on_bad = str(doc.get("on_bad_record", "skip"))
        if on_bad not in ON_BAD_RECORD:
            raise ValueError(f"on_bad_record {on_bad!r} (expected one of: {', '.join(ON_BAD_RECORD)})")
        registry = doc.get("schema_registry")
        offsets = tuple(int(o) for o in doc["offsets"])
        if any(o < 0 for o in offsets):
            raise ValueError("live offsets must be >= 0")
        return cls(
            topic=str(doc["topic"]),
            bootstrap_servers=str(doc["bootstrap_servers"]),
            merge=Merge.from_json(doc["merge"]),
            offsets=offsets,
            kafka={str(k): str(v) for k, v in dict(doc.get("kafka", {})).items()},
            on_bad_record=on_bad,
            catch_up_records=int(doc.get("catch_up_records", DEFAULT_CATCH_UP_RECORDS)),
            value_format=str(doc.get("value_format", "json")),
            schema_registry=None if registry is None else RegistrySettings.from_json(registry),
        )


def check_kafka_settings(kafka: Mapping[str, Any]) -> dict[str, str]:
    """The spec's `kafka` table as client settings: strings (TOML numbers and booleans spelled as librdkafka
    wants them); secrets only as `${ENV}` references. LiveSpecError otherwise."""
    settings: dict[str, str] = {}
    for name, value in kafka.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float, str)):
            text = str(value)
        else:
            raise LiveSpecError(f"kafka setting {name!r} must be a string, number or boolean")
        if name.lower() in SECRET_SETTINGS and env_reference(text) is None:
            raise LiveSpecError(
                f'kafka setting {name!r} is a secret: write it as "${{ENV_VAR}}" and set that variable on the '
                "nodes (secrets are never written to manifests or ZooKeeper)"
            )
        if name in ("group.id", "enable.auto.commit", "bootstrap.servers"):
            raise LiveSpecError(f"kafka setting {name!r} is keyroute's own (bootstrap_servers is its own field)")
        settings[str(name)] = text
    return settings
