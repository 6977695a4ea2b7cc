"""What `Client` and `AsyncClient` decide alike: requests, direct routing, retries and reading answers.

`ClientBase` holds every decision and does no I/O. Each read is a plan (`keyroute.client._plans`): a generator
that yields the steps it needs done and is sent back what each step gave, until it returns the read's result.
`keyroute.client._sync` and `keyroute.client._async` run plans, blocking or awaited: that is all they do (a
sans-I/O design, as h11's; httpx's `BaseClient` shares decisions the same way).

The client's other modules, one concern each (as httpx's `_models`, `_config`, `_urls`): `_config` (settings,
defaults, TLS), `_urls` (keys, times and paths as the API takes them), `_models` (answers and values),
`_paging` (paged reads), `_plans` (the steps of a read), `_direct` (direct routing's map), `_wire` (the
blocking client's sockets), `_errors` (the exceptions).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from functools import partial
from typing import Any
from urllib.parse import unquote, urlencode

import httpx

from keyroute.client._config import (
    ANSWER_FORMATS,
    DEFAULT_RETRIES,
    DEFAULT_TIMEOUT_S,
    LIMITS,
    MAP_RELOAD_MIN_S,
    MAX_RETRY_WAIT_S,
    NODE_BACKOFF_S,
    ClientCert,
    Format,
    tls_context,
)
from keyroute.client._direct import PARTITION_MAP_PATH, ROUTING_PATH, _DirectMap
from keyroute.client._errors import KeyrouteError, connection_failed, error_of_answer
from keyroute.client._models import Answer, Value, body_of, value_of_answer
from keyroute.client._paging import Paged, Pages, T, next_page, paged_params, range_params
from keyroute.client._plans import MAP_DUE, Batch, Call, Parallel, Plan, Sleep
from keyroute.client._urls import key_path, store_path

Fields = Mapping[str, str] | None  # a request's query or extra headers


class ClientBase:
    """Every decision of a keyroute client; the I/O is its subclasses': they name their httpx client class
    (`_http_class`), make the senders of the hot path (`_wire`) and the lock map reads take
    (`_lock_class`), and run plans.

    Reads go over the client's own wire (keep-alive HTTP/1.1 on sockets, `_wire`); httpx carries what is off
    the hot path (reading the partition map) and every request when the caller gives an httpx `transport`."""

    _http_class: Callable[..., Any]
    _httpx_sender: Callable[[Any], Any]
    _lock_class: Callable[[], Any]

    def __init__(
        self,
        url: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        retries: int = DEFAULT_RETRIES,
        backoff_s: float = 0.05,
        token: str | None = None,
        transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None,
        routing: str = "router",
        map_max_age_s: float = 30.0,
        verify: str | bool = True,
        cert: ClientCert | None = None,
        answer_format: str = "json",
    ) -> None:
        """`verify`, `cert`: see `tls_context` (https:// addresses; direct mode reaches the nodes with the
        same CA bundle and certificate). `answer_format`: "json" or "avro", what reads ask for unless one
        says otherwise (`_accept`)."""
        if retries < 0:
            raise ValueError("retries must not be negative")
        if routing not in ("router", "direct"):
            raise ValueError("routing is 'router' or 'direct'")
        self.answer_format = answer_format
        self._accept(None)  # checks it
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.retries = retries
        self.backoff_s = backoff_s
        self.routing = routing
        self.map_max_age_s = map_max_age_s
        self.headers = {"accept": "application/json"}
        self._verify = tls_context(verify, cert)
        if token:
            self.headers["authorization"] = f"Bearer {token}"
        # Direct routing: the map, when it must be read again, and nodes to skip for a while.
        self._map: _DirectMap | None = None
        self._map_at = float("-inf")
        self._reload = True
        # Stores a node said we routed wrongly (forwarded): re-read alone, not the whole map.
        self._stale_stores: set[str] = set()
        self._map_etag: str | None = None
        self._legacy_map = False  # the router has no routing view: read its whole partition map
        self._last_load = float("-inf")
        self._down: dict[str, float] = {}
        self.map_reload_min_s = MAP_RELOAD_MIN_S  # a burst of stale answers re-reads the map once
        # What the client did: reads answered by a node directly, reads that went through the router (every
        # read in router mode), map reads, answers that said the map was behind (forwarded, or a newer map
        # generation), failovers. Direct routing fills the last three.
        self.stats = {"direct": 0, "via_router": 0, "map_loads": 0, "misroutes": 0, "failovers": 0}
        self._transport = transport
        # The httpx client of the client's address (made when first needed) and the senders of the hot path
        # by URL: the client's address, and each node in direct mode (one pool each).
        self._http: Any = None
        self._nodes: dict[str, Any] = {}
        self._map_lock = self._lock_class()

    def _node(self, url: str | None, hot: bool = True) -> Any:
        """What sends to `url` (None: the client's address): its `request(method, path, *, params, json,
        headers)` returns an `Answer`. `hot`: a read (the client's wire unless a transport was given), else
        the address's httpx client."""
        if url is None:
            url = self.url
        sender = self._nodes.get(url) if hot else None
        if sender is None:
            if hot and self._transport is None:
                sender = self._nodes.setdefault(url, self._wire(url))
            elif url == self.url:
                if self._http is None:
                    self._http = self._http_class(**self._http_options(url, self._transport))
                sender = self._httpx_sender(self._http)
                if hot:
                    self._nodes[url] = sender
            else:
                sender = self._nodes.setdefault(
                    url, self._httpx_sender(self._http_class(**self._http_options(url, self._transport)))
                )
        return sender

    def _wire(self, url: str) -> Any:
        """The sender of reads to `url` over the client's own wire."""
        raise NotImplementedError

    def _wire_headers(self) -> dict[str, str]:
        """What every request on the client's wire carries: the client's headers, and the content codings it
        takes (as httpx asks for them)."""
        return {**self.headers, "accept-encoding": "gzip, deflate"}

    # -- reads ------------------------------------------------------------------------------------------

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
        fields: Iterable[str] | str | None = None,
    ) -> Pages[dict[str, Any]]:
        """Every row of a key of a history store with start <= time < end, page after page (a live store's
        from a state that has applied at least `min_offset`); `answer_format`: the client's unless given;
        `fields` ("a,b.c" or a list of them): only those fields of each row."""
        paged = partial(
            self._history, store, key, start, end, order, page_size, min_offset, answer_format, fields_text(fields)
        )
        return Pages(self, paged, _same)

    def windows(
        self,
        store: str,
        key: Any,
        *,
        start: Any = None,
        end: Any = None,
        page_size: int = 100,
        answer_format: Format = None,
        fields: Iterable[str] | str | None = None,
    ) -> Pages[dict[str, Any]]:
        """The windows of a key of a windowed store that overlap [start, end): {"start", "end", "value"};
        `answer_format` as `history`'s; `fields`: only those fields of each window's value."""
        windows = partial(self._windows, store, key, start, end, page_size, answer_format, fields_text(fields))
        return Pages(self, windows, _same)

    def range(
        self,
        store: str,
        *,
        from_key: Any = None,
        to_key: Any = None,
        prefix: str | None = None,
        page_size: int = 100,
        fields: Iterable[str] | str | None = None,
    ) -> Pages[tuple[str, Any]]:
        """(key, value) of the keys in [from_key, to_key) (or starting with `prefix`), in key order; `fields`:
        only those fields of each value."""
        keys = partial(self._range, store, from_key, to_key, prefix, page_size, fields_text(fields))
        return Pages(self, keys, _key_and_value)

    def _iterate(self, paged: Callable[[], Paged], item: Callable[[Any], T]) -> Iterator[T]:
        raise TypeError(f"{type(self).__name__}'s paged reads are read with `async for`")

    def _aiterate(self, paged: Callable[[], Paged], item: Callable[[Any], T]) -> AsyncIterator[T]:
        raise TypeError(f"{type(self).__name__}'s paged reads are read with `for`")

    def _http_options(self, url: str, transport: Any) -> dict[str, Any]:
        """What every httpx client of this client is made with (the router's, and one per node)."""
        return {
            "base_url": url,
            "timeout": self.timeout,
            "headers": self.headers,
            "transport": transport,
            "trust_env": False,
            "limits": LIMITS,
            "verify": self._verify,
        }

    # -- requests ---------------------------------------------------------------------------------------

    def _accept(self, answer_format: str | None) -> dict[str, str] | None:
        """The headers of a read answered in `answer_format` (None: the client's): None for JSON, which every
        request asks for already."""
        answer_format = self.answer_format if answer_format is None else answer_format
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(f"answer_format is 'json' or 'avro', not {answer_format!r}")
        return None if answer_format == "json" else {"accept": ANSWER_FORMATS[answer_format]}

    def _get_request(
        self, store: str, key: Any, min_offset: int | None, answer_format: Format, fields: Any = None
    ) -> tuple[str, Any, str, dict[str, str] | None, dict[str, str] | None]:
        """What `_read` takes for a read of one key: store, key, path, query and headers."""
        params = None if min_offset is None else {"min_offset": str(min_offset)}
        projection = fields_text(fields)
        if projection is not None:
            params = {**(params or {}), "fields": projection}
        return store, key, key_path(store, key), params, self._accept(answer_format)

    def _history(
        self,
        store: str,
        key: Any,
        start: Any,
        end: Any,
        order: str,
        page_size: int,
        min_offset: int | None,
        answer_format: str | None = None,
        fields: str | None = None,
    ) -> Paged:
        min_offset_text = None if min_offset is None else str(min_offset)
        params = paged_params(start, end, page_size, order, min_offset=min_offset_text, fields=fields)
        return Paged(f"{key_path(store, key)}/history", "rows", params, (store, key), self._accept(answer_format))

    def _windows(
        self,
        store: str,
        key: Any,
        start: Any,
        end: Any,
        page_size: int,
        answer_format: str | None = None,
        fields: str | None = None,
    ) -> Paged:
        params = paged_params(start, end, page_size, fields=fields)
        return Paged(f"{key_path(store, key)}/windows", "windows", params, (store, key), self._accept(answer_format))

    @staticmethod
    def _range(
        store: str, from_key: Any, to_key: Any, prefix: str | None, page_size: int, fields: str | None = None
    ) -> Paged:
        return Paged(
            store_path(store, "range"), "keys", range_params(from_key, to_key, prefix, page_size, fields=fields)
        )

    # -- retries ----------------------------------------------------------------------------------------

    def _retry_wait_s(self, attempt: int, answer: Answer | None) -> float | None:
        """After attempt `attempt` (from 0) got `answer` (None: the connection failed): None when the answer
        is the result, else how long to wait before the next attempt. Raises the answer's error when it is
        not retried (anything but a 503, or the last attempt's); the caller re-raises a last connection
        failure."""
        error: KeyrouteError | None = None
        if answer is not None:
            if answer.status_code < 400:
                return None
            error = error_of_answer(answer)
            if answer.status_code != 503 or attempt == self.retries:
                raise error
        backoff = self.backoff_s * (2**attempt)
        if error is not None and error.retry_after is not None:
            backoff = max(backoff, error.retry_after)
        return min(backoff, MAX_RETRY_WAIT_S)

    # -- direct routing ---------------------------------------------------------------------------------

    def _map_due(self) -> bool:
        now = time.monotonic()
        stale = self._reload or self._stale_stores or self._map is None or now - self._map_at > self.map_max_age_s
        return bool(stale) and now - self._last_load >= self.map_reload_min_s

    def _map_request(self) -> tuple[str, list[tuple[str, str]], dict[str, str]]:
        """The map read to send now: path, query and headers. Stores a misroute named alone, when that is
        all that is due; else what changed since the map held (the router answers 304 when nothing did)."""
        if self._legacy_map:
            return PARTITION_MAP_PATH, [("detail", "all")], {}
        direct_map = self._map
        if direct_map is None:
            return ROUTING_PATH, [], {}
        now = time.monotonic()
        if self._stale_stores and not self._reload and now - self._map_at <= self.map_max_age_s:
            return ROUTING_PATH, [("store", name) for name in sorted(self._stale_stores)], {}
        headers = {} if self._map_etag is None else {"if-none-match": self._map_etag}
        return ROUTING_PATH, [("since", str(direct_map.map_generation))], headers

    def _took_map(self, answer: Answer | None) -> None:
        """The router's answer to a map read (None: the request failed)."""
        self._last_load = time.monotonic()
        if answer is None:
            return
        legacy = not answer.path.endswith(ROUTING_PATH)
        if answer.status_code == 404 and not legacy:
            self._legacy_map = True  # an older router: its whole map, from the next read on
            self._last_load = float("-inf")
            return
        if answer.status_code == 304:
            self._map_at, self._reload = time.monotonic(), False
            self._stale_stores.clear()
            return
        if answer.status_code != 200:
            return
        try:
            doc = answer.json()
            direct_map = _DirectMap(doc) if legacy else _DirectMap.of_routing(doc, self._map)
        except (ValueError, KeyError, TypeError, IndexError):
            return
        whole = legacy or "store" not in answer.params
        if whole:
            self._map_at, self._reload = time.monotonic(), False
            self._map_etag = answer.header("etag")
        self._map = direct_map
        self._stale_stores.clear()
        self.stats["map_loads"] += 1

    def _replicas(self, store: str, key: Any) -> tuple[str, ...]:
        """The URLs of the nodes to ask for the key, in turn: those serving its partition, preferred first,
        but the nodes that failed a moment ago last (none: the router answers)."""
        direct_map = self._map
        if direct_map is None:
            return ()
        replicas = direct_map.urls(store, key)
        if self._down and len(replicas) > 1:
            now = time.monotonic()
            up = tuple(url for url in replicas if self._down.get(url, 0.0) <= now)
            replicas = up + tuple(url for url in replicas if url not in up)
        return replicas

    def _observe(self, answer: Answer) -> None:
        """A node's answer: forwarded (our map sent us to a node that does not serve the key) or routed with
        a newer map than ours means the map is behind: read it again (as Redis Cluster's MOVED)."""
        direct_map = self._map
        map_generation = answer.header("x-keyroute-generation")
        newer = (
            direct_map is not None
            and map_generation is not None
            and map_generation.isdigit()
            and (int(map_generation) > direct_map.map_generation)
        )
        if answer.raw(b"x-keyroute-hops") == b"1" or newer:
            self.stats["misroutes"] += 1
            store = _store_of(answer)
            if store is not None and not newer and self._map is not None:
                self._stale_stores.add(store)  # that store alone is read again
            else:
                self._reload = True

    def _node_failed(self, url: str) -> None:
        self._down[url] = time.monotonic() + NODE_BACKOFF_S
        self._reload = True
        self.stats["failovers"] += 1

    def _node_answered(self, answer: Answer) -> bool:
        """A node's answer to a direct read: False when the next replica is to be asked (a 503), True when
        it is the read's; raises its error when it is one."""
        self._observe(answer)
        if answer.status_code == 503:
            self.stats["failovers"] += 1
            return False
        self.stats["direct"] += 1
        if answer.status_code >= 400:
            raise error_of_answer(answer)
        return True

    def _via_router(self) -> None:
        """A read the router answers: every read in router mode, one direct routing found no node for."""
        self.stats["via_router"] += 1

    def _all_via_router(self, batch: Batch) -> None:
        """A batch the router answers whole (router mode, or no keys): each key counts as a read."""
        self.stats["via_router"] += len(batch.rest)

    def _group_by_node(self, batch: Batch) -> dict[str, list[int]]:
        """Direct routing of a batch: the keys' indexes per node serving their partition (preferred replica);
        those no node is known for stay the router's (`batch.rest`)."""
        groups: dict[str, list[int]] = {}
        rest: list[int] = []
        for index, text in enumerate(batch.texts):
            replicas = self._replicas(batch.store, text)
            if replicas:
                groups.setdefault(replicas[0], []).append(index)
            else:
                rest.append(index)
        batch.rest = rest
        return groups

    def _node_results(self, url: str, answer: Answer | None) -> list[Mapping[str, Any]] | None:
        """A node's batch-get answer's entries; None when it failed (connection, or not a 200)."""
        if answer is None:
            self._node_failed(url)
            return None
        self._observe(answer)
        return body_of(answer)["results"] if answer.status_code == 200 else None

    def _take(self, batch: Batch, done: Iterable[tuple[list[int], list[Mapping[str, Any]] | None]]) -> None:
        """Fill the batch's entries from the nodes' answers; what they did not answer (failed nodes, 503s)
        is left for the router."""
        rest = batch.rest
        for indexes, results in done:
            if results is None:
                rest += indexes
                continue
            for index, entry in zip(indexes, results, strict=True):
                if entry.get("status") == 503:
                    rest.append(index)
                else:
                    batch.entries[index] = entry
        self.stats["direct"] += sum(e is not None for e in batch.entries)
        self.stats["via_router"] += len(rest)
        batch.rest = sorted(rest)

    # -- plans ------------------------------------------------------------------------------------------

    def _send_plan(self, method: str, path: str, **options: Any) -> Plan[Answer]:
        """A request to the client's address, retried (`_retry_wait_s`)."""
        for attempt in range(self.retries + 1):
            answer = yield Call(None, method, path, options)
            if isinstance(answer, httpx.TransportError):
                if attempt == self.retries:
                    raise connection_failed(self.url, answer, attempt + 1) from answer
                answer = None
            wait_s = self._retry_wait_s(attempt, answer)
            if wait_s is None:
                return answer  # type: ignore[no-any-return]  # a failed connection always has a wait
            yield Sleep(wait_s)
        raise AssertionError("unreachable")

    def _map_plan(self) -> Plan[None]:
        """Read the partition map, if it is still due (the caller holds the map lock)."""
        if not self._map_due():
            return
        path, params, headers = self._map_request()
        answer = yield Call(None, "GET", path, {"params": params, "headers": headers}, httpx.HTTPError, hot=False)
        self._took_map(None if isinstance(answer, httpx.HTTPError) else answer)

    def _read_plan(
        self, store: str, key: Any, path: str, params: Fields = None, headers: Fields = None
    ) -> Plan[Answer]:
        """A read of one key: from a node serving its partition (the next replica when one fails or answers
        503), else the router's answer."""
        if self.routing == "direct":
            if self._map_due():  # asked here first: the step costs a round through the client
                yield MAP_DUE
            for url in self._replicas(store, key):
                answer = yield Call(url, "GET", path, {"params": params, "headers": headers})
                if isinstance(answer, httpx.TransportError):
                    self._node_failed(url)
                    continue
                if self._node_answered(answer):
                    return answer  # type: ignore[no-any-return]
        self._via_router()
        return (yield from self._send_plan("GET", path, params=params, headers=headers))

    def _get_plan(
        self, store: str, key: Any, min_offset: int | None, answer_format: Format = None, fields: Any = None
    ) -> Plan[Value]:
        request = self._get_request(store, key, min_offset, answer_format, fields)
        return value_of_answer((yield from self._read_plan(*request)))

    def _get_many_plan(
        self, store: str, keys: Iterable[Any], answer_format: Format = None, fields: Any = None
    ) -> Plan[list[Value | KeyrouteError]]:
        """Direct routing sends one batch per node, at the same time; what a node cannot answer goes through
        the router."""
        batch = Batch(store, keys, self._accept(answer_format))
        if fields is not None:
            batch.path += "?" + urlencode({"fields": fields_text(fields)}, safe=",")
        if self.routing == "direct" and batch.texts:
            yield MAP_DUE
            groups = self._group_by_node(batch)
            self._take(batch, (yield Parallel([self._node_batch_plan(batch, *item) for item in groups.items()])))
        else:
            self._all_via_router(batch)
        if batch.rest:
            answer = yield from self._send_plan("POST", batch.path, json=batch.body(batch.rest), headers=batch.headers)
            batch.took_router_answer(answer)
        return batch.results()

    def _node_batch_plan(
        self, batch: Batch, url: str, indexes: list[int]
    ) -> Plan[tuple[list[int], list[Mapping[str, Any]] | None]]:
        answer = yield Call(url, "POST", batch.path, {"json": batch.body(indexes), "headers": batch.headers})
        return indexes, self._node_results(url, None if isinstance(answer, httpx.TransportError) else answer)

    def _page_plan(self, paged: Paged, params: dict[str, str]) -> Plan[tuple[list[Any], dict[str, str] | None]]:
        """One page of a paged read: its items, and the parameters of the next page (None: the last)."""
        if paged.routed is None:
            answer = yield from self._send_plan("GET", paged.path, params=params)
        else:
            answer = yield from self._read_plan(*paged.routed, paged.path, params, paged.headers)
        body = body_of(answer)
        return body[paged.field], next_page(params, body)


def _same(item: T) -> T:
    return item


def _key_and_value(entry: Mapping[str, Any]) -> tuple[str, Any]:
    return entry["key"], entry["value"]


def _store_of(answer: Answer) -> str | None:
    """The store a node's answer is about (its request's path is /stores/{store}/...)."""
    parts = answer.path.split("/")
    return unquote(parts[2]) if len(parts) > 3 and parts[1] == "stores" else None


def fields_text(fields: Iterable[str] | str | None) -> str | None:
    """A projection's `fields=` text: "a,b.c" as it is, or a list of fields joined (None: whole values)."""
    if fields is None or isinstance(fields, str):
        return fields
    return ",".join(fields)
