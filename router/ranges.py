"""The router's key ranges: `GET /stores/{store}/range`, fanned out to every partition and merged.

murmur2 spreads any range of keys over all partitions, so each partition is asked for the first `limit`
keys of the range it holds (after the cursor's key), from one of its serving replicas (the next one when a
replica fails or no longer serves it), and the sorted answers are merged: the first `limit` keys of the
union are the range's. The answer's `next` cursor names the last key returned and the version each
partition was read at; the next page asks each partition for that version (410 cursor_expired when no
replica serves it any more). Memory: at most `limit` keys per partition, whatever the range's size.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import logging
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from keyroute.core.api import (
    BadCursor,
    BadKey,
    BadRequest,
    CursorExpired,
    PartitionUnavailable,
    StoreNotFound,
)
from keyroute.core.key_format import KeyFormat, parse_key
from keyroute.core.ranges import (
    PartitionRange,
    RangeCursorError,
    RangeKeyError,
    RangeQueryError,
    make_range_cursor,
    order_of,
    parse_range_query,
    range_entry,
    read_range_cursor,
)
from keyroute.http.forwarding import path_segment

if TYPE_CHECKING:
    from keyroute.router.proxy import Proxy

log = logging.getLogger(__name__)

_VALUE = b'", "value": '
_KEY_START = len(b'{"key": ')


class _Page:
    """One partition's answer: its version, its keys as (order, text, value bytes), whether more follow."""

    __slots__ = ("partition", "version", "keys", "more")

    def __init__(self, partition: int, version: int, keys: list[tuple[Any, str, bytes]], more: bool) -> None:
        self.partition = partition
        self.version = version
        self.keys = keys
        self.more = more


async def read_range(proxy: Proxy, store: str, raw_query: bytes, request_id: str) -> bytes:
    """The answer body of a range read; raises ApiError (400, 404, 410, 503)."""
    table = proxy.table
    record = table.map.stores.get(store)
    if record is None:
        raise StoreNotFound(f"store {store!r} is not published")
    key_format = record.key_format
    try:
        query = parse_range_query(raw_query, key_format)
    except RangeKeyError as exc:
        raise BadKey(str(exc)) from None
    except RangeQueryError as exc:
        raise BadRequest(str(exc)) from None
    secret = proxy.member_token.encode("ascii")
    bound = (store, *query.bounds)
    versions: list[int | None] = [None] * record.partitions
    after = None
    if query.cursor is not None:
        try:
            pinned, after = read_range_cursor(secret, bound, query.cursor, record.partitions)
        except RangeCursorError as exc:
            raise BadCursor(str(exc)) from None
        versions = list(pinned)
    low = None if query.low is None else query.low.data
    asks = [
        PartitionRange(low, query.high, after, query.limit, versions[p]).to_query(key_format)
        for p in range(record.partitions)
    ]
    pages = await asyncio.gather(
        *(_ask(proxy, store, p, asks[p], key_format, request_id) for p in range(record.partitions))
    )
    merged = heapq.merge(
        *[[(order, page.partition, text, value) for order, text, value in page.keys] for page in pages]
    )
    chosen = []
    for item in merged:
        if len(chosen) == query.limit:
            break
        chosen.append(item)
    more = len(chosen) == query.limit and (
        any(page.more for page in pages) or sum(len(page.keys) for page in pages) > query.limit
    )
    head: dict[str, Any] = {"store": store}
    if more:
        last_text = chosen[-1][2]
        head["next"] = make_range_cursor(
            secret, bound, [page.version for page in pages], parse_key(key_format, last_text).data
        )
    encoded = json.dumps(head, ensure_ascii=False).encode("utf-8")
    entries = [range_entry(text, value, partition) for _, partition, text, value in chosen]
    return encoded[:-1] + b', "keys": [' + b",".join(entries) + b"]}"


async def _ask(
    proxy: Proxy, store: str, partition: int, ask: dict[str, str], key_format: KeyFormat, request_id: str
) -> _Page:
    """One partition's page, from the first of its serving replicas that gives it."""
    serving = proxy.serving(store, partition)
    if not serving:
        raise PartitionUnavailable(f"no node serves partition {partition} of store {store!r}")
    path = f"/stores/{path_segment(store)}/partitions/{partition}/range?{urlencode(ask)}"
    expired = None
    failures = []
    for endpoint in serving:
        try:
            reply = await proxy.fetch(endpoint.url + path, request_id)
        except Exception as exc:  # a connection failure: the next replica
            failures.append(f"{endpoint.node_id}: {type(exc).__name__}")
            continue
        if reply.status == 200:
            return _page(partition, reply.body, key_format)
        if reply.status == 410:
            expired = json.loads(reply.body).get("message", "")
            continue
        if reply.status in (400, 404):
            # The node refuses what this router sent: a store or partition it does not know yet.
            failures.append(f"{endpoint.node_id}: {reply.status}")
            continue
        failures.append(f"{endpoint.node_id}: {reply.status}")
    if expired is not None:
        raise CursorExpired(expired)
    raise PartitionUnavailable(
        f"no node serving partition {partition} of store {store!r} answered ({', '.join(failures)})"
    )


def _page(partition: int, body: bytes, key_format: KeyFormat) -> _Page:
    """A node's range answer (keyroute.node.ranges, one key per line): each key's value kept as the bytes
    the node sent, only its key parsed."""
    lines = body.split(b"\n")
    head = json.loads(lines[0][: -len(b', "keys": [')] + b"}")
    keys = []
    for line in lines[1:-1]:
        if not line:
            continue  # no keys: an empty line between the brackets
        entry = line[:-1] if line.endswith(b",") else line
        cut = entry.index(_VALUE)
        text = json.loads(entry[_KEY_START : cut + 1])
        keys.append((order_of(key_format, parse_key(key_format, text).data), text, entry[cut + len(_VALUE) : -1]))
    return _Page(partition, int(head["version"]), keys, bool(head["more"]))
