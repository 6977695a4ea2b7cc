"""A small real cluster for request-hardening tests: one store written by hand in the snapshot format (no
Spark), published in ZooKeeper, two `keyroute node` processes and one `keyroute router` process, each a
`tests.harness.Member` (kill, restart, freeze, expire). Started once per module where the tests only read it."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from keyroute.cluster import zk, zk_layout
from keyroute.cluster.partition_map import StoreRecord
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.runtime.settings import ZkSettings
from tests.harness import Member
from tests.integration.test_node import write_snapshot
from tests.util import free_port, wait_for

STORE = "bookings"
PARTITIONS = 4
ROWS: dict[str, dict[str, Any]] = {
    **{f"C{i:03d}": {"customer": i, "fare": round(10 + i * 1.5, 2)} for i in range(40)},
    "a/b": {"slash": True},
    "東京": {"city": "Tokyo"},
    "x y?#%": {"odd": "chars"},
    "..": {"dots": 2},
}
SECRET = "cluster-s3cret"
ADMIN_TOKEN = "admin-t0ken"


def partition(key: str) -> int:
    return partition_for(Partitioner.MURMUR2, key.encode("utf-8"), PARTITIONS)


def key_path(key: str, store: str = STORE) -> str:
    segment = key.replace(".", "%2E") if key in (".", "..") else quote(key, safe="")
    return f"/stores/{store}/keys/{segment}"


def expected(key: str) -> dict[str, Any]:
    return {"store": STORE, "key": key, "partition": partition(key), "version": 1, "value": ROWS[key]}


@dataclass
class SmallCluster:
    router_url: str
    node_urls: dict[str, str]
    procs: list[Member] = field(default_factory=list)
    # With admin ports: "router" and each node id -> the URL of its admin port (empty: admin on the data port).
    admin_urls: dict[str, str] = field(default_factory=dict)
    # What the test's own httpx calls need (TLS: `verify`, an ssl.SSLContext with a client certificate).
    http_options: dict[str, Any] = field(default_factory=dict)

    @property
    def members(self) -> dict[str, Member]:
        """"router" and each node id -> its process."""
        return {proc.name: proc for proc in self.procs}

    @property
    def router(self) -> Member:
        return self.members["router"]

    @property
    def router_admin_url(self) -> str:
        """Where the router answers /admin/* and /metrics."""
        return self.admin_urls.get("router", self.router_url)

    def serving(self) -> dict[int, list[str]]:
        """partition -> node ids serving it, from the router's view (with the admin token if any)."""
        return {p: serving for p, (serving, _) in self.placement().items()}

    def placement(self) -> dict[int, tuple[list[str], list[str]]]:
        """partition -> (node ids serving it, node ids assigned it), from the router's view."""
        options = {name: value for name, value in self.http_options.items() if name != "headers"}
        view = httpx.get(
            self.router_admin_url + "/admin/partition-map?detail=all",
            headers={**self.http_options.get("headers", {}), "authorization": f"Bearer {ADMIN_TOKEN}"},
            timeout=10,
            **options,
        ).json()
        entries = view["stores"][STORE]["partition_map"]
        return {
            p: ([e["node"] for e in entries[p]["serving"]], list(entries[p]["assigned"])) for p in range(PARTITIONS)
        }

    def check_every_key(self, client: httpx.Client) -> None:
        for key in ROWS:
            r = client.get(self.router_url + key_path(key))
            assert r.status_code == 200, (key, r.status_code, r.text)
            assert r.json() == expected(key), key

    def logs(self) -> str:
        return "\n".join(f"----- {' '.join(p.args[:1])} -----\n{p.output()[-4000:]}" for p in self.procs)


@contextmanager
def small_cluster(
    tmp_path: Path,
    zk_settings: ZkSettings,
    *,
    extra_args: Sequence[str] = (),
    router_args: Sequence[str] = (),
    replication_factor: int = 1,
    admin_ports: bool = False,
    own_args: Callable[[str], Sequence[str]] = lambda name: (),
    scheme: str = "http",
    http_options: dict[str, Any] | None = None,
    node_ids: Sequence[str] = ("n1", "n2"),
) -> Iterator[SmallCluster]:
    """Two nodes and a router, all given `extra_args` (say, the cluster secret); yields once every key of
    the store answers through the router and every partition is served as assigned. `admin_ports`: each
    process also gets an --admin-port (`SmallCluster.admin_urls`). `own_args(name)`: what one process ("n1",
    "n2", "router") alone is given (say, its certificate); `scheme` ("https" for TLS) and `http_options`
    (httpx's, for the test's own calls) go with it. `node_ids`: the nodes, two unless given."""
    http_options = http_options or {}
    client = zk.connect(zk_settings)
    snapshot = write_snapshot(tmp_path / "snapshots", STORE, ROWS, KeyFormat.STRING, PARTITIONS)
    record = StoreRecord(
        STORE, PARTITIONS, Partitioner.MURMUR2, KeyFormat.STRING, 1, snapshot, ("v",), replication_factor, 1.0
    )
    try:
        client.create(zk_layout.store_path(STORE), record.to_json(), makepath=True)
    finally:
        # Closed at once: its threads would otherwise run (and draw random numbers) beside the test.
        zk.close(client)
    connect = zk_settings.connect_string
    procs: list[Member] = []
    node_urls: dict[str, str] = {}
    admin_urls: dict[str, str] = {}

    def admin_port(name: str) -> list[str]:
        if not admin_ports:
            return []
        port = free_port()
        admin_urls[name] = f"{scheme}://127.0.0.1:{port}"
        return ["--admin-port", str(port)]

    cluster: SmallCluster | None = None
    try:
        for node_id in node_ids:
            port = free_port()
            args = ["node", "--zk", connect, "--node-id", node_id, "--port", str(port), *admin_port(node_id)]
            args += ["--data-dir", str(tmp_path / f"data-{node_id}"), "--zk-session-timeout-s", "4"]
            args += ["--version-grace-s", "1", "--drain-timeout-s", "5", *extra_args, *own_args(node_id)]
            node_urls[node_id] = f"{scheme}://127.0.0.1:{port}"
            procs.append(Member(node_id, args, tmp_path / f"{node_id}.log", node_urls[node_id]).start())
        port = free_port()
        router = Member(
            "router",
            [
                *("router", "--zk", connect, "--port", str(port), *admin_port("router")),
                *(*extra_args, *router_args, *own_args("router")),
            ],
            tmp_path / "router.log",
            f"{scheme}://127.0.0.1:{port}",
        )
        procs.append(router.start())
        cluster = SmallCluster(router.url, node_urls, procs, admin_urls, http_options)

        def settled() -> bool:
            if httpx.get(cluster.router_url + "/readyz", timeout=5, **http_options).json().get("complete") is not True:
                return False
            placement = cluster.placement()
            # Both nodes serve something, and each partition is served by exactly its assigned replicas (no
            # hand-over left: while the second node is still loading its share, the first one serves the
            # rest, so "one replica each" alone can hold before the placement is final).
            nodes = {n for serving, _ in placement.values() for n in serving}
            return nodes == set(node_urls) and all(
                len(serving) == replication_factor and sorted(serving) == sorted(assigned)
                for serving, assigned in placement.values()
            )

        wait_for(settled, timeout_s=90, interval_s=0.2, message="the cluster to settle")
        with httpx.Client(timeout=10, trust_env=False, **http_options) as http:
            cluster.check_every_key(http)
        yield cluster
    finally:
        for proc in procs:
            proc.stop()
        if cluster is not None:
            print(cluster.logs())  # shown by pytest only when the test failed
