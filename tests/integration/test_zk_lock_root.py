"""`keyroute zk lock-root`: on a ZooKeeper of the test's own (its root's ACL is changed), only the writer identity
may create at the root afterwards; everyone may still read it, and keyroute's writers still create chroots."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError

from keyroute.cluster import zk
from keyroute.cluster.cluster_identity import chroots_with_a_cluster, create_cluster_id
from keyroute.dev.zookeeper_server import EmbeddedZooKeeper
from keyroute.runtime.settings import ZkIdentity, ZkSettings
from tests.util import free_port

pytestmark = pytest.mark.integration

WRITER = "keyroute:writer-secret"
READER = "reader:reader-secret"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "keyroute", *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_only_the_writer_creates_at_a_locked_root_and_everyone_still_reads_it(tmp_path: Path) -> None:
    with EmbeddedZooKeeper(port=free_port(), data_dir=tmp_path / "zookeeper") as server:
        hosts = server.connect_string
        # Without an identity it is refused in one line, and the root stays as it was.
        refused = cli("zk", "lock-root", "--zk", hosts)
        assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        assert "needs the writer identity" in refused.stderr and "Traceback" not in refused.stderr
        anyone = KazooClient(hosts=hosts)
        anyone.start(timeout=15)
        try:
            anyone.create("/before-the-lock")  # world-open, as ZooKeeper starts

            locked = cli("zk", "lock-root", "--zk", hosts, "--zk-auth", WRITER, "--zk-reader", READER)
            assert locked.returncode == 0, locked.stderr
            assert json.loads(locked.stdout) == {"root_acl": ["digest:keyroute ALL", "world:anyone READ"]}

            with pytest.raises(NoAuthError):
                anyone.create("/litter")
            assert "before-the-lock" in anyone.get_children("/")  # reading the root still works
            # keyroute's writer still creates a new cluster's chroot, which others can then find.
            settings = ZkSettings(hosts=hosts, chroot="/prod", auth=ZkIdentity.parse(WRITER))
            client = zk.connect(settings)
            try:
                create_cluster_id(client)
            finally:
                zk.close(client)
            assert chroots_with_a_cluster(dataclasses.replace(settings, chroot="/other")) == ["/prod"]
            # Again: the same ACL (it can run at every start).
            again = cli("zk", "lock-root", "--zk", hosts, "--zk-auth", WRITER)
            assert again.returncode == 0 and json.loads(again.stdout) == json.loads(locked.stdout)
            # Another identity may not undo it.
            other = cli("zk", "lock-root", "--zk", hosts, "--zk-auth", "intruder:pw")
            assert other.returncode == 1 and "may not change the ACL of ZooKeeper's root" in other.stderr
        finally:
            anyone.stop()
            anyone.close()
