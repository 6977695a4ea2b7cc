"""Which replicas a read asks when the map names none, and which first when the read is bounded.

    serving_or_last_known  the replicas serving a partition, or the last known ones when none serves it now
    RememberedOffsets      per (node, store, partition), the highest X-Keyroute-Offset a node answered with
                           (bounded); a read bounded by `min_offset` asks the replicas known to have applied
                           it first. The node decides on the bound, the router only prefers.
"""

from __future__ import annotations

from keyroute.cluster.partition_map import Endpoint
from keyroute.router.metrics import RouterMetrics
from keyroute.router.routing_table import RoutingTable

# Offsets remembered per (node URL, store, partition): beyond it the oldest entry is forgotten.
MAX_REMEMBERED_OFFSETS = 65536


def serving_or_last_known(
    table: RoutingTable, metrics: RouterMetrics, store: str, partition: int, serving: tuple[Endpoint, ...]
) -> tuple[Endpoint, ...]:
    """`serving` (a partition's serving replicas in `table`), or when empty the nodes that served it last."""
    if serving:
        return serving
    known = table.last_known_endpoints(store, partition)
    if known:
        metrics.last_known_routes += 1
    return known


class RememberedOffsets:
    """The highest offset each node reported per partition of a live store, the oldest forgotten first."""

    def __init__(self) -> None:
        self._offsets: dict[tuple[str, str, int], int] = {}

    def remember(self, url: str, store: str, partition: int, offset: bytes | int | None) -> None:
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

    def remembered(self, url: str, store: str, partition: int) -> int | None:
        """The highest offset the node at `url` reported for `partition` of `store`, if any."""
        return self._offsets.get((url, store, partition))

    def fresh_first(
        self, order: tuple[Endpoint, ...], store: str, partition: int, min_offset: int
    ) -> tuple[Endpoint, ...]:
        """`order` with the replicas known to have applied `min_offset` first (each group in its order)."""
        offsets = self._offsets
        fresh = [ep for ep in order if offsets.get((ep.url, store, partition), -1) >= min_offset]
        if not fresh or len(fresh) == len(order):
            return order
        return (*fresh, *(ep for ep in order if ep not in fresh))
