"""The router's partition-map page (/admin/ui) in a real headless browser: Debian's Chromium, driven by
Playwright. Against a real cluster (two node processes, a router, ZooKeeper) the page renders the summary
and a store's partitions and, after a node is killed, shows the change within seconds without a reload, naming
the node that died, when it was last seen and what it held.
Against a router serving a 1,000-node map (100 stores x 1,000 partitions, rf 3, built from records) it
renders the summary, the node grid and a drill-down within seconds, downloading neither the whole map nor
partitions it does not show. A router with an admin token answers the 401 JSON, and the page, refused by the
API, goes to the login page. Screenshots are saved (KEYROUTE_TEST_ARTIFACTS, else the test's directory)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from keyroute.runtime.settings import ZkSettings
from tests.integration.small_cluster import ADMIN_TOKEN, PARTITIONS, STORE, small_cluster
from tests.util import free_port, wait_for

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
TOKEN = "page-t0ken"


def artifacts(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("KEYROUTE_TEST_ARTIFACTS", tmp_path))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextmanager
def records_router(tmp_path: Path, *args: str) -> Iterator[str]:
    """A router process serving a map built from records (tests/integration/records_router.py)."""
    port = free_port()
    log = open(tmp_path / f"records-router-{port}.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.records_router", "--port", str(port), *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=Path(__file__).resolve().parents[2],
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(url + "/readyz", timeout=5).status_code == 200, 120, message="records router")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        log.close()


@contextmanager
def browser_page(width: int = 1300, height: int = 1000):  # type: ignore[no-untyped-def]
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            yield browser.new_page(viewport={"width": width, "height": height})
        finally:
            browser.close()


def test_the_page_shows_the_cluster_and_a_killed_node_within_seconds(tmp_path: Path, zk_settings: ZkSettings) -> None:
    with small_cluster(tmp_path, zk_settings) as cluster, browser_page() as page:
        page.goto(f"{cluster.router_url}/admin/ui")
        page.wait_for_selector(f'#stores tr[data-store="{STORE}"]', timeout=15_000)
        for node_id in ("n1", "n2"):
            page.wait_for_selector(f'#grid [data-node="{node_id}"][data-state="up"]', timeout=15_000)
        page.click(f'#stores tr[data-store="{STORE}"] button')
        rows = "#partitions tr[data-partition]"
        page.wait_for_function(
            f"""() => document.querySelectorAll('{rows}').length === {PARTITIONS} &&
                document.querySelectorAll('#partitions [data-state="serving"]').length === {PARTITIONS}""",
            timeout=15_000,
        )
        placement = cluster.placement()
        on_n2 = [p for p, (serving, _) in placement.items() if "n2" in serving]
        assert on_n2, placement
        for p in on_n2:
            replica = page.locator(f'#partitions tr[data-partition="{p}"] [data-replica="n2"]')
            assert replica.get_attribute("data-state") == "serving"
        assert page.locator("#problems li").first.text_content().startswith("nothing")
        page.screenshot(path=str(artifacts(tmp_path) / "partition-map.png"), full_page=True)

        cluster.procs[1].kill9()  # n2
        # Without a reload: n2 leaves the map once its session expires (4 s), and its partitions show
        # another state than served by n2 (unserved, or moved to n1).
        page.wait_for_function(
            """() => {
                const cell = document.querySelector('#grid [data-node="n2"]');
                return cell === null || cell.getAttribute("data-state") === "gone";
            }""",
            timeout=20_000,
        )
        page.wait_for_function(
            '() => document.querySelectorAll(\'#partitions [data-replica="n2"][data-state="serving"]\').length === 0',
            timeout=20_000,
        )
        # The page names what broke: n2 by name, gone, when last seen and what it held; cells say their names.
        departed = page.wait_for_selector('#departed li[data-node="n2"][data-state="gone"]', timeout=20_000)
        text = departed.text_content()
        held = len(on_n2)
        assert "n2" in text and "last seen" in text, text
        assert f"held {held} partition{'' if held == 1 else 's'}" in text, text
        assert page.locator('#grid [data-node="n2"]').text_content() == "n2 (gone)"
        assert page.locator('#grid [data-node="n1"]').text_content() == "n1"
        assert "1 node registered" in page.locator("#totals").text_content()
        # rf 1: n1 takes n2's partitions over, and the page counts them as served again (without a reload).
        page.wait_for_function(
            f"""() => document.querySelector('#departed li[data-node="n2"]').textContent
                .includes("{held} of them served as asked again")""",
            timeout=30_000,
        )
        page.screenshot(path=str(artifacts(tmp_path) / "partition-map-after-kill.png"), full_page=True)


def test_a_router_with_an_admin_token_sends_the_page_to_the_login_and_shows_it_after(tmp_path: Path) -> None:
    args = ("--nodes", "3", "--stores", "1", "--partitions", "4", "--rf", "1", "--admin-token", TOKEN)
    with records_router(tmp_path, *args) as url:
        refused = httpx.get(url + "/admin/partition-map", timeout=5)
        assert refused.status_code == 401
        assert refused.headers["content-type"].startswith("application/json")
        assert refused.json()["error"] == "unauthorized"
        # The page sends a browser without a session to the login form; a token in its URL is never honoured.
        for params in ({}, {"token": "nope"}, {"token": TOKEN}):
            redirected = httpx.get(url + "/admin/ui", params=params, timeout=5)
            assert redirected.status_code == 303 and redirected.headers["location"] == "/admin/login"
        # The API takes the header; the routing view is open like the data API.
        headers = {"authorization": f"Bearer {TOKEN}"}
        assert httpx.get(url + "/admin/partition-map", headers=headers, timeout=5).status_code == 200
        assert httpx.get(url + "/routing", timeout=5).status_code == 200
        with browser_page() as page:
            page.goto(f"{url}/admin/ui?token={TOKEN}")
            page.wait_for_url("**/admin/login", timeout=15_000)
            page.fill('input[name="token"]', TOKEN)
            page.click('button[type="submit"]')
            page.wait_for_url("**/admin/ui", timeout=15_000)
            page.wait_for_selector("#stores tr[data-store]", timeout=15_000)
            assert TOKEN not in page.url


def test_with_access_control_an_admin_caller_logs_in_and_sees_the_map(tmp_path: Path, zk_settings: ZkSettings) -> None:
    ops, reader = ADMIN_TOKEN, "re4der-t0ken"  # small_cluster reads the map with ADMIN_TOKEN: ops's here
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(
        f'[[tokens]]\nname = "ops"\ntoken = "{ops}"\nstores = "*"\nadmin = true\n\n'
        f'[[tokens]]\nname = "reader"\ntoken = "{reader}"\nstores = ["{STORE}"]\n',
        encoding="utf-8",
    )
    # Access control on and no admin token: the token file's admin caller is the only way in.
    args = ["--cluster-secret", "page-s3cret", "--access-tokens", str(tokens)]
    options = {"headers": {"authorization": f"Bearer {ops}"}}
    with small_cluster(tmp_path / "cluster", zk_settings, extra_args=args, http_options=options) as cluster:
        url = cluster.router_url
        # No redirect loop: the page sends a browser to the login form, which is shown.
        assert httpx.get(url + "/admin/ui", timeout=5).headers["location"] == "/admin/login"
        assert httpx.get(url + "/admin/login", timeout=5).status_code == 200
        with browser_page() as page:
            page.goto(f"{url}/admin/ui")
            page.wait_for_url("**/admin/login", timeout=15_000)
            page.fill('input[name="token"]', reader)  # a caller without `admin` is refused
            page.click('button[type="submit"]')
            page.wait_for_selector(".error", timeout=15_000)
            assert page.url.endswith("/admin/login")
            page.fill('input[name="token"]', ops)
            page.click('button[type="submit"]')
            page.wait_for_url("**/admin/ui", timeout=15_000)
            page.wait_for_selector(f'#stores tr[data-store="{STORE}"]', timeout=15_000)
            for node_id in ("n1", "n2"):
                page.wait_for_selector(f'#grid [data-node="{node_id}"][data-state="up"]', timeout=15_000)
            assert ops not in page.url
            page.screenshot(path=str(artifacts(tmp_path) / "partition-map-admin-caller.png"), full_page=True)


def test_the_page_renders_a_thousand_node_map_and_a_drill_down_within_seconds(tmp_path: Path) -> None:
    with records_router(tmp_path, "--gone", "2", "--loading-store", "1") as url, browser_page(1400, 1100) as page:
        asked: list[str] = []
        page.on("request", lambda request: asked.append(request.url))
        page.goto(f"{url}/admin/ui")
        page.wait_for_function("() => document.querySelectorAll('#grid [data-node]').length === 1000", timeout=30_000)
        assert page.locator("#stores tr[data-store]").count() == 100
        # Problems first: the loading store heads the table; the gone nodes head the grid and the list.
        assert page.locator("#stores tr[data-store]").first.get_attribute("data-store") == "store-001"
        assert page.locator("#grid [data-node]").first.get_attribute("data-state") == "gone"
        assert page.locator('#problems li[data-problem="loading"] [data-store="store-001"]').count() == 1
        assert page.locator('#problems li[data-problem="gone"] [data-node]').count() == 2
        totals = httpx.get(url + "/admin/partition-map", timeout=30).json()["totals"]
        assert totals["under_replicated"] > 0 and totals["loading"] == 10 and totals["nodes_gone"] == 2
        under = page.locator('#problems li[data-problem="under_replicated"]')
        assert under.get_attribute("data-count") == str(totals["under_replicated"])
        page.screenshot(path=str(artifacts(tmp_path) / "partition-map-1000-nodes.png"), full_page=False)

        page.click('#stores tr[data-store="store-001"] button')
        page.wait_for_selector('#detail[data-loaded="store:store-001"]', timeout=15_000)
        # It opens on the worst state the store has: its 10 loading partitions, not its 1,000.
        assert page.locator("#partitions tr[data-partition]").count() == 10
        assert page.locator("#partitions tr[data-partition]").first.get_attribute("data-partition") == "0"
        page.select_option("#detail-state", "")
        page.wait_for_function("() => document.querySelectorAll('#partitions tr[data-partition]').length === 200")
        page.click("#detail-more")
        page.wait_for_function("() => document.querySelectorAll('#partitions tr[data-partition]').length === 400")
        page.locator("#grid [data-node]").nth(5).click()
        page.wait_for_function("() => (document.querySelector('#detail').getAttribute('data-loaded') || '')"
                               ".startsWith('node:')", timeout=15_000)  # fmt: skip
        assert page.locator("#partitions tr[data-partition]").count() > 0
        page.screenshot(path=str(artifacts(tmp_path) / "partition-map-1000-nodes-drill-down.png"), full_page=False)
        assert not any("detail=all" in u for u in asked), asked
        # The map's views, the page itself and the quota table (every few seconds, hidden: no quotas here).
        assert all("/admin/partition-map" in u or u.endswith(("/admin/ui", "/admin/quotas")) for u in asked), asked
        assert page.locator("#quotas").is_hidden()
