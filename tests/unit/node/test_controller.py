"""Pure parts of the controller (keyroute.state_node.controller); the controller itself is tested against a real
ZooKeeper in tests/integration; here, with a stand-in client, what it logs."""

from __future__ import annotations

import gc
import logging
from typing import Any

import pytest
from kazoo.handlers.threading import KazooTimeoutError

from keyroute.runtime.collector import without_cyclic_collection
from keyroute.state_node.controller import Controller
from tests.util import wait_for


def test_the_collector_is_held_back_during_the_placement_and_restored_after_even_on_error() -> None:
    assert gc.isenabled()
    with without_cyclic_collection():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), without_cyclic_collection():
        raise RuntimeError("the placement failed")
    assert gc.isenabled()


def test_a_collector_switched_off_before_stays_off() -> None:
    gc.disable()
    try:
        with without_cyclic_collection():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_controller_names_an_election_failure_that_has_no_text(caplog: pytest.LogCaptureFixture) -> None:
    """kazoo's exceptions often carry no text: the controller's line, repeated while ZooKeeper is away, read
    "controller election interrupted: " with nothing after it."""

    class Lock:
        node = None
        path = "/controller"

    class Election:
        lock = Lock()

        def run(self, func: Any, *args: Any) -> None:
            raise KazooTimeoutError()

        def cancel(self) -> None:
            pass

    class Client:
        def Election(self, path: str, identifier: str) -> Election:  # noqa: N802 - kazoo's name
            return Election()

    controller = Controller(Client(), "n1")  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="keyroute.state_node.controller"):
        controller.start()
        try:
            wait_for(lambda: any("interrupted" in r.getMessage() for r in caplog.records), message="the warning")
        finally:
            controller.stop()
    lines = [r.getMessage() for r in caplog.records if "interrupted" in r.getMessage()]
    assert lines[0] == "controller election interrupted: KazooTimeoutError"
