"""A node's part of a key range: `GET /stores/{store}/partitions/{p}/range`, the keys of one partition it
serves, in the store's key order (keyroute.storage.ranges), for a router to merge with the other partitions'.

    ?from_key=HEX&to_key=HEX&after=HEX&limit=N&version=V

Bounds are serialized keys in hex ([from_key, to_key), strictly after `after`); with `version` the node
answers only from that version of the partition (410 cursor_expired otherwise). The answer:

    {"store", "partition", "version", "more": bool, "keys": [
    {"key", "value"},
    ...
    ]}

one key per line.
`more` says keys of the range may follow the last one (ask again with `after` = it).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from keyroute.api import (
    HEADER_PARTITION,
    HEADER_VERSION,
    BadRequest,
    CursorExpired,
    PartitionUnavailable,
    WrongStoreKind,
)
from keyroute.http.exchange import Answer
from keyroute.keys.key_format import KeyFormatError, key_from_data
from keyroute.state_node.reads import RETRY_AFTER_S, find_store
from keyroute.storage.lmdb_layout import TAG_KEY
from keyroute.storage.ranges import (
    RangeQueryError,
    in_range,
    no_key_ranges,
    order_of,
    parse_partition_range,
    prefix_end,
    range_entry,
    scan_segments,
)
from keyroute.storage.timeline import escape_key

if TYPE_CHECKING:
    from keyroute.state_node.app import Node
    from keyroute.state_node.store import PartitionStore

_JSON = (b"content-type", b"application/json")
_PARTITION = HEADER_PARTITION.encode("ascii")
_VERSION = HEADER_VERSION.encode("ascii")
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


def read_partition_range(node: Node, store_name: str, raw_partition: str, raw_query: bytes) -> Answer:
    """The keys of one partition held here in the asked range (see the module docstring). Raises ApiError:
    an unknown store (404), a bad partition or query (400), a partition not held here (503), a version not
    held here (410)."""
    record = find_store(node.ownership.map, store_name)
    if not raw_partition.isdigit() or not 0 <= int(raw_partition) < record.partitions:
        raise BadRequest(
            f"partition {raw_partition!r}: store {store_name!r} has partitions 0 to {record.partitions - 1}"
        )
    partition = int(raw_partition)
    key_format = record.key_format
    if (refused := no_key_ranges(store_name, key_format)) is not None:
        raise WrongStoreKind(refused)
    try:
        query = parse_partition_range(raw_query, key_format)
    except RangeQueryError as exc:
        raise BadRequest(str(exc)) from None
    held = node.ownership.local(store_name, partition)
    if held is None:
        raise PartitionUnavailable(
            f"node {node.node_id} does not serve partition {partition} of store {store_name!r}", RETRY_AFTER_S
        )
    if query.version is not None and held.version != query.version:
        raise CursorExpired(
            f"the cursor continues version {query.version} of store {store_name!r}, which is no longer served"
            f" (partition {partition} is at version {held.version}): start the read again"
        )
    # One key beyond the limit tells whether more follow.
    found: list[tuple[bytes, bytes]] = []
    for start, end in scan_segments(key_format, query.low, query.high, query.after):
        _scan(held, key_format, start, end, query.low, query.high, query.after, query.limit + 1, found)
        if len(found) > query.limit:
            break
    more = len(found) > query.limit
    del found[query.limit :]
    entries = []
    for data, value in found:
        try:
            text = key_from_data(key_format, data).text
        except KeyFormatError:
            continue  # not a key of this store's format: never written by keyroute
        entries.append(range_entry(text, value))
    head = json.dumps(
        {"store": store_name, "partition": partition, "version": held.version, "more": more}, ensure_ascii=False
    ).encode("utf-8")
    # One key per line: a router splits them without parsing the values (compact JSON has no raw newline).
    body = head[:-1] + b', "keys": [\n' + b",\n".join(entries) + b"\n]}"
    headers = [_JSON, (_PARTITION, str(partition).encode("ascii")), node.node_header]
    headers.append((_VERSION, str(held.version).encode("ascii")))
    return 200, headers, body


def _scan(
    held: PartitionStore,
    key_format: object,
    start: bytes | None,
    end: bytes | None,
    low: bytes | None,
    high: bytes | None,
    after: bytes | None,
    limit: int,
    found: list[tuple[bytes, bytes]],
) -> None:
    """Append to `found` (up to `limit` in all) the keys of [start, end) that are in the range, in order."""
    timeline = held.timeline is not None
    position, stop = _lower(start, timeline), _upper(end, timeline)
    resume = None
    while len(found) < limit:
        items, more, resume = held.key_range(position, stop, limit - len(found), resume)
        for data, value in items:
            if in_range(key_format, data, low, high, after):  # type: ignore[arg-type]
                found.append((data, value))
            elif high is not None and order_of(key_format, data) >= order_of(key_format, high):  # type: ignore[arg-type,operator]
                return  # keys only grow from here
        if not more:
            return
