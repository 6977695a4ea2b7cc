"""What this node tells ZooKeeper about what it holds: its serving record (/serving/{id}: the partitions it serves,
only once loaded), its node record again after its session was replaced, the live status of its live partitions
(/live/{id}, about once a second when it changed), and when it leaves, that it serves nothing any more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from keyroute.cluster.partition_map import PartitionMap
from keyroute.runtime.clock import SYSTEM_CLOCK, Clock
from keyroute.runtime.logs import describe
from keyroute.state_node.registration import Registration

log = logging.getLogger(__name__)

# How often the live status record (/live/{node_id}) may be rewritten.
LIVE_REPORT_EVERY_S = 1.0

# store -> {partition: version}
Serving = dict[str, dict[int, int]]


class Announcer:
    """Writes this node's records through `registration`. `serving()` is what the node serves now and `current()`
    the map it knows (whose serving record of this node may already say it); `spawn(work)` runs a task the
    node keeps track of. A write that fails (ZooKeeper unreachable) is tried again on the next map after
    reconnecting. On the event loop; the writes themselves run in worker threads."""

    def __init__(
        self,
        registration: Registration,
        node_id: str,
        serving: Callable[[], Serving],
        current: Callable[[], PartitionMap],
        spawn: Callable[[Awaitable[None]], None],
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._registration = registration
        self._node_id = node_id
        self._serving = serving
        self._current = current
        self._spawn = spawn
        self._clock = clock
        self._lock = asyncio.Lock()
        self._published: Serving | None = None  # what the serving record says, as far as this node knows
        self._registering = False
        self._live_reporter: asyncio.Task[None] | None = None
        self._live_reported: dict[str, Any] | None = None
        self._stopped = False
        self.withdrawn = False  # de-announced for good: nothing is announced any more

    def map_changed(self, m: PartitionMap) -> None:
        """A new fresh map: register again when it lacks this node (the session was replaced: its ephemeral
        records died with it), and announce when its serving record of this node is not what it serves."""
        if m.stale or self.withdrawn:
            return
        if self._node_id not in m.nodes and not self._registering:
            self._registering = True
            self._spawn(self._register())
        announced = m.serving.get(self._node_id)
        if announced is None or announced.stores != self._serving():
            self._spawn(self.publish())

    async def publish(self) -> None:
        """Write the serving record, unless it already says what this node serves."""
        async with self._lock:
            if self.withdrawn:
                return
            announced = self._serving()
            current = self._current().serving.get(self._node_id)
            if announced == self._published and current is not None and current.stores == announced:
                return
            try:
                await asyncio.to_thread(self._registration.publish_serving, announced)
                self._published = announced
            except Exception as exc:  # ZooKeeper unreachable: the next map after reconnecting retries
                log.warning("publishing the serving record failed: %s", describe(exc))
                self._published = None

    async def _register(self) -> None:
        try:
            await asyncio.to_thread(self._registration.register_node)
            self._published = None
            self._live_reported = None  # the live record went with the old session too
            await self.publish()
        except Exception as exc:
            log.warning("re-registering node %s failed: %s", self._node_id, describe(exc))
        finally:
            self._registering = False

    def report_live(self, report: Callable[[], dict[str, Any]]) -> None:
        """From now on, keep /live/{id} saying `report()` (rewritten when it changed, about once a second)."""
        if self._live_reporter is None and not self._stopped:
            self._live_reporter = asyncio.ensure_future(self._report_live(report))

    async def _report_live(self, report: Callable[[], dict[str, Any]]) -> None:
        while not self._stopped and not self.withdrawn:
            stores = report()
            if stores != self._live_reported:
                try:
                    if stores:
                        record = {"stores": stores, "updated_at": self._clock.time()}
                        await asyncio.to_thread(self._registration.publish_live, record)
                    else:
                        await asyncio.to_thread(self._registration.withdraw_live)
                    self._live_reported = stores
                except Exception as exc:  # ZooKeeper unreachable: tried again next time
                    log.debug("publishing the live status failed: %s", describe(exc))
            await self._clock.sleep(LIVE_REPORT_EVERY_S)

    async def withdraw(self) -> None:
        """De-announce this node (delete /serving/{id} and /live/{id}) and never announce again."""
        self.withdrawn = True
        async with self._lock:
            try:
                await asyncio.to_thread(self._registration.withdraw_serving)
            except Exception as exc:  # ZooKeeper unreachable: the record goes with the session
                log.warning("withdrawing the serving record failed: %s", describe(exc))
        if self._live_reporter is not None:
            self._live_reporter.cancel()
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self._registration.withdraw_live)

    def halt(self) -> None:
        """The node stops: no live status report from now on (`stop` ends the reporting task)."""
        self._stopped = True

    async def stop(self) -> None:
        """Stop reporting the live status (the records stay: they go with the session)."""
        self._stopped = True
        if self._live_reporter is not None:
            self._live_reporter.cancel()
            await asyncio.gather(self._live_reporter, return_exceptions=True)
