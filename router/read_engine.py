"""The engine of a single-key read: its requests to the serving replicas, one after another or two at once.

    send      a request out: on an idle pooled connection at once (no coroutine), else through
              `Upstream.get` in a task; a request the node never saw (a stale idle connection) is sent again
    replied   a request ended: the reply delivered, or a refusal kept while another replica may answer
    failover  nothing out and nothing usable came back: the next replica is asked, or the read fails
    hedge     the first request has not replied in time: the next replica is asked too, within the retry
              budget and unless that replica is backed off
    stall     nothing has replied within the stall delay: the replica waited on is backed off and the next
              one asked whatever the budget says

What a request ended with is taken as a batch's requests take it (router/node_outcomes.py); what of a reply
is passed on is router/relay.py's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Final

from keyroute.api import HEADER_OFFSET
from keyroute.cluster.partition_map import Endpoint
from keyroute.http.fast_upstream import StaleConnection, header_block
from keyroute.http.forwarding import passthrough_headers
from keyroute.http.upstream import UpstreamResponse
from keyroute.router.balancer import LatencyQuantile
from keyroute.router.engine import Engine, EngineParts
from keyroute.router.hedge_timer import HedgeTimer
from keyroute.router.key_read import NodeRequest, OnResult, Read
from keyroute.router.proxy_settings import HedgeSettings
from keyroute.router.relay import relayed
from keyroute.runtime.logs import bind_request_id

_OFFSET: Final = HEADER_OFFSET.encode("ascii")
# tuple.__new__: builds a NamedTuple (UpstreamResponse) without the Python frame of its generated __new__.
_new_tuple: Final = tuple.__new__
_UPSTREAM_RESPONSE: Final = UpstreamResponse  # C statics in the compiled build, not globals looked up
_relayed: Final = relayed


class ReadEngine(Engine):
    """Moves each `Read` along, from its first request to its delivered result (made once per `Proxy`)."""

    def __init__(self, parts: EngineParts, hedge: HedgeSettings) -> None:
        super().__init__(parts)
        self._in_flight = self.balancer.in_flight  # requests in flight per node URL, the balancer's own
        self._backoff = self.outcomes.backoff
        self._hedging = hedge.after_s != 0
        self._hedge_after_s = hedge.after_s
        self._stall_after_s = hedge.stall_after_s
        # Only the automatic threshold needs latencies: a fixed one or none at all skips the bookkeeping.
        self._latency = LatencyQuantile() if hedge.after_s is None else None
        self._timer = HedgeTimer(self.clock)
        upstream = self.upstream
        # Sending on an idle connection without a coroutine (FastUpstream.get_now); None: every request
        # goes through `Upstream.get` in a task.
        self._send_now: Callable[[str, bytes, OnResult], Any] | None = getattr(upstream, "get_now", None)
        # The same with the node's URL and the path apart (FastUpstream.get_now_at), for the paths the proxy
        # made itself (nothing to split or check again).
        self._send_now_at: Callable[[str, str, bytes, OnResult], Any] | None = getattr(upstream, "get_now_at", None)
        # What every request to a node carries except its request id, as header lines.
        self._id_head = header_block(self.settings.node_headers(None)) + b"x-request-id: "  # then the read's id
        # Requests sent through `Upstream.get`: the loop keeps only weak references to tasks.
        self.tasks: set[asyncio.Task[UpstreamResponse]] = set()

    @property
    def hedge_delay_s(self) -> float | None:
        """How long a read's first request may take before the read is hedged now: the fixed delay, the one
        derived from recent latencies (None until there are enough), or 0 when hedging is off."""
        latency = self._latency
        return self._hedge_after_s if latency is None else latency.value_s

    def start(self, read: Read) -> None:
        """`read`'s first request out, and its hedge (or stall delay) timed when another replica could help."""
        self.send(read, read.order[0], False, False)
        if len(read.order) > 1:
            delay = None
            if self._hedging:
                latency = self._latency
                delay = self._hedge_after_s if latency is None else latency.value_s
            if delay:
                read.waiting = True
                self._timer.add(read, delay)
            elif self._stall_after_s:
                read.waiting = read.stalled = True
                self._timer.add(read, self._stall_after_s)

    def send(self, read: Read, endpoint: Endpoint, hedge: bool, resend: bool) -> None:
        """One request of `read` to `endpoint`: on an idle connection at once when there is one, else in a
        task. A `resend` (the idle connection had been closed by the node) is the same upstream request
        again, never on an idle connection: `Upstream.get` opens a new one if it must."""
        request = NodeRequest(read, endpoint)
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
        request.started = self.clock()
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
        task = asyncio.get_running_loop().create_task(self.get(url + read.path, read.request_id))
        request.pending = task
        self.tasks.add(task)
        task.add_done_callback(request.fetched)

    async def get(self, url: str, request_id: str) -> UpstreamResponse:
        """A GET to a node with the headers every request to a node carries (`Upstream.get`, in a task)."""
        bind_request_id({}, request_id)  # this task's log lines carry it
        return await self.upstream.get(url, self.settings.node_headers(request_id))

    def replied(self, request: NodeRequest, result: UpstreamResponse | Exception) -> None:
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
        outcomes = self.outcomes
        if isinstance(result, _UPSTREAM_RESPONSE):
            elapsed = self.clock() - request.started
            outcomes.replied(endpoint, elapsed)
            if self._latency is not None:
                self._latency.record(elapsed)
            passed, hops = _relayed(result.headers)
            if hops is not None and hops != b"0":  # "0": the node served it itself (as `hops_seen` says)
                outcomes.hops_seen(hops, result)
            if read.live:
                self.offsets.remember(endpoint.url, read.store, read.partition, result.header(_OFFSET))
            if result.status != 503:
                if hedge:
                    self.metrics.hedge_wins += 1
                # UpstreamResponse(...) without its Python-level __new__ (a NamedTuple's): once per read.
                read.deliver(_new_tuple(_UPSTREAM_RESPONSE, (result.status, passed, result.body)))
                return
            outcomes.refused(result, read.min_offset is not None)
            read.refused = result  # a replica still might answer
        elif isinstance(result, StaleConnection):
            # The node had closed the idle connection and never saw the request (not its fault).
            self.send(read, endpoint, hedge, True)
            return
        elif not outcomes.failed(endpoint, result):
            read.deliver(result)  # unexpected: the read fails with it
            return
        if read.lead is None and read.hedge is None:
            self.fail_over(read)
        # else: the read's other request may still reply

    def fail_over(self, read: Read) -> None:
        """Nothing of `read` is out and nothing usable came back: ask the next replica, or deliver the last
        refusal, or PartitionUnavailable when every replica failed."""
        read.waiting = False  # a hedge not sent yet never will be: the next replica is asked now
        order = read.order
        if read.asked < len(order):
            self.metrics.failovers += 1
            self.budget.spend_failover()
            endpoint = order[read.asked]
            read.asked += 1
            self.send(read, endpoint, False, False)
            if read.asked < len(order) and self._stall_after_s:
                read.waiting = read.stalled = True  # the replica failed over to may be frozen too
                self._timer.add(read, self._stall_after_s)
            return
        refused = read.refused
        if refused is not None:
            read.deliver(UpstreamResponse(refused.status, passthrough_headers(refused.headers), refused.body))
            return
        self.metrics.unavailable += 1
        tried = ", ".join(endpoint.node_id for endpoint in order)
        read.deliver(
            self.settings.unavailable(
                f"no node serving partition {read.partition} of store {read.store!r} answered (tried {tried})"
            )
        )

    def hedge(self, read: Read) -> None:
        """`read`'s first request has not replied in time: ask the next replica too, unless it is backed off
        (it failed just now: a second request there would not be faster) or the retry budget is spent. Then,
        if still nothing has replied by the stall delay, the next replica is asked all the same."""
        if read.stalled:
            self._stalled(read)
            return
        endpoint = read.order[1]
        refused = self._backoff.backed_off(endpoint.url)
        if not refused and not self.budget.try_spend():
            self.metrics.budget_exhausted += 1
            refused = True
        if refused:
            lead = read.lead
            if self._stall_after_s and lead is not None:
                read.waiting = read.stalled = True
                waited = self.clock() - lead.started
                self._timer.add(read, max(self._stall_after_s - waited, 0.0))
            return
        self.metrics.hedges += 1
        read.asked = 2
        self.send(read, endpoint, True, False)

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
        self.budget.spend_failover()
        endpoint = order[read.asked]
        read.asked += 1
        self.send(read, endpoint, True, False)

    def cancel(self, request: NodeRequest) -> None:
        """Abandon `request` (out for its read): its connection is closed, never reused, and its reply never
        read. It counts for the automatic hedge threshold: it took at least this long."""
        pending = request.pending
        request.pending = None
        read = request.read
        if read.lead is request:
            read.lead = None
        else:
            read.hedge = None
        self.balancer.request_ended(request.endpoint.url)
        if self._latency is not None:
            self._latency.record(self.clock() - request.started)
        pending.cancel()
