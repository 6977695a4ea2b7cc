"""What the router's data path is allowed and told, passed whole to `Proxy` (as httpx passes `Limits` and
`Timeout`): `ProxySettings` (batch limits, what a 503 advises, the proof of membership every request to a node
carries) and `HedgeSettings` (when a read also asks a second replica, how many extra requests the router may
send, when a replica that answers nothing is given up on)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from keyroute.api import HEADER_REQUEST_ID, HEADER_ROUTER, PartitionUnavailable
from keyroute.runtime.settings import DEFAULT_STALL_AFTER_MS, RouterSettings


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

    def node_headers(self, request_id: str | None) -> dict[str, str]:
        """The headers of a request to a node: the router's mark, the membership proof, the read's id."""
        # identity: the body is passed on as bytes, so it must not need decoding.
        headers = {HEADER_ROUTER: "1", "accept-encoding": "identity", **self.member_headers}
        if request_id:
            headers[HEADER_REQUEST_ID] = request_id
        return headers

    def unavailable(self, message: str) -> PartitionUnavailable:
        """The 503 of a read no node could answer, with this router's Retry-After."""
        return PartitionUnavailable(message, retry_after_s=self.retry_after_s)


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
