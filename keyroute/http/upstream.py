"""The wire between members (router to node, node to node), behind a small interface: `Upstream`.

An implementation only moves bytes: it reports an unreachable node as `UpstreamUnavailable`, never parses.
`FastUpstream` (keyroute.http.fast_upstream) is the one the services use; `HttpxUpstream` is kept for the
benchmarks that compare the two.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol

import httpx

# A pool large enough for a router's fan-out to a few dozen nodes; idle connections are kept for reuse
# because a fresh TCP connection per read would cost more than the read.
POOL_MAX_CONNECTIONS = 512
POOL_MAX_KEEPALIVE = 256
POOL_KEEPALIVE_EXPIRY_S = 30.0


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


class HttpxUpstream:
    """`Upstream` over one shared `httpx.AsyncClient` (keep-alive pool, explicit timeouts)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    @classmethod
    def create(
        cls,
        timeout_s: float,
        connect_timeout_s: float,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> HttpxUpstream:
        client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(
                max_connections=POOL_MAX_CONNECTIONS,
                max_keepalive_connections=POOL_MAX_KEEPALIVE,
                keepalive_expiry=POOL_KEEPALIVE_EXPIRY_S,
            ),
            transport=transport,
            # Nodes are addressed by the URL they advertise; a redirect would be a misconfiguration.
            follow_redirects=False,
            # The client's environment (HTTP_PROXY, .netrc) must not reroute traffic inside the cluster.
            trust_env=False,
        )
        return cls(client)

    async def get(self, url: str, headers: Mapping[str, str]) -> UpstreamResponse:
        return await self._send("GET", url, None, headers)

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        return await self._send("POST", url, body, headers)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _send(self, method: str, url: str, body: bytes | None, headers: Mapping[str, str]) -> UpstreamResponse:
        try:
            # Non-streaming request: httpx reads the whole body and closes the response, also on errors.
            response = await self._client.request(method, url, content=body, headers=headers)
        except httpx.PoolTimeout as exc:
            raise UpstreamUnavailable(f"no free connection to {url} ({exc!r})", node_fault=False) from exc
        except httpx.TransportError as exc:
            # ConnectError, ReadError, RemoteProtocolError, timeouts...: reads are idempotent, so retriable.
            raise UpstreamUnavailable(f"{type(exc).__name__}: {exc}") from exc
        except httpx.InvalidURL as exc:
            raise UpstreamUnavailable(f"invalid node URL {url!r}: {exc}") from exc
        raw_headers = response.headers.raw
        if "content-encoding" in response.headers:
            # httpx has already decoded the body, so the coding header no longer describes it.
            raw_headers = [(k, v) for k, v in raw_headers if k.lower() != b"content-encoding"]
        return UpstreamResponse(response.status_code, raw_headers, response.content)
