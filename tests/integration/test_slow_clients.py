"""A live router under slow clients and oversized requests: 1,000 connections that trickle a request head or
never finish a body do not keep a fast client from being served, and oversized keys, bodies, batches and
headers are refused with JSON 4xx answers."""

from __future__ import annotations

import json
import resource
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from keyroute.runtime.settings import ZkSettings
from tests.integration.small_cluster import ROWS, STORE, SmallCluster, expected, key_path, small_cluster

pytestmark = pytest.mark.integration

SLOW_CLIENTS = 1000


def _raise_open_files_limit(needed: int) -> None:
    """Slow sockets on both ends (this process and the router, which inherits the limit) need descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        pytest.skip(f"the open-files limit ({soft}) is below the {needed} this test needs")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, module_zk_settings: ZkSettings) -> Iterator[SmallCluster]:
    """One cluster for the tests that only read it (each closes its own connections)."""
    _raise_open_files_limit(3 * SLOW_CLIENTS + 512)
    # Bodies may take their time here (the body timeout has a test of its own below).
    router_args = ["--body-timeout-s", "300"]
    with small_cluster(tmp_path_factory.mktemp("slow-clients"), module_zk_settings, router_args=router_args) as c:
        yield c


def _open_slow(address: tuple[str, int], n: int) -> socket.socket:
    sock = socket.create_connection(address, timeout=5)
    if n % 2:
        # A request head that never ends.
        sock.sendall(b"GET /stores/bookings/keys/C0")
    else:
        # A complete head, then a body that never arrives in full.
        sock.sendall(
            b"POST /stores/bookings/batch-get HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b'content-length: 100000\r\n\r\n{"keys": ["C0'
        )
    return sock


def _still_waiting(slow: list[socket.socket]) -> int:
    """How many of the slow connections the router has neither answered nor closed (nothing to read yet)."""
    waiting = 0
    for sock in slow:
        timeout = sock.gettimeout()
        sock.setblocking(False)  # a socket with a timeout would wait that long for something to read
        try:
            sock.recv(1, socket.MSG_PEEK)  # b"" (closed) or an answer: either way not waiting any more
        except BlockingIOError:
            waiting += 1
        except OSError:
            pass  # reset: not waiting either
        finally:
            sock.settimeout(timeout)
    return waiting


def test_a_thousand_slow_clients_do_not_stop_a_fast_one(cluster: SmallCluster) -> None:
    parts = urlsplit(cluster.router_url)
    address = (parts.hostname or "127.0.0.1", parts.port or 80)
    slow: list[socket.socket] = []
    try:
        for n in range(SLOW_CLIENTS):
            slow.append(_open_slow(address, n))
        with httpx.Client(timeout=10, trust_env=False) as fast:
            for round_no in range(3):
                for sock in slow:  # one more byte each: still connected, still unfinished
                    sock.sendall(b"0")
                for key in ROWS:
                    r = fast.get(cluster.router_url + key_path(key))
                    assert r.status_code == 200 and r.json() == expected(key), (round_no, key, r.text)
                r = fast.post(cluster.router_url + f"/stores/{STORE}/batch-get", json={"keys": sorted(ROWS)})
                assert [e["value"] for e in r.json()["results"]] == [ROWS[k] for k in sorted(ROWS)]
                # The order that shows it: the fast reads were answered while the slow clients still waited
                # (not after the router had dropped or served them).
                waiting = _still_waiting(slow)
                assert waiting >= SLOW_CLIENTS * 0.95, (round_no, waiting)
        # The slow connections were open the whole time: the router neither dropped nor served them.
        still_open = _still_waiting(slow)
        assert still_open >= SLOW_CLIENTS * 0.95, still_open
    finally:
        for sock in slow:
            sock.close()
    # Once they are gone, the router still answers.
    with httpx.Client(timeout=10, trust_env=False) as http:
        cluster.check_every_key(http)


def _assert_json_error(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert body["error"] == code and body["message"], body


def test_oversized_keys_bodies_batches_and_headers_get_4xx(cluster: SmallCluster) -> None:
    url = cluster.router_url
    with httpx.Client(timeout=30, trust_env=False) as http:
        _assert_json_error(http.get(url + "/stores/bookings/keys/" + "k" * 1025), 414, "key_too_long")
        _assert_json_error(http.get(url + "/stores/bookings/keys/" + "%E6%9D%B1" * 342), 414, "key_too_long")
        r = http.get(url + "/stores/bookings/keys/" + "k" * 1024)  # at the limit: an ordinary missing key
        _assert_json_error(r, 404, "key_not_found")
        body = json.dumps({"keys": ["C001", "k" * 2000]}).encode()
        entries = http.post(url + "/stores/bookings/batch-get", content=body).json()["results"]
        assert [e["status"] for e in entries] == [200, 400] and entries[1]["error"] == "key_too_long"
        big = b'{"keys": ["' + b"z" * (2 * 1024 * 1024) + b'"]}'
        _assert_json_error(http.post(url + "/stores/bookings/batch-get", content=big), 413, "body_too_large")
        many = json.dumps({"keys": [f"C{i:03d}" for i in range(1001)]}).encode()
        _assert_json_error(http.post(url + "/stores/bookings/batch-get", content=many), 413, "too_many_keys")
        # Beyond max_header_bytes (32 KiB): refused before the whole head is buffered, with the same JSON.
        for size in (40_000, 1_000_000):
            r = http.get(url + key_path("C001"), headers={"x-filler": "h" * size})
            _assert_json_error(r, 431, "headers_too_large")
        many_headers = [(f"x-h{i}".encode(), b"v" * 100) for i in range(400)]
        _assert_json_error(http.get(url + key_path("C001"), headers=many_headers), 431, "headers_too_large")
        _assert_json_error(http.get(url + key_path("C001") + "?" + "q" * 50_000), 431, "headers_too_large")
        # A head that grows past the limit without ever ending is answered and closed by the server's
        # protocol: the application (which sees only complete heads) could not have refused it.
        parts = urlsplit(url)
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80), timeout=10) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\nx-endless: " + b"e" * 100_000)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 431 "), head
        assert json.loads(payload)["error"] == "headers_too_large"
        # A request head just below the limit is served.
        r = http.get(url + key_path("C001"), headers={"x-filler": "h" * 20_000})
        assert r.status_code == 200 and r.json() == expected("C001")
        cluster.check_every_key(http)


def test_a_body_that_never_arrives_holds_no_slot_and_times_out(tmp_path: Path, zk_settings: ZkSettings) -> None:
    """A request is admitted once its body is complete: clients that send a head and never their body take
    none of the router's slots (reads go on being answered), and each gets 408 after the body timeout."""
    slots = 3
    router_args = ["--body-timeout-s", "2", "--max-concurrent-requests", str(slots)]
    with small_cluster(tmp_path, zk_settings, router_args=router_args) as cluster:
        parts = urlsplit(cluster.router_url)
        address = (parts.hostname or "127.0.0.1", parts.port or 80)
        slow = [_open_slow(address, 0) for _ in range(2 * slots)]  # complete heads, bodies that never finish
        try:
            with httpx.Client(timeout=10, trust_env=False) as fast:
                for key in sorted(ROWS)[:5]:
                    r = fast.get(cluster.router_url + key_path(key))
                    assert r.status_code == 200 and r.json() == expected(key)
            for sock in slow:
                answer = _read_answer(sock)
                assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
                assert b'"error": "body_timeout"' in answer or b'"error":"body_timeout"' in answer, answer
            with httpx.Client(timeout=10, trust_env=False) as scraper:
                metrics = scraper.get(cluster.router_url + "/metrics").text
            assert 'reason="body_timeout"' in metrics
            refused = [line for line in metrics.splitlines() if 'reason="body_timeout"' in line and "_total" in line]
            assert refused and float(refused[0].rsplit(" ", 1)[1]) == 2 * slots, refused
        finally:
            for sock in slow:
                sock.close()


def _read_answer(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    received = b""
    while b"}" not in received:
        chunk = sock.recv(65536)
        if not chunk:
            break
        received += chunk
    return received
