"""The control plane at scale, on a real ZooKeeper with simulated nodes: record sizes, controller CPU per
membership change, time from a change to every router routing on it, router CPU per change, ZooKeeper writes
per node restart, and a new router's first map.

Simulated nodes are records, not processes: each registers (/nodes/{id}) and announces what it serves
(/serving/{id}) over a few shared ZooKeeper sessions, with no HTTP and no data. The controller is keyroute's
own (`keyroute.state_node.controller.Controller`), and the routers are keyroute's map watchers and routing tables
(what `keyroute router` runs to follow the cluster), in this process.

    .venv/bin/python benchmarks/control_plane.py                       # 100, 300, 1000 nodes
    .venv/bin/python benchmarks/control_plane.py --code OTHER_CHECKOUT # the same harness on other code

--code runs the harness on another checkout of the repository (say, an earlier commit in a `git worktree`),
importing its keyroute instead of this one. --write records the table in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import harness  # benchmarks/harness.py: ports, ZooKeeper, waiting, RESULTS.md

ROOT = Path(__file__).resolve().parents[1]

SIZES = {  # nodes: (stores, partitions per store)
    100: (20, 256),
    300: (50, 512),
    1000: (100, 1000),
}
RF = 3
SESSIONS = 8  # ZooKeeper sessions the simulated nodes share
CHANGES = 5  # node leaves (and joins) measured per size
RESTARTS = 10  # nodes restarted one after the other, for the writes per restart
BURST = 100  # serving records rewritten back to back, for the routers' coalescing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="100,300,1000", help="node counts to run, from: 100, 300, 1000")
    parser.add_argument("--code", type=Path, help="another checkout of the repository to measure")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="give up on a size after this long")
    parser.add_argument("--json", action="store_true", help="print one JSON object per size (used by --code)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.code is not None:
        for line in _run_elsewhere(args.code.resolve(), sizes, args.timeout_s):
            print(line, flush=True)
        return
    if "PYTHONPATH" not in os.environ:
        sys.path.insert(0, str(ROOT))
    import keyroute.state_node

    print(
        f"measuring the keyroute in {Path(keyroute.state_node.__file__).resolve().parent.parent}",
        file=sys.stderr,
    )
    # The measured tree's ZooKeeper server: harness imports it now, after the path is set.
    with (
        tempfile.TemporaryDirectory(prefix="keyroute-control-plane-") as work,
        harness.zookeeper(Path(work), "zk") as server,
    ):
        for n in sizes:
            stores, partitions = SIZES[n]
            result = _measure(server.connect_string, n, stores, partitions, args.timeout_s)
            print(json.dumps(result) if args.json else _describe(result), flush=True)


@contextlib.contextmanager
def _site_of(code: Path) -> Iterator[str]:
    """A directory to put on PYTHONPATH to import the keyroute of `code` (folders mapped as pyproject.toml
    maps them)."""
    with tempfile.TemporaryDirectory(prefix="keyroute-other-code-") as site:
        package = Path(site) / "keyroute"
        package.mkdir()
        for entry in (code / "keyroute").iterdir():
            (package / entry.name).symlink_to(entry)
        setuptools = tomllib.loads((code / "pyproject.toml").read_text()).get("tool", {}).get("setuptools", {})
        for name, folder in setuptools.get("package-dir", {}).items():
            if name.startswith("keyroute.") and not (package / name.split(".", 1)[1]).exists():
                (package / name.split(".", 1)[1]).symlink_to(code / folder)
        yield site


def _run_elsewhere(code: Path, sizes: list[int], timeout_s: float) -> list[str]:
    """This script, importing the keyroute of `code`."""
    with _site_of(code) as site:
        env = {**os.environ, "PYTHONPATH": site}
        script = [sys.executable, str(Path(__file__).resolve()), "--sizes", ",".join(map(str, sizes)), "--json"]
        script += ["--timeout-s", str(timeout_s)]
        done = subprocess.run(script, env=env, capture_output=True, text=True, check=False)
        lines = [_describe(json.loads(line)) for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0:
            lines.append("failed: " + (done.stderr.strip().splitlines() or ["?"])[-1])
        return lines


def _measure(connect: str, n: int, stores_n: int, partitions: int, timeout_s: float) -> dict[str, Any]:
    from kazoo.client import KazooClient

    import keyroute.state_node.controller as controller_module
    from keyroute.cluster import zk_layout
    from keyroute.cluster.map_watcher import MapWatcher
    from keyroute.cluster.partition_map import NodeRecord, PartitionMap, ServingRecord, StoreRecord
    from keyroute.keys.key_format import KeyFormat
    from keyroute.keys.partitioner import Partitioner
    from keyroute.router.routing_table import RoutingTable
    from keyroute.state_node.controller import Controller

    chroot = f"/cp-{uuid.uuid4().hex[:8]}"
    deadline = time.monotonic() + timeout_s
    result: dict[str, Any] = {
        "nodes": n,
        "stores": stores_n,
        "partitions": stores_n * partitions,
        "replicas": stores_n * partitions * RF,
    }

    def client() -> KazooClient:
        c = KazooClient(hosts=connect + chroot, timeout=30.0)
        c.start(timeout=30)
        return c

    boot = KazooClient(hosts=connect, timeout=30.0)
    boot.start(timeout=30)
    boot.ensure_path(chroot)
    boot.stop()
    boot.close()
    admin = client()
    # Every root a cluster has (as keyroute.cluster.zk makes them): a controller that lists one missing (the
    # planned restarts' /restarting) fails each recomputation and never assigns.
    for root in getattr(zk_layout, "PERSISTENT_ROOTS", ("/stores", "/nodes", "/controller", "/serving", "/live")):
        admin.ensure_path(root)
    names = [f"store-{s:03d}" for s in range(stores_n)]
    for name in names:
        record = StoreRecord(
            name, partitions, Partitioner.MURMUR2, KeyFormat.STRING, 1, f"/snap/{name}/v1", ("v",), RF, 1.0
        )
        admin.create(zk_layout.store_path(name), record.to_json(), makepath=True)

    fleet = [client() for _ in range(SESSIONS)]
    node_ids = [f"keyroute-node-{i:04d}" for i in range(n)]
    session_of = {node: fleet[i % SESSIONS] for i, node in enumerate(node_ids)}
    url_of = {node: f"http://{node}.keyroute-node:8080" for node in node_ids}
    zone_of = {node: f"zone-{i % 3}" for i, node in enumerate(node_ids)}

    def register(nodes: list[str]) -> None:
        pending = [
            session_of[m].create_async(
                zk_layout.node_path(m), NodeRecord(m, url_of[m], zone=zone_of[m]).to_json(), ephemeral=True
            )
            if "zone" in NodeRecord.__dataclass_fields__
            else session_of[m].create_async(zk_layout.node_path(m), NodeRecord(m, url_of[m]).to_json(), ephemeral=True)
            for m in nodes
        ]
        for p in pending:
            p.get(timeout=60)

    # The controller's CPU: its recomputations, timed on its own thread.
    recompute_cpu: list[float] = []
    recompute_started: list[float] = []  # wall clock (monotonic) when each recomputation began
    original = Controller._recompute

    def timed_recompute(self: Any, election: Any) -> None:
        recompute_started.append(time.monotonic())
        started = time.thread_time()
        try:
            original(self, election)
        finally:
            recompute_cpu.append(time.thread_time() - started)

    controller_module.Controller._recompute = timed_recompute  # type: ignore[method-assign]

    register(node_ids)
    controller_client = client()
    controller = Controller(controller_client, node_ids[0])

    # Two routers: map watchers on sessions of their own, each building the routing table on every map.
    class Router:
        def __init__(self) -> None:
            self.client = client()
            self.table: RoutingTable | None = None
            self.cpu: list[float] = []
            self.maps = 0
            self.watcher = _TimedWatcher(self.client, self.on_map, self.cpu)

        def on_map(self, new_map: PartitionMap) -> None:
            started = time.thread_time()
            self.table = RoutingTable.of(new_map, self.table)
            self.cpu[-1:] = [(self.cpu[-1] if self.cpu else 0.0) + time.thread_time() - started]
            self.maps += 1

    class _TimedWatcher(MapWatcher):
        def __init__(self, zk: KazooClient, on_map: Any, cpu: list[float]) -> None:
            super().__init__(zk, on_map)
            self._cpu = cpu

        def _read(self) -> PartitionMap:
            started = time.thread_time()
            new_map = super()._read()
            self._cpu.append(time.thread_time() - started)
            return new_map

    def assignment_now() -> Any:
        return routers[0].watcher.current.assignment if routers else None

    routers: list[Router] = []
    nodes_watching: dict[str, Any] = {}
    node_clients: list[KazooClient] = []
    started = time.monotonic()
    controller.start()
    watcher_client = client()
    probe = MapWatcher(watcher_client, lambda _m: None)
    probe.start()

    def wait(predicate: Any, what: str) -> None:
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{n} nodes: {what}")
            time.sleep(0.01)

    def placed_everywhere(m: PartitionMap) -> bool:
        a = m.assignment
        return len(a.stores) == stores_n and all(len(a.stores[s]) == partitions for s in names)

    try:
        wait(lambda: placed_everywhere(probe.current), "a first assignment")
        result["first_assignment_s"] = round(time.monotonic() - started, 2)
        first = probe.current.assignment

        def announce(nodes: list[str], assignment: Any) -> None:
            pending = []
            for m in nodes:
                mine = assignment.partitions_of(m)
                record = ServingRecord(m, url_of[m], {s: dict.fromkeys(sorted(ps), 1) for s, ps in mine.items()})
                path = zk_layout.serving_path(m)
                pending.append((m, record, session_of[m].create_async(path, record.to_json(), ephemeral=True)))
            for m, record, p in pending:
                try:
                    p.get(timeout=60)
                except Exception:  # exists already: this is an update
                    session_of[m].set(zk_layout.serving_path(m), record.to_json())

        announce(node_ids, first)
        result["record_sizes_kb"] = _record_sizes(admin, zk_layout)

        routers.extend([Router(), Router()])
        for r in routers:
            r.watcher.start()
        wait(lambda: all(r.table is not None and r.table.complete for r in routers), "complete routers")
        # Nodes' own map watchers (a node follows its own share of the assignment): those of the nodes that
        # will leave and join, and of one node that stays put (what an ordinary node reads per change).
        changing = [node_ids[1 + i * (n // (CHANGES + 1))] for i in range(CHANGES)]
        bystander = node_ids[2]
        for m in [*changing, bystander]:  # a session each, as nodes have
            node_clients.append(client())
            nodes_watching[m] = _node_watcher(MapWatcher, node_clients[-1], m)
        for w in nodes_watching.values():
            w.start()
        for m, w in nodes_watching.items():
            wait(lambda w=w, m=m: w.current.assignment.partitions_of(m), f"node {m}'s own assignment")
        # A router joining: its first whole read and table.
        joining = Router()
        t0 = time.thread_time()
        first_map = joining.watcher._read()
        RoutingTable.of(first_map)
        result["router_start_cpu_s"] = round(time.thread_time() - t0, 3)

        # One node's serving record changing (one partition's version): what each router does about it.
        for r in routers:
            r.cpu.clear()
        changer = node_ids[-1]
        mine = first.partitions_of(changer)
        store0 = sorted(mine)[0]
        bumped = {s: dict.fromkeys(sorted(ps), 1) for s, ps in mine.items()}
        bumped[store0][min(mine[store0])] = 2
        maps_before = [r.maps for r in routers]
        session_of[changer].set(
            zk_layout.serving_path(changer), ServingRecord(changer, url_of[changer], bumped).to_json()
        )
        wait(lambda: all(r.maps > b for r, b in zip(routers, maps_before, strict=True)), "routers see a serving change")
        time.sleep(0.5)  # let any re-reads triggered by the same change finish
        result["router_cpu_per_serving_change_ms"] = round(statistics.mean(sum(r.cpu) for r in routers) * 1000, 1)

        # A burst: BURST nodes' serving records rewritten back to back (as when many nodes load a new version
        # at once): maps each router built for it (coalesced: fewer than the changes) and its CPU for all of it.
        for r in routers:
            r.cpu.clear()
        maps_before = [r.maps for r in routers]
        burst = [m for m in node_ids if first.partitions_of(m)][:BURST]
        pending = []
        for m in burst:
            mine = first.partitions_of(m)
            record = ServingRecord(m, url_of[m], {s: dict.fromkeys(sorted(ps), 2) for s, ps in mine.items()})
            pending.append(session_of[m].set_async(zk_layout.serving_path(m), record.to_json()))
        for done in pending:
            done.get(timeout=60)

        def burst_seen(r: Router) -> bool:
            served = r.watcher.current.serving
            return all(any(2 in parts.values() for parts in served[m].stores.values()) for m in burst if m in served)

        wait(lambda: all(burst_seen(r) for r in routers), "routers see the burst")
        time.sleep(0.5)
        result["burst_changes"] = len(burst)
        result["burst_maps"] = round(statistics.mean(r.maps - b for r, b in zip(routers, maps_before, strict=True)), 1)
        result["burst_router_cpu_ms"] = round(statistics.mean(sum(r.cpu) for r in routers) * 1000, 1)

        # Nodes leaving and coming back: controller CPU, and time until both routers route on the new map.
        leave_cpu, join_cpu, leave_lag, join_lag, seen_lag, own_lag = [], [], [], [], [], []
        node_kb, router_kb = [], []
        for node in changing:
            for phase in ("leave", "join"):
                generation = assignment_now().generation
                recompute_cpu.clear()
                recompute_started.clear()
                read_before = (_bytes_read(nodes_watching[bystander]), _bytes_read(routers[0].watcher))
                t0 = time.monotonic()
                if phase == "leave":
                    session_of[node].delete(zk_layout.serving_path(node))
                    session_of[node].delete(zk_layout.node_path(node))
                else:
                    register([node])

                def routed(r: Router, generation: int = generation, node: str = node, phase: str = phase) -> bool:
                    m = r.watcher.current
                    if m.assignment.generation <= generation:
                        return False
                    held = any(node in reps for per in m.assignment.stores.values() for reps in per)
                    return held if phase == "join" else not held

                own = nodes_watching[node]

                def own_share(g: int = generation, node: str = node, own: Any = own) -> bool:
                    m = own.current
                    return m.assignment.generation > g and bool(m.assignment.partitions_of(node))

                def bystander_caught_up(g: int = generation) -> bool:
                    return nodes_watching[bystander].current.assignment.generation > g

                waits = {f"router {i}": (lambda r=r: routed(r)) for i, r in enumerate(routers)}
                waits["bystander"] = bystander_caught_up
                if phase == "join":
                    waits["own"] = own_share
                seen = _wait_all(waits, deadline, f"the {phase} of {node}")
                lags = [seen[f"router {i}"] - t0 for i in range(len(routers))]
                (leave_lag if phase == "leave" else join_lag).append(max(lags))
                if phase == "join" and recompute_started:
                    # From the controller starting the recomputation that saw the node (it reads the node
                    # records first) to both routers having its assignment, and to the node's own watcher.
                    seen_lag.append(t0 + max(lags) - recompute_started[0])
                    own_lag.append(seen["own"] - recompute_started[0])
                time.sleep(0.2)  # a recomputation may still be running
                (leave_cpu if phase == "leave" else join_cpu).append(sum(recompute_cpu))
                read_after = (_bytes_read(nodes_watching[bystander]), _bytes_read(routers[0].watcher))
                if None not in read_before + read_after:
                    node_kb.append((read_after[0] - read_before[0]) / 1024)
                    router_kb.append((read_after[1] - read_before[1]) / 1024)
                if phase == "join":
                    announce([node], assignment_now())
        result["controller_cpu_leave_s"] = _median(leave_cpu)
        result["controller_cpu_join_s"] = _median(join_cpu)
        result["routed_after_leave_s"] = _p50_p99(leave_lag)
        result["routed_after_join_s"] = _p50_p99(join_lag)
        result["join_assigned_after_seen_s"] = _p50_p99(seen_lag)
        result["join_own_assignment_after_seen_s"] = _p50_p99(own_lag)
        result["node_kb_read_per_change"] = round(statistics.median(node_kb), 1) if node_kb else "-"
        result["router_kb_read_per_change"] = round(statistics.median(router_kb), 1) if router_kb else "-"

        # Rolling restart of a sample of nodes: ZooKeeper writes per node restarted (records written by the
        # controller, plus the node's own records).
        writes_before = _controller_writes(controller)
        bytes_before = getattr(controller, "bytes_written", None)
        restarted = node_ids[-RESTARTS - 1 : -1]
        t0 = time.monotonic()
        for node in restarted:
            generation = assignment_now().generation
            session_of[node].delete(zk_layout.serving_path(node))
            session_of[node].delete(zk_layout.node_path(node))
            wait(lambda g=generation: assignment_now().generation > g, "assignment after a restart's leave")
            generation = assignment_now().generation
            register([node])
            wait(lambda g=generation: assignment_now().generation > g, "assignment after a restart's join")
            announce([node], assignment_now())
        elapsed = time.monotonic() - t0
        controller_writes = _controller_writes(controller) - writes_before
        own = 4  # per restart: delete serving and node records, create them again
        result["zk_writes_per_restart"] = round(controller_writes / RESTARTS + own, 1)
        if bytes_before is not None:
            result["controller_kb_written_per_restart"] = round(
                (controller.bytes_written - bytes_before) / RESTARTS / 1024, 1
            )
        result["restart_cycle_s"] = round(elapsed / RESTARTS, 2)
    finally:
        controller_module.Controller._recompute = original  # type: ignore[method-assign]
        for r in routers:
            r.watcher.stop()
        probe.stop()
        for w in nodes_watching.values():
            w.stop()
        controller.stop()
        for c in (*fleet, controller_client, watcher_client, admin, *(r.client for r in routers), *node_clients):
            c.stop()
            c.close()
    return result


def _node_watcher(watcher_class: Any, zk: Any, node_id: str) -> Any:
    """A node's map watcher; on code from before share records, a node's watcher read what a router's does."""
    try:
        return watcher_class(zk, lambda _m: None, node_id=node_id)
    except TypeError:
        return watcher_class(zk, lambda _m: None)


def _bytes_read(watcher: Any) -> int | None:
    return getattr(watcher, "bytes_read", None)


def _wait_all(conditions: dict[str, Any], deadline: float, what: str) -> dict[str, float]:
    """Poll every condition until all hold; when each first held (monotonic)."""
    seen: dict[str, float] = {}
    while len(seen) < len(conditions):
        for name, holds in conditions.items():
            if name not in seen and holds():
                seen[name] = time.monotonic()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: still waiting for {sorted(set(conditions) - set(seen))}")
        time.sleep(0.005)
    return seen


def _controller_writes(controller: Any) -> int:
    """Records the controller wrote: per assignment, its store records that changed and the root (or the
    single record of the layout before)."""
    return getattr(controller, "records_written", controller.writes)


def _record_sizes(admin: Any, zk_layout: Any) -> dict[str, float]:
    sizes: dict[str, float] = {}
    placement = getattr(zk_layout, "PLACEMENT", None)
    if placement is not None and admin.exists(placement):
        root, _ = admin.get(placement)
        children = admin.get_children(placement)
        biggest = max((len(admin.get(f"{placement}/{c}")[0]) for c in children), default=0)
        sizes["assignment_root"] = round(len(root) / 1024, 1)
        sizes["assignment_largest"] = round(biggest / 1024, 1)
    if admin.exists(zk_layout.ASSIGNMENT):
        raw, _ = admin.get(zk_layout.ASSIGNMENT)
        if raw:
            sizes["assignment_largest"] = max(sizes.get("assignment_largest", 0), round(len(raw) / 1024, 1))
    assigned = getattr(zk_layout, "ASSIGNED", None)
    if assigned is not None and admin.exists(assigned):
        children = admin.get_children(assigned)
        sizes["node_share_largest"] = round(
            max((len(admin.get(f"{assigned}/{c}")[0]) for c in children), default=0) / 1024, 1
        )
    serving = admin.get_children(zk_layout.SERVING)
    if serving:
        sizes["serving_largest"] = round(max(len(admin.get(f"{zk_layout.SERVING}/{s}")[0]) for s in serving) / 1024, 1)
    return sizes


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 3) if values else float("nan")


def _p50_p99(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return f"{statistics.median(ordered):.2f} / {p99:.2f}"


def _describe(r: dict[str, Any]) -> str:
    return (
        f"{r['nodes']} nodes, {r['stores']} stores, {r['partitions']:,} partitions, {r['replicas']:,} replicas: "
        f"first assignment {r.get('first_assignment_s')} s; records {r.get('record_sizes_kb')} KB; "
        f"controller CPU per leave {r.get('controller_cpu_leave_s')} s, per join {r.get('controller_cpu_join_s')} s; "
        f"routed after a leave (p50/p99) {r.get('routed_after_leave_s')} s, "
        f"after a join {r.get('routed_after_join_s')} s "
        f"({r.get('join_assigned_after_seen_s')} s after the controller saw it; the joining node's own watcher "
        f"{r.get('join_own_assignment_after_seen_s')} s); "
        f"read per membership change: a node {r.get('node_kb_read_per_change')} KB, "
        f"a router {r.get('router_kb_read_per_change')} KB; "
        f"router CPU per serving change {r.get('router_cpu_per_serving_change_ms')} ms; "
        f"a burst of {r.get('burst_changes')} serving changes: {r.get('burst_maps')} maps per router, "
        f"{r.get('burst_router_cpu_ms')} ms CPU; "
        f"new router's first map {r.get('router_start_cpu_s')} s CPU; "
        f"ZooKeeper writes per node restart {r.get('zk_writes_per_restart')} "
        f"({r.get('controller_kb_written_per_restart', '-')} KB by the controller; {r.get('restart_cycle_s')} s each)"
    )


if __name__ == "__main__":
    threading.current_thread().name = "control-plane"
    logging.basicConfig(level=logging.ERROR)  # kazoo's reconnect notes when sessions close at the end
    main()
