"""The assignment in ZooKeeper, one record per store, so that no record grows with the whole cluster.

    /placement           {"generation": G, "stores": {store: generation of its record, ...}}
    /placement/{store}   {"generation": g, "nodes": [node ids], "replicas": [[index into nodes, ...], ...]}

The controller writes the store records that changed first, then the root (last, in a transaction that
checks it still leads): a store record is written whole, and the root says which generation of each store
record belongs to the assignment it names. A reader that finds a store record at another generation than
the root lists is looking at a write in progress; it keeps what it had and reads again when the root
changes (its watch fires). A store record's size is bounded by the store's own partitions (node ids are
written once), whatever the number of stores.

Before this layout the whole assignment was one record at /assignment (keyroute.core.zk_layout.ASSIGNMENT);
it is read when /placement does not exist yet, so the first controller after an upgrade starts from it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from keyroute.core import zk_layout
from keyroute.core.partition_map import Assignment, RecordError


class InProgress(Exception):
    """The store records do not match the root: a controller is writing a new assignment."""


def store_record(generation: int, replicas: tuple[tuple[str, ...], ...]) -> bytes:
    """One store's replicas, node ids written once each (indexes keep the record small)."""
    nodes = sorted({n for reps in replicas for n in reps})
    index = {n: i for i, n in enumerate(nodes)}
    body = {"generation": generation, "nodes": nodes, "replicas": [[index[n] for n in reps] for reps in replicas]}
    return json.dumps(body, separators=(",", ":")).encode("utf-8")


def parse_store_record(raw: bytes) -> tuple[int, tuple[tuple[str, ...], ...]]:
    try:
        obj = json.loads(raw)
        nodes = [str(n) for n in obj["nodes"]]
        replicas = tuple(tuple(nodes[i] for i in reps) for reps in obj["replicas"])
        return int(obj["generation"]), replicas
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise RecordError(f"placement record: {exc!r}") from exc


def root_record(generation: int, stores: Mapping[str, int]) -> bytes:
    return json.dumps({"generation": generation, "stores": dict(sorted(stores.items()))}).encode("utf-8")


def parse_root(raw: bytes) -> tuple[int, dict[str, int]]:
    try:
        obj = json.loads(raw)
        return int(obj["generation"]), {str(k): int(v) for k, v in dict(obj["stores"]).items()}
    except (ValueError, KeyError, TypeError) as exc:
        raise RecordError(f"placement root: {exc!r}") from exc


def assemble(root: bytes, records: Mapping[str, bytes | None]) -> Assignment:
    """The assignment the root names, from its store records (raises InProgress if one is missing or at
    another generation, RecordError if one is unreadable)."""
    generation, wanted = parse_root(root)
    stores: dict[str, tuple[tuple[str, ...], ...]] = {}
    for store, store_generation in wanted.items():
        raw = records.get(store)
        if raw is None:
            raise InProgress(f"store {store}: no record yet")
        got, replicas = parse_store_record(raw)
        if got != store_generation:
            raise InProgress(f"store {store}: record at generation {got}, the root names {store_generation}")
        stores[store] = replicas
    return Assignment(generation, stores)


def read(client: KazooClient, *, lenient: bool = False) -> tuple[Assignment | None, int, dict[str, int]]:
    """The current assignment, the root's version (-1: no root yet) and the store generations it names.
    Falls back to the single record of the layout before (/assignment) while /placement holds nothing.
    Raises InProgress (unless `lenient`: then each store record is taken as it is, the controller's view,
    and the generations are the records' own) or RecordError."""
    try:
        root, stat = client.get(zk_layout.PLACEMENT)
    except NoNodeError:
        root, version = b"", -1
    else:
        version = stat.version
    if not root:
        try:
            raw, _ = client.get(zk_layout.ASSIGNMENT)
        except NoNodeError:
            return None, version, {}
        return (Assignment.from_json(raw) if raw else None), version, {}
    _, wanted = parse_root(root)
    pending = {store: client.get_async(zk_layout.placement_path(store)) for store in wanted}
    records: dict[str, bytes | None] = {}
    for store, result in pending.items():
        try:
            records[store] = result.get()[0]
        except NoNodeError:
            records[store] = None
    if lenient:
        # Each record as it is, with its own generation: a root written on top of this assignment must name
        # the generation of a record it keeps, which is not the one the old root names when the record was
        # written ahead of it (a controller that stopped between its store records and its root).
        generation, _ = parse_root(root)
        parsed = {s: parse_store_record(raw) for s, raw in records.items() if raw is not None}
        stores = {s: replicas for s, (_, replicas) in parsed.items()}
        return Assignment(generation, stores), version, {s: g for s, (g, _) in parsed.items()}
    return assemble(root, records), version, wanted


def changes(
    wanted: Assignment, previous: Assignment | None, previous_generations: Mapping[str, int]
) -> tuple[dict[str, bytes], dict[str, int], list[str]]:
    """What to write for `wanted`: the store records that changed (store -> record), the store
    generations the root will name, and the stores to delete (no longer assigned)."""
    writes: dict[str, bytes] = {}
    generations: dict[str, int] = {}
    for store, replicas in sorted(wanted.stores.items()):
        kept = previous_generations.get(store)
        if previous is not None and kept is not None and previous.stores.get(store) == replicas:
            generations[store] = kept
            continue
        writes[store] = store_record(wanted.generation, replicas)
        generations[store] = wanted.generation
    gone = sorted(set(previous_generations) - set(wanted.stores))
    return writes, generations, gone
