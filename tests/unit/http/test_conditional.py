"""ETags and If-None-Match for the admin views of routers and nodes (keyroute.http.conditional)."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from keyroute.http.conditional import entity_tag, marked, matches, not_modified


def _request(if_none_match: str | None) -> Request:
    headers = [] if if_none_match is None else [(b"if-none-match", if_none_match.encode("latin-1"))]
    return Request({"type": "http", "method": "GET", "path": "/", "headers": headers})


def test_a_tag_is_its_marks_in_order_the_empty_ones_left_out_and_more_may_be_added() -> None:
    assert entity_tag("g12", "a3", "", "l1.5") == '"g12.a3.l1.5"'
    assert entity_tag("g1", "a1", "s") == '"g1.a1.s"'
    assert marked('"g1.a1"', "r2") == '"g1.a1.r2"'
    assert marked(marked('"g1"', "r2"), "p3") == '"g1.r2.p3"'


@pytest.mark.parametrize(
    ("given", "named"),
    [
        (None, False),
        ("", False),
        ('"g1.a1"', True),
        ('W/"g1.a1"', True),  # compared weakly, as RFC 9110 asks of If-None-Match
        ("*", True),
        ('"g0.a1", "g1.a1"', True),
        ('"g1.a1.s"', False),
        ('"g1"', False),
        ("g1.a1", False),  # unquoted: not that tag
    ],
)
def test_if_none_match_names_the_tag_itself_its_weak_form_or_any(given: str | None, named: bool) -> None:
    assert matches(given, '"g1.a1"') is named
    answer = not_modified(_request(given), {"etag": '"g1.a1"', "cache-control": "no-cache"})
    if named:
        assert answer is not None and answer.status_code == 304 and answer.body == b""
        assert answer.headers["etag"] == '"g1.a1"' and answer.headers["cache-control"] == "no-cache"
    else:
        assert answer is None
