"""The router's Starlette app: admin, health, metrics and the API document, one error mapping. The data API
(everything under /stores/) is answered by the router's data plane (router/dataplane.py), not here.

Its lifespan owns the long-lived resources: the partition-map source (ZooKeeper), the HTTP client to the
nodes, and the `Proxy` the data plane reads through (`app.state.proxy`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from keyroute.api import BadRequest
from keyroute.auth.security import ClusterAuth, MemberIdentity
from keyroute.cluster.cluster_policy import MemberSecurity, PolicyWatch, UnmetPolicyError
from keyroute.cluster.live_status import LiveStatusReader
from keyroute.cluster.partition_map import PartitionMap
from keyroute.cluster.zk import ZkAccessError, ZkUnavailableError
from keyroute.http import openapi
from keyroute.http.admin_login import login_routes
from keyroute.http.admission import RequestGuard
from keyroute.http.authn import callers_of
from keyroute.http.error_answers import exception_handlers
from keyroute.http.fast_upstream import FastUpstream
from keyroute.http.lifespan import StartupError
from keyroute.http.openapi import ApiRoute
from keyroute.http.policy_gate import PolicyGate
from keyroute.http.quotas import start_quotas
from keyroute.http.routing import RouteTable
from keyroute.http.tls import MemberTls, member_tls
from keyroute.http.upstream import Upstream
from keyroute.router import map_views, ui
from keyroute.router import openapi as router_openapi
from keyroute.router.dataplane import RouterDataPlane
from keyroute.router.limits import admission
from keyroute.router.map_source import MapSource, ZooKeeperMapSource
from keyroute.router.proxy import HedgeSettings, Proxy, ProxySettings
from keyroute.router.registry import RouterRegistry, register_when_connected
from keyroute.router.routing_table import RoutingTable
from keyroute.runtime.logs import describe
from keyroute.runtime.metrics import CONTENT_TYPE, certificates_in_use
from keyroute.runtime.settings import RouterSettings

log = logging.getLogger(__name__)

# How long startup waits for the first partition map (ZooKeeper answers within milliseconds when it is up).
FIRST_MAP_WAIT_S = 5.0
# Between attempts to reach ZooKeeper at startup (each attempt itself waits up to the connect timeout).
_RECONNECT_PAUSE_S = (1.0, 30.0)


async def _connect(
    source: MapSource,
    on_map: Callable[[PartitionMap], None],
    settings: RouterSettings,
    policy: PolicyWatch | None = None,
) -> None:
    """Start `source`, retrying while ZooKeeper is unreachable (said once). Credentials ZooKeeper refuses
    are not retried: the error ends the task (at startup, the router's start), as does a cluster `policy`
    this router does not satisfy while its check is strict (later, the router starts watching it all the
    same, serving no read while it is unmet)."""
    pause, said = _RECONNECT_PAUSE_S[0], False
    while True:
        try:
            await run_in_threadpool(source.start, on_map)
            if said:
                log.info("ZooKeeper at %s is reachable again: reading the partition map", settings.zk.hosts)
            return
        except ZkAccessError:
            raise
        except UnmetPolicyError:
            if policy is None or policy.strict:
                raise
            continue  # the router has started meanwhile: the next attempt watches the policy
        except ZkUnavailableError as exc:
            if not said:
                said = True
                log.warning("%s: answering 503 and retrying until it is reachable", describe(exc))
        await asyncio.sleep(pause)
        pause = min(pause * 2, _RECONNECT_PAUSE_S[1])


async def _stop(connecting: asyncio.Task[None], waiting: asyncio.Task[Any], source: MapSource) -> None:
    for task in (connecting, waiting):
        task.cancel()
    await asyncio.wait((connecting, waiting))
    if not connecting.cancelled() and connecting.exception() is not None:
        connecting.exception()  # retrieved: it was reported at startup or does not matter at shutdown
    await run_in_threadpool(source.stop)


def create_app(
    settings: RouterSettings,
    *,
    map_source: MapSource | None = None,
    upstream: Upstream | None = None,
    first_map_wait_s: float = FIRST_MAP_WAIT_S,
) -> Starlette:
    """The router app. `map_source` and `upstream` replace ZooKeeper and the wire to the nodes in tests (the
    app closes the upstream it is given when it stops). Startup waits up to `first_map_wait_s` for the first
    map, so that a router (or one of several workers sharing a port) does not take connections it can only
    answer 503."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Who may read what: files that do not load stop the start.
        members = ClusterAuth(settings.access.cluster_secret, certificates=bool(settings.http.tls.member_ca))
        app.state.callers = callers_of(settings.access, members, "router", trust_members=False)
        checks.identify_admins(app.state.callers)
        # Quotas (keyroute/http/quotas.py): how much each caller may read, from the quota file, watched for changes.
        quotas, quota_file = start_quotas(settings.quota_file, lambda store: proxy.table.has_store(store))
        # The cluster policy, checked when the session starts, before the router registers (or reads anything).
        gate = PolicyGate(checks, "router", asyncio.get_running_loop())
        policy = app.state.policy = PolicyWatch(MemberSecurity.of(settings), gate)
        source = map_source if map_source is not None else ZooKeeperMapSource(settings.zk, policy)
        # The data path uses our own keep-alive pool (benchmarks/RESULTS.md, "Router": httpx costs ~20x
        # more CPU per proxied read), made here: it belongs to the event loop that runs the lifespan.
        wire: Upstream = (
            upstream
            if upstream is not None
            else FastUpstream(
                settings.upstream_timeout_s,
                settings.upstream_connect_timeout_s,
                tls=member_tls(settings.http.tls, "router", MemberIdentity("router", settings.member_id)),
            )
        )
        proxy = Proxy(
            wire,
            on_stale_map=source.refresh,
            settings=ProxySettings.of(settings, ClusterAuth(settings.access.cluster_secret).headers()),
            hedge=HedgeSettings.of(settings),
        )
        if isinstance(getattr(wire, "tls", None), MemberTls):  # a node is held to the id it registered
            wire.tls.peers = lambda: proxy.table.map  # type: ignore[attr-defined]
        proxy.metrics.admission = checks
        proxy.cursor_key = getattr(source, "cursor_key", proxy.cursor_key)  # a test source has none
        if app.state.callers is not None:
            app.state.callers.cluster_key = proxy.cursor_key  # what admin callers' login sessions are keyed by
        proxy.metrics.certificates = certificates_in_use(settings.http.tls, settings.zk.tls)
        app.state.proxy = proxy
        app.state.upstream = wire  # the data plane's multi-store batches post on it (keyroute.router.multi_read)
        app.state.quotas = proxy.metrics.quotas = quotas
        # A source without a ZooKeeper session (tests) has no live status to show.
        app.state.live_status = LiveStatusReader(lambda: getattr(source, "client", None))
        app.state.map_source = source
        views = app.state.map_views = map_views.MapViews(app.state.live_status)
        loop = asyncio.get_running_loop()
        built: list[RoutingTable] = []  # the last table built, on the source's thread
        first_map = asyncio.Event()

        def install(table: RoutingTable) -> None:
            proxy.install(table)
            views.observe(table.map)
            first_map.set()

        def on_map(new_map: PartitionMap) -> None:
            # Runs on the source's thread: derive the table there, then one hand-over onto the loop.
            table = RoutingTable.of(new_map, built[-1] if built else None)
            built[:] = [table]
            with contextlib.suppress(RuntimeError):  # the loop has closed: we are shutting down
                loop.call_soon_threadsafe(install, table)

        # Connecting goes on in the background for as long as it takes: after `first_map_wait_s` the router
        # listens anyway, answering 503 (and not ready) until a map arrives.
        connecting = asyncio.create_task(_connect(source, on_map, settings, policy))
        waiting = asyncio.create_task(first_map.wait())
        # Routers up (router/registry.py): each enforces its share of the quotas; the partition map lists them.
        registry = app.state.router_registry = RouterRegistry(settings.http.url, _on_loop(loop, quotas.set_routers))
        registering = asyncio.create_task(
            register_when_connected(connecting, lambda: getattr(source, "client", None), registry)
        )
        try:
            await asyncio.wait((connecting, waiting), timeout=first_map_wait_s, return_when=asyncio.FIRST_EXCEPTION)
            if connecting.done() and connecting.exception() is not None:
                raise StartupError(str(connecting.exception()))
            policy.strict = False  # started: a policy first read from now on is watched, not refused
            if not first_map.is_set():
                wait_s = first_map_wait_s
                log.warning("no partition map within %g s of starting: answering 503 until one arrives", wait_s)
        except BaseException:
            await _stop(connecting, waiting, source)
            await wire.aclose()
            raise
        if quota_file is not None:
            quota_file.watch(loop)
        try:
            yield
        finally:
            if app.state.callers is not None:
                app.state.callers.close()  # the JWT signing keys' refreshes
            if quota_file is not None:
                quota_file.close()
            registering.cancel()
            await run_in_threadpool(registry.stop)
            try:
                await _stop(connecting, waiting, source)
            finally:
                await wire.aclose()

    async def partition_map_page(request: Request) -> Response:
        # Never cached, never framed by another site; its script only talks to this router.
        return HTMLResponse(
            ui.PAGE,
            headers={
                "cache-control": "no-store",
                "x-frame-options": "DENY",
                "content-security-policy": "default-src 'none'; script-src 'unsafe-inline'; "
                "style-src 'unsafe-inline'; connect-src 'self'",
                "referrer-policy": "no-referrer",
            },
        )

    async def route(request: Request) -> Response:
        store, key = request.query_params.get("store"), request.query_params.get("key")
        if store is None or key is None:
            raise BadRequest("both query parameters are required: /admin/route?store=S&key=K")
        table = _proxy(request).table
        found = table.locate(store, key)
        return _json_bytes(
            {
                "store": found.store,
                "key": key,
                "hash": found.hash,
                "partition": found.partition,
                "assigned": list(found.assigned),
                "serving": [{"node": ep.node_id, "url": ep.url, "version": ep.version} for ep in found.serving],
                # Asked when nobody announces the partition: the nodes that served it last.
                "last_known": [
                    {"node": ep.node_id, "url": ep.url, "version": ep.version}
                    for ep in table.last_known_endpoints(found.store, found.partition)
                ],
            }
        )

    async def quotas_table(request: Request) -> Response:
        return _json_bytes(request.app.state.quotas.table())

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        # A complete map stays complete while ZooKeeper is away: keep serving it, and say it is stale.
        table = _proxy(request).table
        stores = set(table.map.stores)
        complete_now = table.complete_stores
        body = {
            "ready": table.ready,
            "stale": table.stale,
            "generation": table.generation,
            "complete": table.complete,
            # Never fully served yet (a first version loading), and fully served once but missing a partition
            # now: what the map says of the data, which readiness does not depend on.
            "stores_loading": sorted(stores - table.ever_complete),
            "stores_degraded": sorted((table.ever_complete & stores) - complete_now),
            # A router on an empty (often mistyped) chroot stays ready, as before stores are published: it says so.
            **_cluster_state(request),
        }
        withheld = request.app.state.admission.withheld
        if withheld is not None:  # a cluster policy it does not satisfy: it serves no read, so takes none
            body["ready"] = False
            body["reason"] = withheld.message
            return JSONResponse(body, status_code=503)
        return JSONResponse(body, status_code=200 if table.ready else 503)

    async def metrics(request: Request) -> Response:
        return Response(_proxy(request).metrics.exposition(), headers={"content-type": CONTENT_TYPE})

    # Shared with the data plane (router/dataplane.py): one count of requests in progress for both.
    checks = admission(settings)
    app = Starlette(
        routes=[
            ApiRoute(map_views.PARTITION_MAP_PATH, map_views.partition_map, router_openapi.GET_PARTITION_MAP),
            ApiRoute(map_views.ROUTING_PATH, map_views.routing, router_openapi.GET_ROUTING),
            ApiRoute("/admin/route", route, router_openapi.GET_ROUTE),
            ApiRoute("/admin/quotas", quotas_table, router_openapi.GET_QUOTAS),
            ApiRoute(ui.PATH, partition_map_page, router_openapi.PARTITION_MAP_PAGE),
            ApiRoute("/healthz", healthz, openapi.HEALTHZ),
            ApiRoute("/readyz", readyz, router_openapi.READYZ),
            ApiRoute("/metrics", metrics, openapi.METRICS),
            ApiRoute(openapi.OPENAPI_PATH, openapi.endpoint(router_openapi.INFO, _data_plane_routes), openapi.OPENAPI),
            *login_routes(),
        ],
        # The first thing every request meets: concurrency and header limits, the admin token.
        # mypy matches no class taking **options (RequestGuard's) against starlette's middleware factory type
        middleware=[Middleware(RequestGuard, admission=checks)],  # type: ignore[arg-type]
        exception_handlers=exception_handlers(),
        lifespan=lifespan,
    )
    app.state.admission = checks
    return app


def _on_loop(loop: asyncio.AbstractEventLoop, call: Callable[[int], None]) -> Callable[[int], None]:
    """`call`, made on `loop` from another thread (nothing once the loop has closed)."""

    def soon(value: int) -> None:
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(call, value)

    return soon


def _data_plane_routes() -> RouteTable:
    return RouterDataPlane.routes


def _proxy(request: Request) -> Proxy:
    proxy: Proxy = request.app.state.proxy
    return proxy


_cluster_state = map_views.cluster_state


def _json_bytes(obj: Any) -> Response:
    try:
        content = json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        # A key echoed back may hold a lone surrogate (sent as a JSON escape); escaping is then the only way.
        content = json.dumps(obj).encode("ascii")
    return Response(content, media_type="application/json")
