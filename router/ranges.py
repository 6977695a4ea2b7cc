"""The router's key ranges: `GET /stores/{store}/range`, fanned out to every partition and merged.

murmur2 spreads any range of keys over all partitions, so each partition is asked for the first keys of
the range it holds (after the cursor's key), twice its share of `limit`, from one of its serving replicas
(the next one when a replica fails or no longer serves it), and the sorted answers are merged; a partition
whose keys might still be among the first `limit` of the union once its share is used up is asked again,
for twice as many, until none is. The first `limit` keys of the union are the range's.

The answer's `next` cursor names the last key returned and the version each partition was read at; the
next page asks each partition for that version (410 cursor_expired when no replica serves it any more).
Memory: at most `limit` keys per partition (about twice `limit` in all when keys are spread evenly),
whatever the range's size.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import logging
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from keyroute.api import (
    BadCursor,
    CursorExpired,
    PartitionUnavailable,
)
from keyroute.http.forwarding import path_segment
from keyroute.keys.key_format import KeyFormat, parse_key
from keyroute.storage.projection import parse_fields
from keyroute.storage.ranges import (
    PartitionRange,
    RangeCursorError,
    make_range_cursor,
    order_of,
    parse_range_query,
    range_entry,
    read_query,
    read_range_cursor,
)

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
        raise table.unknown_store(store)
    key_format = record.key_format
    query = read_query(store, key_format, raw_query, parse_range_query)
    if query.fields is not None:  # refused here, once, rather than by every partition's node
        parse_fields(query.fields).check_record(store, record)
    secret = proxy.cursor_key.value
    if secret is None:
        raise PartitionUnavailable("the cluster's cursor key is not known yet (no node has joined): retry shortly")
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
    partitions = record.partitions
    limit = query.limit
    # Each partition is first asked for twice its share of the page; a partition whose keys might still
    # be among the first `limit` of the union once its share is used up is asked again (for twice as many),
    # until none is. An even spread needs one round; the keys sent are about twice those returned.
    quota = [min(limit, max(1, -(-2 * limit // partitions)))] * partitions
    pages = list(
        await asyncio.gather(
            *(
                _ask(proxy, store, p, PartitionRange(low, query.high, after, quota[p], versions[p], query.fields),
                     key_format, request_id)
                for p in range(partitions)
            )
        )
    )  # fmt: skip
    while True:
        merged = list(heapq.merge(*[[(k[0], page.partition, k[1], k[2]) for k in page.keys] for page in pages]))
        cutoff = merged[limit - 1][0] if len(merged) >= limit else None
        needy = [
            p
            for p, page in enumerate(pages)
            if page.more and page.keys and (cutoff is None or page.keys[-1][0] < cutoff)
        ]
        if not needy:
            break
        for p in needy:
            quota[p] = min(limit, quota[p] * 2)
        refills = await asyncio.gather(
            *(
                _ask(proxy, store, p, PartitionRange(low, query.high, _data(key_format, pages[p].keys[-1][1]),
                     quota[p], pages[p].version, query.fields), key_format, request_id, refill=True)
                for p in needy
            )
        )  # fmt: skip
        for p, refill in zip(needy, refills, strict=True):
            pages[p] = _Page(p, pages[p].version, pages[p].keys + refill.keys, refill.more)
    chosen = merged[:limit]
    more = len(merged) > limit or any(page.more for page in pages)
    head: dict[str, Any] = {"store": store}
    if more:
        last_text = chosen[-1][2]
        head["next"] = make_range_cursor(
            secret, bound, [page.version for page in pages], parse_key(key_format, last_text).data
        )
    encoded = json.dumps(head, ensure_ascii=False).encode("utf-8")
    entries = [range_entry(text, value, partition) for _, partition, text, value in chosen]
    return encoded[:-1] + b', "keys": [' + b",".join(entries) + b"]}"


def _data(key_format: KeyFormat, text: str) -> bytes:
    return parse_key(key_format, text).data


async def _ask(
    proxy: Proxy,
    store: str,
    partition: int,
    wanted: PartitionRange,
    key_format: KeyFormat,
    request_id: str,
    refill: bool = False,
) -> _Page:
    """One partition's page, from the first of its serving replicas that gives it. A `refill` (more keys of
    a partition already read at `wanted.version`) that meets another version means the partition changed
    under the read: 503, to be asked again."""
    ask = wanted.to_query(key_format)
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
        if refill:
            raise PartitionUnavailable(f"partition {partition} of store {store!r} changed version during the read")
        raise CursorExpired(expired)
    raise PartitionUnavailable(
        f"no node serving partition {partition} of store {store!r} answered ({', '.join(failures)})"
    )


def _page(partition: int, body: bytes, key_format: KeyFormat) -> _Page:
    """A node's range answer (keyroute.state_node.ranges, one key per line): each key's value kept as the bytes
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
