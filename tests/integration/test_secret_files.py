"""Secrets from files, as prod mounts them: a real `keyroute` process given only `KEYROUTE_ZK_AUTH_FILE` (a
Kubernetes Secret's file, trailing newline and all) reads a ZooKeeper layout locked to the writer and reader
identities; the wrong file is refused in one line that never repeats a password, and no password is in
the process's environment or arguments."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from keyroute.cluster import zk
from keyroute.cluster.cluster_identity import create_cluster_id
from keyroute.runtime.settings import ZkIdentity, ZkSettings

pytestmark = pytest.mark.integration

WRITER = ZkIdentity("keyroute-writer", "writer:secret-from-a-file")
READER = ZkIdentity("keyroute-reader", "reader-secret-from-a-file")


def keyroute(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KEYROUTE_")}
    return subprocess.run(
        [sys.executable, "-m", "keyroute", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**clean, **env},
    )


def test_a_process_reads_a_locked_layout_with_its_identity_from_a_file(zk_settings: ZkSettings, tmp_path: Path) -> None:
    # The writer locks the layout: the writer may do everything, the reader read, nobody else anything.
    writer = zk.connect(dataclasses.replace(zk_settings, auth=WRITER, reader=READER))
    try:
        cluster_id, _ = create_cluster_id(writer)  # as the first node does
    finally:
        zk.close(writer)
    connect = f"{zk_settings.hosts}{zk_settings.chroot}"
    reader_file = tmp_path / "reader"
    reader_file.write_text(READER.credential + "\n")  # `kubectl create secret --from-file` keeps the newline
    env = {"KEYROUTE_ZK_AUTH_FILE": str(reader_file)}
    listed = keyroute("cluster", "id", "--zk", connect, env=env)
    assert listed.returncode == 0, listed.stderr
    assert str(cluster_id.id) in listed.stdout
    assert READER.password not in listed.stdout + listed.stderr
    # Without the identity the same command is refused: the file is what let it in.
    refused = keyroute("cluster", "id", "--zk", connect, env={})
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    # A file with the wrong password: refused in one line naming the identity, never the password.
    wrong = tmp_path / "wrong"
    wrong.write_text(f"{READER.user}:not-the-password\n")
    bad = keyroute("cluster", "id", "--zk", connect, env={"KEYROUTE_ZK_AUTH_FILE": str(wrong)})
    assert bad.returncode == 1 and "keyroute-reader" in bad.stderr and "Traceback" not in bad.stderr
    assert "not-the-password" not in bad.stderr
    # A file that is not there: one line, exit 1, before any connection.
    missing = keyroute("cluster", "id", "--zk", connect, env={"KEYROUTE_ZK_AUTH_FILE": str(tmp_path / "nope")})
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1
    assert missing.stderr.startswith(f"keyroute cluster: --zk-auth-file {tmp_path / 'nope'}: cannot read it")
