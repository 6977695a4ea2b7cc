"""A node's part of a key range: `GET /stores/{store}/partitions/{p}/range`, the keys of one partition it
serves, in the store's key order (keyroute.storage.ranges), for a router to merge with the other partitions'.

    ?from_key=HEX&to_key=HEX&after=HEX&limit=N&version=V&fields=a,b.c

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
)
from keyroute.http.exchange import Answer
from keyroute.keys.key_format import KeyFormatError, key_from_data
from keyroute.state_node.reads import RETRY_AFTER_S, find_store
from keyroute.storage.projection import parse_fields
from keyroute.storage.ranges import (
    parse_partition_range,
    range_entry,
    read_query,
    scan_partition,
    scan_segments,
)

if TYPE_CHECKING:
    from keyroute.state_node.app import Node

_JSON = (b"content-type", b"application/json")
_PARTITION = HEADER_PARTITION.encode("ascii")
_VERSION = HEADER_VERSION.encode("ascii")


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
    query = read_query(store_name, key_format, raw_query, parse_partition_range)
    fields = None if query.fields is None else parse_fields(query.fields)
    if fields is not None:
        fields.check_record(store_name, record)
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
        scan_partition(held, key_format, start, end, query.low, query.high, query.after, query.limit + 1, found)
        if len(found) > query.limit:
            break
    more = len(found) > query.limit
    del found[query.limit :]
    entries = []
    ttl = record.ttl
    now = node.clock() if ttl is not None else 0.0
    for data, value in found:
        if ttl is not None and ttl.expired(value, now):
            continue  # past its time to live: not served
        try:
            text = key_from_data(key_format, data).text
        except KeyFormatError:
            continue  # not a key of this store's format: never written by keyroute
        entries.append(range_entry(text, value if fields is None else fields.apply(value)))
    head = json.dumps(
        {"store": store_name, "partition": partition, "version": held.version, "more": more}, ensure_ascii=False
    ).encode("utf-8")
    # One key per line: a router splits them without parsing the values (compact JSON has no raw newline).
    body = head[:-1] + b', "keys": [\n' + b",\n".join(entries) + b"\n]}"
    headers = [_JSON, (_PARTITION, str(partition).encode("ascii")), node.node_header]
    headers.append((_VERSION, str(held.version).encode("ascii")))
    return 200, headers, body
