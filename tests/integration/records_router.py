"""A real router process serving a partition map built from records, without ZooKeeper: the map of a large
cluster (1,000 nodes, 100 stores x 1,000 partitions, rf 3, every replica serving: the shape
benchmarks/map_build.py builds) for the
partition-map page's test and benchmarks/map_view.py.

    python -m tests.integration.records_router --port 8080 [--nodes 1000] [--stores 100] [--partitions 1000]
        [--rf 3] [--gone 2] [--loading-store 1] [--node-url http://127.0.0.1:9000]

Every node's URL is `--node-url` when given (one process answering for all of them, for data-path
measurements), else `http://{node}:8080`. `--gone K`: the first K nodes are assigned partitions but neither
registered nor serving (their partitions under-replicated); `--loading-store S`: store S's first 10
partitions are served at an older version only (loading).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

from keyroute.cluster.partition_map import Assignment, NodeRecord, PartitionMap, ServingRecord, StoreRecord
from keyroute.http.server import run
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.router import service
from keyroute.router.app import create_app
from keyroute.runtime.settings import AccessSettings, HttpSettings, RouterSettings


def records_map(
    nodes: int = 1000,
    stores: int = 100,
    partitions: int = 1000,
    rf: int = 3,
    node_url: str | None = None,
    gone: int = 0,
    loading_store: int | None = None,
    generation: int = 1,
) -> PartitionMap:
    node_ids = [f"keyroute-node-{i:04d}" for i in range(nodes)]
    names = [f"store-{s:03d}" for s in range(stores)]
    records = {
        name: StoreRecord(name, partitions, Partitioner.MURMUR2, KeyFormat.STRING, 2, "/s", ("v",), rf, 1.0)
        for name in names
    }
    # Balanced like the controller's placement (replicas per node differ by at most one), but computed in
    # a blink: partition p of store s on nodes s*partitions*rf + p*rf + k, modulo the node count.
    n = len(node_ids)
    a = Assignment(
        1,
        {
            name: tuple(
                tuple(node_ids[(s * partitions * rf + p * rf + k) % n] for k in range(min(rf, n)))
                for p in range(partitions)
            )
            for s, name in enumerate(names)
        },
    )

    def url(n: str) -> str:
        return node_url or f"http://{n}:8080"

    absent = set(node_ids[:gone])
    loading = names[loading_store] if loading_store is not None else None
    serving = {}
    for n in node_ids:
        if n in absent:
            continue
        mine = a.partitions_of(n)
        serving[n] = ServingRecord(
            n,
            url(n),
            {s: {p: 1 if s == loading and p < 10 else 2 for p in sorted(ps)} for s, ps in mine.items()},
        )
    node_records = {n: NodeRecord(n, url(n), zone=f"zone-{i % 3}") for i, n in enumerate(node_ids) if n not in absent}
    return PartitionMap.build(records, node_records, a, serving, generation=generation)


class FixedSource:
    """A MapSource that pushes one map, once."""

    def __init__(self, m: PartitionMap) -> None:
        self.map = m

    def start(self, on_map: Callable[[PartitionMap], None]) -> None:
        on_map(self.map)

    def refresh(self) -> None:
        pass

    def stop(self) -> None:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--stores", type=int, default=100)
    parser.add_argument("--partitions", type=int, default=1000)
    parser.add_argument("--rf", type=int, default=3)
    parser.add_argument("--gone", type=int, default=0)
    parser.add_argument("--loading-store", type=int, default=None)
    parser.add_argument("--node-url", default=None)
    parser.add_argument("--admin-token", default="")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    m = records_map(
        args.nodes, args.stores, args.partitions, args.rf, args.node_url, args.gone, args.loading_store
    )
    settings = RouterSettings(
        http=HttpSettings(port=args.port), access=AccessSettings(admin_token=args.admin_token)
    )
    app = create_app(settings, map_source=FixedSource(m))
    return run(service.server(settings, app), settings.http.host, settings.http.port)


if __name__ == "__main__":
    raise SystemExit(main())
