"""keyroute.local on a real cluster: ZooKeeper, two `keyroute node` processes and a router (small_cluster), a
LocalReplica following the same chroot. Every answer of the replica (gets, batches, key ranges) equals the
cluster's (read with keyroute.client through the router) for the same key, before and after a version swap;
a subset of partitions answers the others through the cluster with `fallback="router"`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from keyroute.client import Client, KeyNotFound, KeyrouteError, StoreNotFound, Value
from keyroute.cluster import zk, zk_layout
from keyroute.cluster.partition_map import StoreRecord
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.local import LocalReplica, NotHeld
from keyroute.runtime.settings import ZkIdentity, ZkSettings
from tests.integration.small_cluster import PARTITIONS, ROWS, STORE, partition, small_cluster
from tests.integration.test_node import write_snapshot
from tests.util import wait_for

pytestmark = pytest.mark.integration


def same(local: Value | KeyrouteError, cluster: Value | KeyrouteError) -> bool:
    """Equal answers: the same value, version, partition and offset, or the same error code."""
    if isinstance(local, KeyrouteError) or isinstance(cluster, KeyrouteError):
        return type(local) is type(cluster) and getattr(local, "code", None) == getattr(cluster, "code", None)
    return dataclasses.replace(local, node=None) == dataclasses.replace(cluster, node=None)


def answer(read: Any, *args: Any) -> Value | KeyrouteError:
    try:
        return read(*args)
    except KeyrouteError as exc:
        return exc


def publish_version(tmp: Path, settings: ZkSettings, rows: dict[str, Any], version: int) -> None:
    snapshot = write_snapshot(tmp / f"snapshots-v{version}", STORE, rows, KeyFormat.STRING, PARTITIONS, version)
    client = zk.connect(settings)
    try:
        raw, _ = client.get(zk_layout.store_path(STORE))
        record = dataclasses.replace(StoreRecord.from_json(raw), version=version, snapshot=snapshot)
        client.set(zk_layout.store_path(STORE), record.to_json())
    finally:
        zk.close(client)


def test_every_answer_equals_the_clusters_across_a_version_swap(tmp_path: Path, zk_settings: ZkSettings) -> None:
    keys = [*ROWS, "nope", "C999"]
    leftover = tmp_path / "local" / "stores" / STORE / "v7" / "p0"  # what an earlier run left behind
    leftover.mkdir(parents=True)
    (leftover / "data.mdb").write_bytes(b"old")
    with (
        small_cluster(tmp_path, zk_settings) as cluster,
        Client(cluster.router_url) as client,
        LocalReplica(zk_settings, [STORE], tmp_path / "local", registry=None) as replica,
    ):
        replica.wait_ready(timeout_s=60)
        assert replica.applying
        wait_for(lambda: not leftover.parent.exists(), message="the leftover version to go")
        for key in keys:
            local, remote = answer(replica.get, STORE, key), answer(client.get, STORE, key)
            assert same(local, remote), (key, local, remote)
        assert isinstance(answer(replica.get, STORE, "nope"), KeyNotFound)
        local_many = replica.get_many(STORE, keys)
        remote_many = client.get_many(STORE, keys)
        assert all(same(a, b) for a, b in zip(local_many, remote_many, strict=True))
        with pytest.raises(StoreNotFound):
            replica.get("nowhere", "C001")
        # Projections as the cluster's: the store's one column ("v", which these values lack), or 400
        # unknown_fields naming the others.
        for fields in ("v", ["v"], "fare,v"):
            for key in ("C002", "nope"):
                local = answer(lambda k=key, f=fields: replica.get(STORE, k, fields=f))
                remote = answer(lambda k=key, f=fields: client.get(STORE, k, fields=f))
                assert same(local, remote), (fields, key, local, remote)
        assert getattr(answer(lambda: replica.get(STORE, "C002", fields="fare")), "code", None) == "unknown_fields"
        local_many = replica.get_many(STORE, keys, fields="v")
        assert all(same(a, b) for a, b in zip(local_many, client.get_many(STORE, keys, fields="v"), strict=True))
        assert all(a.value == {} for a in local_many if isinstance(a, Value))
        for bounds in ({}, {"prefix": "C0"}, {"from_key": "C010", "to_key": "C020"}, {"from_key": "a"}):
            local_keys = list(replica.range(STORE, **bounds))
            assert local_keys == list(client.range(STORE, **bounds, page_size=7)) and local_keys, bounds
        assert replica.status() == {STORE: {p: {"version": 1} for p in range(PARTITIONS)}}

        # Version 2 changes every value and drops a key: once the cluster and the replica both serve it, the
        # answers are equal again; until then each answers from a whole version (never a mix within a key).
        newer = {key: {**value, "v2": True} for key, value in ROWS.items() if key != "C001"}
        publish_version(tmp_path, zk_settings, newer, 2)

        def on_v2() -> bool:
            return all(
                isinstance(v, Value) and v.version == 2
                for v in (answer(client.get, STORE, k) for k in ("C000", "C002", "C003", "C004", "C005"))
            )

        while replica.status()[STORE][0]["version"] != 2:  # read all the way through the swap
            found = replica.get(STORE, "C002")
            assert found.value == (ROWS["C002"] if found.version == 1 else newer["C002"])
        wait_for(on_v2, timeout_s=60, message="the cluster to serve version 2")
        assert replica.status() == {STORE: {p: {"version": 2} for p in range(PARTITIONS)}}
        for key in keys:
            local, remote = answer(replica.get, STORE, key), answer(client.get, STORE, key)
            assert same(local, remote), (key, local, remote)
        assert isinstance(answer(replica.get, STORE, "C001"), KeyNotFound)
        # The superseded version's files go once its grace period is over.
        wait_for(lambda: not (tmp_path / "local" / "stores" / STORE / "v1").exists(), message="v1's files to go")


def test_a_chosen_subset_holds_only_its_partitions_and_falls_back_to_the_router(
    tmp_path: Path, zk_settings: ZkSettings
) -> None:
    held = {0, 2}
    inside = next(k for k in ROWS if partition(k) in held)
    outside = next(k for k in ROWS if partition(k) not in held)
    with small_cluster(tmp_path, zk_settings) as cluster, Client(cluster.router_url) as client:
        registry = CollectorRegistry()
        with LocalReplica(zk_settings, [STORE], tmp_path / "a", partitions={STORE: held}, registry=registry) as replica:
            replica.wait_ready(timeout_s=60)
            assert set(replica.status()[STORE]) == held
            scraped = generate_latest(registry).decode()
            assert "keyroute_local_applying 1.0" in scraped
            for p in range(PARTITIONS):
                line = f'keyroute_local_partition_version{{partition="{p}",store="{STORE}"}} 1.0'
                assert (line in scraped) == (p in held), (p, scraped)
            assert same(replica.get(STORE, inside), client.get(STORE, inside))
            with pytest.raises(NotHeld, match=f"partition {partition(outside)} of store"):
                replica.get(STORE, outside)
            # Following a consumer's assignment: the partitions it is given are loaded, the others let go.
            replica.set_partitions(STORE, [1])
            wait_for(lambda: set(replica.status()[STORE]) == {1}, timeout_s=30, message="the new subset")
        with LocalReplica(
            zk_settings, [STORE], tmp_path / "b", partitions={STORE: held}, fallback="router",
            router=cluster.router_url, registry=None,
        ) as replica:  # fmt: skip
            replica.wait_ready(timeout_s=60)
            for key in ROWS:
                assert same(replica.get(STORE, key), client.get(STORE, key)), key
            assert replica.get(STORE, outside).node in cluster.node_urls  # read through the cluster
            assert replica.get(STORE, inside).node == "local"
            keys = [*ROWS, "nope"]
            assert all(
                same(a, b) for a, b in zip(replica.get_many(STORE, keys), client.get_many(STORE, keys), strict=True)
            )
            assert list(replica.range(STORE)) == list(client.range(STORE))  # a range needs every partition


def test_a_reader_identity_suffices_and_records_it_may_not_read_are_not_held(
    tmp_path: Path, zk_settings: ZkSettings
) -> None:
    """The cluster's records belong to the writer identity and only its reader identity may read them: a
    replica with the reader identity holds the store; one without any identity reads nothing and says so."""
    writer = ZkIdentity("keyroute-writer", "writer-secret")
    reader = ZkIdentity("keyroute-reader", "reader-secret")
    writing = dataclasses.replace(zk_settings, auth=writer, reader=reader)
    snapshot = write_snapshot(tmp_path / "snapshots", STORE, ROWS, KeyFormat.STRING, PARTITIONS)
    record = StoreRecord(STORE, PARTITIONS, Partitioner.MURMUR2, KeyFormat.STRING, 1, snapshot, ("v",))
    client = zk.connect(writing)
    try:
        client.create(zk_layout.store_path(STORE), record.to_json(), makepath=True)
    finally:
        zk.close(client)
    reading = dataclasses.replace(zk_settings, auth=reader)
    with LocalReplica(reading, [STORE], tmp_path / "reader", registry=None) as replica:
        replica.wait_ready(timeout_s=60)
        for key, value in ROWS.items():
            assert replica.get(STORE, key).value == json.loads(json.dumps(value)), key
    with LocalReplica(zk_settings, [STORE], tmp_path / "anonymous", registry=None) as replica:
        with pytest.raises(TimeoutError, match=STORE):
            replica.wait_ready(timeout_s=3)
        with pytest.raises(NotHeld):
            replica.get(STORE, "C001")
