"""The router's HTTP application: the data API, admin and health endpoints, one error mapping.

Its lifespan owns the long-lived resources: the partition-map source (ZooKeeper) and the HTTP client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from keyroute_core.api import HEADER_REQUEST_ID, ApiError, BadRequest, PayloadTooLarge, key_path_segment
from keyroute_core.partition_map import PartitionMap
from keyroute_core.settings import RouterSettings
from router.fast_upstream import FastUpstream
from router.map_source import MapSource, ZooKeeperMapSource
from router.proxy import Proxy, parse_batch_body
from router.routing_table import RoutingTable
from router.upstream import HttpxUpstream, Upstream

log = logging.getLogger(__name__)

# Room for long keys plus JSON punctuation; a body beyond this cannot be a legitimate batch.
MAX_BODY_BYTES_PER_KEY = 4096

_HTTP_ERROR_CODES = {404: "not_found", 405: "method_not_allowed"}


class PathNotFound(ApiError):
    status = 404
    code = "not_found"


class BodyTooLarge(PayloadTooLarge):
    code = "body_too_large"


def create_app(
    settings: RouterSettings,
    *,
    map_source: MapSource | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> Starlette:
    """The router app. `map_source` and `transport` replace ZooKeeper and the network in tests."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        source = map_source if map_source is not None else ZooKeeperMapSource(settings.zk)
        # The data path uses our own keep-alive pool (benchmarks/RESULTS.md, "Router": httpx costs ~20x
        # more CPU per proxied read); an injected transport (tests) keeps httpx.
        upstream: Upstream = (
            HttpxUpstream.create(settings.upstream_timeout_s, settings.upstream_connect_timeout_s, transport)
            if transport is not None
            else FastUpstream(settings.upstream_timeout_s, settings.upstream_connect_timeout_s)
        )
        proxy = Proxy(
            upstream,
            on_stale_map=source.refresh,
            max_batch_keys=settings.max_batch_keys,
            retry_after_s=settings.unavailable_retry_after_s,
        )
        app.state.proxy = proxy
        loop = asyncio.get_running_loop()
        built: list[RoutingTable] = []  # the last table built, on the source's thread

        def on_map(new_map: PartitionMap) -> None:
            # Runs on the source's thread: derive the table there, then one hand-over onto the loop.
            table = RoutingTable.of(new_map, built[-1] if built else None)
            built[:] = [table]
            with contextlib.suppress(RuntimeError):  # the loop has closed: we are shutting down
                loop.call_soon_threadsafe(proxy.install, table)

        try:
            await run_in_threadpool(source.start, on_map)
        except BaseException:
            await run_in_threadpool(source.stop)
            await upstream.aclose()
            raise
        try:
            yield
        finally:
            try:
                await run_in_threadpool(source.stop)
            finally:
                await upstream.aclose()

    max_body_bytes = settings.max_batch_keys * MAX_BODY_BYTES_PER_KEY + MAX_BODY_BYTES_PER_KEY

    async def get_key(request: Request) -> Response:
        raw_path: bytes | None = request.scope.get("raw_path")
        # The raw path, because the decoded one has already turned a key's %2F into a separator.
        located = key_path_segment(raw_path.split(b"?", 1)[0]) if raw_path else None
        if located is None:
            raise PathNotFound("not a key path: a key containing '/' must be percent-encoded as %2F")
        store, key = located
        answer = await _proxy(request).get(store, key, request.headers.get(HEADER_REQUEST_ID))
        response = Response(content=answer.body, status_code=answer.status)
        response.raw_headers.extend(answer.headers)
        return response

    async def batch_get(request: Request) -> Response:
        body = await _read_body(request, max_body_bytes)
        keys = parse_batch_body(body)
        results = await _proxy(request).batch_get(
            request.path_params["store"], keys, request.headers.get(HEADER_REQUEST_ID)
        )
        return _json_bytes({"results": results})

    async def partition_map(request: Request) -> Response:
        return JSONResponse({**_proxy(request).table.map.describe(), "router": True})

    async def route(request: Request) -> Response:
        store, key = request.query_params.get("store"), request.query_params.get("key")
        if store is None or key is None:
            raise BadRequest("both query parameters are required: /admin/route?store=S&key=K")
        table = _proxy(request).table
        found = table.resolve(store, key)
        return _json_bytes(
            {
                "store": found.store,
                "key": key,
                "hash": found.hash,
                "partition": found.partition,
                "assigned": list(found.assigned),
                "serving": [
                    {"node": ep.node_id, "url": ep.url, "version": ep.version} for ep in found.serving
                ],
                # Asked when nobody announces the partition: the nodes that served it last.
                "last_known": [
                    {"node": ep.node_id, "url": ep.url, "version": ep.version}
                    for ep in table.last_known_endpoints(found.store, found.partition)
                ],
            }
        )

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        # A complete map stays complete while ZooKeeper is away: keep serving it, and say it is stale.
        table = _proxy(request).table
        loading = sorted(set(table.map.stores) - table.ever_complete)
        body = {
            "ready": table.ready,
            "stale": table.stale,
            "generation": table.generation,
            "complete": table.complete,
            "stores_loading": loading,
        }
        return JSONResponse(body, status_code=200 if table.ready else 503)

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(_proxy(request).metrics.render(), media_type="text/plain; version=0.0.4")

    return Starlette(
        routes=[
            Route("/stores/{store}/keys/{key:path}", get_key, methods=["GET"]),
            Route("/stores/{store}/batch-get", batch_get, methods=["POST"]),
            Route("/admin/partition-map", partition_map, methods=["GET"]),
            Route("/admin/route", route, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        exception_handlers={
            ApiError: _api_error,
            HTTPException: _http_error,
            Exception: _internal_error,
        },
        lifespan=lifespan,
    )


def _proxy(request: Request) -> Proxy:
    proxy: Proxy = request.app.state.proxy
    return proxy


def _json_bytes(obj: Any) -> Response:
    try:
        content = json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        # A key echoed back may hold a lone surrogate (sent as a JSON escape); escaping is then the only way.
        content = json.dumps(obj).encode("ascii")
    return Response(content, media_type="application/json")


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"the body is larger than {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"the body is larger than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = _HTTP_ERROR_CODES.get(exc.status_code, "http_error")
    return JSONResponse(
        {"error": code, "message": exc.detail}, status_code=exc.status_code, headers=exc.headers
    )


async def _internal_error(request: Request, exc: Exception) -> Response:
    # The traceback goes to the log (the server logs the re-raised exception), never to the client.
    return JSONResponse({"error": "internal_error", "message": "internal error"}, status_code=500)
