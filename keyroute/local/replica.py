"""`LocalReplica`: a store's partitions held inside the application, read without a hop.

Reads locate the key's partition exactly as the cluster does (the store's key format and partitioner, every
partition counted) and read the partition's LMDB file in this process: a memory-mapped lookup, no request.
Answers are the client's (keyroute.client): a `Value` per key, the same `KeyrouteError` subclasses, the same
value as the cluster's answer for the same key at the same version and offset.

The view readers use is an immutable mapping {store: _StoreView}, replaced whole on every swap: the read path
takes no lock. Partitions that leave a view are closed only after a grace period, so a read that started on
one finishes on it.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import logging
import os
import re
import threading
import time
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import lmdb
import orjson
from prometheus_client import REGISTRY, CollectorRegistry

from keyroute.api import ApiError
from keyroute.client import (
    BadKey,
    BadRequest,
    Client,
    KeyNotFound,
    KeyrouteError,
    NotLive,
    StoreNotFound,
    Unavailable,
    Value,
    WrongStoreKind,
    key_text,
    paged_params,
    range_params,
)
from keyroute.keys.key_format import KeyFormat, KeyFormatError, key_from_data, parse_key
from keyroute.keys.partitioner import Partitioner, murmur2_bits, partition_for
from keyroute.local.holder import Holder
from keyroute.local.shared import ApplyLock, HeldStore, read_status, read_view, view_stamp
from keyroute.replica.live import ApplierSettings
from keyroute.replica.store import LoadError, PartitionId, PartitionStore, open_loaded
from keyroute.runtime.settings import ZkSettings
from keyroute.storage.live import OFFSET_KEY, value_bytes
from keyroute.storage.lmdb_layout import LMDB_MAX_KEY_BYTES, TAG_KEY, db_key
from keyroute.storage.projection import Projection, parse_fields
from keyroute.storage.ranges import (
    RangeKeyError,
    RangeQueryError,
    no_key_ranges,
    order_of,
    parse_range_query,
    scan_partition,
    scan_segments,
)
from keyroute.storage.timeline import HISTORY, READ_KINDS, WINDOWS, QueryError, parse_query

log = logging.getLogger(__name__)

# LMDB's own limit on a key: longer serialized keys are stored under a hash (keyroute.storage.lmdb_layout).
_LONG_KEY = LMDB_MAX_KEY_BYTES
# orjson reads a JSON integer beyond 64 bits as a float: text with a run of 19 or more digits is read by the
# standard library instead, as the client's JSON decoder reads it (exact integers).
_LONG_DIGITS = re.compile(rb"[0-9]{19}")
_NODE = "local"
FALLBACKS = (None, "router")
DEFAULT_MAP_SIZE = 1 << 34


class NotHeld(Unavailable):
    """503 partition_not_held: the key's partition (or the store) is not held by this local replica, which was
    made without a fallback (`fallback="router"` reads such keys through the cluster)."""


def _loads(raw: bytes) -> Any:
    if _LONG_DIGITS.search(raw) is not None:
        return json.loads(raw)
    return orjson.loads(raw)


class _StoreView:
    """One held store as reads see it: how its keys are located, and its open partitions (None where a
    partition is not held)."""

    __slots__ = ("fast", "live", "name", "parts", "partitioner", "partitions", "record", "timeline", "version")

    def __init__(self, held: HeldStore, parts: Mapping[int, PartitionStore]) -> None:
        record = held.record
        self.name = record.name
        self.record = record
        self.version = held.version
        self.partitions = record.partitions
        self.partitioner = record.partitioner
        self.live = record.live
        self.timeline = record.timeline
        self.parts: tuple[PartitionStore | None, ...] = tuple(parts.get(p) for p in range(record.partitions))
        # String keys hashed with murmur2 (the common case): the key's bytes and partition without a detour.
        self.fast = record.key_format is KeyFormat.STRING and record.partitioner is Partitioner.MURMUR2

    def locate(self, key: Any) -> tuple[str, bytes, int]:
        """The key's text (as answers carry it), its serialized bytes and its partition; BadKey when it does not
        fit the store's key format."""
        if self.fast and type(key) is str:
            try:
                data = key.encode("utf-8")
            except UnicodeEncodeError:
                raise BadKey(400, "bad_key", f"key {key!r} is not a valid string (contains a lone surrogate)") from None
            return key, data, (murmur2_bits(data) & 0x7FFFFFFF) % self.partitions
        try:
            parsed = parse_key(self.record.key_format, key_text(key), self.record.key_schema)
        except (KeyFormatError, TypeError) as exc:
            raise BadKey(400, "bad_key", str(exc)) from None
        return parsed.text, parsed.data, partition_for(self.partitioner, parsed.data, self.partitions)


class LocalReplica:
    """The partitions of `stores` (every one, or those `partitions` names per store) held in `data_dir`,
    following the cluster at `zk` (a `HOST:PORT[/chroot]` string or ZkSettings, e.g. with a reader identity).

    Worker processes of one host may share `data_dir`: the first to lock it applies (loads versions, applies
    live topics), the others open the same files read-only; when the applying process ends, however it ends,
    another takes over within `refresh_s`. `fallback="router"` reads keys this replica does not hold
    through the cluster at `router` (a keyroute.client Client; `client_options` are its keyword arguments).
    """

    def __init__(
        self,
        zk: str | ZkSettings,
        stores: Iterable[str],
        data_dir: str | Path,
        *,
        partitions: Mapping[str, Iterable[int]] | None = None,
        fallback: str | None = None,
        router: str | None = None,
        client_options: Mapping[str, Any] | None = None,
        min_offset_wait_s: float = 0.5,
        refresh_s: float = 0.05,
        grace_s: float = 1.0,
        map_size: int = DEFAULT_MAP_SIZE,
        applier_settings: ApplierSettings | None = None,
        registry: CollectorRegistry | None = REGISTRY,
    ) -> None:
        self._zk = zk if isinstance(zk, ZkSettings) else ZkSettings.parse(zk)
        self._stores = tuple(dict.fromkeys(stores))
        if not self._stores:
            raise ValueError("a local replica holds at least one store")
        if fallback not in FALLBACKS:
            raise ValueError(f"fallback is None or 'router', not {fallback!r}")
        if fallback == "router" and not router:
            raise ValueError('fallback="router" needs the router\'s address: router="http://..."')
        self._data_dir = Path(data_dir)
        self._data_dir.mkdir(parents=True, exist_ok=True)
        self._subsets = {name: frozenset(int(p) for p in parts) for name, parts in (partitions or {}).items()}
        self._min_offset_wait_s = min_offset_wait_s
        self._refresh_s = refresh_s
        self._grace_s = grace_s
        self._map_size = map_size
        self._applier_settings = applier_settings or ApplierSettings()
        self._fallback: Client | None = Client(router, **dict(client_options or {})) if fallback and router else None
        self._views: dict[str, _StoreView] = {}
        self._opened: dict[PartitionId, PartitionStore] = {}  # partitions this process opened read-only
        self._lock = ApplyLock(self._data_dir)
        self._holder: Holder | None = None
        self._stamp: tuple[int, int] | None = None
        self._settled = threading.Event()
        self._settled.set()
        self._changed = threading.Condition()
        self._closing = threading.Event()
        self._retiring: list[tuple[float, list[PartitionStore]]] = []
        self._thread = threading.Thread(target=self._run, name="keyroute-local-replica", daemon=True)
        self._collector: Any = None
        self._registry = registry
        self._started = False

    # -- life -------------------------------------------------------------------------------------------

    def start(self) -> LocalReplica:
        if self._started:
            return self
        self._started = True
        if self._lock.try_take():
            self._become_holder()
        else:
            self._follow_view()
        self._thread.start()
        if self._registry is not None:
            from keyroute.local.metrics import register

            self._collector = register(self, self._registry)
        return self

    def __enter__(self) -> LocalReplica:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop reading and applying; the files stay for the next start (or the process that takes over)."""
        if self._closing.is_set():
            return
        self._closing.set()
        if self._thread.is_alive():
            self._thread.join(10)
        if self._collector is not None:
            from keyroute.local.metrics import unregister

            if self._registry is not None:
                unregister(self._collector, self._registry)
        if self._views:
            self._views = {}
            time.sleep(min(self._grace_s, 0.05))  # reads that started on the partitions finish before they close
        holder, self._holder = self._holder, None
        if holder is not None:
            holder.stop()
        for part in self._opened.values():
            part.close()
        self._opened.clear()
        for _, parts in self._retiring:
            for part in parts:
                part.close()
        self._retiring.clear()
        self._lock.release()
        if self._fallback is not None:
            self._fallback.close()

    @property
    def applying(self) -> bool:
        """Whether this process is the one applying (it holds the data directory's lock)."""
        return self._lock.held

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Block until every store is held (at the version the applying process loaded); TimeoutError saying
        which are not, and why when a load failed."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                missing = [name for name in self._stores if name not in self._views]
                if not missing:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    errors = self._holder.errors if self._holder is not None else {}
                    why = "; ".join(f"{name}: {errors[name]}" for name in missing if name in errors)
                    raise TimeoutError(
                        f"store(s) {', '.join(missing)} not held after {timeout_s:.0f}s" + (f" ({why})" if why else "")
                    )
                self._changed.wait(min(left, 0.1))

    def set_partitions(self, store: str, partitions: Iterable[int] | None) -> None:
        """Hold only `partitions` of `store` from now on (None: every partition). The applying process loads
        the new ones before it lets the others go; followed by `keyroute.local.follow_assignment`."""
        if store not in self._stores:
            raise ValueError(f"store {store!r} is not one of this replica's stores: {', '.join(self._stores)}")
        subset = None if partitions is None else frozenset(int(p) for p in partitions)
        if subset is None:
            self._subsets.pop(store, None)
        else:
            self._subsets[store] = subset
        holder = self._holder
        if holder is not None:
            holder.set_subset(store, subset)

    # -- reads ------------------------------------------------------------------------------------------

    def get(
        self, store: str, key: Any, *, min_offset: int | None = None, fields: Iterable[str] | str | None = None
    ) -> Value:
        """The key's value as the cluster would answer it; KeyNotFound, StoreNotFound, BadKey, NotLive, NotHeld
        (or the cluster's answer with a fallback) as the client raises them. A live store's value reflects at
        least `min_offset` (waiting up to `min_offset_wait_s`, then Unavailable not_up_to_bound). `fields`
        ("a,b.c" or a list of them): only those fields of the value, as the client's `get` (BadRequest for
        fields the store lacks)."""
        if fields is None:
            return self._get(store, key, min_offset)
        projection = self._projection(store, fields)
        found = self._get(store, key, min_offset)
        return dataclasses.replace(found, value=projection.project(found.value))

    def _projection(self, store: str, fields: Iterable[str] | str) -> Projection:
        try:
            projection = parse_fields(fields if isinstance(fields, str) else ",".join(fields))
            view = self._views.get(store)
            if view is not None:
                projection.check_record(store, view.record)
        except ApiError as exc:
            raise BadRequest(400, exc.code, exc.message) from None
        return projection

    def _get(self, store: str, key: Any, min_offset: int | None) -> Value:
        view = self._views.get(store)
        if view is None:
            return self._unheld_get(store, key, min_offset)
        text, data, p = view.locate(key)
        part = view.parts[p]
        if part is None:
            return self._not_held(view, key, p, min_offset)
        try:
            if view.timeline is None:
                with part.read_txn() as txn:
                    # bytes: the environment is opened without buffers=True
                    raw = cast("bytes | None", txn.get(TAG_KEY + data if len(data) < _LONG_KEY else db_key(data)))
                    next_offset = txn.get(OFFSET_KEY) if view.live else None
                if raw is not None and view.live:
                    raw = value_bytes(raw)  # without the merge state, as the node answers
            else:
                with part.read_txn() as txn:
                    next_offset = txn.get(OFFSET_KEY) if view.live else None
                raw = part.get(data)
        except (LoadError, lmdb.Error):
            return self._after_swap(store, view, lambda: self._get(store, key, min_offset))
        offset = None
        if view.live:
            offset = -1 if next_offset is None else int(next_offset) - 1
            if min_offset is not None and offset < min_offset:
                return self._wait_bound(store, p, offset, min_offset, lambda: self._get(store, key, min_offset))
        elif min_offset is not None:
            raise _not_live(store)
        if raw is None:
            raise KeyNotFound(404, "key_not_found", f"key {text!r} is not in store {store!r}")
        return Value(store, text, p, view.version, _loads(raw), _NODE, offset)

    def get_many(
        self,
        store: str,
        keys: Iterable[Any],
        *,
        min_offset: int | None = None,
        fields: Iterable[str] | str | None = None,
    ) -> list[Value | KeyrouteError]:
        """One Value or KeyrouteError per key, in order (as the client's get_many). With a fallback, the keys
        not held here go to the cluster in one batch (`min_offset` unset; with it, one read each). `fields`
        as `get`'s."""
        keys = list(keys)
        projection = None if fields is None else self._projection(store, fields)
        found: list[Value | KeyrouteError | None] = [None] * len(keys)
        view = self._views.get(store)
        remote: list[int] = []
        for i, key in enumerate(keys):
            try:
                batched = self._fallback is not None and min_offset is None
                if batched and view is not None and view.parts[view.locate(key)[2]] is None:
                    remote.append(i)
                    continue
                got = self._get(store, key, min_offset)
                found[i] = got if projection is None else dataclasses.replace(got, value=projection.project(got.value))
            except KeyrouteError as exc:
                found[i] = exc
        if remote and self._fallback is not None:
            texts = None if projection is None else projection.text
            remote_keys = [keys[i] for i in remote]
            for i, answer in zip(remote, self._fallback.get_many(store, remote_keys, fields=texts), strict=True):
                found[i] = answer
        return [entry for entry in found if entry is not None]

    def history(
        self,
        store: str,
        key: Any,
        *,
        start: Any = None,
        end: Any = None,
        order: str = "asc",
        page_size: int = 1000,
        min_offset: int | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Every row of a key of a history store with start <= time < end, oldest first (newest with
        order="desc"), as the client's `history` yields them."""
        return self._timeline(HISTORY, store, key, start, end, order, page_size, min_offset)

    def windows(
        self, store: str, key: Any, *, start: Any = None, end: Any = None, page_size: int = 1000
    ) -> Iterator[dict[str, Any]]:
        """The windows of a key of a windowed store that overlap [start, end), as the client's `windows`."""
        return self._timeline(WINDOWS, store, key, start, end, None, page_size, None)

    def range(
        self,
        store: str,
        *,
        from_key: Any = None,
        to_key: Any = None,
        prefix: str | None = None,
        page_size: int = 1000,
    ) -> Iterator[tuple[str, Any]]:
        """(key, value) of the keys in [from_key, to_key) (or starting with `prefix`) in the store's key order,
        as the client's `range`; every partition must be held here (a range spans them all)."""
        view = self._views.get(store)
        if view is None:
            if self._fallback is not None and self._settled.is_set():
                return iter(self._fallback.range(store, from_key=from_key, to_key=to_key, prefix=prefix))
            raise self._store_error(store)
        if (refused := no_key_ranges(store, view.record.key_format)) is not None:
            raise WrongStoreKind(400, "wrong_store_kind", refused)
        if any(part is None for part in view.parts):
            if self._fallback is not None:
                return iter(self._fallback.range(store, from_key=from_key, to_key=to_key, prefix=prefix))
            raise NotHeld(503, "partition_not_held", f"a range of store {store!r} needs every partition held here")
        return _key_range(view, from_key, to_key, prefix, page_size)

    # -- status -----------------------------------------------------------------------------------------

    def status(self) -> dict[str, dict[int, dict[str, Any]]]:
        """store -> partition -> {"version", and for a live store "offset" (the last applied, read from the
        partition itself), "lag_records" and "state" (as the applying process last saw them)}."""
        holder = self._holder
        reported = holder.live_status() if holder is not None else read_status(self._data_dir)
        found: dict[str, dict[int, dict[str, Any]]] = {}
        for name, view in self._views.items():
            rows: dict[int, dict[str, Any]] = {}
            for p, part in enumerate(view.parts):
                if part is None:
                    continue
                row: dict[str, Any] = {"version": view.version}
                if view.live:
                    try:
                        with part.read_txn() as txn:
                            raw = txn.get(OFFSET_KEY)
                        row["offset"] = -1 if raw is None else int(raw) - 1
                    except (LoadError, lmdb.Error):
                        continue
                    seen = reported.get(name, {}).get(str(p), {})
                    row["lag_records"] = (
                        int(seen.get("lag_records", 0)) if seen.get("version") == view.version else None
                    )
                    row["state"] = seen.get("state") if seen.get("version") == view.version else None
                rows[p] = row
            found[name] = rows
        return found

    # -- reads' slow paths ------------------------------------------------------------------------------

    def _store_error(self, store: str) -> KeyrouteError:
        if store in self._stores:
            return NotHeld(503, "partition_not_held", f"store {store!r} is not loaded here yet (wait_ready)", 1.0)
        return StoreNotFound(
            404, "store_not_found", f"store {store!r} is not held by this local replica ({', '.join(self._stores)})"
        )

    def _unheld_get(self, store: str, key: Any, min_offset: int | None) -> Value:
        if not self._settled.is_set() and self._settled.wait(10):
            view = self._views.get(store)
            if view is not None:
                return self._get(store, key, min_offset)
        if self._fallback is not None:
            return self._fallback.get(store, key, min_offset=min_offset)
        raise self._store_error(store)

    def _not_held(self, view: _StoreView, key: Any, partition: int, min_offset: int | None) -> Value:
        if self._fallback is not None:
            return self._fallback.get(view.name, key, min_offset=min_offset)
        raise NotHeld(
            503,
            "partition_not_held",
            f"partition {partition} of store {view.name!r} is not held by this local replica "
            f"(it holds {[p for p, part in enumerate(view.parts) if part is not None]})",
        )

    def _after_swap(self, store: str, view: _StoreView, again: Any) -> Any:
        """A partition closed under a read (this process took over applying, or a swap's grace ran out):
        read again once a new view is in place; Unavailable when none comes (the replica is closing)."""
        if self._views.get(store) is view:
            self._settled.wait(10)
        if self._views.get(store) is view:
            raise Unavailable(503, "partition_unavailable", f"store {store!r} is closed in this local replica", 1.0)
        return again()

    def _wait_bound(self, store: str, partition: int, offset: int, min_offset: int, again: Any) -> Any:
        deadline = time.monotonic() + self._min_offset_wait_s
        while time.monotonic() < deadline:
            time.sleep(0.001)
            view = self._views.get(store)
            part = view.parts[partition] if view is not None else None
            if part is None:
                break
            try:
                with part.read_txn() as txn:
                    raw = txn.get(OFFSET_KEY)
            except (LoadError, lmdb.Error):
                continue
            if raw is not None and int(raw) - 1 >= min_offset:
                return again()
        raise Unavailable(
            503,
            "not_up_to_bound",
            f"partition {partition} of store {store!r} has applied offset {offset}, not yet {min_offset}",
            1.0,
        )

    def _timeline(
        self,
        read: str,
        store: str,
        key: Any,
        start: Any,
        end: Any,
        order: str | None,
        page_size: int,
        min_offset: int | None,
    ) -> Iterator[dict[str, Any]]:
        view = self._views.get(store)
        if view is None or view.parts[view.locate(key)[2]] is None:
            if self._fallback is not None and (view is not None or self._settled.is_set()):
                if read == HISTORY:
                    return iter(
                        self._fallback.history(
                            store, key, start=start, end=end, order=order or "asc", min_offset=min_offset
                        )
                    )
                return iter(self._fallback.windows(store, key, start=start, end=end))
            if view is None:
                raise self._store_error(store)
            self._not_held(view, key, view.locate(key)[2], min_offset)  # raises: no fallback here
            raise AssertionError("unreachable: _not_held raises without a fallback")
        wanted = READ_KINDS[read]
        timeline = view.timeline
        if timeline is None or timeline.kind is not wanted:
            kind = "a store of one value per key" if timeline is None else f"a {timeline.kind.value} store"
            raise WrongStoreKind(
                400, "wrong_store_kind", f"store {store!r} is {kind}: {read} reads are for {wanted.value} stores"
            )
        params = paged_params(start, end, page_size, order)
        try:
            query = parse_query(read, urllib.parse.urlencode(params).encode("ascii"), timeline)
        except QueryError as exc:
            raise BadRequest(400, "bad_request", str(exc)) from None
        text, data, p = view.locate(key)
        part = view.parts[p]
        assert part is not None
        if min_offset is not None:
            if not view.live:
                raise _not_live(store)
            with part.read_txn() as txn:
                raw = txn.get(OFFSET_KEY)
            offset = -1 if raw is None else int(raw) - 1
            if offset < min_offset:
                self._wait_bound(store, p, offset, min_offset, lambda: None)
        return _entries(part, data, query.low, query.high, query.limit, query.descending)

    # -- the view ---------------------------------------------------------------------------------------

    def _become_holder(self) -> None:
        """This process applies from now on: close what it opened read-only (LMDB allows one environment per
        file per process), then reopen it writable, resuming where the files say, and follow the map."""
        resume: dict[str, HeldStore] = {}
        if self._opened:
            self._settled.clear()
            self._views = {}
            time.sleep(min(self._grace_s, 0.2))  # reads that started on the read-only partitions finish
            for part in self._opened.values():
                part.close()
            self._opened.clear()
        found = read_view(self._data_dir)
        if found is not None:
            resume = found[1]
        self._holder = Holder(
            zk_settings=self._zk,
            data_dir=self._data_dir,
            stores=self._stores,
            subsets=self._subsets,
            publish=self._published,
            map_size=self._map_size,
            applier_settings=self._applier_settings,
            grace_s=self._grace_s,
        )
        self._holder.start(resume)
        if not resume:
            self._settled.set()

    def _published(self, held: Mapping[str, HeldStore], parts: Mapping[PartitionId, PartitionStore]) -> None:
        """The holder swapped (on its thread): the new views, in one assignment."""
        by_store: dict[str, dict[int, PartitionStore]] = {}
        for pid, part in parts.items():
            by_store.setdefault(pid.store, {})[pid.partition] = part
        self._swap({name: _StoreView(store, by_store.get(name, {})) for name, store in held.items()})

    def _swap(self, views: dict[str, _StoreView]) -> None:
        with self._changed:
            self._views = views
            self._settled.set()
            self._changed.notify_all()

    def _follow_view(self) -> None:
        """A reading process: open (read-only) what the applying process's view file names, when it changed."""
        stamp = view_stamp(self._data_dir)
        if stamp is None or stamp == self._stamp:
            return
        found = read_view(self._data_dir)
        if found is None:
            return
        opened: dict[PartitionId, PartitionStore] = {}
        views: dict[str, _StoreView] = {}
        for name, held in found[1].items():
            if name not in self._stores:
                continue
            parts: dict[int, PartitionStore] = {}
            for p in held.partitions:
                pid = PartitionId(name, held.version, p)
                part = self._opened.get(pid)
                if part is None:
                    try:
                        part = open_loaded(
                            self._data_dir, pid, self._map_size, live=held.record.live, timeline=held.record.timeline
                        )
                    except LoadError as exc:
                        log.debug("local replica: %s; reading the view again", exc)
                        for fresh in opened.values():
                            if fresh.pid not in self._opened:
                                fresh.close()
                        return  # retired meanwhile: a newer view file follows
                opened[pid] = part
                parts[p] = part
            views[name] = _StoreView(held, parts)
        gone = [part for pid, part in self._opened.items() if pid not in opened]
        self._opened = opened
        self._stamp = stamp
        self._swap(views)
        if gone:
            self._retiring.append((time.monotonic() + self._grace_s, gone))

    def _run(self) -> None:
        while not self._closing.wait(self._refresh_s):
            try:
                if self._holder is None:
                    if self._lock.try_take():
                        log.info(
                            "local replica: the applying process ended; this one (pid %d) applies now", os.getpid()
                        )
                        self._become_holder()
                    else:
                        self._follow_view()
                now = time.monotonic()
                due = [parts for at, parts in self._retiring if at <= now]
                if due:
                    self._retiring = [(at, parts) for at, parts in self._retiring if at > now]
                    for parts in due:
                        for part in parts:
                            part.close()
            except Exception:
                log.exception("the local replica's refresh failed a turn")


def _not_live(store: str) -> NotLive:
    return NotLive(400, "not_live", f"store {store!r} does not follow a topic: min_offset applies to live stores only")


def _entries(
    part: PartitionStore, data: bytes, low: int | None, high: int | None, limit: int, descending: bool
) -> Iterator[dict[str, Any]]:
    after = None
    while True:
        entries, more = part.entries(data, low, high, limit, descending, after)
        for entry in entries:
            yield _loads(entry[2])
        if not more or not entries:
            return
        after = entries[-1][:2]


def _key_range(
    view: _StoreView, from_key: Any, to_key: Any, prefix: str | None, page_size: int
) -> Iterator[tuple[str, Any]]:
    """Every partition's keys of the range, merged in the store's key order (as a router merges the nodes'):
    the query read as a router reads it, each partition scanned as a node scans it (keyroute.storage.ranges)."""
    fmt = view.record.key_format
    given = range_params(from_key, to_key, prefix, page_size)
    try:
        query = parse_range_query(urllib.parse.urlencode(given).encode("ascii"), fmt)
    except RangeKeyError as exc:
        raise BadKey(400, "bad_key", str(exc)) from None
    except RangeQueryError as exc:
        raise BadRequest(400, "bad_request", str(exc)) from None
    low = None if query.low is None else query.low.data
    streams = [_partition_keys(part, fmt, low, query.high, page_size) for part in view.parts if part is not None]
    for _, data, value in heapq.merge(*streams, key=lambda item: item[0]):
        try:
            text = key_from_data(fmt, data).text
        except KeyFormatError:
            continue  # not a key of this store's format: never written by keyroute
        yield text, _loads(value)


def _partition_keys(
    part: PartitionStore, fmt: KeyFormat, low: bytes | None, high: bytes | None, page_size: int
) -> Iterator[tuple[Any, bytes, bytes]]:
    """One partition's (order, serialized key, value) in [low, high), in the store's key order, a page at a
    time as a node answers them."""
    after = None
    while True:
        found: list[tuple[bytes, bytes]] = []
        for start, end in scan_segments(fmt, low, high, after):
            scan_partition(part, fmt, start, end, low, high, after, page_size + 1, found)
            if len(found) > page_size:
                break
        more = len(found) > page_size
        del found[page_size:]
        for data, value in found:
            yield order_of(fmt, data), data, value
        if not more or not found:
            return
        after = found[-1][0]
