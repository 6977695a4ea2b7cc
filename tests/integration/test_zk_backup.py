"""`keyroute zk dump` and `keyroute zk restore` against the session's ZooKeeper and a real `keyroute node`: a cluster
whose chroot was wiped serves the same answers again from a dump, and a restore never writes over another
cluster's chroot."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient

from keyroute.cluster import zk, zk_layout
from keyroute.cluster.cluster_identity import create_cluster_id, read_cluster_id
from keyroute.runtime.settings import ZkSettings
from keyroute.state_node.data_dir import read_identity
from tests.integration.small_cluster import STORE
from tests.integration.test_cluster_identity import answers, publish, start_node

pytestmark = pytest.mark.integration


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "keyroute", *args], capture_output=True, text=True, timeout=60, check=False
    )


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 1, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def znodes(path: Path) -> dict[str, Any]:
    """path -> the entry's data (text or base64) of a dump file."""
    doc = json.loads(path.read_text())
    return {z["path"]: z.get("text", z.get("base64")) for z in doc["znodes"]}


def wipe(zk_settings: ZkSettings) -> None:
    root = zk.connect(ZkSettings(hosts=zk_settings.hosts), ensure_layout=False)
    try:
        root.delete(zk_settings.chroot, recursive=True)
    finally:
        zk.close(root)


def test_a_wiped_cluster_serves_the_same_answers_after_zk_restore(
    zk_settings: ZkSettings, tmp_path: Path
) -> None:
    client: KazooClient = zk.connect(zk_settings)
    try:
        publish(client, tmp_path / "output")
    finally:
        zk.close(client)
    data = tmp_path / "data"
    node = start_node(zk_settings, "n1", data, tmp_path / "n1.log")
    connect = zk_settings.connect_string
    dump_file = tmp_path / "backup.json"
    try:
        before = answers(node)
        # Dumped while the node runs: its registration, serving record and election entry are left out.
        dumped = cli("zk", "dump", "--zk", connect, "--out", str(dump_file))
        assert dumped.returncode == 0, dumped.stderr
    finally:
        node.stop()
    cluster_id = read_identity(data)["cluster_id"]
    doc = json.loads(dump_file.read_text())
    assert doc["format"] == "keyroute-zk-dump" and doc["cluster_id"] == cluster_id
    assert doc["chroot"] == zk_settings.chroot
    paths = [z["path"] for z in doc["znodes"]]
    assert paths == sorted(paths)
    saved = znodes(dump_file)
    for path in (zk_layout.CLUSTER, zk_layout.store_path(STORE), zk_layout.placement_path(STORE), "/assigned/n1"):
        assert path in saved, (path, paths)
    assert json.loads(saved[zk_layout.CLUSTER])["id"] == cluster_id
    for ephemeral in ("/nodes/n1", "/serving/n1"):
        assert ephemeral not in saved
    assert not [p for p in paths if p.startswith(zk_layout.CONTROLLER + "/")]  # the election's entries
    assert json.loads(dumped.stdout) == {
        "chroot": zk_settings.chroot,
        "cluster_id": cluster_id,
        "znodes": len(paths),
        "out": str(dump_file),
    }

    wipe(zk_settings)
    restored = cli("zk", "restore", "--zk", connect, "--in", str(dump_file))
    assert restored.returncode == 0, restored.stderr
    summary = json.loads(restored.stdout)
    assert summary["cluster_id"] == cluster_id and summary["created"] > 0
    # Everything dumped is back as it was (a dump of the restored chroot, to stdout, holds the same records).
    again = cli("zk", "dump", "--zk", connect, "--out", "-")
    assert again.returncode == 0, again.stderr
    assert {z["path"]: z.get("text", z.get("base64")) for z in json.loads(again.stdout)["znodes"]} == saved
    assert json.loads(again.stderr.strip().splitlines()[-1])["cluster_id"] == cluster_id

    # A second restore over the same cluster needs --force; over another cluster it is refused even then.
    line = one_line_error(cli("zk", "restore", "--zk", connect, "--in", str(dump_file)))
    assert f"already holds cluster {cluster_id}" in line and "--force" in line
    forced = cli("zk", "restore", "--zk", connect, "--in", str(dump_file), "--force")
    assert forced.returncode == 0, forced.stderr
    assert json.loads(forced.stdout)["created"] == 0
    other = ZkSettings(hosts=zk_settings.hosts, chroot=f"/t-{uuid.uuid4().hex[:12]}")
    other_client = zk.connect(other)
    try:
        other_id, _ = create_cluster_id(other_client)
        line = one_line_error(cli("zk", "restore", "--zk", other.connect_string, "--in", str(dump_file), "--force"))
        assert f"belongs to cluster {other_id.id}, the dump to cluster {cluster_id}" in line
        assert other_client.exists(zk_layout.store_path(STORE)) is None  # nothing written
        assert read_cluster_id(other_client) == other_id
    finally:
        zk.close(other_client)

    node = start_node(zk_settings, "n1", data, tmp_path / "restored.log")
    try:
        assert answers(node) == before
    finally:
        node.stop()
