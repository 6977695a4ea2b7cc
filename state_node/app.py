"""The node's HTTP face: reads answered from local partitions or forwarded once, plus admin endpoints.

A forwarded request carries `X-Keyroute-Hops: 1` and is never forwarded again (503 instead). Answers
carry `X-Keyroute-Generation`, the generation of the map this node routed with, so a router learns how
far behind its own view is when a node had to forward for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
from keyroute.core import zk
from keyroute.core.api import (
    HEADER_AUTH,
    HEADER_FORWARDED_BY,
    HEADER_GENERATION,
    HEADER_HOPS,
    HEADER_NODE,
    HEADER_PARTITION,
    HEADER_REQUEST_ID,
    HEADER_VERSION,
    ApiError,
    BadKey,
    BadRequest,
    BatchKeyTooLong,
    KeyNotFound,
    PartitionUnavailable,
    PayloadTooLarge,
    StoreNotFound,
    found_body,
    key_path_segment,
    key_too_long,
)
from keyroute.core.http_server import Answer, DirectAnswerProtocol, ExpressCycle, Scope
from keyroute.core.key_format import Key, KeyFormat, KeyFormatError, key_from_value, parse_key
from keyroute.core.logs import SCOPE_REQUEST_ID, bind_request_id
from keyroute.core.map_watcher import MapWatcher
from keyroute.core.metrics import CONTENT_TYPE, KIND_BATCH, KIND_KEY
from keyroute.core.partition_map import Endpoint, PartitionMap, StoreRecord
from keyroute.core.request_guard import (
    Admission,
    RequestGuard,
    first_header,
    read_body,
    request_id_in,
    request_id_of,
)
from keyroute.core.security import BearerAuth, ClusterAuth
from keyroute.core.settings import NodeSettings
from keyroute.node.controller import Controller
from keyroute.node.metrics import NodeMetrics
from keyroute.node.ownership import Ownership
from keyroute.node.registration import Registration
from keyroute.node.store import PartitionStore, load_partition
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

# Never relayed from an upstream response: they describe that one connection, or the body as sent on
# it (httpx has already decoded it, and Starlette sets the length of what we send).
_NOT_RELAYED = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "content-encoding",
        "date",
        "server",
    }
)
# Seconds a client should wait before asking again when nobody serves a partition (rebalance or reload).
RETRY_AFTER_S = 1
# For key reads answered before the application (LocalReadProtocol).
_JSON = (b"content-type", b"application/json")
_PARTITION = HEADER_PARTITION.encode("ascii")
_NODE = HEADER_NODE.encode("ascii")
_VERSION = HEADER_VERSION.encode("ascii")
_HOPS = HEADER_HOPS.encode("ascii")
_GENERATION = HEADER_GENERATION.encode("ascii")
_REQUEST_ID = HEADER_REQUEST_ID.encode("ascii")
# A router re-encodes the keys it sends on (integers become strings, `", "` separators): a body within the
# router's limit may grow by this much per key and must still fit the node's.
_REENCODING_BYTES_PER_KEY = 8


@dataclass(slots=True)
class Node:
    """Everything a request handler needs, created by the lifespan and kept on `app.state.node`."""

    settings: NodeSettings
    ownership: Ownership
    http: httpx.AsyncClient
    controller: Controller | None = None
    registration: Registration | None = None
    metrics: NodeMetrics = field(default_factory=NodeMetrics)
    # Tells other members' requests (whose hop header counts) from clients' (whose does not).
    members: ClusterAuth = field(init=False)

    def __post_init__(self) -> None:
        self.members = ClusterAuth(self.settings.access.cluster_secret)

    @property
    def node_id(self) -> str:
        return self.settings.node_id

    async def leave(self) -> None:
        """Graceful leave (SIGTERM): take no new work, let the controller move every partition away,
        wait (at most `drain_timeout_s`) until live nodes serve them at the published version, then
        de-announce. The caller stops the HTTP server afterwards, which finishes in-flight requests."""
        timeout_s = self.settings.drain_timeout_s
        log.info("node %s is leaving: handing its partitions over (waiting at most %.0fs)", self.node_id, timeout_s)
        self.ownership.leave()
        if self.registration is not None:
            try:
                await run_in_threadpool(self.registration.mark_leaving)
            except Exception as exc:  # ZooKeeper unreachable: nobody can take over; the drain times out
                log.warning("marking node %s as leaving failed: %s", self.node_id, exc)
        if self.controller is not None:
            self.controller.leave()  # a leader writes the assignment without us, then resigns
        remaining = await self.ownership.wait_handed_over(timeout_s)
        if remaining:
            log.warning(
                "node %s leaves after %.0fs with %d partition(s) served by no other live node: %s",
                self.node_id,
                timeout_s,
                len(remaining),
                ", ".join(remaining[:10]),
            )
        else:
            log.info("node %s: every partition it served is served elsewhere", self.node_id)
        await self.ownership.withdraw()
        # Routers see the withdrawal through the same kind of watch as we do: once ours has fired,
        # theirs have too (or are about to). A straggler meanwhile is still answered from the view.
        await self.ownership.wait_for_map(lambda m: self.node_id not in m.serving, timeout_s=2.0)


def create_app(
    settings: NodeSettings,
    *,
    drop_grace_s: float = 2.0,
    max_parallel_loads: int = 2,
) -> Starlette:
    """The node application; its lifespan joins the cluster on startup and leaves it on shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with _running_node(settings, drop_grace_s, max_parallel_loads, metrics) as node:
            app.state.node = node
            yield

    node_id = settings.node_id
    metrics = NodeMetrics()

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        headers = {HEADER_NODE: node_id, **exc.headers, **_request_id_header(request)}
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        body = {"error": code, "message": str(exc.detail)}
        return JSONResponse(
            body,
            status_code=exc.status_code,
            headers={HEADER_NODE: node_id, **(exc.headers or {}), **_request_id_header(request)},
        )

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        body = {"error": "internal_error", "message": "the node failed to answer; see its log"}
        return JSONResponse(body, status_code=500, headers={HEADER_NODE: node_id, **_request_id_header(request)})

    routes = [
        Route("/stores/{store}/keys/{key:path}", _data(KIND_KEY, get_key), methods=["GET"]),
        Route("/stores/{store}/batch-get", _data(KIND_BATCH, batch_get), methods=["POST"]),
        Route("/admin/partition-map", partition_map, methods=["GET"]),
        Route("/admin/route", route, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
    ]
    access = settings.access
    metrics.admission = Admission(
        max_concurrent_requests=settings.limits.max_concurrent_requests,
        max_header_bytes=settings.limits.max_header_bytes,
        admin=BearerAuth(access.admin_token),
        protected=("/admin", "/metrics") if access.metrics_require_token else ("/admin",),
        retry_after_s=RETRY_AFTER_S,
    )
    guard = Middleware(RequestGuard, admission=metrics.admission, error_headers=[(HEADER_NODE, node_id)])
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[guard],
        exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: internal_error},
    )
    # Shared with LocalReadProtocol, which answers reads of keys held here before the middleware.
    app.state.admission = metrics.admission
    return app


@contextlib.asynccontextmanager
async def _running_node(
    settings: NodeSettings, drop_grace_s: float, max_parallel_loads: int, metrics: NodeMetrics | None = None
) -> AsyncIterator[Node]:
    metrics = metrics if metrics is not None else NodeMetrics()
    loop = asyncio.get_running_loop()
    client = await run_in_threadpool(zk.connect, settings.zk)
    registration = Registration(client, settings.node_id, settings.http.url)
    ownership = Ownership(
        settings,
        registration,
        drop_grace_s=drop_grace_s,
        max_parallel_loads=max_parallel_loads,
        loader=metrics.timed(load_partition),
    )
    metrics.watch(ownership)

    def on_map(new_map: PartitionMap) -> None:
        # Called on the watcher's thread: hand the immutable map to the loop and return at once.
        with contextlib.suppress(RuntimeError):  # the loop is closing: the map no longer matters
            loop.call_soon_threadsafe(ownership.on_map, new_map)

    watcher = MapWatcher(client, on_map)
    controller = Controller(client, settings.node_id)
    timeout = settings.forward_timeout_s
    http = httpx.AsyncClient(
        timeout=httpx.Timeout(timeout, connect=min(1.0, timeout)),
        limits=httpx.Limits(max_connections=256, max_keepalive_connections=64, keepalive_expiry=30.0),
        # Peers are addressed directly: proxy settings from the environment must not reroute them.
        trust_env=False,
        follow_redirects=False,
    )
    node = Node(settings, ownership, http, controller, registration, metrics)
    try:
        await run_in_threadpool(registration.register_node)
        watcher.start()
        controller.start()
        yield node
    finally:
        # Reverse order: stop deciding (controller), stop reacting (watcher), stop holding (ownership),
        # then tell the cluster we are gone before the session closes.
        await run_in_threadpool(controller.stop)
        await run_in_threadpool(watcher.stop)
        await ownership.stop()
        try:
            await run_in_threadpool(registration.withdraw)
        except Exception as exc:  # the session's end removes the records anyway
            log.warning("withdrawing node %s from ZooKeeper failed: %s", settings.node_id, exc)
        await run_in_threadpool(zk.close, client)
        await http.aclose()


def _node(request: Request) -> Node:
    node: Node = request.app.state.node
    return node


def _forwarded(request: Request) -> bool:
    """Whether another node already forwarded this request. An unreadable hop count counts as forwarded:
    a request we cannot prove fresh is never forwarded again."""
    raw = request.headers.get(HEADER_HOPS)
    if raw is None:
        return False
    if not _node(request).members.is_member(request.headers.get(HEADER_AUTH)):
        # A client's hop count (a cluster secret is set and the request does not prove membership): ignored,
        # so a client can neither stop this node from forwarding nor make it forward twice.
        return False
    try:
        return int(raw.strip()) >= 1
    except ValueError:
        return True


def _store(m: PartitionMap, name: str) -> StoreRecord:
    record = m.stores.get(name)
    if record is None:
        raise StoreNotFound(f"no store named {name!r}")
    return record


def _parse(record: StoreRecord, text: str) -> Key:
    try:
        return parse_key(record.key_format, text)
    except KeyFormatError as exc:
        raise BadKey(str(exc)) from exc


def _answer_locally(held: PartitionStore | None, endpoints: Sequence[Endpoint], forwarded: bool) -> bool:
    """Serve from the local copy unless the map routes the partition to a newer version elsewhere (and
    we may still forward): answers then never go back to an older version than the router would give."""
    if held is None:
        return False
    return forwarded or not endpoints or held.version >= endpoints[0].version


# -- data API ---------------------------------------------------------------------------------------


async def get_key(request: Request) -> Response:
    node = _node(request)
    raw_path = (request.scope.get("raw_path") or request.url.path.encode("utf-8")).split(b"?", 1)[0]
    parsed = key_path_segment(raw_path, node.settings.limits.max_key_bytes)
    if parsed is None:
        raise HTTPException(404, "expected /stores/{store}/keys/{key} with the key as one path segment")
    store_name, key_text = parsed
    m = node.ownership.map
    record = _store(m, store_name)
    key = _parse(record, key_text)
    route = m.route(record, key.data)
    forwarded = _forwarded(request)
    hops = "1" if forwarded else "0"
    held = node.ownership.local(store_name, route.partition)
    others = [ep for ep in route.serving if ep.node_id != node.node_id]
    if held is not None and _answer_locally(held, others, forwarded):
        node.metrics.local_answers += 1
        headers = {
            HEADER_PARTITION: str(route.partition),
            HEADER_NODE: node.node_id,
            HEADER_VERSION: str(held.version),
            HEADER_HOPS: hops,
            HEADER_GENERATION: str(m.generation),
        }
        value = held.get(key.data)
        if value is None:
            raise KeyNotFound(f"key {key.text!r} is not in store {store_name!r}", headers)
        body = found_body(store_name, key.text, route.partition, held.version, value)
        return Response(body, media_type="application/json", headers=headers)
    if forwarded:
        # Our view and the forwarding node's differ (a rebalance is in flight): say so, never bounce.
        raise PartitionUnavailable(
            f"node {node.node_id} does not serve partition {route.partition} of store {store_name!r}"
            " and does not forward a forwarded request",
            RETRY_AFTER_S,
        )
    if not others:
        raise PartitionUnavailable(f"no node serves partition {route.partition} of store {store_name!r}", RETRY_AFTER_S)
    return await _forward_get(
        node, raw_path, others, request.scope.get(SCOPE_REQUEST_ID), route.partition, m.generation
    )


def answer_local_read(
    node: Node, raw_path: bytes, headers: Sequence[tuple[bytes, bytes]], request_id: Callable[[], str]
) -> Answer | None:
    """The answer to a client's or router's read of a key this node holds, found in its own copy, exactly
    as `get_key` gives it; None for everything else (a forwarded request, a partition held elsewhere or
    at an older version, a missing key, a bad key or path), which the application answers. `headers` are
    the request's (lower-case names); `request_id()` gives its id, only called for an answer."""
    query = raw_path.find(b"?")
    try:
        parsed = key_path_segment(raw_path if query < 0 else raw_path[:query], node.settings.limits.max_key_bytes)
    except ApiError:
        return None  # a key over the limit: the application's 414
    if parsed is None:
        return None
    if first_header(headers, _HOPS) is not None:
        return None  # counted and checked by the application
    store_name, key_text = parsed
    m = node.ownership.map
    record = m.stores.get(store_name)
    if record is None:
        return None
    try:
        key = parse_key(record.key_format, key_text)
    except KeyFormatError:
        return None
    route = m.route(record, key.data)
    held = node.ownership.local(store_name, route.partition)
    if held is None:
        return None
    others = [ep for ep in route.serving if ep.node_id != node.node_id]
    if not _answer_locally(held, others, False):
        return None
    value = held.get(key.data)
    if value is None:
        return None
    node.metrics.local_answers += 1
    node.metrics.count(store_name, KIND_KEY, 200)
    headers = [
        _JSON,
        (_PARTITION, str(route.partition).encode("ascii")),
        (_NODE, node.node_id.encode("latin-1")),
        (_VERSION, str(held.version).encode("ascii")),
        (_HOPS, b"0"),
        (_GENERATION, str(m.generation).encode("ascii")),
        (_REQUEST_ID, request_id().encode("latin-1")),
    ]
    return 200, headers, found_body(store_name, key.text, route.partition, held.version, value)


class LocalReadProtocol(DirectAnswerProtocol):
    """uvicorn's httptools protocol answering reads of keys this node holds itself (keyroute_core.http_server),
    everything else through the application: the express way as soon as the request head is parsed, or,
    for a pipelined read waiting behind another request, where uvicorn would start the application."""

    async def answer(self, scope: Scope, raw_path: bytes) -> Answer | None:
        return answer_local_read(self.owner_app.state.node, raw_path, scope["headers"], lambda: request_id_of(scope))

    def express(
        self, cycle: ExpressCycle, raw_path: bytes, target_bytes: int, headers: list[tuple[bytes, bytes]]
    ) -> Any:
        state = self.owner_app.state
        admission: Admission = state.admission
        # A key path starts with /stores/: percent-decoding cannot make it a probe or an admin path.
        refusal = admission.admit_head(raw_path.decode("latin-1"), target_bytes, headers)
        if refusal is not None:
            return self.express_error(refusal, request_id_in(headers))
        try:
            return answer_local_read(state.node, raw_path, headers, lambda: request_id_in(headers))
        except Exception:
            # As on every other way in: logged, answered 500 without detail, the connection goes on.
            log.exception("answering a local read failed")
            return self.express_error(ApiError("internal error"), request_id_in(headers))
        finally:
            admission.release()


def local_read_protocol(app: Starlette, node_id: str, base: type[HttpToolsProtocol] = HttpToolsProtocol) -> type:
    """The uvicorn protocol class (`base` with `LocalReadProtocol`'s reads) for the node app `app`."""
    return LocalReadProtocol.for_app(app, base, extra_error_headers=((_NODE, node_id.encode("latin-1")),))


async def _forward_get(
    node: Node,
    raw_path: bytes,
    endpoints: Sequence[Endpoint],
    request_id: str | None,
    partition: int,
    generation: int,
) -> Response:
    headers = _forward_headers(request_id, node.members)
    refused: tuple[httpx.Response, bytes] | None = None
    failures = []
    for endpoint in endpoints:
        url = httpx.URL(endpoint.url).copy_with(raw_path=raw_path)
        node.metrics.forwards += 1
        try:
            upstream = await node.http.get(url, headers=headers)
        except httpx.HTTPError as exc:
            node.metrics.forward_failures += 1
            log.warning("forwarding a read to node %s failed: %s", endpoint.node_id, type(exc).__name__)
            failures.append(f"{endpoint.node_id}: {type(exc).__name__}")
            continue
        try:
            body = upstream.content
        finally:
            await upstream.aclose()
        if upstream.status_code == 503:
            # That node stopped serving it too; another replica still might.
            refused = (upstream, body)
            continue
        node.metrics.forwarded_answers += 1
        return _relay(node, upstream, body, generation)
    if refused is not None:
        return _relay(node, *refused, generation)
    raise PartitionUnavailable(f"no node serving partition {partition} answered ({', '.join(failures)})", RETRY_AFTER_S)


def _forward_headers(request_id: str | None, members: ClusterAuth) -> dict[str, str]:
    # Only what the next node needs: never the client's Host, Content-Length or hop-by-hop headers. The
    # membership proof makes the next node honour the hop count, so it never forwards again.
    headers = {HEADER_HOPS: "1", "accept-encoding": "identity", "accept": "application/json", **members.headers()}
    if request_id:
        headers[HEADER_REQUEST_ID] = request_id
    return headers


def _relay(node: Node, upstream: httpx.Response, body: bytes, generation: int) -> Response:
    named = {token.strip().lower() for value in upstream.headers.get_list("connection") for token in value.split(",")}
    headers = {
        name: value for name, value in upstream.headers.items() if name not in _NOT_RELAYED and name not in named
    }
    headers[HEADER_HOPS] = "1"
    headers[HEADER_FORWARDED_BY] = node.node_id
    # The map this (forwarding) node routed with, not the one of the node that read the value.
    headers[HEADER_GENERATION] = str(generation)
    return Response(body, status_code=upstream.status_code, headers=headers)


async def batch_get(request: Request) -> Response:
    node = _node(request)
    settings = node.settings
    store_name = request.path_params["store"]
    keys = _batch_keys(await read_body(request, _body_limit(settings), settings.limits.body_timeout_s))
    if len(keys) > settings.max_batch_keys:
        raise PayloadTooLarge(f"{len(keys)} keys in one batch; at most {settings.max_batch_keys} are allowed")
    m = node.ownership.map
    record = _store(m, store_name)
    forwarded = _forwarded(request)

    results: list[bytes | None] = [None] * len(keys)
    texts: dict[int, str] = {}
    choices: dict[int, list[Endpoint]] = {}
    max_key_bytes = settings.limits.max_key_bytes
    for i, raw in enumerate(keys):
        if isinstance(raw, str) and key_too_long(raw, max_key_bytes):
            node.metrics.count(store_name, KIND_BATCH, BatchKeyTooLong.status)
            results[i] = _error_entry(raw, BatchKeyTooLong(f"the key is longer than {max_key_bytes} bytes"))
            continue
        try:
            key = _batch_key(record.key_format, raw)
        except BadKey as exc:
            node.metrics.count(store_name, KIND_BATCH, exc.status)
            results[i] = _error_entry(raw if isinstance(raw, str) else str(raw), exc)
            continue
        route = m.route(record, key.data)
        held = node.ownership.local(store_name, route.partition)
        others = [ep for ep in route.serving if ep.node_id != node.node_id]
        if held is not None and _answer_locally(held, others, forwarded):
            node.metrics.local_answers += 1
            value = held.get(key.data)
            if value is None:
                node.metrics.count(store_name, KIND_BATCH, KeyNotFound.status)
                results[i] = _error_entry(key.text, KeyNotFound(f"key {key.text!r} is not in store {store_name!r}"))
            else:
                node.metrics.count(store_name, KIND_BATCH, 200)
                results[i] = _found_entry(key.text, route.partition, held.version, value)
        elif forwarded or not others:
            node.metrics.count(store_name, KIND_BATCH, PartitionUnavailable.status)
            why = "does not forward a forwarded request" if forwarded else "no node serves it"
            results[i] = _error_entry(
                key.text,
                PartitionUnavailable(f"partition {route.partition} of store {store_name!r}: {why}", RETRY_AFTER_S),
            )
        else:
            texts[i] = key.text
            choices[i] = others

    if choices:
        await _forward_batch(node, store_name, texts, choices, results, request.scope.get(SCOPE_REQUEST_ID))

    headers = {
        HEADER_NODE: node.node_id,
        # 1 also when this node forwarded some keys itself: the router's view of them was stale.
        HEADER_HOPS: "1" if forwarded or choices else "0",
        HEADER_GENERATION: str(m.generation),
    }
    body = b'{"results":[' + b",".join(entry or b"null" for entry in results) + b"]}"
    return Response(body, media_type="application/json", headers=headers)


async def _forward_batch(
    node: Node,
    store: str,
    texts: dict[int, str],
    choices: dict[int, list[Endpoint]],
    results: list[bytes | None],
    request_id: str | None,
) -> None:
    """One batch-get per serving node, in parallel; keys whose node fails move to their next replica."""
    path = f"/stores/{quote(store, safe='')}/batch-get"
    headers = {**_forward_headers(request_id, node.members), "content-type": "application/json"}
    attempt = dict.fromkeys(choices, 0)
    refused: dict[int, bytes] = {}
    pending = sorted(choices)
    while pending:
        groups: dict[str, list[int]] = {}
        for i in pending:
            groups.setdefault(choices[i][attempt[i]].url, []).append(i)
        answers = await asyncio.gather(
            *(_node_batch(node, url + path, [texts[i] for i in indexes], headers) for url, indexes in groups.items())
        )
        pending = []
        for indexes, answer in zip(groups.values(), answers, strict=True):
            for n, i in enumerate(indexes):
                entry = answer[n] if answer is not None else None
                if entry is not None and entry.get("status") != 503:
                    node.metrics.forwarded_answers += 1
                    status = entry.get("status")
                    node.metrics.count(store, KIND_BATCH, status if isinstance(status, int) else 500)
                    results[i] = _json(entry)
                    continue
                if entry is not None:
                    refused[i] = _json(entry)
                attempt[i] += 1
                if attempt[i] < len(choices[i]):
                    pending.append(i)
                else:
                    node.metrics.count(store, KIND_BATCH, PartitionUnavailable.status)
                    results[i] = refused.get(i) or _error_entry(
                        texts[i],
                        PartitionUnavailable(f"no node serving the partition of key {texts[i]!r} answered"),
                    )


async def _node_batch(node: Node, url: str, texts: list[str], headers: dict[str, str]) -> list[dict[str, Any]] | None:
    """Another node's entries for `texts`, in order; None if it failed or answered something unusable."""
    payload = json.dumps({"keys": texts}, ensure_ascii=False).encode("utf-8")
    node.metrics.forwards += 1
    try:
        upstream = await node.http.post(url, content=payload, headers=headers)
    except httpx.HTTPError as exc:
        node.metrics.forward_failures += 1
        log.warning("forwarding a batch-get to %s failed: %s", url, type(exc).__name__)
        return None
    try:
        body = upstream.content
    finally:
        await upstream.aclose()
    if upstream.status_code != 200:
        node.metrics.forward_failures += 1
        log.warning("forwarded batch-get to %s answered %d", url, upstream.status_code)
        return None
    try:
        entries = json.loads(body)["results"]
    except (ValueError, KeyError, TypeError):
        node.metrics.forward_failures += 1
        return None
    if not isinstance(entries, list) or len(entries) != len(texts) or not all(isinstance(e, dict) for e in entries):
        node.metrics.forward_failures += 1
        return None
    return entries


def _body_limit(settings: NodeSettings) -> int:
    """max_body_bytes, plus room for a router's re-encoding of a batch it split (a few bytes per key)."""
    limit = settings.limits.max_body_bytes
    return limit + _REENCODING_BYTES_PER_KEY * settings.max_batch_keys if limit else 0


def _batch_keys(body: bytes) -> list[Any]:
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(f"the body is not JSON: {exc}") from exc
    if not isinstance(obj, dict) or not isinstance(obj.get("keys"), list):
        raise BadRequest('expected a JSON object {"keys": [...]}')
    keys: list[Any] = obj["keys"]
    for raw in keys:
        if not isinstance(raw, str) and not (isinstance(raw, int) and not isinstance(raw, bool)):
            raise BadRequest(f"keys must be JSON strings (or integers for integer key formats), got {raw!r:.40}")
    return keys


_INT_FORMATS = frozenset({KeyFormat.INT16, KeyFormat.INT32, KeyFormat.INT64})


def _batch_key(fmt: KeyFormat, raw: str | int) -> Key:
    if isinstance(raw, int) and fmt not in _INT_FORMATS:
        raise BadKey(f"a {fmt.value} key must be a JSON string")
    try:
        return key_from_value(fmt, raw)
    except KeyFormatError as exc:
        raise BadKey(str(exc)) from exc


def _found_entry(key: str, partition: int, version: int, value: bytes) -> bytes:
    head = json.dumps(
        {"key": key, "status": 200, "partition": partition, "version": version}, ensure_ascii=False
    ).encode("utf-8")
    return head[:-1] + b', "value": ' + value + b"}"


def _error_entry(key: str, error: ApiError) -> bytes:
    return _json({"key": key, "status": error.status, "error": error.code, "message": error.message})


def _json(obj: Any) -> bytes:
    try:
        return json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        # A key echoed back may hold a lone surrogate (valid in JSON text, not in UTF-8): escape it.
        return json.dumps(obj).encode("ascii")


def _data(kind: str, handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """A data endpoint with its request id bound (logs, forwards, the answer's X-Request-ID) and its
    outcome counted; a batch counts its keys itself, and only a batch refused whole is counted here."""

    async def endpoint(request: Request) -> Response:
        request_id = bind_request_id(request.scope, request.headers.get(HEADER_REQUEST_ID))
        metrics = _node(request).metrics
        if _forwarded(request):
            metrics.forwarded_in += 1
        store = request.path_params.get("store", "")
        try:
            response = await handler(request)
        except ApiError as exc:
            metrics.count(store, kind, exc.status)
            raise
        if kind == KIND_KEY:
            metrics.count(store, kind, response.status_code)
        if HEADER_REQUEST_ID not in response.headers:  # a relayed answer carries the id the other node got
            response.headers[HEADER_REQUEST_ID] = request_id
        return response

    return endpoint


def _request_id_header(request: Request) -> dict[str, str]:
    """X-Request-ID for an error answer: the id bound to the request, else the client's or a new one."""
    return {HEADER_REQUEST_ID: bind_request_id(request.scope, request.headers.get(HEADER_REQUEST_ID))}


# -- admin --------------------------------------------------------------------------------------------


async def partition_map(request: Request) -> Response:
    node = _node(request)
    body = node.ownership.map.describe()
    body["node"] = node.node_id
    body["controller"] = node.controller.is_leader if node.controller is not None else False
    body["leaving"] = node.ownership.leaving
    body["local"] = node.ownership.describe()
    return JSONResponse(body)


async def route(request: Request) -> Response:
    node = _node(request)
    store_name = request.query_params.get("store")
    key_text = request.query_params.get("key")
    if store_name is None or key_text is None:
        raise BadRequest("both query parameters are required: /admin/route?store=S&key=K")
    m = node.ownership.map
    record = _store(m, store_name)
    key = _parse(record, key_text)
    r = m.route(record, key.data)
    held = node.ownership.local(store_name, r.partition)
    return JSONResponse(
        {
            "store": store_name,
            "key": key.text,
            "partitioner": record.partitioner.value,
            "hash": r.hash,
            "partition": r.partition,
            "partitions": record.partitions,
            "version": record.version,
            "assigned": list(r.assigned),
            "serving": [{"node": ep.node_id, "url": ep.url, "version": ep.version} for ep in r.serving],
            "local": {"node": node.node_id, "version": held.version if held is not None else None},
            "map_stale": m.stale,
        }
    )


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def metrics_endpoint(request: Request) -> Response:
    return Response(_node(request).metrics.render(), headers={"content-type": CONTENT_TYPE})


async def readyz(request: Request) -> Response:
    # 200 while the node holds what is assigned to it, also when ZooKeeper is away (the body then says
    # the map is stale): a load balancer must keep sending traffic to a node that can answer.
    node = _node(request)
    readiness = node.ownership.readiness()
    body = {"node": node.node_id, **readiness.describe(), "checked_at": time.time()}
    return JSONResponse(body, status_code=200 if readiness.ready else 503)
