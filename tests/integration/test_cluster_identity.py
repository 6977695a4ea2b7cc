"""One data directory, one node, one cluster: real `keyroute node` processes against the session's ZooKeeper.

A second process on a running node's data directory, or a node pointed at another cluster's chroot, refuses
to start in one line and deletes nothing; a cluster whose ZooKeeper was wiped serves the same answers again
after `keyroute store adopt`, without the pipeline.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kazoo.client import KazooClient

from keyroute.cluster import zk, zk_layout
from keyroute.cluster.cluster_identity import create_cluster_id, read_cluster_id
from keyroute.cluster.partition_map import StoreRecord
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.runtime.settings import ZkSettings
from keyroute.state_node.data_dir import read_identity
from keyroute.storage.snapshot import version_dir
from tests.integration.small_cluster import PARTITIONS, ROWS, STORE, expected, key_path
from tests.integration.test_node import write_snapshot
from tests.util import Proc, free_port, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def client(zk_settings: ZkSettings) -> Iterator[KazooClient]:
    c = zk.connect(zk_settings)
    yield c
    zk.close(c)


def publish(client: KazooClient, output: Path) -> None:
    """One store written by hand in the snapshot format (no Spark) under `output`, published at version 1."""
    snapshot = write_snapshot(output, STORE, ROWS, KeyFormat.STRING, PARTITIONS)
    record = StoreRecord(STORE, PARTITIONS, Partitioner.MURMUR2, KeyFormat.STRING, 1, snapshot, ("v",), 1, 1.0)
    client.create(zk_layout.store_path(STORE), record.to_json(), makepath=True)


def start_node(zk_settings: ZkSettings, node_id: str, data_dir: Path, log: Path, chroot: str | None = None) -> Proc:
    connect = zk_settings.hosts + (zk_settings.chroot if chroot is None else chroot)
    args = ["node", "--zk", connect, "--node-id", node_id, "--port", str(free_port()), "--data-dir", str(data_dir)]
    args += ["--zk-session-timeout-s", "4", "--version-grace-s", "1", "--drain-timeout-s", "5"]
    return Proc(args, log).start()


def url_of(proc: Proc) -> str:
    return f"http://127.0.0.1:{proc.args[proc.args.index('--port') + 1]}"


def answers(proc: Proc) -> dict[str, Any]:
    """Every key's answer from the node, once it answers every key (it serves every partition alone)."""
    with httpx.Client(timeout=10, trust_env=False) as http:

        def all_served() -> dict[str, Any] | None:
            got = {key: http.get(url_of(proc) + key_path(key)) for key in ROWS}
            if any(r.status_code != 200 for r in got.values()):
                return None
            return {key: r.json() for key, r in got.items()}

        return wait_for(all_served, timeout_s=60, interval_s=0.2, message="the node to answer every key")


def files(data_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(data_dir)): p.stat().st_size for p in sorted(data_dir.rglob("*")) if p.is_file()}


def refused(proc: Proc) -> str:
    """The one error line of a process that must exit 1 at once."""
    assert proc.popen is not None
    code = proc.popen.wait(timeout=60)
    output = proc.output()
    assert code == 1, output
    errors = [line for line in output.splitlines() if " ERROR " in line]
    assert len(errors) == 1, output
    assert "Traceback" not in output, output
    return errors[0]


def test_a_second_process_on_a_running_nodes_data_directory_refuses_and_deletes_nothing(
    zk_settings: ZkSettings, client: KazooClient, tmp_path: Path
) -> None:
    publish(client, tmp_path / "output")
    data = tmp_path / "data"
    first = start_node(zk_settings, "n1", data, tmp_path / "n1.log")
    try:
        before = answers(first)
        held = files(data)
        assert any(name.startswith("stores/") for name in held), held
        second = start_node(zk_settings, "n2", data, tmp_path / "n2.log")
        assert first.popen is not None
        line = refused(second)
        assert line.endswith(
            f"node n2 did not start: data directory {data} is in use by node n1 (pid {first.popen.pid})"
        )
        assert files(data) == held  # not one partition file removed
        assert client.exists(zk_layout.node_path("n2")) is None  # never joined
        assert answers(first) == before and first.alive
    finally:
        first.stop()


def test_a_node_pointed_at_another_clusters_chroot_refuses_to_start_and_keeps_its_files(
    zk_settings: ZkSettings, client: KazooClient, tmp_path: Path
) -> None:
    publish(client, tmp_path / "output")
    data = tmp_path / "data"
    first = start_node(zk_settings, "n1", data, tmp_path / "first.log")
    answers(first)
    first.kill9()  # files stay exactly as a crash leaves them
    ours = read_cluster_id(client)
    assert ours is not None and read_identity(data) == {"node_id": "n1", "cluster_id": ours.id}
    held = files(data)
    other_chroot = zk_settings.chroot + "-other"
    other = zk.connect(ZkSettings(hosts=zk_settings.hosts, chroot=other_chroot))
    try:
        theirs, _ = create_cluster_id(other)
        line = refused(start_node(zk_settings, "n1", data, tmp_path / "again.log", chroot=other_chroot))
        assert (
            f"node n1 did not start: chroot {other_chroot} belongs to cluster {theirs.id} but data directory {data} "
            f"joined cluster {ours.id}"
        ) in line
        assert other.exists(zk_layout.node_path("n1")) is None
    finally:
        zk.close(other)
    assert files(data) == held
    assert read_identity(data)["cluster_id"] == ours.id


def test_store_adopt_brings_a_wiped_cluster_back_to_the_same_answers(
    zk_settings: ZkSettings, client: KazooClient, tmp_path: Path
) -> None:
    output = tmp_path / "output"
    publish(client, output)
    version_dir(str(output), STORE, 2).joinpath("partition=0").mkdir(parents=True)  # a build that died midway
    data = tmp_path / "data"
    node = start_node(zk_settings, "n1", data, tmp_path / "n1.log")
    before = answers(node)
    assert before == {key: expected(key) for key in ROWS}
    cluster_id = read_identity(data)["cluster_id"]
    node.stop()

    root = zk.connect(ZkSettings(hosts=zk_settings.hosts), ensure_layout=False)
    try:
        root.delete(zk_settings.chroot, recursive=True)  # the whole chroot is gone
    finally:
        zk.close(root)
    line = refused(start_node(zk_settings, "n1", data, tmp_path / "wiped.log"))
    assert f"chroot {zk_settings.chroot} has no cluster id but data directory {data} joined cluster" in line
    assert "keyroute store adopt" in line

    adopt = ["store", "adopt", "--zk", zk_settings.connect_string, "--output", str(output)]
    without_id = Proc(adopt, tmp_path / "adopt-refused.log").start()
    assert without_id.popen is not None and without_id.popen.wait(timeout=60) == 1
    assert "has no cluster id: pass --cluster-id" in without_id.output()
    assert client.exists(zk_layout.store_path(STORE)) is None  # nothing written

    adopted = Proc([*adopt, "--cluster-id", cluster_id], tmp_path / "adopt.log").start()
    assert adopted.popen is not None and adopted.popen.wait(timeout=60) == 0, adopted.output()
    lines = [json.loads(line) for line in adopted.output().splitlines() if line.startswith("{")]
    assert lines == [
        {"store": STORE, "action": "published", "version": 1, "retained": [1], "skipped": [lines[0]["skipped"][0]]}
    ]
    assert lines[0]["skipped"][0].startswith("v2: no manifest")
    shown = Proc(["cluster", "id", "--zk", zk_settings.connect_string], tmp_path / "cluster-id.log").start()
    assert shown.popen is not None and shown.popen.wait(timeout=60) == 0, shown.output()
    printed = [json.loads(line) for line in shown.output().splitlines() if line.startswith("{")]
    assert [line["cluster_id"] for line in printed] == [cluster_id]  # the old identity, restored
    replaced = Proc([*adopt, "--new-cluster-id"], tmp_path / "adopt-new-id.log").start()
    assert replaced.popen is not None and replaced.popen.wait(timeout=60) == 1
    assert f"already has cluster id {cluster_id}; nothing was changed" in replaced.output()

    node = start_node(zk_settings, "n1", data, tmp_path / "restored.log")
    try:
        assert answers(node) == before
    finally:
        node.stop()


def tree(client: KazooClient, top: str) -> dict[str, Any]:
    """Every znode under `top` (itself included): its data, ACL and the versions ZooKeeper keeps of each."""
    out: dict[str, Any] = {}
    pending = [top]
    while pending:
        path = pending.pop()
        data, stat = client.get(path)
        acl, _ = client.get_acls(path)
        out[path] = (data, sorted(str(entry) for entry in acl), stat.version, stat.aversion, stat.cversion)
        pending += [f"{path.rstrip('/')}/{child}" for child in client.get_children(path)]
    return out


def test_a_refused_node_leaves_zookeeper_exactly_as_it_found_it(
    zk_settings: ZkSettings, client: KazooClient, tmp_path: Path
) -> None:
    publish(client, tmp_path / "output")
    data = tmp_path / "data"
    first = start_node(zk_settings, "n1", data, tmp_path / "first.log")
    answers(first)
    first.stop()
    ours = read_cluster_id(client)
    assert ours is not None
    root = zk.connect(ZkSettings(hosts=zk_settings.hosts), ensure_layout=False)
    other_chroot = zk_settings.chroot + "-theirs"
    missing_chroot = zk_settings.chroot + "-typo"
    other = zk.connect(ZkSettings(hosts=zk_settings.hosts, chroot=other_chroot))
    try:
        theirs, _ = create_cluster_id(other)
        other.delete(zk_layout.NODES, recursive=True)  # a chroot with only its cluster id: nothing to lock
        before = tree(root, other_chroot)
        line = refused(start_node(zk_settings, "n1", data, tmp_path / "theirs.log", chroot=other_chroot))
        assert f"belongs to cluster {theirs.id} but data directory {data} joined cluster {ours.id}" in line
        assert tree(root, other_chroot) == before  # no root created, no ACL changed, nothing registered

        line = refused(start_node(zk_settings, "n1", data, tmp_path / "typo.log", chroot=missing_chroot))
        assert f"chroot {missing_chroot} has no cluster id but data directory {data} joined cluster" in line
        assert root.exists(missing_chroot) is None  # the mistyped chroot is not created
    finally:
        zk.close(other)
        zk.close(root)
