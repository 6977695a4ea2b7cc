"""Reads of several stores at once: one key's values in many stores, or many keys x stores. What routers and
nodes share of them: the stores a path names, the options a query gives, the request body, the answers.

    GET  /stores/{stores}/read/{key}    `{stores}`: store names joined by ',' (`profile,balance,bookings`),
                                        each at most once, at most MAX_STORES
         ?min_offset=a:N,b:M            a freshness bound per live store (as a get's `min_offset`)
         ?fields=x,y                    a projection of every store's values (each store must have them)
         ?fields.{store}=x,y            a projection of one store's values (instead of `fields` for it)
    answer  {"key": K, "stores": {"a": ENTRY, "b": ENTRY, ...}}      the stores in the order the path names them

    POST /stores/{stores}/read          (the query takes the `fields` parameters above)
         {"keys": [K, ...]}                        every store of the path reads every key
         {"keys": {"a": [K, ...], "b": [...]}}     each store its own keys (stores of the path only)
         optional "min_offset": {"a": N, ...}      a bound per live store
    answer  {"results": [{"key": K, "stores": {...}}, ...]}    one per key of a list, in its order; one per
                                                                distinct key of the object form, in the order
                                                                first named, with the stores that read it

    ENTRY   a batch-get entry: {"key", "status": 200, "partition", "version", "node", "value"}
            | {"key", "status", "error", "message"}; a live store's also carries "offset"

A store's entry has the status and error a single read of it would get (404 key_not_found, expired,
store_not_found, 503 partition_unavailable or not_up_to_bound, 400 unknown_fields, ...): one store's failure
is its entry, never the request's. What is wrong with the request itself (a malformed path, query or body) is
the request's 400.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from json.encoder import encode_basestring
from typing import Any
from urllib.parse import quote, unquote

from keyroute.api import (
    HEADER_NODE,
    HEADER_OFFSET,
    ApiError,
    BadRequest,
    PayloadTooLarge,
    loads_json,
    offset_value,
    parse_min_offset,
)
from keyroute.http.forwarding import encode_entry, error_entry, path_segment
from keyroute.storage.projection import FIELDS, Projection, parse_fields

# The most stores one read may name: a page's few stores, never a scan of the cluster.
MAX_STORES = 16
# The path segment after the stores: /stores/{stores}/read and /stores/{stores}/read/{key}.
READ = "read"
_PER_STORE_FIELDS = FIELDS + "."
_NODE = HEADER_NODE.encode("ascii")
# A JSON string as `json.dumps(text, ensure_ascii=False)` writes it, without an encoder per call.
_json_string = encode_basestring
_OFFSET = HEADER_OFFSET.encode("ascii")


def parse_stores(text: str) -> tuple[str, ...]:
    """The stores a path's `{stores}` segment names (decoded), in order. Raises BadRequest for an empty name,
    one named twice, or more than MAX_STORES (a store name never holds ',': keyroute.pipeline.spec)."""
    stores = tuple(text.split(","))
    if any(not name for name in stores):
        raise BadRequest(f"stores: {text[:80]!r} is not a list of store names joined by ','")
    if len(stores) > MAX_STORES:
        raise BadRequest(f"stores: at most {MAX_STORES} stores in one read, got {len(stores)}")
    if len(set(stores)) != len(stores):
        twice = sorted({name for name in stores if stores.count(name) > 1})
        raise BadRequest(f"stores: {', '.join(map(repr, twice))} named more than once")
    return stores


def stores_segment(stores: Iterable[str]) -> str:
    """The path segment that names `stores` (each percent-encoded as a path segment, joined by ',')."""
    return ",".join(path_segment(name) for name in stores)


@dataclass(frozen=True, slots=True)
class ReadOptions:
    """What a multi-store read's query asks: per store its `min_offset` and its projection."""

    min_offsets: Mapping[str, int] = field(default_factory=dict)
    fields: Mapping[str, Projection] = field(default_factory=dict)

    def query(self, stores: Iterable[str] | None = None, bounds: bool = True) -> str:
        """The query string (with its '?', or "") that asks another member for these options, of `stores`
        only when given; `bounds`: with the min_offsets (a GET's; a POST carries them in its body)."""
        wanted = None if stores is None else set(stores)
        parts = []
        if bounds:
            offsets = [f"{quote(s, safe='')}:{n}" for s, n in self.min_offsets.items() if wanted is None or s in wanted]
            if offsets:
                parts.append("min_offset=" + ",".join(offsets))
        for store, projection in self.fields.items():
            if wanted is None or store in wanted:
                parts.append(f"{_PER_STORE_FIELDS}{quote(store, safe='')}={quote(projection.text, safe=',.')}")
        return "?" + "&".join(parts) if parts else ""


_NO_OPTIONS = ReadOptions()


def parse_options(raw_query: bytes, stores: Sequence[str], bounds: bool = True) -> ReadOptions:
    """The options of a multi-store read's raw query string (`bounds`: `min_offset` is taken, a GET's).
    Raises BadRequest for an unknown or repeated parameter, a store it names that the read does not, or a
    malformed bound or projection."""
    if not raw_query:
        return _NO_OPTIONS
    min_offsets: dict[str, int] = {}
    every: Projection | None = None
    fields: dict[str, Projection] = {}
    seen: set[str] = set()
    for pair in raw_query.split(b"&"):
        if not pair:
            continue
        raw_name, _, raw_value = pair.partition(b"=")
        name, value = _unquote(raw_name), _unquote(raw_value)
        if name in seen:
            raise BadRequest(f"query parameter {name[:60]!r} is given twice")
        seen.add(name)
        if name == "min_offset" and bounds:
            for item in value.split(","):
                store, colon, offset = item.rpartition(":")
                if not colon or not store:
                    raise BadRequest(f"min_offset: {item[:60]!r} is not store:offset (min_offset=a:5,b:7)")
                _named(store, stores, "min_offset")
                if store in min_offsets:
                    raise BadRequest(f"min_offset: store {store!r} is given twice")
                min_offsets[store] = parse_min_offset(offset)
        elif name == FIELDS:
            every = parse_fields(value)
        elif name.startswith(_PER_STORE_FIELDS):
            store = name[len(_PER_STORE_FIELDS) :]
            _named(store, stores, name)
            fields[store] = parse_fields(value)
        else:
            allowed = "min_offset, fields, fields.{store}" if bounds else "fields, fields.{store}"
            raise BadRequest(f"unknown query parameter {name[:60]!r} (expected some of: {allowed})")
    if every is not None:
        for store in stores:
            fields.setdefault(store, every)
    return ReadOptions(min_offsets, fields)


def _unquote(raw: bytes) -> str:
    try:
        return unquote(raw.decode("ascii").replace("+", " "), errors="strict")
    except (UnicodeDecodeError, ValueError):
        raise BadRequest("the query string is malformed (not percent-encoded UTF-8)") from None


def _named(store: str, stores: Sequence[str], what: str) -> None:
    if store not in stores:
        raise BadRequest(f"{what[:60]}: store {store[:60]!r} is not one of the stores read ({', '.join(stores)})")


# -- the batch form ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    """One result of a batch: a key (as the body gave it) and, per store that reads it, its index in that
    store's key list."""

    key: Any
    at: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class ReadRequest:
    """A multi-store batch: each store's keys (in order, as JSON gave them), the rows of the answer, the
    bounds per store."""

    keys: Mapping[str, list[Any]]
    rows: list[Row]
    min_offsets: Mapping[str, int]

    @property
    def size(self) -> int:
        """Reads of a key in a store the batch makes (what its quota and its limit count)."""
        return sum(len(keys) for keys in self.keys.values())


def parse_read_request(body: bytes, stores: Sequence[str], max_reads: int) -> ReadRequest:
    """A multi-store batch's body (see the module docstring). Raises BadRequest when it is not such a body
    (keys that are neither strings nor integers included), PayloadTooLarge past `max_reads` reads of a key
    in a store (0: no limit)."""
    try:
        obj = loads_json(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(f"the body is not valid JSON ({exc})") from exc
    if not isinstance(obj, dict) or not isinstance(obj.get("keys"), (list, dict)):
        raise BadRequest('expected a JSON object {"keys": [...]} or {"keys": {"store": [...], ...}}')
    unknown = sorted(set(obj) - {"keys", "min_offset"})
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(map(repr, unknown))} in the body (expected keys, min_offset)")
    given = obj["keys"]
    keys: dict[str, list[Any]] = {}
    rows: list[Row] = []
    if isinstance(given, list):
        _check_keys(given, "keys")
        keys = {store: given for store in stores}
        rows = [Row(key, tuple((store, i) for store in stores)) for i, key in enumerate(given)]
    else:
        by_key: dict[str, list[tuple[str, int]]] = {}
        first: dict[str, Any] = {}
        for store, store_keys in given.items():
            _named(store, stores, "keys")
            if not isinstance(store_keys, list):
                raise BadRequest(f"keys[{store!r}] must be a list of keys")
            _check_keys(store_keys, f"keys[{store!r}]")
            keys[store] = store_keys
            for i, key in enumerate(store_keys):
                identity = json.dumps(key)
                first.setdefault(identity, key)
                by_key.setdefault(identity, []).append((store, i))
        rows = [Row(first[identity], tuple(at)) for identity, at in by_key.items()]
    request = ReadRequest(keys, rows, _body_bounds(obj.get("min_offset"), stores))
    if max_reads and request.size > max_reads:
        raise PayloadTooLarge(f"{request.size} reads of a key in a store in one batch; at most {max_reads} are allowed")
    return request


def _check_keys(keys: list[Any], what: str) -> None:
    for key in keys:
        if not isinstance(key, str) and not (isinstance(key, int) and not isinstance(key, bool)):
            shown = json.dumps(key)[:40]
            raise BadRequest(f"{what}: a key is a JSON string or integer, not {shown}")


def _body_bounds(given: Any, stores: Sequence[str]) -> dict[str, int]:
    if given is None:
        return {}
    if not isinstance(given, dict):
        raise BadRequest('min_offset must be a JSON object {"store": offset, ...}')
    bounds = {}
    for store, value in given.items():
        _named(store, stores, "min_offset")
        bounds[store] = offset_value(value, f"min_offset[{store}]")
    return bounds


def read_body(keys: Mapping[str, Sequence[str]], min_offsets: Mapping[str, int] | None = None) -> bytes:
    """The body of a multi-store batch asking each store of `keys` for its keys (object form)."""
    obj: dict[str, Any] = {"keys": {store: list(texts) for store, texts in keys.items()}}
    if min_offsets:
        obj["min_offset"] = dict(min_offsets)
    return encode_entry(obj)


# -- answers ----------------------------------------------------------------------------------------------


def json_text(text: str) -> bytes:
    """A JSON string (a key, a store name), as `encode_entry` writes strings (a lone surrogate escaped)."""
    try:
        return _json_string(text).encode("utf-8")
    except UnicodeEncodeError:
        return encode_entry({"": text})[4:-1]


def key_answer(key: str, entries: Iterable[tuple[str, bytes]]) -> bytes:
    """`{"key": K, "stores": {...}}` around entries already encoded, in the order given."""
    return b'{"key":%s,"stores":{%s}}' % (
        json_text(key),
        b",".join(b"%s:%s" % (json_text(store), entry) for store, entry in entries),
    )


def results_answer(rows: Iterable[bytes]) -> bytes:
    """`{"results": [...]}` around rows made by `key_answer`."""
    return b'{"results":[' + b",".join(rows) + b"]}"


def error_entry_bytes(key: Any, error: ApiError, offset: int | None = None) -> bytes:
    """The entry of a store read that failed with `error`; a live store's offset when given, or when the
    error says it (503 not_up_to_bound's X-Keyroute-Offset)."""
    entry = error_entry(key, error)
    said = error.headers.get(HEADER_OFFSET)
    if offset is None and said is not None and said.lstrip("-").isdigit():
        offset = int(said)
    if offset is not None:
        entry["offset"] = offset
    return encode_entry(entry)


def entry_of_answer(key: str, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> dict[str, Any]:
    """The entry of one store read as a single-key read answers it (`status`, `headers`, the JSON `body`):
    the node that read it and a live store's offset come from the headers."""
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    node = offset = None
    for name, value in headers:
        if name == _NODE:
            node = value.decode("latin-1")
        elif name == _OFFSET:
            try:
                offset = int(value)
            except ValueError:
                offset = None
    if not isinstance(obj, dict):
        return {"key": key, "status": 502, "error": "bad_gateway", "message": "a node answered a malformed body"}
    if status == 200:
        entry: dict[str, Any] = {
            "key": obj.get("key", key),
            "status": 200,
            "partition": obj.get("partition"),
            "version": obj.get("version"),
        }
    else:
        entry = {"key": key, "status": status, "error": obj.get("error"), "message": obj.get("message")}
    if offset is not None:
        entry["offset"] = offset
    if node is not None:
        entry["node"] = node
    if status == 200:
        entry["value"] = obj.get("value")
    return entry
