"""prod's ZooKeeper takes its recovery superuser from zoo.cfg, not from the JVM's command line: a real
ZooKeeper (the jars keyroute's tests run) started with the very line prod's start script appends to zoo.cfg
lets the superuser read and re-ACL a record locked to an identity whose password is lost, while anyone else
stays out, and the digest is on no process's command line."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError
from kazoo.security import make_digest_acl, make_digest_acl_credential

from keyroute.dev.zookeeper_server import command, is_serving, terminate
from tests.k8s_render import find, pod_template, render
from tests.util import free_port, wait_for

pytestmark = pytest.mark.integration

SUPER_PASSWORD = "recovery-password"


def superuser_line(digest: str) -> str:
    """The zoo.cfg line prod's ZooKeeper start script writes (overlays/prod/zookeeper.yaml), for `digest`."""
    [zk] = pod_template(find(render("prod"), "StatefulSet", "keyroute-zookeeper"))["spec"]["containers"]
    [template] = re.findall(r"printf '([^']*)\\n' \"\$SUPER_DIGEST\"", zk["command"][2])
    return template.replace("%s", digest)


@pytest.fixture
def zookeeper(tmp_path: Path) -> Iterator[tuple[str, list[str]]]:
    port = free_port()
    argv = command(tmp_path / "zk", port)  # writes zoo.cfg
    digest = make_digest_acl_credential("super", SUPER_PASSWORD)
    with open(argv[-1], "a") as cfg:
        cfg.write(superuser_line(digest) + "\n")
    log = open(tmp_path / "zookeeper.log", "wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    log.close()
    try:
        wait_for(lambda: proc.poll() is not None or is_serving("127.0.0.1", port), timeout_s=60, message="ZooKeeper")
        assert proc.poll() is None, (tmp_path / "zookeeper.log").read_text()
        yield f"127.0.0.1:{port}", argv
    finally:
        terminate(proc, 10)


def client(hosts: str, auth: tuple[str, str] | None = None) -> KazooClient:
    zk = KazooClient(hosts=hosts, auth_data=[("digest", f"{auth[0]}:{auth[1]}")] if auth else None)
    zk.start(timeout=15)
    return zk


def test_the_superuser_from_zoo_cfg_opens_a_record_whose_owner_is_lost(zookeeper: tuple[str, list[str]]) -> None:
    hosts, argv = zookeeper
    digest = make_digest_acl_credential("super", SUPER_PASSWORD)
    assert not [part for part in argv if digest in part or "superDigest" in part], "the digest is on the command line"
    owner = client(hosts, ("keyroute-writer", "lost-password"))
    try:
        owner.create("/keyroute", b"routing", acl=[make_digest_acl("keyroute-writer", "lost-password", all=True)])
    finally:
        owner.stop()
    stranger = client(hosts, ("keyroute-writer", "a-guess"))
    try:
        with pytest.raises(NoAuthError):
            stranger.get("/keyroute")
    finally:
        stranger.stop()
    superuser = client(hosts, ("super", SUPER_PASSWORD))
    try:
        assert superuser.get("/keyroute")[0] == b"routing"
        # The way back in (README, "Rotation"): the record handed to identities the operators hold.
        superuser.set_acls("/keyroute", [make_digest_acl("keyroute-writer-2", "new-password", all=True)])
    finally:
        superuser.stop()
    new_owner = client(hosts, ("keyroute-writer-2", "new-password"))
    try:
        assert new_owner.get("/keyroute")[0] == b"routing"
    finally:
        new_owner.stop()
