"""The assignment in ZooKeeper, a placement record per store, so that no record grows with the whole cluster.

    /placement           the placement root:
                         {"generation": G, "stores": {store: generation of its placement record, ...},
                          "share_records": true}
    /placement/{store}   the store's placement record:
                         {"generation": g, "nodes": [node ids], "replicas": [[index into nodes, ...], ...]}
    /assigned/{node}     the node's share record:
                         {"generation": g, "stores": {store: {"partitions": N, "assigned": [p, ...]}, ...}}

Every generation here is an assignment generation (G the assignment's, g the one a record was written for),
not a map generation. A placement record is not the store record (/stores/{store}, the pipeline's).

The controller writes the placement records that changed first, then the root (last, in a transaction that
checks it still leads): a placement record is written whole, and the root says which generation of each
placement record belongs to the assignment it names. A reader that finds a placement record at another
generation than the root lists is looking at a write in progress; it keeps what it had and reads again when
the root changes (its watch fires). A placement record's size is bounded by the store's own partitions (node
ids are written once), whatever the number of stores.

Each node's share of the assignment (its partitions in every store, and each store's partition count) is
also written to a record of its own by the controller, whose root then says so ("share_records"): a node
reads its own share record rather than every placement record a new assignment rewrote (at 1,000 nodes and 100
stores that is a few KB instead of MBs per node and change). A share record is rewritten only when its
share changes; `g` is the assignment generation it was written for. Share records are written ahead
of the root, with the placement records, and a node takes its record only once the root names generation `g`
or a later one (a record ahead of the root is a write in progress), so a node never acts on a share whose
root is not written, and never sees a root before its share. A node left without a share gets an empty
record, deleted once the root is written. A controller that becomes leader brings every share record in
line with the assignment the root names before it writes anything else, so a predecessor that stopped
between its share records and its root leaves nothing behind.

Before this layout the whole assignment was one record at /assignment (keyroute.cluster.zk_layout.ASSIGNMENT);
it is read when /placement does not exist yet, so the first controller after an upgrade starts from it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Collection, Mapping
from typing import NamedTuple

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from keyroute.cluster import zk_layout
from keyroute.cluster.partition_map import Assignment, RecordError


class InProgress(Exception):
    """The placement records do not match the root: a controller is writing a new assignment."""


class Root(NamedTuple):
    generation: int  # the assignment generation
    stores: dict[str, int]  # store -> the assignment generation its placement record was written for
    share_records: bool  # the controller writes every node's share to /assigned/{node} too


# One node's share of the assignment: store -> (the store's partition count, the node's partitions there).
Share = dict[str, tuple[int, frozenset[int]]]


def placement_record(generation: int, replicas: tuple[tuple[str, ...], ...]) -> bytes:
    """One store's placement record: its replicas, node ids written once each (indexes keep the record
    small). The same JSON as
    json.dumps with compact separators, spelled out: the controller writes a hundred of these per change."""
    nodes = sorted({n for reps in replicas for n in reps})
    index = {n: str(i) for i, n in enumerate(nodes)}
    lists = ",".join("[" + ",".join([index[n] for n in reps]) + "]" for reps in replicas)
    names = ",".join(map(_quoted, nodes))
    return f'{{"generation":{int(generation)},"nodes":[{names}],"replicas":[{lists}]}}'.encode()


def parse_placement_record(raw: bytes) -> tuple[int, tuple[tuple[str, ...], ...]]:
    try:
        obj = json.loads(raw)
        nodes = [str(n) for n in obj["nodes"]]
        replicas = tuple(tuple(nodes[i] for i in reps) for reps in obj["replicas"])
        return int(obj["generation"]), replicas
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise RecordError(f"placement record: {exc!r}") from exc


def root_record(generation: int, stores: Mapping[str, int], *, share_records: bool = True) -> bytes:
    body: dict[str, object] = {"generation": generation, "stores": dict(sorted(stores.items()))}
    if share_records:
        body["share_records"] = True
    return json.dumps(body).encode("utf-8")


def parse_root(raw: bytes) -> Root:
    try:
        obj = json.loads(raw)
        stores = {str(k): int(v) for k, v in dict(obj["stores"]).items()}
        return Root(int(obj["generation"]), stores, obj.get("share_records") is True)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RecordError(f"placement root: {exc!r}") from exc


def share_record(generation: int, share: Share) -> bytes:
    """One node's share; compact JSON spelled out (hundreds of these are written per membership change)."""
    stores = ",".join(
        f'{_quoted(store)}:{{"partitions":{int(count)},"assigned":[{",".join(map(str, sorted(partitions)))}]}}'
        for store, (count, partitions) in sorted(share.items())
    )
    return f'{{"generation":{int(generation)},"stores":{{{stores}}}}}'.encode()


@functools.lru_cache(maxsize=65536)
def _quoted(name: str) -> str:
    return json.dumps(name)


def parse_share_record(raw: bytes) -> tuple[int, Share]:
    try:
        obj = json.loads(raw)
        share: Share = {}
        for store, entry in dict(obj["stores"]).items():
            count = int(entry["partitions"])
            partitions = frozenset(int(p) for p in entry["assigned"])
            if any(p < 0 or p >= count for p in partitions):
                raise ValueError(f"store {store}: a partition outside 0..{count - 1}")
            share[str(store)] = (count, partitions)
        return int(obj["generation"]), share
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RecordError(f"share record: {exc!r}") from exc


def shares(assignment: Assignment) -> dict[str, Share]:
    """Every node's share of `assignment` (nodes without partitions have none)."""
    out: dict[str, Share] = {}
    for store, per_partition in assignment.stores.items():
        count = len(per_partition)
        for node, partitions in _collect(per_partition).items():
            out.setdefault(node, {})[store] = (count, frozenset(partitions))
    return out


def update_shares(before: Assignment, after: Assignment, held: dict[str, Share]) -> set[str]:
    """Turn `held`, the shares of `before`, into those of `after` in place, comparing only what differs (a
    store's replica tuples that are the very same object are skipped); returns the nodes whose share
    changed (a node left without partitions is removed from `held`)."""
    touched: set[str] = set()
    for store in before.stores.keys() | after.stores.keys():
        old = before.stores.get(store, ())
        new = after.stores.get(store, ())
        if old is new:
            continue
        count = len(new)
        if len(old) == count:
            gained: dict[str, list[int]] = {}
            lost: dict[str, list[int]] = {}
            for p, (was, now) in enumerate(zip(old, new, strict=True)):
                if was == now or set(was) == set(now):
                    continue
                for n in set(was).difference(now):
                    lost.setdefault(n, []).append(p)
                for n in set(now).difference(was):
                    gained.setdefault(n, []).append(p)
            for n in gained.keys() | lost.keys():
                _, partitions = held.get(n, {}).get(store, (count, frozenset()))
                _set_share(held, n, store, count, partitions.difference(lost.get(n, ())).union(gained.get(n, ())))
                touched.add(n)
        else:  # the store came, went or changed its partition count: every node in it is rewritten
            collected = _collect(new)
            for n in {n for reps in old for n in reps} | collected.keys():
                _set_share(held, n, store, count, frozenset(collected.get(n, ())))
                touched.add(n)
    return touched


def _collect(per_partition: tuple[tuple[str, ...], ...]) -> dict[str, list[int]]:
    collected: dict[str, list[int]] = {}
    for p, nodes in enumerate(per_partition):
        for n in nodes:
            collected.setdefault(n, []).append(p)
    return collected


def _set_share(held: dict[str, Share], node: str, store: str, count: int, partitions: frozenset[int]) -> None:
    share = held.setdefault(node, {})
    if partitions:
        share[store] = (count, partitions)
    else:
        share.pop(store, None)
        if not share:
            del held[node]


def assemble(root: bytes, records: Mapping[str, bytes | None], only: Collection[str] | None = None) -> Assignment:
    """The assignment the root names (`only`: of these stores alone), from its placement records (raises InProgress
    if one is missing or at another generation, RecordError if one is unreadable)."""
    generation, wanted, _ = parse_root(root)
    stores: dict[str, tuple[tuple[str, ...], ...]] = {}
    for store, record_generation in wanted.items():
        if only is not None and store not in only:
            continue
        raw = records.get(store)
        if raw is None:
            raise InProgress(f"store {store}: no record yet")
        got, replicas = parse_placement_record(raw)
        if got != record_generation:
            raise InProgress(
                f"store {store}: placement record at assignment generation {got}, the root names {record_generation}"
            )
        stores[store] = replicas
    return Assignment(generation, stores)


def read(
    client: KazooClient, *, lenient: bool = False, only: Collection[str] | None = None
) -> tuple[Assignment | None, int, dict[str, int]]:
    """The current assignment, the placement root's znode version (-1: no root yet) and the generation of each
    placement record it names (`only`: the placement records of these stores alone are read). Falls back to
    the single record of the layout before (/assignment) while /placement holds nothing. Raises InProgress
    (unless `lenient`: then each placement record is taken as it is, the controller's view, and the
    generations are the records' own) or RecordError."""
    try:
        root, stat = client.get(zk_layout.PLACEMENT)
    except NoNodeError:
        root, zstat_version = b"", -1
    else:
        zstat_version = stat.version
    if not root:
        try:
            raw, _ = client.get(zk_layout.ASSIGNMENT)
        except NoNodeError:
            return None, zstat_version, {}
        return (Assignment.from_json(raw) if raw else None), zstat_version, {}
    wanted = {s: g for s, g in parse_root(root).stores.items() if only is None or s in only}
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
        # written ahead of it (a controller that stopped between its placement records and its root).
        generation = parse_root(root).generation
        parsed = {s: parse_placement_record(raw) for s, raw in records.items() if raw is not None}
        stores = {s: replicas for s, (_, replicas) in parsed.items()}
        return Assignment(generation, stores), zstat_version, {s: g for s, (g, _) in parsed.items()}
    return assemble(root, records, only), zstat_version, wanted


def read_whole(client: KazooClient, only: Collection[str] | None = None) -> Assignment | None:
    """The whole assignment (`only`: of these stores) for an operator's view (a node follows only its own
    share): the one the root names, or while a new one is being written, its placement records as they are."""
    try:
        return read(client, only=only)[0]
    except InProgress:
        return read(client, lenient=True, only=only)[0]


def changes(
    wanted: Assignment, previous: Assignment | None, previous_generations: Mapping[str, int]
) -> tuple[dict[str, bytes], dict[str, int], list[str]]:
    """What to write for `wanted`: the placement records that changed (store -> record), the generation of
    each placement record the root will name, and the stores whose placement record to delete (no longer
    assigned)."""
    writes: dict[str, bytes] = {}
    generations: dict[str, int] = {}
    for store, replicas in sorted(wanted.stores.items()):
        kept = previous_generations.get(store)
        if previous is not None and kept is not None and previous.stores.get(store) == replicas:
            generations[store] = kept
            continue
        writes[store] = placement_record(wanted.generation, replicas)
        generations[store] = wanted.generation
    gone = sorted(set(previous_generations) - set(wanted.stores))
    return writes, generations, gone
