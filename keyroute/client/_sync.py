"""`Client`: the blocking client. It only runs `ClientBase`'s plans: every decision is the base's."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from keyroute.client._base import ClientBase
from keyroute.client._errors import KeyrouteError
from keyroute.client._models import Answer, Value
from keyroute.client._paging import Paged, T
from keyroute.client._plans import Call, MapDue, Parallel, Plan, Sleep, Step
from keyroute.client._stores import Fields, get_many_stores_plan, get_stores_plan
from keyroute.client._wire import Origin


class HttpxSender:
    """A sender over an `httpx.Client` (a caller's transport, and map reads): its answers as `Answer`s."""

    __slots__ = ("http",)

    def __init__(self, http: httpx.Client) -> None:
        self.http = http

    def request(self, method: str, path: str, **options: Any) -> Answer:
        return Answer.of_httpx(self.http.request(method, path, **options))


class Client(ClientBase):
    """A blocking client of one keyroute address (a router's load balancer, or any router or node).

    Options (keywords): `timeout` (seconds, per request), `retries`, `backoff_s`, `token` (a bearer
    token), `transport` (an httpx transport), `routing` ("router", or "direct": straight to the nodes
    serving a key, from the partition map), `map_max_age_s` (how old the map may grow), `answer_format`
    ("json" or "avro": what reads ask for; the values are the same), and over HTTPS `verify` (a CA bundle,
    True for the system's CAs, False for none) and `cert` (a client certificate)."""

    _http_class = httpx.Client
    _httpx_sender = HttpxSender
    _lock_class = threading.Lock
    _http: httpx.Client | None
    # Direct routing's batches, one task per node: made at the first one.
    _pool: ThreadPoolExecutor | None = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for sender in list(self._nodes.values()):
            if isinstance(sender, Origin):
                sender.close()
            elif sender.http is not self._http:
                sender.http.close()
        if self._http is not None:
            self._http.close()

    def _wire(self, url: str) -> Origin:
        return Origin(url, self.timeout, self._verify, self._wire_headers())

    def get(
        self,
        store: str,
        key: str | int | bytes | uuid.UUID,
        *,
        min_offset: int | None = None,
        answer_format: str | None = None,
        fields: Iterable[str] | str | None = None,
    ) -> Value:
        """The value of one key (KeyNotFound when there is none); `answer_format`: the client's unless given;
        `fields` ("a,b.c" or a list of them): only those fields of the value, as the node selects them."""
        return self._run(self._get_plan(store, key, min_offset, answer_format, fields))

    def get_many(
        self,
        store: str,
        keys: Iterable[str | int | bytes | uuid.UUID],
        *,
        answer_format: str | None = None,
        fields: Iterable[str] | str | None = None,
    ) -> list[Value | KeyrouteError]:
        """Many keys of one store: per key, in order, its Value or its error (nodes asked in parallel); `fields`
        as `get`'s."""
        return self._run(self._get_many_plan(store, keys, answer_format, fields))

    def get_stores(
        self,
        key: str | int | bytes | uuid.UUID,
        stores: Iterable[str],
        *,
        min_offset: Mapping[str, int] | None = None,
        fields: Fields = None,
    ) -> dict[str, Value | KeyrouteError]:
        """One key's values in several stores, in one request (co-located stores are read from one node): per
        store, in the order given, its Value or its error (KeyNotFound, ...). `min_offset`: a bound per live
        store; `fields`: "a,b.c" or a list for every store, or a mapping store -> fields for some."""
        return self._run(get_stores_plan(self, key, list(stores), min_offset, fields))

    def get_many_stores(
        self,
        keys: Iterable[str | int | bytes | uuid.UUID],
        stores: Iterable[str],
        *,
        min_offset: Mapping[str, int] | None = None,
        fields: Fields = None,
    ) -> list[dict[str, Value | KeyrouteError]]:
        """Many keys in several stores: per key, in order, what `get_stores` gives for it (one request per
        node)."""
        return self._run(get_many_stores_plan(self, keys, list(stores), min_offset, fields))

    def _iterate(self, paged: Callable[[], Paged], item: Callable[[Any], T]) -> Iterator[T]:
        first = paged()
        params: dict[str, str] | None = first.params
        while params is not None:
            items, params = self._run(self._page_plan(first, params))
            yield from map(item, items)

    def _run(self, plan: Plan[T]) -> T:
        """Do what `plan` asks, step after step, until it returns."""
        send = plan.send
        reply = None
        while True:
            try:
                step = send(reply)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            reply = self._do(step)

    def _do(self, step: Step) -> Any:
        if step.__class__ is Call:  # the common step first, without isinstance's generality
            try:
                return self._node(step.url, step.hot).request(step.method, step.path, **step.options)
            except step.errors as exc:
                return exc
        if isinstance(step, Sleep):
            time.sleep(step.seconds)
        elif isinstance(step, MapDue):
            if self._map_due():
                with self._map_lock:  # one read for many threads that find the map due at once
                    self._run(self._map_plan())
        elif isinstance(step, Parallel):
            if not step.plans:
                return []
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="keyroute-client")
            return list(self._pool.map(self._run, step.plans))
        return None
