"""What both of the proxy's engines are built on: a key's read (router/read_engine.py) and a batch's fan-out
(router/batch_reads.py) send their requests over one wire, count them in one balancer and one retry budget,
take what they end with in one `NodeOutcomes`, keep the offsets live stores answer with in one place, and
time everything by one clock."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from keyroute.http.upstream import Upstream
from keyroute.router.balancer import Balancer, RetryBudget
from keyroute.router.metrics import RouterMetrics
from keyroute.router.node_outcomes import NodeOutcomes
from keyroute.router.proxy_settings import ProxySettings
from keyroute.router.replica_order import RememberedOffsets


class EngineParts(NamedTuple):
    """The proxy's collaborators, the same objects for both engines (made by `Proxy`)."""

    upstream: Upstream
    settings: ProxySettings
    balancer: Balancer
    budget: RetryBudget
    outcomes: NodeOutcomes
    offsets: RememberedOffsets
    metrics: RouterMetrics
    clock: Callable[[], float]


class Engine:
    """An engine's collaborators, held as its own attributes (read on every request)."""

    def __init__(self, parts: EngineParts) -> None:
        (
            self.upstream, self.settings, self.balancer, self.budget,
            self.outcomes, self.offsets, self.metrics, self.clock,
        ) = parts  # fmt: skip
