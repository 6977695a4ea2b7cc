"""The router's views of its partition map: the operator's summary and filtered detail at
`/admin/partition-map`, the full document (`?detail=all`) and the routing view clients route with (`/routing`).

A map of 1,000 nodes and 100,000 partitions makes a 39 MB full document that takes ~0.8 s of CPU to build.
So every view is built at most once per map (map generation, assignment generation, staleness and, for a
map with live stores, the live status read), in a worker thread, never on the event loop, and kept while
that map is current: a repeated request costs a dictionary lookup, and one that names the current ETag in
`If-None-Match` is answered 304. A long poll (`?since=G&wait_s=N`) waits, without a thread, until the map
passes generation G (or its ETag changes), and stops waiting when the client goes away.

The summary does not grow with partitions (per store its counts and a heat strip of at most
`HEAT_CELLS` cells; per node its counts); the detail is filtered and paged on the server.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from keyroute.api import BadRequest
from keyroute.cluster.live_status import REPORTED, LiveStatus, LiveStatusReader, annotate
from keyroute.cluster.partition_map import (
    LOADING,
    PARTITION_STATES,
    SERVED,
    UNDER_REPLICATED,
    UNSERVED,
    Endpoint,
    PartitionMap,
    StoreRecord,
)
from keyroute.http.conditional import entity_tag, marked, matches, not_modified
from keyroute.router.departures import Departures

PARTITION_MAP_PATH = "/admin/partition-map"
ROUTING_PATH = "/routing"
# The routing view's format: raised on any change a client of the previous one could not read.
ROUTING_FORMAT = 1
# The longest long poll, and the page size of the detail (default and largest).
MAX_WAIT_S = 60.0
DEFAULT_LIMIT = 1000
MAX_LIMIT = 10_000
# A store's heat strip in the summary: its partitions in at most this many cells, each the worst state among them.
HEAT_CELLS = 100
LAGGING = "lagging"
FILTER_STATES = (UNSERVED, UNDER_REPLICATED, LOADING, LAGGING)
# A live replica reporting any other state than this one counts its partition as lagging.
LIVE_OK = "live"
_HEAT_CHAR = {SERVED: "s", UNDER_REPLICATED: "r", LOADING: "l", UNSERVED: "u"}
_WORST = {UNSERVED: 3, LOADING: 2, UNDER_REPLICATED: 1, SERVED: 0}
# The full document goes out in pieces of this size, so one answer never holds a write for long.
_CHUNK = 1 << 20
# Pages of detail kept per map (the pages open operators' pages ask again at each change of the map).
_DETAIL_KEPT = 64
_MAP_PARAMS = frozenset({"detail", "store", "node", "state", "partition", "limit", "cursor", "since", "wait_s"})
_ROUTING_PARAMS = frozenset({"since", "store"})
HEADER_MAP_AGE = "x-keyroute-map-age-s"


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


class Views:
    """Everything served of one map, each part built on first use (in a worker thread) and kept."""

    def __init__(self, m: PartitionMap, status: LiveStatus, etag: str, built_at: float, owner: MapViews) -> None:
        self.map = m
        self.status = status
        self.etag = etag
        self.built_at = built_at  # the wall clock when these views were made (the map's age is counted from its own)
        self._owner = owner
        self._lock = threading.RLock()  # a part may be made of others
        self._parts: dict[str, Any] = {}
        self._details: dict[DetailQuery, bytes] = {}

    def ready(self, name: str) -> Any:
        """A part already built (None: not yet): answered without a thread."""
        return self._parts.get(name)

    def part(self, name: str, make: Callable[[], Any]) -> Any:
        part = self._parts.get(name)
        if part is None:
            with self._lock:  # concurrent requests share one build
                part = self._parts.get(name)
                if part is None:
                    part = self._parts[name] = make()
        return part

    # -- live status ------------------------------------------------------------------------------------

    def live(self) -> dict[str, dict[int, list[dict[str, Any]]]]:
        """store -> partition -> what each replica reports of it (as `annotate` gives it)."""
        return self.part("live", self._make_live)  # type: ignore[no-any-return]

    def _make_live(self) -> dict[str, dict[int, list[dict[str, Any]]]]:
        out: dict[str, dict[int, list[dict[str, Any]]]] = {}
        reports = self.status.reports
        if not reports:
            return out
        now = self.built_at
        for name in self.map.stores:
            per_partition: dict[int, list[dict[str, Any]]] = {}
            for node_id, report in reports.items():
                parts = report["stores"].get(name)
                if not isinstance(parts, dict):
                    continue
                updated_at = report.get("updated_at")
                age_s = round(max(0.0, now - updated_at), 3) if isinstance(updated_at, (int, float)) else None
                for key, reported in parts.items():
                    if not isinstance(reported, dict) or not str(key).isdigit():
                        continue
                    per_partition.setdefault(int(key), []).append(
                        {
                            "node": node_id,
                            "version": reported.get("version"),
                            **{f: reported.get(f) for f in REPORTED},
                            "reported_age_s": age_s,
                        }
                    )
            if per_partition:
                out[name] = per_partition
        return out

    # -- the summary ------------------------------------------------------------------------------------

    def summary(self) -> bytes:
        return self.part("summary", lambda: _dumps(self._make_summary()))  # type: ignore[no-any-return]

    def _make_summary(self) -> dict[str, Any]:
        m, live = self.map, self.live()
        totals = dict.fromkeys((*PARTITION_STATES, LAGGING), 0)
        stores: dict[str, Any] = {}
        for name, record in sorted(m.stores.items()):
            stores[name] = entry = self._store_summary(name, record, live.get(name, {}))
            for state in (*PARTITION_STATES, LAGGING):
                totals[state] += entry.get(state, 0)
        assigned: dict[str, int] = {}
        for per_partition in m.assignment.stores.values():
            for replicas in per_partition:
                for node_id in replicas:
                    assigned[node_id] = assigned.get(node_id, 0) + 1
        nodes: dict[str, Any] = {}
        for node_id in sorted(m.nodes.keys() | assigned.keys()):
            node = m.nodes.get(node_id)
            serving = m.serving.get(node_id)
            nodes[node_id] = {
                "url": None if node is None else node.url,
                "zone": None if node is None else node.zone or None,
                # gone: assigned partitions but not registered (crashed, or its session expired)
                "state": "gone" if node is None else "leaving" if node.leaving else "up",
                "assigned": assigned.get(node_id, 0),
                "serving": 0 if serving is None else sum(len(parts) for parts in serving.stores.values()),
            }
        problems = [
            {"store": name, "state": state, "partitions": entry[state]}
            for state in (UNSERVED, LOADING, UNDER_REPLICATED, LAGGING)
            for name, entry in stores.items()
            if entry.get(state)
        ]
        problems += [{"node": node_id, "state": n["state"]} for node_id, n in nodes.items() if n["state"] == "gone"]
        problems += [{"node": node_id, "state": n["state"]} for node_id, n in nodes.items() if n["state"] == "leaving"]
        # Nodes that left or died (router/departures.py): named, with when they were last seen and what they held.
        departed = self._owner.departures.describe(m)
        for entry in departed:
            if entry["node"] not in nodes and entry["state"] != "back":
                nodes[entry["node"]] = {"url": entry["url"], "zone": entry["zone"], "state": entry["state"],
                                        "assigned": 0, "serving": 0}
                if entry["served_again"] < entry["held_partitions"]:
                    problems.append({"node": entry["node"], "state": entry["state"]})
        body: dict[str, Any] = {
            "view": "summary",
            "generation": m.generation,
            "assignment_generation": m.assignment.generation,
            "age_s": round(max(0.0, self.built_at - m.built_at), 3),
            "built_at": m.built_at,
            "stale": m.stale,
            "complete": m.complete,
            "router": True,
            "totals": {
                "stores": len(stores),
                "nodes": len(m.nodes),
                "nodes_leaving": sum(1 for r in m.nodes.values() if r.leaving),
                "nodes_gone": sum(1 for n in nodes.values() if n["state"] == "gone"),
                "partitions": sum(r.partitions for r in m.stores.values()),
                **totals,
            },
            "problems": problems,
            "stores": stores,
            "nodes": nodes,
            "departed": departed,
        }
        if self.status.error is not None:
            body["live_status_error"] = self.status.error
        return body

    def _store_summary(
        self, name: str, record: StoreRecord, live: Mapping[int, list[dict[str, Any]]]
    ) -> dict[str, Any]:
        m = self.map
        routes = m.routes.get(name, ())
        counts = dict.fromkeys(PARTITION_STATES, 0)
        versions: set[int] = set()
        cells = min(record.partitions, HEAT_CELLS)
        heat = [0] * cells
        for p in range(record.partitions):
            endpoints = routes[p] if p < len(routes) else ()
            state = _state(endpoints, record)
            counts[state] += 1
            if endpoints:
                versions.add(endpoints[0].version)
            cell = p * cells // record.partitions
            heat[cell] = max(heat[cell], _WORST[state])
        by_worst = {v: _HEAT_CHAR[s] for s, v in _WORST.items()}
        entry: dict[str, Any] = {
            "partitions": record.partitions,
            "version": record.version,
            "versions_served": sorted(versions),
            "replication_factor": record.replication_factor,
            "partitioner": record.partitioner.value,
            "key_format": record.key_format.value,
            **counts,
            "heat": "".join(by_worst[v] for v in heat),
        }
        if record.timeline is not None:
            entry["timeline"] = record.timeline.kind
        if record.ttl is not None:
            entry["ttl"] = record.ttl.text
        if record.colocate_with is not None:
            entry["colocate_with"] = record.colocate_with
        if name in m.orphaned:
            entry["orphaned"] = True
        if record.live or live:
            lagging = sum(1 for reports in live.values() if any(r.get("state") != LIVE_OK for r in reports))
            lags = [
                max((r["lag_records"] for r in reports if isinstance(r.get("lag_records"), (int, float))), default=0)
                for reports in live.values()
            ]
            lags_ms = [
                max((r["lag_ms"] for r in reports if isinstance(r.get("lag_ms"), (int, float))), default=0)
                for reports in live.values()
            ]
            entry.update(
                live=True,
                lagging=lagging,
                lag_records_max=max(lags, default=None),
                lag_records_p99=_p99(lags),
                lag_ms_max=max(lags_ms, default=None),
                lag_ms_p99=_p99(lags_ms),
            )
        return entry

    # -- the full document ------------------------------------------------------------------------------

    def full(self) -> bytes:
        """Today's whole document: `PartitionMap.describe()`, annotated with live status."""

        def make() -> bytes:
            body = {**self.map.describe(self.built_at), "router": True}
            annotate(body, self.map, self.status, self.built_at)
            return _dumps(body)

        return self.part("full", make)  # type: ignore[no-any-return]

    # -- filtered detail --------------------------------------------------------------------------------

    def index(self) -> DetailIndex:
        return self.part("index", lambda: DetailIndex(self.map, self.live()))  # type: ignore[no-any-return]

    def kept_detail(self, query: DetailQuery) -> bytes | None:
        return self._details.get(query)

    def detail(self, query: DetailQuery) -> bytes:
        """One page of the partitions `query` selects (the last `_DETAIL_KEPT` pages asked are kept)."""
        kept = self._details.get(query)
        if kept is None:
            kept = self._make_detail(query)
            with self._lock:
                if len(self._details) >= _DETAIL_KEPT:
                    del self._details[next(iter(self._details))]
                self._details[query] = kept
        return kept

    def _make_detail(self, query: DetailQuery) -> bytes:
        index = self.index()
        positions = index.select(query)
        start = 0 if query.cursor is None else bisect.bisect_right(positions, index.position_of(query.cursor))
        page = positions[start : start + query.limit]
        m, live = self.map, self.live()
        entries = []
        for position in page:
            name, p = index.order[position]
            record = m.stores[name]
            endpoints = m.serving_endpoints(name, p)
            entry: dict[str, Any] = {
                "store": name,
                "partition": p,
                "state": _state(endpoints, record),
                "assigned": list(m.assignment.replicas(name, p)),
                "serving": [{"node": ep.node_id, "url": ep.url, "version": ep.version} for ep in endpoints],
            }
            if name in index.live_stores:
                entry["live"] = live.get(name, {}).get(p, [])
                entry["lagging"] = position in index.lagging_set
            entries.append(entry)
        body: dict[str, Any] = {
            "view": "detail",
            "generation": m.generation,
            "assignment_generation": m.assignment.generation,
            "stale": m.stale,
            "matched": len(positions),
            "partitions": entries,
        }
        if start + query.limit < len(positions):
            last = index.order[page[-1]]
            body["next"] = f"{last[1]}:{last[0]}"
        return _dumps(body)


def _state(endpoints: tuple[Endpoint, ...], record: StoreRecord) -> str:
    if not endpoints:
        return UNSERVED
    if endpoints[0].version != record.version:
        return LOADING
    return UNDER_REPLICATED if len(endpoints) < record.replication_factor else SERVED


@dataclass(frozen=True, slots=True)
class DetailQuery:
    store: str | None = None
    node: str | None = None
    state: str | None = None
    partition: int | None = None
    limit: int = DEFAULT_LIMIT
    cursor: tuple[str, int] | None = None


class DetailIndex:
    """Every partition of a map in one order (stores by name, then partition), with the positions per
    store, node (assigned or serving) and state, so a filtered page costs in proportion to what it matches."""

    def __init__(self, m: PartitionMap, live: Mapping[str, Mapping[int, list[dict[str, Any]]]]) -> None:
        self.order: list[tuple[str, int]] = []
        self.names = sorted(m.stores)
        self.starts: dict[str, int] = {}
        self.by_node: dict[str, list[int]] = {}
        self.by_state: dict[str, list[int]] = {s: [] for s in (*PARTITION_STATES, LAGGING)}
        self.live_stores = {name for name, r in m.stores.items() if r.live or name in live}
        for name in self.names:
            record = m.stores[name]
            self.starts[name] = len(self.order)
            replicas = m.assignment.stores.get(name, ())
            routes = m.routes.get(name, ())
            lagging = live.get(name, {})
            for p in range(record.partitions):
                position = len(self.order)
                self.order.append((name, p))
                endpoints = routes[p] if p < len(routes) else ()
                self.by_state[_state(endpoints, record)].append(position)
                reports = lagging.get(p)
                if reports and any(r.get("state") != LIVE_OK for r in reports):
                    self.by_state[LAGGING].append(position)
                nodes = set(replicas[p]) if p < len(replicas) else set()
                nodes.update(ep.node_id for ep in endpoints)
                for node_id in nodes:
                    self.by_node.setdefault(node_id, []).append(position)
        self.lagging_set = frozenset(self.by_state[LAGGING])

    def position_of(self, cursor: tuple[str, int]) -> int:
        """The position of the partition a cursor names (or where it would be: it may have gone since)."""
        name, p = cursor
        start = self.starts.get(name)
        if start is not None:
            return start + p
        i = bisect.bisect_left(self.names, name)
        return (self.starts[self.names[i]] if i < len(self.names) else len(self.order)) - 1

    def select(self, q: DetailQuery) -> list[int]:
        """The positions matching every filter of `q`, in order."""
        candidates: list[list[int]] = []
        if q.store is not None:
            start = self.starts.get(q.store)
            if start is None:
                return []
            end = self._end(q.store)
            if q.partition is not None:
                return [start + q.partition] if start + q.partition < end else []
            candidates.append(list(range(start, end)))
        elif q.partition is not None:
            candidates.append([self.starts[n] + q.partition for n in self.names if self._holds(n, q.partition)])
        if q.node is not None:
            candidates.append(self.by_node.get(q.node, []))
        if q.state is not None:
            candidates.append(self.by_state[q.state])
        if not candidates:
            return list(range(len(self.order)))
        candidates.sort(key=len)
        first, rest = candidates[0], [set(c) for c in candidates[1:]]
        return [pos for pos in first if all(pos in r for r in rest)]

    def _end(self, name: str) -> int:
        i = self.names.index(name)
        return self.starts[self.names[i + 1]] if i + 1 < len(self.names) else len(self.order)

    def _holds(self, name: str, partition: int) -> bool:
        return self.starts[name] + partition < self._end(name)


# -- the routing view ------------------------------------------------------------------------------------


class RoutingTables:
    """The routing view's parts, shared by every map: an append-only node table (so a store's part, which
    names nodes by their index in it, stays valid while the store's routes do) and each store's part."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._node_index: dict[tuple[str, str], int] = {}
        self.nodes: list[list[str]] = []
        self._parts: dict[str, tuple[Any, StoreRecord, bytes]] = {}

    def _node(self, ep: Endpoint) -> int:
        key = (ep.node_id, ep.url)
        index = self._node_index.get(key)
        if index is None:
            index = self._node_index[key] = len(self.nodes)
            self.nodes.append([ep.node_id, ep.url])
        return index

    def store_part(self, m: PartitionMap, name: str) -> bytes:
        record = m.stores[name]
        routes = m.routes.get(name, ())
        with self._lock:
            cached = self._parts.get(name)
            if cached is not None and cached[0] is routes and cached[1] == record:
                return cached[2]
            replicas = []
            versions: dict[str, int] = {}
            for p in range(record.partitions):
                endpoints = routes[p] if p < len(routes) else ()
                replicas.append([self._node(ep) for ep in endpoints])
                if endpoints and endpoints[0].version != record.version:
                    versions[str(p)] = endpoints[0].version
            part = _dumps(
                {
                    "partitions": record.partitions,
                    "partitioner": record.partitioner.value,
                    "key_format": record.key_format.value,
                    **({} if record.key_schema is None else {"key_schema": record.key_schema.to_dict()}),
                    "version": record.version,
                    "replicas": replicas,
                    # Partitions served at another version than the store's (loading, rolling back).
                    "versions": versions,
                }
            )
            self._parts[name] = (routes, record, part)
            return part

    def forget(self, names: set[str]) -> None:
        with self._lock:
            for name in list(self._parts):
                if name not in names:
                    del self._parts[name]

    def document(
        self, m: PartitionMap, names: list[str], since: int | None, visible: frozenset[str] | None = None
    ) -> bytes:
        """The routing view of the stores `names` (of those, in `store_names`, `visible` only: None, all)."""
        parts = [(name, self.store_part(m, name)) for name in names]
        with self._lock:
            # No store part: no index to resolve (an answer to ?since=G when nothing routes differently).
            nodes = _dumps(self.nodes if parts else [])
        head = {
            "format": ROUTING_FORMAT,
            "generation": m.generation,
            "assignment_generation": m.assignment.generation,
            "stale": m.stale,
            "store_names": sorted(m.stores if visible is None else visible.intersection(m.stores)),
        }
        if since is not None:
            head["since"] = since
        out = bytearray(_dumps(head)[:-1])
        out += b',"nodes":' + nodes + b',"stores":{'
        out += b",".join(_dumps(name) + b":" + part for name, part in parts)
        out += b"}}"
        return bytes(out)


# -- the views of the current map ------------------------------------------------------------------------


class MapViews:
    """The views of the router's current map, and who waits for the next one."""

    def __init__(self, live_status: LiveStatusReader, clock: Callable[[], float] = time.time) -> None:
        self._live_status = live_status
        self._clock = clock
        self._current: Views | None = None
        self._lock = threading.Lock()
        self._changed: asyncio.Event | None = None
        self.routing = RoutingTables()
        # Per store, the map generation at which its routing part last changed (since the first map seen).
        self._changed_at: dict[str, int] = {}
        self._seen: PartitionMap | None = None
        self.tracked_from: int | None = None
        # Long polls waiting for the next map now (`next_change`).
        self.long_polls = 0
        self.departures = Departures(clock)

    def observe(self, m: PartitionMap) -> None:
        """A new map is installed (on the event loop): note which stores route differently, wake waiters."""
        last = self._seen
        if last is None:
            self.tracked_from = m.generation
        for name, record in m.stores.items():
            old = None if last is None else last.stores.get(name)
            if (
                last is None
                or old is None
                or last.routes.get(name) is not m.routes.get(name)
                or (old.partitions, old.partitioner, old.key_format, old.version)
                != (record.partitions, record.partitioner, record.key_format, record.version)
            ):
                self._changed_at[name] = m.generation
        for name in list(self._changed_at):
            if name not in m.stores:
                del self._changed_at[name]
        self.departures.observe(last, m)
        self._seen = m
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def changed_since(self, since: int) -> list[str] | None:
        """The stores whose routing changed after generation `since`; None: not known that far back."""
        if self.tracked_from is None or since < self.tracked_from:
            return None
        return sorted(name for name, at in self._changed_at.items() if at > since)

    async def next_change(self, timeout_s: float, gone: asyncio.Future[None]) -> None:
        """Wait until the next map is installed, `timeout_s` passes or `gone` (the client went away) is done."""
        if self._changed is None:
            self._changed = asyncio.Event()
        changed = asyncio.ensure_future(self._changed.wait())
        self.long_polls += 1
        try:
            await asyncio.wait((changed, gone), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.long_polls -= 1
            changed.cancel()

    def _live(self, m: PartitionMap) -> bool:
        return any(record.live for record in m.stores.values())

    def cached(self, m: PartitionMap) -> Views | None:
        """The current views when they are `m`'s and need no live status read (answers at once)."""
        current = self._current
        if current is not None and current.map is m and current.status.read_at == 0.0:
            return current
        return None

    def views(self, m: PartitionMap) -> Views:
        """The views of `m` (blocking when live status must be read: call it from a worker thread)."""
        status = self._live_status.read_for(m) if self._live(m) else LiveStatus({}, 0.0)
        live_mark = f"l{status.read_at:.6f}" if status.read_at else ""
        etag = entity_tag(f"g{m.generation}", f"a{m.assignment.generation}", "s" if m.stale else "", live_mark)
        with self._lock:
            current = self._current
            if current is not None and current.etag == etag:
                return current
            current = self._current = Views(m, status, etag, self._clock(), self)
            self.routing.forget(set(m.stores))
            return current

    async def of(self, m: PartitionMap) -> Views:
        cached = self.cached(m)
        if cached is not None:
            return cached
        return await run_in_threadpool(self.views, m)

    def headers(self, views: Views) -> dict[str, str]:
        age = max(0.0, self._clock() - views.map.built_at)
        return {
            "etag": views.etag,
            "cache-control": "no-cache",
            HEADER_MAP_AGE: f"{age:.3f}",
            "x-keyroute-generation": str(views.map.generation),
        }


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _matches(request: Request, etag: str) -> bool:
    return matches(request.headers.get("if-none-match"), etag)


# -- request parameters ----------------------------------------------------------------------------------


def _one(request: Request, name: str) -> str | None:
    values = request.query_params.getlist(name)
    if len(values) > 1:
        raise BadRequest(f"query parameter {name!r} is given {len(values)} times; give it once")
    return values[0] if values else None


def _int(request: Request, name: str, low: int, high: int | None = None) -> int | None:
    text = _one(request, name)
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f">= {low}"
        raise BadRequest(f"query parameter {name!r} must be an integer {bound}, got {text!r}")
    return value


def _unknown(request: Request, known: frozenset[str]) -> None:
    for name in request.query_params:
        if name not in known:
            raise BadRequest(f"unknown query parameter {name!r}; known: {', '.join(sorted(known))}")


def _wait(request: Request) -> tuple[int | None, float | None]:
    since = _int(request, "since", 0)
    text = _one(request, "wait_s")
    if text is None:
        return since, None
    try:
        wait_s = float(text)
    except ValueError:
        wait_s = -1.0
    if not 0 <= wait_s <= MAX_WAIT_S or math.isnan(wait_s):
        raise BadRequest(f"query parameter 'wait_s' must be a number of seconds from 0 to {MAX_WAIT_S:g}, got {text!r}")
    if since is None:
        raise BadRequest("query parameter 'wait_s' needs 'since' (the map generation the caller has)")
    return since, wait_s


def detail_query(request: Request) -> DetailQuery | str | None:
    """The view a partition-map request asks for: "all" (the full document), None (the summary), or the
    filters of the detail. Raises BadRequest naming a bad parameter."""
    _unknown(request, _MAP_PARAMS)
    detail = _one(request, "detail")
    if detail is not None and detail != "all":
        raise BadRequest(f"query parameter 'detail' must be 'all', got {detail!r}")
    state = _one(request, "state")
    if state is not None and state not in FILTER_STATES:
        raise BadRequest(f"query parameter 'state' must be one of {', '.join(FILTER_STATES)}, got {state!r}")
    cursor_text = _one(request, "cursor")
    cursor = None
    if cursor_text is not None:
        p, sep, name = cursor_text.partition(":")
        if not sep or not p.isdigit():
            raise BadRequest(f"query parameter 'cursor' is not one this router gave, got {cursor_text!r}")
        cursor = (name, int(p))
    query = DetailQuery(
        store=_one(request, "store"),
        node=_one(request, "node"),
        state=state,
        partition=_int(request, "partition", 0),
        limit=_int(request, "limit", 1, MAX_LIMIT) or DEFAULT_LIMIT,
        cursor=cursor,
    )
    if detail is not None:
        if query != DetailQuery():
            raise BadRequest("query parameter 'detail=all' takes no filter or paging parameters")
        return "all"
    return None if query == DetailQuery() else query


# -- the endpoints ---------------------------------------------------------------------------------------


def _map_of(request: Request) -> PartitionMap:
    m: PartitionMap = request.app.state.proxy.table.map
    return m


async def _current_after_wait(request: Request, views_of: MapViews) -> Views:
    """The views to answer with, after the long poll the request asks for (if any): it ends when the map
    passes generation `since`, when its ETag is no longer the one the client has, at `wait_s`, or when the
    client goes away."""
    since, wait_s = _wait(request)
    views = await views_of.of(_map_of(request))
    if wait_s is None or since is None:
        return views
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    has_tag = "if-none-match" in request.headers
    # One watcher for the whole wait: cancelling a read of the connection's end more than once would lose it.
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while views.map.generation <= since and (not has_tag or _matches(request, views.etag)):
            left = deadline - loop.time()
            if left <= 0 or gone.done():
                break
            await views_of.next_change(left, gone)
            views = await views_of.of(_map_of(request))
    finally:
        gone.cancel()
    return views


async def partition_map(request: Request) -> Response:
    """GET /admin/partition-map: the summary, filtered detail, or the whole document (`?detail=all`)."""
    views_of: MapViews = request.app.state.map_views
    query = detail_query(request)
    views = await _current_after_wait(request, views_of)
    headers = views_of.headers(views)
    empty = cluster_state(request)
    routers, policy = _routers(request, headers), _policy(request, headers)
    if not empty and (unchanged := not_modified(request, headers)) is not None:
        return unchanged
    if query == "all":
        body = policy(routers(await run_in_threadpool(views.full)))
        if empty:  # an empty cluster's map is a few bytes: said in the body as /readyz says it
            body = json.dumps({**json.loads(body), **empty}, separators=(",", ":")).encode()
        return StreamingResponse(
            _chunks(body), media_type="application/json", headers={**headers, "content-length": str(len(body))}
        )
    if query is None:
        body = policy(routers(views.ready("summary") or await run_in_threadpool(views.summary)))
        if empty:
            body = json.dumps({**json.loads(body), **empty}, separators=(",", ":")).encode()
    else:
        assert isinstance(query, DetailQuery)
        kept = views.kept_detail(query)
        body = kept if kept else await run_in_threadpool(views.detail, query)
    return Response(body, media_type="application/json", headers=headers)


def _routers(request: Request, headers: dict[str, str]) -> Callable[[bytes], bytes]:
    """What adds the routers up (router/registry.py) to a summary or whole document, `"routers": [{"id",
    "url"}]`; their version goes into the ETag in `headers`. Nothing while none is known (a router not
    registered, a source without ZooKeeper in tests)."""
    registry = getattr(request.app.state, "router_registry", None)
    if registry is None or not registry.version:
        return lambda body: body
    routers, version = registry.routers, registry.version
    headers["etag"] = marked(headers["etag"], f"r{version}")
    listed = b',"routers":' + _dumps(routers) + b"}"
    return lambda body: body[:-1] + listed if body.endswith(b"}") else body


def _policy(request: Request, headers: dict[str, str]) -> Callable[[bytes], bytes]:
    """What adds the cluster policy and whether this router satisfies it (keyroute.cluster.cluster_policy) to a
    summary or whole document, `"policy": {...}`; the check's version, once it changed, goes into the ETag in
    `headers`."""
    watch = getattr(request.app.state, "policy", None)
    if watch is None:
        return lambda body: body
    version, check = watch.version, watch.check  # in this order: a body never older than its ETag says
    if version:  # the policy as first read (none recorded, or one met at start) changes no ETag
        headers["etag"] = marked(headers["etag"], f"p{version}")
    listed = b',"policy":' + _dumps(check.describe()) + b"}"
    return lambda body: body[:-1] + listed if body.endswith(b"}") else body


def cluster_state(request: Request) -> dict[str, str]:
    """`{"cluster": "empty", "cluster_message": ...}` while the chroot holds no cluster, else nothing (the map
    source says so: keyroute.router.map_source)."""
    message = getattr(getattr(request.app.state, "map_source", None), "empty_cluster", None)
    return {"cluster": "empty", "cluster_message": message} if message else {}


def _chunks(body: bytes) -> Iterator[bytes]:
    view = memoryview(body)
    for start in range(0, len(body), _CHUNK):
        yield bytes(view[start : start + _CHUNK])


async def routing(request: Request) -> Response:
    """GET /routing: what a client needs to send each key to a node serving it; `?since=G` only the stores
    whose routing changed after map generation G, `?store=S` (repeatable) only those stores."""
    views_of: MapViews = request.app.state.map_views
    _unknown(request, _ROUTING_PARAMS)
    since = _int(request, "since", 0)
    wanted = request.query_params.getlist("store")
    m = _map_of(request)
    callers = getattr(request.app.state, "callers", None)
    visible = None if callers is None else callers.of_scope(request.scope).stores
    views = await views_of.of(m)
    headers = views_of.headers(views)
    if visible is not None:
        # A caller allowed some stores only: the stores it may read, never from the shared cache.
        names = sorted(name for name in (wanted or m.stores) if name in m.stores and name in visible)
        since_changed = None if since is None else views_of.changed_since(since)
        if since_changed is not None:
            names = [name for name in names if name in since_changed]
        document = views_of.routing.document
        body = await run_in_threadpool(document, m, names, since if since_changed is not None else None, visible)
        own = {name: value for name, value in headers.items() if name != "etag"}
        return Response(body, media_type="application/json", headers={**own, "cache-control": "no-store"})
    if wanted:
        names = sorted({name for name in wanted if name in m.stores})
        body = await run_in_threadpool(views_of.routing.document, m, names, None)
        return Response(body, media_type="application/json", headers=headers)
    if (unchanged := not_modified(request, headers)) is not None:
        return unchanged
    changed = None if since is None else views_of.changed_since(since)
    if changed is None:
        body = views.ready("routing") or await run_in_threadpool(
            views.part, "routing", lambda: views_of.routing.document(m, sorted(m.stores), None)
        )
    else:
        body = await run_in_threadpool(views_of.routing.document, m, changed, since)
    return Response(body, media_type="application/json", headers=headers)
