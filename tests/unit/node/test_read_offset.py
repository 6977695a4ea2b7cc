"""Reads of live partitions on a node (keyroute.state_node.reads, .dataplane) over real sockets: answers say
which offset they reflect; `min_offset` is answered at once when applied, after a wait when the applier
gets there in time, else 503 not_up_to_bound; a forwarded read carries its bound on; batch-gets take bounds
per partition. The partition's `live` is a small real object with the node's LivePartition interface."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from keyroute.api import BadRequest, min_offset_query, parse_min_offset
from tests.unit.node.fakes import (
    HELD,
    KEY_LOCAL,
    KEY_REMOTE,
    LOCAL_P,
    ME,
    REMOTE_P,
    SERVING,
    Client,
    Held,
    Nodes,
    P,
    key_in,
    unreachable,
)
from tests.util import wait_for

OTHER_P = 2
KEY_OTHER = key_in("s", OTHER_P)
MISSING = key_in("s", LOCAL_P, prefix="zz")


class Live:
    """The LivePartition interface: `offset` (last applied), `lag_records`, `reached`, `wait_reached` (on the
    node's loop; woken from any thread by `advance`, as the applier wakes readers)."""

    def __init__(self, offset: int, lag_records: int = 0) -> None:
        self.offset = offset
        self.lag_records = lag_records
        self.lag_ms = 0.0
        self.state = "live"
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None], int]] = []

    def reached(self, offset: int) -> bool:
        return self.offset >= offset

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._waiters)

    def advance(self, offset: int) -> None:
        with self._lock:
            self.offset = offset
            due = [w for w in self._waiters if w[2] <= offset]
            self._waiters = [w for w in self._waiters if w[2] > offset]
        for loop, future, _ in due:
            loop.call_soon_threadsafe(lambda f=future: f.done() or f.set_result(None))

    async def wait_reached(self, offset: int, timeout_s: float) -> bool:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self.offset >= offset:
                return True
            entry = (loop, future, offset)
            self._waiters.append(entry)
        try:
            await asyncio.wait_for(future, timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            with self._lock:
                if entry in self._waiters:
                    self._waiters.remove(entry)


class LiveHeld(Held):
    def __init__(self, version: int, rows: dict[bytes, bytes], live: Live) -> None:
        super().__init__(version, rows)
        self.live = live


@pytest.fixture
def pool() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    with concurrent.futures.ThreadPoolExecutor(2) as executor:
        yield executor


def live_node(
    client_for: Nodes, offsets: dict[int, int], wait_ms: float = 5000, peer: Any = unreachable
) -> tuple[Client, dict[int, Live], list[httpx.Request]]:
    """A node holding partitions `offsets` (partition -> applied offset) of store "s" as live partitions."""
    lives = {p: Live(offset, lag_records=3) for p, offset in offsets.items()}
    held = {
        ("s", p): LiveHeld(1, {KEY_LOCAL.encode(): b'{"v":1}', KEY_OTHER.encode(): b'{"v":2}'}, live)
        for p, live in lives.items()
    }
    serving = {ME: {"s": dict.fromkeys(offsets, 1)}, "n2": {"s": {REMOTE_P: 1}}}
    client, seen = client_for(serving, held, peer)
    client.node.settings = dataclasses.replace(client.node.settings, min_offset_wait_ms=wait_ms)
    return client, lives, seen


def error(response: httpx.Response) -> str:
    code: str = response.json()["error"]
    return code


# -- parsing --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        (b"min_offset=0", 0),
        (b"min_offset=42", 42),
        (b"x=1&min_offset=7", 7),
        (b"min_offset=9223372036854775807", (1 << 63) - 1),
        (b"other=1", None),
        (b"", None),
    ],
)
def test_min_offset_is_read_from_the_query_and_other_parameters_are_ignored(query: bytes, expected: int) -> None:
    assert min_offset_query(query) == expected


@pytest.mark.parametrize(
    "query",
    [b"min_offset=", b"min_offset=-1", b"min_offset=abc", b"min_offset=1.5", b"min_offset=+3", b"min_offset= 3",
     b"min_offset=9223372036854775808", b"min_offset=1&min_offset=1", "min_offset=٣".encode()],
)  # fmt: skip
def test_a_malformed_or_repeated_min_offset_is_a_bad_request(query: bytes) -> None:
    with pytest.raises(BadRequest):
        min_offset_query(query)


def test_parse_min_offset_names_the_parameter_and_the_range() -> None:
    with pytest.raises(BadRequest, match=r"min_offset must be an offset: an integer from 0 to 9223372036854775807"):
        parse_min_offset("x")


# -- one key --------------------------------------------------------------------------------------------


def test_answers_of_a_live_partition_carry_its_offset_and_lag_found_or_not(client_for: Nodes) -> None:
    client, _, _ = live_node(client_for, {LOCAL_P: 41})
    found = client.get(f"/stores/s/keys/{KEY_LOCAL}")
    assert found.status_code == 200 and found.json()["value"] == {"v": 1}
    assert found.headers["x-keyroute-offset"] == "41" and found.headers["x-keyroute-lag"] == "3"
    missing = client.get(f"/stores/s/keys/{MISSING}")
    assert missing.status_code == 404 and error(missing) == "key_not_found"
    assert missing.headers["x-keyroute-offset"] == "41" and missing.headers["x-keyroute-lag"] == "3"


def test_a_batch_store_answers_without_offsets_and_refuses_a_bound_as_not_live(client_for: Nodes) -> None:
    client, _ = client_for(SERVING, HELD, unreachable)
    plain = client.get(f"/stores/s/keys/{KEY_LOCAL}")
    assert plain.status_code == 200 and "x-keyroute-offset" not in plain.headers
    bounded = client.get(f"/stores/s/keys/{KEY_LOCAL}?min_offset=0")
    assert bounded.status_code == 400 and error(bounded) == "not_live"
    assert "live stores" in bounded.json()["message"]


@pytest.mark.parametrize("query", ["min_offset=", "min_offset=-1", "min_offset=x", "min_offset=1&min_offset=2"])
def test_a_malformed_min_offset_is_400_bad_request(client_for: Nodes, query: str) -> None:
    client, _, _ = live_node(client_for, {LOCAL_P: 5})
    response = client.get(f"/stores/s/keys/{KEY_LOCAL}?{query}")
    assert response.status_code == 400 and error(response) == "bad_request"


def test_a_bound_already_applied_is_answered_at_once(client_for: Nodes) -> None:
    client, lives, _ = live_node(client_for, {LOCAL_P: 10})
    for bound in (0, 9, 10):
        response = client.get(f"/stores/s/keys/{KEY_LOCAL}?min_offset={bound}")
        assert response.status_code == 200 and response.headers["x-keyroute-offset"] == "10"
    assert lives[LOCAL_P].waiting == 0


def test_a_bound_applied_during_the_wait_is_answered_with_the_new_state(
    client_for: Nodes, pool: concurrent.futures.ThreadPoolExecutor
) -> None:
    client, lives, _ = live_node(client_for, {LOCAL_P: 10})
    pending = pool.submit(client.get, f"/stores/s/keys/{KEY_LOCAL}?min_offset=12")
    wait_for(lambda: lives[LOCAL_P].waiting == 1, timeout_s=5)
    assert not pending.done()
    lives[LOCAL_P].advance(11)  # not yet
    assert lives[LOCAL_P].waiting == 1
    lives[LOCAL_P].advance(12)
    response = pending.result(timeout=5)
    assert response.status_code == 200 and response.headers["x-keyroute-offset"] == "12"


def test_a_bound_not_applied_within_the_wait_is_503_not_up_to_bound_with_the_current_offset(client_for: Nodes) -> None:
    client, lives, _ = live_node(client_for, {LOCAL_P: 10}, wait_ms=50)
    response = client.get(f"/stores/s/keys/{KEY_LOCAL}?min_offset=11")
    assert response.status_code == 503 and error(response) == "not_up_to_bound"
    assert response.headers["retry-after"] == "1"
    assert response.headers["x-keyroute-offset"] == "10"
    assert response.headers["x-keyroute-partition"] == str(LOCAL_P)
    assert "applied offset 10, not yet 11" in response.json()["message"]
    assert lives[LOCAL_P].waiting == 0
    # No wait configured: the bound is checked once, at once.
    client.node.settings = dataclasses.replace(client.node.settings, min_offset_wait_ms=0)
    assert client.get(f"/stores/s/keys/{KEY_LOCAL}?min_offset=11").status_code == 503
    assert lives[LOCAL_P].waiting == 0


def test_a_forwarded_read_carries_its_bound_to_the_node_that_serves_the_key(client_for: Nodes) -> None:
    def peer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"value": {}}, headers={"x-keyroute-offset": "99"})

    client, _, seen = live_node(client_for, {LOCAL_P: 1}, peer=peer)
    response = client.get(f"/stores/s/keys/{KEY_REMOTE}?min_offset=77")
    assert response.status_code == 200 and response.headers["x-keyroute-offset"] == "99"
    assert seen[0].url.raw_path == f"/stores/s/keys/{KEY_REMOTE}?min_offset=77".encode()
    plain = client.get(f"/stores/s/keys/{KEY_REMOTE}")
    assert plain.status_code == 200 and seen[1].url.raw_path == f"/stores/s/keys/{KEY_REMOTE}".encode()


# -- batches --------------------------------------------------------------------------------------------


def entries(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    results: list[dict[str, Any]] = response.json()["results"]
    return results


def test_batch_entries_of_a_live_store_carry_the_partitions_offset(client_for: Nodes) -> None:
    client, _, _ = live_node(client_for, {LOCAL_P: 5, OTHER_P: 8})
    got = entries(client.post("/stores/s/batch-get", json={"keys": [KEY_LOCAL, KEY_OTHER, MISSING]}))
    assert [(e["status"], e.get("offset")) for e in got] == [(200, 5), (200, 8), (404, 5)]
    assert got[0] == {
        "key": KEY_LOCAL,
        "status": 200,
        "partition": LOCAL_P,
        "version": 1,
        "offset": 5,
        "node": ME,
        "value": {"v": 1},
    }


def test_batch_bounds_per_partition_and_for_all(client_for: Nodes, pool: concurrent.futures.ThreadPoolExecutor) -> None:
    client, lives, _ = live_node(client_for, {LOCAL_P: 5, OTHER_P: 8}, wait_ms=5000)
    keys = [KEY_LOCAL, KEY_OTHER]
    # Both applied: at once.
    got = entries(client.post("/stores/s/batch-get", json={"keys": keys, "min_offsets": {str(LOCAL_P): 5}}))
    assert [e["status"] for e in got] == [200, 200]
    # Partition LOCAL_P is behind its bound (the larger of min_offset and its own): it is waited for,
    # OTHER_P (bound 6 <= 8) is not.
    body = {"keys": keys, "min_offset": 6, "min_offsets": {str(LOCAL_P): 7}}
    pending = pool.submit(client.post, "/stores/s/batch-get", json=body)
    wait_for(lambda: lives[LOCAL_P].waiting == 1, timeout_s=5)
    assert lives[OTHER_P].waiting == 0
    lives[LOCAL_P].advance(6)
    assert lives[LOCAL_P].waiting == 1 and not pending.done()
    lives[LOCAL_P].advance(7)
    got = entries(pending.result(timeout=5))
    assert [(e["status"], e["offset"]) for e in got] == [(200, 7), (200, 8)]


def test_batch_entries_of_a_partition_that_does_not_reach_its_bound_are_503_not_up_to_bound(
    client_for: Nodes,
) -> None:
    client, _, _ = live_node(client_for, {LOCAL_P: 5, OTHER_P: 8}, wait_ms=50)
    body = {"keys": [KEY_LOCAL, KEY_OTHER, MISSING], "min_offsets": {str(LOCAL_P): 6}}
    got = entries(client.post("/stores/s/batch-get", json=body))
    assert [(e["status"], e.get("error"), e["offset"]) for e in got] == [
        (503, "not_up_to_bound", 5),
        (200, None, 8),
        (503, "not_up_to_bound", 5),
    ]


@pytest.mark.parametrize(
    "body",
    [
        {"keys": ["a"], "min_offset": -1},
        {"keys": ["a"], "min_offset": "3"},
        {"keys": ["a"], "min_offset": True},
        {"keys": ["a"], "min_offsets": [1]},
        {"keys": ["a"], "min_offsets": {"x": 1}},
        {"keys": ["a"], "min_offsets": {"0": 1.5}},
        {"keys": ["a"], "min_offsets": {str(P): 1}},  # the store has P partitions: 0..P-1
    ],
)
def test_a_malformed_batch_bound_refuses_the_batch(client_for: Nodes, body: dict[str, Any]) -> None:
    client, _, _ = live_node(client_for, {LOCAL_P: 5})
    response = client.post("/stores/s/batch-get", json=body)
    assert response.status_code == 400 and error(response) == "bad_request"


def test_a_batch_bound_on_a_batch_store_is_a_not_live_entry(client_for: Nodes) -> None:
    client, _ = client_for(SERVING, HELD, unreachable)
    got = entries(client.post("/stores/s/batch-get", json={"keys": [KEY_LOCAL], "min_offset": 0}))
    assert got[0]["status"] == 400 and got[0]["error"] == "not_live"
    # A bound on other partitions only leaves this one alone.
    got = entries(client.post("/stores/s/batch-get", json={"keys": [KEY_LOCAL], "min_offsets": {str(REMOTE_P): 0}}))
    assert got[0]["status"] == 200


def test_keys_sent_on_carry_the_bounds_of_their_partitions_only(client_for: Nodes) -> None:
    def peer(request: httpx.Request) -> httpx.Response:
        keys = json.loads(request.content)["keys"]
        return httpx.Response(
            200, json={"results": [{"key": k, "status": 200, "offset": 3, "value": {}} for k in keys]}
        )

    client, _, seen = live_node(client_for, {LOCAL_P: 5}, peer=peer)
    body = {"keys": [KEY_LOCAL, KEY_REMOTE], "min_offset": 2, "min_offsets": {str(REMOTE_P): 3, str(OTHER_P): 9}}
    got = entries(client.post("/stores/s/batch-get", json=body))
    assert [e["status"] for e in got] == [200, 200]
    assert json.loads(seen[0].content) == {"keys": [KEY_REMOTE], "min_offsets": {str(REMOTE_P): 3}}
