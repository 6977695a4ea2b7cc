"""`AsyncClient`: the asyncio client. It only does I/O, method for method as `Client`; every decision is
`ClientBase`'s."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any, cast

import httpx

from keyroute.client._base import (
    DEFAULT_RETRIES,
    DEFAULT_TIMEOUT_S,
    AnyKey,
    Batch,
    ClientBase,
    Fields,
    Format,
    Paged,
    Value,
    body_of,
    next_page,
    value_of_answer,
)
from keyroute.client._errors import KeyrouteError, connection_failed


class AsyncClient(ClientBase):
    """The asyncio client: the same reads as `Client`, awaited (and async iterators for paged reads)."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        retries: int = DEFAULT_RETRIES,
        backoff_s: float = 0.05,
        token: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        routing: str = "router",
        map_max_age_s: float = 30.0,
        answer_format: str = "json",
    ) -> None:
        super().__init__(url, timeout, retries, backoff_s, token, routing, map_max_age_s, answer_format)
        self._http = httpx.AsyncClient(**self._http_options(self.url, transport))
        self._transport = transport
        # One connection pool per node (direct routing): a pool scans its connections on every request.
        self._nodes: dict[str, httpx.AsyncClient] = {}
        self._map_lock: asyncio.Lock | None = None  # made on the event loop, at the first map read

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for node in list(self._nodes.values()):
            await node.aclose()
        await self._http.aclose()

    def _node(self, url: str) -> httpx.AsyncClient:
        client = self._nodes.get(url)
        if client is None:
            client = self._nodes[url] = httpx.AsyncClient(**self._http_options(url, self._transport))
        return client

    async def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        for attempt in range(self.retries + 1):
            answer: httpx.Response | None
            try:
                answer = await self._http.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                if attempt == self.retries:
                    raise connection_failed(self.url, exc, attempt + 1) from exc
                answer = None
            wait_s = self._retry_wait_s(attempt, answer)
            if wait_s is None:
                return cast(httpx.Response, answer)  # a failed connection always has a wait
            await asyncio.sleep(wait_s)
        raise AssertionError("unreachable")

    # -- direct routing ---------------------------------------------------------------------------------

    async def _ensure_map(self) -> None:
        if self._map_due():
            if self._map_lock is None:
                self._map_lock = asyncio.Lock()
            async with self._map_lock:  # one read for many tasks that find the map due at once
                if not self._map_due():
                    return
                path, params, headers = self._map_request()
                try:
                    answer: httpx.Response | None = await self._http.get(path, params=params, headers=headers)
                except httpx.HTTPError:
                    answer = None
                self._took_map(answer)

    async def _read(
        self, store: str, key: Any, path: str, params: Fields = None, headers: Fields = None
    ) -> httpx.Response:
        """A read of one key: from a node serving its partition (the next replica when one fails or answers
        503), else the router's answer."""
        if self.routing == "direct":
            await self._ensure_map()
            for url in self._replicas(store, key):
                try:
                    answer = await self._node(url).get(path, params=params, headers=headers)
                except httpx.TransportError:
                    self._node_failed(url)
                    continue
                if self._node_answered(answer):
                    return answer
        self._via_router()
        return await self._send("GET", path, params=params, headers=headers)

    # -- reads ------------------------------------------------------------------------------------------

    async def get(
        self, store: str, key: AnyKey, *, min_offset: int | None = None, answer_format: Format = None
    ) -> Value:
        """The value of one key (KeyNotFound when there is none); `answer_format`: the client's unless given."""
        return value_of_answer(await self._read(*self._get_request(store, key, min_offset, answer_format)))

    async def get_many(
        self, store: str, keys: Iterable[str | int | bytes | uuid.UUID], *, answer_format: Format = None
    ) -> list[Value | KeyrouteError]:
        """Many keys of one store: per key, in order, its Value or its error. Direct routing sends one
        batch per node, concurrently; what a node cannot answer goes through the router."""
        batch = Batch(store, keys, self._accept(answer_format))
        if self.routing == "direct" and batch.texts:
            await self._ensure_map()
            groups = self._group_by_node(batch)
            self._take(batch, await asyncio.gather(*(self._node_batch(batch, *item) for item in groups.items())))
        else:
            self._all_via_router(batch)
        if batch.rest:
            batch.took_router_answer(
                await self._send("POST", batch.path, json=batch.body(batch.rest), headers=batch.headers)
            )
        return batch.results()

    async def _node_batch(
        self, batch: Batch, url: str, indexes: list[int]
    ) -> tuple[list[int], list[Mapping[str, Any]] | None]:
        try:
            answer: httpx.Response | None = await self._node(url).post(
                batch.path, json=batch.body(indexes), headers=batch.headers
            )
        except httpx.TransportError:
            answer = None
        return indexes, self._node_results(url, answer)

    async def history(
        self,
        store: str,
        key: Any,
        *,
        start: Any = None,
        end: Any = None,
        order: str = "asc",
        page_size: int = 100,
        min_offset: int | None = None,
        answer_format: Format = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """Every row of a key of a history store with start <= time < end, page after page (a live store's
        from a state that has applied at least `min_offset`)."""
        async for row in self._pages(
            self._history(store, key, start, end, order, page_size, min_offset, answer_format)
        ):
            yield row

    async def windows(
        self, store: str, key: Any, *, start: Any = None, end: Any = None, page_size: int = 100, **read: Format
    ) -> AsyncIterator[dict[str, Any]]:
        """The windows of a key of a windowed store that overlap [start, end): {"start", "end", "value"};
        `answer_format` as `get`'s."""
        async for window in self._pages(self._windows(store, key, start, end, page_size, **read)):
            yield window

    async def range(
        self,
        store: str,
        *,
        from_key: Any = None,
        to_key: Any = None,
        prefix: str | None = None,
        page_size: int = 100,
    ) -> AsyncIterator[tuple[str, Any]]:
        """(key, value) of the keys in [from_key, to_key) (or starting with `prefix`), in key order."""
        async for entry in self._pages(self._range(store, from_key, to_key, prefix, page_size)):
            yield entry["key"], entry["value"]

    async def _pages(self, paged: Paged) -> AsyncIterator[Any]:
        params: dict[str, str] | None = paged.params
        while params is not None:
            if paged.routed is None:
                answer = await self._send("GET", paged.path, params=params)
            else:
                answer = await self._read(*paged.routed, paged.path, params, paged.headers)
            body = body_of(answer)
            for item in body[paged.field]:
                yield item
            params = next_page(params, body)
