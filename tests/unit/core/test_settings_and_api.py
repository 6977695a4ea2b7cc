from __future__ import annotations

import json
from typing import Any

import pytest

from keyroute.core.api import BadKey, PartitionUnavailable, found_body, key_path_segment
from keyroute.core.settings import HttpSettings, ZkSettings


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


def test_unavailable_says_when_to_retry() -> None:
    err = PartitionUnavailable("no node serves partition 3", retry_after_s=2)
    assert err.status == 503 and err.headers == {"Retry-After": "2"}
    assert err.body() == {"error": "partition_unavailable", "message": "no node serves partition 3"}


def _admin_scope(path: str, query: bytes = b"", authorization: bytes | None = None) -> dict[str, Any]:
    headers = [] if authorization is None else [(b"authorization", authorization)]
    return {"type": "http", "path": path, "raw_path": path.encode(), "query_string": query, "headers": headers}


def test_the_partition_map_page_takes_the_admin_token_from_its_query_and_nothing_else_does() -> None:
    from keyroute.core.security import BearerAuth
    from keyroute.http.admission import Admission

    admission = Admission(admin=BearerAuth("s3cret"))

    def admitted(scope: dict[str, Any]) -> bool:
        refusal = admission.admit(scope)
        if refusal is None:
            admission.release()
            return True
        assert refusal.status == 401
        return False

    assert admitted(_admin_scope("/admin/ui", b"token=s3cret"))
    assert admitted(_admin_scope("/admin/ui", authorization=b"Bearer s3cret"))
    assert not admitted(_admin_scope("/admin/ui"))
    assert not admitted(_admin_scope("/admin/ui", b"token=wrong"))
    assert not admitted(_admin_scope("/admin/ui", b"token=wrong", authorization=b"Bearer s3cret"))  # query wins
    assert not admitted(_admin_scope("/admin/partition-map", b"token=s3cret"))  # only the page
    assert admitted(_admin_scope("/admin/partition-map", authorization=b"Bearer s3cret"))
