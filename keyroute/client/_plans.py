"""Plans: what a read asks its client to do. A plan is a generator that yields steps (`Call` a request,
`Sleep`, `MAP_DUE` to read the partition map when it is due, `Parallel` plans) and is sent back what each
step gave, until it returns the read's result; `Batch` is one `get_many` on its way."""

from __future__ import annotations

from collections.abc import Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import httpx

from keyroute.client._errors import KeyrouteError, error_of_entry
from keyroute.client._models import Answer, Value, body_of, value_of
from keyroute.client._paging import T
from keyroute.client._urls import key_text, store_path

_NO_OPTIONS: Mapping[str, Any] = MappingProxyType({})


class Call:
    """Send a request: to the node at `url` (None: the client's address). The plan is sent back the answer,
    or the exception when it is one of `errors` (anything else is raised). `hot`: a read (the client's
    wire), else off the hot path (httpx). A plain class, not a dataclass: one is made per read."""

    __slots__ = ("errors", "hot", "method", "options", "path", "url")

    def __init__(
        self,
        url: str | None,
        method: str,
        path: str,
        options: Mapping[str, Any] = _NO_OPTIONS,  # the sender's params, json, headers
        errors: type[Exception] | tuple[type[Exception], ...] = httpx.TransportError,
        hot: bool = True,
    ) -> None:
        self.url = url
        self.method = method
        self.path = path
        self.options = options
        self.errors = errors
        self.hot = hot

    def __repr__(self) -> str:
        return f"Call({self.url!r}, {self.method!r}, {self.path!r}, {dict(self.options)!r})"


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


class MapDue:
    """Read the partition map now if it is due (`ClientBase._map_plan`), one read for the callers that find
    it due at once: the client runs it under its lock."""


MAP_DUE = MapDue()


@dataclass(frozen=True, slots=True)
class Parallel:
    """Run these plans at the same time; the plan is sent back their results, in order."""

    plans: Sequence[Plan[Any]]


Step = Call | Sleep | MapDue | Parallel
Plan = Generator[Step, Any, T]


class Batch:
    """One `get_many`: the keys as sent, per key its answer's entry once known, and the keys left for the
    router (all of them, until direct routing has sent some to their nodes)."""

    __slots__ = ("entries", "headers", "path", "rest", "store", "texts")

    def __init__(self, store: str, keys: Iterable[Any], headers: dict[str, str] | None = None) -> None:
        self.store = store
        self.headers = headers  # the Accept of the answer format asked for
        self.texts = [key_text(k) for k in keys]
        self.path = store_path(store, "batch-get")
        self.entries: list[Mapping[str, Any] | None] = [None] * len(self.texts)
        self.rest = list(range(len(self.texts)))

    def body(self, indexes: list[int]) -> dict[str, list[str]]:
        return {"keys": [self.texts[i] for i in indexes]}

    def took_router_answer(self, answer: Answer) -> None:
        for index, entry in zip(self.rest, body_of(answer)["results"], strict=True):
            self.entries[index] = entry

    def results(self) -> list[Value | KeyrouteError]:
        """Per key, in order, its Value or its error."""
        out: list[Value | KeyrouteError] = []
        for entry in self.entries:
            if entry is None:
                raise AssertionError("a key of the batch has no entry")  # every key has had an answer
            if entry.get("status") == 200:
                node = entry.get("node")  # the node that read it (a router passes the entry on as is)
                node_id = None if node is None else str(node)
                out.append(value_of({**entry, "store": self.store}, node_id, entry.get("offset")))
            else:
                out.append(error_of_entry(entry))
        return out
