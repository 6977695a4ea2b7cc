"""keyroute.http.lifespan through the server: the lifespan's state, a failing startup, a failing shutdown."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.applications import Starlette

from keyroute.http import HttpServer
from tests.unit.http.harness import (
    Plane,
    exchange,
    get,
    starlette_app,
)


def test_the_lifespan_state_reaches_the_data_plane_factory_and_the_requests(arun: Any) -> None:
    events: list[str] = []

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        app.state.proxy = "the proxy"
        events.append("startup")
        yield {"counter": 7}
        events.append("shutdown")

    async def scenario() -> None:
        plane = Plane()
        given: list[Any] = []

        def factory(state: Any) -> Plane:
            given.append(state.proxy)
            return plane

        server = HttpServer(starlette_app(lifespan), data_plane=factory)
        await server.start(port=0)
        assert given == ["the proxy"] and events == ["startup"] and server.data_plane is plane
        try:
            answer = await exchange(server.port, get("/hello"))
            assert answer.json()["state"] == 7
            assert (await exchange(server.port, get("/stores/x"))).status == 200
        finally:
            await server.stop()
        assert events == ["startup", "shutdown"]

    arun(scenario())


def test_a_failing_lifespan_makes_start_raise_and_nothing_listens(arun: Any) -> None:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        raise ValueError("no store here")
        yield  # pragma: no cover

    async def scenario() -> None:
        built: list[Any] = []
        server = HttpServer(starlette_app(lifespan), data_plane=built.append)
        with pytest.raises(RuntimeError, match="no store here"):
            await server.start(port=0)
        assert built == []
        with pytest.raises(RuntimeError):
            server.port  # noqa: B018

    arun(scenario())


def test_a_failing_lifespan_shutdown_is_logged_and_stop_returns(arun: Any, caplog: pytest.LogCaptureFixture) -> None:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        raise ValueError("shutdown trouble")

    async def scenario() -> None:
        server = HttpServer(starlette_app(lifespan))
        await server.start(port=0)
        await server.stop()

    with caplog.at_level(logging.ERROR, logger="keyroute.http.lifespan"):
        arun(scenario())
    assert any(r.name == "keyroute.http.lifespan" and "shutdown trouble" in r.getMessage() for r in caplog.records)
