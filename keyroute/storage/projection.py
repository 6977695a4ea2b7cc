"""Projections: `fields=a,b.c` on a read answers only those fields of each value, computed where the value is
read (the node), so fewer bytes cross the wire.

A field is a value column's name (`a`), or a path into a nested value (`b.c`: field `c` of the struct in column
`b`). The first name of every path must be one of the store's columns (`known`: its record's value columns,
and a history store's order_by column); deeper names are looked up in each value and a path a value does not
have is left out of its projection (a nested field is not described by the store's record). A path covered by
a shorter one given too (`b` and `b.c`) is the shorter one's. The projection of a value keeps the order the
fields were given in.

Projections apply to a value (get, batch-get, range reads), a history row, and a window's `value` (windows).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Final
from urllib.parse import quote, unquote

import orjson

from keyroute.api import ApiError, BadRequest
from keyroute.storage.live import loads_json
from keyroute.storage.timeline import StoreKind

# The query parameter that asks for a projection.
FIELDS = "fields"
_FIELDS_PREFIX = b"fields="
# Bounds on what one read may ask: a projection is a short list of names, never a document.
MAX_FIELDS = 100
MAX_DEPTH = 8
# Projections parsed from queries, by `fields=` and its value as they came (percent-encoded): a read parses its
# projection once, not per read. Bounded (emptied when full): callers choose what they ask.
_PARSED: Final[dict[bytes, Projection]] = {}
_PARSED_MAX: Final = 256
# Records a projection was checked against, per projection (emptied when full).
_CHECKED_MAX: Final = 64
# orjson reads an integer beyond 64 bits as a float of at least this size.
_BIG: Final = 2.0**63


class UnknownFields(ApiError, status=400, code="unknown_fields"):
    """A projection naming fields the store's values do not have."""


class Projection:
    """The fields a read answers: `paths` (each a tuple of names, outermost first), and `text`, the
    projection as given (canonical: what is passed on to another node). Immutable, and shared by the reads
    that ask for the same fields (`fields_of_query`); two are equal when their paths are."""

    __slots__ = ("paths", "text", "_names", "_checked")

    def __init__(self, paths: tuple[tuple[str, ...], ...], text: str) -> None:
        self.paths = paths
        self.text = text
        # Every path one name (the common projection): the names, copied from a value without walking paths.
        self._names: tuple[str, ...] | None = tuple(p[0] for p in paths) if all(len(p) == 1 for p in paths) else None
        # store name -> the record (keyroute.cluster.partition_map.StoreRecord) whose fields were last found to
        # hold these: a read of that store checks its record by identity, not its columns again.
        self._checked: dict[str, Any] = {}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Projection) and other.paths == self.paths

    def __hash__(self) -> int:
        return hash(self.paths)

    def __repr__(self) -> str:
        return f"Projection({self.text!r})"

    def check(self, store: str, known: Iterable[str]) -> None:
        """Raises UnknownFields naming the paths whose first name is not among `known` (the store's columns);
        nothing is checked when the store's record names no columns (a record from before they were kept)."""
        columns = set(known)
        if not columns:
            return
        unknown = [".".join(p) for p in self.paths if p[0] not in columns]
        if unknown:
            raise UnknownFields(
                f"store {store!r} has no field {', '.join(map(repr, unknown))}"
                f" (its fields: {', '.join(sorted(columns))})"
            )

    def check_record(self, store: str, record: Any) -> None:
        """`check` against a store record's (keyroute.cluster.partition_map.StoreRecord) fields: its value
        columns, and a history store's time column (a windowed store's projection applies to its windows'
        values). Checked once per record: the next read of the same record is one look-up."""
        checked = self._checked
        if checked.get(store) is record:
            return
        columns: tuple[str, ...] = tuple(record.value_columns)
        timeline = record.timeline
        if timeline is not None and timeline.kind is StoreKind.HISTORY and columns:
            columns = (*columns, timeline.column)
        self.check(store, columns)
        if len(checked) >= _CHECKED_MAX:
            checked.clear()
        checked[store] = record

    def query(self) -> str:
        """The query string (with its '?') that asks another node for this projection."""
        return "?fields=" + quote(self.text, safe=",.")

    def apply_all(self, values: list[bytes], windows: bool = False) -> list[bytes]:
        """The projections of a timeline's entries: history rows, or (`windows`) window entries."""
        if windows:
            return [self.apply_window(v) for v in values]
        return [self.apply(v) for v in values]

    def project(self, value: Any) -> Any:
        """The projection of one decoded value (an object; anything else is answered as it is)."""
        if not isinstance(value, dict):
            return value
        names = self._names
        if names is not None:
            return {name: value[name] for name in names if name in value}
        out: dict[str, Any] = {}
        for path in self.paths:
            _copy(value, out, path)
        return out

    def apply(self, value_json: bytes) -> bytes:
        """The projection of one stored value's JSON, as compact JSON. Parsed by orjson (the stored value
        whole: it has no partial parse), which reads an integer beyond 64 bits as a float: a projection that
        kept a float that large is made again from the standard library's exact parse."""
        try:
            value = orjson.loads(value_json)
        except orjson.JSONDecodeError:
            return _dumps(self.project(_loads(value_json)))
        names = self._names
        if names is None or type(value) is not dict:
            projected = self.project(value)
            big = _has_big_float(projected)
        else:  # `project`'s top-level names, looking at each value kept as it is copied
            projected = {}
            big = False
            for name in names:
                if name in value:
                    kept = projected[name] = value[name]
                    kind = type(kept)
                    if kind is float:
                        big = big or kept >= _BIG or kept <= -_BIG
                    elif kind is dict or kind is list:
                        big = big or _has_big_float(kept)
        if big:
            projected = self.project(_loads_exact(value_json))
        return _dumps(projected)

    def apply_window(self, window_json: bytes) -> bytes:
        """The projection of a window entry `{"start", "end", "value"}`: its `value` projected."""
        try:
            window = orjson.loads(window_json)
        except orjson.JSONDecodeError:
            window = _loads(window_json)
        else:
            if _has_big_float(window):  # as in `apply`: an integer orjson may have read as a float
                window = _loads_exact(window_json)
        if isinstance(window, dict) and "value" in window:
            window["value"] = self.project(window["value"])
        return _dumps(window)


def _copy(source: dict[str, Any], target: dict[str, Any], path: tuple[str, ...]) -> None:
    """Copy the field at `path` of `source` into `target` (making the nested objects on the way); nothing
    when `source` lacks it."""
    name = path[0]
    if name not in source:
        return
    value = source[name]
    if len(path) == 1:
        target[name] = value
        return
    if not isinstance(value, dict):
        return
    inner = target.get(name)
    if not isinstance(inner, dict):
        inner = {}
    before = len(inner)
    _copy(value, inner, path[1:])
    if len(inner) > before or name in target:
        target[name] = inner


def _loads(raw: bytes) -> Any:
    try:
        return loads_json(raw)
    except ValueError:  # JSON orjson refuses (a lone surrogate's escape): the standard library reads it
        return json.loads(raw)


def _loads_exact(raw: bytes) -> Any:
    """JSON text with every integer exact (the standard library's parse)."""
    return json.loads(raw)


def _has_big_float(value: Any) -> bool:
    """Whether `value` holds a float of 2**63 or more (either sign): where orjson may have read an integer
    beyond 64 bits. Walks only what a projection kept."""
    kind = type(value)
    if kind is float:
        return value >= _BIG or value <= -_BIG
    if kind is dict:
        for inner in value.values():
            if _has_big_float(inner):
                return True
    elif kind is list:
        for inner in value:
            if _has_big_float(inner):
                return True
    return False


def _dumps(obj: Any) -> bytes:
    try:
        return orjson.dumps(obj)
    except orjson.JSONEncodeError:  # an integer beyond 64 bits, or a lone surrogate: exact, slower
        try:
            return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (valid in JSON text, not in UTF-8)
            return json.dumps(obj, separators=(",", ":")).encode("ascii")


def parse_fields(text: str) -> Projection:
    """The projection `text` asks for (`a,b.c`). Raises BadRequest for an empty one, an empty name, too many
    fields or too deep a path."""
    if not text:
        raise BadRequest("fields: name at least one field (fields=a,b.c)")
    given = text.split(",")
    if len(given) > MAX_FIELDS:
        raise BadRequest(f"fields: at most {MAX_FIELDS} fields, got {len(given)}")
    paths: list[tuple[str, ...]] = []
    for item in given:
        path = tuple(item.strip().split("."))
        if any(not name for name in path):
            raise BadRequest(f"fields: {item[:60]!r} is not a field name (names joined by '.')")
        if len(path) > MAX_DEPTH:
            raise BadRequest(f"fields: {item[:60]!r} is deeper than {MAX_DEPTH} levels")
        paths.append(path)
    # A path under another one given is that one's: drop it (and exact repeats).
    kept = [p for p in paths if not any(q != p and p[: len(q)] == q for q in paths)]
    unique = tuple(dict.fromkeys(kept))
    return Projection(unique, ",".join(".".join(p) for p in unique))


def fields_of_query(raw_query: bytes) -> Projection | None:
    """The projection a raw query string (without '?', percent-encoded) asks for with `fields=`, or None.
    Other parameters are ignored (each read checks its own). Raises BadRequest for a malformed or repeated
    one. The same `fields=` value gives the same (shared) Projection, parsed once."""
    parsed = _PARSED.get(raw_query)  # a query that is the projection alone, seen before: one look-up
    if parsed is not None:
        return parsed
    if not raw_query or _FIELDS_PREFIX not in raw_query:
        return None
    found: bytes | None = None
    if raw_query.startswith(_FIELDS_PREFIX) and b"&" not in raw_query:
        found = raw_query[len(_FIELDS_PREFIX) :]  # the query is the projection alone
    else:
        for pair in raw_query.split(b"&"):
            name, _, value = pair.partition(b"=")
            if name != b"fields":
                continue
            if found is not None:
                raise BadRequest("fields is given more than once")
            found = value
        if found is None:
            return None
    parsed = _PARSED.get(_FIELDS_PREFIX + found)
    if parsed is not None:
        return parsed
    try:
        text = unquote(found.decode("ascii").replace("+", " "), errors="strict")
    except (UnicodeDecodeError, ValueError):
        raise BadRequest("fields: not valid percent-encoded UTF-8") from None
    parsed = parse_fields(text)
    if len(_PARSED) >= _PARSED_MAX:
        _PARSED.clear()
    _PARSED[_FIELDS_PREFIX + found] = parsed
    return parsed


def json_projection(raw_query: bytes, media: bytes | None) -> Projection | None:
    """`fields_of_query` of a read answered in JSON (`media` None); a projection asked with an Avro answer is
    400 (an Avro answer's schema is the store's whole value)."""
    fields = fields_of_query(raw_query)
    if fields is not None and media is not None:
        raise BadRequest("fields: a projection is answered as JSON only (ask with Accept: application/json)")
    return fields
