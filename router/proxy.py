"""The router's data path: one key, or a batch fanned out per node, sent to a node serving its partition.

`Proxy` is what the router's app and data plane hold: it keeps the routing view (`install`), locates a key and
hands its read to the engines. The jobs around it, each in a module of its own:

    router/proxy_settings.py  what the data path is allowed and told (ProxySettings, HedgeSettings)
    router/key_read.py        one read and its requests to nodes (Read, NodeRequest)
    router/read_engine.py     a read's requests: failover, hedging, stalls (ReadEngine)
    router/hedge_timer.py     when waiting reads' hedges are due, on one loop timer (HedgeTimer)
    router/batch_reads.py     a batch-get's fan-out per node (BatchReads)
    router/node_outcomes.py   what a request to a node ended with, for both engines (NodeOutcomes)
    router/relay.py           what of a node's reply is passed on
    router/replica_order.py   the last known replicas, and offsets remembered for bounded reads

The wire is `Upstream` (mostly `FastUpstream`). The names here stay importable from this module.

Words, each with one meaning here (and in router/dataplane.py, keyroute/http/fast_upstream.py):

    read      one single-key lookup, from `Proxy.read` until its result is delivered (or it is cancelled)
    request   what the router sends one node for a read: a read sends one, or more (failover, hedge)
    reply     a node's complete HTTP response to one request (`UpstreamResponse`); a 503 reply is a refusal
    end       a request ends when its reply or its failure arrives, or when it is cancelled
    result    what a read ends with: the reply to pass on (hop-by-hop headers stripped) or an exception
    deliver   hand a read's result to its `on_result`, exactly once
    answer    what the router's client is sent: the data plane's business, not this module's
    hedge     a read's second request, to the next replica, when the first has not replied in time
    failover  a read's next request, to the next replica, after every request out failed or was refused

Freshness (live stores): the router keeps, per (node, store, partition), the highest X-Keyroute-Offset a
node answered with (`remembered_offset`, bounded). A read bounded by `min_offset` asks first the replicas known to
have applied it; a replica that has not within its wait answers 503 not_up_to_bound, and the next replica
is asked, each once, as after any refusal. The bound goes to the node with the read (a query string, or a
batch's "min_offsets"): the node decides, the router only prefers.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

from keyroute.auth.cursor_key import CursorKey
from keyroute.cluster.partition_map import Endpoint
from keyroute.http.forwarding import OffsetBounds, path_segment
from keyroute.http.upstream import Upstream, UpstreamResponse
from keyroute.keys.partitioner import murmur2_bits
from keyroute.router.backoff import NodeBackoff
from keyroute.router.balancer import Balancer, RetryBudget
from keyroute.router.batch_reads import BatchReads
from keyroute.router.engine import EngineParts
from keyroute.router.key_read import OnResult, Read
from keyroute.router.metrics import RouterMetrics
from keyroute.router.node_outcomes import MIN_REFRESH_INTERVAL_S, MapRefresh, NodeOutcomes
from keyroute.router.proxy_settings import HedgeSettings, ProxySettings
from keyroute.router.read_engine import ReadEngine
from keyroute.router.replica_order import MAX_REMEMBERED_OFFSETS, RememberedOffsets, serving_or_last_known
from keyroute.router.routing_table import RoutingTable

__all__ = [
    "MAX_REMEMBERED_OFFSETS",
    "MIN_REFRESH_INTERVAL_S",
    "HedgeSettings",
    "OnResult",
    "Proxy",
    "ProxySettings",
    "Read",
]

# Imported names a read uses, held where the compiled build (setup.py) reads them from C statics.
_path_segment: Final = path_segment
_serving_or_last_known: Final = serving_or_last_known


class Proxy:
    """Routes reads with the current `RoutingTable`; `table` is replaced whole by `install`.

    `clock` (seconds, monotonic, at the event loop's rate) times everything the proxy decides by: when a
    hedge is due, how long a request took (latency metrics, the automatic hedge delay), how often the map
    is re-read."""

    def __init__(
        self,
        upstream: Upstream,
        *,
        on_stale_map: Callable[[], None],
        settings: ProxySettings = ProxySettings(),  # noqa: B008 (immutable)
        hedge: HedgeSettings = HedgeSettings(),  # noqa: B008 (immutable)
        backoff: NodeBackoff | None = None,
        metrics: RouterMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.table = RoutingTable.empty()
        self.settings = settings
        self.hedge = hedge
        # "/stores/{store}/keys/" per store of the table, percent-encoded once (see `read`).
        self._key_paths: dict[str, str] = {}
        # What range cursors are signed with: the cluster's key, once read from ZooKeeper (the app's).
        self.cursor_key = CursorKey()
        self.metrics = metrics = metrics or RouterMetrics()
        backoff = backoff or NodeBackoff()
        self._balancer = balancer = Balancer(backoff, rng)
        budget = RetryBudget(hedge.budget_ratio)
        self._budget = budget
        self._map_refresh = MapRefresh(on_stale_map, clock, metrics)
        self._map_refresh.generation = self.table.generation
        outcomes = NodeOutcomes(metrics, backoff, self._map_refresh)
        self._offsets = offsets = RememberedOffsets()
        parts = EngineParts(upstream, settings, balancer, budget, outcomes, offsets, metrics, clock)
        self._reads = ReadEngine(parts, hedge)
        self._batches = BatchReads(parts)
        # Live stores of the current table (their answers' offsets are remembered).
        self._live_stores: frozenset[str] = frozenset()

    @property
    def in_flight(self) -> dict[str, int]:
        """Requests out right now per node URL (a copy; nodes with none are absent)."""
        return dict(self._balancer.in_flight)

    @property
    def hedge_delay_s(self) -> float | None:
        """How long a read's first request may take before the read is hedged now: the fixed delay, the one
        derived from recent latencies (None until there are enough), or 0 when hedging is off."""
        return self._reads.hedge_delay_s

    def serving(self, store: str, partition: int) -> tuple[Endpoint, ...]:
        """The replicas to ask for one partition, in the order to ask them (the last known ones when the map
        has none serving it right now)."""
        table = self.table
        serving = _serving_or_last_known(
            table, self.metrics, store, partition, table.map.serving_endpoints(store, partition)
        )
        return serving if len(serving) < 2 else self._balancer.order(serving)

    async def fetch(self, url: str, request_id: str) -> UpstreamResponse:
        """A GET to a node (range pages), with the headers every request to a node carries."""
        self.metrics.upstream_requests += 1
        return await self._reads.get(url, request_id)

    def install(self, table: RoutingTable) -> None:
        """Swap in a new routing view (on the event loop thread; readers keep the one they started with)."""
        self.table = table
        self._map_refresh.generation = table.generation
        self._key_paths = {}
        self._live_stores = frozenset(name for name, record in table.map.stores.items() if record.live)
        m = self.metrics
        m.map_updates += 1
        m.map_generation = table.generation
        m.map_stale = table.stale
        m.map_complete = table.complete
        m.map_installed(table.map)

    def read(
        self,
        store: str,
        key_text: str,
        request_id: str,
        on_result: OnResult,
        min_offset: int | None = None,
        tail: str = "",
    ) -> Read:
        """Read one key: `on_result` is called once, later, on the event loop, with the result: a node's
        reply (headers filtered for passing on; any status, a last replica's 503 included) or the exception
        the read failed with (an ApiError, or anything unexpected). What is wrong at once (an unknown store,
        a bad key, no node serving the partition) is raised here, and `on_result` is never called.

        A read bounded by `min_offset` goes first to the replicas known to have applied it; the nodes
        enforce the bound (the last replica's 503 not_up_to_bound is the result when none has).

        `request_id` (visible ASCII, as `keyroute.runtime.logs` accepts or makes one) goes to the nodes.

        `tail` follows the key in the path asked of the node (a timeline read: "/history?from=..." as the
        client sent it, visible ASCII without spaces as any request target).

        The common read costs no coroutine: its request goes out on an idle pooled connection at once and
        its reply is delivered from that connection's callback. A request (first, hedge or failover) that
        finds no idle connection goes through `Upstream.get` in a task, and so does a resend.

        Returns the read, whose `cancel()` abandons it (every request out is cancelled, nothing delivered).
        """
        self.metrics.key_requests += 1
        table = self.table
        # RoutingTable.serving_of and StoreLocator.serving_of, inline for a plain store (string keys,
        # murmur2), the common case: two frames per read less. Anything else asks the table, which decides
        # (and raises) as ever. tests/property/test_key_location_props.py pins it to StoreLocator.locate_key.
        locator = table.reads.get(store)
        if locator is not None and locator.plain and key_text.isascii():
            partition = (murmur2_bits(key_text.encode()) & 0x7FFFFFFF) % locator.partitions
            serving = locator.serving[partition]
        else:
            partition, serving = table.serving_of(store, key_text)
        if not serving:
            serving = _serving_or_last_known(table, self.metrics, store, partition, serving)
            if not serving:
                self.metrics.unavailable += 1
                raise self.settings.unavailable(f"no node serves partition {partition} of store {store!r}")
        order = serving if len(serving) < 2 else self._balancer.order(serving)  # one replica: no choice
        self._budget.deposit()
        prefix = self._key_paths.get(store)
        if prefix is None:
            # Only stores of the current table get here (`locate` raised for others): bounded, and
            # emptied whenever a new table is installed.
            prefix = self._key_paths[store] = f"/stores/{_path_segment(store)}/keys/"
        path = prefix + _path_segment(key_text)
        if tail:
            path += tail
        if min_offset is not None:
            path += f"{'&' if '?' in tail else '?'}min_offset={min_offset}"
            order = self._offsets.fresh_first(order, store, partition, min_offset)
        engine = self._reads
        read = Read(engine, store, partition, path, order, request_id, on_result)
        read.tail = bool(tail)
        if min_offset is not None:
            read.min_offset = min_offset
            read.live = True  # only a live store answers a bounded read
        elif store in self._live_stores:
            read.live = True
        engine.start(read)
        return read

    async def batch_get(
        self,
        store: str,
        keys: Sequence[Any],
        request_id: str | None = None,
        bounds: OffsetBounds | None = None,
        fields: str = "",
    ) -> list[dict[str, Any]]:
        """One result per key in request order; one request per node, in parallel, replicas on failure.
        With `bounds`, each node gets the bounds of its keys' partitions, and a partition's keys go first
        to the replicas known to have applied its bound. `fields` (a projection's query, "?fields=...")
        goes to every node with its keys."""
        live = store in self._live_stores
        return await self._batches.get(self.table, live, store, keys, request_id, bounds, fields)

    def remember_offset(self, url: str, store: str, partition: int, offset: bytes | int | None) -> None:
        """Keep the highest offset the node at `url` reported for `partition` of `store`: an answer's
        X-Keyroute-Offset (bytes; ignored unless an integer) or a batch entry's `offset`; None is ignored. At
        most MAX_REMEMBERED_OFFSETS are kept: a new one beyond that forgets the oldest."""
        self._offsets.remember(url, store, partition, offset)

    def remembered_offset(self, url: str, store: str, partition: int) -> int | None:
        """The highest offset the node at `url` reported for `partition` of `store`, if any."""
        return self._offsets.remembered(url, store, partition)
