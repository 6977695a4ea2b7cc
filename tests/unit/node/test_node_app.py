"""The node's HTTP API over keyroute's HTTP server: local answers, forwarding rules, batch-get, admin and
error bodies. The data plane (keyroute.state_node.dataplane) and the admin app (keyroute.state_node.app) share one port,
as in `keyroute node`; peers and partitions are fakes (tests/unit/node/fakes.py), no ZooKeeper is needed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from keyroute.auth.security import ClusterAuth, member_token
from keyroute.http.admission import Admission
from keyroute.http.authn import callers_of
from keyroute.runtime.settings import AccessSettings, RequestLimits
from keyroute.state_node.metrics import NodeMetrics
from tests.unit.node.fakes import (
    GENERATION,
    HELD,
    KEY_LOCAL,
    KEY_REMOTE,
    LOCAL_P,
    ME,
    REMOTE_P,
    SERVING,
    B,
    C,
    Handler,
    Held,
    Nodes,
    key_in,
    partition_of,
    unreachable,
)


def test_a_local_key_is_answered_here_with_hops_0(client_for: Nodes) -> None:
    client, seen = client_for(SERVING, HELD, unreachable)
    r = client.get(f"/stores/s/keys/{KEY_LOCAL}")
    assert r.status_code == 200
    assert r.json() == {"store": "s", "key": KEY_LOCAL, "partition": LOCAL_P, "version": 1, "value": {"v": 1}}
    assert r.headers["x-keyroute-partition"] == str(LOCAL_P)
    assert r.headers["x-keyroute-node"] == ME
    assert r.headers["x-keyroute-version"] == "1"
    assert r.headers["x-keyroute-hops"] == "0"
    assert r.headers["x-keyroute-generation"] == str(GENERATION)
    assert seen == []


def test_a_forwarded_request_served_here_says_hops_1(client_for: Nodes) -> None:
    client, _ = client_for(SERVING, HELD, unreachable)
    r = client.get(f"/stores/s/keys/{KEY_LOCAL}", headers={"x-keyroute-hops": "1"})
    assert r.status_code == 200 and r.headers["x-keyroute-hops"] == "1"


def test_a_missing_key_is_404_key_not_found_from_its_partition(client_for: Nodes) -> None:
    missing = key_in("s", LOCAL_P, prefix="zz")
    client, _ = client_for(SERVING, HELD, unreachable)
    r = client.get(f"/stores/s/keys/{missing}")
    assert r.status_code == 404
    assert r.json()["error"] == "key_not_found" and missing in r.json()["message"]
    assert r.headers["x-keyroute-partition"] == str(LOCAL_P)


@pytest.mark.parametrize(
    ("path", "status", "code"),
    [
        ("/stores/nope/keys/k", 404, "store_not_found"),
        ("/stores/ints/keys/12x", 400, "bad_key"),
        ("/stores/ints/keys/9223372036854775808", 400, "bad_key"),
        ("/stores/s/keys/%FF", 400, "bad_key"),
        ("/nothing-here", 404, "not_found"),
        ("/stores/s/keys/a/b", 404, "not_found"),
    ],
)
def test_errors_are_json_with_a_code_and_a_message(path: str, status: int, code: str, client_for: Nodes) -> None:
    client, _ = client_for(SERVING, HELD, unreachable)
    r = client.get(path)
    assert r.status_code == status
    assert r.headers["content-type"] == "application/json"
    assert r.json()["error"] == code and r.json()["message"]


def test_wrong_method_is_json_405(client_for: Nodes) -> None:
    client, _ = client_for(SERVING, HELD, unreachable)
    r = client.delete(f"/stores/s/keys/{KEY_LOCAL}")
    assert r.status_code == 405 and r.json()["error"] == "method_not_allowed"


def test_a_remote_key_is_forwarded_once_and_the_answer_relayed(client_for: Nodes) -> None:
    key = key_in("s", REMOTE_P, prefix="a/b ")  # needs %2F and %20 in the path

    def peer(request: httpx.Request) -> httpx.Response:
        body = b'{"store": "s", "key": "x", "partition": 1, "version": 1, "value": {"far": true}}'
        return httpx.Response(
            200,
            content=body,
            headers={
                "content-type": "application/json",
                "x-keyroute-node": B,
                "x-keyroute-partition": str(REMOTE_P),
                "x-keyroute-version": "1",
                "x-keyroute-hops": "1",
                "x-keyroute-generation": "99999",
                "connection": "keep-alive, x-private",
                "keep-alive": "timeout=5",
                "x-private": "hop",
                "x-other": "kept",
            },
        )

    client, seen = client_for(SERVING, HELD, peer)
    segment = httpx.URL("http://x/" + key.replace("/", "%2F").replace(" ", "%20")).raw_path.decode()[1:]
    r = client.get(f"/stores/s/keys/{segment}", headers={"x-request-id": "req-7", "cookie": "secret"})
    assert r.status_code == 200
    assert r.content.endswith(b'"value": {"far": true}}')
    assert r.headers["x-keyroute-node"] == B
    assert r.headers["x-keyroute-hops"] == "1"
    assert r.headers["x-keyroute-forwarded-by"] == ME
    # The map generation of the map the forwarding node routed with (a router compares it with its own).
    assert r.headers["x-keyroute-generation"] == str(GENERATION)
    assert r.headers["x-other"] == "kept"
    assert "keep-alive" not in r.headers and "x-private" not in r.headers
    assert len(seen) == 1
    sent = seen[0]
    assert sent.url.host == "n2.test"
    assert sent.url.raw_path == f"/stores/s/keys/{segment}".encode()  # %2F kept: still one segment
    assert sent.headers["x-keyroute-hops"] == "1"
    assert sent.headers["x-request-id"] == "req-7"
    assert "cookie" not in sent.headers


def test_forwarding_moves_to_the_next_replica_when_one_is_down(client_for: Nodes) -> None:
    def peer(request: httpx.Request) -> httpx.Response:
        if request.url.host == "n2.test":
            raise httpx.ConnectTimeout("slow", request=request)
        return httpx.Response(200, json={"from": "n3"}, headers={"x-keyroute-node": C})

    client, seen = client_for(SERVING, HELD, peer)
    r = client.get(f"/stores/s/keys/{KEY_REMOTE}")
    assert r.status_code == 200 and r.json() == {"from": "n3"}
    assert [s.url.host for s in seen] == ["n2.test", "n3.test"]


def test_when_every_replica_fails_the_answer_is_503_with_retry_after(client_for: Nodes) -> None:
    client, seen = client_for(SERVING, HELD, unreachable)
    r = client.get(f"/stores/s/keys/{KEY_REMOTE}")
    assert r.status_code == 503
    assert r.json()["error"] == "partition_unavailable"
    assert r.headers["retry-after"] == "1"
    assert len(seen) == 2


def test_a_replica_refusing_with_503_is_relayed_when_no_other_answers(client_for: Nodes) -> None:
    def peer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": "partition_unavailable", "message": "moved"})

    client, seen = client_for(SERVING, HELD, peer)
    r = client.get(f"/stores/s/keys/{KEY_REMOTE}")
    assert r.status_code == 503 and r.json()["message"] == "moved"
    assert len(seen) == 2 and r.headers["x-keyroute-forwarded-by"] == ME


@pytest.mark.parametrize("hops", ["1", "2", "abc"])
def test_a_forwarded_request_is_never_forwarded_again(hops: str, client_for: Nodes) -> None:
    client, seen = client_for(SERVING, HELD, unreachable)
    r = client.get(f"/stores/s/keys/{KEY_REMOTE}", headers={"x-keyroute-hops": hops})
    assert r.status_code == 503
    assert r.json()["error"] == "partition_unavailable" and "forward" in r.json()["message"]
    assert r.headers["retry-after"] == "1"
    assert seen == []


def test_a_partition_nobody_serves_is_503(client_for: Nodes) -> None:
    client, seen = client_for({ME: {"s": {LOCAL_P: 1}}}, HELD, unreachable)
    r = client.get(f"/stores/s/keys/{KEY_REMOTE}")
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert seen == []


def test_a_newer_version_elsewhere_wins_over_an_older_local_copy(client_for: Nodes) -> None:
    # Version 2 is published and served by B; this node still holds version 1 (loading 2).
    serving = {ME: {"s": {LOCAL_P: 1}}, B: {"s": {LOCAL_P: 2}}}

    def peer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"version": 2})

    client, seen = client_for(serving, HELD, peer, version=2)
    assert client.get(f"/stores/s/keys/{KEY_LOCAL}").json() == {"version": 2}
    # ...unless the request was already forwarded: then the local copy answers.
    r = client.get(f"/stores/s/keys/{KEY_LOCAL}", headers={"x-keyroute-hops": "1"})
    assert r.status_code == 200 and r.json()["version"] == 1
    assert len(seen) == 1


def batch_peer(answers: dict[str, Callable[[list[str]], httpx.Response]]) -> Handler:
    def peer(request: httpx.Request) -> httpx.Response:
        keys = json.loads(request.content)["keys"]
        return answers[request.url.host](keys)

    return peer


def found(keys: list[str], node: str) -> httpx.Response:
    results = [{"key": k, "status": 200, "partition": REMOTE_P, "version": 1, "value": {"node": node}} for k in keys]
    return httpx.Response(200, json={"results": results})


def test_batch_get_mixes_local_remote_missing_and_bad_keys_in_order(client_for: Nodes) -> None:
    other_remote = key_in("s", REMOTE_P, prefix="r")
    missing = key_in("s", LOCAL_P, prefix="zz")
    client, seen = client_for(SERVING, HELD, batch_peer({"n2.test": lambda keys: found(keys, B)}))
    keys = [KEY_REMOTE, KEY_LOCAL, missing, other_remote]
    body = json.dumps({"keys": keys})[:-2] + ', "\\ud800"]}'  # a lone surrogate: valid JSON, not a key
    r = client.post("/stores/s/batch-get", content=body.encode())
    assert r.status_code == 200
    results = r.json()["results"]
    assert [e["key"] for e in results[:4]] == [KEY_REMOTE, KEY_LOCAL, missing, other_remote]
    assert [e["status"] for e in results] == [200, 200, 404, 200, 400]
    assert results[0]["value"] == {"node": B} and results[3]["value"] == {"node": B}
    assert results[1] == {
        "key": KEY_LOCAL,
        "status": 200,
        "partition": LOCAL_P,
        "version": 1,
        "node": ME,  # the node that read it
        "value": {"v": 1},
    }
    assert results[2]["error"] == "key_not_found"
    assert results[4]["error"] == "bad_key"
    assert len(seen) == 1  # one request per serving node, carrying both of its keys
    assert json.loads(seen[0].content) == {"keys": [KEY_REMOTE, other_remote]}
    assert seen[0].headers["x-keyroute-hops"] == "1"
    # Some keys had to be forwarded: the router that sent them here had a stale view of them.
    assert r.headers["x-keyroute-hops"] == "1"
    assert r.headers["x-keyroute-generation"] == str(GENERATION)


def test_batch_get_moves_keys_to_the_next_replica_when_a_node_fails_or_refuses(client_for: Nodes) -> None:
    for failing in (
        lambda keys: httpx.Response(500, json={"error": "internal_error"}),
        lambda keys: httpx.Response(
            200, json={"results": [{"key": k, "status": 503, "error": "partition_unavailable"} for k in keys]}
        ),
    ):
        client, seen = client_for(SERVING, HELD, batch_peer({"n2.test": failing, "n3.test": lambda k: found(k, C)}))
        r = client.post("/stores/s/batch-get", json={"keys": [KEY_REMOTE]})
        assert r.json()["results"][0]["value"] == {"node": C}
        assert [s.url.host for s in seen] == ["n2.test", "n3.test"]


def test_batch_get_answers_503_per_key_when_no_replica_answers(client_for: Nodes) -> None:
    client, _ = client_for(SERVING, HELD, unreachable)
    r = client.post("/stores/s/batch-get", json={"keys": [KEY_REMOTE, KEY_LOCAL]})
    assert [e["status"] for e in r.json()["results"]] == [503, 200]
    assert r.json()["results"][0]["error"] == "partition_unavailable"


def test_a_forwarded_batch_is_never_forwarded_again(client_for: Nodes) -> None:
    client, seen = client_for(SERVING, HELD, unreachable)
    r = client.post("/stores/s/batch-get", json={"keys": [KEY_REMOTE, KEY_LOCAL]}, headers={"x-keyroute-hops": "1"})
    assert [e["status"] for e in r.json()["results"]] == [503, 200]
    assert r.headers["x-keyroute-hops"] == "1"
    assert seen == []


def test_batch_get_accepts_json_integers_for_integer_keys(client_for: Nodes) -> None:
    key, missing = [i for i in range(1000) if partition_of("ints", str(i)) == LOCAL_P][:2]
    held = {("ints", LOCAL_P): Held(1, {key.to_bytes(8, "big", signed=True): b'{"n":1}'})}
    client, _ = client_for({ME: {"ints": {LOCAL_P: 1}}}, held, unreachable)
    r = client.post("/stores/ints/batch-get", json={"keys": [key, str(key), missing, 2**63]})
    results = r.json()["results"]
    assert [e["status"] for e in results] == [200, 200, 404, 400]
    assert results[0]["key"] == results[1]["key"] == str(key)
    assert results[3]["error"] == "bad_key"


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"not json", 400, "bad_request"),
        (b'["k"]', 400, "bad_request"),
        (b'{"keys": "k"}', 400, "bad_request"),
        (b'{"keys": ["k", null]}', 400, "bad_request"),
        (b'{"keys": ["k", 1.5]}', 400, "bad_request"),
        (b'{"keys": [true]}', 400, "bad_request"),
        (b'{"keys": ["a", "b", "c", "d", "e", "f"]}', 413, "too_many_keys"),
        (b'{"keys": [' + b'"k",' * 600_000 + b'"k"]}', 413, "body_too_large"),
    ],
)
def test_batch_get_rejects_bad_bodies(body: bytes, status: int, code: str, client_for: Nodes) -> None:
    client, _ = client_for(SERVING, HELD, unreachable)
    r = client.post("/stores/s/batch-get", content=body)
    assert r.status_code == status and r.json()["error"] == code


def test_batch_get_refuses_integers_for_string_keys_and_unknown_stores(client_for: Nodes) -> None:
    client, _ = client_for(SERVING, HELD, unreachable)
    r = client.post("/stores/s/batch-get", json={"keys": [7]})
    assert r.json()["results"][0]["status"] == 400
    assert r.json()["results"][0]["message"] == "store 's' has string keys: a batch-get key is a JSON string, not 7"
    # A key no store takes refuses the whole batch (only a client sends one), naming the forms that are taken.
    r = client.post("/stores/ints/batch-get", json={"keys": [1.5]})
    assert r.status_code == 400 and r.json()["error"] == "bad_request"
    assert r.json()["message"] == "store 'ints' has int64 keys: a batch-get key is a JSON string or integer, not 1.5"
    r = client.post("/stores/nope/batch-get", json={"keys": ["k"]})
    assert r.status_code == 404 and r.json()["error"] == "store_not_found"
    # The answer names the stores this node knows, and the closest as "did you mean".
    assert r.json()["message"] == "no store named 'nope' (stores: ints, s)"
    r = client.get("/stores/int/keys/1")
    assert r.json()["message"] == "no store named 'int'; did you mean 'ints'? (stores: ints, s)"


def test_admin_route_explains_a_key(client_for: Nodes) -> None:
    client, _ = client_for(SERVING, HELD, unreachable)
    r = client.get("/admin/route", params={"store": "s", "key": KEY_REMOTE})
    assert r.status_code == 200
    body = r.json()
    assert body["partition"] == REMOTE_P and isinstance(body["hash"], int)
    assert [e["node"] for e in body["serving"]] == [B, C]
    assert body["local"] == {"node": ME, "version": None}
    assert client.get("/admin/route", params={"store": "s"}).status_code == 400
    assert client.get("/admin/route", params={"store": "x", "key": "k"}).json()["error"] == "store_not_found"
    assert client.get("/admin/route", params={"store": "ints", "key": "k"}).json()["error"] == "bad_key"


def test_admin_partition_map_names_this_node(client_for: Nodes) -> None:
    client, _ = client_for(SERVING, HELD, unreachable)
    body = client.get("/admin/partition-map").json()
    assert body["node"] == ME
    assert body["stores"]["s"]["partition_map"][REMOTE_P]["serving"][0]["node"] == B
    assert body["local"]["s"][0]["state"] == "serving"


def test_admin_partition_map_carries_an_etag_and_answers_304_while_nothing_changed(client_for: Nodes) -> None:
    client, _ = client_for(SERVING, HELD, unreachable)
    first = client.get("/admin/partition-map")
    etag = first.headers["etag"]
    assert first.status_code == 200 and etag.startswith('"g')
    again = client.get("/admin/partition-map", headers={"if-none-match": etag})
    assert again.status_code == 304 and again.content == b"" and again.headers["etag"] == etag
    # Compared weakly, as a router's views are (one helper for both: keyroute.http.conditional).
    weak = client.get("/admin/partition-map", headers={"if-none-match": f'"g0.a0.x", W/{etag}'})
    assert weak.status_code == 304
    other = client.get("/admin/partition-map", headers={"if-none-match": '"g0.a0.x"'})
    assert other.status_code == 200 and other.json()["node"] == ME


def test_health_and_readiness(client_for: Nodes) -> None:
    client, _ = client_for(SERVING, HELD, unreachable)
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").status_code == 200
    client, _ = client_for(SERVING, HELD, unreachable, ready=False)
    r = client.get("/readyz")
    assert r.status_code == 503 and r.json()["pending"] == ["s v1 p0"]


def test_an_unexpected_error_is_a_json_500_without_a_stack_trace(client_for: Nodes) -> None:
    class Broken(Held):
        def get(self, key: bytes) -> bytes | None:
            raise RuntimeError("disk on fire at /secret/path")

    client, _ = client_for(SERVING, {("s", LOCAL_P): Broken(1, {})}, unreachable)
    r = client.get(f"/stores/s/keys/{KEY_LOCAL}")
    assert r.status_code == 500
    assert r.json()["error"] == "internal_error"
    assert "secret" not in r.text and "Traceback" not in r.text


SECRET = AccessSettings(cluster_secret="s3cret", admin_token="adm1n")
MEMBER = {"x-keyroute-auth": member_token("s3cret")}


def found_at_b(request: httpx.Request) -> httpx.Response:
    if request.method == "POST":
        keys = json.loads(request.content)["keys"]
        return httpx.Response(200, json={"results": [{"key": k, "status": 200, "value": {}} for k in keys]})
    body = b'{"store": "s", "key": "x", "partition": 1, "version": 1, "value": {"far": true}}'
    return httpx.Response(200, content=body, headers={"x-keyroute-node": B, "x-keyroute-hops": "1"})


@pytest.mark.parametrize(
    "forged",
    [
        {"x-keyroute-hops": "1"},
        {"x-keyroute-hops": "abc", "x-keyroute-router": "1"},
        {"x-keyroute-hops": "1", "x-keyroute-auth": "guess"},
        {"x-keyroute-hops": "1", "x-keyroute-auth": member_token("other secret")},
        {"x-keyroute-hops": "1", "x-keyroute-auth": "\xe9t\xe9"},
    ],
)
def test_with_a_cluster_secret_a_clients_hop_header_neither_stops_nor_repeats_a_forward(
    forged: dict[str, str],
    client_for: Nodes,
) -> None:
    client, seen = client_for(SERVING, HELD, found_at_b, access=SECRET)
    raw = {k: v.encode("latin-1") for k, v in forged.items()}
    r = client.get(f"/stores/s/keys/{KEY_REMOTE}", headers=raw)
    assert r.status_code == 200 and r.headers["x-keyroute-forwarded-by"] == ME
    assert len(seen) == 1 and seen[0].url.host in ("n2.test", "n3.test")
    # The next node gets this node's proof of membership, so it honours the hop count and never forwards.
    assert seen[0].headers["x-keyroute-hops"] == "1"
    assert seen[0].headers["x-keyroute-auth"] == member_token("s3cret")

    r = client.post("/stores/s/batch-get", json={"keys": [KEY_REMOTE]}, headers=raw)
    assert r.json()["results"][0]["status"] == 200 and len(seen) == 2
    assert seen[1].headers["x-keyroute-auth"] == member_token("s3cret")


def test_with_a_cluster_secret_a_members_hop_header_still_forbids_a_second_forward(client_for: Nodes) -> None:
    client, seen = client_for(SERVING, HELD, found_at_b, access=SECRET)
    r = client.get(f"/stores/s/keys/{KEY_REMOTE}", headers={"x-keyroute-hops": "1", **MEMBER})
    assert r.status_code == 503 and r.json()["error"] == "partition_unavailable"
    r = client.post("/stores/s/batch-get", json={"keys": [KEY_REMOTE]}, headers={"x-keyroute-hops": "1", **MEMBER})
    assert r.json()["results"][0]["status"] == 503
    assert seen == []


def test_during_a_rotation_a_node_honours_members_sending_either_secret_and_sends_the_first(
    client_for: Nodes,
) -> None:
    rotating = AccessSettings(cluster_secret="new-s3cret, s3cret", admin_token="adm1n")
    client, seen = client_for(SERVING, HELD, found_at_b, access=rotating)
    # A router or node still sending the old secret, and one already sending the new: both are members.
    for secret in ("s3cret", "new-s3cret"):
        member = {"x-keyroute-hops": "1", "x-keyroute-auth": member_token(secret)}
        r = client.get(f"/stores/s/keys/{KEY_REMOTE}", headers=member)
        assert r.status_code == 503 and r.json()["error"] == "partition_unavailable", secret
    assert seen == []
    # Anyone else is a client: its hop count is ignored, the read is forwarded, with the first secret's proof.
    r = client.get(f"/stores/s/keys/{KEY_REMOTE}", headers={"x-keyroute-hops": "1", **MEMBER_OF_NONE})
    assert r.status_code == 200 and len(seen) == 1
    assert seen[0].headers["x-keyroute-auth"] == member_token("new-s3cret")


MEMBER_OF_NONE = {"x-keyroute-auth": member_token("other secret")}


def test_without_a_secret_no_token_is_sent_to_peers(client_for: Nodes) -> None:
    client, seen = client_for(SERVING, HELD, found_at_b)
    assert client.get(f"/stores/s/keys/{KEY_REMOTE}").status_code == 200
    assert "x-keyroute-auth" not in seen[0].headers


def test_node_admin_endpoints_need_the_admin_token(client_for: Nodes) -> None:
    client, _ = client_for(SERVING, HELD, unreachable, access=SECRET)
    r = client.get("/admin/partition-map")
    assert r.status_code == 401 and r.json()["error"] == "unauthorized"
    assert r.headers["www-authenticate"] == "Bearer" and r.headers["x-keyroute-node"] == ME
    assert client.get("/admin/partition-map", headers={"authorization": "Bearer adm1n"}).status_code == 200
    assert client.get("/healthz").status_code == 200
    assert client.get("/metrics").status_code == 200


@pytest.mark.parametrize("metrics_open", [False, True])
def test_with_access_control_node_metrics_need_an_admin_caller_unless_opened(
    client_for: Nodes, tmp_path: Path, metrics_open: bool
) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(
        '[[tokens]]\nname = "ops"\ntoken = "0ps"\nstores = []\nadmin = true\n\n'
        '[[tokens]]\nname = "reader"\ntoken = "re4der"\nstores = "*"\n',
        encoding="utf-8",
    )
    access = AccessSettings(cluster_secret="s3cret", access_tokens=str(tokens), metrics_open=metrics_open)
    client, _ = client_for(SERVING, HELD, unreachable, access=access)
    # What the lifespan (not run here) does: the callers' check, which /admin and /metrics also take.
    callers = client.app.state.callers = callers_of(access, ClusterAuth("s3cret"), "node", trust_members=True)
    client.app.state.admission.identify_admins(callers)
    answers = {
        who: client.get("/metrics", headers=headers).status_code
        for who, headers in (
            ("nobody", {}),
            ("reader", {"authorization": "Bearer re4der"}),
            ("ops", {"authorization": "Bearer 0ps"}),
        )
    }
    assert answers == ({"nobody": 200, "reader": 200, "ops": 200} if metrics_open else {
        "nobody": 401, "reader": 403, "ops": 200})  # fmt: skip
    assert client.get("/healthz").status_code == 200


def test_node_admin_endpoints_take_the_login_cookie_and_any_token_of_a_list(client_for: Nodes) -> None:
    access = AccessSettings(admin_token="new-adm1n, adm1n")
    client, _ = client_for(SERVING, HELD, unreachable, access=access)
    for token in ("new-adm1n", "adm1n"):
        assert client.get("/admin/partition-map", headers={"authorization": f"Bearer {token}"}).status_code == 200
    login = client.post("/admin/login", data={"token": "adm1n"}, follow_redirects=False)
    assert login.status_code == 303 and login.headers["location"] == "/admin/partition-map"
    value = login.headers["set-cookie"].split(";")[0].partition("=")[2]
    client.http.cookies.clear()
    assert client.get("/admin/partition-map").status_code == 401
    r = client.get("/admin/partition-map", headers={"cookie": f"keyroute_admin={value}"})
    assert r.status_code == 200 and r.json()["node"] == ME


def test_node_refuses_keys_and_heads_over_the_limits(client_for: Nodes) -> None:
    limits = RequestLimits(max_key_bytes=8, max_header_bytes=4000)
    client, seen = client_for(SERVING, HELD, unreachable, limits=limits)
    r = client.get("/stores/s/keys/" + "x" * 9)
    assert r.status_code == 414 and r.json()["error"] == "key_too_long"
    assert r.headers["x-keyroute-node"] == ME
    r = client.post("/stores/s/batch-get", json={"keys": [KEY_LOCAL, "x" * 9]})
    assert [e["status"] for e in r.json()["results"]] == [200, 400]
    assert r.json()["results"][1]["error"] == "key_too_long"
    # A head over the limit is refused by the server while it arrives, and the connection closed.
    r = client.get(f"/stores/s/keys/{KEY_LOCAL}", headers={"x-request-id": "big-1", "x-big": "b" * 5000})
    assert r.status_code == 431 and r.json()["error"] == "headers_too_large"
    assert r.headers["x-request-id"] == "big-1" and r.headers["connection"] == "close"
    assert client.get("/healthz", headers={"x-big": "b" * 5000}).status_code == 431
    assert seen == []


def test_node_metrics_export_the_admission_refusals_by_reason() -> None:
    metrics = NodeMetrics()
    metrics.admission = Admission(max_concurrent_requests=1)
    scope = {"path": "/stores/s/keys/k", "headers": [], "raw_path": b"/stores/s/keys/k", "query_string": b""}
    assert metrics.admission.admit(scope) is None
    assert metrics.admission.admit(scope) is not None  # the second one in progress: overloaded
    text = metrics.render().decode()
    assert 'keyroute_node_refused_requests_total{reason="overloaded"} 1.0' in text
    assert 'keyroute_node_refused_requests_total{reason="unauthorized"} 0.0' in text
