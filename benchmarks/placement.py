"""The controller's placement alone (`keyroute.state_node.placement.assign`), in-process: CPU per node leaving,
node joining and new store, at 1,000 nodes and 100 stores x 1,000 partitions, rf 3, with and without zones.

    .venv/bin/python benchmarks/placement.py [--rounds 3] [--code OTHER_CHECKOUT]

Each figure is the median of `--rounds` rounds of time.process_time() around one `assign` call, starting from
the assignment the previous step produced (a leave from a fresh placement of every node, a join from that,
a new store added to that). With --code the same script runs on another checkout (say, an earlier commit in
a `git worktree`) right after this one, and both are printed.

What is timed is the controller's entry point: `assign_grouped` (keyroute.state_node.placement.groups) where the
checkout has co-location groups, given no groups for the rows both codes run; `assign` before. Where it has
groups, one more row places the same stores in co-location groups of three (and the new store joins one).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
NODES, STORES, PARTITIONS, RF, ZONES = 1000, 100, 1000, 3, 3


def _assign() -> tuple[Any, bool]:
    """The controller's placement entry of the code measured, as f(shapes, nodes, previous, generation, zones,
    groups), and whether it places co-location groups: `assign_grouped`, or `assign` in checkouts from before
    groups (keyroute.state_node.assignment before the placement package), so that --code can measure them too."""
    try:
        from keyroute.state_node.placement.groups import assign_grouped
    except ImportError:
        try:
            from keyroute.state_node.placement import assign
        except ImportError:
            from keyroute.state_node.assignment import assign  # type: ignore[import-not-found, no-redef]

        def ungrouped(shapes: Any, nodes: Any, previous: Any, generation: int, zones: Any, groups: Any) -> Any:
            return assign(shapes, nodes, previous, generation, zones=zones)

        return ungrouped, False

    def grouped(shapes: Any, nodes: Any, previous: Any, generation: int, zones: Any, groups: Any) -> Any:
        return assign_grouped(shapes, groups, nodes, previous, generation, zones=zones)

    return grouped, True


def measure(rounds: int) -> dict[str, dict[str, float]]:
    assign, has_groups = _assign()

    nodes = [f"node-{i:04d}" for i in range(NODES)]
    shapes = {f"store-{i:03d}": (PARTITIONS, RF) for i in range(STORES)}
    zoned = {n: f"z{i % ZONES}" for i, n in enumerate(nodes)}
    # Co-location groups of three stores (store -> its group's least store, as colocation_groups gives).
    grouped = {name: f"store-{i // 3 * 3:03d}" for i, name in enumerate(shapes) if i // 3 * 3 + 1 < STORES}
    cases: list[tuple[str, Any, dict[str, str]]] = [("no zones", None, {}), (f"{ZONES} zones", zoned, {})]
    if has_groups:
        cases.append((f"{ZONES} zones, co-located in groups of 3", zoned, grouped))
    out: dict[str, dict[str, float]] = {}
    for label, zones, groups in cases:
        fresh = assign(shapes, nodes, None, 1, zones, groups)
        gone = nodes[NODES // 2]
        left = [n for n in nodes if n != gone]
        with_new = {**shapes, "store-new": (PARTITIONS, RF)}
        groups_new = {**groups, "store-new": "store-000"} if groups else groups
        times: dict[str, list[float]] = {"leave": [], "join": [], "new store": []}
        for _ in range(rounds):
            t0 = time.process_time()
            after_leave = assign(shapes, left, fresh, 2, zones, groups)
            t1 = time.process_time()
            after_join = assign(shapes, nodes, after_leave, 3, zones, groups)
            t2 = time.process_time()
            assign(with_new, nodes, after_join, 4, zones, groups_new)
            t3 = time.process_time()
            times["leave"].append(t1 - t0)
            times["join"].append(t2 - t1)
            times["new store"].append(t3 - t2)
        out[label] = {step: round(statistics.median(values), 3) for step, values in times.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--code", type=Path, help="another checkout of the repository to measure as well")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.json:
        import keyroute.state_node

        code = Path(keyroute.state_node.__file__).resolve().parents[1].name  # the checkout measured
        print(json.dumps({"code": code, **measure(args.rounds)}))
        return
    sys.path.insert(0, str(ROOT))
    print(f"this checkout: {measure(args.rounds)}", flush=True)
    if args.code is not None:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from control_plane import _site_of  # noqa: PLC0415 (only with --code)

        with _site_of(args.code.resolve()) as site:
            script = [sys.executable, str(Path(__file__).resolve()), "--rounds", str(args.rounds), "--json"]
            env = {**os.environ, "PYTHONPATH": site}
            done = subprocess.run(script, env=env, capture_output=True, text=True, check=False)
            print(f"{args.code.name}: {done.stdout.strip() or done.stderr.strip().splitlines()[-1:]}")


if __name__ == "__main__":
    main()
