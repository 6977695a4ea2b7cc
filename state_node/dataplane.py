"""The node's data plane: its routes under /stores/ and their handlers, on the shared skeleton
(keyroute.http.dataplane: admission, routing, path decoding, error answers and tasks are the skeleton's).

    GET|HEAD /stores/{store}/keys/{key}   `reads.read_key`: answered at once when held here, else passed on
                                          once (`reads.forward_read`) in a task; `?min_offset=N` a live
                                          partition has not applied yet waits for it in a task
    GET|HEAD /stores/{store}/keys/{key}/history, .../windows
                                          `reads.read_timeline`, answered or passed on as a key read is
    GET|HEAD /stores/{store}/partitions/{partition}/range
                                          `ranges.read_partition_range`: one partition held here
    POST     /stores/{store}/batch-get    `reads.read_batch`, the keys held elsewhere sent on (and the keys
                                          of partitions behind their bound waited for) in a task
    GET|HEAD /stores/{store}/schema       the Avro schema of the answers (keyroute.formats.avro_answers)
    GET|HEAD /stores/{stores}/read/{key}, POST /stores/{stores}/read
                                          several stores at once (keyroute.state_node.multi_read)

Key, timeline and batch reads answer Avro when the request's Accept prefers it (a 200 only: errors stay
JSON); a read forwarded to another node asks it for JSON and answers Avro here.

Every answer carries X-Keyroute-Node and is counted in the node's metrics (a batch by each key's entry).

With quotas (`--quota-file`, keyroute.http.quotas) every read a caller makes here directly is admitted
against its caller's quota of the store, at this node's share, before it is read or passed on (429
quota_exceeded with Retry-After past it), costing what it costs on a router; a read a member passes on (a
router's, another node's forward) was admitted where it came in and is not counted here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Final

from keyroute.api import HEADER_AUTH, HEADER_FORWARDED_BY, HEADER_HOPS, found_body, min_offset_query
from keyroute.auth.access import caller_of
from keyroute.auth.security import check_member_headers
from keyroute.formats.avro_answers import (
    JSON_ACCEPTS,
    answer_type,
    avro_answer,
    avro_headers,
    found_avro,
    found_entry_avro,
    is_avro,
    results_avro,
    schema_answer,
)
from keyroute.http import openapi
from keyroute.http.admission import Admission
from keyroute.http.dataplane import JSON, Call, Route, RoutedDataPlane, store_routes
from keyroute.http.exchange import Answer, Request
from keyroute.http.forwarding import parse_batch_request
from keyroute.http.quotas import Quotas, ServingShares, page_cost
from keyroute.http.tls import call_peer_identity, call_peer_role
from keyroute.runtime.metrics import KIND_RANGE
from keyroute.runtime.native import mypyc_attr
from keyroute.state_node import multi_read
from keyroute.state_node import openapi as node_openapi
from keyroute.state_node.app import Node
from keyroute.state_node.ranges import read_partition_range
from keyroute.state_node.reads import (
    Batch,
    Behind,
    Forward,
    find_store,
    forward_read,
    is_forwarded,
    read_batch,
    read_key,
    read_timeline,
)
from keyroute.storage.projection import json_projection

_HOPS: Final = HEADER_HOPS.encode("ascii")
_AUTH: Final = HEADER_AUTH.encode("ascii")
_FORWARDED_BY: Final = HEADER_FORWARDED_BY.encode("ascii")
_ACCEPT: Final = b"accept"
# C statics in the compiled build (setup.py), not globals looked up per read.
_read_key_here: Final = read_key
_answer_type: Final = answer_type
_JSON_ACCEPTS: Final = JSON_ACCEPTS
_min_offset_query: Final = min_offset_query


# -- one key, and a key's timeline ----------------------------------------------------------------------
# The handlers are module functions taking the plane first (as `RoutedDataPlane` calls a route's handler),
# defined before the class that names them in its route table.


def _read_key(plane: NodeDataPlane, call: Call, store: str, key: str) -> Any:
    if plane.quotas.active:
        plane._admit(call, store, 1)
    request = call.request
    accept = request.header(_ACCEPT)
    # No Accept, or one that means JSON (what keyroute's client sends): no call
    media = None if accept is None or accept in _JSON_ACCEPTS else _answer_type(accept, store)
    forwarded = False if request.header(_HOPS) is None else plane._forwarded(call)
    # Only a request with a query string pays for looking at it.
    min_offset = fields = None
    if request.query:
        min_offset = _min_offset_query(request.query)
        fields = json_projection(request.query, media)
    node = plane.node
    if fields is not None:
        answer = _read_key_here(node, store, key, forwarded, min_offset, fields=fields)
    elif media is None:
        answer = _read_key_here(node, store, key, forwarded, min_offset)
    else:  # a value read here is written as Avro straight from its stored JSON
        answer = _read_key_here(node, store, key, forwarded, min_offset, found=found_avro)
    if type(answer) is tuple:
        if media is None:
            call.answer(*answer)
        else:
            _reply(call, answer, media)
        return None
    if type(answer) is Behind:
        found = found_body if media is None else found_avro
        again = functools.partial(
            read_key, node, store, key, forwarded, answer.min_offset, waited=True, found=found, fields=fields
        )
        return _catch_up(plane, call, answer, again, media)
    return _forward(plane, call, answer, media)  # type: ignore[arg-type]


def _read_timeline(plane: NodeDataPlane, call: Call, store: str, key: str, read: str) -> Any:
    request = call.request
    if plane.quotas.active:
        plane._admit(call, store, page_cost(request.query))
    media = answer_type(request.header(_ACCEPT), store)
    forwarded = plane._forwarded(call)
    node = plane.node
    fields = json_projection(request.query, media)
    answer = read_timeline(node, store, key, read, request.query, forwarded, fields=fields)
    if type(answer) is tuple:
        _reply(call, answer, media)
        return None
    if type(answer) is Behind:
        query = request.query
        again = functools.partial(
            read_timeline, node, store, key, read, query, forwarded, waited=True, fields=fields
        )
        return _catch_up(plane, call, answer, again, media)
    return _forward(plane, call, answer, media)  # type: ignore[arg-type]


def _read_history(plane: NodeDataPlane, call: Call, store: str, key: str) -> Any:
    return _read_timeline(plane, call, store, key, "history")


def _read_windows(plane: NodeDataPlane, call: Call, store: str, key: str) -> Any:
    return _read_timeline(plane, call, store, key, "windows")


async def _catch_up(
    plane: NodeDataPlane,
    call: Call,
    behind: Behind,
    read_again: Callable[[], Answer | Forward | Behind],
    media: bytes | None = None,
) -> None:
    """A bounded read (of a key, or of a key's timeline) of a live partition held here, once it has applied
    the bound or the wait is over: `read_again` reads it then (waited), answered in `media` (None: JSON)."""
    node = plane.node
    await behind.live.wait_reached(behind.min_offset, node.settings.min_offset_wait_ms / 1000)
    # Read again: the partition may have moved or changed version meanwhile.
    answer = read_again()
    if isinstance(answer, Forward):
        answer = await forward_read(node, _target(call.request), answer, call.request.request_id)
    assert type(answer) is tuple
    _reply(call, answer, media)


async def _forward(plane: NodeDataPlane, call: Call, forward: Forward, media: bytes | None = None) -> None:
    request = call.request
    _reply(call, await forward_read(plane.node, _target(request), forward, request.request_id), media)


# -- a partition's key range, and a batch -----------------------------------------------------------------


def _read_range(plane: NodeDataPlane, call: Call, store: str, partition: str) -> None:
    if plane.quotas.active:
        plane._admit(call, store, page_cost(call.request.query))
    call.answer(*read_partition_range(plane.node, store, partition, call.request.query))


def _batch_get(plane: NodeDataPlane, call: Call, store: str) -> Any:
    request = call.request
    media = answer_type(request.header(_ACCEPT), store)
    forwarded = plane._forwarded(call)
    # The body's size is bounded by the server (keyroute.state_node.service.server_limits).
    parsed = parse_batch_request(request.body, plane._max_batch_keys)
    if plane.quotas.active:
        plane._admit(call, store, len(parsed.keys))
    fields = json_projection(request.query, media)
    if fields is not None:
        batch = read_batch(plane.node, store, parsed.keys, forwarded, parsed.bounds, fields=fields)
    elif media is None:
        batch = read_batch(plane.node, store, parsed.keys, forwarded, parsed.bounds)
    else:  # the keys found here are written as Avro entries straight from their stored JSON
        batch = read_batch(plane.node, store, parsed.keys, forwarded, parsed.bounds, found_entry_avro)
    if batch.complete:
        call.answer_counted(*_batch_answer(batch, media))  # its keys are counted, one each, as they are read
        return None
    return _finish_batch(call, batch, media)


async def _finish_batch(call: Call, batch: Batch, media: bytes | None) -> None:
    await batch.finish(call.request.request_id)
    call.answer_counted(*_batch_answer(batch, media))


# -- the answers' schema ----------------------------------------------------------------------------------


def _schema(plane: NodeDataPlane, call: Call, store: str) -> None:
    record = find_store(plane.node.ownership.map, store)
    call.answer(200, list(JSON), schema_answer(store, record.value_columns))


@mypyc_attr(allow_interpreted_subclasses=True)  # tests spy on it by subclassing
class NodeDataPlane(RoutedDataPlane):
    """`keyroute.http.exchange.DataPlane` for a node: `node` answers, `admission` admits. Its handlers are the
    module's functions above."""

    def __init__(
        self, node: Node, admission: Admission, quotas: Quotas | None = None, shares: ServingShares | None = None
    ) -> None:
        settings = node.settings
        metrics = node.metrics
        super().__init__(
            admission,
            metrics.count,
            max_parameter_bytes=settings.limits.max_key_bytes,
            error_headers=(node.node_header,),
            observe=metrics.observe_request,
            answered=metrics.answered,
            caller_answered=metrics.caller_answered,
        )
        self.node = node
        self._max_batch_keys: int = settings.max_batch_keys
        self.quotas = quotas if quotas is not None else Quotas(process="node")
        self.shares = shares if shares is not None else ServingShares(self.quotas)

    @classmethod
    def from_state(cls, state: Any) -> NodeDataPlane:
        """What `HttpServer(data_plane=...)` calls once the app's lifespan has started: the data plane of the
        node and admission checks on the node app's `state` (keyroute.state_node.app.create_app)."""
        plane = cls(state.node, state.admission, getattr(state, "quotas", None), getattr(state, "quota_shares", None))
        plane.callers = getattr(state, "callers", None)
        return plane

    def _forwarded(self, call: Call) -> bool:
        request = call.request
        hops = request.header(_HOPS)
        if hops is None:
            return False
        node = self.node
        members = node.members
        role = None
        if members.certificates:
            peer = call_peer_identity(call)
            if peer is not None:
                # A router's certificate may not forward as a node, node n1's not as node n2 (403).
                check_member_headers(peer, hops, request.header(_FORWARDED_BY))
                role = peer.role
        forwarded = is_forwarded(members, hops, request.header(_AUTH), role)
        if forwarded:
            node.metrics.forwarded_in += 1
        return forwarded

    def _admit(self, call: Call, store: str, cost: int) -> None:
        """The quota check of a caller's read made here directly: raises QuotaExceeded (429) past the caller's
        quota of `store` (this node's share of it, by the nodes serving the store in its map). A member's read
        is not counted. Only called while quotas are configured (`Quotas.active`)."""
        request = call.request
        node = self.node
        members = node.members
        if members.is_member(request.header(_AUTH), call_peer_role(call) if members.certificates else None):
            return
        self.shares.follow(node.ownership.map)
        self.quotas.admit(caller_of(call).name, store, cost)

    routes = store_routes(
        _read_key,
        _read_history,
        _read_windows,
        _batch_get,
        # A range read over one partition held here (a router's range read asks one per partition).
        Route(
            "/stores/{store}/partitions/{partition}/range",
            ("GET",),
            _read_range,
            KIND_RANGE,
            (node_openapi.GET_PARTITION_RANGE,),
        ),
        Route("/stores/{store}/schema", ("GET",), _schema, None, (openapi.GET_ANSWER_SCHEMA,)),
        # Several stores at once (keyroute.state_node.multi_read).
        *multi_read.ROUTES,
    )


def _batch_answer(batch: Batch, media: bytes | None) -> Answer:
    """A batch's answer: JSON, or Avro of `media` (its entries Avro already, or JSON written now)."""
    status, headers, body = batch.answer()
    if media is None:
        return status, headers, body
    return status, avro_headers(headers, media), results_avro(batch.entries)  # type: ignore[arg-type]


def _reply(call: Call, answer: Answer, media: bytes | None) -> None:
    """Answer `call` with `answer` (JSON), or as Avro of `media` when the request asked for it: a 200 written
    as Avro already (`found_avro`) gets its headers, any other is written now (an error stays JSON)."""
    if media is None:
        call.answer(*answer)
        return
    status, headers, body = answer
    if status == 200 and is_avro(body):
        call.answer(status, avro_headers(headers, media), body)
    else:
        call.answer(*avro_answer(status, headers, body, media))


def _target(request: Request) -> bytes:
    """The raw path with its query (a `min_offset` goes on with a forwarded read)."""
    return request.path + b"?" + request.query if request.query else request.path
