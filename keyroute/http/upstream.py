"""The wire between members (router to node, node to node), behind a small interface: `Upstream`.

An implementation only moves bytes: it reports an unreachable node as `UpstreamUnavailable`, never parses.
`FastUpstream` (keyroute.http.fast_upstream) is the one the services use; benchmarks/upstream_clients.py
measures it against httpx behind the same interface.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol


class UpstreamUnavailable(Exception):
    """The node could not be reached, timed out, or went away mid-reply; the read may go to a replica.

    `node_fault` is False when the sender itself was the bottleneck (its connection pool was exhausted):
    the request may still be retried, but the node should not be put in back-off for it.
    """

    def __init__(self, message: str, node_fault: bool = True) -> None:
        super().__init__(message)
        self.node_fault = node_fault


class UpstreamResponse(NamedTuple):
    """A node's complete reply: status, raw headers and the body (any content coding already removed).

    Immutable; a NamedTuple rather than a frozen dataclass because it is made twice per proxied read and a
    tuple is made for a fraction of the cost."""

    status: int
    headers: Sequence[tuple[bytes, bytes]]
    body: bytes

    def header(self, name: bytes) -> bytes | None:
        """First value of header `name` (lowercase)."""
        size = len(name)
        for key, value in self.headers:
            # Only a name of the same length can match: most are never lower-cased.
            if len(key) == size and (key == name or key.lower() == name):
                return value
        return None


class Upstream(Protocol):
    async def get(self, url: str, headers: Mapping[str, str]) -> UpstreamResponse: ...

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse: ...

    async def aclose(self) -> None: ...
