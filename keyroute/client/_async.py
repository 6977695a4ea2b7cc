"""`AsyncClient`: the asyncio client. It only runs `ClientBase`'s plans, awaited: every decision is the
base's."""

from __future__ import annotations

import asyncio
import json
import ssl
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any
from urllib.parse import urlencode

import httpx

from keyroute.client._base import ClientBase
from keyroute.client._errors import KeyrouteError
from keyroute.client._models import Answer, Value, head_of
from keyroute.client._paging import Paged, T
from keyroute.client._plans import Call, MapDue, Parallel, Plan, Sleep, Step
from keyroute.client._stores import Fields, get_many_stores_plan, get_stores_plan
from keyroute.http.fast_upstream import FastUpstream
from keyroute.http.upstream import UpstreamUnavailable

_NO_TIMEOUT_S = 86_400.0


class AsyncHttpxSender:
    """A sender over an `httpx.AsyncClient` (a caller's transport, and map reads): its answers as `Answer`s."""

    __slots__ = ("http",)

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http

    async def request(self, method: str, path: str, **options: Any) -> Answer:
        return Answer.of_httpx(await self.http.request(method, path, **options))


class AsyncClient(ClientBase):
    """The asyncio client: the same reads and options as `Client`, awaited (paged reads with `async for`)."""

    _http_class = httpx.AsyncClient
    _httpx_sender = AsyncHttpxSender
    _lock_class = asyncio.Lock  # bound to the event loop at its first use
    _http: httpx.AsyncClient | None
    # The wire of reads to every origin (made at the first read): keyroute.http's member wire.
    _upstream: FastUpstream | None = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for sender in list(self._nodes.values()):
            if isinstance(sender, AsyncHttpxSender) and sender.http is not self._http:
                await sender.http.aclose()
        if self._upstream is not None:
            await self._upstream.aclose()
        if self._http is not None:
            await self._http.aclose()

    def _wire(self, url: str) -> UpstreamOrigin:
        if self._upstream is None:
            context = self._verify
            # No timeout (None, as httpx takes it): a day, the member wire's bounds being always finite.
            timeout_s = self.timeout if self.timeout is not None else _NO_TIMEOUT_S
            self._upstream = FastUpstream(timeout_s, timeout_s, pool_wait_s=timeout_s, tls=lambda origin: context)
        return UpstreamOrigin(self._upstream, url, self._wire_headers())

    async def get(
        self,
        store: str,
        key: str | int | bytes | uuid.UUID,
        *,
        min_offset: int | None = None,
        answer_format: str | None = None,
        fields: Iterable[str] | str | None = None,
    ) -> Value:
        """`Client.get`, awaited."""
        return await self._run(self._get_plan(store, key, min_offset, answer_format, fields))

    async def get_many(
        self,
        store: str,
        keys: Iterable[str | int | bytes | uuid.UUID],
        *,
        answer_format: str | None = None,
        fields: Iterable[str] | str | None = None,
    ) -> list[Value | KeyrouteError]:
        """`Client.get_many`, awaited (nodes asked concurrently)."""
        return await self._run(self._get_many_plan(store, keys, answer_format, fields))

    async def get_stores(
        self,
        key: str | int | bytes | uuid.UUID,
        stores: Iterable[str],
        *,
        min_offset: Mapping[str, int] | None = None,
        fields: Fields = None,
    ) -> dict[str, Value | KeyrouteError]:
        """`Client.get_stores`, awaited."""
        return await self._run(get_stores_plan(self, key, list(stores), min_offset, fields))

    async def get_many_stores(
        self,
        keys: Iterable[str | int | bytes | uuid.UUID],
        stores: Iterable[str],
        *,
        min_offset: Mapping[str, int] | None = None,
        fields: Fields = None,
    ) -> list[dict[str, Value | KeyrouteError]]:
        """`Client.get_many_stores`, awaited (nodes asked concurrently)."""
        return await self._run(get_many_stores_plan(self, keys, list(stores), min_offset, fields))

    async def _aiterate(self, paged: Callable[[], Paged], item: Callable[[Any], T]) -> AsyncIterator[T]:
        first = paged()
        params: dict[str, str] | None = first.params
        while params is not None:
            items, params = await self._run(self._page_plan(first, params))
            for entry in items:
                yield item(entry)

    async def _run(self, plan: Plan[T]) -> T:
        """Do what `plan` asks, step after step, until it returns."""
        send = plan.send
        reply = None
        while True:
            try:
                step = send(reply)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            reply = await self._do(step)

    async def _do(self, step: Step) -> Any:
        if step.__class__ is Call:  # the common step first, without isinstance's generality
            try:
                return await self._node(step.url, step.hot).request(step.method, step.path, **step.options)
            except step.errors as exc:
                return exc
        if isinstance(step, Sleep):
            await asyncio.sleep(step.seconds)
        elif isinstance(step, MapDue):
            if self._map_due():
                async with self._map_lock:  # one read for many tasks that find the map due at once
                    await self._run(self._map_plan())
        elif isinstance(step, Parallel):
            return await asyncio.gather(*map(self._run, step.plans))
        return None


class UpstreamOrigin:
    """`AsyncClient`'s reads to one base URL over keyroute.http's member wire (`FastUpstream`: keep-alive
    HTTP/1.1 on asyncio, httptools' parser), its failures raised as httpx's transport exceptions of their
    kind, as the blocking client's wire raises them."""

    __slots__ = ("headers", "upstream", "url")

    def __init__(self, upstream: FastUpstream, url: str, headers: Mapping[str, str]) -> None:
        if not url.lower().startswith(("http://", "https://")):
            raise httpx.UnsupportedProtocol(f"only http:// and https:// URLs are supported, not {url!r}")
        self.upstream = upstream
        self.url = url
        self.headers = dict(headers)

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Any = None,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
    ) -> Answer:
        target = path if not params else path + "?" + urlencode(params)
        merged = self.headers if not headers else {**self.headers, **headers}
        url = self.url + target
        try:
            if json is None:
                reply = await self.upstream.get(url, merged)
            else:
                body = _json_body(json)
                reply = await self.upstream.post(url, body, {**merged, "content-type": "application/json"})
        except UpstreamUnavailable as exc:
            raise _transport_error(exc) from exc
        except ValueError as exc:  # a content coding it cannot undo
            raise httpx.DecodingError(str(exc)) from exc
        return Answer(reply.status, head_of(reply.headers), reply.body, target)


def _json_body(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")


def _transport_error(exc: UpstreamUnavailable) -> httpx.TransportError:
    """httpx's exception of the failure's kind: connecting, or the exchange (FastUpstream's own
    messages and causes tell which)."""
    message = str(exc)
    cause = exc.__cause__
    if not exc.node_fault:
        return httpx.PoolTimeout(message)
    if isinstance(cause, TimeoutError) and message.startswith("connecting to"):
        return httpx.ConnectTimeout(message)
    if message.startswith(("cannot connect to", "TLS with")) or isinstance(cause, ssl.SSLError):
        return httpx.ConnectError(message)
    if "no complete reply within" in message:
        return httpx.ReadTimeout(message)
    return httpx.ReadError(message)
