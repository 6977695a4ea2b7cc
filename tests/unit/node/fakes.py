"""A node under test without ZooKeeper: a hand-made partition map and partitions, peers answering on a real
server on 127.0.0.1 (tests.peers: every forwarded request, sent over the node's own wire, can be inspected),
and the node's app and data plane behind keyroute's HTTP server on 127.0.0.1, as `keyroute node` serves
them, without the app's lifespan."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import httpx
from starlette.applications import Starlette

from keyroute.cluster.partition_map import Assignment, NodeRecord, PartitionMap, ServingRecord, StoreRecord
from keyroute.http.admission import Admission
from keyroute.http.exchange import ServerLimits
from keyroute.http.quotas import Quotas, ServingShares
from keyroute.http.server import HttpServer
from keyroute.keys.key_format import KeyFormat, parse_key
from keyroute.keys.partitioner import Partitioner
from keyroute.runtime.settings import AccessSettings, NodeSettings, RequestLimits
from keyroute.state_node.app import Node, create_app, forwarding_upstream
from keyroute.state_node.dataplane import NodeDataPlane
from keyroute.state_node.ownership import Readiness
from keyroute.state_node.service import server_limits as node_server_limits
from tests.peers import serve_peers
from tests.util import serve_in_thread

ME, B, C = "n1", "n2", "n3"
URLS = {ME: "http://n1.test:1", B: "http://n2.test:2", C: "http://n3.test:3"}
P = 4


class Held:
    """A loaded partition as the read path sees it (keyroute.replica.store.PartitionStore): a batch one."""

    live: Any = None

    def __init__(self, version: int, rows: Mapping[bytes, bytes]) -> None:
        self.version = version
        self.rows = dict(rows)

    def get(self, key: bytes) -> bytes | None:
        return self.rows.get(key)


class FakeOwnership:
    def __init__(self, m: PartitionMap, held: Mapping[tuple[str, int], Held], ready: bool = True) -> None:
        self.map = m
        self.held = dict(held)
        self.ready = ready
        self.leaving = False

    def local(self, store: str, partition: int) -> Held | None:
        return self.held.get((store, partition))

    def readiness(self) -> Readiness:
        return Readiness(self.ready, False, () if self.ready else ("s v1 p0",), {})

    def describe(self) -> dict[str, Any]:
        return {"s": [{"partition": 0, "version": 1, "state": "serving"}]}


def records(version: int = 1) -> dict[str, StoreRecord]:
    return {
        "s": StoreRecord("s", P, Partitioner.MURMUR2, KeyFormat.STRING, version, "/nowhere", ("v",), 2),
        "ints": StoreRecord("ints", P, Partitioner.MURMUR2, KeyFormat.INT64, 1, "/nowhere", ("v",), 1),
    }


def partition_of(store: str, text: str) -> int:
    record = records()[store]
    return PartitionMap.empty().locate(record, parse_key(record.key_format, text)).partition


def key_in(store: str, partition: int, prefix: str = "k") -> str:
    return next(t for i in range(1000) if partition_of(store, t := f"{prefix}{i}") == partition)


GENERATION = 4242


def build(serving: Mapping[str, Mapping[str, Mapping[int, int]]], version: int = 1) -> PartitionMap:
    return PartitionMap.build(
        records(version),
        {n: NodeRecord(n, url) for n, url in URLS.items()},
        Assignment(1, {}),
        {n: ServingRecord(n, URLS[n], {s: dict(p) for s, p in v.items()}) for n, v in serving.items()},
        generation=GENERATION,
    )


Handler = Callable[[httpx.Request], httpx.Response]


class WithoutLifespan:
    """The node app with its lifespan answered here (no ZooKeeper, no loading): the test puts a hand-made
    `Node` on `state` itself. `state` is the app's, where the server looks for the data plane's objects.
    At shutdown the node's wire to its peers is closed, as the real lifespan does."""

    def __init__(self, app: Starlette) -> None:
        self.app = app
        self.state = app.state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return
        while True:
            kind = (await receive())["type"]
            if kind == "lifespan.shutdown" and (node := getattr(self.state, "node", None)) is not None:
                await node.http.aclose()
            await send({"type": kind + ".complete"})
            if kind == "lifespan.shutdown":
                return


class Client:
    """A node under test behind keyroute's HTTP server on 127.0.0.1, as `keyroute node` serves it (its app
    and its data plane on one port), on a thread of this process; synchronous calls over real sockets."""

    def __init__(self, app: Starlette, port: int) -> None:
        self.app = app
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.http = httpx.Client(base_url=self.url, trust_env=False, timeout=10)

    @property
    def node(self) -> Node:
        node: Node = self.app.state.node
        return node

    @property
    def admission(self) -> Admission:
        admission: Admission = self.app.state.admission
        return admission

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return self.http.request(method, path, **kwargs)

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.request("POST", path, **kwargs)

    def delete(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.request("DELETE", path, **kwargs)


def node_settings(access: AccessSettings | None = None, limits: RequestLimits | None = None) -> NodeSettings:
    return NodeSettings(
        node_id=ME,
        data_dir=None,  # type: ignore[arg-type]
        max_batch_keys=5,
        access=access or AccessSettings(),
        limits=limits or RequestLimits(),
    )


class Nodes:
    """Nodes under test, each behind keyroute's HTTP server on a thread of this process: call it to start one;
    `close` stops them all (the `client_for` fixture does)."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        # The data plane class the nodes serve with: a test may put a subclass that spies on it here (the
        # compiled build's class takes no attribute set on it, but an interpreted subclass overrides).
        self.plane: type[NodeDataPlane] = NodeDataPlane

    def __call__(
        self,
        serving: Mapping[str, Mapping[str, Mapping[int, int]]],
        held: Mapping[tuple[str, int], Held],
        peer: Handler,
        ready: bool = True,
        version: int = 1,
        access: AccessSettings | None = None,
        limits: RequestLimits | None = None,
        server_limits: ServerLimits | None = None,
        quotas: Quotas | None = None,
    ) -> tuple[Client, list[httpx.Request]]:
        """A node (its map built from `serving`, holding `held`, its peers answering with `peer`) and the
        requests its peers received. The server's limits are the node's own
        (`keyroute.state_node.service.server_limits`) unless `server_limits` is given; `quotas`: the ones its
        data plane enforces (as the lifespan puts them on the app's state from --quota-file)."""
        seen: list[httpx.Request] = []

        def record_and_answer(request: httpx.Request) -> httpx.Response:
            seen.append(request)
            return peer(request)

        settings = node_settings(access, limits)
        app = create_app(settings)
        peers = self._stack.enter_context(serve_peers(record_and_answer))
        http = forwarding_upstream(settings.forward_timeout_s, resolve=peers.resolve)
        ownership = FakeOwnership(build(serving, version), held, ready)
        node = Node(settings, ownership, http)  # type: ignore[arg-type]
        node.metrics.admission = app.state.admission  # as the lifespan's node shares create_app's metrics
        app.state.node = node
        if quotas is not None:
            app.state.quotas = node.metrics.quotas = quotas
            app.state.quota_shares = ServingShares(quotas)
        server = HttpServer(
            WithoutLifespan(app),
            server_limits or node_server_limits(settings),
            data_plane=self.plane.from_state,
            on_refusal=app.state.admission.refused,  # as keyroute.state_node.service.NodeServer counts them
        )
        client = Client(app, self._stack.enter_context(serve_in_thread(server)))
        self._stack.callback(client.http.close)
        return client, seen

    def close(self) -> None:
        self._stack.close()


def unreachable(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("refused", request=request)


LOCAL_P, REMOTE_P = 0, 1
KEY_LOCAL = key_in("s", LOCAL_P)
KEY_REMOTE = key_in("s", REMOTE_P)
SERVING = {ME: {"s": {LOCAL_P: 1}}, B: {"s": {REMOTE_P: 1}}, C: {"s": {REMOTE_P: 1}}}
HELD = {("s", LOCAL_P): Held(1, {KEY_LOCAL.encode(): b'{"v":1}'})}
