"""In-process stand-ins for state nodes and ZooKeeper, for unit tests of the router's logic, and `Proxy.read`
as an awaitable.

Fake nodes are real ASGI apps. A `FakeCluster` serves them on a real server on 127.0.0.1 (tests.peers) for
the router's own wire (`FakeCluster.upstream()`: FastUpstream, each node still addressed by its name), and
is an httpx transport too; either way it can play a dead node.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from keyroute.api import ApiError, KeyNotFound, PartitionUnavailable, found_body, key_path_segment
from keyroute.auth.cursor_key import CursorKey
from keyroute.cluster.partition_map import (
    EMPTY_ASSIGNMENT,
    Assignment,
    NodeRecord,
    PartitionMap,
    ServingRecord,
    StoreRecord,
)
from keyroute.http.fast_upstream import FastUpstream
from keyroute.http.upstream import UpstreamResponse
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.router.proxy import Proxy
from tests.peers import Peers, Unreachable

# Where a dead node is: a port nothing listens on, so connecting is refused.
REFUSED = ("127.0.0.1", 1)


def store_record(
    name: str,
    partitions: int,
    key_format: KeyFormat = KeyFormat.STRING,
    partitioner: Partitioner = Partitioner.MURMUR2,
    version: int = 1,
) -> StoreRecord:
    return StoreRecord(
        name=name,
        partitions=partitions,
        partitioner=partitioner,
        key_format=key_format,
        version=version,
        snapshot=f"/snapshots/{name}/v{version}",
    )


def node_url(node_id: str) -> str:
    return f"http://{node_id}:8000"


def build_map(
    stores: Iterable[StoreRecord],
    serving: Mapping[str, Mapping[str, Iterable[int]]],
    assignment: Assignment = EMPTY_ASSIGNMENT,
    generation: int = 7,
) -> PartitionMap:
    """`serving[node_id][store]` lists the partitions the node serves, at its store's published version."""
    by_name = {s.name: s for s in stores}
    records = {
        node_id: ServingRecord(
            node_id=node_id,
            url=node_url(node_id),
            stores={store: {p: by_name[store].version for p in parts} for store, parts in per_store.items()},
        )
        for node_id, per_store in serving.items()
    }
    nodes = {node_id: NodeRecord(node_id, node_url(node_id)) for node_id in serving}
    return PartitionMap.build(by_name, nodes, assignment, records, generation=generation)


@dataclass
class Received:
    method: str
    raw_path: bytes
    headers: httpx.Headers
    key: str | None = None
    keys: list[str] = field(default_factory=list)


class FakeNode:
    """Answers the node data API from `values[(store, key)]` and records every request it receives.

    Knobs: `down` (connection refused), `fault` (an httpx error raised instead of answering), `hops`
    (answer as if forwarded), `unavailable` (503 for everything), `extra_headers`.
    """

    def __init__(self, node_id: str, values: Mapping[tuple[str, str], Any] | None = None) -> None:
        self.node_id = node_id
        self.values = dict(values or {})
        self.received: list[Received] = []
        self.down = False
        self.fault: Callable[[], Exception] | None = None
        self.hops = "0"
        self.unavailable = False
        self.extra_headers: list[tuple[str, str]] = []
        # Set to a barrier to prove that requests to several nodes are in flight at the same time.
        self.barrier: asyncio.Barrier | None = None
        self.app = Starlette(
            routes=[
                Route("/stores/{store}/keys/{key:path}", self._get, methods=["GET"]),
                Route("/stores/{store}/batch-get", self._batch, methods=["POST"]),
            ]
        )

    def answer(self, store: str, key: str) -> tuple[int, bytes]:
        err: ApiError
        if self.unavailable:
            err = PartitionUnavailable(f"{self.node_id} does not serve it")
        elif (store, key) in self.values:
            value = json.dumps(self.values[(store, key)]).encode()
            return 200, found_body(store, key, 0, 1, value)
        else:
            err = KeyNotFound(f"no key {key!r}")
        return err.status, json.dumps(err.body()).encode()

    async def _get(self, request: Request) -> Response:
        located = key_path_segment(request.scope["raw_path"])
        assert located is not None
        store, key = located
        self.received.append(Received("GET", request.scope["raw_path"], httpx.Headers(request.headers), key=key))
        status, body = self.answer(store, key)
        headers = {
            "content-type": "application/json",
            "x-keyroute-node": self.node_id,
            "x-keyroute-partition": "0",
            "x-keyroute-version": "1",
            "x-keyroute-hops": self.hops,
        }
        if status == 503:
            headers["retry-after"] = "7"
        response = Response(body, status_code=status, headers=headers)
        for name, value in self.extra_headers:
            response.raw_headers.append((name.lower().encode(), value.encode()))
        return response

    async def _batch(self, request: Request) -> Response:
        store = request.path_params["store"]
        keys = json.loads(await request.body())["keys"]
        self.received.append(
            Received("POST", request.scope["raw_path"], httpx.Headers(request.headers), keys=list(keys))
        )
        if self.barrier is not None:
            await asyncio.wait_for(self.barrier.wait(), timeout=5)
        results = []
        for key in keys:
            status, body = self.answer(store, key)
            entry = json.loads(body)
            if status == 200:
                results.append({"key": key, "status": 200, "partition": 0, "version": 1, "value": entry["value"]})
            else:
                results.append({"key": key, "status": status, **entry})
        return Response(json.dumps({"results": results}), media_type="application/json")


class FakeCluster(httpx.AsyncBaseTransport):
    """Delivers each request to the fake node named by its host: over real sockets to a server on 127.0.0.1
    (started on first use, stopped when the cluster is collected or the tests end) for `upstream()`, or as
    an httpx transport. A node that is `down` refuses connections and drops those already open; a `fault`
    breaks the reply off (over sockets: a malformed one)."""

    def __init__(self, *nodes: FakeNode) -> None:
        self.nodes = {node.node_id: node for node in nodes}
        self._transports = {node.node_id: httpx.ASGITransport(node.app) for node in nodes}
        self._peers: Peers | None = None

    def __getitem__(self, node_id: str) -> FakeNode:
        return self.nodes[node_id]

    def upstream(self, timeout_s: float = 5.0, connect_timeout_s: float = 1.0) -> PerLoopUpstream:
        """The router's own wire to this cluster's nodes (a FastUpstream per event loop)."""
        return PerLoopUpstream(lambda: FastUpstream(timeout_s, connect_timeout_s, resolve=self.resolve))

    def resolve(self, host: str, port: int) -> tuple[str, int]:
        """Where to connect for node `host` (`FastUpstream`'s `resolve`)."""
        node = self.nodes.get(host)
        if node is None or node.down:
            return REFUSED
        if self._peers is None:
            self._peers = Peers(self._over_sockets).start()
            weakref.finalize(self, self._peers.stop)
        return "127.0.0.1", self._peers.port

    async def _over_sockets(self, request: httpx.Request) -> httpx.Response:
        node = self.nodes.get(request.url.host)
        if node is None or node.down:
            raise Unreachable(request.url.host)
        return await self.handle_async_request(request)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        node = self.nodes.get(request.url.host)
        if node is None or node.down:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if node.fault is not None:
            raise node.fault()
        return await self._transports[node.node_id].handle_async_request(request)


class PerLoopUpstream:
    """FastUpstream, one per event loop: a FastUpstream belongs to the loop it first ran on, and a test may
    run one proxy in several `asyncio.run`s in a row."""

    def __init__(self, make: Callable[[], FastUpstream]) -> None:
        self._make = make
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, FastUpstream] = (
            weakref.WeakKeyDictionary()
        )

    def current(self) -> FastUpstream:
        loop = asyncio.get_running_loop()
        upstream = self._by_loop.get(loop)
        if upstream is None:
            upstream = self._by_loop[loop] = self._make()
        return upstream

    async def get(self, url: str, headers: Mapping[str, str]) -> UpstreamResponse:
        return await self.current().get(url, headers)

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        return await self.current().post(url, body, headers)

    def get_now(self, url: str, head: bytes, on_reply: Callable[[UpstreamResponse | Exception], None]) -> Any:
        return self.current().get_now(url, head, on_reply)

    async def aclose(self) -> None:
        await self.current().aclose()


class StaticMapSource:
    """A MapSource that pushes maps on demand and counts refresh requests."""

    def __init__(self, initial: PartitionMap | None = None) -> None:
        self.initial = initial
        self.refreshes = 0
        self.started = False
        self.stopped = False
        self._on_map: Callable[[PartitionMap], None] | None = None
        # The cluster's key, as a ZooKeeper source reads it (keyroute.auth.cursor_key).
        self.cursor_key = CursorKey(b"k" * 32)

    def start(self, on_map: Callable[[PartitionMap], None]) -> None:
        self.started = True
        self._on_map = on_map
        if self.initial is not None:
            on_map(self.initial)

    def push(self, new_map: PartitionMap) -> None:
        assert self._on_map is not None
        self._on_map(new_map)

    def refresh(self) -> None:
        self.refreshes += 1

    def stop(self) -> None:
        self.stopped = True


# -- Proxy.read as an awaitable, for tests --------------------------------------------------------------------


def read_result(
    proxy: Proxy, store: str, key: str, request_id: str = "rid-1"
) -> asyncio.Future[UpstreamResponse | Exception]:
    """`Proxy.read` as a future of its result (the node's reply or the exception the read failed with);
    cancelling the future cancels the read. What `read` raises at once is raised here."""
    result: asyncio.Future[UpstreamResponse | Exception] = asyncio.get_running_loop().create_future()

    def deliver(outcome: UpstreamResponse | Exception) -> None:
        if not result.done():
            result.set_result(outcome)

    read = proxy.read(store, key, request_id, deliver)
    assert not result.done(), "a read never delivers before `read` returns"
    result.add_done_callback(lambda future: read.cancel() if future.cancelled() else None)
    return result


async def get(proxy: Proxy, store: str, key: str, request_id: str = "rid-1") -> UpstreamResponse:
    """The reply a read delivers; the exception it delivers is raised."""
    outcome = await read_result(proxy, store, key, request_id)
    if isinstance(outcome, Exception):
        raise outcome
    return outcome
