"""Key ranges across keys: `GET /stores/{store}/range` in the store's key order.

Keys are in the byte order of their serialized form (Kafka's serializers), except integer keys, which are
in numeric order (negative before positive, which big-endian two's complement bytes alone do not give).
murmur2 spreads any range over every partition, so a router asks each partition for the keys of the range
it holds (`GET /stores/{store}/partitions/{p}/range`, sent to a node serving it), merges the nodes' sorted
replies and answers with at most `limit` keys, with a cursor that continues after the last one, at the
versions the first page was read at.

Keys too long to be stored under their own bytes (511 bytes and more, stored under a hash) cannot be read
back, and are never in a range.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from keyroute.api import BadKey, BadRequest, WrongStoreKind, integer_text, query_params
from keyroute.keys.key_format import Key, KeyFormat, KeyFormatError, parse_key
from keyroute.storage.lmdb_layout import TAG_KEY
from keyroute.storage.timeline import CursorError, escape_key, seal, unseal

DEFAULT_LIMIT = 100
MAX_LIMIT = 10_000
_INT_FORMATS = frozenset({KeyFormat.INT16, KeyFormat.INT32, KeyFormat.INT64})
_PUBLIC = ("from_key", "to_key", "prefix", "limit", "cursor", "fields")
_PARTITION = ("from_key", "to_key", "after", "limit", "version", "fields")


class RangeQueryError(ValueError):
    """A range query that is not valid (400); the message names the parameter."""


class RangeKeyError(RangeQueryError):
    """A range bound that does not fit the store's key format (400 bad_key)."""


def no_key_ranges(store: str, key_format: KeyFormat) -> str | None:
    """Why `store` offers no key ranges (None: it does): Schema Registry keys sort by their framed bytes,
    which is no order of their texts a caller could ask for."""
    if not key_format.registered:
        return None
    return f"store {store!r} has {key_format.value} keys (Schema Registry): key ranges are not offered for them"


_Query = TypeVar("_Query")


def read_query(
    store: str, key_format: KeyFormat, raw_query: bytes, parse: Callable[[bytes, KeyFormat], _Query]
) -> _Query:
    """`parse`'s reading of a range read of `store` (a router's or a node's), its refusals as the data API's
    errors: `wrong_store_kind` (keys without an order), `bad_key` (a bound the key format refuses) or
    `bad_request`."""
    if (refused := no_key_ranges(store, key_format)) is not None:
        raise WrongStoreKind(refused)
    try:
        return parse(raw_query, key_format)
    except RangeKeyError as exc:
        raise BadKey(str(exc)) from None
    except RangeQueryError as exc:
        raise BadRequest(str(exc)) from None


def order_of(key_format: KeyFormat, data: bytes) -> bytes | int:
    """What keys of `key_format` sort by: their serialized bytes, or their value for integer formats."""
    if key_format in _INT_FORMATS:
        return int.from_bytes(data, "big", signed=True)
    return data


def prefix_end(prefix: bytes) -> bytes | None:
    """The least byte string greater than every string starting with `prefix` (None: there is none)."""
    trimmed = prefix.rstrip(b"\xff")
    if not trimmed:
        return None
    return trimmed[:-1] + bytes([trimmed[-1] + 1])


def _limit(given: dict[str, str]) -> int:
    if "limit" not in given:
        return DEFAULT_LIMIT
    text = given["limit"]
    limit = integer_text(text)
    if limit is None or not 1 <= limit <= MAX_LIMIT:
        raise RangeQueryError(f"limit={text!r}: expected an integer from 1 to {MAX_LIMIT}")
    return limit


def _key(key_format: KeyFormat, given: dict[str, str], name: str) -> Key | None:
    text = given.get(name)
    if text is None or text == "":
        return None
    try:
        return parse_key(key_format, text)
    except KeyFormatError as exc:
        raise RangeKeyError(f"{name}={text!r}: {exc}") from None


@dataclass(frozen=True, slots=True)
class RangeQuery:
    """A range read as a client asks it: keys in [low, high) (None: unbounded), at most `limit`, after the
    cursor's key when `cursor` is given. A `prefix` (string keys) is the range of the keys starting with it."""

    low: Key | None
    high: bytes | None  # serialized; None: unbounded
    high_text: str | None
    limit: int
    cursor: str | None
    bounds: tuple[str | None, str | None, str | None]  # from_key, to_key, prefix as given: what a cursor binds
    # `fields=` as given (keyroute.storage.projection), passed on to the nodes; None: whole values.
    fields: str | None = None


def parse_range_query(raw_query: bytes, key_format: KeyFormat) -> RangeQuery:
    given = query_params(raw_query, _PUBLIC, RangeQueryError)
    prefix = given.get("prefix")
    low, high = _key(key_format, given, "from_key"), _key(key_format, given, "to_key")
    high_bytes = None if high is None else high.data
    high_text = None if high is None else high.text
    if prefix is not None:
        if key_format is not KeyFormat.STRING:
            raise RangeQueryError(f"prefix: prefix ranges are for string keys, not {key_format.value} keys")
        if low is not None or high is not None:
            raise RangeQueryError("prefix: give either prefix or from_key/to_key, not both")
        low = parse_key(KeyFormat.STRING, prefix)
        high_bytes = prefix_end(low.data)
        high_text = None
    elif low is not None and high is not None and order_of(key_format, low.data) > order_of(key_format, high.data):  # type: ignore[operator]
        raise RangeQueryError(f"from_key={low.text!r} is after to_key={high.text!r}")
    return RangeQuery(
        low=low,
        high=high_bytes,
        high_text=high_text,
        limit=_limit(given),
        cursor=given.get("cursor") or None,
        bounds=(given.get("from_key"), given.get("to_key"), prefix),
        fields=given.get("fields"),
    )


@dataclass(frozen=True, slots=True)
class PartitionRange:
    """What a router asks one partition: keys in [low, high) after `after`, at most `limit`, at `version`
    (None: whatever version the node serves)."""

    low: bytes | None
    high: bytes | None
    after: bytes | None
    limit: int
    version: int | None
    # The projection (keyroute.storage.projection) as text; None: whole values.
    fields: str | None = None

    def to_query(self, key_format: KeyFormat) -> dict[str, str]:
        """The query parameters of this request (keys as their canonical text; `high` may be a prefix's end,
        which is not a key of the format: sent as hex)."""
        query: dict[str, str] = {"limit": str(self.limit)}
        if self.low is not None:
            query["from_key"] = self.low.hex()
        if self.high is not None:
            query["to_key"] = self.high.hex()
        if self.after is not None:
            query["after"] = self.after.hex()
        if self.version is not None:
            query["version"] = str(self.version)
        if self.fields is not None:
            query["fields"] = self.fields
        return query


def parse_partition_range(raw_query: bytes, key_format: KeyFormat) -> PartitionRange:
    """A router's request to one partition (bounds as the serialized keys' hex)."""
    given = query_params(raw_query, _PARTITION, RangeQueryError)

    def data(name: str) -> bytes | None:
        text = given.get(name)
        if text is None:
            return None
        try:
            return bytes.fromhex(text)
        except ValueError:
            raise RangeQueryError(f"{name}: expected the serialized key in hex") from None

    version_text = given.get("version")
    version = None if version_text is None else integer_text(version_text)
    if version_text is not None and (version is None or version < 1):
        raise RangeQueryError(f"version={version_text!r}: expected a version number")
    width = _WIDTHS.get(key_format)
    bounds = (data("from_key"), data("to_key"), data("after"))
    if width is not None and any(b is not None and len(b) != width for b in bounds):
        raise RangeQueryError(f"{key_format.value} keys are {width} bytes")
    return PartitionRange(*bounds, limit=_limit(given), version=version, fields=given.get("fields"))


_WIDTHS = {KeyFormat.INT16: 2, KeyFormat.INT32: 4, KeyFormat.INT64: 8}


def in_range(key_format: KeyFormat, data: bytes, low: bytes | None, high: bytes | None, after: bytes | None) -> bool:
    """Whether the serialized key `data` is in [low, high) and after `after`, in the store's key order."""
    key = order_of(key_format, data)
    if low is not None and key < order_of(key_format, low):  # type: ignore[operator]
        return False
    if high is not None and key >= order_of(key_format, high):  # type: ignore[operator]
        return False
    return after is None or key > order_of(key_format, after)  # type: ignore[operator]


def scan_segments(
    key_format: KeyFormat, low: bytes | None, high: bytes | None, after: bytes | None
) -> list[tuple[bytes | None, bytes | None]]:
    """The stretches of serialized-key space to scan, in the store's key order, each [start, end) in byte
    order (None: unbounded): one for byte-ordered keys, up to two for integer keys (negatives, whose sign
    bit sorts them after the positives in bytes, then non-negatives). Scanned keys are still checked with
    `in_range` (the stretches may be wider)."""
    if key_format not in _INT_FORMATS:
        start = low
        if after is not None and (start is None or after + b"\x00" > start):
            start = after + b"\x00"
        return [(start, high)]
    width = _WIDTHS[key_format]
    lo = None if low is None else int.from_bytes(low, "big", signed=True)
    if after is not None:
        following = int.from_bytes(after, "big", signed=True) + 1
        lo = following if lo is None else max(lo, following)
    hi = None if high is None else int.from_bytes(high, "big", signed=True)
    top = 1 << (8 * width - 1)

    def encoded(n: int) -> bytes:
        return n.to_bytes(width, "big", signed=True)

    segments: list[tuple[bytes | None, bytes | None]] = []
    first = -top if lo is None else lo
    if first < 0 and (hi is None or hi > first):
        # Negatives are the bytes 0x80.. to 0xff..: [first, min(hi, 0)).
        segments.append((encoded(first), None if hi is None or hi >= 0 else encoded(hi)))
    first = max(first, 0)
    if hi is None or hi > first:
        # Non-negatives are the bytes 0x00.. to 0x7f..: [first, hi), before the first negative at most.
        segments.append((encoded(first), b"\x80" if hi is None else encoded(hi)))
    return segments


# The longest serialized key (value layout) and escaped key (timeline layout) stored under its own bytes.
_VALUE_KEY_BYTES = 510
_TIMELINE_KEY_BYTES = 496
_END_OF_KEYS = bytes([TAG_KEY[0] + 1])  # every `=` LMDB key sorts before it


def _lower(data: bytes | None, timeline: bool) -> bytes:
    """An LMDB key at or below every stored key whose serialized form is >= `data`."""
    if data is None:
        return TAG_KEY
    if timeline:
        return TAG_KEY + escape_key(data)[:_TIMELINE_KEY_BYTES]
    return TAG_KEY + data[:_VALUE_KEY_BYTES]


def _upper(data: bytes | None, timeline: bool) -> bytes:
    """An LMDB key above every stored key whose serialized form is < `data` (perhaps above more: the scan
    checks each key)."""
    if data is None:
        return _END_OF_KEYS
    form = escape_key(data) if timeline else data
    most = _TIMELINE_KEY_BYTES if timeline else _VALUE_KEY_BYTES
    if len(form) <= most:
        return TAG_KEY + form
    end = prefix_end(form[:most])
    return _END_OF_KEYS if end is None else TAG_KEY + end


def scan_partition(
    held: Any,
    key_format: KeyFormat,
    start: bytes | None,
    end: bytes | None,
    low: bytes | None,
    high: bytes | None,
    after: bytes | None,
    limit: int,
    found: list[tuple[bytes, bytes]],
) -> None:
    """Append to `found` (up to `limit` in all) the keys of one partition (`held`, a loaded partition:
    keyroute.replica.store.PartitionStore) in the segment [start, end) (`scan_segments`) that are in the
    range, in order: (serialized key, value)."""
    timeline = held.timeline is not None
    position, stop = _lower(start, timeline), _upper(end, timeline)
    resume = None
    while len(found) < limit:
        items, more, resume = held.key_range(position, stop, limit - len(found), resume)
        for data, value in items:
            if in_range(key_format, data, low, high, after):
                found.append((data, value))
            elif high is not None and order_of(key_format, data) >= order_of(key_format, high):  # type: ignore[operator]
                return  # keys only grow from here
        if not more:
            return


def range_entry(key_text: str, value: bytes, partition: int | None = None) -> bytes:
    """One key of a range, around its stored value bytes: {"key", "value"} in a node's reply, {"key",
    "partition", "value"} in the router's answer."""
    head: dict[str, Any] = {"key": key_text}
    if partition is not None:
        head["partition"] = partition
    encoded = json.dumps(head, ensure_ascii=False).encode("utf-8")
    return encoded[:-1] + b', "value": ' + value + b"}"


# -- cursors ---------------------------------------------------------------------------------------------

_RANGE_CURSOR = 2  # distinct from timeline cursors (keyroute.storage.timeline.CURSOR_VERSION)
_CONTEXT = b"keyroute-range-cursor"


def make_range_cursor(secret: bytes, query: tuple[Any, ...], versions: list[int], after: bytes) -> str:
    """An opaque cursor continuing the range read `query` after the serialized key `after`, at the
    partitions' `versions` (one number when they are all the same), sealed as timeline cursors are."""
    pinned: int | list[int] = versions[0] if len(set(versions)) == 1 else versions
    return seal(_CONTEXT, secret, [_RANGE_CURSOR, pinned, after.hex()], query)


class RangeCursorError(RangeQueryError):
    """A cursor that is malformed, altered, or given with another range than the one it continues."""


def read_range_cursor(secret: bytes, query: tuple[Any, ...], text: str, partitions: int) -> tuple[list[int], bytes]:
    """(versions per partition, the key after which to continue) of a cursor `make_range_cursor` made for
    this `query`; RangeCursorError otherwise."""
    try:
        body = unseal(_CONTEXT, secret, query, text, 16_384)
    except CursorError as exc:
        raise RangeCursorError(str(exc)) from None
    malformed = RangeCursorError("cursor is malformed (not one this API returned)")
    if len(body) != 3 or body[0] != _RANGE_CURSOR or not isinstance(body[2], str):
        raise malformed
    try:
        after = bytes.fromhex(body[2])
    except ValueError:
        raise malformed from None
    pinned = body[1]
    versions = [pinned] * partitions if type(pinned) is int else pinned
    if not (
        isinstance(versions, list) and len(versions) == partitions and all(type(v) is int and v > 0 for v in versions)
    ):
        raise malformed
    return versions, after
