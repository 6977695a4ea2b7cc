"""Single-key reads take the bare-ASGI path, answer exactly as the full application would, and fall back to
it for anything that is not a key read."""

from __future__ import annotations

from typing import Any

import pytest
from keyroute.router import fast_path

from tests.unit.router.fakes import build_map
from tests.unit.router.test_app import FULL, STORES, nodes, router, run


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """What every fast-path attempt returned (True: it answered; False: it passed the request on)."""
    seen: list[bool] = []
    original = fast_path.answer_key_read

    async def spy(*args: Any) -> Any:
        answered = await original(*args)
        seen.append(answered is not None)
        return answered

    monkeypatch.setattr(fast_path, "answer_key_read", spy)
    return seen


def test_a_key_read_is_answered_by_the_fast_path_with_the_nodes_answer_and_a_request_id(served: list[bool]) -> None:
    async def scenario() -> None:
        async with router(build_map(STORES, FULL), *nodes("k1")) as r:
            resp = await r.client.get("/stores/s/keys/k1", headers={"x-request-id": "abc-123"})
            assert resp.status_code == 200
            assert resp.json()["value"] == {"v": "k1"}
            assert resp.headers["x-request-id"] == "abc-123"
            assert int(resp.headers["content-length"]) == len(resp.content)
            generated = await r.client.get("/stores/s/keys/k1")
            assert generated.headers["x-request-id"] not in ("", "abc-123")
            assert served == [True, True]

    run(scenario)


def test_errors_on_the_fast_path_are_the_apis_json_errors(served: list[bool]) -> None:
    async def scenario() -> None:
        async with router(build_map(STORES, FULL), *nodes("k1")) as r:
            missing_store = await r.client.get("/stores/nope/keys/k1")
            assert missing_store.status_code == 404
            assert missing_store.json()["error"] == "store_not_found"
            assert missing_store.headers["x-request-id"]
            bad_key = await r.client.get("/stores/n/keys/not-a-number")
            assert (bad_key.status_code, bad_key.json()["error"]) == (400, "bad_key")
            too_long = await r.client.get("/stores/s/keys/" + "k" * 5000)
            assert too_long.status_code == 414 and too_long.json()["error"] == "key_too_long"
            absent = await r.client.get("/stores/s/keys/absent")
            assert (absent.status_code, absent.json()["error"]) == (404, "key_not_found")
            assert served == [True, True, True, True]

    run(scenario)


def test_what_is_not_a_key_read_goes_to_the_full_application(served: list[bool]) -> None:
    async def scenario() -> None:
        async with router(build_map(STORES, FULL), *nodes("k1")) as r:
            deeper = await r.client.get("/stores/s/extra/keys/k1")
            assert deeper.status_code == 404 and deeper.json()["error"] == "not_found"
            posted = await r.client.post("/stores/s/keys/k1")
            assert posted.status_code == 405 and posted.json()["error"] == "method_not_allowed"
            health = await r.client.get("/healthz")
            assert health.status_code == 200
            # Only the first looked like a key read; the fast path passed it on.
            assert served == [False]

    run(scenario)


def test_a_head_read_takes_the_fast_path_and_says_how_long_the_answer_is(served: list[bool]) -> None:
    async def scenario() -> None:
        async with router(build_map(STORES, FULL), *nodes("k1")) as r:
            got = await r.client.get("/stores/s/keys/k1")
            head = await r.client.head("/stores/s/keys/k1")
            assert head.status_code == 200
            assert head.headers["content-length"] == str(len(got.content))
            assert head.headers["x-keyroute-node"] == got.headers["x-keyroute-node"]
            assert served == [True, True]

    run(scenario)
