"""The elected controller: one node at a time turns membership and stores into the assignment.

Runs kazoo's Election recipe on its own thread; while leader it writes every new assignment on a change:
the placement records that changed (/placement/{store}) and the share records that changed
(/assigned/{node}), then the placement root (/placement) that names them (keyroute.cluster.placement_records).
The single /assignment record of the layout before is only read, never written.
Nodes marked leaving in their /nodes record are not assigned anything; a leaving controller writes the
assignment without itself, then resigns so another node takes over. A node away for a planned restart
(/restarting/{node}, keyroute.state_node.restarts) is placed as if it were live until its grace ends: its
partitions stay where they are, and the assignment is recomputed without it when the grace ends.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import KazooException, NoNodeError
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.recipe.election import Election

from keyroute.cluster import placement_records, zk_layout
from keyroute.cluster.colocation import colocation_groups
from keyroute.cluster.partition_map import Assignment, NodeRecord, RecordError, StoreRecord
from keyroute.runtime.collector import without_cyclic_collection
from keyroute.runtime.logs import describe
from keyroute.runtime.wakeup import Wakeup
from keyroute.state_node.placement import StoreShape
from keyroute.state_node.placement.groups import assign_grouped
from keyroute.state_node.restarts import Holds, PlannedRestart, holds

log = logging.getLogger(__name__)

_Parsed = TypeVar("_Parsed")

# Watches push every change; this only bounds how long a lost watch could leave the assignment behind.
SAFETY_RECOMPUTE_S = 30.0
RETRY_AFTER_ERROR_S = 1.0
# The largest transaction of share records written at once.
_TRANSACTION_BYTES = 256 * 1024


class NotLeader(Exception):
    """Our election znode is gone (session expired): another node may already be controller."""


@dataclass(frozen=True, slots=True)
class _KnownAssignment:
    """The assignment in ZooKeeper as this controller last read or wrote it. While the placement root is at
    `root_zstat_version` nobody else wrote one, so the placement records need not be read (and parsed)
    again on every recomputation."""

    root_zstat_version: int  # the placement root's znode version
    assignment: Assignment
    # per store, the assignment generation of its placement record that the root names
    record_generations: dict[str, int]


@dataclass(frozen=True, slots=True)
class _Inputs:
    """What a recomputation placed: the same inputs again give the same assignment."""

    stores: dict[str, StoreShape]
    zones: dict[str, str]  # node -> zone, every assignable node
    root_zstat_version: int  # the placement root's znode version the previous assignment was read at
    # store -> its co-location group (keyroute.state_node.placement.groups), for the stores in one.
    groups: dict[str, str] = field(default_factory=dict)


class Controller:
    """Contends for /controller; while elected, keeps the assignment in /placement equal to
    `assign(stores, nodes, ...)`.

    Writes are fenced: the placement root is written in one transaction with a check that this node's
    election znode still exists (the share records in transactions with the same check), so a controller
    whose session expired can never overwrite its successor.
    """

    def __init__(self, client: KazooClient, node_id: str, *, clock: Callable[[], float] = time.time) -> None:
        self._client = client
        # Unix seconds: restart records carry the time their node began to stop.
        self._clock = clock
        self._node_id = node_id
        self._wake = Wakeup()
        self._lost = threading.Event()
        self._leaving = threading.Event()
        self._leader = False
        self._election: Election | None = None
        self._stale_contenders: list[str] = []
        self._thread = threading.Thread(target=self._run, name="keyroute-controller", daemon=True)
        self.writes = 0  # assignments written while leader (for tests and the admin view)
        self.records_written = 0  # ZooKeeper records those writes took (changed placement records and the root)
        self.bytes_written = 0  # and their bytes (share records included)
        self.resigned = False
        # (store, replication factor, live nodes) already said to be short of nodes.
        self._short_of_nodes: set[tuple[str, int, int]] = set()
        # The assignment as this controller last read or wrote it.
        self._known: _KnownAssignment | None = None
        # Node records as last read (None: not assignable) and the ones whose watch fired since: a change
        # re-reads those, not every node. Emptied (everything read again) when leadership starts and on the
        # safety recomputation.
        self._node_records: dict[str, NodeRecord | None] = {}
        # The inputs of the last recomputation: the same inputs again give the same assignment, so it is not
        # computed again.
        self._computed: _Inputs | None = None
        # Every node's share of the assignment as the /assigned records hold it, and the assignment those
        # shares are of (None: not known, read them all before the next write).
        self._shares: dict[str, placement_records.Share] | None = None
        self._shares_of: Assignment | None = None
        self._nodes_changed: set[str] = set()
        self._nodes_lock = threading.Lock()
        # Store shapes as last read (None: not placeable), and the stores whose record's watch fired since:
        # the same, for /stores/{store}.
        self._store_shapes: dict[str, StoreShape | None] = {}
        self._stores_changed: set[str] = set()
        # Each placeable store's current version, as last read: which of the partitions a node holds on disk
        # are current (the placement prefers those nodes for a replica it must place).
        self._store_versions: dict[str, int] = {}
        # store -> the store it is co-located with (its record's colocate_with), as last read.
        self._store_links: dict[str, str | None] = {}
        # Restart records as last read (None: unreadable), the ones whose watch fired since, and what the last
        # recomputation made of them (nodes held in their assignment, and when the first hold ends).
        self._restart_records: dict[str, PlannedRestart | None] = {}
        self._restarts_changed: set[str] = set()
        self.holds = Holds()

    @property
    def is_leader(self) -> bool:
        return self._leader

    def leave(self) -> None:
        """This node is leaving (its /nodes record already says so): a leader writes one more assignment,
        without this node, then resigns; a contender stops contending. Never blocks."""
        self._leaving.set()
        self._wake.ring()
        election = self._election
        if election is not None and not self._leader:
            election.cancel()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._wake.stop()
        election = self._election
        if election is not None:
            election.cancel()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    # -- election loop -----------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._wake.stopped and not self._leaving.is_set():
            self._remove_stale_contenders()
            election = self._client.Election(zk_layout.CONTROLLER, identifier=self._node_id)
            self._election = election
            if self._wake.stopped or self._leaving.is_set():
                return
            try:
                election.run(self._lead, election)
            except (KazooException, KazooTimeoutError) as exc:  # the timeout is no KazooException
                log.warning("controller election interrupted: %s", describe(exc))
            except Exception:  # the thread must outlive any surprise, or nobody would assign again
                log.exception("controller failed")
            lock = election.lock
            if lock.node is not None:
                # Releasing failed (connection lost at that moment): a contender znode of this still
                # living session would sit ahead of the next one and block it until the session ends.
                self._stale_contenders.append(f"{lock.path}/{lock.node}")
            self._wake.pause(RETRY_AFTER_ERROR_S)
        self._remove_stale_contenders()

    def _remove_stale_contenders(self) -> None:
        for path in list(self._stale_contenders):
            try:
                self._client.delete(path)
            except NoNodeError:
                pass
            except KazooException:
                continue  # still disconnected: try again before the next contention
            self._stale_contenders.remove(path)

    def _lead(self, election: Election) -> None:
        log.info("node %s is now the controller", self._node_id)
        self._leader = True
        self._lost.clear()
        self._wake.ring()
        self._client.add_listener(self._on_state)
        self._node_records, self._store_shapes, self._computed = {}, {}, None
        self._restart_records, self.holds = {}, Holds()
        self._shares, self._shares_of = None, None
        try:
            while not self._wake.stopped and not self._lost.is_set():
                hold_ends = self.holds.next_end
                timeout_s = SAFETY_RECOMPUTE_S
                if hold_ends is not None:
                    # Wake up when a planned restart's grace ends: its node's partitions are reassigned then.
                    timeout_s = min(timeout_s, max(0.0, hold_ends - self._clock()) + 0.05)
                if not self._wake.wait(timeout_s) and (hold_ends is None or self._clock() < hold_ends):
                    # The safety net: read and compute again.
                    self._node_records, self._store_shapes, self._computed = {}, {}, None
                    self._restart_records = {}
                if self._wake.stopped or self._lost.is_set():
                    break
                if self._client.state != KazooState.CONNECTED:
                    continue  # a suspended session may come back; nothing can be written meanwhile
                leaving = self._leaving.is_set()
                try:
                    self._recompute(election)
                except NotLeader:
                    log.warning("node %s lost the controller role", self._node_id)
                    break
                except (KazooException, KazooTimeoutError) as exc:
                    log.warning("recomputing the assignment failed (%s); retrying", describe(exc))
                    self._wake.ring_after(RETRY_AFTER_ERROR_S)
                    continue
                if leaving:
                    # The assignment just written (or found unchanged) no longer places this node.
                    log.info("node %s is leaving: resigning as controller", self._node_id)
                    self.resigned = True
                    break
        finally:
            self._client.remove_listener(self._on_state)
            self._leader = False

    def _on_state(self, state: str) -> bool:
        # kazoo's connection thread: flag only, never block.
        if state == KazooState.LOST:
            self._lost.set()
        self._wake.ring()
        return False

    def _on_change(self, event: Any = None) -> None:
        path = getattr(event, "path", None) or ""
        if path.startswith(zk_layout.NODES + "/"):
            with self._nodes_lock:
                self._nodes_changed.add(path[len(zk_layout.NODES) + 1 :])
        elif path.startswith(zk_layout.STORES + "/"):
            with self._nodes_lock:
                self._stores_changed.add(path[len(zk_layout.STORES) + 1 :])
        elif path.startswith(zk_layout.RESTARTING + "/"):
            with self._nodes_lock:
                self._restarts_changed.add(path[len(zk_layout.RESTARTING) + 1 :])
        self._wake.ring()

    # -- one recomputation -------------------------------------------------------------------------

    def _recompute(self, election: Election) -> None:
        with self._nodes_lock:
            changed, self._nodes_changed = self._nodes_changed, set()
            stores_changed, self._stores_changed = self._stores_changed, set()
            restarts_changed, self._restarts_changed = self._restarts_changed, set()
        # Only the node and store records not known yet or whose watch fired since are read again.
        zones = self.assignable_nodes(changed, restarts_changed)
        nodes = list(zones)
        listed = self._read_changed(
            zk_layout.STORES, zk_layout.store_path, self._store_shapes, stores_changed, self._placeable
        )
        stores = {name: shape for name in listed if (shape := self._store_shapes.get(name)) is not None}

        previous, root_zstat_version, record_generations = self._previous()
        if previous is not None and root_zstat_version >= 0:
            # Share records a predecessor left behind its root (or none, before this layout) are put right
            # first; after that each write of the assignment rewrites only the shares it changed.
            self._write_shares(election, previous, committed=True)
        groups = colocation_groups(self._store_links, list(stores))
        inputs = _Inputs(stores, zones, root_zstat_version, groups)
        if inputs == self._computed:
            return  # a watch that fired for what the last recomputation already saw (or wrote)

        if not nodes:
            # Not even this node's record is visible (session being re-established), or every node is
            # leaving: keep the assignment as it is (leaving nodes serve until they go).
            return
        if previous is not None and self.back_meanwhile(previous, zones):
            self._wake.ring()  # read the nodes again: one came back between the two listings
            return
        self._say_short_of_nodes(stores, len(nodes))
        generation = previous.generation + 1 if previous is not None else 1  # the assignment generation
        with without_cyclic_collection():
            holds_hint = self._holds_hint(stores)
            wanted = assign_grouped(stores, groups, nodes, previous, generation, zones=zones, holds=holds_hint)
        if previous is not None and dict(previous.stores) == dict(wanted.stores):
            self._computed = inputs
            return
        self._write(election, wanted, root_zstat_version, previous, record_generations)
        known = self._known
        if known is not None and known.assignment is wanted:
            self._computed = _Inputs(stores, zones, known.root_zstat_version, groups)
        log.info("assignment generation %d written for %d nodes, %d stores", generation, len(nodes), len(stores))

    def assignable_nodes(self, changed: set[str], restarts_changed: set[str]) -> dict[str, str]:
        """node -> zone of every node to place partitions on: the registered nodes that are not leaving, and the
        nodes away for a planned restart within their grace (a restart record whose grace has ended is deleted
        here). `changed`, `restarts_changed`: the node and restart records to read again (the watches said they
        changed); the others are taken from the last read."""
        nodes_read = self._node_records
        registered = self._read_changed(zk_layout.NODES, zk_layout.node_path, nodes_read, changed, self._assignable)
        zones = {name: record.zone for name in registered if (record := nodes_read.get(name)) is not None}
        # Registered: listed and its record read. A record deleted between the two is a node gone: a restart
        # record may hold it (a node that stops for a restart deletes its record right after its restart
        # record is written, as a new controller lists the nodes).
        present = [name for name in registered if name in nodes_read]
        for name, zone in self._hold(present, restarts_changed).items():
            zones.setdefault(name, zone)  # away for a planned restart: placed as if live until its grace ends
        return zones

    def back_meanwhile(self, previous: Assignment, zones: Mapping[str, str]) -> bool:
        """Whether a node the previous assignment places, neither placed now nor registered when listed, is
        registered now. The nodes are listed before the restart records: a node back from a restart that
        registered after the first listing and deleted its restart record before the second is neither
        registered nor held in what was read, but must not lose its partitions."""
        placed = {m for per in previous.stores.values() for reps in per for m in reps}
        missing = placed - zones.keys() - self._node_records.keys()
        return any(self._client.exists(zk_layout.node_path(m)) is not None for m in sorted(missing))

    def _holds_hint(self, stores: Mapping[str, StoreShape]) -> dict[str, dict[str, tuple[int, ...]]]:
        """store -> node -> partitions of its current version whose files the node had on disk at its start."""
        hint: dict[str, dict[str, tuple[int, ...]]] = {}
        for node, record in self._node_records.items():
            if record is None or not record.holds:
                continue
            for store, version, partitions in record.holds:
                if store in stores and self._store_versions.get(store) == version:
                    hint.setdefault(store, {})[node] = partitions
        return hint

    def _hold(self, registered: list[str], changed: set[str]) -> Mapping[str, str]:
        """The nodes away for a planned restart within their grace (node -> zone); records whose grace ended
        without their node are deleted (that node's partitions are reassigned by this recomputation)."""
        listed = self._read_changed(
            zk_layout.RESTARTING, zk_layout.restarting_path, self._restart_records, changed, self._restart_record
        )
        before = self.holds.held
        now = holds({name: self._restart_records.get(name) for name in listed}, set(registered), self._clock())
        self.holds = now
        for name in sorted(now.held.keys() - before.keys()):
            record = self._restart_records.get(name)
            log.info(
                "node %s is away for a planned restart: its partitions stay assigned to it for up to %.0fs",
                name,
                record.ends_at - self._clock() if record is not None else 0.0,
            )
        for name in now.expired:
            if name in before:
                log.warning(
                    "node %s did not come back within its restart grace: its partitions are reassigned", name
                )
            with contextlib.suppress(NoNodeError):
                self._client.delete(zk_layout.restarting_path(name))
            self._restart_records.pop(name, None)
        return now.held

    @staticmethod
    def _restart_record(name: str, raw: bytes) -> PlannedRestart | None:
        try:
            return PlannedRestart.from_json(raw)
        except RecordError as exc:
            log.warning("ignoring the restart record of node %s: %s", name, describe(exc))
            return None

    def _previous(self) -> tuple[Assignment | None, int, dict[str, int]]:
        """The assignment in ZooKeeper now, the placement root's znode version (-1: none) and the assignment
        generation of each placement record it names."""
        known = self._known
        stat = self._client.exists(zk_layout.PLACEMENT)
        if known is not None and stat is not None and stat.version == known.root_zstat_version:
            return known.assignment, known.root_zstat_version, known.record_generations
        self._known = None
        try:
            # Lenient: placement records a predecessor wrote before it could write the root are as good a
            # starting point as the ones the root names (both were balanced placements).
            previous, root_zstat_version, record_generations = placement_records.read(self._client, lenient=True)
        except RecordError as exc:
            log.warning("replacing an unreadable assignment: %s", describe(exc))
            return None, -1, {}
        if previous is not None and root_zstat_version >= 0:
            self._known = _KnownAssignment(root_zstat_version, previous, record_generations)
        return previous, root_zstat_version, record_generations

    def _say_short_of_nodes(self, stores: Mapping[str, StoreShape], live: int) -> None:
        """A replication factor above the number of live nodes is allowed (each partition gets one replica per
        node until more join), and said once per store and node count."""
        short = {(name, rf, live) for name, (_, rf) in stores.items() if rf > live}
        for name, rf, _ in sorted(short - self._short_of_nodes):
            log.warning(
                "store %s asks for %d replicas of each partition but %d node(s) can take them: each partition "
                "gets %d until more nodes join",
                name,
                rf,
                live,
                live,
            )
        self._short_of_nodes = short

    def _read_changed(
        self,
        parent: str,
        path_of: Callable[[str], str],
        cache: dict[str, _Parsed],
        changed: set[str],
        parse: Callable[[str, bytes], _Parsed],
    ) -> list[str]:
        """The children of `parent` (the listing watched), sorted, with `cache` brought up to date: the records
        not known yet or named in `changed` (their watch fired) read again, pipelined (one round trip rather
        than one per record); each read re-arms its record's watch."""
        zk = self._client
        listed = sorted(zk.get_children(parent, watch=self._on_change))
        for name in cache.keys() - set(listed):
            del cache[name]
        reads = {
            name: zk.get_async(path_of(name), watch=self._on_change)
            for name in listed
            if name not in cache or name in changed
        }
        for name, pending in reads.items():
            try:
                raw, _ = pending.get()
            except NoNodeError:
                cache.pop(name, None)  # gone since the listing (a new one is read when it is listed)
                continue
            cache[name] = parse(name, raw)
        return listed

    def _placeable(self, name: str, raw: bytes) -> StoreShape | None:
        """The store's (partitions, replication factor), or None when it is not to be placed (yet)."""
        if not raw:
            return None  # the pipeline creates the znode before it has a version to publish
        try:
            record = StoreRecord.from_json(raw)
        except RecordError as exc:
            log.warning("ignoring store %s: %s", name, describe(exc))
            return None
        if record.partitions < 1 or record.replication_factor < 1:
            log.warning(
                "ignoring store %s: %d partitions, replication factor %d",
                name,
                record.partitions,
                record.replication_factor,
            )
            return None
        self._store_versions[name] = record.version
        self._store_links[name] = record.colocate_with
        return StoreShape(record.partitions, record.replication_factor)

    @staticmethod
    def _assignable(node_id: str, raw: bytes) -> NodeRecord | None:
        """The node's record, or None when it takes no partitions (leaving)."""
        try:
            record = NodeRecord.from_json(raw)
        except RecordError:
            return NodeRecord(node_id, "")  # an unreadable record still marks a live node (of no known zone)
        return None if record.leaving else record

    def _write(
        self,
        election: Election,
        wanted: Assignment,
        root_zstat_version: int,
        previous: Assignment | None,
        record_generations: Mapping[str, int],
    ) -> None:
        """The placement records that changed, then the root that names them (checked against the election
        and the root's znode version read: a concurrent writer makes this controller read and recompute)."""
        lock = election.lock
        if lock.node is None:
            raise NotLeader()
        writes, named, gone = placement_records.changes(wanted, previous, record_generations)
        zk = self._client
        pending = []
        for store, data in writes.items():
            path = zk_layout.placement_path(store)
            pending.append((path, data, zk.set_async(path, data)))
        # The nodes' shares too, ahead of the root (a node takes a share only once the root has reached its
        # generation), sent while the placement records are on their way; a node left without a share gets an
        # empty record now, deleted once the root is written.
        emptied = self._write_shares(election, wanted, committed=False)
        for path, data, result in pending:
            try:
                result.get()
            except NoNodeError:
                zk.create(path, data, makepath=True)
        # Until the root is written, the records just written belong to no root: if it fails, every record is
        # read and compared next time.
        shares, self._shares, self._shares_of = self._shares, None, None
        root = placement_records.root_record(wanted.generation, named)
        txn = zk.transaction()
        txn.check(f"{lock.path}/{lock.node}", 0)  # the election znode is never modified: version 0
        if root_zstat_version < 0:
            txn.create(zk_layout.PLACEMENT, root)
        else:
            txn.set_data(zk_layout.PLACEMENT, root, version=root_zstat_version)
        results = txn.commit()
        failures = [r for r in results if isinstance(r, Exception)]
        if not failures:
            self.writes += 1
            self.records_written += len(writes) + 1
            self.bytes_written += sum(len(data) for data in writes.values()) + len(root)
            # The root as written: a set returns its new stat, a create made znode version 0.
            written_zstat_version = results[1].version if root_zstat_version >= 0 else 0
            self._known = _KnownAssignment(written_zstat_version, wanted, named)
            for store in gone:  # no longer named by the root: nobody reads them
                with contextlib.suppress(NoNodeError):
                    zk.delete(zk_layout.placement_path(store))
            if emptied:
                self._commit_fenced(election, [("delete", zk_layout.assigned_path(n), b"") for n in emptied])
                self.records_written += len(emptied)
            self._shares, self._shares_of = shares, wanted
            return
        if isinstance(results[0], NoNodeError):
            raise NotLeader()
        # Someone else wrote /placement in between (an operator, or a predecessor's last write):
        # read it again and recompute on top of it.
        self._wake.ring()
        log.info("assignment changed under the controller (%s); recomputing", failures[-1])

    def _write_shares(self, election: Election, assignment: Assignment, *, committed: bool) -> list[str]:
        """Bring the share records (/assigned/{node}) in line with `assignment`: the shares that changed since
        the last call, or after a start (or a failed write) every record read and compared. Written in
        transactions that check this controller still leads. A record carries the assignment generation it
        was written for, and a node takes it once the root names that generation or a later one, so records are
        written ahead of the root they belong to (`committed`: the root already names `assignment`).
        A node left without a share is deleted when `committed`; otherwise it gets an empty record, and the
        nodes returned are to be deleted once the root is written (deleting it first would take the node's
        share away ahead of the root)."""
        if self._shares_of is assignment:
            return []
        zk = self._client
        held, of = self._shares, self._shares_of
        self._shares = self._shares_of = None  # unknown until every write below went through
        if held is None or of is None:
            zk.ensure_path(zk_layout.ASSIGNED)
            names = zk.get_children(zk_layout.ASSIGNED)
            reads = {name: zk.get_async(zk_layout.assigned_path(name)) for name in names}
            written: dict[str, tuple[int, placement_records.Share] | None] = {}
            for name, pending in reads.items():
                try:
                    written[name] = placement_records.parse_share_record(pending.get()[0])
                except NoNodeError:
                    continue
                except RecordError:
                    written[name] = None  # unreadable: rewritten below (or deleted)
            wanted = placement_records.shares(assignment)

            def stale(node: str) -> bool:
                record = written.get(node)
                if record is None or node not in wanted:
                    return True  # unreadable, missing, or one without a share (an empty one left behind)
                # Ahead of this assignment (a predecessor's write that no root followed): a node would wait for
                # a root of that generation.
                return record[1] != wanted[node] or record[0] > assignment.generation

            touched = {n for n in wanted.keys() | written.keys() if stale(n)}
            existing = set(written)
        else:
            existing = set(held)
            touched = placement_records.update_shares(of, assignment, held)
            wanted = held
        ops = []
        emptied = []
        # Nodes without a record yet first (a joining node waits for its share), then by name.
        for node in sorted(touched, key=lambda n: (n in existing, n)):
            path = zk_layout.assigned_path(node)
            share = wanted.get(node)
            if share is None:
                if node not in existing:
                    continue
                if committed:
                    ops.append(("delete", path, b""))
                    continue
                share = {}
                emptied.append(node)
            data = placement_records.share_record(assignment.generation, share)
            ops.append(("set" if node in existing else "create", path, data))
        self._commit_fenced(election, ops)
        self.records_written += len(ops)
        self.bytes_written += sum(len(data) for _, _, data in ops)
        self._shares, self._shares_of = wanted, assignment
        return emptied

    def _commit_fenced(self, election: Election, ops: list[tuple[str, str, bytes]]) -> None:
        """Writes in transactions of at most ~256 KB (far below ZooKeeper's 1 MB request limit), each with a
        check that this controller's election znode still exists, sent together."""
        lock = election.lock
        if lock.node is None:
            raise NotLeader()
        fence = f"{lock.path}/{lock.node}"
        batches: list[list[tuple[str, str, bytes]]] = [[]]
        size = 0
        for op in ops:
            if batches[-1] and size + len(op[2]) > _TRANSACTION_BYTES:
                batches.append([])
                size = 0
            batches[-1].append(op)
            size += len(op[2]) + len(op[1])
        pending = []
        for batch in batches:
            if not batch:
                continue
            txn = self._client.transaction()
            txn.check(fence, 0)
            for kind, path, data in batch:
                if kind == "delete":
                    txn.delete(path)
                elif kind == "create":
                    txn.create(path, data)
                else:
                    txn.set_data(path, data)
            pending.append(txn.commit_async())
        for result in pending:
            results = result.get()
            if isinstance(results[0], NoNodeError):
                raise NotLeader()
            failures = [r for r in results if isinstance(r, Exception)]
            if failures:
                # A record not as this controller thought (changed by someone else): read them all next time.
                raise KazooException(f"writing share records failed: {failures[-1]!r}")
