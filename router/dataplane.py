"""The router's data plane: its routes under /stores/ and their handlers, on the shared skeleton
(keyroute.http.dataplane: admission, routing, path decoding, error answers and tasks are the skeleton's).

    GET|HEAD /stores/{store}/keys/{key}   `Proxy.read` (with `?min_offset=N` when given): the node's reply
                                          passed on
    GET|HEAD /stores/{store}/keys/{key}/history, .../windows
                                          the same, routed by the key, the query passed on to the node
    GET|HEAD /stores/{store}/range        `ranges.read_range` in a task: every partition asked, the answers
                                          merged
    POST     /stores/{store}/batch-get    `Proxy.batch_get` in a task: the entries as JSON
    GET|HEAD /stores/{store}/schema       the Avro schema of the answers (keyroute.formats.avro_answers)
    GET|HEAD /stores/{stores}/read/{key}, POST /stores/{stores}/read
                                          several stores at once (keyroute.router.multi_read)

Key, timeline and batch reads answer Avro when the request's Accept prefers it (a 200 only: errors stay
JSON): the router asks the nodes for JSON and writes the Avro answer itself, so a JSON read costs one
header lookup more and nothing else.

Every answer of these routes is counted in the router's metrics (a batch by each key's entry).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from keyroute.api import min_offset_query
from keyroute.auth.access import caller_of
from keyroute.formats.avro_answers import (
    JSON_ACCEPTS,
    answer_type,
    avro_answer,
    avro_headers,
    encode_answer,
    schema_answer,
)
from keyroute.http import openapi
from keyroute.http.admission import Admission
from keyroute.http.dataplane import JSON, Call, Route, RoutedDataPlane, store_routes
from keyroute.http.forwarding import encode_entry, parse_batch_request
from keyroute.http.quotas import Quotas, page_cost
from keyroute.router import multi_read
from keyroute.router import openapi as router_openapi
from keyroute.router.ranges import read_range
from keyroute.runtime.metrics import KIND_BATCH, KIND_RANGE
from keyroute.runtime.native import mypyc_attr
from keyroute.storage.projection import json_projection

_ACCEPT: Final = b"accept"
_JSON_ACCEPTS: Final = JSON_ACCEPTS
_answer_type: Final = answer_type  # C statics in the compiled build, not globals looked up
_min_offset_query: Final = min_offset_query


# -- one key, and a key's timeline ----------------------------------------------------------------------


def _read_key(plane: RouterDataPlane, call: Call, store: str, key: str) -> None:
    if plane.quotas.active:
        plane._admit(call, store, 1)
    request = call.request
    accept = request.header(_ACCEPT)
    # No Accept, or one that means JSON (what keyroute's client sends): no call
    media = None if accept is None or accept in _JSON_ACCEPTS else _answer_type(accept, store)
    settle = call.settle if media is None else _avro_settle(call, media)
    # The node's reply is passed on as it is (the server adds the read's id unless the node echoed it).
    # Only a request with a query string pays for looking at it.
    query = request.query
    if query and (fields := json_projection(query, media)) is not None:
        # A projection goes to the node with the read (which checks it against the store's fields).
        plane.proxy.read(store, key, request.request_id, settle, _min_offset_query(query), tail=fields.query())
    elif query and (min_offset := _min_offset_query(query)) is not None:
        plane.proxy.read(store, key, request.request_id, settle, min_offset)
    else:
        plane.proxy.read(store, key, request.request_id, settle)


def _read_timeline(plane: RouterDataPlane, call: Call, store: str, key: str, read: str) -> None:
    """A history or windows read: routed by its key like a key read, its query passed on as it came (the
    node checks it)."""
    request = call.request
    media = answer_type(request.header(_ACCEPT), store)
    settle = call.settle if media is None else _avro_settle(call, media)
    if plane.quotas.active:
        plane._admit(call, store, page_cost(request.query))
    tail = "/" + read + ("?" + request.query.decode("latin-1") if request.query else "")
    plane.proxy.read(store, key, request.request_id, settle, tail=tail)


def _read_history(plane: RouterDataPlane, call: Call, store: str, key: str) -> None:
    _read_timeline(plane, call, store, key, "history")


def _read_windows(plane: RouterDataPlane, call: Call, store: str, key: str) -> None:
    _read_timeline(plane, call, store, key, "windows")


# -- key ranges and batches -----------------------------------------------------------------------------


async def _read_range(plane: RouterDataPlane, call: Call, store: str) -> None:
    request = call.request
    if plane.quotas.active:
        plane._admit(call, store, page_cost(request.query))
    call.answer(200, list(JSON), await read_range(plane.proxy, store, request.query, request.request_id))


async def _batch_get(plane: RouterDataPlane, call: Call, store: str) -> None:
    request = call.request
    media = answer_type(request.header(_ACCEPT), store)
    proxy = plane.proxy
    parsed = parse_batch_request(request.body, 0)  # the proxy checks (and counts) the number of keys
    if plane.quotas.active:
        plane._admit(call, store, len(parsed.keys))
    fields = json_projection(request.query, media) if request.query else None
    if fields is None:
        results = await proxy.batch_get(store, parsed.keys, request.request_id, parsed.bounds)
    else:
        if proxy.table.has_store(store):  # refused here, once, rather than by every node
            fields.check_record(store, proxy.table.map.stores[store])
        results = await proxy.batch_get(store, parsed.keys, request.request_id, parsed.bounds, fields=fields.query())
    proxy.metrics.count_results(store, KIND_BATCH, results)
    if media is None:
        call.answer_counted(200, list(JSON), encode_entry({"results": results}))
    else:
        call.answer_counted(200, avro_headers(JSON, media), encode_answer({"results": results}))


# -- the answers' schema --------------------------------------------------------------------------------


def _schema(plane: RouterDataPlane, call: Call, store: str) -> None:
    table = plane.proxy.table
    if not table.has_store(store):
        raise table.unknown_store(store)
    call.answer(200, list(JSON), schema_answer(store, table.map.stores[store].value_columns))


@mypyc_attr(allow_interpreted_subclasses=True)  # tests spy on it by subclassing
class RouterDataPlane(RoutedDataPlane):
    """Answers the exchanges `keyroute.http.server.HttpServer` hands it with the proxy and the admission
    checks the router app's lifespan and `create_app` put on the app's state: the same counters as the
    app's own `RequestGuard`. Its handlers are the module's functions below, each taking the plane first
    (as `RoutedDataPlane` calls a route's handler), defined before it."""

    def __init__(
        self, proxy: Any, admission: Admission, max_key_bytes: int = 0, quotas: Quotas | None = None
    ) -> None:
        # `proxy` is a keyroute.router.proxy.Proxy, or a test's stand-in for one: typed Any, because the
        # compiled build checks a parameter's declared class when the function is called.
        metrics = proxy.metrics
        super().__init__(
            admission,
            metrics.count,
            max_parameter_bytes=max_key_bytes,
            observe=metrics.observe_request,
            answered=metrics.answered,
            caller_answered=metrics.caller_answered,
        )
        self.proxy: Any = proxy  # see above: a Proxy
        # The wire to the nodes (keyroute.http.upstream.Upstream), for the requests the proxy does not make
        # itself (keyroute.router.multi_read's batches).
        self.upstream: Any = None
        self.quotas = quotas if quotas is not None else Quotas()

    @classmethod
    def factory(cls, max_key_bytes: int) -> Callable[[Any], RouterDataPlane]:
        """What `HttpServer(data_plane=...)` calls with the router app's state once its lifespan started."""

        def plane(state: Any) -> RouterDataPlane:
            made = cls(state.proxy, state.admission, max_key_bytes, getattr(state, "quotas", None))
            made.callers = getattr(state, "callers", None)
            made.upstream = getattr(state, "upstream", None)
            return made

        return plane

    def _admit(self, call: Call, store: str, cost: int) -> None:
        """The quota check of every read, before it is proxied: raises QuotaExceeded (429) past the caller's
        quota of `store`. Only called while quotas are configured (`Quotas.active`)."""
        self.quotas.admit(caller_of(call).name, store, cost)

    # The data API's routes, with a range read over a whole store (the router gathers it from every
    # partition's nodes) and the answers' schema.
    routes = store_routes(
        _read_key,
        _read_history,
        _read_windows,
        _batch_get,
        Route("/stores/{store}/range", ("GET",), _read_range, KIND_RANGE, (router_openapi.GET_RANGE,)),
        Route("/stores/{store}/schema", ("GET",), _schema, None, (openapi.GET_ANSWER_SCHEMA,)),
        # Several stores at once (keyroute.router.multi_read).
        *multi_read.ROUTES,
        batch_operation=router_openapi.BATCH_GET,
    )


def _avro_settle(call: Call, media: bytes) -> Callable[[Any], None]:
    """What settles a read asked for in Avro of `media`: the node's JSON reply, a 200 written as Avro."""

    def settle(result: Any) -> None:
        if isinstance(result, BaseException) or result.status != 200:
            call.settle(result)
            return
        call.answer(*avro_answer(result.status, result.headers, result.body, media))

    return settle
