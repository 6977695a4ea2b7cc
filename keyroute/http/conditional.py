"""Conditional requests (RFC 9110 section 13) for the admin views routers and nodes build: an ETag made of
marks, and `If-None-Match` answered 304 before a view is built or sent.

    entity_tag("g12", "a3", "s")  -> '"g12.a3.s"'     the marks of what the view depends on, in order
    marked('"g12.a3"', "r2")      -> '"g12.a3.r2"'    one more, added to a tag made already
    matches(if_none_match, tag)                         the header names the tag: itself, weak (W/) or *
    not_modified(request, headers)                      the 304 (with `headers`) when the request's
                                                        If-None-Match names `headers["etag"]`, else None

If-None-Match is compared weakly, as RFC 9110 asks of it: `W/"x"` names `"x"`.
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.requests import Request
from starlette.responses import Response

__all__ = ["entity_tag", "marked", "matches", "not_modified"]


def entity_tag(*marks: str) -> str:
    """A strong ETag of `marks` (the empty ones left out), joined by '.'."""
    return '"' + ".".join(mark for mark in marks if mark) + '"'


def marked(etag: str, mark: str) -> str:
    """`etag` with `mark` added last (inside its quotes)."""
    return f'{etag[:-1]}.{mark}"' if etag.endswith('"') else f"{etag}.{mark}"


def matches(if_none_match: str | None, etag: str) -> bool:
    """Whether an If-None-Match header value (None: absent) names `etag`."""
    if if_none_match is None:
        return False
    return any(tag.strip() in (etag, "W/" + etag, "*") for tag in if_none_match.split(","))


def not_modified(request: Request, headers: Mapping[str, str]) -> Response | None:
    """304 Not Modified with `headers` when `request`'s If-None-Match names `headers["etag"]`, else None."""
    if matches(request.headers.get("if-none-match"), headers["etag"]):
        return Response(status_code=304, headers=dict(headers))
    return None
