"""The router's data path: one key, or a batch fanned out per node, sent to a node serving its partition.

Failover across serving replicas, hedging, node back-off and misroute detection live here; the wire is
`Upstream` (mostly `FastUpstream`). One engine reads a single key: `Proxy.read`, driven by callbacks.

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

Versions: a partition's routable endpoints all serve one version (`PartitionMap` picks it), and a batch
sends all keys of one partition to one node at a time (failover moves them together), so within one
batch answer every key of a partition carries the same version. Partitions may differ from each other
while a new version is being swapped in, partition by partition.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import logging
import random
import time
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from keyroute.api import (
    HEADER_GENERATION,
    HEADER_HOPS,
    HEADER_OFFSET,
    HEADER_REQUEST_ID,
    HEADER_ROUTER,
    ApiError,
    BatchKeyTooLong,
    PartitionUnavailable,
    PayloadTooLarge,
    key_too_long,
)
from keyroute.auth.cursor_key import CursorKey
from keyroute.cluster.partition_map import Endpoint
from keyroute.http.fast_upstream import StaleConnection, header_block
from keyroute.http.forwarding import (
    HOP_BY_HOP,
    OffsetBounds,
    batch_body,
    batch_path,
    error_entry,
    forward_batch,
    parse_batch_answer,
    passthrough_headers,
    path_segment,
)
from keyroute.http.upstream import Upstream, UpstreamResponse, UpstreamUnavailable
from keyroute.keys.partitioner import murmur2_bits
from keyroute.router.backoff import NodeBackoff
from keyroute.router.balancer import Balancer, LatencyQuantile, RetryBudget
from keyroute.router.metrics import RouterMetrics
from keyroute.router.routing_table import RoutingTable
from keyroute.runtime.logs import bind_request_id, describe
from keyroute.runtime.metrics import Histogram
from keyroute.runtime.settings import DEFAULT_STALL_AFTER_MS, RouterSettings

log = logging.getLogger(__name__)

# A burst of misrouted reads (say, during a rebalance) asks for one re-read, not one per read.
MIN_REFRESH_INTERVAL_S = 0.5

_HOPS: Final = HEADER_HOPS.encode("ascii")
# tuple.__new__: builds a NamedTuple (UpstreamResponse) without the Python frame of its generated __new__.
_new_tuple: Final = tuple.__new__
_UPSTREAM_RESPONSE: Final = UpstreamResponse  # C statics in the compiled build, not globals looked up
_path_segment: Final = path_segment
_GENERATION: Final = HEADER_GENERATION.encode("ascii")
_OFFSET: Final = HEADER_OFFSET.encode("ascii")
# Imported names a read uses, held where the compiled build (setup.py) reads them from C statics.
_HOP_BY_HOP: Final = HOP_BY_HOP
_HOP_LENGTHS: Final = sum(1 << n for n in {len(name) for name in HOP_BY_HOP})  # bit n: a hop-by-hop name has n bytes
_bisect_left: Final = bisect_left
# Offsets remembered per (node URL, store, partition): beyond it the oldest entry is forgotten.
MAX_REMEMBERED_OFFSETS = 65536

# What a read's caller gets its result with (`Proxy.read`), and what a request's reply or failure goes to.
OnResult = Callable[[UpstreamResponse | Exception], None]


def _key_text(raw: Any) -> str | None:
    if isinstance(raw, str):
        return raw
    # Integer keys are accepted as JSON numbers for convenience; their text form is the decimal.
    if isinstance(raw, int) and not isinstance(raw, bool):
        return str(raw)
    return None


@dataclass(frozen=True, slots=True)
class ProxySettings:
    """What the router's data path allows and says, passed whole (as httpx's `Limits`).

    `max_batch_keys`: keys in one batch-get (more: 413). `max_key_bytes`: a batch key longer than this gets
    its own 400 entry (0: no limit). `retry_after_s`: the Retry-After of a 503 when no node answers.
    `member_headers`: the proof of membership sent with every request to a node
    (`keyroute.auth.security.ClusterAuth.headers()`; empty without a cluster secret)."""

    max_batch_keys: int = 1000
    max_key_bytes: int = 0
    retry_after_s: int = 1
    member_headers: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, settings: RouterSettings, member_headers: Mapping[str, str]) -> ProxySettings:
        return cls(
            max_batch_keys=settings.max_batch_keys,
            max_key_bytes=settings.limits.max_key_bytes,
            retry_after_s=settings.unavailable_retry_after_s,
            member_headers=dict(member_headers),
        )


@dataclass(frozen=True, slots=True)
class HedgeSettings:
    """When a read also asks a second replica, and how many extra requests the router may send (as httpx's
    `Timeout`: one value, units in the names).

    `after_s`: a read whose first request has not replied after this long also asks the next serving
    replica; None derives the delay from recent upstream latencies, 0 turns hedging off.
    `budget_ratio`: hedges at most this share of first requests, plus a small burst (failovers spend from
    the same budget but are never refused: `keyroute.router.balancer.RetryBudget`).
    `stall_after_s`: a read none of whose requests has replied after this long asks the next replica as a
    failover does, whatever the budget and back-off say (a frozen node: a GC pause, a stuck disk, SIGSTOP);
    the budget caps the extra requests for nodes that answer slowly, this bounds what a node that answers
    nothing costs a read. 0 turns it off."""

    after_s: float | None = None
    budget_ratio: float = 0.1
    stall_after_s: float = DEFAULT_STALL_AFTER_MS / 1000

    def __post_init__(self) -> None:
        if self.after_s is not None and self.after_s < 0:
            raise ValueError("the hedge delay must not be negative (0 turns hedging off)")
        if self.budget_ratio < 0:
            raise ValueError("the retry budget ratio must not be negative")
        if self.stall_after_s < 0:
            raise ValueError("the stall delay must not be negative (0 turns it off)")

    @classmethod
    def of(cls, settings: RouterSettings) -> HedgeSettings:
        after_s = None if settings.hedge_after_ms is None else settings.hedge_after_ms / 1000
        return cls(
            after_s=after_s,
            budget_ratio=settings.retry_budget_percent / 100,
            stall_after_s=settings.stall_after_ms / 1000,
        )


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
        self._member_headers = dict(settings.member_headers)
        # What range cursors are signed with: the cluster's key, once read from ZooKeeper (the app's).
        self.cursor_key = CursorKey()
        self.metrics = metrics or RouterMetrics()
        self._upstream = upstream
        self._on_stale_map = on_stale_map
        self._max_batch_keys = settings.max_batch_keys
        self._max_key_bytes = settings.max_key_bytes
        self._retry_after_s = settings.retry_after_s
        self._backoff = backoff or NodeBackoff()
        self._backed_off = self._backoff.backed_off_urls  # the nodes in back-off (empty: none)
        self._balancer = Balancer(self._backoff, rng)
        self._in_flight = self._balancer.in_flight  # requests in flight per node URL, the balancer's own
        self._budget = RetryBudget(hedge.budget_ratio)
        self._hedging = hedge.after_s != 0
        self._hedge_after_s = hedge.after_s
        self._stall_after_s = hedge.stall_after_s
        # Only the automatic threshold needs latencies: a fixed one or none at all skips the bookkeeping.
        self._latency = LatencyQuantile() if hedge.after_s is None else None
        self._clock = clock
        self._hedge_timer = _HedgeTimer(clock)
        # Sending on an idle connection without a coroutine (FastUpstream.get_now); None: every request
        # goes through `Upstream.get` in a task.
        self._send_now: Callable[[str, bytes, OnResult], Any] | None = getattr(upstream, "get_now", None)
        # The same with the node's URL and the path apart (FastUpstream.get_now_at), for the paths this proxy
        # made itself (nothing to split or check again).
        self._send_now_at: Callable[[str, str, bytes, OnResult], Any] | None = getattr(upstream, "get_now_at", None)
        # What every request to a node carries except its request id, as header lines.
        self._block = header_block(self._headers(None))
        self._id_head = self._block + b"x-request-id: "  # followed by the read's id
        # Requests sent through `Upstream.get`: the loop keeps only weak references to tasks.
        self._tasks: set[asyncio.Task[UpstreamResponse]] = set()
        self._last_refresh = float("-inf")
        # The highest map generation a node reported while forwarding for us that made us re-read.
        self._refreshed_for = 0
        # Live stores of the current table (their answers' offsets are remembered) and those offsets.
        self._live_stores: frozenset[str] = frozenset()
        self._offsets: dict[tuple[str, str, int], int] = {}

    @property
    def in_flight(self) -> dict[str, int]:
        """Requests out right now per node URL (a copy; nodes with none are absent)."""
        return dict(self._in_flight)

    @property
    def hedge_delay_s(self) -> float | None:
        """How long a read's first request may take before the read is hedged now: the fixed delay, the one
        derived from recent latencies (None until there are enough), or 0 when hedging is off."""
        latency = self._latency
        return self._hedge_after_s if latency is None else latency.value_s

    def serving(self, store: str, partition: int) -> tuple[Endpoint, ...]:
        """The replicas to ask for one partition, in the order to ask them (the last known ones when the map
        has none serving it right now)."""
        table = self.table
        serving = self._serving(table, store, partition, table.map.serving_endpoints(store, partition))
        return serving if len(serving) < 2 else self._balancer.order(serving)

    async def fetch(self, url: str, request_id: str) -> UpstreamResponse:
        """A GET to a node (range pages), with the headers every request to a node carries."""
        self.metrics.upstream_requests += 1
        return await self._get(url, request_id)

    def install(self, table: RoutingTable) -> None:
        """Swap in a new routing view (on the event loop thread; readers keep the one they started with)."""
        self.table = table
        self._key_paths = {}
        self._live_stores = frozenset(name for name, record in table.map.stores.items() if record.live)
        m = self.metrics
        m.map_updates += 1
        m.map_generation = table.generation
        m.map_stale = table.stale
        m.map_complete = table.complete
        m.map_installed(table.map)

    # -- one key ----------------------------------------------------------------------------------------

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
            serving = self._serving(table, store, partition, serving)
            if not serving:
                self.metrics.unavailable += 1
                raise self._unavailable(f"no node serves partition {partition} of store {store!r}")
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
            order = self._fresh_first(order, store, partition, min_offset)
        read = Read(self, store, partition, path, order, request_id, on_result)
        read.tail = bool(tail)
        if min_offset is not None:
            read.min_offset = min_offset
            read.live = True  # only a live store answers a bounded read
        elif store in self._live_stores:
            read.live = True
        self._send(read, order[0], False, False)
        if len(order) > 1:
            delay = None
            if self._hedging:
                latency = self._latency
                delay = self._hedge_after_s if latency is None else latency.value_s
            if delay:
                read.waiting = True
                self._hedge_timer.add(read, delay)
            elif self._stall_after_s:
                read.waiting = read.stalled = True
                self._hedge_timer.add(read, self._stall_after_s)
        return read

    def _send(self, read: Read, endpoint: Endpoint, hedge: bool, resend: bool) -> None:
        """One request of `read` to `endpoint`: on an idle connection at once when there is one, else in a
        task. A `resend` (the idle connection had been closed by the node) is the same upstream request
        again, never on an idle connection: `Upstream.get` opens a new one if it must."""
        request = _Request(read, endpoint)
        if hedge:
            read.hedge = request
        else:
            read.lead = request
        url = endpoint.url
        # Balancer.request_sent, inline (once per request): its count_up is interpreted code, a frame per call
        in_flight = self._in_flight
        in_flight[url] = in_flight.get(url, 0) + 1
        if not resend:
            self.metrics.upstream_requests += 1
        request.started = self._clock()
        send_now = self._send_now
        if send_now is not None and not resend:
            # The request id is one the server accepted or made: visible ASCII, no spaces.
            head = self._id_head + read.request_id.encode("ascii") + b"\r\n"
            send_now_at = self._send_now_at
            exchange = None
            if send_now_at is not None and not read.tail:
                exchange = send_now_at(url, read.path, head, request.replied)
            if exchange is None:
                exchange = send_now(url + read.path, head, request.replied)
            if exchange is not None:
                request.pending = exchange
                return
        task = asyncio.get_running_loop().create_task(self._get(url + read.path, read.request_id))
        request.pending = task
        self._tasks.add(task)
        task.add_done_callback(request.fetched)

    async def _get(self, url: str, request_id: str) -> UpstreamResponse:
        bind_request_id({}, request_id)  # this task's log lines carry it
        return await self._upstream.get(url, self._headers(request_id))

    def _replied(self, request: _Request, result: UpstreamResponse | Exception) -> None:
        """`request` ended with `result` (a reply or a failure): the read delivers, waits for its other
        request, or fails over to the next replica."""
        endpoint = request.endpoint
        # The request is over: no longer in flight to its node, nor out for its read.
        # Balancer.request_ended, inline (once per request): its count_down is interpreted code, a frame per call
        url = endpoint.url
        in_flight = self._in_flight
        count = in_flight.get(url, 0)
        if count > 1:
            in_flight[url] = count - 1
        else:
            in_flight.pop(url, None)
        request.pending = None
        read = request.read
        hedge = read.lead is not request
        if hedge:
            read.hedge = None
        else:
            read.lead = None
        if isinstance(result, _UPSTREAM_RESPONSE):
            elapsed = self._clock() - request.started
            self._node_replied(endpoint, elapsed)
            if self._latency is not None:
                self._latency.record(elapsed)
            relayed, hops = _relayed(result.headers)
            if hops is not None and hops != b"0":  # "0": the node served it itself (as `_hops_seen` says)
                self._hops_seen(hops, result)
            if read.live:
                self.remember_offset(endpoint.url, read.store, read.partition, result.header(_OFFSET))
            if result.status != 503:
                if hedge:
                    self.metrics.hedge_wins += 1
                # UpstreamResponse(...) without its Python-level __new__ (a NamedTuple's): once per read.
                read.deliver(_new_tuple(_UPSTREAM_RESPONSE, (result.status, relayed, result.body)))
                return
            self._node_refused(result, read.min_offset is not None)
            read.refused = result  # a replica still might answer
        elif isinstance(result, StaleConnection):
            # The node had closed the idle connection and never saw the request (not its fault).
            self._send(read, endpoint, hedge, True)
            return
        elif not self._node_failed(endpoint, result):
            read.deliver(result)  # unexpected: the read fails with it
            return
        if read.lead is None and read.hedge is None:
            self._fail_over(read)
        # else: the read's other request may still reply

    # How both engines (a key's read above, a batch's `_node_batch`) take what a request to a node ended with.

    def _node_replied(self, endpoint: Endpoint, elapsed: float) -> None:
        """A node replied (whatever the status) `elapsed` seconds after it was asked: its latency observed, its
        back-off (if any) lifted."""
        # RouterMetrics.observe_upstream, inline (once per read)
        latency = self.metrics.upstream_latency
        histogram = latency.get(endpoint.node_id)
        if histogram is None:
            histogram = latency[endpoint.node_id] = Histogram()
        histogram.counts[_bisect_left(histogram.bounds, elapsed)] += 1
        histogram.sum += elapsed
        if self._backed_off:  # NodeBackoff.succeeded, inline: only a node in back-off has anything to undo
            self._backoff.succeeded(endpoint)

    def _node_refused(self, reply: UpstreamResponse, bounded: bool) -> None:
        """A node replied 503: it no longer serves the partition and knows no one who does, so the map is
        re-read; but a bounded read's (`bounded`) 503 not_up_to_bound is a replica behind the bound, not a
        stale map."""
        if not bounded or _error_code(reply.body) != "not_up_to_bound":
            self._refresh_map()

    def _node_failed(self, endpoint: Endpoint, error: Exception) -> bool:
        """A request to `endpoint` failed with `error`. A node's failure is counted and, when it is the node's
        fault, backs the node off (its replicas lead for a while): the node could not be reached, timed out or
        broke off (UpstreamUnavailable), or advertises a URL the wire cannot speak to (ValueError: a
        misconfigured node, taken as an unreachable one). True then: the read goes on with another replica.
        Anything else is unexpected: False, the read fails with it."""
        if isinstance(error, UpstreamUnavailable):
            self.metrics.upstream_failures += 1
            if error.node_fault:
                self._backoff.failed(endpoint, describe(error))
            return True
        if isinstance(error, ValueError):
            self.metrics.upstream_failures += 1
            self._backoff.failed(endpoint, f"unusable node URL: {describe(error)}")
            return True
        return False

    def _fail_over(self, read: Read) -> None:
        """Nothing of `read` is out and nothing usable came back: ask the next replica, or deliver the last
        refusal, or PartitionUnavailable when every replica failed."""
        read.waiting = False  # a hedge not sent yet never will be: the next replica is asked now
        order = read.order
        if read.asked < len(order):
            self.metrics.failovers += 1
            self._budget.spend_failover()
            endpoint = order[read.asked]
            read.asked += 1
            self._send(read, endpoint, False, False)
            if read.asked < len(order) and self._stall_after_s:
                read.waiting = read.stalled = True  # the replica failed over to may be frozen too
                self._hedge_timer.add(read, self._stall_after_s)
            return
        refused = read.refused
        if refused is not None:
            read.deliver(UpstreamResponse(refused.status, passthrough_headers(refused.headers), refused.body))
            return
        self.metrics.unavailable += 1
        tried = ", ".join(endpoint.node_id for endpoint in order)
        read.deliver(
            self._unavailable(
                f"no node serving partition {read.partition} of store {read.store!r} answered (tried {tried})"
            )
        )

    def _hedge(self, read: Read) -> None:
        """`read`'s first request has not replied in time: ask the next replica too, unless it is backed off
        (it failed just now: a second request there would not be faster) or the retry budget is spent. Then,
        if still nothing has replied by the stall delay, the next replica is asked all the same."""
        if read.stalled:
            self._stalled(read)
            return
        endpoint = read.order[1]
        refused = self._backoff.backed_off(endpoint.url)
        if not refused and not self._budget.try_spend():
            self.metrics.budget_exhausted += 1
            refused = True
        if refused:
            lead = read.lead
            if self._stall_after_s and lead is not None:
                read.waiting = read.stalled = True
                waited = self._clock() - lead.started
                self._hedge_timer.add(read, max(self._stall_after_s - waited, 0.0))
            return
        self.metrics.hedges += 1
        read.asked = 2
        self._send(read, endpoint, True, False)

    def _stalled(self, read: Read) -> None:
        """Nothing `read` sent has replied within the stall delay: the node it waits on answers nothing at all
        (frozen or stuck), so the next replica not asked yet is asked now, as a failover (never refused)."""
        read.stalled = False
        order = read.order
        if read.hedge is not None or read.asked >= len(order):
            return  # a second request is out already, or every replica has been asked
        lead = read.lead
        if lead is not None:  # the node waited on: the next reads go to another replica first
            self._backoff.failed(lead.endpoint, f"no reply within {self._stall_after_s:g} s")
        self.metrics.failovers += 1
        self.metrics.stalls += 1
        self._budget.spend_failover()
        endpoint = order[read.asked]
        read.asked += 1
        self._send(read, endpoint, True, False)

    def _cancel(self, request: _Request) -> None:
        """Abandon `request` (out for its read): its connection is closed, never reused, and its reply never
        read. It counts for the automatic hedge threshold: it took at least this long."""
        pending = request.pending
        request.pending = None
        read = request.read
        if read.lead is request:
            read.lead = None
        else:
            read.hedge = None
        self._balancer.request_ended(request.endpoint.url)
        if self._latency is not None:
            self._latency.record(self._clock() - request.started)
        pending.cancel()

    # -- batches ----------------------------------------------------------------------------------------

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
        self.metrics.batch_requests += 1
        self.metrics.batch_keys += len(keys)
        if len(keys) > self._max_batch_keys:
            raise PayloadTooLarge(f"{len(keys)} keys in one batch; at most {self._max_batch_keys} are allowed")
        table = self.table
        if not table.has_store(store):
            raise table.unknown_store(store)
        if bounds is not None:
            bounds.check(store, table.map.stores[store].partitions)
        # Where each key goes, for the bounds sent with it and the offsets its entry reports.
        partition_of: dict[str, int] | None = {} if bounds is not None or store in self._live_stores else None

        results: list[dict[str, Any] | None] = [None] * len(keys)
        texts: dict[int, str] = {}
        candidates: dict[int, tuple[Endpoint, ...]] = {}
        # One replica order per partition for the whole batch, so a partition's keys travel together.
        orders: dict[int, tuple[Endpoint, ...]] = {}
        for i, raw in enumerate(keys):
            text = _key_text(raw)
            if text is None:
                results[i] = error_entry(raw, table.bad_batch_key(store, raw))
                continue
            if self._max_key_bytes and key_too_long(text, self._max_key_bytes):
                results[i] = error_entry(raw, BatchKeyTooLong(f"the key is longer than {self._max_key_bytes} bytes"))
                continue
            try:
                route = table.locate(store, text)
            except ApiError as exc:
                results[i] = error_entry(text, exc)
                continue
            order = orders.get(route.partition)
            if order is None:
                serving = self._serving(table, store, route.partition, route.serving)
                order = self._balancer.order(serving)
                bound = bounds.bound(route.partition) if bounds is not None else None
                if bound is not None:
                    order = self._fresh_first(order, store, route.partition, bound)
                orders[route.partition] = order
            if not order:
                self.metrics.unavailable += 1
                results[i] = error_entry(
                    text, self._unavailable(f"no node serves partition {route.partition} of store {store!r}")
                )
                continue
            texts[i] = text
            candidates[i] = order
            if partition_of is not None:
                partition_of[text] = route.partition

        path = batch_path(store) + fields
        headers = {**self._headers(request_id), "content-type": "application/json"}

        async def send(endpoint: Endpoint, group: list[str], round_number: int) -> list[dict[str, Any]] | None:
            # A first request to a node feeds the retry budget, a failover round spends from it.
            if round_number == 0:
                self._budget.deposit()
            else:
                self._budget.spend_failover()
            min_offsets = None
            if bounds is not None and partition_of is not None:
                min_offsets = bounds.wire(sorted({partition_of[text] for text in group}))
            entries = await self._node_batch(endpoint, path, group, headers, min_offsets)
            if entries is not None and partition_of is not None:
                for text, entry in zip(group, entries, strict=True):
                    offset = entry.get("offset")
                    if type(offset) is int:
                        self.remember_offset(endpoint.url, store, partition_of[text], offset)
            return entries

        forwarded = await forward_batch(texts, candidates, send)
        self.metrics.failovers += forwarded.failovers
        for i, entry in forwarded.entries.items():
            if entry.get("status") == 503:
                self.metrics.unavailable += 1
            results[i] = entry
        complete = [entry for entry in results if entry is not None]
        assert len(complete) == len(keys), "every key gets exactly one result"
        return complete

    async def _node_batch(
        self,
        endpoint: Endpoint,
        path: str,
        texts: list[str],
        headers: Mapping[str, str],
        min_offsets: Mapping[str, int] | None = None,
    ) -> list[dict[str, Any]] | None:
        """The node's entries for `texts` (bounded by `min_offsets`) in order, or None when it failed or
        replied with nonsense."""
        self.metrics.upstream_requests += 1
        started = self._clock()
        balancer = self._balancer
        url = endpoint.url
        balancer.request_sent(url)
        try:
            reply = await self._upstream.post(url + path, batch_body(texts, min_offsets), headers)
        except Exception as exc:
            if not self._node_failed(endpoint, exc):
                raise
            return None
        finally:
            balancer.request_ended(url)
        self._node_replied(endpoint, self._clock() - started)
        self._check_hops(reply)
        if reply.status != 200:
            if reply.status == 503:
                self._node_refused(reply, min_offsets is not None)
            log.warning("node %s replied to a batch-get with status %d", endpoint.node_id, reply.status)
            return None
        entries = parse_batch_answer(reply.body, len(texts))
        if entries is None:
            log.warning("node %s replied to a batch-get with a malformed body", endpoint.node_id)
        return entries

    # -- shared -----------------------------------------------------------------------------------------

    def remember_offset(self, url: str, store: str, partition: int, offset: bytes | int | None) -> None:
        """Keep the highest offset the node at `url` reported for `partition` of `store`: an answer's
        X-Keyroute-Offset (bytes; ignored unless an integer) or a batch entry's `offset`; None is ignored. At
        most MAX_REMEMBERED_OFFSETS are kept: a new one beyond that forgets the oldest."""
        if offset is None:
            return
        if isinstance(offset, bytes):
            try:
                offset = int(offset)
            except ValueError:
                return
        where = (url, store, partition)
        offsets = self._offsets
        known = offsets.get(where)
        if known is None:
            if len(offsets) >= MAX_REMEMBERED_OFFSETS:
                del offsets[next(iter(offsets))]  # the oldest remembered
            offsets[where] = offset
        elif offset > known:
            offsets[where] = offset

    def remembered_offset(self, url: str, store: str, partition: int) -> int | None:
        """The highest offset the node at `url` reported for `partition` of `store`, if any."""
        return self._offsets.get((url, store, partition))

    def _fresh_first(
        self, order: tuple[Endpoint, ...], store: str, partition: int, min_offset: int
    ) -> tuple[Endpoint, ...]:
        """`order` with the replicas known to have applied `min_offset` first (each group in its order)."""
        offsets = self._offsets
        fresh = [ep for ep in order if offsets.get((ep.url, store, partition), -1) >= min_offset]
        if not fresh or len(fresh) == len(order):
            return order
        return (*fresh, *(ep for ep in order if ep not in fresh))

    def _check_hops(self, reply: UpstreamResponse) -> None:
        hops = reply.header(_HOPS)
        if hops is not None:
            self._hops_seen(hops, reply)

    def _hops_seen(self, hops: bytes, reply: UpstreamResponse) -> None:
        """`reply` carried X-Keyroute-Hops: `hops`."""
        if hops.strip() not in (b"", b"0"):
            # The node had to forward: it does not serve what our map says it serves.
            self.metrics.misroutes += 1
            self._refresh_map(_int_header(reply.header(_GENERATION)))

    def _serving(
        self, table: RoutingTable, store: str, partition: int, serving: tuple[Endpoint, ...]
    ) -> tuple[Endpoint, ...]:
        if serving:
            return serving
        known = table.last_known_endpoints(store, partition)
        if known:
            self.metrics.last_known_routes += 1
        return known

    def _refresh_map(self, reported_map_generation: int | None = None) -> None:
        """Ask the map source to re-read now. A node that forwarded for us and used a newer map than ours
        proves our view is behind: re-read at once (once per such map generation). Otherwise re-read at most
        every MIN_REFRESH_INTERVAL_S, so a burst of misroutes costs one read."""
        now = self._clock()
        newer = (
            reported_map_generation is not None
            and reported_map_generation > self.table.generation
            and reported_map_generation > self._refreshed_for
        )
        if newer or now - self._last_refresh >= MIN_REFRESH_INTERVAL_S:
            if newer and reported_map_generation is not None:
                self._refreshed_for = reported_map_generation
            self._last_refresh = now
            self.metrics.map_refreshes += 1
            self._on_stale_map()

    def _headers(self, request_id: str | None) -> dict[str, str]:
        # identity: the body is passed on as bytes, so it must not need decoding.
        headers = {HEADER_ROUTER: "1", "accept-encoding": "identity", **self._member_headers}
        if request_id:
            headers[HEADER_REQUEST_ID] = request_id
        return headers

    def _unavailable(self, message: str) -> PartitionUnavailable:
        return PartitionUnavailable(message, retry_after_s=self._retry_after_s)


def _relayed(pairs: Sequence[Any]) -> tuple[list[Any], bytes | None]:
    """A node's reply headers as they are passed on (`passthrough_headers`: without the hop-by-hop ones and
    those its `connection` names), and its first X-Keyroute-Hops value, in one pass (lower-case names:
    FastUpstream's, or `_Request.fetched` made them so). Each pair is relayed as the same tuple."""
    relayed: list[Any] = []
    hops = None
    named: set[bytes] | None = None
    for pair in pairs:
        name: bytes = pair[0]
        # Only a name as long as a hop-by-hop one can be one: most are never looked up in the set.
        if not (_HOP_LENGTHS >> len(name)) & 1 or name not in _HOP_BY_HOP:
            relayed.append(pair)
            if name == _HOPS and hops is None:
                hops = pair[1]
        elif name == b"connection":
            named = (named or set()) | {token.strip().lower() for token in pair[1].split(b",")}
    if named:
        relayed = [(name, value) for name, value in relayed if name not in named]
    return relayed, hops


def _error_code(body: bytes) -> str | None:
    """The `error` of a JSON error body, or None when it is not one."""
    try:
        code = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    return code if isinstance(code, str) else None


def _delivered(result: UpstreamResponse | Exception) -> None:
    """A read's `on_result` once it has delivered or been cancelled: nothing may reach its caller again."""
    raise AssertionError("a read delivered twice")


_DELIVERED: Final = _delivered


class Read:
    """One single-key read (made by `Proxy.read`): where it goes, in which order, its requests out.

    At most two requests are out at once: `lead` (the first request, or after a failure the failover) and
    `hedge`. `asked` counts the replicas of `order` asked so far. `waiting` is True while a hedge may still
    be sent (`_HedgeTimer` calls `fire` when it is due). The first usable reply is delivered and the other
    request cancelled; when nothing is out and nothing usable came back, the next replica is asked.

    A plain class with its own `__init__` (not a dataclass): made once per read, and a dataclass's generated
    `__init__` stays interpreted Python in the compiled build.
    """

    __slots__ = (
        "proxy", "store", "partition", "path", "order", "request_id", "on_result", "asked", "lead", "hedge",
        "refused", "waiting", "live", "min_offset", "tail", "stalled", "due",
    )  # fmt: skip

    def __init__(
        self,
        proxy: Proxy,
        store: str,
        partition: int,
        path: str,
        order: tuple[Endpoint, ...],
        request_id: str,
        on_result: OnResult,
    ) -> None:
        self.proxy = proxy
        self.store = store
        self.partition = partition
        self.path = path
        self.order = order
        self.request_id = request_id
        self.on_result = on_result
        self.asked = 1
        self.lead: _Request | None = None
        self.hedge: _Request | None = None
        # The last 503 reply, passed on if no replica does better.
        self.refused: UpstreamResponse | None = None
        # `live`: a read of a live store (its replies' offsets are remembered), with its bound `min_offset`
        # (None: none). `tail`: the path ends in a caller's own text (a timeline read's query), checked by the
        # upstream when sent.
        self.waiting = self.live = self.tail = False
        # `stalled`: the timer, when it fires, is the stall delay's rather than the hedge's. `due`: the
        # deadline of the read's one current timer entry (earlier entries of it are dropped when they come up).
        self.stalled = False
        self.due = 0.0
        self.min_offset: int | None = None

    @property
    def over(self) -> bool:
        """Delivered or cancelled."""
        return self.on_result is _DELIVERED

    def deliver(self, result: UpstreamResponse | Exception) -> None:
        """The read's result to its caller (once); whatever request is still out is cancelled."""
        self.waiting = False
        if self.lead is not None or self.hedge is not None:
            self._stop()
        on_result = self.on_result
        # Let go of the caller's callback: whatever it holds (the client's exchange) is freed with it.
        self.on_result = _DELIVERED
        try:
            on_result(result)
        except Exception:  # never into a connection's parser: the router goes on
            log.exception("delivering a read's result failed", extra={"request_id": self.request_id})

    def cancel(self) -> None:
        """Abandon the read: every request out is cancelled and nothing is delivered."""
        self._stop()
        self.on_result = _DELIVERED

    def fire(self) -> None:
        """The hedge is due (called by `_HedgeTimer` while `waiting`)."""
        self.waiting = False
        self.proxy._hedge(self)

    def _stop(self) -> None:
        self.waiting = False
        proxy = self.proxy
        for request in (self.lead, self.hedge):
            if request is not None:
                proxy._cancel(request)


class _Request:
    """One request of a read to one node (the read's `lead` or its `hedge`). `pending` is what cancels it
    while it is out (FastUpstream's exchange, or the task of `Upstream.get`); None once it has ended."""

    __slots__ = ("read", "endpoint", "started", "pending")

    def __init__(self, read: Read, endpoint: Endpoint) -> None:
        self.read = read
        self.endpoint = endpoint
        self.started = 0.0
        self.pending: Any = None

    def replied(self, result: UpstreamResponse | Exception) -> None:
        """The request's reply or failure (from the connection's callback or the task's end)."""
        if self.pending is None:
            return  # cancelled meanwhile
        read = self.read
        try:
            read.proxy._replied(self, result)
        except Exception as exc:  # never into the connection's parser: the read fails, the router goes on
            log.exception("handling a node's reply failed", extra={"request_id": read.request_id})
            if not read.over:
                read.deliver(exc)

    def fetched(self, task: asyncio.Task[UpstreamResponse]) -> None:
        self.read.proxy._tasks.discard(task)
        if task.cancelled():
            if self.pending is None:
                return  # cancelled by the read
            self.replied(UpstreamUnavailable("the request was cancelled", node_fault=False))
            return
        failure = task.exception()
        if failure is not None:
            self.replied(failure)  # type: ignore[arg-type]
            return
        # `Upstream.get` of any kind: header names lower-cased here, as FastUpstream's already are, so that
        # `Proxy._replied` compares them as they come.
        reply = task.result()
        headers = [(name.lower(), value) for name, value in reply.headers]
        self.replied(UpstreamResponse(reply.status, headers, reply.body))


class _HedgeTimer:
    """When each waiting read's hedge is due, on one loop timer for all of them.

    A timer per read (`loop.call_later` and its cancel) costs ~3 us on uvloop, more than the rest of the
    hedging bookkeeping together; here a read costs a heap push, and the one timer is armed for the
    earliest deadline. Reads no longer waiting (delivered, failed over or cancelled meanwhile) are dropped
    when their deadline comes up. Deadlines are readings of `clock` (the proxy's, which may be offset from
    the loop's but runs at its rate): the loop's timer wakes it after the clock's time to the earliest
    deadline, the reads due by `clock` are hedged, and the timer is armed again for the next one.
    """

    # uvloop counts whole milliseconds, so a timer may fire up to one early: that much early is due.
    _EARLY_S = 0.001

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._due: list[tuple[float, int, Read]] = []
        self._seq = itertools.count()  # ties on the deadline must never compare two reads
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None

    def add(self, read: Read, delay_s: float) -> None:
        loop = asyncio.get_running_loop()
        now = self._clock()
        when = now + delay_s
        read.due = when
        if loop is not self._loop:  # a new event loop (tests run one after another): start afresh
            self._loop, self._timer, self._due = loop, None, []
        heapq.heappush(self._due, (when, next(self._seq), read))
        if self._timer is None or when < self._timer_at - self._EARLY_S:
            self._arm(loop, when, now)

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float, now: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_later(when - now, self._fire, loop)
        self._timer_at = when

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        due = self._due
        now = self._clock()
        while due:
            when, _, read = due[0]
            current = read.waiting and read.due == when  # a read re-armed later has a newer entry too
            if current and when > now + self._EARLY_S:
                self._arm(loop, when, now)
                return
            heapq.heappop(due)
            if current:
                try:
                    read.fire()
                except Exception as exc:  # one read's trouble must not stop the others' hedges
                    log.exception("hedging a read failed", extra={"request_id": read.request_id})
                    if not read.over:
                        read.deliver(exc)


def _int_header(value: bytes | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value.strip())
    except ValueError:
        return None
