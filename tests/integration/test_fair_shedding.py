"""Fair shedding on a real cluster (two `keyroute node` processes and a `keyroute router` with a small
--max-concurrent-requests, the session's ZooKeeper, callers with tokens): one caller floods the router with
many concurrent reads that hold their places (their node is paused, so none of them ends), the other caller's
reads are still answered while the flooder's surplus gets fast 503s; the router counts both by caller."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from keyroute.runtime.settings import ZkSettings
from tests.integration.small_cluster import (
    ADMIN_TOKEN,
    ROWS,
    SECRET,
    STORE,
    expected,
    key_path,
    partition,
    small_cluster,
)
from tests.util import wait_for

pytestmark = pytest.mark.integration

LIMIT = 8  # the router's places: 7, then a reserve of 1
FLOODERS = 20
FLOOD_TOKEN, STEADY_TOKEN = "fl00d-t0ken", "st3ady-t0ken"


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def write_tokens(path: Path) -> None:
    entries = [("ops", ADMIN_TOKEN, '"*"', "true"), ("flood", FLOOD_TOKEN, f'["{STORE}"]', "false")]
    entries.append(("steady", STEADY_TOKEN, f'["{STORE}"]', "false"))
    path.write_text(
        "".join(
            f'[[tokens]]\nname = "{name}"\ntoken = "{token}"\nstores = {stores}\nadmin = {admin}\n\n'
            for name, token, stores, admin in entries
        ),
        encoding="utf-8",
    )


def caller_reads(metrics: str, identity: str, status: int) -> float:
    prefix = f'keyroute_router_caller_requests_total{{identity="{identity}",status="{status}",store="{STORE}"}}'
    lines = [line for line in metrics.splitlines() if line.startswith(prefix)]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


def test_a_flooding_caller_is_shed_while_another_caller_is_still_answered(
    tmp_path: Path, zk_settings: ZkSettings
) -> None:
    tokens = tmp_path / "tokens.toml"
    write_tokens(tokens)
    args = ["--cluster-secret", SECRET, "--access-tokens", str(tokens), "--admin-token", ADMIN_TOKEN]
    router_args = ["--max-concurrent-requests", str(LIMIT), "--upstream-timeout-s", "120", "--hedge-after-ms", "0"]
    options = {"headers": bearer(ADMIN_TOKEN)}
    with small_cluster(tmp_path, zk_settings, extra_args=args, router_args=router_args, http_options=options) as c:
        serving = c.serving()
        paused = c.members["n1"]  # its reads hang while it is frozen
        on_paused = {p for p, nodes in serving.items() if nodes == ["n1"]}
        flood_keys = [k for k in ROWS if partition(k) in on_paused]
        steady_keys = [k for k in ROWS if partition(k) not in on_paused][:10]
        assert flood_keys and steady_keys, serving
        flood_results: list[httpx.Response | Exception] = []
        lock = threading.Lock()

        def flood(i: int) -> None:
            key = flood_keys[i % len(flood_keys)]
            try:
                with httpx.Client(timeout=150, trust_env=False) as http:
                    result: httpx.Response | Exception = http.get(
                        c.router_url + key_path(key), headers=bearer(FLOOD_TOKEN)
                    )
            except Exception as exc:  # reported by the assertions below
                result = exc
            with lock:
                flood_results.append(result)

        paused.freeze()
        threads = [threading.Thread(target=flood, args=(i,), daemon=True) for i in range(FLOODERS)]
        try:
            for thread in threads:
                thread.start()
            # The flooder alone holds every place but the reserve; the rest of its reads are shed at once.
            shed = FLOODERS - (LIMIT - 1)
            wait_for(lambda: len(flood_results) >= shed, timeout_s=30, interval_s=0.05, message="the flood's 503s")
            with lock:
                answered = list(flood_results)
            assert len(answered) == shed
            for r in answered:
                assert isinstance(r, httpx.Response) and r.status_code == 503, r
                assert r.json()["error"] == "overloaded" and r.headers["retry-after"] == "1", r.text
            with httpx.Client(timeout=30, trust_env=False, headers=bearer(STEADY_TOKEN)) as steady:
                for key in steady_keys:
                    r = steady.get(c.router_url + key_path(key))
                    assert r.status_code == 200, (key, r.status_code, r.text)
                    assert r.json() == expected(key)
            with httpx.Client(timeout=30, trust_env=False, headers=bearer(FLOOD_TOKEN)) as flooder:
                r = flooder.get(c.router_url + key_path(steady_keys[0]))
            assert (r.status_code, r.json()["error"]) == (503, "overloaded")  # still over its share
            with httpx.Client(timeout=30, trust_env=False, headers=bearer(ADMIN_TOKEN)) as ops:
                metrics = ops.get(c.router_admin_url + "/metrics").text
            assert caller_reads(metrics, "steady", 200) == len(steady_keys)
            assert caller_reads(metrics, "flood", 503) == shed + 1
        finally:
            paused.thaw()
            for thread in threads:
                thread.join(timeout=150)
        assert len(flood_results) == FLOODERS
