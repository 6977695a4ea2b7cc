"""The router's multi-store reads (keyroute.http.multi_store: the wire format): one key's values in several
stores, or many keys x stores, each key's stores read from as few nodes as serve them.

For each key, its stores are grouped by the nodes that serve them (`plan`): co-located stores
(keyroute.cluster.colocation) have partition p of each on the same replicas, so they make one group, sent to
one of those replicas, the next on failure. Stores not co-located with the others make groups of their own,
read at the same time.

    GET  /stores/{stores}/read/{key}   one group: the node's answer passed on as it is (its X-Keyroute-Node,
                                       X-Keyroute-Hops), as a single read's; several: one request per group,
                                       in parallel, their entries put together
    POST /stores/{stores}/read         every key's groups, gathered per node: one request per node (and
                                       round of failover; keyroute.http.forwarding.forward_batch), all nodes
                                       at the same time

Every store named is one the caller may read (keyroute.http.authn checks each), and with quotas each store's
reads are admitted against the caller's quota of that store, as its gets (or batch-gets) would be.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from keyroute.api import (
    HEADER_HOPS,
    HEADER_NODE,
    HEADER_REQUEST_ID,
    HEADER_ROUTER,
    ApiError,
    PartitionUnavailable,
    loads_json,
)
from keyroute.cluster.partition_map import Endpoint
from keyroute.http import openapi
from keyroute.http.dataplane import JSON, Call, Route
from keyroute.http.fast_upstream import StaleConnection, header_block
from keyroute.http.forwarding import encode_entry, error_entry, forward_batch, passthrough_headers, path_segment
from keyroute.http.multi_store import (
    READ,
    ReadOptions,
    Row,
    parse_options,
    parse_read_request,
    parse_stores,
    read_body,
    stores_segment,
)
from keyroute.http.upstream import UpstreamResponse
from keyroute.runtime.logs import describe
from keyroute.runtime.metrics import KIND_BATCH, KIND_KEY

log = logging.getLogger(__name__)

_HOPS = HEADER_HOPS.encode("ascii")
_NODE = HEADER_NODE.encode("ascii")


@dataclass(frozen=True, slots=True)
class Group:
    """Stores of one key read from one node: `replicas`, in the order to ask them, serve the key's partition
    of every one of `stores`."""

    key: str
    stores: tuple[str, ...]
    replicas: tuple[Endpoint, ...]


def plan(proxy: Any, key: str, stores: Sequence[str]) -> tuple[dict[str, dict[str, Any]], list[Group]]:
    """How to read `key` in `stores`: the entries known at once (an unknown store, a key its store cannot
    take, a partition no node serves), and the groups to send. The first store left picks the node serving
    the most of the stores left among its replicas (the first in its order on a tie); that group's replicas
    are the first store's that serve every store of it."""
    table = proxy.table
    entries: dict[str, dict[str, Any]] = {}
    left: list[tuple[str, int, frozenset[str]]] = []
    for store in stores:
        if not table.has_store(store):
            entries[store] = error_entry(key, table.unknown_store(store))
            continue
        try:
            partition, serving = table.serving_of(store, key)
        except ApiError as exc:
            entries[store] = error_entry(key, exc)
            continue
        if not serving:
            serving = proxy.serving(store, partition)  # the last known replicas, when any
            if not serving:
                proxy.metrics.unavailable += 1
                unserved = PartitionUnavailable(f"no node serves partition {partition} of store {store!r}")
                entries[store] = error_entry(key, unserved)
                continue
        left.append((store, partition, frozenset(ep.url for ep in serving)))
    groups = []
    while left:
        first, partition, _ = left[0]
        order = proxy.serving(first, partition)  # in the order to ask them
        best: list[str] = []
        for endpoint in order:
            covered = [store for store, _, urls in left if endpoint.url in urls]
            if len(covered) > len(best):
                best = covered
        if not best:  # the replicas changed between the two looks: the first store alone
            best = [first]
        chosen = set(best)
        urls = [urls for store, _, urls in left if store in chosen]
        replicas = tuple(ep for ep in order if all(ep.url in served for served in urls)) or tuple(order)
        groups.append(Group(key, tuple(best), replicas))
        left = [item for item in left if item[0] not in chosen]
    return entries, groups


def _headers(proxy: Any, request_id: str, body: bool = False) -> dict[str, str]:
    """What a request to a node carries (as the proxy's own): the router's mark, the membership proof."""
    headers = {HEADER_ROUTER: "1", "accept-encoding": "identity", **proxy.settings.member_headers}
    if request_id:
        headers[HEADER_REQUEST_ID] = request_id
    if body:
        headers["content-type"] = "application/json"
    return headers


# -- one key ----------------------------------------------------------------------------------------------


def _read_stores(plane: Any, call: Call, stores_text: str, key: str) -> Any:
    stores = parse_stores(stores_text)
    options = parse_options(call.request.query, stores)
    if plane.quotas.active:
        for store in stores:
            plane._admit(call, store, 1)
    proxy = plane.proxy
    entries, groups = plan(proxy, key, stores)
    if len(groups) == 1 and not entries and plane.upstream is not None:
        # One node serves every store asked (co-located stores): its answer is the answer, relayed from its
        # connection's callback as a single read's is.
        _Relay(plane, call, groups[0], options).send()
        return None
    return _read_key(plane, call, key, stores, options, entries, groups)


class _Relay:
    """A read of one group passed on: to its replicas in turn (the next after a failure or a 503), the first
    other answer relayed as it is; no coroutine while a pooled connection to the node is idle."""

    __slots__ = ("plane", "call", "group", "url_path", "head", "headers", "at", "refused")

    def __init__(self, plane: Any, call: Call, group: Group, options: ReadOptions) -> None:
        self.plane = plane
        self.call = call
        self.group = group
        self.url_path = _group_path(group, options)
        self.headers = _headers(plane.proxy, call.request.request_id)
        self.head = header_block(self.headers)
        self.at = 0
        self.refused: UpstreamResponse | None = None

    def send(self) -> None:
        replicas = self.group.replicas
        if self.at >= len(replicas):
            if self.refused is not None:
                self._relay(self.refused)
            else:
                self.call.fail(PartitionUnavailable(f"no node serving {', '.join(self.group.stores)} answered"))
            return
        endpoint = replicas[self.at]
        self.plane.proxy.metrics.upstream_requests += 1
        upstream = self.plane.upstream
        url = endpoint.url + self.url_path
        if upstream.get_now(url, self.head, self.replied) is None:
            task = asyncio.get_running_loop().create_task(upstream.get(url, self.headers))
            _TASKS.add(task)
            task.add_done_callback(self._fetched)

    def _fetched(self, task: asyncio.Task[UpstreamResponse]) -> None:
        _TASKS.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        self.replied(error if error is not None else task.result())  # type: ignore[arg-type]

    def replied(self, result: UpstreamResponse | BaseException) -> None:
        if isinstance(result, BaseException) or result.status == 503:
            if isinstance(result, UpstreamResponse):
                self.refused = result
            elif isinstance(result, StaleConnection):
                self.at -= 1  # the idle connection had been closed: the same node again, on a new one
            else:
                endpoint = self.group.replicas[self.at]
                log.warning("a multi-store read from node %s failed: %s", endpoint.node_id, describe(result))
            self.at += 1
            self.send()
            return
        self._relay(result)

    def _relay(self, reply: UpstreamResponse) -> None:
        if reply.status == 200:
            _count(self.plane, self.group.stores, KIND_KEY, 200)
        self.call.answer(reply.status, passthrough_headers(reply.headers), reply.body)


# The relays' requests in tasks (the loop keeps only weak references to tasks).
_TASKS: set[asyncio.Task[UpstreamResponse]] = set()


def _group_path(group: Group, options: ReadOptions) -> str:
    return f"/stores/{stores_segment(group.stores)}/{READ}/{path_segment(group.key)}" + options.query(group.stores)


async def _read_key(
    plane: Any,
    call: Call,
    key: str,
    stores: tuple[str, ...],
    options: ReadOptions,
    entries: dict[str, dict[str, Any]],
    groups: list[Group],
) -> None:
    proxy = plane.proxy
    request_id = call.request.request_id
    replies = await asyncio.gather(*(_get_group(proxy, group, options, request_id) for group in groups))
    nodes: set[str] = set()
    hopped = False
    for group, reply in zip(groups, replies, strict=True):
        entries.update(_group_entries(group, reply))
        if isinstance(reply, UpstreamResponse) and reply.status == 200:
            node = reply.header(_NODE)
            if node is not None:
                nodes.add(node.decode("latin-1"))
            hopped = hopped or reply.header(_HOPS) not in (None, b"0")
    for store in stores:
        status = entries[store].get("status")
        plane.count(store, KIND_KEY, status if isinstance(status, int) else 500)
    headers = [*JSON, (_HOPS, b"1" if hopped else b"0")]
    if len(nodes) == 1:
        headers.append((_NODE, next(iter(nodes)).encode("latin-1")))
    call.answer(200, headers, encode_entry({"key": key, "stores": {store: entries[store] for store in stores}}))


async def _get_group(proxy: Any, group: Group, options: ReadOptions, request_id: str) -> UpstreamResponse | ApiError:
    """A node's answer to the GET of `group`: the first replica's that answers other than 503, else the
    last 503, else PartitionUnavailable."""
    path = _group_path(group, options)
    refused: UpstreamResponse | None = None
    for endpoint in group.replicas:
        try:
            reply = await proxy.fetch(endpoint.url + path, request_id)
        except Exception as exc:  # the node failed: the next replica
            log.warning("a multi-store read from node %s failed: %s", endpoint.node_id, describe(exc))
            continue
        if reply.status == 503:
            refused = reply
            continue
        return reply
    if refused is not None:
        return refused
    return PartitionUnavailable(f"no node serving key {group.key!r} of {', '.join(group.stores)} answered")


def _group_entries(group: Group, reply: UpstreamResponse | ApiError) -> dict[str, dict[str, Any]]:
    """Each store's entry of a group, from its node's answer (its error, for each store, when it failed)."""
    if isinstance(reply, UpstreamResponse) and reply.status == 200:
        try:
            stores = loads_json(reply.body)["stores"]
            return {store: stores[store] for store in group.stores}
        except (ValueError, KeyError, TypeError):
            reply = PartitionUnavailable(f"a node answered {', '.join(group.stores)} with a malformed body")
    if isinstance(reply, UpstreamResponse):
        error = _reply_error(reply)
        return {store: dict(error, key=group.key) for store in group.stores}
    return {store: error_entry(group.key, reply) for store in group.stores}


def _reply_error(reply: UpstreamResponse) -> dict[str, Any]:
    try:
        body = loads_json(reply.body)
        return {"status": reply.status, "error": str(body["error"]), "message": str(body["message"])}
    except (ValueError, KeyError, TypeError):
        return {"status": reply.status, "error": "partition_unavailable", "message": f"a node answered {reply.status}"}


def _count(plane: Any, stores: Sequence[str], kind: str, status: int) -> None:
    for store in stores:
        plane.count(store, kind, status)


# -- many keys x stores -----------------------------------------------------------------------------------


def _read_stores_batch(plane: Any, call: Call, stores_text: str) -> Any:
    request = call.request
    stores = parse_stores(stores_text)
    options = parse_options(request.query, stores, bounds=False)
    parsed = parse_read_request(request.body, stores, plane.proxy.settings.max_batch_keys)
    if plane.quotas.active:
        for store, keys in parsed.keys.items():
            if keys:
                plane._admit(call, store, len(keys))
    return _read_batch(plane, call, parsed.rows, parsed.min_offsets, options)


async def _read_batch(plane: Any, call: Call, rows: list[Row], min_offsets: Any, options: ReadOptions) -> None:
    proxy = plane.proxy
    request_id = call.request.request_id
    answers: list[dict[str, dict[str, Any]]] = []
    groups: list[Group] = []
    where: list[int] = []  # the row of each group
    for r, row in enumerate(rows):
        key = row.key if isinstance(row.key, str) else str(row.key)
        entries, found = plan(proxy, key, [store for store, _ in row.at])
        answers.append(entries)
        groups += found
        where += [r] * len(found)
    headers = _headers(proxy, request_id, body=True)
    upstream = plane.upstream

    async def send(endpoint: Endpoint, ids: list[str], round_number: int) -> list[dict[str, Any]] | None:
        sent = [groups[int(i)] for i in ids]
        keys: dict[str, list[str]] = {}
        for group in sent:
            for store in group.stores:
                keys.setdefault(store, []).append(group.key)
        stores = list(keys)
        url = endpoint.url + f"/stores/{stores_segment(stores)}/{READ}" + options.query(stores, bounds=False)
        bounds = {store: n for store, n in min_offsets.items() if store in keys}
        proxy.metrics.upstream_requests += 1
        try:
            reply = await upstream.post(url, read_body(keys, bounds), headers)
        except Exception as exc:
            log.warning("a multi-store batch to node %s failed: %s", endpoint.node_id, describe(exc))
            return None
        if reply.status != 200:
            log.warning("node %s answered a multi-store batch with status %d", endpoint.node_id, reply.status)
            return None
        try:
            by_key = {result["key"]: result["stores"] for result in loads_json(reply.body)["results"]}
            out = []
            for group in sent:
                stores_of = by_key[group.key]
                entries = {store: stores_of[store] for store in group.stores}
                # A store its node could not answer (503) goes to the next replica with the group.
                refused = any(entry.get("status") == 503 for entry in entries.values())
                out.append({"status": 503 if refused else 200, "stores": entries})
            return out
        except (ValueError, KeyError, TypeError):
            log.warning("node %s answered a multi-store batch with a malformed body", endpoint.node_id)
            return None

    done = await forward_batch(
        {i: str(i) for i in range(len(groups))}, {i: group.replicas for i, group in enumerate(groups)}, send
    )
    for i, group in enumerate(groups):
        result = done.entries[i]
        entries = answers[where[i]]
        if "stores" in result:
            entries.update(result["stores"])
        else:  # no replica answered: each store's entry says so
            for store in group.stores:
                entries[store] = dict(result, key=group.key)
    results = []
    for row, entries in zip(rows, answers, strict=True):
        for store, _ in row.at:
            status = entries[store].get("status")
            plane.count(store, KIND_BATCH, status if isinstance(status, int) else 500)
        results.append({"key": row.key, "stores": {store: entries[store] for store, _ in row.at}})
    call.answer(200, list(JSON), encode_entry({"results": results}))


# The routes, for the router's route table (keyroute.router.dataplane).
ROUTES = (
    Route(f"/stores/{{stores}}/{READ}/{{key}}", ("GET",), _read_stores, None, (openapi.GET_STORES,)),
    Route(f"/stores/{{stores}}/{READ}", ("POST",), _read_stores_batch, None, (openapi.READ_STORES,)),
)
