"""Paged reads (`history`, `windows`, `range`): the first request of one, its parameters, the next page's, and
`Pages`, what a client's paged read returns."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from keyroute.client._urls import key_text, time_text

if TYPE_CHECKING:
    from keyroute.client._base import ClientBase

T = TypeVar("T")


def paged_params(start: Any, end: Any, page_size: int, order: str | None = None, **extra: Any) -> dict[str, str]:
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


def range_params(from_key: Any, to_key: Any, prefix: str | None, page_size: int, **extra: Any) -> dict[str, str]:
    """A key range's parameters as a router takes them (the local replica reads its own ranges with them)."""
    return paged_params(
        None,
        None,
        page_size,
        from_key=None if from_key is None else key_text(from_key),
        to_key=None if to_key is None else key_text(to_key),
        prefix=prefix,
        **extra,
    )


@dataclass(frozen=True, slots=True)
class Paged:
    """A paged read: its first request (`routed`: the store and key whose node direct routing asks, None
    for the router), and the field of each answer that holds the page's items."""

    path: str
    field: str
    params: dict[str, str]
    routed: tuple[str, Any] | None = None
    headers: dict[str, str] | None = None  # the Accept of the answer format asked for


def next_page(params: dict[str, str], body: Mapping[str, Any]) -> dict[str, str] | None:
    """The parameters of the page after the one whose answer is `body`; None after the last page."""
    if "next" not in body:
        return None
    return {**params, "cursor": body["next"]}


class Pages(Generic[T]):
    """The items of a paged read (`history`, `windows`, `range`), page after page, each page asked for when
    the one before is used up: iterated with `for` from a `Client`, with `async for` from an `AsyncClient`.
    Nothing is sent, nor any argument checked, before the first item is asked for."""

    __slots__ = ("_client", "_item", "_paged")

    def __init__(self, client: ClientBase, paged: Callable[[], Paged], item: Callable[[Any], T]) -> None:
        self._client, self._paged, self._item = client, paged, item

    def __iter__(self) -> Iterator[T]:
        return self._client._iterate(self._paged, self._item)

    def __aiter__(self) -> AsyncIterator[T]:
        return self._client._aiterate(self._paged, self._item)
