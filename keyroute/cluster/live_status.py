"""What live partitions report about themselves, for the admin partition map of routers and nodes.

Each node writes `/live/{node_id}` (ephemeral, throttled) with the state of every live partition it holds:

    {"stores": {STORE: {"<partition>": {"version", "offset", "lag_records", "lag_ms", "state", "applied",
                                        "skipped": {reason: n}, "error"}}}, "updated_at": unix_s}

`LiveStatusReader` reads them on request (no watch: only an operator's page asks), at most once per
`max_age_s`, so a busy admin page does not hammer ZooKeeper; `annotate` adds them to a partition map's
description.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException, NoNodeError

from keyroute.cluster import zk_layout
from keyroute.cluster.partition_map import PartitionMap

log = logging.getLogger(__name__)

# The parent of the nodes' live status records (keyroute.cluster.zk_layout keeps the layout).
# What the partition map shows of each replica's report, in this order.
REPORTED = ("offset", "lag_records", "lag_ms", "state", "applied", "skipped", "error")
DEFAULT_MAX_AGE_S = 1.0
# One ZooKeeper read of a report may take this long: a partition map is never held up by a slow ensemble.
READ_TIMEOUT_S = 2.0


class LiveStatus:
    """The reports read at one time: node id -> its record (parsed), and why reading failed, if it did."""

    __slots__ = ("reports", "read_at", "error")

    def __init__(self, reports: Mapping[str, Mapping[str, Any]], read_at: float, error: str | None = None) -> None:
        self.reports = reports
        self.read_at = read_at
        self.error = error


class LiveStatusReader:
    """Reads every `/live/{node_id}` with the client `client()` gives (None: not connected), keeping what it
    read for `max_age_s`. Blocking: call `read` from a worker thread when on the event loop."""

    def __init__(
        self,
        client: Callable[[], KazooClient | None],
        max_age_s: float = DEFAULT_MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()
        self._cached: LiveStatus | None = None

    def read_for(self, m: PartitionMap) -> LiveStatus:
        """`read()`, or nothing at all (no ZooKeeper read) when no store of the map is live."""
        if not any(record.live for record in m.stores.values()):
            return LiveStatus({}, self._clock())
        return self.read()

    def read(self) -> LiveStatus:
        with self._lock:  # one read at a time: concurrent pages share it
            cached = self._cached
            now = self._clock()
            if cached is not None and now - cached.read_at < self._max_age_s:
                return cached
            status = self._read(now)
            self._cached = status
            return status

    def _read(self, now: float) -> LiveStatus:
        client = self._client()
        if client is None or not client.connected:
            # kazoo would wait for the connection to come back: the map is shown at once, without reports.
            return LiveStatus({}, now, "not connected to ZooKeeper")
        try:
            children = client.get_children_async(zk_layout.LIVE).get(timeout=READ_TIMEOUT_S)
        except NoNodeError:
            return LiveStatus({}, now)
        except (KazooException, client.handler.timeout_exception) as exc:
            return LiveStatus({}, now, f"reading {zk_layout.LIVE} failed: {type(exc).__name__}")
        reports: dict[str, Mapping[str, Any]] = {}
        for node_id in sorted(children):
            try:
                data, _ = client.get_async(zk_layout.live_path(node_id)).get(timeout=READ_TIMEOUT_S)
                record = json.loads(data)
            except NoNodeError:
                continue  # the node went away meanwhile
            except (KazooException, client.handler.timeout_exception) as exc:
                return LiveStatus(reports, now, f"reading {zk_layout.live_path(node_id)} failed: {type(exc).__name__}")
            except ValueError:
                log.warning("the live status of node %s is not JSON; left out of the partition map", node_id)
                continue
            if isinstance(record, dict) and isinstance(record.get("stores"), dict):
                reports[node_id] = record
        return LiveStatus(reports, now)


def annotate(description: dict[str, Any], m: PartitionMap, status: LiveStatus, now: float | None = None) -> None:
    """Add live stores' state to `description` (`PartitionMap.describe()` of `m`): a live store says
    `"live": true` (and its `topic` when a replica reports it), and every partition of it lists under
    `"live"` each replica that reports it: node, version, the fields of `REPORTED` and the report's age."""
    now = time.time() if now is None else now
    reports = status.reports
    if status.error is not None:
        description["live_status_error"] = status.error
    for name, store in description.get("stores", {}).items():
        record = m.stores[name]  # the description is m's
        per_node = {node_id: report["stores"].get(name) for node_id, report in reports.items()}
        per_node = {node_id: parts for node_id, parts in per_node.items() if isinstance(parts, dict)}
        if not (record.live or per_node):
            continue
        store["live"] = True
        topic = None
        for entry in store.get("partition_map", ()):
            key = str(entry["partition"])
            replicas = []
            for node_id, parts in per_node.items():
                reported = parts.get(key)
                if not isinstance(reported, dict):
                    continue
                topic = topic or reported.get("topic")
                updated_at = reports[node_id].get("updated_at")
                age_s = round(max(0.0, now - updated_at), 3) if isinstance(updated_at, (int, float)) else None
                replicas.append(
                    {
                        "node": node_id,
                        "version": reported.get("version"),
                        **{field: reported.get(field) for field in REPORTED},
                        "reported_age_s": age_s,
                    }
                )
            entry["live"] = replicas
        if topic is not None:
            store["topic"] = topic
