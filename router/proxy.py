"""The router's data path: one key, or a batch fanned out per node, sent to a node serving its partition.

Failover across serving replicas, node back-off and misroute detection live here; the wire is `Upstream`.

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
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any
from urllib.parse import quote

from keyroute.core.api import (
    HEADER_GENERATION,
    HEADER_HOPS,
    HEADER_REQUEST_ID,
    ApiError,
    BadKey,
    BadRequest,
    BatchKeyTooLong,
    PartitionUnavailable,
    PayloadTooLarge,
    StoreNotFound,
    key_too_long,
)
from keyroute.core.logs import bind_request_id
from keyroute.core.partition_map import Endpoint
from keyroute.router.backoff import NodeBackoff
from keyroute.router.balancer import Balancer, LatencyQuantile, RetryBudget
from keyroute.router.fast_upstream import StaleConnection, header_block
from keyroute.router.metrics import RouterMetrics
from keyroute.router.routing_table import RoutingTable
from keyroute.router.upstream import Upstream, UpstreamResponse, UpstreamUnavailable

log = logging.getLogger(__name__)

# Marks a request as sent by a router. Deliberately not the hop header: a node whose view is newer than
# ours must still be allowed to forward once, which is the fallback when our map is stale.
HEADER_ROUTER = "x-keyroute-router"

# A burst of misrouted reads (say, during a rebalance) asks for one re-read, not one per read.
MIN_REFRESH_INTERVAL_S = 0.5

_HOPS = HEADER_HOPS.encode("ascii")
_GENERATION = HEADER_GENERATION.encode("ascii")
# Hop-by-hop headers (RFC 9110 section 7.6.1) belong to one connection, never to the answer; the
# framing and server headers are set again by our own server for our own connection.
_NOT_PASSED = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"content-length",
        b"date",
        b"server",
    }
)


def passthrough_headers(headers: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """A node's response headers minus hop-by-hop ones (also those its Connection header names)."""
    kept = []
    named: set[bytes] | None = None
    for name, value in headers:
        lowered = name.lower()
        if lowered not in _NOT_PASSED:
            kept.append((lowered, value))
        elif lowered == b"connection":
            named = (named or set()) | {token.strip().lower() for token in value.split(b",")}
    if named:
        kept = [(name, value) for name, value in kept if name not in named]
    return kept


def key_segment(text: str) -> str:
    """A key as one URL path segment that every client and server on the way leaves alone.

    '/', '%', '?', '#', '+', spaces and non-ASCII are percent-encoded; "." and ".." also are, because
    URL normalisation (RFC 3986 dot segments, which httpx applies) would otherwise remove them.
    """
    if text in (".", ".."):
        return text.replace(".", "%2E")
    return quote(text, safe="")


def parse_batch_body(body: bytes) -> list[Any]:
    """The `keys` of a batch-get body; BadRequest when the body is not `{"keys": [...]}`."""
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"the body is not valid JSON ({exc})") from exc
    if not isinstance(obj, dict) or not isinstance(obj.get("keys"), list):
        raise BadRequest('expected a JSON object {"keys": [...]}')
    return obj["keys"]


def error_entry(key: Any, error: ApiError) -> dict[str, Any]:
    return {"key": key, "status": error.status, "error": error.code, "message": error.message}


def _key_text(raw: Any) -> str | None:
    if isinstance(raw, str):
        return raw
    # Integer keys are accepted as JSON numbers for convenience; their text form is the decimal.
    if isinstance(raw, int) and not isinstance(raw, bool):
        return str(raw)
    return None


class Proxy:
    """Routes reads with the current `RoutingTable`; `table` is replaced whole by `install`."""

    def __init__(
        self,
        upstream: Upstream,
        *,
        on_stale_map: Callable[[], None],
        max_batch_keys: int = 1000,
        max_key_bytes: int = 0,
        retry_after_s: int = 1,
        backoff: NodeBackoff | None = None,
        metrics: RouterMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        hedge_after_s: float | None = None,
        retry_budget_ratio: float = 0.1,
        rng: random.Random | None = None,
        member_headers: Mapping[str, str] | None = None,
    ) -> None:
        self.table = RoutingTable.empty()
        # Proof of membership (keyroute_core.security.ClusterAuth.headers()) sent with every request to a node.
        self._member_headers = dict(member_headers or {})
        self.metrics = metrics or RouterMetrics()
        self._upstream = upstream
        self._on_stale_map = on_stale_map
        self._max_batch_keys = max_batch_keys
        self._max_key_bytes = max_key_bytes  # a batch key beyond it gets its own 400 entry (0: no limit)
        self._retry_after_s = retry_after_s
        self._backoff = backoff or NodeBackoff()
        # Hedging: a single-key read that has not answered after `hedge_after_s` is also sent to another
        # serving replica; None derives the delay from recent upstream latencies, 0 turns hedging off.
        if hedge_after_s is not None and hedge_after_s < 0:
            raise ValueError("hedge_after_s must not be negative (0 turns hedging off)")
        self._balancer = Balancer(self._backoff, rng)
        self._budget = RetryBudget(retry_budget_ratio)
        self._hedging = hedge_after_s != 0
        self._hedge_after_s = hedge_after_s
        # Only the automatic threshold needs latencies: a fixed one or none at all skips the bookkeeping.
        self._latency = LatencyQuantile() if hedge_after_s is None else None
        self._hedge_timer = _HedgeTimer()
        self._clock = clock
        # `Proxy.read` without a coroutine needs an upstream that can send at once (FastUpstream.get_now).
        self._send_now: Callable[[str, bytes, Callable[[UpstreamResponse | Exception], None]], Any] | None = getattr(
            upstream, "get_now", None
        )
        # What every request to a node carries except its request id, as header lines.
        self._block = header_block(self._headers(None))
        self._tasks: set[asyncio.Task[None]] = set()
        self._last_refresh = float("-inf")
        # The highest map generation a node reported while forwarding for us that made us re-read.
        self._refreshed_for = 0

    def install(self, table: RoutingTable) -> None:
        """Swap in a new routing view (on the event loop thread; readers keep the one they started with)."""
        self.table = table
        m = self.metrics
        m.map_updates += 1
        m.map_generation = table.generation
        m.map_stale = table.stale
        m.map_complete = table.complete
        m.map_installed(table.map)

    async def get(self, store: str, key_text: str, request_id: str | None = None) -> UpstreamResponse:
        """A node's answer for one key, headers filtered for passing on; raises ApiError when none answers."""
        read = self._plan(store, key_text, request_id, None)
        return await self._attempts(read, [], None)

    def read(
        self,
        store: str,
        key_text: str,
        request_id: str,
        on_answer: Callable[[UpstreamResponse | Exception], None],
    ) -> None:
        """`get` for a caller that is not a coroutine (the router's server protocol): `on_answer` is called
        once, later, with what `get` would return or raise (an ApiError, or anything unexpected); what is
        wrong at once (an unknown store, a bad key, nothing serving) is raised here.

        Most reads go without a coroutine: sent on an idle connection at once, their answer handed on from
        the connection's callback, hedged (`_Read.fire`) by the same timer as `get`'s hedges. A read that
        finds no idle connection, or has to try again elsewhere (a failed or refusing node, a stale
        connection), continues as `get` does, in a task."""
        read = self._plan(store, key_text, request_id, on_answer)
        send_now = self._send_now
        if send_now is not None:
            endpoint = read.order[0]
            url = endpoint.url
            balancer = self._balancer
            balancer.started(url)
            read.started = time.perf_counter()
            exchange = send_now(url + read.path, self._express_block(request_id), read.answered)
            if exchange is not None:
                self.metrics.upstream_requests += 1
                read.exchange = exchange
                if len(read.order) > 1:
                    delay = self._hedge_delay()
                    if delay:
                        read.waiting = True
                        self._hedge_timer.add(read, delay)
                return
            balancer.finished(url)
        self._continue(read, [], None)

    def _plan(
        self,
        store: str,
        key_text: str,
        request_id: str | None,
        on_answer: Callable[[UpstreamResponse | Exception], None] | None,
    ) -> _Read:
        """The read's route and the order to ask the serving nodes in; counted, and a deposit in the retry
        budget. Raises ApiError when the store or key is bad or no node serves the partition."""
        self.metrics.key_requests += 1
        table = self.table
        route = table.resolve(store, key_text)
        serving = self._serving(table, store, route.partition, route.serving)
        if not serving:
            self.metrics.unavailable += 1
            raise self._unavailable(f"no node serves partition {route.partition} of store {store!r}")
        path = f"/stores/{key_segment(store)}/keys/{key_segment(key_text)}"
        order = self._balancer.order(serving)
        self._budget.deposit()
        return _Read(self, store, route.partition, path, order, request_id, on_answer)

    def _hedge_delay(self) -> float | None:
        """How long a read waits before it is hedged; None or 0 when it is not."""
        if not self._hedging:
            return None
        latency = self._latency
        return self._hedge_after_s if latency is None else latency.value_s

    def _express_block(self, request_id: str) -> bytes:
        # The request id is one `request_id_in` accepted or made: visible ASCII, no spaces.
        return self._block + b"x-request-id: " + request_id.encode("ascii") + b"\r\n"

    def _continue(self, read: _Read, tried: list[str], refused: UpstreamResponse | None) -> None:
        """The rest of `read` as `get` does it (the nodes not yet `tried`), in a task."""
        self._spawn(self._attempts(read, tried, refused), read)

    async def _finish(self, work: Awaitable[UpstreamResponse], read: _Read) -> None:
        if read.request_id is not None:
            bind_request_id({}, read.request_id)  # this task's log lines carry it
        try:
            answer: UpstreamResponse | Exception = await work
        except Exception as exc:
            answer = exc
        read.deliver(answer)

    async def _attempts(self, read: _Read, tried: list[str], refused: UpstreamResponse | None) -> UpstreamResponse:
        """Ask the nodes of `read.order` not yet `tried` (hedged when none was), until one answers."""
        order, path = read.order, read.path
        headers = self._headers(read.request_id)
        if not tried:
            delay = self._hedge_delay() if len(order) > 1 else None
            if delay:
                answer, refused = await self._hedged(order, path, headers, delay, tried)
                if answer is not None:
                    return UpstreamResponse(answer.status, passthrough_headers(answer.headers), answer.body)
        for endpoint in order[len(tried) :]:
            if tried:
                self.metrics.failovers += 1
                self._budget.spend_failover()
            tried.append(endpoint.node_id)
            response = await self._fetch(endpoint, path, headers)
            if response is None:
                continue
            if response.status == 503:
                # The node no longer serves the partition and knows no one who does: a replica still might.
                refused = response
                self._refresh_map()
                continue
            return UpstreamResponse(response.status, passthrough_headers(response.headers), response.body)
        if refused is not None:
            return UpstreamResponse(refused.status, passthrough_headers(refused.headers), refused.body)
        self.metrics.unavailable += 1
        raise self._unavailable(
            f"no node serving partition {read.partition} of store {read.store!r} answered (tried {', '.join(tried)})"
        )

    def _answered_now(self, read: _Read, result: UpstreamResponse | Exception) -> None:
        """The answer to the request `read` sent without a coroutine: handed on, or the read continues."""
        first = read.order[0]
        read.waiting = False
        hedge = read.hedge
        self._balancer.finished(first.url)
        if isinstance(result, UpstreamResponse):
            # As `_send` and `_fetch` do for an answer.
            elapsed = time.perf_counter() - read.started
            self.metrics.observe_upstream(first.node_id, elapsed)
            self._backoff.succeeded(first)
            if self._latency is not None:
                self._latency.record(elapsed)
            self._check_hops(result)
            if result.status != 503:
                if hedge is not None:
                    _abandon(hedge)
                read.deliver(UpstreamResponse(result.status, passthrough_headers(result.headers), result.body))
                return
            # The node no longer serves the partition and knows no one who does: a replica still might.
            self._refresh_map()
            refused: UpstreamResponse | None = result
        elif isinstance(result, StaleConnection):
            # The node had closed the idle connection and never saw the request (not its fault).
            if hedge is None:
                # Sent again on a new connection, as `get` does, within the same upstream request.
                self.metrics.upstream_requests -= 1
                self._continue(read, [], None)
                return
            refused = None  # the hedge is out and may answer
        else:
            self.metrics.upstream_failures += 1
            if not isinstance(result, UpstreamUnavailable) or result.node_fault:
                self._backoff.failed(first, str(result))
            refused = None
        if hedge is None:
            self._continue(read, [first.node_id], refused)
        else:
            self._spawn(self._after_hedge(read, hedge, refused), read)

    def _launch_hedge(
        self,
        endpoint: Endpoint,
        path: str,
        headers: Mapping[str, str],
        request_id: str | None,
        on_done: Callable[[asyncio.Task[UpstreamResponse | None]], None],
    ) -> asyncio.Task[UpstreamResponse | None] | None:
        """The second request of a hedged read (`_Hedge` for `get`, `_Read` for `read`), to `endpoint` in a
        task that calls `on_done` when it ends; None when that replica is backed off (it failed just now: a
        second request there would not be faster) or the retry budget is spent."""
        if self._backoff.backed_off(endpoint.url):
            return None
        if not self._budget.try_spend():
            self.metrics.budget_exhausted += 1
            return None
        task = asyncio.get_running_loop().create_task(self._hedge_request(endpoint, path, headers, request_id))
        task.add_done_callback(on_done)
        return task

    async def _hedge_request(
        self, endpoint: Endpoint, path: str, headers: Mapping[str, str], request_id: str | None
    ) -> UpstreamResponse | None:
        # Counted here, not at launch: a hedge cancelled before its task first ran was never sent.
        self.metrics.hedges += 1
        if request_id is not None:
            bind_request_id({}, request_id)  # this task's log lines carry it
        return await self._fetch(endpoint, path, headers)

    def _spawn(self, work: Awaitable[UpstreamResponse], read: _Read) -> None:
        """The rest of `read` as `work` does it, in a task; its answer goes to `read.on_answer`."""
        task = asyncio.get_running_loop().create_task(self._finish(work, read))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _after_hedge(
        self, read: _Read, hedge: asyncio.Task[UpstreamResponse | None], refused: UpstreamResponse | None
    ) -> UpstreamResponse:
        """The first request failed or refused while the hedge is out: the hedge may answer (as in `_hedged`),
        else the replicas neither was sent to."""
        order = read.order
        second = await hedge
        if second is not None:
            if second.status != 503:
                self.metrics.hedge_wins += 1
                return UpstreamResponse(second.status, passthrough_headers(second.headers), second.body)
            self._refresh_map()
            refused = second
        return await self._attempts(read, [order[0].node_id, order[1].node_id], refused)

    async def batch_get(self, store: str, keys: Sequence[Any], request_id: str | None = None) -> list[dict[str, Any]]:
        """One result per key in request order; one request per node, in parallel, replicas on failure."""
        self.metrics.batch_requests += 1
        self.metrics.batch_keys += len(keys)
        if len(keys) > self._max_batch_keys:
            raise PayloadTooLarge(f"{len(keys)} keys in one batch; at most {self._max_batch_keys} are allowed")
        table = self.table
        if not table.has_store(store):
            raise StoreNotFound(f"no store named {store!r}")

        results: list[dict[str, Any] | None] = [None] * len(keys)
        texts: dict[int, str] = {}
        candidates: dict[int, tuple[Endpoint, ...]] = {}
        # One replica order per partition for the whole batch, so a partition's keys travel together.
        orders: dict[int, tuple[Endpoint, ...]] = {}
        for i, raw in enumerate(keys):
            text = _key_text(raw)
            if text is None:
                results[i] = error_entry(raw, BadKey("a key must be a JSON string"))
                continue
            if self._max_key_bytes and key_too_long(text, self._max_key_bytes):
                results[i] = error_entry(raw, BatchKeyTooLong(f"the key is longer than {self._max_key_bytes} bytes"))
                continue
            try:
                route = table.resolve(store, text)
            except ApiError as exc:
                results[i] = error_entry(text, exc)
                continue
            order = orders.get(route.partition)
            if order is None:
                serving = self._serving(table, store, route.partition, route.serving)
                order = orders[route.partition] = self._balancer.order(serving)
            if not order:
                self.metrics.unavailable += 1
                results[i] = error_entry(
                    text, self._unavailable(f"no node serves partition {route.partition} of store {store!r}")
                )
                continue
            texts[i] = text
            candidates[i] = order

        path = f"/stores/{key_segment(store)}/batch-get"
        headers = {**self._headers(request_id), "content-type": "application/json"}
        attempt = dict.fromkeys(candidates, 0)
        refused: dict[int, dict[str, Any]] = {}
        pending = list(candidates)
        first_round = True
        while pending:
            # Grouped by URL, not Endpoint: one node may serve different partitions at different versions.
            groups: dict[str, list[int]] = {}
            endpoints: dict[str, Endpoint] = {}
            for i in pending:
                endpoint = candidates[i][attempt[i]]
                groups.setdefault(endpoint.url, []).append(i)
                endpoints.setdefault(endpoint.url, endpoint)
            for _ in groups:
                if first_round:
                    self._budget.deposit()
                else:
                    self._budget.spend_failover()
            first_round = False
            answers = await asyncio.gather(
                *(
                    self._node_batch(endpoints[url], path, [texts[i] for i in indexes], headers)
                    for url, indexes in groups.items()
                )
            )
            pending = []
            for indexes, answer in zip(groups.values(), answers, strict=True):
                retry: list[int] = []
                if answer is None:
                    retry = indexes
                else:
                    for i, entry in zip(indexes, answer, strict=True):
                        if entry.get("status") == 503:
                            refused[i] = entry
                            retry.append(i)
                        else:
                            results[i] = entry
                for i in retry:
                    attempt[i] += 1
                    if attempt[i] < len(candidates[i]):
                        self.metrics.failovers += 1
                        pending.append(i)
                        continue
                    self.metrics.unavailable += 1
                    results[i] = refused.get(i) or error_entry(
                        texts[i],
                        self._unavailable(f"no node serving the partition of key {texts[i]!r} answered"),
                    )
        answered = [entry for entry in results if entry is not None]
        assert len(answered) == len(keys), "every key gets exactly one result"
        return answered

    async def _fetch(self, endpoint: Endpoint, path: str, headers: Mapping[str, str]) -> UpstreamResponse | None:
        """One single-key request (`_send`), its latency kept for the automatic hedge threshold."""
        latency = self._latency
        if latency is None:
            return await self._send(endpoint, self._upstream.get(endpoint.url + path, headers))
        started = time.perf_counter()
        try:
            response = await self._send(endpoint, self._upstream.get(endpoint.url + path, headers))
        except asyncio.CancelledError:
            # Cancelled because another request answered first: it took at least this long.
            latency.record(time.perf_counter() - started)
            raise
        if response is not None:  # a failure's latency says nothing about how long an answer takes
            latency.record(time.perf_counter() - started)
        return response

    async def _hedged(
        self,
        order: tuple[Endpoint, ...],
        path: str,
        headers: Mapping[str, str],
        delay_s: float,
        tried: list[str],
    ) -> tuple[UpstreamResponse | None, UpstreamResponse | None]:
        """Ask `order[0]`; when it has not answered within `delay_s`, also `order[1]` (budget allowing).

        Returns (the first answer, None), or (None, a 503 one of them gave) when neither answered; the
        nodes asked are appended to `tried`. The loser is cancelled: a cancelled request's connection is
        closed, never reused (FastUpstream). A fast answer costs one entry in `_HedgeTimer`, no timer.
        """
        reader = asyncio.current_task()
        assert reader is not None
        first = order[0]
        tried.append(first.node_id)
        hedge = _Hedge(self, reader, order[1], path, headers)
        cancelling = reader.cancelling()
        self._hedge_timer.add(hedge, delay_s)
        response: UpstreamResponse | None = None
        try:
            response = await self._fetch(first, path, headers)
        except asyncio.CancelledError:
            # The hedge answered and cancelled us (as `asyncio.timeout` does) unless someone else, too,
            # wants this read cancelled: then that cancellation goes on.
            if not hedge.won or reader.uncancel() > cancelling:
                hedge.abandon()
                raise
        finally:
            hedge.waiting = False
        task = hedge.task
        if task is None:  # answered in time, or no hedge was allowed
            if response is not None and response.status == 503:
                self._refresh_map()
                return None, response
            return response, None
        tried.append(hedge.endpoint.node_id)
        if hedge.won:
            self.metrics.hedge_wins += 1
            return task.result(), None
        refused: UpstreamResponse | None = None
        if response is not None:
            if response.status != 503:
                hedge.abandon()
                return response, None
            refused = response
            self._refresh_map()
        # The first request failed while the hedge is still out (or failed too): the hedge may answer.
        try:
            second = await task
        except asyncio.CancelledError:
            hedge.abandon()
            raise
        if second is None:
            return None, refused
        if second.status == 503:
            self._refresh_map()
            return None, second
        self.metrics.hedge_wins += 1
        return second, None

    async def _node_batch(
        self, endpoint: Endpoint, path: str, texts: list[str], headers: Mapping[str, str]
    ) -> list[dict[str, Any]] | None:
        """The node's result entries for `texts` in order, or None when it failed or answered nonsense."""
        body = json.dumps({"keys": texts}, ensure_ascii=False).encode("utf-8")
        response = await self._send(endpoint, self._upstream.post(endpoint.url + path, body, headers))
        if response is None:
            return None
        if response.status != 200:
            if response.status == 503:
                self._refresh_map()
            log.warning("node %s answered a batch-get with status %d", endpoint.node_id, response.status)
            return None
        try:
            entries = json.loads(response.body)["results"]
        except (ValueError, KeyError, TypeError):
            entries = None
        if (
            not isinstance(entries, list)
            or len(entries) != len(texts)
            or not all(isinstance(e, dict) and isinstance(e.get("status"), int) for e in entries)
        ):
            log.warning("node %s answered a batch-get with a malformed body", endpoint.node_id)
            return None
        return entries

    async def _send(self, endpoint: Endpoint, request: Awaitable[UpstreamResponse]) -> UpstreamResponse | None:
        """One request to one node; None (and the node backed off) when it could not be completed."""
        self.metrics.upstream_requests += 1
        started = time.perf_counter()
        balancer = self._balancer
        url = endpoint.url
        balancer.started(url)
        try:
            response = await request
        except UpstreamUnavailable as exc:
            self.metrics.upstream_failures += 1
            if exc.node_fault:
                self._backoff.failed(endpoint, str(exc))
            return None
        except ValueError as exc:
            # A node advertising a URL we cannot speak to (not http://, bad characters) is misconfigured:
            # treat it like an unreachable node rather than failing the read.
            self.metrics.upstream_failures += 1
            self._backoff.failed(endpoint, f"unusable node URL: {exc}")
            return None
        finally:
            balancer.finished(url)
        self.metrics.observe_upstream(endpoint.node_id, time.perf_counter() - started)
        self._backoff.succeeded(endpoint)
        self._check_hops(response)
        return response

    def _check_hops(self, response: UpstreamResponse) -> None:
        hops = response.header(_HOPS)
        if hops is not None and hops.strip() not in (b"", b"0"):
            # The node had to forward: it does not serve what our map says it serves.
            self.metrics.misroutes += 1
            self._refresh_map(_int_header(response.header(_GENERATION)))

    def _serving(
        self, table: RoutingTable, store: str, partition: int, serving: tuple[Endpoint, ...]
    ) -> tuple[Endpoint, ...]:
        if serving:
            return serving
        known = table.last_known_endpoints(store, partition)
        if known:
            self.metrics.last_known_routes += 1
        return known

    def _refresh_map(self, reported_generation: int | None = None) -> None:
        """Ask the map source to re-read now. A node that forwarded for us and used a newer map than ours
        proves our view is behind: re-read at once (once per such generation). Otherwise re-read at most
        every MIN_REFRESH_INTERVAL_S, so a burst of misroutes costs one read."""
        now = self._clock()
        newer = (
            reported_generation is not None
            and reported_generation > self.table.generation
            and reported_generation > self._refreshed_for
        )
        if newer or now - self._last_refresh >= MIN_REFRESH_INTERVAL_S:
            if newer and reported_generation is not None:
                self._refreshed_for = reported_generation
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


class _Read:
    """One single-key read: where to send it, in which order, and (for `Proxy.read`) whom to tell.

    A read sent without a coroutine (`Proxy.read`) is also its own hedge: `waiting` while the first
    request is out, `fire` (from `_HedgeTimer`) sends the second one to `order[1]` in a task; when that
    answers first, the first request's connection is closed and the hedge's answer handed on.
    """

    __slots__ = (
        "proxy",
        "store",
        "partition",
        "path",
        "order",
        "request_id",
        "on_answer",
        "started",
        "exchange",
        "waiting",
        "hedge",
    )

    def __init__(
        self,
        proxy: Proxy,
        store: str,
        partition: int,
        path: str,
        order: tuple[Endpoint, ...],
        request_id: str | None,
        on_answer: Callable[[UpstreamResponse | Exception], None] | None,
    ) -> None:
        self.proxy = proxy
        self.store = store
        self.partition = partition
        self.path = path
        self.order = order
        self.request_id = request_id
        self.on_answer = on_answer
        self.started = 0.0
        self.exchange: Any = None  # the first request, sent without a coroutine (it has `cancel`)
        self.waiting = False
        self.hedge: asyncio.Task[UpstreamResponse | None] | None = None

    def deliver(self, answer: UpstreamResponse | Exception) -> None:
        on_answer = self.on_answer
        assert on_answer is not None
        on_answer(answer)

    def answered(self, result: UpstreamResponse | Exception) -> None:
        try:
            self.proxy._answered_now(self, result)
        except Exception as exc:  # never into the connection's parser: the read fails, the router goes on
            log.exception("handling a node's answer failed")
            self.deliver(exc)

    # -- the hedge ------------------------------------------------------------------------------------

    def fire(self) -> None:
        proxy = self.proxy
        headers = proxy._headers(self.request_id)
        self.hedge = proxy._launch_hedge(self.order[1], self.path, headers, self.request_id, self._hedge_answered)

    def _hedge_answered(self, task: asyncio.Task[UpstreamResponse | None]) -> None:
        response = _winning(task) if self.waiting else None
        if response is None:
            return  # the first request answered meanwhile and decides, or it may still answer
        self.waiting = False
        proxy = self.proxy
        # The first request is abandoned: its connection is closed, never reused, and it counts as `get`
        # counts a cancelled request (its latency is at least this long).
        self.exchange.cancel()
        first = self.order[0]
        proxy._balancer.finished(first.url)
        if proxy._latency is not None:
            proxy._latency.record(time.perf_counter() - self.started)
        proxy.metrics.hedge_wins += 1
        try:
            self.deliver(UpstreamResponse(response.status, passthrough_headers(response.headers), response.body))
        except Exception:
            log.exception("handing on a hedged answer failed")


def _winning(hedge: asyncio.Task[UpstreamResponse | None]) -> UpstreamResponse | None:
    """The answer of a hedge that ended with one the read can take (not a failure, not a 503), else None."""
    if hedge.cancelled() or hedge.exception() is not None:
        return None
    response = hedge.result()
    return response if response is not None and response.status != 503 else None


def _abandon(hedge: asyncio.Task[UpstreamResponse | None]) -> None:
    """A hedge whose answer is no longer wanted: stopped, and no error of it unseen."""
    if not hedge.done():
        hedge.cancel()
    elif not hedge.cancelled() and hedge.exception() is not None:
        log.error("a hedged request failed unexpectedly", exc_info=hedge.exception())


class _HedgeTimer:
    """When each waiting read's hedge is due, on one loop timer for all of them.

    A timer per read (`loop.call_later` and its cancel) costs ~3 us on uvloop, more than the rest of the
    hedging bookkeeping together; here a read costs a heap push, and the one timer is armed for the
    earliest deadline. Reads that have answered meanwhile are dropped when their deadline comes up.
    """

    # uvloop counts whole milliseconds, so a timer may fire up to one early: that much early is due.
    _EARLY_S = 0.001

    def __init__(self) -> None:
        # Entries are `_Hedge`s of `get` and `_Read`s of `Proxy.read`: each has `waiting` and `fire`.
        self._due: list[tuple[float, int, _Hedge | _Read]] = []
        self._seq = itertools.count()  # ties on the deadline must never compare two _Hedge objects
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None

    def add(self, hedge: _Hedge | _Read, delay_s: float) -> None:
        loop = asyncio.get_running_loop()
        when = loop.time() + delay_s
        if loop is not self._loop:  # a new event loop (tests run one after another): start afresh
            self._loop, self._timer, self._due = loop, None, []
        heapq.heappush(self._due, (when, next(self._seq), hedge))
        if self._timer is None or when < self._timer_at - self._EARLY_S:
            self._arm(loop, when)

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(when, self._fire, loop)
        self._timer_at = when

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        due = self._due
        now = loop.time() + self._EARLY_S
        while due:
            when, _, hedge = due[0]
            if hedge.waiting and when > now:
                self._arm(loop, when)
                return
            heapq.heappop(due)
            if hedge.waiting:
                hedge.fire()


class _Hedge:
    """The second request of one single-key read, sent by a timer when the first has not answered in time.

    The read's task awaits its first request itself (a task of its own for it would cost more than the
    rest of the hedging bookkeeping); when the hedge answers first, it cancels the read's task while that
    waits for the first request, the way `asyncio.timeout` interrupts an await, and `Proxy._hedged` takes
    the hedge's answer. `waiting` is True exactly while the read's task is suspended in that await.
    """

    __slots__ = ("proxy", "reader", "endpoint", "path", "headers", "task", "waiting", "won")

    def __init__(
        self, proxy: Proxy, reader: asyncio.Task[Any], endpoint: Endpoint, path: str, headers: Mapping[str, str]
    ) -> None:
        self.proxy = proxy
        self.reader = reader
        self.endpoint = endpoint
        self.path = path
        self.headers = headers
        self.task: asyncio.Task[UpstreamResponse | None] | None = None
        self.waiting = True
        self.won = False

    def fire(self) -> None:
        # The reader's task is where this is created from: the hedge's task inherits its request id.
        self.task = self.proxy._launch_hedge(self.endpoint, self.path, self.headers, None, self._answered)

    def _answered(self, task: asyncio.Task[UpstreamResponse | None]) -> None:
        if self.waiting and _winning(task) is not None:
            self.won = True
            self.waiting = False
            self.reader.cancel()

    def abandon(self) -> None:
        """The read is over without the hedge's answer: stop it, and let no error of it go unseen."""
        if self.task is not None:
            _abandon(self.task)


def _int_header(value: bytes | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value.strip())
    except ValueError:
        return None
