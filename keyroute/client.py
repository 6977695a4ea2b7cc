"""A Python client of keyroute's HTTP API: `Client` (blocking) and `AsyncClient` (asyncio), on httpx.

    from keyroute.client import Client, KeyNotFound

    with Client("http://keyroute.example:8080") as kr:
        booking = kr.get("bookings", "C000042")          # Value(store, key, partition, version, value, ...)
        found = kr.get_many("bookings", ["C1", "C2"])    # one Value or KeyrouteError per key, in order
        for row in kr.history("trips", "C000042", start=datetime(2024, 6, 1, tzinfo=UTC)):
            ...                                          # every row, page after page (cursors followed)
        for window in kr.windows("fares_5m", "C000042", start=..., end=...):
            ...
        for key, value in kr.range("bookings", prefix="C0000"):
            ...

Keys are given as the store's key format has them: `str`, `int` (integer formats), `uuid.UUID` or `str`
(uuid), `bytes` (bytes keys, sent as base64url). Times (`start` inclusive, `end` exclusive) as `datetime`
(naive means UTC), `date`, `int` (a store ordered by an integer column) or ISO 8601 text.

Every API error is raised as its `KeyrouteError` subclass (`KeyNotFound`, `StoreNotFound`, `BadKey`,
`BadRequest`, `BadCursor`, `CursorExpired`, `WrongStoreKind`, `Unavailable` with `retry_after`, ...).
Reads are retried on 503 (after the answer's Retry-After, capped, with back-off) and on connection
failures, up to `retries` times; connections are pooled and kept alive; clients close with `close()` or
as context managers.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx

from keyroute.core.key_format import KeyFormat, KeyFormatError, parse_key
from keyroute.core.partitioner import Partitioner, partition_for

__all__ = [
    "AsyncClient",
    "BadCursor",
    "BadKey",
    "BadRequest",
    "Client",
    "CursorExpired",
    "KeyNotFound",
    "KeyrouteError",
    "NotLive",
    "StoreNotFound",
    "Unauthorized",
    "Unavailable",
    "Value",
    "WrongStoreKind",
]

DEFAULT_TIMEOUT_S = 5.0
# Keep-alive connections enough for many reads in flight (per node in direct mode): httpx's default keeps 20
# and would close and reopen connections under a higher concurrency.
_LIMITS = httpx.Limits(max_connections=256, max_keepalive_connections=256)
DEFAULT_RETRIES = 3
_MAX_RETRY_WAIT_S = 2.0


class KeyrouteError(Exception):
    """An answer of the API that is not a success: its HTTP `status`, error `code` and `message`."""

    def __init__(self, status: int, code: str, message: str, retry_after: float | None = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after


class KeyNotFound(KeyrouteError):
    """404 key_not_found."""


class StoreNotFound(KeyrouteError):
    """404 store_not_found."""


class BadKey(KeyrouteError):
    """400 bad_key (or 414 key_too_long): the key does not fit the store's key format."""


class BadRequest(KeyrouteError):
    """400 bad_request: a malformed parameter or body."""


class BadCursor(KeyrouteError):
    """400 bad_cursor."""


class WrongStoreKind(KeyrouteError):
    """400 wrong_store_kind: a history read of a store that is not a history store, and so on."""


class NotLive(KeyrouteError):
    """400 not_live: `min_offset` on a store that follows no topic."""


class Unauthorized(KeyrouteError):
    """401 unauthorized."""


class CursorExpired(KeyrouteError):
    """410 cursor_expired: the version a paged read started on is no longer served; start again."""


class Unavailable(KeyrouteError):
    """503 (partition_unavailable, overloaded, not_up_to_bound), after the client's retries; `retry_after`
    is the answer's Retry-After in seconds."""


_ERRORS: dict[str, type[KeyrouteError]] = {
    "key_not_found": KeyNotFound,
    "store_not_found": StoreNotFound,
    "bad_key": BadKey,
    "key_too_long": BadKey,
    "bad_request": BadRequest,
    "bad_cursor": BadCursor,
    "wrong_store_kind": WrongStoreKind,
    "not_live": NotLive,
    "unauthorized": Unauthorized,
    "cursor_expired": CursorExpired,
}


@dataclass(frozen=True, slots=True)
class Value:
    """A key's value as read: where it came from, and for a live store the offset it reflects."""

    store: str
    key: str
    partition: int
    version: int
    value: Any
    node: str | None = None
    offset: int | None = None


def key_text(key: str | int | bytes | uuid.UUID) -> str:
    """A key as the API takes it: text as is, integers in decimal, uuids as their text, bytes in base64url."""
    if isinstance(key, bool):
        raise TypeError("a key is str, int, bytes or uuid.UUID, not bool")
    if isinstance(key, str):
        return key
    if isinstance(key, int):
        return str(key)
    if isinstance(key, uuid.UUID):
        return str(key)
    if isinstance(key, (bytes, bytearray, memoryview)):
        return base64.urlsafe_b64encode(bytes(key)).rstrip(b"=").decode("ascii")
    raise TypeError(f"a key is str, int, bytes or uuid.UUID, not {type(key).__name__}")


def key_segment(key: str | int | bytes | uuid.UUID) -> str:
    """A key as one percent-encoded path segment ('.' and '..' too, which a path would otherwise resolve)."""
    text = key_text(key)
    if text in (".", ".."):
        return text.replace(".", "%2E")
    return quote(text, safe="")


def time_text(moment: dt.datetime | dt.date | int | str) -> str:
    """A time bound as the API takes it."""
    if isinstance(moment, bool):
        raise TypeError("a time is a datetime, date, int or ISO 8601 text, not bool")
    if isinstance(moment, dt.datetime):
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=dt.UTC)
        return moment.isoformat()
    if isinstance(moment, dt.date):
        return moment.isoformat()
    if isinstance(moment, (int, str)):
        return str(moment)
    raise TypeError(f"a time is a datetime, date, int or ISO 8601 text, not {type(moment).__name__}")


def _error(response: httpx.Response) -> KeyrouteError:
    try:
        body = response.json()
        code, message = str(body["error"]), str(body["message"])
    except (ValueError, KeyError, TypeError):
        code, message = "http_error", response.text[:200] or response.reason_phrase
    retry_after = None
    if "retry-after" in response.headers:
        try:
            retry_after = float(response.headers["retry-after"])
        except ValueError:
            retry_after = None
    kind = _ERRORS.get(code) or (Unavailable if response.status_code == 503 else KeyrouteError)
    return kind(response.status_code, code, message, retry_after)


def _value(body: Mapping[str, Any], response: httpx.Response | None = None) -> Value:
    offset = body.get("offset")
    node = None
    if response is not None:
        node = response.headers.get("x-keyroute-node")
        if offset is None and "x-keyroute-offset" in response.headers:
            offset = int(response.headers["x-keyroute-offset"])
    return Value(
        store=str(body["store"]),
        key=str(body["key"]),
        partition=int(body["partition"]),
        version=int(body["version"]),
        value=body["value"],
        node=node,
        offset=None if offset is None else int(offset),
    )


def _batch_results(store: str, results: list[Mapping[str, Any]]) -> list[Value | KeyrouteError]:
    out: list[Value | KeyrouteError] = []
    for entry in results:
        if entry.get("status") == 200:
            out.append(_value({**entry, "store": store}))
        else:
            code = str(entry.get("error", "http_error"))
            kind = _ERRORS.get(code) or (Unavailable if entry.get("status") == 503 else KeyrouteError)
            out.append(kind(int(entry.get("status", 500)), code, str(entry.get("message", ""))))
    return out


def _paged_params(start: Any, end: Any, page_size: int, order: str | None = None, **extra: Any) -> dict[str, str]:
    if not 1 <= page_size <= 10_000:
        raise ValueError("page_size must be from 1 to 10,000")
    params = {"limit": str(page_size)}
    if start is not None:
        params["from"] = time_text(start)
    if end is not None:
        params["to"] = time_text(end)
    if order is not None:
        if order not in ("asc", "desc"):
            raise ValueError("order must be 'asc' or 'desc'")
        params["order"] = order
    for name, value in extra.items():
        if value is not None:
            params[name] = value
    return params


def _offset(min_offset: int | None) -> str | None:
    return None if min_offset is None else str(min_offset)


def _range_params(from_key: Any, to_key: Any, prefix: str | None, page_size: int) -> dict[str, str]:
    return _paged_params(
        None,
        None,
        page_size,
        from_key=None if from_key is None else key_text(from_key),
        to_key=None if to_key is None else key_text(to_key),
        prefix=prefix,
    )


class _Routes:
    """The partition map as a direct-routing client uses it: per store its shape and, per partition, the
    URLs of the nodes serving it (preferred replica first), from a router's /admin/partition-map."""

    __slots__ = ("generation", "stores")

    def __init__(self, doc: Mapping[str, Any]) -> None:
        self.generation = int(doc["generation"])
        self.stores: dict[str, tuple[int, Partitioner, KeyFormat, list[tuple[str, ...]]]] = {}
        for name, store in doc["stores"].items():
            serving = [tuple(str(s["url"]) for s in entry["serving"]) for entry in store["partition_map"]]
            self.stores[name] = (
                int(store["partitions"]),
                Partitioner(store["partitioner"]),
                KeyFormat(store["key_format"]),
                serving,
            )

    def replicas(self, store: str, key: Any) -> tuple[str, ...]:
        """The nodes serving the key's partition (none: unknown store, or a key the router must judge)."""
        entry = self.stores.get(store)
        if entry is None:
            return ()
        partitions, partitioner, key_format, serving = entry
        try:
            data = parse_key(key_format, key_text(key)).data
        except (KeyFormatError, TypeError):
            return ()
        partition = partition_for(partitioner, data, partitions)
        return serving[partition] if partition < len(serving) else ()


# A node that failed (connection) is skipped for this long; a map newer than what answers show is re-read at
# most this often.
_NODE_BACKOFF_S = 1.0
_MAP_RELOAD_MIN_S = 0.05


class _Base:
    def __init__(
        self,
        url: str,
        timeout: float,
        retries: int,
        backoff_s: float,
        token: str | None,
        routing: str = "router",
        map_max_age_s: float = 30.0,
    ) -> None:
        if retries < 0:
            raise ValueError("retries must not be negative")
        if routing not in ("router", "direct"):
            raise ValueError("routing is 'router' or 'direct'")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.retries = retries
        self.backoff_s = backoff_s
        self.routing = routing
        self.map_max_age_s = map_max_age_s
        self.headers = {"accept": "application/json"}
        if token:
            self.headers["authorization"] = f"Bearer {token}"
        # Direct routing: the map, when it must be read again, and nodes to skip for a while.
        self._routes: _Routes | None = None
        self._routes_at = float("-inf")
        self._reload = True
        self._last_load = float("-inf")
        self._down: dict[str, float] = {}
        self.map_reload_min_s = _MAP_RELOAD_MIN_S  # a burst of stale answers re-reads the map once
        # What direct routing did: reads answered by a node directly, reads that went through the router,
        # map reads, answers that said the map was behind (forwarded, or a newer generation), failovers.
        self.stats = {"direct": 0, "via_router": 0, "map_loads": 0, "misroutes": 0, "failovers": 0}

    def _wait_s(self, attempt: int, error: KeyrouteError | None) -> float:
        backoff = self.backoff_s * (2**attempt)
        if error is not None and error.retry_after is not None:
            backoff = max(backoff, error.retry_after)
        return min(backoff, _MAX_RETRY_WAIT_S)

    def _map_due(self) -> bool:
        now = time.monotonic()
        stale = self._reload or self._routes is None or now - self._routes_at > self.map_max_age_s
        return stale and now - self._last_load >= self.map_reload_min_s

    def _took_map(self, response: httpx.Response) -> None:
        self._last_load = time.monotonic()
        if response.status_code != 200:
            return
        try:
            routes = _Routes(response.json())
        except (ValueError, KeyError, TypeError):
            return
        self._routes, self._routes_at, self._reload = routes, time.monotonic(), False
        self.stats["map_loads"] += 1

    def _replicas(self, store: str, key: Any) -> tuple[str, ...]:
        routes = self._routes
        if routes is None:
            return ()
        replicas = routes.replicas(store, key)
        if self._down and len(replicas) > 1:
            now = time.monotonic()
            up = tuple(url for url in replicas if self._down.get(url, 0.0) <= now)
            replicas = up + tuple(url for url in replicas if url not in up)
        return replicas

    def _observe(self, response: httpx.Response) -> None:
        """A node's answer: forwarded (our map sent us to a node that does not serve the key) or routed with
        a newer map than ours means the map is behind: read it again (as Redis Cluster's MOVED)."""
        routes = self._routes
        generation = response.headers.get("x-keyroute-generation")
        newer = (
            routes is not None
            and generation is not None
            and generation.isdigit()
            and (int(generation) > routes.generation)
        )
        if response.headers.get("x-keyroute-hops") == "1" or newer:
            self.stats["misroutes"] += 1
            self._reload = True

    def _node_failed(self, url: str) -> None:
        self._down[url] = time.monotonic() + _NODE_BACKOFF_S
        self._reload = True
        self.stats["failovers"] += 1

    def _http_options(self, url: str, transport: Any) -> dict[str, Any]:
        """What every httpx client of this client is made with (the router's, and one per node)."""
        return {
            "base_url": url,
            "timeout": self.timeout,
            "headers": self.headers,
            "transport": transport,
            "trust_env": False,
            "limits": _LIMITS,
        }

    def _group_by_node(self, store: str, texts: list[str]) -> tuple[dict[str, list[int]], list[int]]:
        """Direct routing of a batch: the keys' indexes per node serving their partition (preferred replica),
        and those no node is known for (the router's)."""
        groups: dict[str, list[int]] = {}
        rest: list[int] = []
        for index, text in enumerate(texts):
            replicas = self._replicas(store, text)
            if replicas:
                groups.setdefault(replicas[0], []).append(index)
            else:
                rest.append(index)
        return groups, rest

    def _node_results(self, url: str, response: httpx.Response | None) -> list[Mapping[str, Any]] | None:
        """A node's batch-get answer's entries; None when it failed (connection, or not a 200)."""
        if response is None:
            self._node_failed(url)
            return None
        self._observe(response)
        return response.json()["results"] if response.status_code == 200 else None

    def _take(
        self,
        done: Iterable[tuple[list[int], list[Mapping[str, Any]] | None]],
        entries: list[Mapping[str, Any] | None],
        rest: list[int],
    ) -> list[int]:
        """Fill `entries` from the nodes' answers; the indexes left for the router (failed nodes, 503s)."""
        for indexes, results in done:
            if results is None:
                rest += indexes
                continue
            for index, entry in zip(indexes, results, strict=True):
                if entry.get("status") == 503:
                    rest.append(index)
                else:
                    entries[index] = entry
        self.stats["direct"] += sum(e is not None for e in entries)
        self.stats["via_router"] += len(rest)
        return sorted(rest)


class Client(_Base):
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
    ) -> None:
        super().__init__(url, timeout, retries, backoff_s, token, routing, map_max_age_s)
        self._http = httpx.Client(**self._http_options(self.url, transport))
        self._pool: ThreadPoolExecutor | None = None
        self._transport = transport
        # One connection pool per node (direct routing): a pool scans its connections on every request.
        self._nodes: dict[str, httpx.Client] = {}
        self._map_lock = threading.Lock()

    def _node(self, url: str) -> httpx.Client:
        client = self._nodes.get(url)
        if client is None:
            client = self._nodes.setdefault(url, httpx.Client(**self._http_options(url, self._transport)))
        return client

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

    # -- direct routing ---------------------------------------------------------------------------------

    def _ensure_map(self) -> None:
        if self._map_due():
            with self._map_lock:  # one read for many threads that find the map due at once
                if not self._map_due():
                    return
                try:
                    self._took_map(self._http.get("/admin/partition-map"))
                except httpx.HTTPError:
                    self._last_load = time.monotonic()

    def _direct(self, store: str, key: Any, path: str, params: Mapping[str, str] | None) -> httpx.Response | None:
        """The read from a node serving the key's partition (the next replica when one fails or answers
        503), or None: then the router answers it."""
        self._ensure_map()
        for url in self._replicas(store, key):
            try:
                response = self._node(url).get(path, params=params)
            except httpx.TransportError:
                self._node_failed(url)
                continue
            self._observe(response)
            if response.status_code == 503:
                self.stats["failovers"] += 1
                continue
            self.stats["direct"] += 1
            return response
        self.stats["via_router"] += 1
        return None

    def _read(self, store: str, key: Any, path: str, params: Mapping[str, str] | None = None) -> httpx.Response:
        if self.routing == "direct":
            response = self._direct(store, key, path, params)
            if response is not None:
                if response.status_code >= 400:
                    raise _error(response)
                return response
        return self._send("GET", path, params=params)

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        error: KeyrouteError | None = None
        for attempt in range(self.retries + 1):
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.TransportError:
                if attempt == self.retries:
                    raise
                error = None
            else:
                if response.status_code < 400:
                    return response
                error = _error(response)
                if response.status_code != 503 or attempt == self.retries:
                    raise error
            time.sleep(self._wait_s(attempt, error))
        raise AssertionError("unreachable")

    def get(self, store: str, key: str | int | bytes | uuid.UUID, *, min_offset: int | None = None) -> Value:
        """The value of one key (KeyNotFound when there is none)."""
        params = None if min_offset is None else {"min_offset": str(min_offset)}
        response = self._read(store, key, self._key_path(store, key), params)
        return _value(response.json(), response)

    def get_many(self, store: str, keys: Iterable[str | int | bytes | uuid.UUID]) -> list[Value | KeyrouteError]:
        """Many keys of one store: per key, in order, its Value or its error. Direct routing sends one
        batch per node, in parallel; what a node cannot answer goes through the router."""
        texts = [key_text(k) for k in keys]
        path = f"/stores/{quote(store, safe='')}/batch-get"
        entries: list[Mapping[str, Any] | None] = [None] * len(texts)
        rest = list(range(len(texts)))
        if self.routing == "direct" and texts:
            self._ensure_map()
            groups, rest = self._group_by_node(store, texts)
            if groups and self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="keyroute-client")
            done = (
                self._pool.map(lambda item: self._node_batch(item[0], path, texts, item[1]), groups.items())
                if groups
                else ()
            )
            rest = self._take(done, entries, rest)
        if rest:
            response = self._send("POST", path, json={"keys": [texts[i] for i in rest]})
            for index, entry in zip(rest, response.json()["results"], strict=True):
                entries[index] = entry
        return _batch_results(store, entries)  # type: ignore[arg-type]

    def _node_batch(
        self, url: str, path: str, texts: list[str], indexes: list[int]
    ) -> tuple[list[int], list[Mapping[str, Any]] | None]:
        try:
            response: httpx.Response | None = self._node(url).post(path, json={"keys": [texts[i] for i in indexes]})
        except httpx.TransportError:
            response = None
        return indexes, self._node_results(url, response)

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
    ) -> Iterator[dict[str, Any]]:
        """Every row of a key of a history store with start <= time < end, page after page (a live store's
        from a state that has applied at least `min_offset`)."""
        params = _paged_params(start, end, page_size, order, min_offset=_offset(min_offset))
        yield from self._pages(f"{self._key_path(store, key)}/history", "rows", params, (store, key))

    def windows(
        self, store: str, key: Any, *, start: Any = None, end: Any = None, page_size: int = 100
    ) -> Iterator[dict[str, Any]]:
        """The windows of a key of a windowed store that overlap [start, end): {"start", "end", "value"}."""
        params = _paged_params(start, end, page_size)
        yield from self._pages(f"{self._key_path(store, key)}/windows", "windows", params, (store, key))

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
        params = _range_params(from_key, to_key, prefix, page_size)
        for entry in self._pages(f"/stores/{quote(store, safe='')}/range", "keys", params):
            yield entry["key"], entry["value"]

    def _key_path(self, store: str, key: Any) -> str:
        return f"/stores/{quote(store, safe='')}/keys/{key_segment(key)}"

    def _pages(
        self, path: str, field: str, params: dict[str, str], routed: tuple[str, Any] | None = None
    ) -> Iterator[Any]:
        while True:
            response = self._send("GET", path, params=params) if routed is None else self._read(*routed, path, params)
            body = response.json()
            yield from body[field]
            if "next" not in body:
                return
            params = {**params, "cursor": body["next"]}


class AsyncClient(_Base):
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
    ) -> None:
        super().__init__(url, timeout, retries, backoff_s, token, routing, map_max_age_s)
        self._http = httpx.AsyncClient(**self._http_options(self.url, transport))
        self._transport = transport
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
        error: KeyrouteError | None = None
        for attempt in range(self.retries + 1):
            try:
                response = await self._http.request(method, path, **kwargs)
            except httpx.TransportError:
                if attempt == self.retries:
                    raise
                error = None
            else:
                if response.status_code < 400:
                    return response
                error = _error(response)
                if response.status_code != 503 or attempt == self.retries:
                    raise error
            await asyncio.sleep(self._wait_s(attempt, error))
        raise AssertionError("unreachable")

    # -- direct routing ---------------------------------------------------------------------------------

    async def _ensure_map(self) -> None:
        if self._map_due():
            if self._map_lock is None:
                self._map_lock = asyncio.Lock()
            async with self._map_lock:  # one read for many tasks that find the map due at once
                if not self._map_due():
                    return
                try:
                    self._took_map(await self._http.get("/admin/partition-map"))
                except httpx.HTTPError:
                    self._last_load = time.monotonic()

    async def _read(self, store: str, key: Any, path: str, params: Mapping[str, str] | None = None) -> httpx.Response:
        if self.routing == "direct":
            await self._ensure_map()
            for url in self._replicas(store, key):
                try:
                    response = await self._node(url).get(path, params=params)
                except httpx.TransportError:
                    self._node_failed(url)
                    continue
                self._observe(response)
                if response.status_code == 503:
                    self.stats["failovers"] += 1
                    continue
                self.stats["direct"] += 1
                if response.status_code >= 400:
                    raise _error(response)
                return response
            self.stats["via_router"] += 1
        return await self._send("GET", path, params=params)

    async def get(self, store: str, key: Any, *, min_offset: int | None = None) -> Value:
        params = None if min_offset is None else {"min_offset": str(min_offset)}
        path = f"/stores/{quote(store, safe='')}/keys/{key_segment(key)}"
        response = await self._read(store, key, path, params)
        return _value(response.json(), response)

    async def get_many(self, store: str, keys: Iterable[Any]) -> list[Value | KeyrouteError]:
        texts = [key_text(k) for k in keys]
        path = f"/stores/{quote(store, safe='')}/batch-get"
        entries: list[Mapping[str, Any] | None] = [None] * len(texts)
        rest = list(range(len(texts)))
        if self.routing == "direct" and texts:
            await self._ensure_map()
            groups, rest = self._group_by_node(store, texts)
            done = await asyncio.gather(*(self._node_batch(url, path, texts, idx) for url, idx in groups.items()))
            rest = self._take(done, entries, rest)
        if rest:
            response = await self._send("POST", path, json={"keys": [texts[i] for i in rest]})
            for index, entry in zip(rest, response.json()["results"], strict=True):
                entries[index] = entry
        return _batch_results(store, entries)  # type: ignore[arg-type]

    async def _node_batch(
        self, url: str, path: str, texts: list[str], indexes: list[int]
    ) -> tuple[list[int], list[Mapping[str, Any]] | None]:
        try:
            body = {"keys": [texts[i] for i in indexes]}
            response: httpx.Response | None = await self._node(url).post(path, json=body)
        except httpx.TransportError:
            response = None
        return indexes, self._node_results(url, response)

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
    ) -> AsyncIterator[dict[str, Any]]:
        path = f"/stores/{quote(store, safe='')}/keys/{key_segment(key)}/history"
        params = _paged_params(start, end, page_size, order, min_offset=_offset(min_offset))
        async for row in self._pages(path, "rows", params, (store, key)):
            yield row

    async def windows(
        self, store: str, key: Any, *, start: Any = None, end: Any = None, page_size: int = 100
    ) -> AsyncIterator[dict[str, Any]]:
        path = f"/stores/{quote(store, safe='')}/keys/{key_segment(key)}/windows"
        async for window in self._pages(path, "windows", _paged_params(start, end, page_size), (store, key)):
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
        params = _range_params(from_key, to_key, prefix, page_size)
        async for entry in self._pages(f"/stores/{quote(store, safe='')}/range", "keys", params):
            yield entry["key"], entry["value"]

    async def _pages(
        self, path: str, field: str, params: dict[str, str], routed: tuple[str, Any] | None = None
    ) -> AsyncIterator[Any]:
        while True:
            if routed is None:
                response = await self._send("GET", path, params=params)
            else:
                response = await self._read(*routed, path, params)
            body = response.json()
            for item in body[field]:
                yield item
            if "next" not in body:
                return
            params = {**params, "cursor": body["next"]}
