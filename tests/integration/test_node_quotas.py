"""Quotas wherever reads are served, on a real cluster (tests/integration/small_cluster.py: two nodes, a
router, ZooKeeper; access control on, the cluster secret proving members): a caller reading straight from the
nodes (direct mode) is admitted at its quota, as through the router; past it, 429 quota_exceeded with
Retry-After; the reads the router passes on to the nodes are not counted again by the nodes.

The caller reads far faster than its quota (20 reads/s: each node admits its share, 10/s) for a window of
about 100 admitted reads, after emptying its buckets; what counts is the ratio of the reads admitted to the
quota times the window the test measured (which holds the servers' own), within 15%: a ratio, not a time
limit. The servers' own counts (`keyroute_node_quota_*`) must agree with the answers the test got."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
import pytest

from keyroute.runtime.settings import ZkSettings
from tests.integration.small_cluster import ADMIN_TOKEN, ROWS, SECRET, STORE, key_path, partition, small_cluster
from tests.util import Proc, free_port, wait_for

pytestmark = pytest.mark.integration

RATE = 20.0
JOB = "batch-job"
TOKENS = (
    f'[[tokens]]\nname = "ops"\ntoken = "{ADMIN_TOKEN}"\nstores = "*"\nadmin = true\n'
    f'[[tokens]]\nname = "{JOB}"\ntoken = "job-t0ken"\nstores = "*"\n'
)
# Any other identity may read 5/s, the identity a member's read arrives under at a node (`member`) included,
# were it counted; the operator's reads (the cluster's settling, the metrics) are not held back.
QUOTAS = f'[identities.{JOB}]\nrate = {RATE}\nburst_s = 1\n[identities."*"]\nrate = 5\n[identities.ops]\nrate = 1e6\n'
JOB_HEADERS = {"authorization": "Bearer job-t0ken"}
OPS_HEADERS = {"authorization": f"Bearer {ADMIN_TOKEN}"}
KEYS = [k for k in ROWS if k.startswith("C")]
# Enough admitted reads in a window that one token more or less at either end of it is well inside 15%.
WINDOW_READS = 100
MOST_REQUESTS = 50_000


def node_counts(http: httpx.Client, node_urls: Sequence[str], identity: str = JOB) -> tuple[float, float]:
    """The nodes' own counts of `identity`'s reads admitted and refused under its quota, summed ("other": of
    identities the quota file does not name)."""
    admitted = refused = 0.0
    for url in node_urls:
        text = http.get(url + "/metrics", headers=OPS_HEADERS).text
        for name, into in (("reads", 0), ("rejections", 1)):
            found = re.search(
                rf'^keyroute_node_quota_{name}_total{{identity="{identity}",store="{STORE}"}} (\S+)$', text, re.M
            )
            value = float(found.group(1)) if found is not None else 0.0
            if into == 0:
                admitted += value
            else:
                refused += value
    return admitted, refused


def drain(http: httpx.Client, urls: Sequence[str]) -> tuple[int, int]:
    """Read through each of `urls` (key read URLs) until one is refused: (admitted, refused)."""
    admitted = refused = 0
    for url in urls:
        for _ in range(1000):
            answer = http.get(url, headers=JOB_HEADERS)
            if answer.status_code == 429:
                refused += 1
                break
            assert answer.status_code == 200, answer.text
            admitted += 1
        else:
            raise AssertionError(f"{url}: 1000 reads and no refusal")
    return admitted, refused


def hammer(
    http: httpx.Client, urls: Sequence[str], check_refusal: Callable[[httpx.Response], None]
) -> tuple[int, int, float]:
    """Key reads through `urls` in turn, as fast as one client goes, until WINDOW_READS are admitted:
    (admitted, refused, seconds from before the first request to after the last)."""
    admitted = refused = 0
    started = time.monotonic()
    for n in range(MOST_REQUESTS):
        answer = http.get(urls[n % len(urls)], headers=JOB_HEADERS)
        if answer.status_code == 200:
            admitted += 1
            if admitted >= WINDOW_READS:
                break
        else:
            assert answer.status_code == 429, answer.text
            check_refusal(answer)
            refused += 1
    else:
        raise AssertionError(f"{MOST_REQUESTS} requests and only {admitted} admitted")
    return admitted, refused, time.monotonic() - started


def refused_by_a_node(answer: httpx.Response) -> None:
    body = answer.json()
    assert body["error"] == "quota_exceeded", body
    assert f"'{JOB}'" in body["message"] and f"'{STORE}'" in body["message"] and "on this node" in body["message"]
    assert int(answer.headers["retry-after"]) >= 1
    assert answer.headers["x-keyroute-node"] in ("n1", "n2")


def refused_by_the_router(answer: httpx.Response) -> None:
    body = answer.json()
    assert body["error"] == "quota_exceeded" and "on this router" in body["message"], body
    assert int(answer.headers["retry-after"]) >= 1
    # Refused by the router itself: a node's refusal would name the node.
    assert "x-keyroute-node" not in answer.headers


def test_a_caller_reading_nodes_directly_is_held_to_its_quota_as_through_the_router(
    tmp_path: Path, zk_settings: ZkSettings
) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(TOKENS, encoding="utf-8")
    quota_file = tmp_path / "quotas.toml"
    quota_file.write_text(QUOTAS, encoding="utf-8")
    # The same quota file on every router and node, as one ConfigMap would give it.
    args = ["--access-tokens", str(tokens), "--cluster-secret", SECRET, "--quota-file", str(quota_file)]
    with (
        small_cluster(tmp_path, zk_settings, extra_args=args, http_options={"headers": OPS_HEADERS}) as c,
        httpx.Client(timeout=10, trust_env=False) as http,
    ):
        # Direct mode: each key read goes to the node serving its partition, one key of each node in turn.
        serving = c.serving()
        node_of = {key: serving[partition(key)][0] for key in KEYS}
        direct = [
            c.node_urls[node_id] + key_path(next(k for k in KEYS if node_of[k] == node_id))
            for node_id in sorted(c.node_urls)
        ]
        assert len(direct) == 2

        # Each node's bucket starts full (its share: half the rate, one second of it) and is emptied.
        drained, drain_refused = drain(http, direct)
        assert drained >= RATE  # 10 on each node, and what came due while they were read
        admitted, refused, seconds = hammer(http, direct, refused_by_a_node)
        # Far above the quota: most requests were refused.
        assert refused > admitted, (admitted, refused, seconds)
        ratio = admitted / (RATE * seconds)
        assert 0.85 <= ratio <= 1.15, (admitted, refused, seconds)
        # Each node's table: its share of the quota, by the two nodes serving the store.
        for url in c.node_urls.values():
            table = http.get(url + "/admin/quotas", headers=OPS_HEADERS).json()
            (bucket,) = (b for b in table["buckets"] if b["identity"] == JOB)
            assert (bucket["quota"], bucket["share"], bucket["nodes"]) == (RATE, RATE / 2, 2), table
        # The nodes' own counts are the answers the caller got.
        assert node_counts(http, list(c.node_urls.values())) == (drained + admitted, drain_refused + refused)

        # A batch-get costs its keys: a drained node refuses one too.
        batch_url = c.node_urls["n1"] + f"/stores/{STORE}/batch-get"
        batch = http.post(batch_url, json={"keys": KEYS[:3]}, headers=JOB_HEADERS)
        assert batch.status_code == 429 and batch.json()["error"] == "quota_exceeded", batch.text
        before = node_counts(http, list(c.node_urls.values()))

        # Through the router, with the nodes' buckets empty: the router admits the caller at its quota, and
        # the nodes admit every read it passes on (a member's read is not counted again).
        router_urls = [c.router_url + key_path(key) for key in KEYS]
        drain(http, router_urls[:1])
        admitted, refused, seconds = hammer(http, router_urls, refused_by_the_router)
        assert refused > admitted, (admitted, refused, seconds)
        ratio = admitted / (RATE * seconds)
        assert 0.85 <= ratio <= 1.15, (admitted, refused, seconds)
        assert node_counts(http, list(c.node_urls.values())) == before
        assert node_counts(http, list(c.node_urls.values()), "other") == (0, 0)


def test_a_node_with_quotas_and_no_member_proof_does_not_start(tmp_path: Path, zk_settings: ZkSettings) -> None:
    quota_file = tmp_path / "quotas.toml"
    quota_file.write_text(QUOTAS, encoding="utf-8")
    bad = tmp_path / "bad.toml"
    bad.write_text("[identities.anonymous]\nrate = 0\n", encoding="utf-8")
    base = ["node", "--zk", zk_settings.connect_string, "--node-id", "q1", "--data-dir", str(tmp_path / "data")]
    for extra, says in (
        (["--quota-file", str(quota_file)], "--quota-file on a node needs --cluster-secret or --member-ca"),
        (["--quota-file", str(bad), "--cluster-secret", SECRET], "identities.anonymous.rate must be a positive"),
    ):
        node = Proc([*base, "--port", str(free_port()), *extra], tmp_path / "node.log").start()
        try:
            wait_for(lambda node=node: not node.alive, timeout_s=60, message="the node to stop")
            assert node.stop() == 1
            out = node.output()
            assert says in out and "Traceback" not in out, out
        finally:
            node.stop()
        (tmp_path / "node.log").unlink()
