from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from keyroute.api import ApiError, BadKey, PartitionUnavailable, found_body, key_path_segment
from keyroute.runtime.settings import HttpSettings, ZkSettings


@pytest.mark.parametrize(
    ("connect", "hosts", "chroot"),
    [
        ("127.0.0.1:2181", "127.0.0.1:2181", ""),
        ("a:1,b:2/keyroute", "a:1,b:2", "/keyroute"),
        ("a:1/x/y/", "a:1", "/x/y"),
        ("a:1/", "a:1", ""),
    ],
)
def test_zk_connect_string_is_split_into_hosts_and_chroot(connect: str, hosts: str, chroot: str) -> None:
    zk = ZkSettings.parse(connect)
    assert (zk.hosts, zk.chroot) == (hosts, chroot)
    assert zk.connect_string == hosts + chroot


@pytest.mark.parametrize("connect", ["", "  ", "/only-chroot"])
def test_zk_connect_string_must_name_a_host(connect: str) -> None:
    with pytest.raises(ValueError):
        ZkSettings.parse(connect)


def test_advertised_url_defaults_to_a_reachable_address() -> None:
    assert HttpSettings(host="0.0.0.0", port=9000).url == "http://127.0.0.1:9000"
    assert HttpSettings(host="10.1.2.3", port=9000, advertise_url="http://node-0.nodes:9000/").url == (
        "http://node-0.nodes:9000"
    )


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"/stores/bookings/keys/C1", ("bookings", "C1")),
        (b"/stores/bookings/keys/a%2Fb", ("bookings", "a/b")),
        (b"/stores/bookings/keys/100%25", ("bookings", "100%")),
        (b"/stores/bookings/keys/x+y", ("bookings", "x+y")),
        (b"/stores/bookings/keys/%E6%9D%B1%E4%BA%AC", ("bookings", "東京")),
        (b"/stores/bookings/keys/with%20space%3F%23", ("bookings", "with space?#")),
        (b"/stores/bookings/keys/", ("bookings", "")),
        (b"/stores/bookings/keys/a/b", None),
        (b"/stores//keys/a", None),
        (b"/admin/partition-map", None),
    ],
)
def test_key_comes_from_the_raw_path(raw: bytes, expected: tuple[str, str] | None) -> None:
    assert key_path_segment(raw) == expected


def test_key_that_is_not_utf8_is_a_bad_key() -> None:
    with pytest.raises(BadKey):
        key_path_segment(b"/stores/s/keys/%FF")


def test_found_body_embeds_the_stored_value_bytes() -> None:
    body = found_body("s", "ключ", 3, 7, b'{"a":1,"b":2.0,"c":"x"}')
    assert json.loads(body) == {"store": "s", "key": "ключ", "partition": 3, "version": 7,
                                "value": {"a": 1, "b": 2.0, "c": "x"}}


@given(store=st.text(min_size=1, max_size=12), key=st.text(max_size=40), partition=st.integers(0, 2**31 - 1),
       version=st.integers(0, 2**63))
@example(store="s", key='a"b\\c\n\x00\u2028é', partition=0, version=1)
def test_found_body_is_the_json_of_its_fields_as_json_dumps_writes_them(
    store: str, key: str, partition: int, version: int
) -> None:
    """found_body is written in one format on a read's path: byte for byte what the dict's `json.dumps`
    (ensure_ascii=False, as answers always were) writes, the value's bytes in place of its JSON."""
    value = b'{"v":[1,2]}'
    try:
        plain = json.dumps(
            {"store": store, "key": key, "partition": partition, "version": version}, ensure_ascii=False
        ).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: neither writes it
        with pytest.raises(UnicodeEncodeError):
            found_body(store, key, partition, version, value)
        return
    assert found_body(store, key, partition, version, value) == plain[:-1] + b', "value": ' + value + b"}"


def test_unavailable_says_when_to_retry() -> None:
    err = PartitionUnavailable("no node serves partition 3", retry_after_s=2)
    assert err.status == 503 and err.headers == {"Retry-After": "2"}
    assert err.body() == {"error": "partition_unavailable", "message": "no node serves partition 3"}


def _admin_scope(
    path: str, query: bytes = b"", authorization: bytes | None = None, cookie: bytes | None = None
) -> dict[str, Any]:
    headers = [] if authorization is None else [(b"authorization", authorization)]
    if cookie is not None:
        headers.append((b"cookie", cookie))
    return {"type": "http", "path": path, "raw_path": path.encode(), "query_string": query, "headers": headers}


def test_the_admin_token_is_never_taken_from_a_url_and_the_page_sends_browsers_to_the_login() -> None:
    from keyroute.auth.security import BearerAuth
    from keyroute.http.admission import Admission

    admission = Admission(admin=BearerAuth("s3cret"))

    def answer(scope: dict[str, Any]) -> int:
        refusal = admission.admit(scope)
        if refusal is None:
            admission.release()
            return 200
        assert refusal.status in (303, 401)
        assert "s3cret" not in refusal.message and "s3cret" not in json.dumps(refusal.headers)  # never echoed
        if refusal.status == 303:
            assert refusal.headers["Location"] == "/admin/login"
        return refusal.status

    # The page: a token in its URL is never honoured, whatever else the request carries.
    assert answer(_admin_scope("/admin/ui", b"token=s3cret")) == 303
    assert answer(_admin_scope("/admin/ui", b"token=wrong", authorization=b"Bearer s3cret")) == 303
    assert answer(_admin_scope("/admin/ui")) == 303
    assert answer(_admin_scope("/admin/ui", authorization=b"Bearer s3cret")) == 200
    # Nor anywhere else: the API answers 401.
    assert answer(_admin_scope("/admin/partition-map", b"token=s3cret")) == 401
    assert answer(_admin_scope("/admin/partition-map", authorization=b"Bearer s3cret")) == 200
    # The login and the logout are open.
    assert answer(_admin_scope("/admin/login")) == 200
    assert answer(_admin_scope("/admin/logout")) == 200
    # Without an admin token everything is open, but a token in the page's URL still leaves it.
    open_admission = Admission(admin=BearerAuth(""))
    assert open_admission.admit(_admin_scope("/admin/ui")) is None
    refusal = open_admission.admit(_admin_scope("/admin/ui", b"token=s3cret"))
    assert refusal is not None and refusal.status == 303


def test_a_session_cookie_admits_until_it_expires_or_its_token_is_removed() -> None:
    from keyroute.auth.security import SESSION_LIFETIME_S, BearerAuth
    from keyroute.http.admission import Admission

    now = [1_800_000_000.0]
    auth = BearerAuth("s3cret", clock=lambda: now[0])
    value = auth.session()
    assert "s3cret" not in value
    cookie = b"theme=dark; keyroute_admin=" + value.encode() + b"; other=1"
    admission = Admission(admin=auth)

    def admitted(scope: dict[str, Any]) -> bool:
        refusal = admission.admit(scope)
        if refusal is None:
            admission.release()
            return True
        return False

    for path in ("/admin/partition-map", "/admin/ui"):
        assert admitted(_admin_scope(path, cookie=cookie)), path
        assert not admitted(_admin_scope(path, cookie=b"keyroute_admin=" + value.encode()[:-1] + b"0")), path
        assert not admitted(_admin_scope(path, cookie=b"keyroute_admin=garbage")), path
        assert not admitted(_admin_scope(path, cookie=b"keyroute_admin=99999999999." + value.split(".")[1].encode()))
    # A wrong bearer token is refused even with a good cookie: what is presented must be right.
    assert not admitted(_admin_scope("/admin/partition-map", authorization=b"Bearer nope", cookie=cookie))
    # Made with another token: refused; made with a token still in the list: admitted.
    assert not BearerAuth("other", clock=lambda: now[0]).valid_session(value)
    assert BearerAuth("other, s3cret", clock=lambda: now[0]).valid_session(value)
    # Expired.
    now[0] += SESSION_LIFETIME_S
    assert not admitted(_admin_scope("/admin/partition-map", cookie=cookie))


def test_admin_tokens_take_a_list_for_a_rotation() -> None:
    from keyroute.auth.security import BearerAuth, split_secrets

    assert split_secrets(" new , old,, ") == ("new", "old")
    assert split_secrets("") == () and split_secrets(" , ") == ()
    auth = BearerAuth("new,old")
    for token in (b"new", b"old"):
        auth.check(b"Bearer " + token)
    with pytest.raises(ApiError):
        auth.check(b"Bearer new,old")
    assert not BearerAuth(" , ").enabled


def test_cluster_secrets_take_a_list_sending_with_the_first_accepting_any() -> None:
    from keyroute.auth.security import ClusterAuth, member_token

    members = ClusterAuth("new, old")
    assert members.headers() == {"x-keyroute-auth": member_token("new")}  # sends with the first
    assert members.is_member(member_token("new")) and members.is_member(member_token("old"))
    assert not members.is_member(member_token("other")) and not members.is_member(None)
    assert ClusterAuth("old").is_member(members.token) is False
    assert not ClusterAuth(",").enabled
