"""ZooKeeper ACLs (digest scheme) on a real ZooKeeper: what keyroute creates belongs to the writer identity,
the reader identity may only read it, anyone else may do nothing, and routing survives hijack attempts.

Real node and router processes (credentials from KEYROUTE_ZK_AUTH / KEYROUTE_ZK_READER); snapshots written
by hand and published by pipeline.publish; a rollback through the CLI.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError
from kazoo.security import OPEN_ACL_UNSAFE, make_digest_acl

from keyroute.cluster import zk, zk_layout
from keyroute.cluster.map_watcher import MapWatcher
from keyroute.cluster.partition_map import Assignment, NodeRecord, ServingRecord, StoreRecord
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.pipeline.publish import publish, read_published
from keyroute.pipeline.spec import Mode, SourceFormat, StoreSpec
from keyroute.pipeline.writer import WrittenVersion
from keyroute.runtime.settings import ZkIdentity, ZkSettings
from keyroute.storage.snapshot import read_manifest
from tests.integration.test_node import key_url, write_snapshot
from tests.util import Proc, free_port, wait_for

pytestmark = pytest.mark.integration

WRITER = ZkIdentity("keyroute-writer", "writer:secret")  # a ':' inside the password is allowed
READER = ZkIdentity("keyroute-reader", "reader-secret")
STORE = "fares"
PARTITIONS = 4
KEYS = [f"F{i:03d}" for i in range(40)]
SPEC = StoreSpec(
    name=STORE,
    source="unused",
    format=SourceFormat.JSON,
    key="k",
    partitions=PARTITIONS,
    mode=Mode.LATEST,
    order_by="ts",
    replication_factor=2,
)
EXPECTED_ACL = {
    (31, "digest", make_digest_acl(WRITER.user, WRITER.password).id.id),
    (1, "digest", make_digest_acl(READER.user, READER.password).id.id),
}

# /routers: the reader may also create and delete children (routers register themselves there).
ROUTERS_ACL = {
    (31, "digest", make_digest_acl(WRITER.user, WRITER.password).id.id),
    (1 | 4 | 8, "digest", make_digest_acl(READER.user, READER.password).id.id),
}


def values(version: int) -> dict[str, Any]:
    return {key: {"fare": i * 10 + version, "version": version} for i, key in enumerate(KEYS)}


def writer_settings(base: ZkSettings) -> ZkSettings:
    return dataclasses.replace(base, auth=WRITER, reader=READER)


def reader_settings(base: ZkSettings) -> ZkSettings:
    return dataclasses.replace(base, auth=READER)


def raw_client(settings: ZkSettings, identity: ZkIdentity | None) -> KazooClient:
    """A plain kazoo client, as an intruder would open one: no default ACL of ours, and no chroot (kazoo
    checks a chroot on start, which an identity without READ on it may not do)."""
    auth = [("digest", identity.credential)] if identity is not None else None
    client = KazooClient(hosts=settings.hosts, auth_data=auth, timeout=4.0)
    client.start(timeout=15)
    return client


def publish_version(client: KazooClient, root: Path, version: int) -> StoreRecord:
    snapshot = write_snapshot(root, STORE, values(version), KeyFormat.STRING, PARTITIONS, version=version)
    written = WrittenVersion(STORE, version, Path(snapshot), read_manifest(snapshot))
    [record] = publish(client, [(SPEC, written)], {STORE: read_published(client, STORE)}, retain=3)
    return record


def every_path(client: KazooClient, path: str = "/") -> Iterator[str]:
    yield path
    if path.startswith(zk_layout.ROUTERS + "/"):
        return  # a router's record: its own identity's (the reader's), the writer may not read it
    for child in client.get_children(path):
        yield from every_path(client, f"{path.rstrip('/')}/{child}")


def acl_of(client: KazooClient, path: str) -> set[tuple[int, str, str]]:
    acl, _ = client.get_acls(path)
    return {(entry.perms, entry.id.scheme, entry.id.id) for entry in acl}


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KEYROUTE_")}
    return subprocess.run(
        [sys.executable, "-m", "keyroute", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**clean, **env},
    )


WRITER_ENV = {"KEYROUTE_ZK_AUTH": WRITER.credential, "KEYROUTE_ZK_READER": READER.credential}
READER_ENV = {"KEYROUTE_ZK_AUTH": READER.credential}


def hijack_attempts(client: KazooClient, chroot: str, victim: str) -> dict[str, Callable[[], object]]:
    """Every way to redirect clients: change the assignment, the serving view or a store's version, add or
    remove records, or open an ACL (`client` has no chroot: paths are prefixed with `chroot`)."""
    assignment, serving = chroot + zk_layout.PLACEMENT, chroot + zk_layout.SERVING
    stores, nodes = chroot + zk_layout.STORES, chroot + zk_layout.NODES
    evil_store = StoreRecord(STORE, PARTITIONS, Partitioner.MURMUR2, KeyFormat.STRING, 99, "/evil/v99")
    evil_serving = ServingRecord("evil", "http://127.0.0.1:9", {STORE: dict.fromkeys(range(PARTITIONS), 1)})
    evil_assignment = Assignment(10**6, {STORE: tuple(("evil",) for _ in range(PARTITIONS))})
    evil_node = NodeRecord("evil", "http://127.0.0.1:9")
    return {
        "set assignment": lambda: client.set(assignment, evil_assignment.to_json()),
        "set serving": lambda: client.set(f"{serving}/{victim}", evil_serving.to_json()),
        "set store version": lambda: client.set(f"{stores}/{STORE}", evil_store.to_json()),
        "create serving": lambda: client.create(f"{serving}/evil", evil_serving.to_json(), ephemeral=True),
        "create node": lambda: client.create(f"{nodes}/evil", evil_node.to_json(), ephemeral=True),
        "create store": lambda: client.create(f"{stores}/evil", evil_store.to_json()),
        "create root record": lambda: client.create(f"{chroot}/evil", b"{}"),
        "delete serving": lambda: client.delete(f"{serving}/{victim}"),
        "delete node": lambda: client.delete(f"{nodes}/{victim}"),
        "delete assignment": lambda: client.delete(assignment),
        "delete store": lambda: client.delete(f"{stores}/{STORE}"),
        "open the chroot's ACL": lambda: client.set_acls(chroot, OPEN_ACL_UNSAFE),
        "open the assignment's ACL": lambda: client.set_acls(assignment, OPEN_ACL_UNSAFE),
        "open the serving root's ACL": lambda: client.set_acls(serving, OPEN_ACL_UNSAFE),
        "transaction": lambda: _transaction(client, assignment, evil_assignment),
    }


def _transaction(client: KazooClient, path: str, assignment: Assignment) -> None:
    txn = client.transaction()
    txn.set_data(path, assignment.to_json())
    results = txn.commit()
    for result in results:
        if isinstance(result, Exception):
            raise result


@pytest.fixture
def secured(tmp_path: Path, zk_settings: ZkSettings) -> Iterator[tuple[ZkSettings, KazooClient]]:
    client = zk.connect(writer_settings(zk_settings))
    yield zk_settings, client
    zk.close(client)


def test_a_secured_cluster_routes_for_its_reader_and_refuses_everyone_else(
    tmp_path: Path, secured: tuple[ZkSettings, KazooClient]
) -> None:
    base, writer = secured
    root = tmp_path / "snapshots"
    publish_version(writer, root, 1)
    publish_version(writer, root, 2)
    connect = base.connect_string
    procs: list[Proc] = []
    http = httpx.Client(timeout=10.0, trust_env=False)
    try:
        for node_id in ("n1", "n2"):
            args = ["node", "--zk", connect, "--node-id", node_id, "--port", str(free_port())]
            args += ["--data-dir", str(tmp_path / node_id), "--zk-session-timeout-s", "4", "--version-grace-s", "60"]
            procs.append(Proc(args, tmp_path / f"{node_id}.log", env=WRITER_ENV).start())
        router_port = free_port()
        router_url = f"http://127.0.0.1:{router_port}"
        router = Proc(
            ["router", "--zk", connect, "--port", str(router_port), "--zk-session-timeout-s", "4"],
            tmp_path / "router.log",
            env=READER_ENV,
        ).start()
        procs.append(router)

        def served_at(version: int) -> bool:
            pmap = http.get(router_url + "/admin/partition-map?detail=all").json()
            entries = pmap["stores"].get(STORE, {}).get("partition_map", [])
            return len(entries) == PARTITIONS and all(
                {s["node"] for s in e["serving"]} == {"n1", "n2"} and all(s["version"] == version for s in e["serving"])
                for e in entries
            )

        wait_for(
            lambda: http.get(router_url + "/readyz").json().get("complete") is True,
            timeout_s=60,
            message="router ready",
        )
        wait_for(lambda: served_at(2), timeout_s=60, interval_s=0.2, message="both nodes serve v2")

        def check_reads(version: int) -> None:
            for key, value in values(version).items():
                r = http.get(router_url + key_url(STORE, key))
                assert r.status_code == 200, (key, r.text)
                assert r.json()["value"] == value and r.json()["version"] == version

        check_reads(2)

        # Everything keyroute created (chroot, roots, records, ephemeral ones, the election's) has one ACL.
        paths = list(every_path(writer))
        for expected in ("/", "/placement", f"/placement/{STORE}", f"/stores/{STORE}", "/nodes/n1", "/serving/n2"):
            assert expected in paths
        assert [p for p in paths if p.startswith("/controller/")], "no election record"
        # ...but /routers, where the reader also creates and deletes: the router registered itself there, its
        # record the reader's alone.
        records = [p for p in paths if p.startswith(zk_layout.ROUTERS + "/")]
        assert len(records) == 1, paths
        for path in paths:
            if path not in records:
                assert acl_of(writer, path) == (ROUTERS_ACL if path == zk_layout.ROUTERS else EXPECTED_ACL), path

        assignment_before = writer.get(zk_layout.placement_path(STORE))[0]
        store_before = writer.get(zk_layout.store_path(STORE))[0]
        anonymous = raw_client(base, None)
        reader = raw_client(base, READER)
        try:
            # Anyone else may not even read; the reader may read.
            chroot = base.chroot
            with pytest.raises(NoAuthError):
                anonymous.get(chroot + zk_layout.placement_path(STORE))
            with pytest.raises(NoAuthError):
                anonymous.get_children(chroot + zk_layout.SERVING)
            assert reader.get(chroot + zk_layout.placement_path(STORE))[0] == assignment_before
            (record,) = records
            assert json.loads(reader.get(chroot + record)[0])["url"] == router_url
            assert {(e.perms, e.id.scheme, e.id.id.split(":")[0]) for e in reader.get_acls(chroot + record)[0]} == {
                (31, "digest", READER.user)
            }
            with pytest.raises(NoAuthError):
                anonymous.get(chroot + record)
            # The cursor key: the members read it, nobody else.
            assert len(reader.get(chroot + zk_layout.CURSOR_KEY)[0]) == 32
            with pytest.raises(NoAuthError):
                anonymous.get(chroot + zk_layout.CURSOR_KEY)
            for who, client in (("anonymous", anonymous), ("reader", reader)):
                for what, attempt in hijack_attempts(client, chroot, victim="n1").items():
                    with pytest.raises(NoAuthError):
                        attempt()
                        pytest.fail(f"{who} could {what}")
        finally:
            for client in (anonymous, reader):
                zk.close(client)
        assert writer.get(zk_layout.placement_path(STORE))[0] == assignment_before
        assert writer.get(zk_layout.store_path(STORE))[0] == store_before
        assert sorted(writer.get_children(zk_layout.SERVING)) == ["n1", "n2"]
        # The cluster id and the cursor key, written by the first node.
        roots = (*zk_layout.PERSISTENT_ROOTS, zk_layout.CLUSTER, zk_layout.CURSOR_KEY)
        assert sorted(writer.get_children("/")) == sorted(p.lstrip("/") for p in roots)
        # ...and the router still routes every key right.
        check_reads(2)

        # The read-only identity may list stores but not roll one back; the writer may.
        listed = cli("store", "list", "--zk", connect, env=READER_ENV)
        assert listed.returncode == 0, listed.stderr
        assert json.loads(listed.stdout)["store"] == STORE
        refused = cli("store", "rollback", "--zk", connect, "--store", STORE, "--version", "1", env=READER_ENV)
        assert refused.returncode == 1
        assert "keyroute-reader" in refused.stderr and "Traceback" not in refused.stderr
        assert READER.password not in refused.stderr
        assert writer.get(zk_layout.store_path(STORE))[0] == store_before
        done = cli("store", "rollback", "--zk", connect, "--store", STORE, "--version", "1", env=WRITER_ENV)
        assert done.returncode == 0, done.stderr
        wait_for(lambda: served_at(1), timeout_s=60, interval_s=0.2, message="both nodes serve v1 again")
        check_reads(1)
        assert acl_of(writer, zk_layout.store_path(STORE)) == EXPECTED_ACL
    finally:
        http.close()
        for proc in procs:
            proc.stop()
        for proc in procs:
            print(f"----- {proc.args[:4]}\n{proc.output()[-4000:]}")  # shown only when the test failed


def test_a_read_only_router_view_waits_for_a_layout_that_does_not_exist_yet(zk_settings: ZkSettings) -> None:
    reading = zk.connect(reader_settings(zk_settings), ensure_layout=False)
    watcher = MapWatcher(reading, lambda _map: None, safety_refresh_s=600.0)  # only watches bring the map
    outside = raw_client(zk_settings, None)
    writer: KazooClient | None = None
    try:
        watcher.start()
        wait_for(lambda: watcher.reads >= 1, timeout_s=10, message="a first read")
        # The reader created nothing: not even the chroot.
        assert outside.exists(zk_settings.chroot) is None
        assert not watcher.current.stores

        writer = zk.connect(writer_settings(zk_settings))
        record = StoreRecord(STORE, PARTITIONS, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/snap/v1")
        writer.create(zk_layout.store_path(STORE), record.to_json())
        writer.create(zk_layout.node_path("n1"), NodeRecord("n1", "http://127.0.0.1:1").to_json(), ephemeral=True)
        serving = ServingRecord("n1", "http://127.0.0.1:1", {STORE: dict.fromkeys(range(PARTITIONS), 1)})
        writer.create(zk_layout.serving_path("n1"), serving.to_json(), ephemeral=True)
        writer.create(zk_layout.ASSIGNMENT, Assignment(1, {STORE: tuple(("n1",) for _ in range(PARTITIONS))}).to_json())

        def complete() -> bool:
            current = watcher.current
            return STORE in current.stores and current.complete and not current.stale

        wait_for(complete, timeout_s=15, message="the map pushed by watches once the layout exists")

        # A record written by a writer that grants the reader nothing is left out; the rest still routes.
        lone = zk.connect(dataclasses.replace(zk_settings, auth=WRITER))
        try:
            hidden = StoreRecord("hidden", 2, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/snap/hidden")
            lone.create(zk_layout.store_path("hidden"), hidden.to_json())
            other = StoreRecord("other", 2, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/snap/other")
            writer.create(zk_layout.store_path("other"), other.to_json())
            wait_for(lambda: "other" in watcher.current.stores, timeout_s=15, message="the readable new store")
            assert "hidden" not in watcher.current.stores
            assert STORE in watcher.current.stores and not watcher.current.stale
            # That writer did not take the reader's READ away from the layout (it only adds its own entry).
            assert (1, "digest", make_digest_acl(READER.user, READER.password).id.id) in acl_of(
                writer, zk_layout.STORES
            )
        finally:
            zk.close(lone)
    finally:
        watcher.stop()
        zk.close(reading)
        zk.close(outside)
        if writer is not None:
            zk.close(writer)


def test_a_world_open_layout_is_locked_when_a_writer_brings_credentials(
    zk_settings: ZkSettings, caplog: pytest.LogCaptureFixture
) -> None:
    legacy = zk.connect(zk_settings)  # as before credentials were configured: world-open
    record = StoreRecord(STORE, PARTITIONS, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/snap/v1")
    legacy.create(zk_layout.store_path(STORE), record.to_json())
    legacy.create(zk_layout.ASSIGNMENT, Assignment(1, {}).to_json())
    zk.close(legacy)
    anonymous = raw_client(zk_settings, None)
    try:
        anonymous.set(zk_settings.chroot + zk_layout.ASSIGNMENT, Assignment(2, {}).to_json())  # still possible
        with caplog.at_level(logging.WARNING, logger="keyroute.cluster.zk"):
            writer = zk.connect(writer_settings(zk_settings))
        assert "changed to: digest:keyroute-writer ALL, digest:keyroute-reader READ" in caplog.text
        assert WRITER.password not in caplog.text and READER.password not in caplog.text
        try:
            for path in ("/", *zk_layout.PERSISTENT_ROOTS, zk_layout.ASSIGNMENT, zk_layout.store_path(STORE)):
                assert acl_of(writer, path) == (ROUTERS_ACL if path == zk_layout.ROUTERS else EXPECTED_ACL), path
            for what, attempt in hijack_attempts(anonymous, zk_settings.chroot, victim="n1").items():
                if "serving" in what or "node" in what:
                    continue  # no node ever ran here
                with pytest.raises(NoAuthError):
                    attempt()
                    pytest.fail(f"anonymous could {what}")
        finally:
            zk.close(writer)
    finally:
        zk.close(anonymous)


def test_who_may_not_administer_the_layout_is_told_so_at_connect(zk_settings: ZkSettings) -> None:
    zk.close(zk.connect(writer_settings(zk_settings)))
    cases = {
        "an unauthenticated client": zk_settings,
        "'keyroute-writer'": dataclasses.replace(zk_settings, auth=ZkIdentity(WRITER.user, "wrong")),
        "'keyroute-reader'": reader_settings(zk_settings),
    }
    for who, settings in cases.items():
        with pytest.raises(zk.ZkAccessError, match=who) as caught:
            zk.connect(settings)
        assert isinstance(caught.value, zk.ZkUnavailableError)  # callers that handle "unavailable" report it
        assert "wrong" not in str(caught.value) and READER.password not in str(caught.value)
    # Reading needs no layout rights: the reader connects without creating anything.
    zk.close(zk.connect(reader_settings(zk_settings), ensure_layout=False))


def test_zk_dump_works_for_the_reader_and_the_writer_and_names_in_one_line_what_it_may_not_read(
    tmp_path: Path, secured: tuple[ZkSettings, KazooClient]
) -> None:
    base, writer = secured
    publish_version(writer, tmp_path / "snapshots", 1)
    writer.create(zk_layout.node_path("n1"), NodeRecord("n1", "http://127.0.0.1:1").to_json(), ephemeral=True)
    # A router's record, made as a router makes it (its connection's default ACL): the reader's own, which the
    # writer may not read. The writer's dump crashed on it with kazoo's NoAuthError.
    reading = zk.connect(reader_settings(base), ensure_layout=False)
    lone = zk.connect(dataclasses.replace(base, auth=WRITER))  # a writer that grants the reader nothing
    try:
        reading.create(zk_layout.router_path("r1"), b'{"url": "http://127.0.0.1:2"}', ephemeral=True)
        with pytest.raises(NoAuthError):
            writer.get(zk_layout.router_path("r1"))
        dumped: dict[str, list[str]] = {}
        for who, env in (("writer", WRITER_ENV), ("reader", READER_ENV)):
            out = tmp_path / f"{who}.json"
            done = cli("zk", "dump", "--zk", base.connect_string, "--out", str(out), env=env)
            assert done.returncode == 0 and "Traceback" not in done.stderr, (who, done.stderr)
            dumped[who] = [znode["path"] for znode in json.loads(out.read_text())["znodes"]]
        assert dumped["writer"] == dumped["reader"]
        assert {zk_layout.ROUTERS, zk_layout.NODES, zk_layout.store_path(STORE)} <= set(dumped["writer"])
        assert not [p for p in dumped["writer"] if p.startswith((zk_layout.ROUTERS + "/", zk_layout.NODES + "/"))]

        # A persistent record the reader may not read: one line, exit 1, and no partial backup.
        hidden = StoreRecord("hidden", 2, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/snap/hidden")
        lone.create(zk_layout.store_path("hidden"), hidden.to_json())
        out = tmp_path / "partial.json"
        refused = cli("zk", "dump", "--zk", base.connect_string, "--out", str(out), env=READER_ENV)
        assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
        assert "1 persistent record(s)" in refused.stderr and zk_layout.store_path("hidden") in refused.stderr
        assert "Traceback" not in refused.stderr and not out.exists()
        again = cli("zk", "dump", "--zk", base.connect_string, "--out", str(out), env=WRITER_ENV)
        assert again.returncode == 0, again.stderr
        assert zk_layout.store_path("hidden") in [z["path"] for z in json.loads(out.read_text())["znodes"]]
    finally:
        zk.close(lone)
        zk.close(reading)
