"""A mistyped or empty chroot is said: a router on it logs one line naming the ZooKeeper address, the chroot
and the chroots that do hold a cluster (that line alone: nothing about registering as a router there), and
says it in /readyz and the admin partition map while it stays empty, registering once the layout is made; a
node creating a new cluster while others exist says "did you mean"; `keyroute store list` exits 1.

A real `keyroute router` process and the session's ZooKeeper server.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import httpx
import pytest

from keyroute.cluster import zk, zk_layout
from keyroute.cluster.cluster_identity import create_cluster_id
from keyroute.cluster.partition_map import StoreRecord
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.runtime.settings import ZkSettings
from keyroute.state_node.data_dir import DataDir
from tests.util import Proc, free_port, wait_for

pytestmark = pytest.mark.integration

SAID = "no keyroute cluster at ZooKeeper"


def _with_a_cluster(settings: ZkSettings) -> None:
    client = zk.connect(settings)
    try:
        create_cluster_id(client)
    finally:
        zk.close(client)


def test_a_router_on_an_empty_chroot_says_so_once_and_names_the_chroot_meant(
    zk_settings: ZkSettings, tmp_path: Path
) -> None:
    _with_a_cluster(zk_settings)  # the chroot meant
    typo = dataclasses.replace(zk_settings, chroot=zk_settings.chroot + "x")
    port = free_port()
    router = Proc(["router", "--zk", typo.connect_string, "--port", str(port)], tmp_path / "router.log").start()
    url = f"http://127.0.0.1:{port}"
    try:
        ready = wait_for(
            lambda: (r := httpx.get(url + "/readyz", timeout=2)).json().get("cluster") and r,
            timeout_s=30,
            message="the router to say the chroot is empty",
        )
        # Still ready: routers start before anything is published (the demo, a new cluster).
        assert ready.status_code == 200
        message = ready.json()["cluster_message"]
        assert ready.json()["cluster"] == "empty"
        assert f"{SAID} {zk_settings.hosts} chroot {typo.chroot}" in message
        assert f"did you mean {zk_settings.chroot}" in message
        page = httpx.get(url + "/admin/partition-map", timeout=5).json()
        assert (page["cluster"], page["cluster_message"]) == ("empty", message)
        # Something published there: the chroot is a cluster's after all, and nothing says otherwise.
        writer = zk.connect(typo)
        try:
            record = StoreRecord("s", 1, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/snap/s/v1")
            writer.create(zk_layout.store_path("s"), record.to_json())
        finally:
            zk.close(writer)
        wait_for(
            lambda: "cluster" not in httpx.get(url + "/readyz", timeout=2).json(),
            timeout_s=30,
            message="the router to see the store",
        )
        assert "cluster" not in httpx.get(url + "/admin/partition-map", timeout=5).json()
        # The writer made the layout (/routers among it): the router registers there now, as it could not before.
        wait_for(
            lambda: len(httpx.get(url + "/admin/partition-map", timeout=5).json().get("routers", [])) == 1,
            timeout_s=30,
            message="the router to register once /routers is made",
        )
    finally:
        assert router.stop(timeout_s=20) == 0
    output = router.output()
    assert output.count(SAID) == 1, output
    # The one helpful line, alone: no warning that the router cannot register in a chroot without a cluster.
    assert "cannot register" not in output, output
    assert "Traceback" not in output


def test_a_router_on_a_cluster_says_nothing_of_an_empty_chroot(zk_settings: ZkSettings, tmp_path: Path) -> None:
    _with_a_cluster(zk_settings)
    port = free_port()
    router = Proc(["router", "--zk", zk_settings.connect_string, "--port", str(port)], tmp_path / "router.log")
    router.start()
    url = f"http://127.0.0.1:{port}"
    try:
        body = wait_for(
            lambda: (r := httpx.get(url + "/readyz", timeout=2)).status_code == 200 and r.json(),
            timeout_s=30,
            message="the router ready",
        )
        assert "cluster" not in body
    finally:
        assert router.stop(timeout_s=20) == 0
    assert SAID not in router.output()


def test_a_node_creating_a_cluster_while_others_exist_asks_whether_another_was_meant(
    zk_settings: ZkSettings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _with_a_cluster(zk_settings)
    typo = dataclasses.replace(zk_settings, chroot=zk_settings.chroot + "-typo")
    client = zk.connect(typo)
    data_dir = DataDir.open(tmp_path, "n1")
    try:
        with caplog.at_level(logging.INFO, logger="keyroute.state_node.data_dir"):
            data_dir.join(client, typo.chroot, typo)
    finally:
        data_dir.close()
        zk.close(client)
    [line] = [r.getMessage() for r in caplog.records if SAID in r.getMessage()]
    assert f"chroot {typo.chroot}: this node created a new cluster" in line
    assert f"did you mean {zk_settings.chroot}" in line
