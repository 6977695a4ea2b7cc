"""A node's multi-store reads (keyroute.http.multi_store: the wire format): one key's values in several
stores, or many keys x stores, in one request.

    GET  /stores/{stores}/read/{key}   each store read as `reads.read_key` reads it: from this node's copy
                                       when it holds the key's partition of that store, else passed on once
                                       (`reads.forward_read`), all stores passed on at the same time
    POST /stores/{stores}/read         each store's keys read as `reads.read_batch` reads a batch-get's, the
                                       keys held elsewhere sent on (one request per node and store)

Co-located stores (keyroute.cluster.colocation) have partition p of each on the same replicas, so a node
serving one serves all: the read is answered here, X-Keyroute-Hops 0. Every store named is one the caller
may read (keyroute.http.authn checks each), and with quotas each store's reads are admitted as a get's
(or a batch's) of that store.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Final

from keyroute.api import HEADER_GENERATION, HEADER_HOPS, HEADER_OFFSET, ApiError
from keyroute.http import openapi
from keyroute.http.dataplane import JSON, Call, Route
from keyroute.http.forwarding import OffsetBounds, encode_entry, error_entry, path_segment
from keyroute.http.multi_store import (
    READ,
    ReadOptions,
    entry_of_answer,
    error_entry_bytes,
    json_text,
    key_answer,
    parse_options,
    parse_read_request,
    parse_stores,
    results_answer,
)
from keyroute.keys.key_location import StoreLocator
from keyroute.keys.partitioner import murmur2_bits
from keyroute.runtime.metrics import KIND_BATCH, KIND_KEY
from keyroute.state_node.reads import Batch, Behind, Forward, forward_read, read_batch, read_key

if TYPE_CHECKING:
    from keyroute.state_node.dataplane import NodeDataPlane

_HOPS = HEADER_HOPS.encode("ascii")
_HOPS_0 = (_HOPS, b"0")
_HOPS_1 = (_HOPS, b"1")
_OFFSET = HEADER_OFFSET.encode("ascii")
_GENERATION = HEADER_GENERATION.encode("ascii")
# C statics in the compiled build (setup.py), not globals looked up per read.
_murmur2_bits: Final = murmur2_bits
_json_text: Final = json_text
# The most distinct `{stores}` segments kept worked out per partition map (`_Plans`): a client naming ever new
# lists of stores costs a bounded amount of memory.
_MAX_PLANS: Final = 256
_NO_OPTIONS: Final = ReadOptions()


def _found(store: str, key: str, partition: int, version: int, value: bytes) -> bytes:
    """The tail of a value read here as its store's entry (`_entry_here` writes its head: the node, a live
    store's offset, the key)."""
    return b'"status":200,"partition":%d,"version":%d,"value":%s}' % (partition, version, value)


# Each node's `{"node":"<id>",` (an entry's head), made once.
_NODE_HEADS: dict[bytes, bytes] = {}


def _entry_here(
    key: str, key_json: bytes, answer: tuple[int, list[tuple[bytes, bytes]], bytes], node_id: bytes
) -> bytes:
    """The entry of a store read here (`read_key`'s answer, a 200 made by `_found`)."""
    status, headers, body = answer
    if status != 200:
        return encode_entry(entry_of_answer(key, status, headers, body))
    head = _NODE_HEADS.get(node_id)
    if head is None:
        head = _NODE_HEADS[node_id] = b'{"node":%s,' % json_text(node_id.decode("latin-1"))
    for name, value in headers:
        if name == _OFFSET:  # a live store's (after the node's own headers)
            return b'%s"offset":%s,"key":%s,%s' % (head, value, key_json, body)
    return b'%s"key":%s,%s' % (head, key_json, body)


# -- one key in many stores: what is worked out once per partition map ----------------------------------


class _Plan:
    """A `{stores}` segment worked out once per partition map: its stores (checked, in order), each one's
    `"name":` as the answer writes it, and each one's locator when a read of it can be answered here the way
    `_held_entry` answers (a store of string keys hashed with murmur2 and no time to live; None: read as
    `read_key` reads)."""

    __slots__ = ("stores", "names", "locators")

    def __init__(self, m: Any, stores: tuple[str, ...]) -> None:
        self.stores = stores
        self.names = [_json_text(store) + b":" for store in stores]
        locators: list[StoreLocator | None] = []
        for store in stores:
            record = m.stores.get(store)
            locator = None
            if record is not None and record.ttl is None:
                locator = StoreLocator.of_map(m, store)
                if locator is not None and not locator.plain:
                    locator = None
            locators.append(locator)
        self.locators = locators


class _Plans:
    """The plans of one partition map (by `{stores}` segment), its generation as a header's value, and this
    node's entry head `{"node":"<id>",`: replaced whole when a read finds the map changed."""

    __slots__ = ("map", "plans", "generation", "head")

    def __init__(self, m: Any, node_id: bytes) -> None:
        self.map = m
        self.plans: dict[str, _Plan] = {}
        self.generation = (_GENERATION, b"%d" % m.generation)
        self.head = b'{"node":%s,' % json_text(node_id.decode("latin-1"))

    def plan(self, stores_text: str) -> _Plan:
        """The plan of a path's `{stores}` (raises BadRequest as `parse_stores` does)."""
        plan = self.plans.get(stores_text)
        if plan is None:
            plan = _Plan(self.map, parse_stores(stores_text))
            if len(self.plans) >= _MAX_PLANS:
                self.plans.clear()
            self.plans[stores_text] = plan
        return plan


class _Current:
    """The `_Plans` of the partition map the last multi-store read was made with."""

    __slots__ = ("plans",)

    def __init__(self) -> None:
        self.plans: _Plans | None = None


_CURRENT: Final = _Current()


def _held_entry(
    node: Any,
    store: str,
    locator: StoreLocator,
    data: bytes,
    key_json: bytes,
    head: bytes,
    node_id: str,
    forwarded: bool,
) -> bytes | None:
    """The entry of a value of `store` this node holds and answers itself, as `read_key` (with `_found`) and
    `_entry_here` make it: one format of the stored bytes, no headers, no answer parsed back. None (and nothing
    counted) when it is not that plain case: a partition not held here or served newer elsewhere, or a key not
    found; `read_key` then says what it is."""
    partition = (_murmur2_bits(data) & 0x7FFFFFFF) % locator.partitions
    held = node.ownership.local(store, partition)
    if held is None:
        return None
    if not forwarded:
        # reads.answers_locally: unless the first other node serving the partition serves a newer version
        for endpoint in locator.serving[partition]:
            if endpoint.node_id != node_id:
                if held.version < endpoint.version:
                    return None
                break
    live = held.live
    offset = -1 if live is None else live.offset  # before the value: the value reflects at least this offset
    value = held.get(data)
    if value is None:
        return None
    node.metrics.local_answers += 1
    if live is None:
        return b'%s"key":%s,"status":200,"partition":%d,"version":%d,"value":%s}' % (
            head,
            key_json,
            partition,
            held.version,
            value,
        )
    return b'%s"offset":%d,"key":%s,"status":200,"partition":%d,"version":%d,"value":%s}' % (
        head,
        offset,
        key_json,
        partition,
        held.version,
        value,
    )


def _read_stores(plane: NodeDataPlane, call: Call, stores_text: str, key: str) -> Any:
    request = call.request
    if request.query:
        return _read_stores_options(plane, call, stores_text, key)
    node = plane.node
    m = node.ownership.map
    plans = _CURRENT.plans
    if plans is None or plans.map is not m:
        plans = _CURRENT.plans = _Plans(m, node.node_header[1])
    plan = plans.plan(stores_text)
    stores = plan.stores
    if plane.quotas.active:
        for store in stores:
            plane._admit(call, store, 1)
    forwarded = False if request.header(_HOPS) is None else plane._forwarded(call)
    try:
        data: bytes | None = key.encode("utf-8")
    except UnicodeEncodeError:
        data = None  # read_key says why
    key_json = _json_text(key)
    head = plans.head
    node_id = node.settings.node_id
    count = plane.count
    parts: list[bytes] = [b'{"key":', key_json, b',"stores":{']
    waiting: list[tuple[str, Forward | Behind]] = []
    entries: dict[str, bytes] = {}
    locators = plan.locators
    names = plan.names
    for i in range(len(stores)):
        store = stores[i]
        locator = locators[i]
        entry = None
        if locator is not None and data is not None:
            entry = _held_entry(node, store, locator, data, key_json, head, node_id, forwarded)
        if entry is not None:
            count(store, KIND_KEY, 200)
        else:
            try:
                answer = read_key(node, store, key, forwarded, None, found=_found)
            except ApiError as exc:
                count(store, KIND_KEY, exc.status)
                entry = error_entry_bytes(key, exc)
            else:
                if type(answer) is tuple:
                    count(store, KIND_KEY, answer[0])
                    entry = _entry_here(key, key_json, answer, node.node_header[1])  # type: ignore[arg-type]
                else:
                    waiting.append((store, answer))  # type: ignore[arg-type]
                    continue
        entries[store] = entry
        if i:
            parts.append(b",")
        parts.append(names[i])
        parts.append(entry)
    if waiting:
        return _finish_key(plane, call, key, stores, entries, waiting, forwarded, _NO_OPTIONS)
    parts.append(b"}}")
    headers = [*JSON, node.node_header, _HOPS_1 if forwarded else _HOPS_0, plans.generation]
    call.answer(200, headers, b"".join(parts))
    return None


def _read_stores_options(plane: NodeDataPlane, call: Call, stores_text: str, key: str) -> Any:
    """A read of one key in many stores with a query (`min_offset`, `fields`): each store read by `read_key`."""
    request = call.request
    stores = parse_stores(stores_text)
    options = parse_options(request.query, stores)
    if plane.quotas.active:
        for store in stores:
            plane._admit(call, store, 1)
    forwarded = plane._forwarded(call)
    node = plane.node
    node_id = node.node_header[1]
    key_json = json_text(key)
    min_offsets, fields = options.min_offsets, options.fields
    entries: dict[str, bytes] = {}
    waiting: list[tuple[str, Forward | Behind]] = []
    count = plane.count
    for store in stores:
        try:
            if min_offsets or fields:
                answer = read_key(
                    node, store, key, forwarded, min_offsets.get(store), found=_found, fields=fields.get(store)
                )
            else:
                answer = read_key(node, store, key, forwarded, None, found=_found)
        except ApiError as exc:
            count(store, KIND_KEY, exc.status)
            entries[store] = error_entry_bytes(key, exc)
            continue
        if type(answer) is tuple:
            count(store, KIND_KEY, answer[0])
            entries[store] = _entry_here(key, key_json, answer, node_id)  # type: ignore[arg-type]
        else:
            waiting.append((store, answer))  # type: ignore[arg-type]
    if not waiting:
        call.answer(200, _headers(plane, forwarded), key_answer(key, [(store, entries[store]) for store in stores]))
        return None
    return _finish_key(plane, call, key, stores, entries, waiting, forwarded, options)


async def _finish_key(
    plane: NodeDataPlane,
    call: Call,
    key: str,
    stores: tuple[str, ...],
    entries: dict[str, bytes],
    waiting: list[tuple[str, Forward | Behind]],
    forwarded: bool,
    options: Any,
) -> None:
    """The stores not answered at once: those held elsewhere passed on, those behind their bound waited
    for, all at the same time."""
    node = plane.node
    node_id = node.node_header[1]
    request_id = call.request.request_id
    passed_on: list[str] = []  # the stores read elsewhere (the answer then says it took a hop)

    async def one(store: str, pending: Forward | Behind) -> bytes:
        fields = options.fields.get(store)
        bound = options.min_offsets.get(store)
        try:
            if isinstance(pending, Behind):
                await pending.live.wait_reached(pending.min_offset, node.settings.min_offset_wait_ms / 1000)
                again = read_key(node, store, key, forwarded, bound, waited=True, found=_found, fields=fields)
                if type(again) is tuple:
                    return _entry_here(key, json_text(key), again, node_id)  # type: ignore[arg-type]
                pending = again  # type: ignore[assignment]  # the partition moved meanwhile
            target = f"/stores/{path_segment(store)}/keys/{path_segment(key)}"
            query = []
            if bound is not None:
                query.append(f"min_offset={bound}")
            if fields is not None:
                query.append(fields.query()[1:])
            if query:
                target += "?" + "&".join(query)
            passed_on.append(store)
            status, headers, body = await forward_read(node, target.encode("ascii"), pending, request_id)  # type: ignore[arg-type]
        except ApiError as exc:
            return error_entry_bytes(key, exc)
        return encode_entry(entry_of_answer(key, status, headers, body))

    done = await asyncio.gather(*(one(store, pending) for store, pending in waiting))
    for (store, _), entry in zip(waiting, done, strict=True):
        plane.count(store, KIND_KEY, _status(entry))
        entries[store] = entry
    hopped = forwarded or bool(passed_on)
    call.answer(200, _headers(plane, hopped), key_answer(key, [(store, entries[store]) for store in stores]))


def _status(entry: bytes) -> int:
    """An encoded entry's status (found entries write `"status": 200`, others `"status":404`)."""
    at = entry.find(b'"status":')
    if at < 0:
        return 500
    digits = entry[at + 9 : at + 14].lstrip(b" ")[:3]
    return int(digits) if digits.isdigit() else 500


def _headers(plane: NodeDataPlane, hopped: bool) -> list[tuple[bytes, bytes]]:
    node = plane.node
    return [
        *JSON,
        node.node_header,
        (_HOPS, b"1" if hopped else b"0"),
        (_GENERATION, b"%d" % node.ownership.map.generation),
    ]


# -- many keys x stores ---------------------------------------------------------------------------------


def _read_stores_batch(plane: NodeDataPlane, call: Call, stores_text: str) -> Any:
    request = call.request
    stores = parse_stores(stores_text)
    options = parse_options(request.query, stores, bounds=False)
    parsed = parse_read_request(request.body, stores, plane._max_batch_keys)
    if plane.quotas.active:
        for store, keys in parsed.keys.items():
            if keys:
                plane._admit(call, store, len(keys))
    forwarded = plane._forwarded(call)
    node = plane.node
    batches: dict[str, Batch | list[bytes]] = {}
    for store, keys in parsed.keys.items():
        bound = parsed.min_offsets.get(store)
        bounds = OffsetBounds(bound, {}) if bound is not None else None
        try:
            batches[store] = read_batch(node, store, keys, forwarded, bounds, fields=options.fields.get(store))
        except ApiError as exc:
            for _ in keys:
                plane.count(store, KIND_BATCH, exc.status)
            batches[store] = [encode_entry(error_entry(_key_shown(key), exc)) for key in keys]
    pending = [batch for batch in batches.values() if isinstance(batch, Batch) and not batch.complete]
    if not pending:
        _answer_batch(plane, call, parsed.rows, batches, forwarded)
        return None
    return _finish_batch(plane, call, parsed.rows, batches, pending, forwarded)


async def _finish_batch(
    plane: NodeDataPlane, call: Call, rows: list[Any], batches: dict[str, Any], pending: list[Batch], forwarded: bool
) -> None:
    await asyncio.gather(*(batch.finish(call.request.request_id) for batch in pending))
    _answer_batch(plane, call, rows, batches, True)


def _answer_batch(plane: NodeDataPlane, call: Call, rows: list[Any], batches: dict[str, Any], hopped: bool) -> None:
    answered = []
    for row in rows:
        entries = []
        for store, i in row.at:
            batch = batches[store]
            entry = batch.entries[i] if isinstance(batch, Batch) else batch[i]
            entries.append((store, entry or b"null"))
        answered.append(key_answer(_key_shown(row.key), entries))
    call.answer(200, _headers(plane, hopped), results_answer(answered))


def _key_shown(key: Any) -> str:
    return key if isinstance(key, str) else str(key)


# The routes, for the node's route table (keyroute.state_node.dataplane).
ROUTES = (
    Route(f"/stores/{{stores}}/{READ}/{{key}}", ("GET",), _read_stores, None, (openapi.GET_STORES,)),
    Route(f"/stores/{{stores}}/{READ}", ("POST",), _read_stores_batch, None, (openapi.READ_STORES,)),
)
