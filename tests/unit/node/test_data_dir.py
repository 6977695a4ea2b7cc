"""One data directory, one node: the lock on it, the node id and cluster id it records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kazoo.exceptions import NodeExistsError, NoNodeError

from keyroute.cluster import zk_layout
from keyroute.cluster.cluster_identity import ClusterId
from keyroute.state_node.data_dir import IDENTITY_FILE, LOCK_FILE, DataDir, DataDirError, read_identity


class FakeZk:
    """The two calls the cluster identity makes, on a dict of paths."""

    def __init__(self) -> None:
        self.nodes: dict[str, bytes] = {}

    def get(self, path: str) -> tuple[bytes, Any]:
        if path not in self.nodes:
            raise NoNodeError(path)
        return self.nodes[path], None

    def create(self, path: str, data: bytes, makepath: bool = False) -> str:
        if path in self.nodes:
            raise NodeExistsError(path)
        self.nodes[path] = data
        return path


def files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_second_holder_is_refused_with_the_first_ones_node_id_and_pid(tmp_path: Path) -> None:
    first = DataDir.open(tmp_path, "n1")
    (tmp_path / "stores").mkdir()
    (tmp_path / "stores" / "kept").write_bytes(b"data")
    before = files(tmp_path)
    with pytest.raises(DataDirError) as refused:
        DataDir.open(tmp_path, "n2")
    assert str(refused.value) == f"data directory {tmp_path} is in use by node n1 (pid {os.getpid()})"
    assert files(tmp_path) == before  # nothing written, nothing removed
    first.close()
    DataDir.open(tmp_path, "n1").close()  # free again once released


def test_the_lock_goes_with_the_process_that_held_it(tmp_path: Path) -> None:
    # The holder keeps the lock until it is killed: it blocks reading its input, which never ends.
    holder = (
        "import sys; from pathlib import Path; from keyroute.state_node.data_dir import DataDir;"
        "DataDir.open(Path(sys.argv[1]), 'n9'); print('held', flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", holder, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"held\n"
        with pytest.raises(DataDirError, match=rf"in use by node n9 \(pid {proc.pid}\)"):
            DataDir.open(tmp_path, "n9")
    finally:
        proc.kill()
        proc.wait()
    DataDir.open(tmp_path, "n9").close()  # killed: the kernel released its lock


def test_a_directory_is_never_used_under_another_node_id(tmp_path: Path) -> None:
    DataDir.open(tmp_path, "n1").close()
    assert read_identity(tmp_path) == {"node_id": "n1"}
    with pytest.raises(DataDirError, match=f"data directory {tmp_path} belongs to node n1, not n2"):
        DataDir.open(tmp_path, "n2")
    DataDir.open(tmp_path, "n1").close()  # the refusal released the lock


def test_an_unreadable_identity_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / IDENTITY_FILE).write_text("{not json")
    with pytest.raises(DataDirError, match="is unreadable"):
        DataDir.open(tmp_path, "n1")
    assert (tmp_path / IDENTITY_FILE).read_text() == "{not json"


def test_the_first_node_creates_the_cluster_id_and_the_next_adopt_it(tmp_path: Path) -> None:
    zk = FakeZk()
    first = DataDir.open(tmp_path / "a", "n1")
    created = first.join(zk, "/prod")  # type: ignore[arg-type]
    assert ClusterId.from_json(zk.nodes[zk_layout.CLUSTER]).id == created
    assert read_identity(tmp_path / "a") == {"node_id": "n1", "cluster_id": created}
    second = DataDir.open(tmp_path / "b", "n2")
    assert second.join(zk, "/prod") == created  # type: ignore[arg-type]
    assert json.loads((tmp_path / "b" / IDENTITY_FILE).read_text())["cluster_id"] == created
    first.close()
    again = DataDir.open(tmp_path / "a", "n1")
    assert again.join(zk, "/prod") == created  # type: ignore[arg-type]
    assert (tmp_path / "a" / LOCK_FILE).is_file()


def test_another_clusters_chroot_is_refused_naming_both_ids(tmp_path: Path) -> None:
    ours, theirs = FakeZk(), FakeZk()
    held = DataDir.open(tmp_path, "n1")
    mine = held.join(ours, "/a")  # type: ignore[arg-type]
    other = DataDir.open(tmp_path / "x", "m1").join(theirs, "/b")  # type: ignore[arg-type]
    with pytest.raises(DataDirError) as refused:
        held.join(theirs, "/b")  # type: ignore[arg-type]
    message = str(refused.value)
    assert f"chroot /b belongs to cluster {other}" in message and f"joined cluster {mine}" in message
    assert read_identity(tmp_path)["cluster_id"] == mine  # unchanged


def test_a_chroot_without_an_id_is_refused_once_a_cluster_was_joined(tmp_path: Path) -> None:
    held = DataDir.open(tmp_path, "n1")
    joined = held.join(FakeZk(), "/a")  # type: ignore[arg-type]
    wiped = FakeZk()
    with pytest.raises(DataDirError) as refused:
        held.join(wiped, "/a")  # type: ignore[arg-type]
    assert "chroot /a has no cluster id" in str(refused.value)
    assert f"joined cluster {joined}" in str(refused.value) and "keyroute store adopt" in str(refused.value)
    assert wiped.nodes == {}  # no new identity made up for it
