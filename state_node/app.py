"""The node's admin app and its wiring: the partition map, a key's route, health, readiness and metrics, and
the lifespan that joins the cluster on startup and leaves it on shutdown (`Node` holds what it creates).

Reads (everything under /stores/) are not the app's: `keyroute.state_node.dataplane` answers them, on the same
port (`keyroute.http.server`), with the same `Node` and the same admission counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException
from kazoo.handlers.threading import KazooTimeoutError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from keyroute.api import HEADER_NODE, BadRequest
from keyroute.auth.cursor_key import CursorKey
from keyroute.auth.security import BearerAuth, ClusterAuth, MemberIdentity
from keyroute.cluster import placement_records, zk
from keyroute.cluster.cluster_policy import MemberSecurity, PolicyWatch, UnmetPolicyError
from keyroute.cluster.live_status import LiveStatusReader, annotate
from keyroute.cluster.map_watcher import MapWatcher
from keyroute.cluster.partition_map import Assignment, PartitionMap
from keyroute.cluster.zk_session import SessionKeeper
from keyroute.http import openapi
from keyroute.http.admin_login import login_routes
from keyroute.http.admission import Admission, RequestGuard
from keyroute.http.authn import admin_paths, callers_of
from keyroute.http.conditional import entity_tag, not_modified
from keyroute.http.error_answers import exception_handlers
from keyroute.http.fast_upstream import FastUpstream
from keyroute.http.lifespan import StartupError
from keyroute.http.openapi import ApiRoute
from keyroute.http.policy_gate import PolicyGate
from keyroute.http.quotas import ServingShares, start_quotas
from keyroute.http.routing import RouteTable
from keyroute.http.tls import member_tls
from keyroute.http.upstream import Upstream
from keyroute.replica.store import load_partition
from keyroute.runtime.logs import describe
from keyroute.runtime.metrics import CONTENT_TYPE, certificates_in_use
from keyroute.runtime.settings import NodeSettings
from keyroute.state_node import openapi as node_openapi
from keyroute.state_node.controller import Controller
from keyroute.state_node.data_dir import DataDir, DataDirError, held_partitions
from keyroute.state_node.metrics import NodeMetrics
from keyroute.state_node.ownership import Ownership
from keyroute.state_node.reads import RETRY_AFTER_S, find_store, parse_key_text
from keyroute.state_node.registration import NodeIdInUse, Registration

log = logging.getLogger(__name__)

_NODE = HEADER_NODE.encode("ascii")
_AFTER_LOGIN = "/admin/partition-map"  # where a login leads: a node has no page of its own


@dataclass(slots=True)
class Node:
    """Everything a request handler needs, created by the lifespan and kept on `app.state.node`."""

    settings: NodeSettings
    ownership: Ownership
    # The wire to the other nodes, for the reads this node forwards (`keyroute.state_node.reads`).
    http: Upstream
    controller: Controller | None = None
    registration: Registration | None = None
    metrics: NodeMetrics = field(default_factory=NodeMetrics)
    # Every node's live partitions' reports, for the partition map (None: no ZooKeeper session, in tests).
    live_status: LiveStatusReader | None = None
    # The whole assignment (of the stores given, or all) read from ZooKeeper, for the admin views (a node's
    # map holds only its own share; None: no ZooKeeper session, in tests: the map's assignment is shown).
    whole_assignment: Callable[[frozenset[str] | None], Assignment | None] | None = None
    # What timeline cursors are signed with: the cluster's key (keyroute.auth.cursor_key; unknown in tests).
    cursor_key: CursorKey = field(default_factory=CursorKey)
    # "Now" for stores' time to live (keyroute.storage.ttl): seconds since the epoch; tests give a fake one.
    clock: Callable[[], float] = time.time
    # Tells other members' requests (whose hop header counts) from clients' (whose does not).
    members: ClusterAuth = field(init=False)
    # X-Keyroute-Node, as every answer of this node carries it.
    node_header: tuple[bytes, bytes] = field(init=False)

    def __post_init__(self) -> None:
        member_ca = bool(self.settings.http.tls.member_ca)
        self.members = ClusterAuth(self.settings.access.cluster_secret, certificates=member_ca)
        self.node_header = (_NODE, self.settings.node_id.encode("latin-1"))

    @property
    def node_id(self) -> str:
        return self.settings.node_id

    async def leave(self) -> None:
        """A departure (SIGTERM after `keyroute node-drain`, or with --restart-grace-s 0; a planned restart is
        keyroute.state_node.service's): take no new work, let the controller move every partition away,
        wait (at most `drain_timeout_s`) until live nodes serve them at the published version, then
        de-announce. The caller stops the HTTP server afterwards, which finishes in-flight requests."""
        timeout_s = self.settings.drain_timeout_s
        log.info("node %s is leaving: handing its partitions over (waiting at most %.0fs)", self.node_id, timeout_s)
        self.ownership.leave()
        if self.registration is not None:
            try:
                await run_in_threadpool(self.registration.mark_leaving)
            except Exception as exc:  # ZooKeeper unreachable: nobody can take over; the drain times out
                log.warning("marking node %s as leaving failed: %s", self.node_id, describe(exc))
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
        elif (held := self.ownership.alone()) is not None:
            log.warning(
                "node %s stops as the only live node: its %d partition(s) are served by no node until another "
                "node serves them",
                self.node_id,
                held,
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
    """The node's admin app; its lifespan joins the cluster on startup (the `Node` on `app.state.node`) and
    leaves it on shutdown. `app.state.admission` holds the admission checks, for the data plane to share."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Who may read what, decided before joining the cluster: files that do not load stop the start.
        members = ClusterAuth(settings.access.cluster_secret, certificates=bool(settings.http.tls.member_ca))
        callers = app.state.callers = callers_of(settings.access, members, f"node {node_id}", trust_members=True)
        admission.identify_admins(callers)
        # Quotas of the reads callers make here directly (keyroute.http.quotas), shared among the nodes serving
        # each store; a read a member passes on is not counted again, so members must prove themselves.
        if settings.quota_file and not members.enabled:
            raise StartupError(
                "--quota-file on a node needs --cluster-secret or --member-ca: reads routers and other nodes pass "
                "on are told from callers' by their proof, and only callers' reads count against a quota"
            )
        quotas, quota_file = start_quotas(
            settings.quota_file, lambda store: store in app.state.node.ownership.map.stores, "node"
        )
        app.state.quotas = metrics.quotas = quotas
        app.state.quota_shares = ServingShares(quotas)
        try:
            async with _running_node(settings, drop_grace_s, max_parallel_loads, metrics) as node:
                app.state.node = node
                if callers is not None:
                    callers.cluster_key = node.cursor_key  # what admin callers' login sessions are keyed by
                if quota_file is not None:
                    quota_file.watch(asyncio.get_running_loop())
                try:
                    yield
                finally:
                    if quota_file is not None:
                        quota_file.close()
        finally:
            if callers is not None:
                callers.close()  # the JWT signing keys' refreshes

    node_id = settings.node_id
    metrics = NodeMetrics()

    routes = [
        ApiRoute("/admin/partition-map", partition_map, node_openapi.GET_PARTITION_MAP),
        ApiRoute("/admin/route", route, node_openapi.GET_ROUTE),
        ApiRoute("/admin/quotas", quotas_table, node_openapi.GET_QUOTAS),
        ApiRoute("/healthz", healthz, openapi.HEALTHZ),
        ApiRoute("/readyz", readyz, node_openapi.READYZ),
        ApiRoute("/metrics", metrics_endpoint, openapi.METRICS),
        ApiRoute(openapi.OPENAPI_PATH, openapi.endpoint(node_openapi.INFO, _data_plane_routes), openapi.OPENAPI),
        *login_routes(_AFTER_LOGIN),
    ]
    access = settings.access
    metrics.certificates = certificates_in_use(settings.http.tls, settings.zk.tls)
    admission = metrics.admission = Admission(
        max_concurrent_requests=settings.limits.max_concurrent_requests,
        max_concurrent_per_caller=settings.limits.max_concurrent_per_caller,
        max_header_bytes=settings.limits.max_header_bytes,
        admin=BearerAuth(access.admin_token),
        protected=admin_paths(access),
        retry_after_s=RETRY_AFTER_S,
    )
    # mypy matches no class taking **options (RequestGuard's) against starlette's middleware factory type
    guard = Middleware(RequestGuard, admission=admission, error_headers=[(HEADER_NODE, node_id)])  # type: ignore[arg-type]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[guard],
        exception_handlers=exception_handlers({HEADER_NODE: node_id}),
    )
    # Shared with the data plane (keyroute.state_node.dataplane): one count of requests in progress.
    app.state.admission = metrics.admission
    app.state.after_login = _AFTER_LOGIN
    return app


@contextlib.asynccontextmanager
async def _running_node(
    settings: NodeSettings, drop_grace_s: float, max_parallel_loads: int, metrics: NodeMetrics | None = None
) -> AsyncIterator[Node]:
    metrics = metrics if metrics is not None else NodeMetrics()
    loop = asyncio.get_running_loop()
    # The data directory is locked before anything in it is touched, and kept locked until the node ends.
    try:
        data_dir = await run_in_threadpool(DataDir.open, settings.data_dir, settings.node_id)
    except DataDirError as exc:
        raise StartupError(str(exc)) from exc
    with contextlib.closing(data_dir):
        async with _joined_node(settings, data_dir, loop, drop_grace_s, max_parallel_loads, metrics) as node:
            yield node


@contextlib.asynccontextmanager
async def _joined_node(
    settings: NodeSettings,
    data_dir: DataDir,
    loop: asyncio.AbstractEventLoop,
    drop_grace_s: float,
    max_parallel_loads: int,
    metrics: NodeMetrics,
) -> AsyncIterator[Node]:
    # StartupError before joining: unusable files, a certificate that does not name this node.
    wire_tls = member_tls(settings.http.tls, f"node {settings.node_id}", MemberIdentity("node", settings.node_id))
    chroot = settings.zk.chroot or ""
    # The cluster policy is checked before anything is written to ZooKeeper: a node that does not satisfy it
    # neither joins nor registers; one that stops satisfying it later serves no read (PolicyGate).
    admission = metrics.admission
    gate = None if admission is None else PolicyGate(admission, f"node {settings.node_id}", loop)
    policy = PolicyWatch(MemberSecurity.of(settings), gate)

    def before_writing(client: KazooClient) -> None:
        # Nothing is created in ZooKeeper before both pass: a chroot of another cluster (or none, for a data
        # directory that joined one) and a policy this node does not satisfy leave ZooKeeper as it was.
        data_dir.check(client, chroot)
        policy.require(client)

    try:
        client = await run_in_threadpool(functools.partial(zk.connect, settings.zk, check=before_writing))
    except (zk.ZkUnavailableError, DataDirError, UnmetPolicyError) as exc:
        raise StartupError(str(exc)) from exc
    try:
        await run_in_threadpool(data_dir.join, client, settings.zk.chroot or "", settings.zk)
    except DataDirError as exc:
        await run_in_threadpool(zk.close, client)
        raise StartupError(str(exc)) from exc
    cursor_key = CursorKey()
    try:
        await run_in_threadpool(cursor_key.ensure, client)
    except (KazooException, KazooTimeoutError, RuntimeError) as exc:
        await run_in_threadpool(zk.close, client)
        raise StartupError(f"the cluster's cursor key could not be read or created: {exc!r}") from exc
    registration = Registration(client, settings.node_id, settings.http.url, settings.zone)
    try:
        await run_in_threadpool(registration.claim, settings.zk.session_timeout_s + 2.0)
    except NodeIdInUse as exc:
        await run_in_threadpool(zk.close, client)
        raise StartupError(str(exc)) from exc

    def on_map(new_map: PartitionMap) -> None:
        # Called on the watcher's thread: hand the immutable map to the loop and return at once.
        with contextlib.suppress(RuntimeError):  # the loop is closing: the map no longer matters
            loop.call_soon_threadsafe(ownership.on_map, new_map)

    # The node's own share of the assignment, and the whole of the stores it hands partitions over in.
    watcher = MapWatcher(client, on_map, node_id=settings.node_id)
    ownership = Ownership(
        settings,
        registration,
        drop_grace_s=drop_grace_s,
        max_parallel_loads=max_parallel_loads,
        loader=metrics.timed(load_partition),
        follow=watcher.follow,
    )
    metrics.watch(ownership)
    controller = Controller(client, settings.node_id)
    # A ZooKeeper restored or rebuilt behind this session: a new session once this node's cluster is back there.
    keeper = SessionKeeper(client, settings.zk, cluster_id=lambda: data_dir.cluster_id)
    http = forwarding_upstream(settings.forward_timeout_s, tls=wire_tls)
    if wire_tls is not None:  # a node forwarded to is held to the id it registered
        wire_tls.peers = lambda: ownership.map
    node = Node(
        settings,
        ownership,
        http,
        controller,
        registration,
        metrics,
        LiveStatusReader(lambda: client),
        whole_assignment=lambda only: placement_records.read_whole(client, only),
        cursor_key=cursor_key,
    )
    try:
        registration.holds = await run_in_threadpool(held_partitions, settings.data_dir)
        await run_in_threadpool(registration.register_node)
        await run_in_threadpool(registration.returned)  # registered first: the controller never sees it gone
        watcher.start()
        controller.start()
        keeper.start()
        yield node
    finally:
        await run_in_threadpool(keeper.stop)
        # Reverse order: stop deciding (controller), stop reacting (watcher), stop holding (ownership),
        # then tell the cluster we are gone before the session closes.
        policy.stop()
        if not zk.is_connected(client):
            # ZooKeeper is unreachable: nothing below can tell it anything, and kazoo's calls would wait for it.
            # Closed first, every call fails at once, and any still waiting (a cut-short leave's) ends.
            await run_in_threadpool(zk.close, client)
        await run_in_threadpool(controller.stop)
        await run_in_threadpool(watcher.stop)
        await ownership.stop()
        try:
            await run_in_threadpool(registration.withdraw)
        except Exception as exc:  # the session's end removes the records anyway
            log.warning("withdrawing node %s from ZooKeeper failed: %s", settings.node_id, describe(exc))
        await run_in_threadpool(zk.close, client)
        await http.aclose()


# Connections the node keeps open to each other node it forwards to (the router keeps as many per node).
FORWARD_MAX_CONNECTIONS_PER_NODE = 256


def forwarding_upstream(
    timeout_s: float,
    resolve: Callable[[str, int], tuple[str, int]] | None = None,
    tls: Callable[[str], ssl.SSLContext] | None = None,
) -> FastUpstream:
    """The wire a node forwards reads on: the router's own (FastUpstream: ~20x less CPU per request than
    httpx). `timeout_s` bounds a whole forwarded request (waiting for a connection included), a connect
    at most 1 s of it. Peers are addressed directly by the URL they advertise: no proxy from the
    environment, no redirects (FastUpstream follows neither). `resolve`, `tls`: see FastUpstream."""
    return FastUpstream(
        timeout_s,
        min(1.0, timeout_s),
        max_connections_per_origin=FORWARD_MAX_CONNECTIONS_PER_NODE,
        pool_wait_s=timeout_s,
        resolve=resolve,
        tls=tls,
    )


def _data_plane_routes() -> RouteTable:
    """The data plane's routes, for the API document (imported here: the data plane imports this module)."""
    from keyroute.state_node.dataplane import NodeDataPlane

    return NodeDataPlane.routes


def _node(request: Request) -> Node:
    node: Node = request.app.state.node
    return node


# -- admin --------------------------------------------------------------------------------------------


async def partition_map(request: Request) -> Response:
    """The node's whole view of the map. Its ETag names the map and assignment generations, staleness, the
    live status read and a digest of what is local to this node (leadership, leaving, its partitions): a
    request naming it in If-None-Match is answered 304 before the document is built."""
    node = _node(request)
    m = node.ownership.map
    assignment = await _whole_assignment(node, m)
    status = None if node.live_status is None else await run_in_threadpool(node.live_status.read_for, m)
    controller = node.controller.is_leader if node.controller is not None else False
    local = node.ownership.describe()
    digest = hashlib.blake2b(
        json.dumps([controller, node.ownership.leaving, local], sort_keys=True, default=str).encode(), digest_size=8
    ).hexdigest()
    live_mark = f"l{status.read_at:.6f}" if status is not None and status.reports else ""
    etag = entity_tag(f"g{m.generation}", f"a{assignment.generation}", "s" if m.stale else "", live_mark, digest)
    headers = {"etag": etag, "cache-control": "no-cache"}
    if (unchanged := not_modified(request, headers)) is not None:
        return unchanged
    body = m.describe(assignment=assignment)
    if status is not None:
        annotate(body, m, status)
    body["node"] = node.node_id
    body["controller"] = controller
    body["leaving"] = node.ownership.leaving
    body["local"] = local
    return JSONResponse(body, headers=headers)


async def _whole_assignment(node: Node, m: PartitionMap, only: frozenset[str] | None = None) -> Assignment:
    """The whole assignment (`only`: of these stores) for an admin view, read now (the map's, which may hold
    only this node's share, when ZooKeeper cannot give it)."""
    if node.whole_assignment is None or m.stale:
        return m.assignment
    try:
        whole = await run_in_threadpool(node.whole_assignment, only)
    except Exception as exc:  # ZooKeeper away, or a record unreadable: show what the node knows
        log.warning("reading the whole assignment for an admin view failed: %s", describe(exc))
        return m.assignment
    return m.assignment if whole is None else whole


async def route(request: Request) -> Response:
    node = _node(request)
    store_name = request.query_params.get("store")
    key_text = request.query_params.get("key")
    if store_name is None or key_text is None:
        raise BadRequest("both query parameters are required: /admin/route?store=S&key=K")
    m = node.ownership.map
    record = find_store(m, store_name)
    key = parse_key_text(record, key_text)
    location = m.locate(record, key)
    whole = await _whole_assignment(node, m, frozenset({store_name}))  # one store record, not every one
    held = node.ownership.local(store_name, location.partition)
    return JSONResponse(
        {
            "store": store_name,
            "key": location.key,
            "partitioner": record.partitioner.value,
            "hash": location.hash,
            "partition": location.partition,
            "partitions": record.partitions,
            "version": record.version,
            "assigned": list(whole.replicas(store_name, location.partition)),
            "serving": [{"node": ep.node_id, "url": ep.url, "version": ep.version} for ep in location.serving],
            "local": {"node": node.node_id, "version": held.version if held is not None else None},
            "map_stale": m.stale,
        }
    )


async def quotas_table(request: Request) -> Response:
    """The quotas of direct reads (keyroute.http.quotas `Quotas.table`): this node's share of each in use."""
    return JSONResponse(request.app.state.quotas.table())


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
    withheld = request.app.state.admission.withheld
    if withheld is not None:  # a cluster policy it does not satisfy: it serves no read, so takes none
        body["status"] = "not_ready"
        body["reason"] = withheld.message
        return JSONResponse(body, status_code=503)
    return JSONResponse(body, status_code=200 if readiness.ready else 503)
