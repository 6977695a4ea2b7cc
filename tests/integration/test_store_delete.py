"""Absence is not deletion: a store disappears only by `keyroute store delete` (a tombstone), never because its
record vanished from ZooKeeper. Real ZooKeeper, real node and router processes (tests.integration.small_cluster).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError, NotEmptyError

from keyroute.cluster import zk, zk_layout
from keyroute.replica.store import PartitionId, partition_path
from keyroute.runtime.settings import ZkSettings
from keyroute.storage.snapshot import version_dir
from tests.integration.small_cluster import PARTITIONS, ROWS, STORE, SmallCluster, expected, key_path, small_cluster
from tests.util import wait_for

pytestmark = pytest.mark.integration

NODES = ("n1", "n2")
ORPHANED_SAID = "has no tombstone"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "keyroute", *args], capture_output=True, text=True, timeout=60, check=False
    )


def files(tmp_path: Path) -> list[Path]:
    """Every partition directory of the store, on both nodes (rf 2: each holds every partition)."""
    return [
        partition_path(tmp_path / f"data-{node}", PartitionId(STORE, 1, p)) for node in NODES for p in range(PARTITIONS)
    ]


def every_key_answers(cluster: SmallCluster, http: httpx.Client) -> None:
    """Through the router, and through each node directly."""
    cluster.check_every_key(http)
    for node, url in cluster.node_urls.items():
        for key in ROWS:
            r = http.get(url + key_path(key))
            assert r.status_code == 200 and r.json()["value"] == expected(key)["value"], (node, key, r.text)


def wipe(zk_settings: ZkSettings) -> None:
    """`deleteall` of the cluster's chroot (the nodes re-create their ephemeral records meanwhile: retried)."""
    root = KazooClient(hosts=zk_settings.hosts)
    root.start(timeout=10)

    def deleted() -> bool:
        try:
            root.delete(zk_settings.chroot, recursive=True)
        except NotEmptyError:
            return False
        except NoNodeError:
            pass
        return True

    try:
        wait_for(deleted, timeout_s=30, message="the chroot deleted")
    finally:
        root.stop()
        root.close()


def test_a_vanished_store_record_deletes_nothing_and_store_delete_deletes_everywhere(
    tmp_path: Path, zk_settings: ZkSettings
) -> None:
    connect = zk_settings.connect_string
    with (
        small_cluster(tmp_path, zk_settings, replication_factor=2) as cluster,
        httpx.Client(timeout=10, trust_env=False) as http,
    ):
        held = files(tmp_path)
        assert all(path.is_dir() for path in held)
        admin = zk.connect(zk_settings)
        try:
            # (a) The store's record is deleted without a tombstone (an operator's `deleteall` on the wrong
            # path, a ZooKeeper restored from an old backup). The controller drops it from the assignment.
            raw_record, _ = admin.get(zk_layout.store_path(STORE))
            admin.delete(zk_layout.store_path(STORE))
            wait_for(
                lambda: admin.exists(zk_layout.placement_path(STORE)) is None,
                message="the controller to drop the store from the assignment",
            )

            def degraded(node: str) -> list[str]:
                body = http.get(cluster.node_urls[node] + "/readyz").json()
                return [line for line in body["degraded"] if STORE in line]

            for node in NODES:
                wait_for(lambda node=node: degraded(node), message=f"{node} to say it is degraded")
            every_key_answers(cluster, http)
            assert all(path.is_dir() for path in held)
            for node, url in cluster.node_urls.items():
                r = http.get(url + "/readyz")
                assert r.status_code == 200 and "without a tombstone" in r.json()["degraded"][0], r.text
                metrics = http.get(url + "/metrics").text
                assert f"keyroute_node_orphaned_partitions {PARTITIONS}" in metrics, node

            # Then the whole chroot is wiped and re-created empty: still nothing is deleted.
            zk.close(admin)
            wipe(zk_settings)
            admin = zk.connect(zk_settings)
            wait_for(
                lambda: sorted(admin.get_children(zk_layout.SERVING)) == list(NODES),
                message="the nodes registered again in the re-created chroot",
            )
            wait_for(lambda: every_key_answers(cluster, http) is None, timeout_s=30, message="every key to answer")
            assert all(path.is_dir() for path in held)
            for node, proc in zip(NODES, cluster.procs, strict=False):
                assert degraded(node), node
                said = [line for line in proc.output().splitlines() if ORPHANED_SAID in line]
                assert len(said) == 1, (node, said)  # why, once
                assert "removing leftover" not in proc.output()

            # The record comes back (as `keyroute store adopt` or a publish would bring it): served from the
            # files the nodes kept, and no longer degraded.
            admin.create(zk_layout.store_path(STORE), raw_record)
            for node in NODES:
                wait_for(lambda node=node: not degraded(node), message=f"{node} no longer degraded")
            every_key_answers(cluster, http)

            # (c) `keyroute store delete`: the tombstone makes every node drop the store and its files.
            done = cli("store", "delete", "--zk", connect, "--store", STORE)
            assert done.returncode == 0, done.stderr
            tombstone = json.loads(done.stdout)
            assert tombstone["store"] == STORE and tombstone["versions"] == [1]
            assert admin.exists(zk_layout.store_path(STORE)) is None
            assert json.loads(admin.get(zk_layout.deleted_path(STORE))[0])["version"] == 1
            wait_for(lambda: not any(path.exists() for path in held), message="every node to delete the files")
            for url in (cluster.router_url, *cluster.node_urls.values()):
                r = wait_for(
                    lambda url=url: (r := http.get(url + key_path("C001"))).status_code == 404 and r,
                    message=f"{url} to answer 404",
                )
                assert r.json()["error"] == "store_not_found", r.text
            for url in cluster.node_urls.values():
                assert http.get(url + "/readyz").json()["degraded"] == []

            # Refused with one line, nothing changed: a store that is not published (any more).
            again = cli("store", "delete", "--zk", connect, "--store", STORE)
            assert again.returncode == 1 and again.stderr.count("\n") == 1 and "no such store" in again.stderr
        finally:
            zk.close(admin)


def test_publishing_a_deleted_store_again_removes_its_tombstone(tmp_path: Path, zk_settings: ZkSettings) -> None:
    from tests.integration.test_rollback import STORE as PRICES
    from tests.integration.test_rollback import publish_version, record

    client = zk.connect(zk_settings)
    try:
        publish_version(client, tmp_path, 1)
        publish_version(client, tmp_path, 2)
        done = cli("store", "delete", "--zk", zk_settings.connect_string, "--store", PRICES)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["versions"] == [1, 2]
        assert client.exists(zk_layout.store_path(PRICES)) is None
        assert client.exists(zk_layout.deleted_path(PRICES)) is not None
        # Its snapshots stay in the output location; a new version brings the store back without a tombstone.
        assert version_dir(str(tmp_path), PRICES, 2).is_dir()
        assert publish_version(client, tmp_path, 3).version == 3
        assert client.exists(zk_layout.deleted_path(PRICES)) is None
        # A record restored by hand beside an old tombstone: deleting it again writes a new tombstone.
        again = cli("store", "delete", "--zk", zk_settings.connect_string, "--store", PRICES)
        assert again.returncode == 0 and json.loads(again.stdout)["versions"] == [3], again.stderr
        client.create(zk_layout.store_path(PRICES), record(4).to_json())
        third = cli("store", "delete", "--zk", zk_settings.connect_string, "--store", PRICES)
        assert third.returncode == 0 and json.loads(third.stdout)["version"] == 4, third.stderr
        assert json.loads(client.get(zk_layout.deleted_path(PRICES))[0])["version"] == 4
        unknown = cli("store", "delete", "--zk", zk_settings.connect_string, "--store", "nope")
        assert unknown.returncode == 1 and unknown.stderr.count("\n") == 1 and "no such store" in unknown.stderr
    finally:
        zk.close(client)
