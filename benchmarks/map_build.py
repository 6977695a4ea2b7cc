"""PartitionMap.build side by side with the one of another commit, in one process, on the same records:
1,000 nodes, 100 stores x 1,000 partitions, rf 3, every replica serving.

    .venv/bin/python benchmarks/map_build.py [--rev 151b52e] [--rounds 7]

The other commit's keyroute/cluster/partition_map.py is loaded from git as a module of its own (it imports the
rest of keyroute from this checkout); rounds alternate between the two, the median CPU time is reported.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from keyroute.cluster.partition_map import PartitionMap  # noqa: E402
from keyroute.keys.key_format import KeyFormat  # noqa: E402
from keyroute.keys.partitioner import Partitioner  # noqa: E402
from keyroute.state_node.placement import assign  # noqa: E402


def load_other(rev: str):  # type: ignore[no-untyped-def]
    source = subprocess.run(
        ["git", "show", f"{rev}:keyroute/cluster/partition_map.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "partition_map_other.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("partition_map_other", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def records(module, nodes: list[str], stores_n: int, partitions: int):  # type: ignore[no-untyped-def]
    stores = {
        f"store-{s:03d}": module.StoreRecord(
            f"store-{s:03d}", partitions, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/s", ("v",), 3, 1.0
        )
        for s in range(stores_n)
    }
    a = assign({k: (partitions, 3) for k in stores}, nodes, None, 1)
    assignment = module.Assignment(a.generation, a.stores)
    node_records = {n: module.NodeRecord(n, f"http://{n}:8080") for n in nodes}
    serving = {
        n: module.ServingRecord(n, f"http://{n}:8080", {s: dict.fromkeys(sorted(ps), 1) for s, ps in mine.items()})
        for n in nodes
        for mine in [a.partitions_of(n)]
    }
    return stores, node_records, assignment, serving


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", default="151b52e", help="the commit to compare with")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    other = load_other(args.rev)
    nodes = [f"keyroute-node-{i:04d}" for i in range(1000)]
    inputs = {"this checkout": (PartitionMap, records(sys.modules["keyroute.cluster.partition_map"], nodes, 100, 1000))}
    inputs[args.rev] = (other.PartitionMap, records(other, nodes, 100, 1000))
    times: dict[str, list[float]] = {name: [] for name in inputs}
    built = {}
    for _ in range(args.rounds):
        for name, (cls, (stores, node_records, assignment, serving)) in inputs.items():
            started = time.process_time()
            built[name] = cls.build(stores, node_records, assignment, serving, generation=1)
            times[name].append(time.process_time() - started)
    mine, theirs = (built[name] for name in inputs)
    assert all(
        [(e.node_id, e.version) for e in mine.serving_endpoints(s, p)]
        == [(e.node_id, e.version) for e in theirs.serving_endpoints(s, p)]
        for s in mine.stores
        for p in range(1000)
    ), "the two builds route differently"
    for name, values in times.items():
        print(f"{name}: median {statistics.median(values):.3f} s CPU over {args.rounds} rounds")
    a, b = (statistics.median(v) for v in times.values())
    print(f"ratio (this checkout / {args.rev}): {a / b:.2f}")


if __name__ == "__main__":
    main()
