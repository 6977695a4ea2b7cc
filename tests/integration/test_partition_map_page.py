"""The router's partition-map page (/admin/ui) in a real headless browser: Debian's Chromium, driven by
Playwright, against a real cluster (two node processes, a router, ZooKeeper). The page renders the live
cluster and, after a node is killed, shows the change within seconds without a reload; an unauthorised
request gets the 401 JSON. Screenshots are saved (KEYROUTE_TEST_ARTIFACTS, else the test's directory)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest

from keyroute.core.settings import ZkSettings
from tests.integration.small_cluster import ADMIN_TOKEN, PARTITIONS, STORE, small_cluster

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not os.path.exists(CHROMIUM),
        reason="needs Debian's Chromium: `apt-get install chromium` (.ci/run installs it)",
    ),
]

# As the machine's closed network needs: no background connections, no sandbox as root, no GPU.
LAUNCH_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def artifacts(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("KEYROUTE_TEST_ARTIFACTS", tmp_path))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def test_the_page_shows_the_cluster_and_a_killed_node_within_seconds(tmp_path: Path, zk_settings: ZkSettings) -> None:
    from playwright.sync_api import sync_playwright

    with small_cluster(tmp_path, zk_settings, router_args=["--admin-token", ADMIN_TOKEN]) as cluster:
        refused = httpx.get(cluster.router_url + "/admin/partition-map", timeout=5)
        assert refused.status_code == 401
        assert refused.headers["content-type"].startswith("application/json")
        assert refused.json()["error"] == "unauthorized"
        # The page sends a browser without a session to the login form; a token in its URL is never honoured.
        for params in ({}, {"token": "nope"}, {"token": ADMIN_TOKEN}):
            redirected = httpx.get(cluster.router_url + "/admin/ui", params=params, timeout=5)
            assert redirected.status_code == 303 and redirected.headers["location"] == "/admin/login"

        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1100, "height": 900})
                page.goto(f"{cluster.router_url}/admin/ui")
                assert page.url.endswith("/admin/login")
                page.fill('input[name="token"]', ADMIN_TOKEN)
                page.click('button[type="submit"]')
                store = f'section[data-store="{STORE}"]'
                page.wait_for_selector(f"{store} tr[data-partition]", timeout=15_000)
                assert page.url.endswith("/admin/ui") and ADMIN_TOKEN not in page.url
                assert page.locator(f"{store} tr[data-partition]").count() == PARTITIONS
                page.wait_for_function(
                    f"""() => document.querySelectorAll('{store} [data-state="serving"]').length === {PARTITIONS}""",
                    timeout=15_000,
                )
                for node_id in ("n1", "n2"):
                    assert page.locator(f'#nodes tr[data-node="{node_id}"]').count() == 1
                placement = cluster.placement()
                on_n2 = [p for p, (serving, _) in placement.items() if "n2" in serving]
                assert on_n2, placement
                for p in on_n2:
                    replica = page.locator(f'{store} tr[data-partition="{p}"] [data-replica="n2"]')
                    assert replica.get_attribute("data-state") == "serving"
                page.screenshot(path=str(artifacts(tmp_path) / "partition-map.png"), full_page=True)

                cluster.procs[1].kill9()  # n2
                # Without a reload: n2 leaves the map once its session expires (4 s), and its partitions show
                # another state than served by n2 (unserved, or moved to n1).
                page.wait_for_function(
                    """() => {
                        const row = document.querySelector('#nodes tr[data-node="n2"]');
                        return row === null || row.textContent.includes("gone");
                    }""",
                    timeout=20_000,
                )
                for p in on_n2:
                    replica = page.locator(
                        f'{store} tr[data-partition="{p}"] [data-replica="n2"][data-state="serving"]'
                    )
                    assert replica.count() == 0
                page.screenshot(path=str(artifacts(tmp_path) / "partition-map-after-kill.png"), full_page=True)
            finally:
                browser.close()
