"""The node's answer to a read: from its own copy of the key's partition, or passed on once to a node that
serves it (never a second time: a forwarded read the node cannot answer itself is 503).

`read_key` is the one local answer to a single-key read; what it cannot answer here it returns as a
`Forward`, which `forward_read` sends on. `read_batch` answers a batch-get's keys the same way, key by key,
and `Batch.forward` sends the rest on, one request per serving node.

Live partitions (`PartitionStore.live` set) say in every answer which offset they reflect
(X-Keyroute-Offset, X-Keyroute-Lag; an "offset" in batch entries). A read bounded by `min_offset` that the
partition has not applied yet is a `Behind` (single key) or waits in `Batch.catch_up`: the node waits for
the applier at most `min_offset_wait_ms`, then reads again or answers 503 not_up_to_bound. The offset is
read before the value, so the value reflects at least that offset.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit

import lmdb

from keyroute.api import (
    HEADER_FORWARDED_BY,
    HEADER_GENERATION,
    HEADER_HOPS,
    HEADER_LAG,
    HEADER_OFFSET,
    HEADER_PARTITION,
    HEADER_REQUEST_ID,
    HEADER_VERSION,
    BadCursor,
    BadKey,
    BadRequest,
    BatchKeyTooLong,
    CursorExpired,
    KeyNotFound,
    NoPartitionMap,
    NotLive,
    NotUpToBound,
    PartitionUnavailable,
    StoreNotFound,
    WrongStoreKind,
    bad_batch_key,
    error_json,
    found_body,
    key_too_long,
    timeline_body,
)
from keyroute.auth.security import ClusterAuth
from keyroute.cluster.partition_map import Endpoint, PartitionMap, StoreRecord
from keyroute.http.exchange import Answer
from keyroute.http.forwarding import (
    OffsetBounds,
    batch_body,
    batch_path,
    encode_entry,
    error_entry,
    forward_batch,
    found_entry,
    parse_batch_answer,
    passthrough_headers,
    results_body,
)
from keyroute.http.upstream import UpstreamUnavailable
from keyroute.keys.key_format import Key, KeyFormat, KeyFormatError, key_from_value, parse_key
from keyroute.keys.key_location import StoreLocator
from keyroute.keys.partitioner import murmur2_bits
from keyroute.replica.store import LoadError, PartitionStore
from keyroute.runtime.logs import describe
from keyroute.runtime.metrics import KIND_BATCH
from keyroute.runtime.native import caused
from keyroute.storage.lmdb_layout import LMDB_MAX_KEY_BYTES, TAG_KEY, db_key
from keyroute.storage.projection import Projection
from keyroute.storage.timeline import (
    HISTORY,
    READ_KINDS,
    CursorError,
    QueryError,
    StoreKind,
    make_cursor,
    parse_query,
    read_cursor,
)
from keyroute.storage.ttl import Expired, Ttl, expired_message

if TYPE_CHECKING:
    from keyroute.keys.key_location import KeyLocation
    from keyroute.state_node.app import Node

log = logging.getLogger(__name__)

# Seconds a client should wait before asking again when nobody serves a partition (rebalance or reload).
RETRY_AFTER_S = 1

_JSON = (b"content-type", b"application/json")
_PARTITION = HEADER_PARTITION.encode("ascii")
_VERSION = HEADER_VERSION.encode("ascii")
_HOPS = HEADER_HOPS.encode("ascii")
_GENERATION = HEADER_GENERATION.encode("ascii")
_FORWARDED_BY = HEADER_FORWARDED_BY.encode("ascii")
_OFFSET = HEADER_OFFSET.encode("ascii")
_LAG = HEADER_LAG.encode("ascii")
_HOPS_0 = (_HOPS, b"0")
_HOPS_1 = (_HOPS, b"1")
# Not relayed besides the hop-by-hop headers: set by the node relaying the answer (the peer's values are
# replaced), and the body's content coding, which the wire (keyroute.http.fast_upstream) has removed.
_NOT_RELAYED = frozenset({_HOPS, _FORWARDED_BY, _GENERATION, b"content-encoding"})
_INT_FORMATS = frozenset({KeyFormat.INT16, KeyFormat.INT32, KeyFormat.INT64})
# C statics in the compiled build (setup.py), not globals looked up per read.
_FOUND_BODY: Final = found_body
_json_string: Final = encode_basestring
_murmur2_bits: Final = murmur2_bits
_TAG_KEY: Final = TAG_KEY
_MAX_KEY_BYTES: Final = LMDB_MAX_KEY_BYTES
# What `_MapReads.txns` holds for a partition not read yet with its map.
_UNSET: Final = object()
_get_ident: Final = threading.get_ident


def is_forwarded(members: ClusterAuth, hops: bytes | None, auth: bytes | None, role: str | None = None) -> bool:
    """Whether another node already forwarded this request, by its hop count `hops` and membership proof
    `auth` (raw header values), or with member certificates the `role` its TLS peer's certificate names.
    An unreadable hop count counts as forwarded: a request we cannot prove fresh is never forwarded again.
    With a cluster secret (or member certificates), a hop count without the proof is a client's and is
    ignored, so a client can neither stop this node from forwarding nor make it forward twice."""
    if hops is None or not members.is_member(auth, role):
        return False
    try:
        return int(hops.strip()) >= 1
    except ValueError:
        return True


def find_store(m: PartitionMap, name: str) -> StoreRecord:
    record = m.stores.get(name)
    if record is None:
        if m.stale and m.generation == 0:
            # Starting (a restart the router still sends reads to, as the node that served them last): no map
            # read yet, so "no such store" cannot be told from "not known yet".
            raise NoPartitionMap("this node has not read the partition map yet", RETRY_AFTER_S)
        raise StoreNotFound.named(name, m.stores)
    return record


def parse_key_text(record: StoreRecord, text: str) -> Key:
    try:
        return parse_key(record.key_format, text, record.key_schema)
    except KeyFormatError as exc:
        raise caused(BadKey(str(exc)), exc)  # noqa: B904 (`from exc` loses the cause when compiled)


def not_live(store_name: str) -> NotLive:
    return NotLive(f"store {store_name!r} does not follow a topic: min_offset applies to live stores only")


def not_up_to_bound(store_name: str, partition: int, offset: int, min_offset: int) -> NotUpToBound:
    return NotUpToBound(
        f"partition {partition} of store {store_name!r} has applied offset {offset}, not yet {min_offset}",
        RETRY_AFTER_S,
        offset,
    )


def answers_locally(held: PartitionStore | None, endpoints: Sequence[Endpoint], forwarded: bool) -> bool:
    """Serve from the local copy `held` unless the map routes the partition to a newer version elsewhere
    (`endpoints`, the other nodes serving it) and we may still forward: answers then never go back to an
    older version than the router would give."""
    if held is None:
        return False
    return forwarded or not endpoints or held.version >= endpoints[0].version


# -- one key --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Forward:
    """A read this node passes on: the other nodes serving the key's partition (in the map's order), the
    partition, and the map generation of the partition map this node routed it with."""

    partition: int
    endpoints: tuple[Endpoint, ...]
    map_generation: int


@dataclass(frozen=True, slots=True)
class Behind:
    """A read bounded by `min_offset` of a live partition held here that has not applied it yet: wait for
    `live` (the partition's `LivePartition`) to reach it, then `read_key` again with `waited=True`."""

    live: Any
    min_offset: int


def read_key(
    node: Node,
    store_name: str,
    key_text: str,
    forwarded: bool,
    min_offset: int | None = None,
    waited: bool = False,
    found: Callable[[str, str, int, int, bytes], bytes] = found_body,
    fields: Projection | None = None,
) -> Answer | Forward | Behind:
    """The answer to a read of `key_text` in `store_name` when this node holds the key's partition (and no
    newer version of it is served elsewhere, unless the read was `forwarded` here): 200 with the value, or
    404 key_not_found, both with X-Keyroute-Partition/Node/Version/Hops/Generation (and, for a live
    partition, X-Keyroute-Offset/Lag). Otherwise the `Forward` to send on. A read bounded by `min_offset`
    that the live partition has not applied is `Behind` (to wait for), or, once `waited` (or when the node
    does not wait), 503 not_up_to_bound. Raises ApiError: an unknown store (404), a key that does not fit
    the store's key format (400), `min_offset` on a partition that is not live (400 not_live), a partition
    it can neither answer nor forward (503: the read was forwarded here already, or no node serves the
    partition). A 200's body is `found` of the value (`found_body`: JSON), only its `fields` when given
    (400 unknown_fields for fields the store lacks); a value past the store's time to live is 404 expired.
    Synchronous: nearly every read is answered here, without a task."""
    ownership = node.ownership
    m = ownership.map
    if fields is not None:
        fields.check_record(store_name, find_store(m, store_name))
    reads = _CURRENT.reads
    if reads is None or reads.map is not m:
        reads = _CURRENT.reads = _MapReads(m)
    locator = reads.locators.get(store_name)
    if locator is None and store_name not in reads.locators:
        locator = reads.add(store_name)
    data = None
    if locator is not None:  # a string key hashed with murmur2: its bytes are its UTF-8
        try:  # noqa: SIM105 (a `with suppress` per read costs a context manager's two calls)
            data = key_text.encode("utf-8")
        except UnicodeEncodeError:
            pass  # parse_key_text says why
    if data is not None:
        # StoreLocator.serving_of's plain case, inline (an interpreted frame less per read): Kafka's
        # toPositive(murmur2(key)) % partitions, as tests/property/test_key_location_props.py pins it.
        partition = (_murmur2_bits(data) & 0x7FFFFFFF) % locator.partitions  # type: ignore[union-attr]
        serving = locator.serving[partition]  # type: ignore[union-attr]
        shown = key_text
    else:
        record = find_store(m, store_name)
        key = parse_key_text(record, key_text)
        location = m.locate(record, key)
        data, shown, partition, serving = key.data, location.key, location.partition, location.serving
    held = ownership.held.get((store_name, partition))  # Ownership.local, inline: a frame less per read
    node_id = node.settings.node_id  # not the `node_id` property: a frame less per read
    if held is not None and not forwarded:
        # answers_locally: unless the first other node serving the partition serves a newer version
        for endpoint in serving:
            if endpoint.node_id != node_id:
                if held.version < endpoint.version:
                    held = None
                break
    if held is None:
        others = [ep for ep in serving if ep.node_id != node_id]
        return _forward_to(node_id, store_name, partition, others, forwarded, m.generation)
    node.metrics.local_answers += 1
    live = held.live
    offset = -1
    if live is not None:
        offset = live.offset  # before the value: the value reflects at least this offset
        if min_offset is not None and offset < min_offset:
            return _behind(node, store_name, partition, held, offset, min_offset, waited)
    elif min_offset is not None:
        raise not_live(store_name)
    version = held.version
    headers = [
        _JSON,
        (_PARTITION, b"%d" % partition),
        node.node_header,
        (_VERSION, b"%d" % version),
        _HOPS_1 if forwarded else _HOPS_0,
        (_GENERATION, reads.generation),
    ]
    if live is not None:
        headers.append((_OFFSET, b"%d" % offset))
        headers.append((_LAG, b"%d" % live.lag_records))
    txn = None
    if reads.thread == _get_ident():  # a transaction is one thread's (LMDB's rule): the thread that made them
        txn = reads.txns.get(held, _UNSET)
        if txn is _UNSET:
            txn = reads.txns[held] = _pinned_txn(held)
    if txn is None:
        value = held.get(data)
    else:  # PartitionStore.get of a batch partition, inline, on the transaction kept open on it
        try:
            value = txn.get(_TAG_KEY + data if len(data) < _MAX_KEY_BYTES else db_key(data))
        except lmdb.Error:  # the partition closed (py-lmdb ends its transactions then): its get says so
            value = held.get(data)
    if value is None:
        return 404, headers, error_json("key_not_found", f"key {shown!r} is not in store {store_name!r}")
    ttl = m.stores[store_name].ttl  # the store is in the map: its key was located by it
    if ttl is not None and ttl.expired(value, node.clock()):
        return 404, headers, error_json("expired", expired_message(store_name, shown, ttl))
    if fields is not None:
        value = fields.apply(value)
    if found is _FOUND_BODY:  # JSON: the compiled twin, called natively
        return 200, headers, _found_json(store_name, shown, partition, version, value)
    return 200, headers, found(store_name, shown, partition, version, value)


def _found_json(store: str, key: str, partition: int, version: int, value_json: bytes) -> bytes:
    """`keyroute.api.found_body`, in this (compiled) module: the same bytes (tests/unit/node pin them equal),
    without an interpreted frame per read."""
    return b'{"store": %s, "key": %s, "partition": %d, "version": %d, "value": %s}' % (
        _json_string(store).encode("utf-8"),
        _json_string(key).encode("utf-8"),
        partition,
        version,
        value_json,
    )


def _pinned_txn(held: Any) -> Any:
    """A read transaction kept open on `held` for this node's reads of a key (on the event loop only: one
    thread), or None where each read takes its own (`held.get`): a live partition (its applier writes it: a
    transaction kept open would not see the writes), a timeline partition, anything but a `PartitionStore`.
    A batch partition is open read-only and never written while it is open (a new version is another
    partition, in another environment), so one snapshot of it holds every read's answer; kept open, a read
    saves a transaction's begin and end. The transaction ends with the `_MapReads` holding it, or when the
    partition closes (py-lmdb ends an environment's transactions as it closes it)."""
    if type(held) is not PartitionStore or held.timeline is not None or not held.read_only:
        return None
    try:
        return held.read_txn()
    except (LoadError, lmdb.Error):  # closed meanwhile: its get says so
        return None


class _MapReads:
    """What a key read here needs of one partition map, worked out once per map: the locators
    (keyroute.keys.key_location.StoreLocator) of its stores of string keys hashed with murmur2, made as
    reads of each come (None for a store of another kind: `PartitionMap.locate` locates its keys), the
    map's generation as its header's value, and the read transactions kept open on the batch partitions
    read here (`_pinned_txn`; None: each read takes its own), by partition, as reads of each come, for the
    reads of the thread that made it."""

    __slots__ = ("map", "locators", "generation", "txns", "thread")

    def __init__(self, m: PartitionMap) -> None:
        self.map = m
        self.locators: dict[str, StoreLocator | None] = {}
        self.generation = b"%d" % m.generation
        self.txns: dict[Any, Any] = {}
        self.thread = _get_ident()  # whose reads use `txns` (a node reads on its event loop's thread only)

    def add(self, name: str) -> StoreLocator | None:
        """The locator of store `name` (None: a store of another kind); an unknown store is not kept."""
        if name not in self.map.stores:
            return None
        locator = StoreLocator.of_map(self.map, name)
        if locator is not None and not locator.plain:
            locator = None
        self.locators[name] = locator
        return locator


class _Current:
    """The `_MapReads` of the partition map the last read was made with: replaced whole (one assignment) when
    a read finds the map changed."""

    __slots__ = ("reads",)

    def __init__(self) -> None:
        self.reads: _MapReads | None = None


_CURRENT: Final = _Current()


def _where(
    node: Node, m: PartitionMap, record: StoreRecord, store_name: str, key_text: str
) -> tuple[Key, KeyLocation, PartitionStore | None, list[Endpoint]]:
    """A read's key as `record` parses it (raises BadKey), where it lives, this node's copy of its partition
    (None: not held here) and the other nodes serving that partition."""
    key = parse_key_text(record, key_text)
    location = m.locate(record, key)
    node_id = node.node_id
    others = [ep for ep in location.serving if ep.node_id != node_id]
    return key, location, node.ownership.local(store_name, location.partition), others


def _behind(
    node: Node, store: str, partition: int, held: PartitionStore, offset: int, min_offset: int, waited: bool
) -> Behind:
    """A read bounded by `min_offset` of a live partition held here that has applied only `offset`: `Behind`,
    to wait for, unless it `waited` already or the node does not wait: then 503 not_up_to_bound (raised)."""
    if not waited and node.settings.min_offset_wait_ms > 0:
        return Behind(held.live, min_offset)
    raise _not_up_to_bound(store, partition, held.version, held.live, offset, min_offset)


def read_timeline(
    node: Node,
    store_name: str,
    key_text: str,
    read: str,
    raw_query: bytes,
    forwarded: bool,
    waited: bool = False,
    fields: Projection | None = None,
) -> Answer | Forward | Behind:
    """The answer to a `history` or `windows` read of `key_text` (keyroute.storage.timeline) when this node
    holds the key's partition: 200 with the entries in time order, and `next`, a cursor, when `limit` cut
    them. Otherwise the `Forward` to send on, as `read_key` decides. Raises ApiError: an unknown store
    (404), a store of another kind (400 wrong_store_kind), a malformed query (400 bad_request), a key that
    does not fit (400 bad_key), a cursor not made for this query (400 bad_cursor) or made for a version no
    longer served here (410 cursor_expired), a partition it can neither answer nor forward (503). With
    `min_offset`, as `read_key`: `Behind` to wait for, or once `waited` 503 not_up_to_bound. With `fields`,
    each row (a window's value) is projected to them."""
    m = node.ownership.map
    record = find_store(m, store_name)
    if fields is not None:
        fields.check_record(store_name, record)
    wanted = READ_KINDS[read]
    timeline = record.timeline
    if timeline is None or timeline.kind is not wanted:
        kind = "a store of one value per key" if timeline is None else f"a {timeline.kind.value} store"
        raise WrongStoreKind(f"store {store_name!r} is {kind}: {read} reads are for {wanted.value} stores")
    try:
        query = parse_query(read, raw_query, timeline)
    except QueryError as exc:
        raise BadRequest(str(exc)) from None
    key, location, held, others = _where(node, m, record, store_name, key_text)
    if held is not None and held.timeline is not None and answers_locally(held, others, forwarded):
        node.metrics.local_answers += 1
        secret = node.cursor_key.value
        if secret is None:
            raise PartitionUnavailable("this node does not know the cluster's cursor key yet: retry shortly")
        bound = query.cursor_query(store_name, key.text)
        after = None
        if query.cursor is not None:
            try:
                version, after = read_cursor(secret, bound, query.cursor)
            except CursorError as exc:
                raise BadCursor(str(exc)) from None
            if version != held.version:
                raise CursorExpired(
                    f"the cursor continues version {version} of store {store_name!r}, which is no longer served"
                    f" (now {held.version}): start the read again"
                )
        # A live partition's offset is read before its entries: they reflect at least that offset.
        live = held.live
        offset = live.offset if live is not None else -1
        if query.min_offset is not None:
            if live is None:
                raise not_live(store_name)
            if offset < query.min_offset:
                return _behind(node, store_name, location.partition, held, offset, query.min_offset, waited)
        low = query.low
        if record.ttl is not None and timeline.kind is StoreKind.HISTORY:
            # Rows past their time to live are never read: the read starts at the oldest one still served.
            oldest = record.ttl.timeline_low(node.clock(), timeline.time_type)
            low = oldest if low is None else max(low, oldest)
        entries, more = held.entries(key.data, low, query.high, query.limit, query.descending, after)
        next_cursor = make_cursor(secret, bound, held.version, entries[-1][:2]) if more else None
        field = "rows" if read == HISTORY else "windows"
        values = [e[2] for e in entries]
        if fields is not None:
            values = fields.apply_all(values, read != HISTORY)
        body = timeline_body(store_name, key.text, location.partition, held.version, field, values, next_cursor)
        headers = _local_headers(node, location.partition, held.version, forwarded, m.generation, live, offset)
        return 200, headers, body
    return _forward_to(node.node_id, store_name, location.partition, others, forwarded, m.generation)


def _local_headers(
    node: Node, partition: int, version: int, forwarded: bool, map_generation: int, live: Any, offset: int
) -> list[tuple[bytes, bytes]]:
    """The headers of a read answered from this node's copy of `partition` at `version`: X-Keyroute-
    Partition/Node/Version/Hops/Generation and, for a live partition (`live` set), the `offset` the answer
    reflects (read before the value) and the partition's lag."""
    headers = [
        _JSON,
        (_PARTITION, str(partition).encode("ascii")),
        node.node_header,
        (_VERSION, str(version).encode("ascii")),
        _HOPS_1 if forwarded else _HOPS_0,
        (_GENERATION, str(map_generation).encode("ascii")),
    ]
    if live is not None:
        headers.append((_OFFSET, str(offset).encode("ascii")))
        headers.append((_LAG, str(live.lag_records).encode("ascii")))
    return headers


def _forward_to(
    node_id: str, store_name: str, partition: int, others: list[Endpoint], forwarded: bool, map_generation: int
) -> Forward:
    """The `Forward` of a read this node does not answer itself; 503 when it may not or cannot forward."""
    if forwarded:
        # Our view and the forwarding node's differ (a rebalance is in flight): say so, never bounce.
        raise PartitionUnavailable(
            f"node {node_id} does not serve partition {partition} of store {store_name!r}"
            " and does not forward a forwarded request",
            RETRY_AFTER_S,
        )
    if not others:
        raise PartitionUnavailable(f"no node serves partition {partition} of store {store_name!r}", RETRY_AFTER_S)
    return Forward(partition, tuple(others), map_generation)


def _not_up_to_bound(
    store_name: str, partition: int, version: int, live: Any, offset: int, min_offset: int
) -> NotUpToBound:
    """503 not_up_to_bound for a live partition held here that has not applied `min_offset`."""
    behind = not_up_to_bound(store_name, partition, offset, min_offset)
    behind.headers[HEADER_LAG] = str(live.lag_records)
    behind.headers[HEADER_PARTITION] = str(partition)
    behind.headers[HEADER_VERSION] = str(version)
    return behind


async def forward_read(node: Node, raw_path: bytes, forward: Forward, request_id: str) -> Answer:
    """The read of `raw_path` (still percent-encoded, so a key's %2F stays one segment; with its query, so
    a `min_offset` goes on with it) passed on to the first of `forward.endpoints` that answers other than
    503, its answer relayed; a 503 one gave when none did; raises PartitionUnavailable when none answered
    at all."""
    headers = forward_headers(request_id, node.members, node.node_id)
    refused: Answer | None = None
    failures = []
    metrics = node.metrics
    target = _request_target(raw_path)
    for endpoint in forward.endpoints:
        metrics.forwards += 1
        try:
            reply = await node.http.get(_origin(endpoint.url) + target, headers)
        except (UpstreamUnavailable, ValueError) as exc:
            # ValueError: a URL the wire cannot speak to (not http://), a misconfigured node.
            metrics.forward_failures += 1
            log.warning("forwarding a read to node %s failed: %s", endpoint.node_id, describe(exc))
            failures.append(f"{endpoint.node_id}: {type(exc).__name__}")
            continue
        status = reply.status
        answer = _relay(node, status, reply.headers, reply.body, forward.map_generation)
        if status == 503:
            # That node stopped serving it too; another replica still might.
            refused = answer
            continue
        metrics.forwarded_answers += 1
        return answer
    if refused is not None:
        return refused
    raise PartitionUnavailable(
        f"no node serving partition {forward.partition} answered ({', '.join(failures)})", RETRY_AFTER_S
    )


def forward_headers(request_id: str | None, members: ClusterAuth, node_id: str = "") -> dict[str, str]:
    """What a forwarded request carries: only what the next node needs, never the client's Host,
    Content-Length or hop-by-hop headers. The membership proof makes the next node honour the hop count,
    so it never forwards again; `node_id` names the forwarding node (with member certificates the next node
    holds it to the certificate's id)."""
    headers = {HEADER_HOPS: "1", "accept-encoding": "identity", "accept": "application/json", **members.headers()}
    if node_id:
        headers[HEADER_FORWARDED_BY] = node_id
    if request_id:
        headers[HEADER_REQUEST_ID] = request_id
    return headers


# Bytes a request target never holds as they are (and "#", which would end it): sent on percent-encoded,
# so the next node decodes the same key.
_NOT_IN_TARGET = re.compile(rb"[^\x21\x22\x24-\x7e]")


def _request_target(raw_path: bytes) -> str:
    """The path and query to ask the next node for: `raw_path` as the client sent it (still
    percent-encoded, so a key's %2F stays one segment), any byte that cannot stand in a request target
    percent-encoded."""
    if _NOT_IN_TARGET.search(raw_path):
        raw_path = _NOT_IN_TARGET.sub(lambda m: b"%%%02X" % m[0][0], raw_path)
    return raw_path.decode("ascii")


@functools.lru_cache(maxsize=256)
def _origin(url: str) -> str:
    """scheme://host:port of a node's advertised URL (a forwarded read asks for the client's own path)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def _relay(
    node: Node, status: int, raw_headers: Sequence[tuple[bytes, bytes]], body: bytes, map_generation: int
) -> Answer:
    headers = [(name, value) for name, value in passthrough_headers(raw_headers) if name not in _NOT_RELAYED]
    headers.append(_HOPS_1)
    headers.append((_FORWARDED_BY, node.node_id.encode("latin-1")))
    # The map this (forwarding) node routed with, not the one of the node that read the value.
    headers.append((_GENERATION, str(map_generation).encode("ascii")))
    return status, headers, body


# -- a batch --------------------------------------------------------------------------------------------


class Batch:
    """One batch-get: the entries answered here (in request order; None where a key waits for another
    node), and the keys to send on with the nodes serving them. (A plain class, not a dataclass: the
    compiled build would look up the annotation `Node`, a name only type checkers import here.)"""

    __slots__ = (
        "node",
        "store",
        "forwarded",
        "map_generation",
        "entries",
        "bounds",
        "texts",
        "replicas",
        "forwarded_partitions",
        "behind",
        "fields",
        "ttl",
    )

    def __init__(
        self,
        node: Node,
        store: str,
        forwarded: bool,
        map_generation: int,
        entries: list[bytes | None],
        bounds: OffsetBounds | None = None,
        fields: Projection | None = None,
        ttl: Ttl | None = None,
    ) -> None:
        self.node = node
        self.store = store
        self.forwarded = forwarded
        self.map_generation = map_generation
        # One per key of the request, in its order.
        self.entries = entries
        self.bounds = bounds
        # The keys to send on: index -> key text, and the nodes serving each.
        self.texts: dict[int, str] = {}
        self.replicas: dict[int, list[Endpoint]] = {}
        # With bounds: the partitions of the keys sent on, whose bounds go with them.
        self.forwarded_partitions: set[int] = set()
        # Live partitions held here that have not applied their bound yet: partition -> (bound, [(index, key)]).
        self.behind: dict[int, tuple[int, list[tuple[int, Key]]]] = {}
        # The projection asked for (passed on with the keys sent on).
        self.fields = fields
        # The store's time to live (keyroute.storage.ttl).
        self.ttl = ttl

    @property
    def complete(self) -> bool:
        """Whether every entry was answered here at once (nothing to send on, nothing to wait for)."""
        return not self.texts and not self.behind

    async def finish(self, request_id: str) -> None:
        """Wait for the partitions behind their bound and send the other keys on, at the same time."""
        if not self.behind:
            await self.forward(request_id)
        elif not self.texts:
            await self.catch_up()
        else:
            await asyncio.gather(self.forward(request_id), self.catch_up())

    async def catch_up(self) -> None:
        """The entries of the partitions behind their bound, once each has applied it (waiting at most
        `min_offset_wait_ms` for all of them together), else 503 not_up_to_bound entries."""
        node = self.node
        wait_s = node.settings.min_offset_wait_ms / 1000
        behind = self.behind

        async def wait(partition: int, bound: int) -> None:
            held = node.ownership.local(self.store, partition)
            live = held.live if held is not None else None  # None: the partition left this node meanwhile
            if live is not None:
                await live.wait_reached(bound, wait_s)

        await asyncio.gather(*(wait(p, bound) for p, (bound, _) in behind.items()))
        metrics = node.metrics
        store = self.store
        for partition, (bound, waiting) in behind.items():
            held = node.ownership.local(store, partition)
            live = held.live if held is not None else None
            offset = live.offset if live is not None else -1
            for i, key in waiting:
                if held is None or live is None or offset < bound:
                    metrics.count(store, KIND_BATCH, NotUpToBound.status)
                    entry = error_entry(key.text, not_up_to_bound(store, partition, offset, bound))
                    if live is not None:
                        entry["offset"] = offset
                    self.entries[i] = encode_entry(entry)
                else:
                    self.entries[i] = _local_entry(
                        node, store, held, key, partition, offset, fields=self.fields, ttl=self.ttl
                    )
        behind.clear()

    async def forward(self, request_id: str) -> None:
        """The keys waiting for other nodes, sent on (`keyroute.http.forwarding.forward_batch`); their
        entries filled in."""
        node = self.node
        metrics = node.metrics
        store = self.store
        url_path = batch_path(store)
        if self.fields is not None:
            url_path += self.fields.query()
        headers = {**forward_headers(request_id, node.members, node.node_id), "content-type": "application/json"}

        bounds = self.bounds
        min_offsets = bounds.wire(sorted(self.forwarded_partitions)) if bounds is not None else None

        async def send(endpoint: Endpoint, texts: list[str], round_number: int) -> list[dict[str, Any]] | None:
            return await _send_batch(node, endpoint.url + url_path, texts, headers, min_offsets)

        done = await forward_batch(self.texts, self.replicas, send)
        for i, entry in done.entries.items():
            status = entry["status"]
            if status != 503:
                metrics.forwarded_answers += 1
            metrics.count(store, KIND_BATCH, status)
            self.entries[i] = encode_entry(entry)

    def answer(self) -> Answer:
        headers = [
            _JSON,
            self.node.node_header,
            # 1 also when this node forwarded some keys itself: the router's view of them was stale.
            _HOPS_1 if self.forwarded or self.texts else _HOPS_0,
            (_GENERATION, str(self.map_generation).encode("ascii")),
        ]
        return 200, headers, results_body(entry or b"null" for entry in self.entries)


def read_batch(
    node: Node,
    store_name: str,
    keys: list[Any],
    forwarded: bool,
    bounds: OffsetBounds | None = None,
    found: Callable[..., bytes] = found_entry,
    fields: Projection | None = None,
) -> Batch:
    """A batch-get of `keys` (as `keyroute.http.forwarding.parse_batch_request` gave them, with its
    `bounds`) in `store_name`: every key answered here as `read_key` would (found, not found, a bad key or
    one too long as a 400 entry, a bound on a partition that is not live as a 400 not_live entry, a
    partition it can neither answer nor forward as a 503 entry), the others left to `Batch.finish` (keys
    of live partitions behind their bound, keys served elsewhere). Raises BadRequest when a key is not a
    JSON string or integer or a bound names a partition the store lacks (the whole batch is refused: only
    a client sends one), StoreNotFound for an unknown store. A key found here has `found`'s entry
    (`found_entry`: JSON), only its `fields` when given."""
    m = node.ownership.map
    record = find_store(m, store_name)
    if fields is not None:
        fields.check_record(store_name, record)
    for raw in keys:
        if not isinstance(raw, str) and not (isinstance(raw, int) and not isinstance(raw, bool)):
            raise BadRequest(bad_batch_key(store_name, record.key_format.value, raw).message)
    if bounds is not None:
        bounds.check(store_name, record.partitions)
    batch = Batch(node, store_name, forwarded, m.generation, [None] * len(keys), bounds, fields=fields, ttl=record.ttl)
    entries = batch.entries
    metrics = node.metrics
    node_id = node.node_id
    max_key_bytes = node.settings.limits.max_key_bytes
    for i, raw in enumerate(keys):
        if isinstance(raw, str) and key_too_long(raw, max_key_bytes):
            metrics.count(store_name, KIND_BATCH, BatchKeyTooLong.status)
            entries[i] = encode_entry(
                error_entry(raw, BatchKeyTooLong(f"the key is longer than {max_key_bytes} bytes"))
            )
            continue
        try:
            key = _batch_key(store_name, record, raw)
        except BadKey as exc:
            metrics.count(store_name, KIND_BATCH, exc.status)
            entries[i] = encode_entry(error_entry(raw if isinstance(raw, str) else str(raw), exc))
            continue
        location = m.locate(record, key)
        held = node.ownership.local(store_name, location.partition)
        others = [ep for ep in location.serving if ep.node_id != node_id]
        if held is not None and answers_locally(held, others, forwarded):
            live = held.live
            offset = None
            if live is not None:
                offset = live.offset
                bound = bounds.bound(location.partition) if bounds is not None else None
                if bound is not None and offset < bound:
                    pending = batch.behind.get(location.partition)
                    if pending is None:
                        pending = batch.behind[location.partition] = (bound, [])
                    pending[1].append((i, key))
                    continue
            elif bounds is not None and bounds.bound(location.partition) is not None:
                metrics.count(store_name, KIND_BATCH, NotLive.status)
                entries[i] = encode_entry(error_entry(key.text, not_live(store_name)))
                continue
            entries[i] = _local_entry(
                node, store_name, held, key, location.partition, offset, found, fields, record.ttl
            )
        elif forwarded or not others:
            metrics.count(store_name, KIND_BATCH, PartitionUnavailable.status)
            why = "does not forward a forwarded request" if forwarded else "no node serves it"
            unavailable = PartitionUnavailable(f"partition {location.partition} of store {store_name!r}: {why}")
            entries[i] = encode_entry(error_entry(key.text, unavailable))
        else:
            batch.texts[i] = key.text
            batch.replicas[i] = others
            if bounds is not None:
                batch.forwarded_partitions.add(location.partition)
    if batch.behind and node.settings.min_offset_wait_ms <= 0:
        # Nothing to wait for: the bound is checked once, now.
        for partition, (bound, keys) in batch.behind.items():
            for i, key in keys:
                metrics.count(store_name, KIND_BATCH, NotUpToBound.status)
                held = node.ownership.local(store_name, partition)
                offset = held.live.offset if held is not None and held.live is not None else -1
                entry = error_entry(key.text, not_up_to_bound(store_name, partition, offset, bound))
                entry["offset"] = offset
                entries[i] = encode_entry(entry)
        batch.behind.clear()
    return batch


def _local_entry(
    node: Node,
    store: str,
    held: PartitionStore,
    key: Key,
    partition: int,
    offset: int | None,
    found: Callable[..., bytes] = found_entry,
    fields: Projection | None = None,
    ttl: Ttl | None = None,
) -> bytes:
    """The entry of a key read from the partition held here (`offset`: a live partition's, read before;
    `found` makes a found key's, of only its `fields` when given; a value past the store's `ttl` is 404
    expired)."""
    metrics = node.metrics
    metrics.local_answers += 1
    value = held.get(key.data)
    if value is None:
        metrics.count(store, KIND_BATCH, KeyNotFound.status)
        entry = error_entry(key.text, KeyNotFound(f"key {key.text!r} is not in store {store!r}"))
        if offset is not None:
            entry["offset"] = offset
        return encode_entry(entry)
    if ttl is not None and ttl.expired(value, node.clock()):
        metrics.count(store, KIND_BATCH, Expired.status)
        entry = error_entry(key.text, Expired(expired_message(store, key.text, ttl)))
        if offset is not None:
            entry["offset"] = offset
        return encode_entry(entry)
    metrics.count(store, KIND_BATCH, 200)
    if fields is not None:
        value = fields.apply(value)
    return found(key.text, partition, held.version, value, offset, node.node_id)


def _batch_key(store: str, record: StoreRecord, raw: str | int) -> Key:
    fmt = record.key_format
    if isinstance(raw, int) and fmt not in _INT_FORMATS:
        if not fmt.registered:
            raise bad_batch_key(store, fmt.value, raw)
        raw = str(raw)  # as the router sends it: a Schema Registry key's text
    try:
        return key_from_value(fmt, raw, record.key_schema)
    except KeyFormatError as exc:
        raise caused(BadKey(str(exc)), exc)  # noqa: B904 (`from exc` loses the cause when compiled)


async def _send_batch(
    node: Node, url: str, texts: list[str], headers: dict[str, str], min_offsets: dict[str, int] | None = None
) -> list[dict[str, Any]] | None:
    """Another node's entries for `texts` (bounded by `min_offsets`), in order; None if it failed or answered
    something unusable."""
    metrics = node.metrics
    metrics.forwards += 1
    try:
        reply = await node.http.post(url, batch_body(texts, min_offsets), headers)
    except (UpstreamUnavailable, ValueError) as exc:
        metrics.forward_failures += 1
        log.warning("forwarding a batch-get to %s failed: %s", url, describe(exc))
        return None
    status, body = reply.status, reply.body
    if status != 200:
        metrics.forward_failures += 1
        log.warning("forwarded batch-get to %s answered %d", url, status)
        return None
    entries = parse_batch_answer(body, len(texts))
    if entries is None:
        metrics.forward_failures += 1
        log.warning("forwarded batch-get to %s answered a malformed body", url)
    return entries
