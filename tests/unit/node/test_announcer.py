"""What a node tells ZooKeeper about what it holds (keyroute.state_node.announcer), through a stand-in for its
registration, on a clock the test moves."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

from keyroute.cluster.partition_map import PartitionMap
from keyroute.state_node.announcer import LIVE_REPORT_EVERY_S, Announcer
from tests.clock import WALL_START, ManualClock
from tests.unit.node.test_ownership import ME, OTHER, FakeRegistration, build_map
from tests.util import wait_until


class Registration(FakeRegistration):
    """Also the live status record; `failing`: every write raises (ZooKeeper unreachable)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: list[dict[str, Any] | None] = []
        self.failing = False

    def publish_serving(self, stores: Mapping[str, Mapping[int, int]]) -> None:
        if self.failing:
            raise ConnectionError("ZooKeeper unreachable")
        super().publish_serving(stores)

    def publish_live(self, record: dict[str, Any]) -> None:
        self.live.append(record)

    def withdraw_live(self) -> None:
        self.live.append(None)


class Node:
    """What the announcer is told by its node: what it serves, its map, and its tracked tasks."""

    def __init__(self) -> None:
        self.serving: dict[str, dict[int, int]] = {"s": {0: 1}}
        self.map = PartitionMap.empty()
        self.tasks: list[asyncio.Future[None]] = []
        self.registration = Registration()
        self.clock = ManualClock()
        self.announcer = Announcer(
            self.registration,
            ME,
            lambda: self.serving,
            lambda: self.map,
            self.spawn,
            self.clock,  # type: ignore[arg-type]
        )

    def spawn(self, work: Awaitable[None]) -> None:
        self.tasks.append(asyncio.ensure_future(work))

    async def take(self, m: PartitionMap) -> None:
        """The node takes `m`: the announcer is told, and what it started runs to its end."""
        self.map = m
        self.announcer.map_changed(m)
        await asyncio.gather(*self.tasks)


def run(scenario: Callable[[Node], Coroutine[Any, Any, None]]) -> None:
    async def main() -> None:
        node = Node()
        try:
            await scenario(node)
        finally:
            await node.announcer.stop()

    asyncio.run(main())


def test_the_serving_record_is_written_when_the_map_does_not_say_what_the_node_serves() -> None:
    async def scenario(node: Node) -> None:
        published = node.registration.published
        await node.take(build_map([], {}))
        assert published == [{"s": {0: 1}}]
        await node.take(build_map([], {}, {ME: {"s": {0: 1}}}, 2))  # the map says it already
        await node.take(build_map([], {}, generation=3).marked_stale(True))  # a stale map proves nothing
        assert published == [{"s": {0: 1}}]
        node.serving = {"s": {0: 1, 1: 1}}
        await node.take(build_map([], {}, {ME: {"s": {0: 1}}}, 4))
        assert published[-1] == {"s": {0: 1, 1: 1}}
        node.map = build_map([], {}, {ME: {"s": {0: 1, 1: 1}}}, 5)
        await node.announcer.publish()  # written, and the map says so: not again
        assert len(published) == 2
        node.map = build_map([], {}, {}, 6)  # ...but a map without the record: written again
        await node.announcer.publish()
        assert len(published) == 3

    run(scenario)


def test_a_failed_write_is_tried_again_with_the_next_map() -> None:
    async def scenario(node: Node) -> None:
        node.registration.failing = True
        await node.take(build_map([], {}))
        assert node.registration.published == []
        node.registration.failing = False
        await node.take(build_map([], {}, generation=2))
        assert node.registration.published == [{"s": {0: 1}}]

    run(scenario)


def test_a_node_missing_from_the_map_registers_again_once_and_announces_again() -> None:
    async def scenario(node: Node) -> None:
        await node.take(build_map([], {}, {ME: {"s": {0: 1}}}))
        registration = node.registration
        assert registration.registrations == 0 and registration.published == []
        expired = build_map([], {}, {}, 2, nodes=(OTHER,))  # a new session: its records died with the old one
        node.map = expired
        node.announcer.map_changed(expired)
        node.announcer.map_changed(expired)  # while registering: not twice
        await asyncio.gather(*node.tasks)
        assert registration.registrations == 1
        assert registration.published and all(stores == {"s": {0: 1}} for stores in registration.published)

    run(scenario)


def test_a_withdrawn_node_never_announces_again() -> None:
    async def scenario(node: Node) -> None:
        await node.announcer.withdraw()
        assert node.registration.published == [{"<withdrawn>": {}}] and node.announcer.withdrawn
        node.serving = {"s": {0: 1, 1: 1}}
        await node.take(build_map([], {}, generation=2))
        await node.announcer.publish()
        assert node.registration.published == [{"<withdrawn>": {}}]

    run(scenario)


def test_the_live_status_is_rewritten_when_it_changed_at_most_once_a_report_interval() -> None:
    async def scenario(node: Node) -> None:
        report: dict[str, Any] = {"s": {"0": {"offset": 1}}}
        live = node.registration.live
        node.announcer.report_live(lambda: report)
        await wait_until(lambda: live == [{"stores": {"s": {"0": {"offset": 1}}}, "updated_at": WALL_START}])
        asleep = [LIVE_REPORT_EVERY_S]  # the reporter waits out its interval on the clock
        await wait_until(lambda: node.clock.pending() == asleep, message="the reporter waiting")
        report = {"s": {"0": {"offset": 2}}}  # nothing written before the interval is over
        node.clock.advance(LIVE_REPORT_EVERY_S)
        await wait_until(lambda: len(live) == 2)
        assert live[-1] == {"stores": report, "updated_at": WALL_START + LIVE_REPORT_EVERY_S}
        await wait_until(lambda: node.clock.pending() == asleep, message="the reporter waiting")
        node.clock.advance(LIVE_REPORT_EVERY_S)  # unchanged: not written again
        await wait_until(lambda: node.clock.pending() == asleep, message="the reporter waiting")
        assert len(live) == 2
        report = {}
        node.clock.advance(LIVE_REPORT_EVERY_S)
        await wait_until(lambda: live[-1] is None, message="the live record withdrawn: nothing live held")

    run(scenario)
