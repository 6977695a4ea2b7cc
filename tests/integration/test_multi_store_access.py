"""Access control and quotas of multi-store reads on a real cluster (two `keyroute node` processes, a `keyroute
router`, tokens and a quota file): a caller allowed stores a and b but not c reads a and b together, and any
read naming c is 403 naming c alone, through the router and straight at a node, for one key and for a batch;
each store's reads are counted against that store's quota, as single reads are."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest

from keyroute.cluster import zk, zk_layout
from keyroute.cluster.partition_map import StoreRecord
from keyroute.dev.zookeeper_server import EmbeddedZooKeeper
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.runtime.settings import ZkSettings
from tests.integration.small_cluster import ADMIN_TOKEN, PARTITIONS, ROWS, SECRET, STORE, SmallCluster, small_cluster
from tests.integration.test_node import write_snapshot
from tests.util import wait_for

pytestmark = pytest.mark.integration

A, B, C = STORE, "profile", "balance"  # bookings (the small cluster's own), and two co-located with it
READER = "reader-t0ken"  # may read A and B, not C
QUOTED = "quoted-t0ken"  # may read every store; 10 reads of B in a burst that comes back in 1000 s
KEY = "C001"
TOKENS = f"""
[[tokens]]
name = "ops"
token = "{ADMIN_TOKEN}"
stores = "*"
admin = true

[[tokens]]
name = "reader"
token = "{READER}"
stores = ["{A}", "{B}"]

[[tokens]]
name = "quoted"
token = "{QUOTED}"
stores = "*"
"""
QUOTAS = f"""
[identities.quoted.stores]
{B} = 0.01
[identities.quoted]
burst_s = 1000
"""


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def cluster(zk_server: EmbeddedZooKeeper, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SmallCluster]:
    zk_settings = ZkSettings(hosts=zk_server.connect_string, chroot=f"/t-{uuid.uuid4().hex[:12]}", session_timeout_s=4)
    tmp_path = tmp_path_factory.mktemp("multi-store-access")
    (tmp_path / "tokens.toml").write_text(TOKENS, encoding="utf-8")
    (tmp_path / "quotas.toml").write_text(QUOTAS, encoding="utf-8")
    args = ["--cluster-secret", SECRET, "--access-tokens", str(tmp_path / "tokens.toml"), "--admin-token", ADMIN_TOKEN]
    args += ["--quota-file", str(tmp_path / "quotas.toml")]
    with small_cluster(tmp_path, zk_settings, extra_args=args, http_options={"headers": bearer(ADMIN_TOKEN)}) as c:
        client = zk.connect(zk_settings)
        try:
            for store in (B, C):
                rows = {key: {"store": store, **value} for key, value in ROWS.items()}
                snapshot = write_snapshot(tmp_path / store, store, rows, KeyFormat.STRING, PARTITIONS)
                record = StoreRecord(
                    store, PARTITIONS, Partitioner.MURMUR2, KeyFormat.STRING, 1, snapshot, ("v",), colocate_with=A
                )
                client.create(zk_layout.store_path(store), record.to_json(), makepath=True)
        finally:
            zk.close(client)
        wait_for(
            lambda: all(
                httpx.get(f"{c.router_url}/stores/{s}/keys/{KEY}", headers=bearer(ADMIN_TOKEN)).status_code == 200
                for s in (B, C)
            ),
            timeout_s=60,
            message="the stores to be served",
        )
        yield c


def urls(cluster: SmallCluster) -> list[str]:
    return [cluster.router_url, *cluster.node_urls.values()]


@pytest.mark.parametrize(
    ("stores", "refused"),
    [
        ((A,), None),
        ((B,), None),
        ((A, B), None),
        ((B, A), None),
        ((C,), (C,)),
        ((A, C), (C,)),
        ((C, B), (C,)),
        ((A, B, C), (C,)),
    ],
)
def test_every_store_named_is_checked(cluster: SmallCluster, stores: tuple[str, ...], refused: tuple[str, ...]) -> None:
    for url in urls(cluster):
        one = httpx.get(f"{url}/stores/{','.join(stores)}/read/{KEY}", headers=bearer(READER))
        many = httpx.post(f"{url}/stores/{','.join(stores)}/read", json={"keys": [KEY]}, headers=bearer(READER))
        for answer in (one, many):
            if refused is None:
                assert answer.status_code == 200, (url, answer.text)
                body = answer.json()
                entries = body["stores"] if "stores" in body else body["results"][0]["stores"]
                assert list(entries) == list(stores)
                assert all(entry["status"] == 200 for entry in entries.values()), entries
            else:
                assert answer.status_code == 403, (url, answer.text)
                message = answer.json()["message"]
                assert answer.json()["error"] == "forbidden"
                assert all(repr(store) in message for store in refused), message
                assert not any(repr(store) in message for store in stores if store not in refused), message


def test_without_credentials_a_multi_store_read_is_401_and_every_store_answers_the_admin(cluster: SmallCluster) -> None:
    for url in urls(cluster):
        assert httpx.get(f"{url}/stores/{A},{B}/read/{KEY}").status_code == 401
        answer = httpx.get(f"{url}/stores/{A},{B},{C}/read/{KEY}", headers=bearer(ADMIN_TOKEN))
        assert answer.status_code == 200, answer.text
        assert [e["value"]["store"] for e in list(answer.json()["stores"].values())[1:]] == [B, C]


def test_each_store_is_counted_against_its_own_quota(cluster: SmallCluster) -> None:
    # A multi-store read costs each store what a get of it costs: 10 reads of B, in gets or in multi-store
    # reads, spend the router's burst for B; A and C stay unlimited.
    http = httpx.Client(timeout=10, headers=bearer(QUOTED))
    router = cluster.router_url
    for _ in range(5):
        assert http.get(f"{router}/stores/{B}/keys/{KEY}").status_code == 200
    for _ in range(5):
        assert http.get(f"{router}/stores/{A},{B}/read/{KEY}").status_code == 200
    refused = http.get(f"{router}/stores/{A},{B},{C}/read/{KEY}")
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"] == "quota_exceeded" and repr(B) in refused.json()["message"]
    assert http.get(f"{router}/stores/{B}/keys/{KEY}").status_code == 429
    assert http.get(f"{router}/stores/{A},{C}/read/{KEY}").status_code == 200
    # A batch costs each store its number of keys.
    assert http.post(f"{router}/stores/{A},{C}/read", json={"keys": [KEY] * 50}).status_code == 200
    assert http.post(f"{router}/stores/{A},{B}/read", json={"keys": {A: [KEY], B: [KEY]}}).status_code == 429
