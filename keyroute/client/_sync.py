"""`Client`: the blocking client. It only does I/O; every decision is `ClientBase`'s."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
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


class Client(ClientBase):
    """A blocking client of one keyroute address (a router's load balancer, or any router or node)."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        retries: int = DEFAULT_RETRIES,
        backoff_s: float = 0.05,
        token: str | None = None,
        transport: httpx.BaseTransport | None = None,
        routing: str = "router",
        map_max_age_s: float = 30.0,
        answer_format: str = "json",
    ) -> None:
        super().__init__(url, timeout, retries, backoff_s, token, routing, map_max_age_s, answer_format)
        self._http = httpx.Client(**self._http_options(self.url, transport))
        self._pool: ThreadPoolExecutor | None = None
        self._transport = transport
        # One connection pool per node (direct routing): a pool scans its connections on every request.
        self._nodes: dict[str, httpx.Client] = {}
        self._map_lock = threading.Lock()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for node in list(self._nodes.values()):
            node.close()
        self._http.close()

    def _node(self, url: str) -> httpx.Client:
        client = self._nodes.get(url)
        if client is None:
            client = self._nodes.setdefault(url, httpx.Client(**self._http_options(url, self._transport)))
        return client

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        for attempt in range(self.retries + 1):
            answer: httpx.Response | None
            try:
                answer = self._http.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                if attempt == self.retries:
                    raise connection_failed(self.url, exc, attempt + 1) from exc
                answer = None
            wait_s = self._retry_wait_s(attempt, answer)
            if wait_s is None:
                return cast(httpx.Response, answer)  # a failed connection always has a wait
            time.sleep(wait_s)
        raise AssertionError("unreachable")

    # -- direct routing ---------------------------------------------------------------------------------

    def _ensure_map(self) -> None:
        if self._map_due():
            with self._map_lock:  # one read for many threads that find the map due at once
                if not self._map_due():
                    return
                path, params, headers = self._map_request()
                try:
                    answer: httpx.Response | None = self._http.get(path, params=params, headers=headers)
                except httpx.HTTPError:
                    answer = None
                self._took_map(answer)

    def _read(self, store: str, key: Any, path: str, params: Fields = None, headers: Fields = None) -> httpx.Response:
        """A read of one key: from a node serving its partition (the next replica when one fails or answers
        503), else the router's answer."""
        if self.routing == "direct":
            self._ensure_map()
            for url in self._replicas(store, key):
                try:
                    answer = self._node(url).get(path, params=params, headers=headers)
                except httpx.TransportError:
                    self._node_failed(url)
                    continue
                if self._node_answered(answer):
                    return answer
        self._via_router()
        return self._send("GET", path, params=params, headers=headers)

    # -- reads ------------------------------------------------------------------------------------------

    def get(self, store: str, key: AnyKey, *, min_offset: int | None = None, answer_format: Format = None) -> Value:
        """The value of one key (KeyNotFound when there is none); `answer_format`: the client's unless given."""
        return value_of_answer(self._read(*self._get_request(store, key, min_offset, answer_format)))

    def get_many(
        self, store: str, keys: Iterable[str | int | bytes | uuid.UUID], *, answer_format: Format = None
    ) -> list[Value | KeyrouteError]:
        """Many keys of one store: per key, in order, its Value or its error. Direct routing sends one
        batch per node, in parallel; what a node cannot answer goes through the router."""
        batch = Batch(store, keys, self._accept(answer_format))
        if self.routing == "direct" and batch.texts:
            self._ensure_map()
            groups = self._group_by_node(batch)
            if groups and self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="keyroute-client")
            done = self._pool.map(lambda item: self._node_batch(batch, *item), groups.items()) if groups else ()
            self._take(batch, done)
        else:
            self._all_via_router(batch)
        if batch.rest:
            batch.took_router_answer(self._send("POST", batch.path, json=batch.body(batch.rest), headers=batch.headers))
        return batch.results()

    def _node_batch(
        self, batch: Batch, url: str, indexes: list[int]
    ) -> tuple[list[int], list[Mapping[str, Any]] | None]:
        try:
            answer: httpx.Response | None = self._node(url).post(
                batch.path, json=batch.body(indexes), headers=batch.headers
            )
        except httpx.TransportError:
            answer = None
        return indexes, self._node_results(url, answer)

    def history(
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
    ) -> Iterator[dict[str, Any]]:
        """Every row of a key of a history store with start <= time < end, page after page (a live store's
        from a state that has applied at least `min_offset`)."""
        yield from self._pages(self._history(store, key, start, end, order, page_size, min_offset, answer_format))

    def windows(
        self, store: str, key: Any, *, start: Any = None, end: Any = None, page_size: int = 100, **read: Format
    ) -> Iterator[dict[str, Any]]:
        """The windows of a key of a windowed store that overlap [start, end): {"start", "end", "value"};
        `answer_format` as `get`'s."""
        yield from self._pages(self._windows(store, key, start, end, page_size, **read))

    def range(
        self,
        store: str,
        *,
        from_key: Any = None,
        to_key: Any = None,
        prefix: str | None = None,
        page_size: int = 100,
    ) -> Iterator[tuple[str, Any]]:
        """(key, value) of the keys in [from_key, to_key) (or starting with `prefix`), in key order."""
        for entry in self._pages(self._range(store, from_key, to_key, prefix, page_size)):
            yield entry["key"], entry["value"]

    def _pages(self, paged: Paged) -> Iterator[Any]:
        params: dict[str, str] | None = paged.params
        while params is not None:
            if paged.routed is None:
                answer = self._send("GET", paged.path, params=params)
            else:
                answer = self._read(*paged.routed, paged.path, params, paged.headers)
            body = body_of(answer)
            yield from body[paged.field]
            params = next_page(params, body)
