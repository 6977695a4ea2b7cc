"""`keyroute demo` (what `make demo` runs) as a newcomer runs it: up, answering the printed requests, a live
value moving while they watch, and Ctrl-C (SIGTERM here) leaving no process behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from keyroute import sample_data
from tests.util import free_port, wait_for

pytestmark = pytest.mark.integration

_UP_TIMEOUT_S = 300.0


def test_the_demo_comes_up_serves_a_live_store_and_stops_cleanly(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "keyroute",
            "demo",
            "--port",
            str(port),
            "--workdir",
            str(tmp_path / "demo"),
            "--events",
            "3000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    up = threading.Event()

    def read_output() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            lines.append(raw.decode(errors="replace"))
            if "keyroute demo is up." in lines[-1]:
                up.set()

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    router = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + _UP_TIMEOUT_S
        while not up.wait(0.5):
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
        banner = "".join(lines)
        assert f"curl -s {router}/stores/bookings/keys/" in banner
        assert f"/stores/quotes/keys/{sample_data.asset_id(7)}" in banner

        with httpx.Client(base_url=router, timeout=5.0) as client:
            booking = client.get(f"/stores/bookings/keys/{sample_data.customer_id(42)}")
            assert booking.status_code == 200, booking.text
            assert booking.json()["value"]["route"] in sample_data.ROUTES

            # The README's history and windows examples: the busy customer's morning of trips.
            busy = sample_data.customer_id(sample_data.BUSY_CUSTOMER)
            morning = {"from": "2024-06-11T10:00:00Z", "to": "2024-06-11T11:00:00Z"}
            trips = client.get(f"/stores/trips/keys/{busy}/history", params=morning)
            assert trips.status_code == 200, trips.text
            rows = trips.json()["rows"]
            assert len(rows) >= len(sample_data.BUSY_MINUTES)
            assert all(set(row) == {"ts", "route", "fare"} for row in rows), rows
            windows = client.get(f"/stores/fares_5m/keys/{busy}/windows", params=morning)
            assert windows.status_code == 200, windows.text
            counted = [window["value"]["trips"] for window in windows.json()["windows"]]
            assert sum(counted) == len(rows) and len(counted) > 1

            def quote() -> httpx.Response | None:
                found = client.get(f"/stores/quotes/keys/{sample_data.asset_id(7)}")
                return found if found.status_code == 200 else None

            first = wait_for(quote, timeout_s=60.0, message="a quote for ASSET-0007")
            offset = int(first.headers["x-keyroute-offset"])

            def moved() -> httpx.Response | None:
                again = quote()
                return again if again is not None and int(again.headers["x-keyroute-offset"]) > offset else None

            later = wait_for(moved, timeout_s=60.0, message="the quotes partition's offset to move")
            assert later.json()["value"]["seq"] >= first.json()["value"]["seq"]
            assert set(later.json()["value"]) == {"ts", "bid", "seq"}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        reader.join(timeout=10)
    assert code == 0, "".join(lines)
    assert "all demo processes stopped." in "".join(lines)
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0, "the router still listens after the demo stopped"
    log_dir = tmp_path / "demo" / "logs"
    assert json.dumps(sorted(p.name for p in log_dir.iterdir()))  # every process kept a log
