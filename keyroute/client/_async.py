"""`AsyncClient`: the asyncio client. It only runs `ClientBase`'s plans, awaited: every decision is the
base's."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import httpx

from keyroute.client._base import Call, ClientBase, MapDue, Paged, Parallel, Plan, Sleep, Step, Steps, T, Value
from keyroute.client._errors import KeyrouteError


class AsyncClient(ClientBase):
    """The asyncio client: the same reads and options as `Client`, awaited (paged reads with `async for`)."""

    _http_class = httpx.AsyncClient
    _lock_class = asyncio.Lock  # bound to the event loop at its first use
    _http: httpx.AsyncClient

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for node in list(self._nodes.values()):
            await node.aclose()
        await self._http.aclose()

    async def get(
        self,
        store: str,
        key: str | int | bytes | uuid.UUID,
        *,
        min_offset: int | None = None,
        answer_format: str | None = None,
    ) -> Value:
        """`Client.get`, awaited."""
        return await self._run(self._get_plan(store, key, min_offset, answer_format))

    async def get_many(
        self, store: str, keys: Iterable[str | int | bytes | uuid.UUID], *, answer_format: str | None = None
    ) -> list[Value | KeyrouteError]:
        """`Client.get_many`, awaited (nodes asked concurrently)."""
        return await self._run(self._get_many_plan(store, keys, answer_format))

    async def _aiterate(self, paged: Callable[[], Paged], item: Callable[[Any], T]) -> AsyncIterator[T]:
        first = paged()
        params: dict[str, str] | None = first.params
        while params is not None:
            items, params = await self._run(self._page_plan(first, params))
            for entry in items:
                yield item(entry)

    async def _run(self, plan: Plan[T]) -> T:
        """Do what `plan` asks, step after step, until it returns."""
        steps = Steps(plan)
        for step in steps:
            steps.reply = await self._do(step)
        return steps.result

    async def _do(self, step: Step) -> Any:
        if isinstance(step, Call):
            try:
                return await self._node(step.url).request(step.method, step.path, **step.options)
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
