"""Quotas on real routers (tests/integration/small_cluster.py: two nodes, a router, ZooKeeper): a quota file
changed while the router runs takes effect; past the quota, 429 quota_exceeded with Retry-After; a second
router registers in ZooKeeper, both list it, and each then enforces half of the quota.

Every caller is the anonymous identity until authentication sets one. The quota is tiny and its burst long
(0.02 reads/s, 1000 s of burst: 20 reads for one router), so that the counts do not depend on how fast the
test runs: a token comes back every 50 s."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from keyroute.runtime.settings import ZkSettings
from tests.integration.small_cluster import ADMIN_TOKEN, ROWS, SECRET, STORE, key_path, small_cluster
from tests.util import Proc, free_port, wait_for

pytestmark = pytest.mark.integration

UNLIMITED = "[identities.anonymous.stores]\nsome_other_store = 1\n"
TINY = "[identities.anonymous]\nrate = 0.02\nburst_s = 1000\n"
KEYS = [k for k in ROWS if k.startswith("C")]


def quotas_of(http: httpx.Client, router_url: str) -> dict[str, Any]:
    answer = http.get(router_url + "/admin/quotas")
    assert answer.status_code == 200, answer.text
    return answer.json()  # type: ignore[no-any-return]


def reads_until_refused(http: httpx.Client, router_url: str, most: int = 100) -> tuple[int, httpx.Response]:
    """Key reads until one is refused: how many were answered 200, and the refusal."""
    for n in range(most):
        answer = http.get(router_url + key_path(KEYS[n % len(KEYS)]))
        if answer.status_code != 200:
            return n, answer
    raise AssertionError(f"{most} reads and no refusal")


def metric(text: str, name: str) -> float:
    found = re.search(rf'^{name}{{identity="anonymous",store="{STORE}"}} (\S+)$', text, re.M)
    assert found is not None, name
    return float(found.group(1))


def test_a_changed_quota_file_applies_429s_and_two_routers_split_the_quota(
    tmp_path: Path, zk_settings: ZkSettings
) -> None:
    quota_file = tmp_path / "quotas.toml"
    quota_file.write_text(UNLIMITED)
    args = ["--quota-file", str(quota_file), "--zk-session-timeout-s", "4"]
    with (
        small_cluster(tmp_path, zk_settings, router_args=args) as c,
        httpx.Client(timeout=10, trust_env=False) as http,
    ):
        # The cluster settled with every key read: this store has no quota yet.
        wait_for(lambda: quotas_of(http, c.router_url)["routers"] == 1, message="the router registered")
        summary = http.get(c.router_url + "/admin/partition-map").json()
        assert [r["url"] for r in summary["routers"]] == [c.router_url]

        # Changed while the router runs: in force at the next look at the file.
        quota_file.write_text(TINY)
        wait_for(
            lambda: http.get(c.router_url + key_path(KEYS[0])).status_code == 429,
            timeout_s=30,
            message="the new quota in force",
        )
        (bucket,) = quotas_of(http, c.router_url)["buckets"]
        assert (bucket["identity"], bucket["store"]) == ("anonymous", STORE)
        assert (bucket["quota"], bucket["share"]) == (0.02, 0.02)
        assert bucket["reads"] == 20 and bucket["rejected"] >= 1

        refused = http.get(c.router_url + key_path(KEYS[1]))
        assert refused.status_code == 429
        body = refused.json()
        assert body["error"] == "quota_exceeded"
        assert "'anonymous'" in body["message"] and f"'{STORE}'" in body["message"]
        assert 1 <= int(refused.headers["retry-after"]) <= 50  # one token at 0.02/s
        batch = http.post(c.router_url + f"/stores/{STORE}/batch-get", json={"keys": KEYS[:3]})
        assert batch.status_code == 429 and batch.json()["error"] == "quota_exceeded"
        for limit, read in (("", "/range"), ("?limit=5", "/range")):
            assert http.get(c.router_url + f"/stores/{STORE}{read}{limit}").status_code == 429
        assert http.get(c.router_url + key_path(KEYS[0]) + "/history").status_code == 429

        exposition = http.get(c.router_url + "/metrics").text
        assert metric(exposition, "keyroute_router_quota_reads_total") == 20
        assert metric(exposition, "keyroute_router_quota_rejections_total") >= 6

        # A second router: both see two routers up, and each enforces half of the quota.
        port = free_port()
        second_url = f"http://127.0.0.1:{port}"
        second = Proc(
            ["router", "--zk", zk_settings.connect_string, "--port", str(port), *args], tmp_path / "router2.log"
        ).start()
        c.procs.append(second)
        for url in (c.router_url, second_url):
            wait_for(lambda url=url: quotas_of(http, url)["routers"] == 2, timeout_s=30, message=f"{url}: 2 routers")
        summary = http.get(c.router_url + "/admin/partition-map").json()
        assert sorted(r["url"] for r in summary["routers"]) == sorted([c.router_url, second_url])
        for url in (c.router_url, second_url):
            admitted, refusal = reads_until_refused(http, url)
            assert (admitted, refusal.status_code) == (10, 429), url
            assert quotas_of(http, url)["buckets"][0]["share"] == 0.01

        # The second router stops: its record goes at once, and the first enforces the whole quota again.
        second.stop()
        wait_for(lambda: quotas_of(http, c.router_url)["routers"] == 1, timeout_s=30, message="1 router again")
        admitted, _ = reads_until_refused(http, c.router_url)
        assert admitted == 20


def test_a_quota_file_that_does_not_load_stops_the_router_in_one_line(tmp_path: Path, zk_settings: ZkSettings) -> None:
    bad = tmp_path / "quotas.toml"
    bad.write_text("[identities.anonymous]\nrate = -3\n")
    router = Proc(
        ["router", "--zk", zk_settings.connect_string, "--port", str(free_port()), "--quota-file", str(bad)],
        tmp_path / "router.log",
    ).start()
    try:
        wait_for(lambda: not router.alive, timeout_s=60, message="the router to stop")
        assert router.stop() == 1
        out = router.output()
        assert "identities.anonymous.rate must be a positive number" in out and "Traceback" not in out
    finally:
        router.stop()


def test_quotas_follow_the_token_a_caller_reads_with(tmp_path: Path, zk_settings: ZkSettings) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(
        f'[[tokens]]\nname = "ops"\ntoken = "{ADMIN_TOKEN}"\nstores = "*"\nadmin = true\n'
        '[[tokens]]\nname = "batch-job"\ntoken = "job-t0ken"\nstores = "*"\n'
        '[[tokens]]\nname = "web"\ntoken = "web-t0ken"\nstores = "*"\n',
        encoding="utf-8",
    )
    quota_file = tmp_path / "quotas.toml"
    quota_file.write_text("[identities.batch-job]\nrate = 0.02\nburst_s = 1000\n[identities.web]\nrate = 1000\n")
    args = ["--access-tokens", str(tokens), "--cluster-secret", SECRET]
    ops = {"headers": {"authorization": f"Bearer {ADMIN_TOKEN}"}}
    with (
        small_cluster(
            tmp_path, zk_settings, extra_args=args, router_args=["--quota-file", str(quota_file)], http_options=ops
        ) as c,
        httpx.Client(timeout=10, trust_env=False) as http,
    ):
        job = {"authorization": "Bearer job-t0ken"}
        web = {"authorization": "Bearer web-t0ken"}
        admitted = 0
        for n in range(25):
            answer = http.get(c.router_url + key_path(KEYS[n % len(KEYS)]), headers=job)
            if answer.status_code == 429:
                break
            assert answer.status_code == 200, answer.text
            admitted += 1
        assert admitted == 20
        assert "'batch-job'" in answer.json()["message"] and answer.headers["retry-after"]
        # The other caller, through the same router, is not held back.
        for key in KEYS:
            assert http.get(c.router_url + key_path(key), headers=web).status_code == 200
        exposition = http.get(c.router_url + "/metrics", **ops).text
        assert re.search(
            rf'^keyroute_router_quota_rejections_total{{identity="batch-job",store="{STORE}"}} 1\.0$', exposition, re.M
        )
        assert re.search(
            rf'^keyroute_router_quota_reads_total{{identity="web",store="{STORE}"}} {len(KEYS)}\.0$', exposition, re.M
        )
