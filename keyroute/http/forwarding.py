"""What routers and nodes share when they pass a read on to another member: relayed headers, batch-get bodies
and entries, and the per-node batch failover loop. No HTTP client here: the caller injects how it sends.

The batch-get wire format, as every member speaks it:

    request   {"keys": [KEY, ...]}                       a JSON object; KEY a string (or an integer)
              optional: "min_offset": N                  a bound for every partition of the request
                        "min_offsets": {"P": N, ...}     a bound per partition (the larger one counts)
    answer    {"results": [ENTRY, ...]}                  one ENTRY per key, in request order
    ENTRY     {"key": TEXT, "status": 200, "partition": P, "version": V, "value": VALUE}
            | {"key": TEXT, "status": S, "error": CODE, "message": TEXT}      (S 400, 404, 503, ...)
              an entry of a live store also carries "offset": the partition's last applied offset

Every integer in a request body (a KEY of an integer store, N) may be written with a zero fraction or an
exponent (14571.0, 1.4571e4: the integer 14571, as JSON Schema counts integers); 14571.5 is refused.

An entry with status 503 means "that node does not serve the key's partition now" (or, `not_up_to_bound`,
"it has not applied the bound yet"): another replica may.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar
from urllib.parse import quote

from keyroute.api import ApiError, BadRequest, PartitionUnavailable, PayloadTooLarge, loads_json, offset_value

__all__ = [
    "HOP_BY_HOP",
    "BatchRequest",
    "ForwardedBatch",
    "OffsetBounds",
    "Replica",
    "SendBatch",
    "batch_body",
    "batch_path",
    "encode_entry",
    "error_entry",
    "forward_batch",
    "found_entry",
    "parse_batch_answer",
    "parse_batch_body",
    "parse_batch_request",
    "passthrough_headers",
    "path_segment",
    "results_body",
]

# Never relayed from another member's answer (lower-case names): the hop-by-hop headers of RFC 9110
# section 7.6.1, which describe that one connection, and the framing and server headers our own server
# sets again for the connection the answer goes out on. Bodies are relayed as the bytes received, so a
# Content-Encoding is relayed with them.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"content-length",
        b"date",
        b"server",
    }
)


def passthrough_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Another member's answer headers to relay: names lower-cased, in order, without `HOP_BY_HOP` and
    without the headers its Connection header names (`Connection: close, X-A` drops X-A too)."""
    kept = []
    named: set[bytes] | None = None
    for name, value in headers:
        lowered = name.lower()
        if lowered not in HOP_BY_HOP:
            kept.append((lowered, value))
        elif lowered == b"connection":
            named = (named or set()) | {token.strip().lower() for token in value.split(b",")}
    if named:
        kept = [(name, value) for name, value in kept if name not in named]
    return kept


def path_segment(text: str) -> str:
    """`text` (a store name or key) as one URL path segment that every client and server on the way leaves
    alone: '/', '%', '?', '#', '+', spaces and non-ASCII percent-encoded, and "." and ".." too, because URL
    normalisation (RFC 3986 dot segments, which httpx applies) would otherwise remove them."""
    if text.isascii() and (text.isalnum() or _UNRESERVED.fullmatch(text) is not None):
        # Nothing to encode (what quote() leaves alone), the common case: one C call instead of quote's.
        return text if text != "." and text != ".." else text.replace(".", "%2E")
    return quote(text, safe="")


# The characters quote() never encodes (RFC 3986 unreserved).
_UNRESERVED = re.compile(r"[A-Za-z0-9_.~-]+")


def batch_path(store: str) -> str:
    """The path of `store`'s batch-get endpoint."""
    return f"/stores/{path_segment(store)}/batch-get"


# -- bodies and entries -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OffsetBounds:
    """A batch-get's freshness bounds: `every` for all partitions of the request, `partitions` per partition.
    A partition's bound is the larger of the two that apply (`bound`)."""

    every: int | None
    partitions: Mapping[int, int]

    def bound(self, partition: int) -> int | None:
        own = self.partitions.get(partition)
        if own is None:
            return self.every
        return own if self.every is None or own > self.every else self.every

    def check(self, store: str, partitions: int) -> None:
        """Raises BadRequest when a bound names a partition `store` (of `partitions` partitions) does not have."""
        for p in self.partitions:
            if p >= partitions:
                raise BadRequest(f"min_offsets names partition {p}; store {store!r} has {partitions} partitions")

    def wire(self, partitions: Iterable[int]) -> dict[str, int]:
        """The bounds of `partitions` as a request body's "min_offsets" (partitions without one left out)."""
        wired = {}
        for p in partitions:
            bound = self.bound(p)
            if bound is not None:
                wired[str(p)] = bound
        return wired


@dataclass(frozen=True, slots=True)
class BatchRequest:
    """A batch-get request body: the keys as JSON gave them, and its freshness bounds (None: no bound)."""

    keys: list[Any]
    bounds: OffsetBounds | None


def parse_batch_body(body: bytes, max_keys: int) -> list[Any]:
    """The `keys` of a batch-get request body (`parse_batch_request`), for callers that take no bounds."""
    return parse_batch_request(body, max_keys).keys


def parse_batch_request(body: bytes, max_keys: int) -> BatchRequest:
    """The `keys` of a batch-get request body, as JSON gave them (any JSON values: each caller decides per
    key what it accepts), and its bounds ("min_offset", "min_offsets").

    Numbers are read as `keyroute.api.loads_json` reads them: one with no fractional part is an
    integer however it is written (14571.0 is 14571, as JSON Schema counts it), for keys and bounds alike.

    Raises BadRequest (400 bad_request) when the body is not UTF-8 JSON of the form `{"keys": [...]}` or a
    bound is malformed (not an offset; a partition that is not a decimal number), and PayloadTooLarge (413
    too_many_keys) when it holds more than `max_keys` keys (0: no limit)."""
    try:
        obj = loads_json(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(f"the body is not valid JSON ({exc})") from exc
    if not isinstance(obj, dict) or not isinstance(obj.get("keys"), list):
        raise BadRequest('expected a JSON object {"keys": [...]}')
    keys: list[Any] = obj["keys"]
    if max_keys and len(keys) > max_keys:
        raise PayloadTooLarge(f"{len(keys)} keys in one batch; at most {max_keys} are allowed")
    if "min_offset" not in obj and "min_offsets" not in obj:
        return BatchRequest(keys, None)
    every = obj.get("min_offset")
    if every is not None:
        every = offset_value(every)
    per_partition = obj.get("min_offsets")
    partitions: dict[int, int] = {}
    if per_partition is not None:
        if not isinstance(per_partition, dict):
            raise BadRequest('min_offsets must be a JSON object {"<partition>": offset, ...}')
        for name, value in per_partition.items():
            if not (name.isascii() and name.isdigit() and len(name) <= 9):
                raise BadRequest(f"min_offsets: {name[:40]!r} is not a partition number")
            partitions[int(name)] = offset_value(value, f"min_offsets[{name}]")
    if every is None and not partitions:
        return BatchRequest(keys, None)
    return BatchRequest(keys, OffsetBounds(every, partitions))


def batch_body(texts: Sequence[str], min_offsets: Mapping[str, int] | None = None) -> bytes:
    """The request body of a batch-get for `texts`, with per-partition bounds when given."""
    if min_offsets:
        return encode_entry({"keys": list(texts), "min_offsets": dict(min_offsets)})
    return encode_entry({"keys": list(texts)})


def found_entry(
    key: str, partition: int, version: int, value_json: bytes, offset: int | None = None, node: str | None = None
) -> bytes:
    """The JSON of a found key's entry, built around the stored value's JSON bytes (never re-parsed); a live
    partition's entry carries its applied `offset`, and `node` names the node that read it."""
    entry: dict[str, Any] = {"key": key, "status": 200, "partition": partition, "version": version}
    if offset is not None:
        entry["offset"] = offset
    if node is not None:
        entry["node"] = node
    head = json.dumps(entry, ensure_ascii=False).encode("utf-8")
    return head[:-1] + b', "value": ' + value_json + b"}"


def error_entry(key: Any, error: ApiError) -> dict[str, Any]:
    """The entry of a key answered with `error` (its status, code and message); `key` as the client gave it."""
    return {"key": key, "status": error.status, "error": error.code, "message": error.message}


def encode_entry(entry: Mapping[str, Any]) -> bytes:
    """An entry (or any JSON object) as compact UTF-8 JSON bytes (a value passed on through a router stays as
    compact as the node stored it). A key echoed back may hold a lone surrogate (valid in JSON text, not in
    UTF-8): then everything non-ASCII is escaped instead."""
    try:
        return json.dumps(entry, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(entry, separators=(",", ":")).encode("ascii")


def results_body(entries: Iterable[bytes]) -> bytes:
    """The batch-get answer body around entries already encoded (`found_entry`, `encode_entry`)."""
    return b'{"results":[' + b",".join(entries) + b"]}"


def parse_batch_answer(body: bytes, count: int) -> list[dict[str, Any]] | None:
    """The entries of another member's batch-get answer for `count` keys, or None when the body is not a
    usable answer (not JSON, no `results` list, a different number of entries, an entry that is not an
    object with an integer `status`): the caller then treats the member as failed."""
    try:
        entries = json.loads(body)["results"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(entries, list) or len(entries) != count:
        return None
    for entry in entries:
        if not isinstance(entry, dict):
            return None
        status = entry.get("status")
        if not isinstance(status, int) or isinstance(status, bool):
            return None
    return entries


# -- the per-node failover loop -----------------------------------------------------------------------


class Replica(Protocol):
    """What the failover loop needs of a place to send keys to (keyroute.cluster.partition_map.Endpoint)."""

    @property
    def url(self) -> str: ...


R = TypeVar("R", bound=Replica)

# send(replica, texts, round) -> the replica's entries for `texts` in order, or None when it failed.
SendBatch = Callable[[R, list[str], int], Awaitable[list[dict[str, Any]] | None]]


@dataclass(frozen=True, slots=True)
class ForwardedBatch:
    """What `forward_batch` ends with: one entry per key index, and how many times a key moved on to its
    next replica (a failover)."""

    entries: dict[int, dict[str, Any]]
    failovers: int


async def forward_batch(
    texts: Mapping[int, str],
    replicas: Mapping[int, Sequence[R]],
    send: SendBatch[R],
) -> ForwardedBatch:
    """Send each key to the first of its replicas that answers for it, then the next: one request per node
    and round, all nodes of a round in parallel.

    `texts[i]` is the text of the key at index i of the caller's batch and `replicas[i]` the replicas to
    ask for it, in order (same keys: `replicas` must have an entry for every index in `texts`, none empty).
    Round 0 sends every key to its first replica, grouped by the replica's `url` (a node may serve
    partitions at different versions: one request to it all the same; `send` gets the first of the
    replicas grouped under that URL), keys in index order. A key whose node failed (`send` returned None)
    or answered its entry with status 503 goes, in the next round, to its next replica; `send` gets the
    round's number, so a caller can tell first requests from failovers (a retry budget, metrics).

    `send` must not raise for a node that fails (None is the answer then); it returns the node's entries
    for the keys it was given, in order (`parse_batch_answer` checks a body).

    Every index of `texts` ends with exactly one entry: the first one a node answered with a status other
    than 503; else, when every replica failed or refused, the last 503 entry a replica gave; else a 503
    `partition_unavailable` entry made here. So a key is unavailable exactly when its entry's status is
    503."""
    entries: dict[int, dict[str, Any]] = {}
    attempt = dict.fromkeys(texts, 0)
    refused: dict[int, dict[str, Any]] = {}
    failovers = 0
    pending = sorted(texts)
    round_number = 0
    while pending:
        groups: dict[str, list[int]] = {}
        first: dict[str, R] = {}
        for i in pending:
            replica = replicas[i][attempt[i]]
            groups.setdefault(replica.url, []).append(i)
            first.setdefault(replica.url, replica)
        answers = await asyncio.gather(
            *(send(first[url], [texts[i] for i in indexes], round_number) for url, indexes in groups.items())
        )
        round_number += 1
        pending = []
        for indexes, answer in zip(groups.values(), answers, strict=True):
            for n, i in enumerate(indexes):
                entry = answer[n] if answer is not None else None
                if entry is not None:
                    if entry.get("status") != 503:
                        entries[i] = entry
                        continue
                    refused[i] = entry
                attempt[i] += 1
                if attempt[i] < len(replicas[i]):
                    failovers += 1
                    pending.append(i)
                    continue
                entries[i] = refused.get(i) or error_entry(
                    texts[i],
                    PartitionUnavailable(f"no node serving the partition of key {texts[i]!r} answered"),
                )
        pending.sort()
    return ForwardedBatch(entries, failovers)
