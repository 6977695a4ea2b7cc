"""A batch-get's fan-out: one request per node holding some of the keys, in parallel, failing over to the
next replica with all of a partition's keys together (`keyroute.http.forwarding.forward_batch`), and one entry
per key back in request order.

Versions: a partition's routable endpoints all serve one version (`PartitionMap` picks it), and a batch sends
all keys of one partition to one node at a time, so within one batch answer every key of a partition carries
the same version. Partitions may differ from each other while a new version is being swapped in.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from keyroute.api import ApiError, BatchKeyTooLong, PayloadTooLarge, key_too_long
from keyroute.cluster.partition_map import Endpoint
from keyroute.http import forwarding
from keyroute.http.forwarding import OffsetBounds, error_entry
from keyroute.router.engine import Engine
from keyroute.router.replica_order import serving_or_last_known
from keyroute.router.routing_table import RoutingTable

log = logging.getLogger(__name__)


def key_text(raw: Any) -> str | None:
    """A batch key as text: a string as it is, an integer as its decimal; None for anything else."""
    if isinstance(raw, str):
        return raw
    # Integer keys are accepted as JSON numbers for convenience; their text form is the decimal.
    if isinstance(raw, int) and not isinstance(raw, bool):
        return str(raw)
    return None


class BatchReads(Engine):
    """Answers batch-gets (made once per `Proxy`, on the collaborators its `ReadEngine` has too)."""

    async def get(
        self,
        table: RoutingTable,
        live: bool,
        store: str,
        keys: Sequence[Any],
        request_id: str | None,
        bounds: OffsetBounds | None,
        fields: str,
    ) -> list[dict[str, Any]]:
        """`Proxy.batch_get` on `table`; `live`: `store` is a live store (its entries' offsets are kept)."""
        metrics = self.metrics
        settings = self.settings
        metrics.batch_requests += 1
        metrics.batch_keys += len(keys)
        if len(keys) > settings.max_batch_keys:
            raise PayloadTooLarge(f"{len(keys)} keys in one batch; at most {settings.max_batch_keys} are allowed")
        if not table.has_store(store):
            raise table.unknown_store(store)
        if bounds is not None:
            bounds.check(store, table.map.stores[store].partitions)
        # Where each key goes, for the bounds sent with it and the offsets its entry reports.
        partition_of: dict[str, int] | None = {} if bounds is not None or live else None

        results: list[dict[str, Any] | None] = [None] * len(keys)
        texts: dict[int, str] = {}
        candidates: dict[int, tuple[Endpoint, ...]] = {}
        # One replica order per partition for the whole batch, so a partition's keys travel together.
        orders: dict[int, tuple[Endpoint, ...]] = {}
        max_key_bytes = settings.max_key_bytes
        for i, raw in enumerate(keys):
            text = key_text(raw)
            if text is None:
                results[i] = error_entry(raw, table.bad_batch_key(store, raw))
                continue
            if max_key_bytes and key_too_long(text, max_key_bytes):
                results[i] = error_entry(raw, BatchKeyTooLong(f"the key is longer than {max_key_bytes} bytes"))
                continue
            try:
                route = table.locate(store, text)
            except ApiError as exc:
                results[i] = error_entry(text, exc)
                continue
            order = orders.get(route.partition)
            if order is None:
                serving = serving_or_last_known(table, metrics, store, route.partition, route.serving)
                order = self.balancer.order(serving)
                bound = bounds.bound(route.partition) if bounds is not None else None
                if bound is not None:
                    order = self.offsets.fresh_first(order, store, route.partition, bound)
                orders[route.partition] = order
            if not order:
                metrics.unavailable += 1
                results[i] = error_entry(
                    text, settings.unavailable(f"no node serves partition {route.partition} of store {store!r}")
                )
                continue
            texts[i] = text
            candidates[i] = order
            if partition_of is not None:
                partition_of[text] = route.partition

        path = forwarding.batch_path(store) + fields
        headers = {**settings.node_headers(request_id), "content-type": "application/json"}

        async def send(endpoint: Endpoint, group: list[str], round_number: int) -> list[dict[str, Any]] | None:
            # A first request to a node feeds the retry budget, a failover round spends from it.
            if round_number == 0:
                self.budget.deposit()
            else:
                self.budget.spend_failover()
            min_offsets = None
            if bounds is not None and partition_of is not None:
                min_offsets = bounds.wire(sorted({partition_of[text] for text in group}))
            entries = await self._node_batch(endpoint, path, group, headers, min_offsets)
            if entries is not None and partition_of is not None:
                for text, entry in zip(group, entries, strict=True):
                    offset = entry.get("offset")
                    if type(offset) is int:
                        self.offsets.remember(endpoint.url, store, partition_of[text], offset)
            return entries

        forwarded = await forwarding.forward_batch(texts, candidates, send)
        metrics.failovers += forwarded.failovers
        for i, entry in forwarded.entries.items():
            if entry.get("status") == 503:
                metrics.unavailable += 1
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
        started = self.clock()
        balancer = self.balancer
        outcomes = self.outcomes
        url = endpoint.url
        balancer.request_sent(url)
        try:
            reply = await self.upstream.post(url + path, forwarding.batch_body(texts, min_offsets), headers)
        except Exception as exc:
            if not outcomes.failed(endpoint, exc):
                raise
            return None
        finally:
            balancer.request_ended(url)
        outcomes.replied(endpoint, self.clock() - started)
        outcomes.check_hops(reply)
        if reply.status != 200:
            if reply.status == 503:
                outcomes.refused(reply, min_offsets is not None)
            log.warning("node %s replied to a batch-get with status %d", endpoint.node_id, reply.status)
            return None
        entries = forwarding.parse_batch_answer(reply.body, len(texts))
        if entries is None:
            log.warning("node %s replied to a batch-get with a malformed body", endpoint.node_id)
        return entries
