"""`arun`: each test of keyroute.http's server runs on asyncio's own event loop and on uvloop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest


def _loop_factories() -> list[Any]:
    params = [pytest.param(None, id="asyncio")]
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return params
    return [*params, pytest.param(uvloop.new_event_loop, id="uvloop")]


@pytest.fixture(params=_loop_factories())
def arun(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, None]], None]:
    """Run a test coroutine on a fresh loop of the parametrized kind; any error the loop reports (an
    exception in a callback, a task exception never retrieved) fails the test."""
    factory = request.param

    def runner(coro: Coroutine[Any, Any, None]) -> None:
        reported: list[dict[str, Any]] = []

        async def main() -> None:
            asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context))
            await coro

        with asyncio.Runner(loop_factory=factory) as runner_:
            runner_.run(main())
        assert not reported, reported

    return runner
