"""Pure parts of the controller (keyroute.state_node.controller); the controller itself is tested against a real
ZooKeeper in tests/integration."""

from __future__ import annotations

import gc

import pytest

from keyroute.core.collector import without_cyclic_collection


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
