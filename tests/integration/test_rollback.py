"""Retention and rollback: the last N versions stay rollback-able, `keyroute store rollback` makes one current
again (and refuses anything else), and a node swaps back without a failed read, reusing files it still has.

Real ZooKeeper and a real node process; snapshots written by hand (no Spark), published by pipeline.publish.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kazoo.client import KazooClient

from keyroute.cluster import zk, zk_layout
from keyroute.cluster.cluster_identity import create_cluster_id
from keyroute.cluster.partition_map import ServingRecord, StoreRecord
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.pipeline.publish import publish, read_published, retained_after, retaining
from keyroute.pipeline.spec import Mode, SourceFormat, StoreSpec
from keyroute.pipeline.writer import WrittenVersion
from keyroute.runtime.settings import ZkSettings
from keyroute.storage.snapshot import read_manifest
from tests.integration.test_node import key_url, write_snapshot
from tests.util import Proc, free_port, wait_for

pytestmark = pytest.mark.integration

STORE = "prices"
PARTITIONS = 2
SPEC = StoreSpec(
    name=STORE,
    source="unused",
    format=SourceFormat.JSON,
    key="k",
    partitions=PARTITIONS,
    mode=Mode.LATEST,
    order_by="ts",
)
KEYS = [f"P{i:03d}" for i in range(40)]


def values(version: int) -> dict[str, Any]:
    return {key: {"price": i * 10 + version, "version": version} for i, key in enumerate(KEYS)}


def record(version: int, retained: dict[int, str] | None = None) -> StoreRecord:
    return StoreRecord(
        STORE,
        PARTITIONS,
        Partitioner.MURMUR2,
        KeyFormat.STRING,
        version,
        f"/s/v{version}",
        (),
        retained=retained or {},
    )


def test_retention_keeps_the_new_version_the_one_it_replaces_and_then_the_newest() -> None:
    first = record(1)
    assert retained_after(None, first, 3) == {1: "/s/v1"}
    two = retained_after(dataclasses.replace(first, retained={1: "/s/v1"}), record(2), 3)
    assert two == {2: "/s/v2", 1: "/s/v1"}
    # v1..v4 published in turn with 3 retained: v1 falls out.
    current = record(3, {1: "/s/v1", 2: "/s/v2", 3: "/s/v3"})
    assert retained_after(current, record(4), 3) == {4: "/s/v4", 3: "/s/v3", 2: "/s/v2"}
    # After a rollback to v2 (v3, v4 retained), the next version keeps v2, the known good one.
    rolled_back = record(2, {2: "/s/v2", 3: "/s/v3", 4: "/s/v4"})
    assert retained_after(rolled_back, record(5), 3) == {5: "/s/v5", 2: "/s/v2", 4: "/s/v4"}
    assert retained_after(rolled_back, record(5), 1) == {5: "/s/v5"}
    with pytest.raises(ValueError), retaining(0):
        pass


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "keyroute", *args], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.fixture
def client(zk_settings: ZkSettings) -> Iterator[KazooClient]:
    c = zk.connect(zk_settings)
    yield c
    zk.close(c)


def publish_version(client: KazooClient, root: Path, version: int, retain: int = 3) -> StoreRecord:
    snapshot = write_snapshot(root, STORE, values(version), KeyFormat.STRING, PARTITIONS, version=version)
    written = WrittenVersion(STORE, version, Path(snapshot), read_manifest(snapshot))
    [published] = publish(client, [(SPEC, written)], {STORE: read_published(client, STORE)}, retain=retain)
    return published


def test_rollback_to_a_retained_version_without_a_failed_read(
    tmp_path: Path, zk_settings: ZkSettings, client: KazooClient
) -> None:
    root = tmp_path / "snapshots"
    for version in (1, 2, 3, 4):
        published = publish_version(client, root, version)
    assert published.retained_versions == (2, 3, 4)
    # A version no longer retained has its snapshot removed; the retained ones stay.
    assert not (root / STORE / "v000001").exists()
    assert all((root / STORE / f"v{v:06d}").is_dir() for v in (2, 3, 4))

    connect = zk_settings.connect_string
    port = free_port()
    node = Proc(
        [
            "node",
            "--zk",
            connect,
            "--node-id",
            "n1",
            "--port",
            str(port),
            "--data-dir",
            str(tmp_path / "n1"),
            "--zk-session-timeout-s",
            "4",
            "--version-grace-s",
            "60",
        ],
        tmp_path / "n1.log",
    ).start()
    base = f"http://127.0.0.1:{port}"

    def serving() -> dict[int, int]:
        try:
            raw, _ = client.get(zk_layout.serving_path("n1"))
        except Exception:
            return {}
        return dict(ServingRecord.from_json(raw).stores.get(STORE, {}))

    def serving_at(version: int) -> bool:
        return serving() == dict.fromkeys(range(PARTITIONS), version)

    failures: list[str] = []
    seen: set[int] = set()
    stop = threading.Event()

    def reader() -> None:
        with httpx.Client(base_url=base, timeout=10, trust_env=False) as http:
            while not stop.is_set():
                for key in KEYS[:10]:
                    r = http.get(key_url(STORE, key))
                    body = r.json()
                    if r.status_code != 200 or body["value"] != values(body["version"])[key]:
                        failures.append(f"{key}: {r.status_code} {r.text[:200]}")
                    else:
                        seen.add(body["version"])

    thread = threading.Thread(target=reader, daemon=True)
    try:
        wait_for(lambda: serving_at(4), timeout_s=30, message="n1 serving version 4")
        v4_marker = tmp_path / "n1" / "stores" / STORE / "v4" / "p0" / "loaded.json"
        v4_inode = v4_marker.stat().st_ino
        thread.start()
        wait_for(lambda: 4 in seen, timeout_s=10, message="reads answered at version 4")

        listed = cli("store", "list", "--zk", connect)
        assert listed.returncode == 0, listed.stderr
        [line] = [json.loads(x) for x in listed.stdout.splitlines()]
        assert line["store"] == STORE and line["version"] == 4 and sorted(line["retained"]) == ["2", "3", "4"]

        # Refused, with a reason, and nothing changes: a version that is no longer retained, one that
        # never existed, a store that does not exist.
        for bad, why in (("1", "version 1 is not retained"), ("9", "version 9 is not retained")):
            refused = cli("store", "rollback", "--zk", connect, "--store", STORE, "--version", bad)
            assert refused.returncode == 1 and why in refused.stderr, refused.stderr
            assert "retained versions: 2, 3, 4" in refused.stderr
        refused = cli("store", "rollback", "--zk", connect, "--store", "nope", "--version", "1")
        assert refused.returncode == 1 and "no such store" in refused.stderr
        current = cli("store", "rollback", "--zk", connect, "--store", STORE, "--version", "4")
        assert current.returncode == 1 and current.stdout == "", current.stdout
        assert current.stderr == f"keyroute store rollback: version 4 is already current for store {STORE!r}; " \
            "nothing was changed\n"
        assert read_published(client, STORE).record.version == 4  # type: ignore[union-attr]

        done = cli("store", "rollback", "--zk", connect, "--store", STORE, "--version", "3")
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)
        assert answer["version"] == 3 and answer["previous_version"] == 4
        wait_for(lambda: serving_at(3), timeout_s=30, message="n1 serving version 3")
        wait_for(lambda: 3 in seen, timeout_s=10, message="reads answered at version 3")

        # Forward again to 4 while its files are still on disk: reused, not rebuilt.
        assert cli("store", "rollback", "--zk", connect, "--store", STORE, "--version", "4").returncode == 0
        wait_for(lambda: serving_at(4), timeout_s=30, message="n1 serving version 4 again")
        assert v4_marker.stat().st_ino == v4_inode

        # Back to 3, then a new build: it retains 5, the version it replaces (3), and the newest other (4).
        assert cli("store", "rollback", "--zk", connect, "--store", STORE, "--version", "3").returncode == 0
        wait_for(lambda: serving_at(3), timeout_s=30, message="n1 serving version 3 again")
        published = publish_version(client, root, 5)
        assert published.retained_versions == (3, 4, 5)
        assert not (root / STORE / "v000002").exists() and (root / STORE / "v000003").is_dir()
        wait_for(lambda: serving_at(5), timeout_s=30, message="n1 serving version 5")
        wait_for(lambda: 5 in seen, timeout_s=10, message="reads answered at version 5")
    finally:
        stop.set()
        if thread.is_alive():
            thread.join(timeout=20)
        code = node.stop()
        if failures or code != 0:
            print(node.output()[-6000:])
    assert not failures, failures[:5]
    assert seen == {3, 4, 5}
    assert code == 0


def test_retention_and_leave_options_read_flags_and_environment() -> None:
    from keyroute.cli import build_parser, main

    parser = build_parser({})
    args = parser.parse_args(["pipeline", "build", "--spec", "s.toml", "--zk", "zk:2181", "--output", "/o"])
    assert args.retain == 3
    args = build_parser({"KEYROUTE_RETAIN": "5"}).parse_args(
        ["pipeline", "build", "--spec", "s.toml", "--zk", "zk:2181", "--output", "/o"]
    )
    assert args.retain == 5
    node = ["node", "--zk", "zk:2181", "--node-id", "n", "--port", "1", "--data-dir", "/d"]
    args = parser.parse_args(node)
    assert (args.drain_timeout_s, args.version_grace_s) == (60.0, 300.0)
    env = {"KEYROUTE_DRAIN_TIMEOUT_S": "90", "KEYROUTE_VERSION_GRACE_S": "5"}
    args = build_parser(env).parse_args(node)
    assert (args.drain_timeout_s, args.version_grace_s) == (90.0, 5.0)
    roll = ["store", "rollback", "--zk", "zk:2181", "--store", "s", "--version", "2"]
    assert parser.parse_args(roll).no_verify is False
    assert build_parser({"KEYROUTE_NO_VERIFY": "1"}).parse_args(roll).no_verify is True
    build = ["pipeline", "build", "--spec", "s.toml", "--zk", "zk:2181", "--output", "/o", "--retain", "0"]
    assert main(build, env={}) == 2


def test_store_list_where_nothing_is_published_says_so(zk_settings: ZkSettings) -> None:
    listed = cli("store", "list", "--zk", zk_settings.connect_string + "-nothing-here")
    # No cluster record, no node, no store: most likely a mistyped chroot, said in one line.
    assert listed.returncode == 1, listed.stderr
    assert listed.stdout == ""
    assert "no keyroute cluster at ZooKeeper" in listed.stderr and "-nothing-here" in listed.stderr
    assert len(listed.stderr.strip().splitlines()) == 1, listed.stderr
    assert "Traceback" not in listed.stderr


def test_store_list_of_a_cluster_that_published_nothing_yet_says_so(zk_settings: ZkSettings) -> None:
    client = zk.connect(zk_settings)
    try:
        create_cluster_id(client)
    finally:
        zk.close(client)
    listed = cli("store", "list", "--zk", zk_settings.connect_string)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout == ""
    assert "no store is published at" in listed.stderr and zk_settings.chroot in listed.stderr
