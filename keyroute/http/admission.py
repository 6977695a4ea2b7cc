"""The cheap checks in front of every request to a router or node: concurrency, header size, admin token,
and each caller's fair share of the concurrency once the caller is known.

One plain ASGI wrapper, answered with the API's JSON errors before any routing happens. It takes no lock
and never queues: an event loop runs one request at a time between awaits, so a plain counter is exact.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from starlette.requests import Request

from keyroute.api import (
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    DEFAULT_MAX_HEADER_BYTES,
    ApiError,
    BodyTimeout,
    BodyTooLarge,
    Forbidden,
    HeadersTooLarge,
    Overloaded,
    Unauthorized,
    error_headers,
    error_json,
)
from keyroute.auth.security import BearerAuth
from keyroute.http.errors import LOGIN_PATH, LogIn
from keyroute.runtime.counters import count_down
from keyroute.runtime.logs import acceptable_request_id, bind_request_id, new_request_id
from keyroute.runtime.metrics import REFUSAL_REASONS

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Probes must keep answering under overload: a failed liveness probe restarts a pod that is merely busy.
PROBE_PATHS = frozenset({"/healthz", "/readyz"})
_AUTHORIZATION = b"authorization"
_COOKIE = b"cookie"
LOGOUT_PATH = "/admin/logout"
_REQUEST_ID = b"x-request-id"

_COUNTED = frozenset(REFUSAL_REASONS)


class Admission:
    """The checks themselves, shared by every way a request comes in (the ASGI wrapper below, or a server
    protocol that answers some requests without ASGI): at most `max_concurrent_requests` admitted at once
    (beyond: 503 `overloaded` with Retry-After, at once), request heads of at most `max_header_bytes` (431),
    and the admin token on paths starting with one of `protected` (401). 0 switches a limit off.

    `admit(scope)` returns the refusal to send, or None after counting the request in `active`: the caller
    then calls `release()` when the request is done. Refusals are counted by reason (REFUSAL_REASONS, one
    attribute each); `refused(code)` counts those made before these checks (by the HTTP server)."""

    def __init__(
        self,
        *,
        max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
        admin: BearerAuth | None = None,
        protected: Iterable[str] = ("/admin",),
        retry_after_s: int = 1,
        max_concurrent_per_caller: int = 0,
    ) -> None:
        self.max_concurrent_requests = max_concurrent_requests
        self.max_concurrent_per_caller = max_concurrent_per_caller
        # The last places of `max_concurrent_requests`, kept for named callers under their fair share: what
        # lets a caller in while another one floods the process (`admit_caller`).
        self.reserve = max(1, max_concurrent_requests // 8) if max_concurrent_requests > 1 else 0
        # Requests in progress per named caller (Identity.name); a name leaves when its count drops to 0.
        self.per_caller: dict[str, int] = {}
        self.max_header_bytes = max_header_bytes
        self.admin = admin if admin is not None else BearerAuth()
        self._protected = tuple(protected)
        self.protected = self._protected if self.admin.enabled else ()
        self.callers: Any = None  # keyroute.http.authn.Callers, once access control is on (`identify_admins`)
        self.retry_after_s = retry_after_s
        # What every data-plane request is answered while this process may serve no read (a cluster policy it
        # does not satisfy: keyroute.http.policy_gate); None: reads are served.
        self.withheld: ApiError | None = None
        self.active = 0
        # Refusals by reason (REFUSAL_REASONS), for metrics: by these checks...
        self.overloaded = 0  # shed_callers included
        self.shed_callers = 0  # of which: a named caller over its fair share (`admit_caller`)
        self.headers_too_large = 0
        self.unauthorized = 0
        # ...and by the HTTP server, before them (`refused`): malformed (400), body late (408), body too large
        # (413), an Expect other than 100-continue (417); a head too large counts with headers_too_large.
        self.bad_request = 0
        self.body_timeout = 0
        self.body_too_large = 0
        self.expectation_failed = 0

    def admit(self, scope: Scope) -> ApiError | None:
        query = scope.get("query_string") or b""
        target_bytes = len(scope.get("raw_path") or b"") + len(query)
        headers = scope["headers"]
        path = scope["path"]
        if path in LOGIN_PAGES and (b"token=" in query or (self.protected and not self._signed_in(headers))):
            # A page a browser opens: without a session (or with an admin token in its URL, which is never
            # honoured, nor repeated: URLs end up in logs), it is sent to the login form.
            self.unauthorized += 1
            return LogIn()
        return self.admit_head(path, target_bytes, headers)

    def identify_admins(self, callers: Any) -> None:
        """With access control on (`callers`: keyroute.http.authn.Callers), /admin is also open to a caller
        whose identity has `admin`, and closed to everyone else even without an admin token."""
        self.callers = callers
        if callers is not None:
            self.protected = self._protected

    def _signed_in(self, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        try:
            self._check_admin(headers)
        except ApiError:
            return False
        return True

    def _check_admin(self, headers: Iterable[tuple[bytes, bytes]]) -> None:
        """Raises Unauthorized (or Forbidden: a caller without `admin`) unless the request carries the admin
        token, its login's cookie, or (with access control) an admin caller's credentials."""
        authorization = first_header(headers, _AUTHORIZATION)
        cookie = first_header(headers, _COOKIE)
        try:
            if not self.admin.enabled:
                raise Unauthorized("credentials required: Authorization: Bearer TOKEN")
            self.admin.check(authorization, cookie)
        except ApiError:
            if self.callers is None:
                raise
            # An admin caller's login (its session cookie), else the caller its credentials name.
            if authorization is None and cookie is not None and self.callers.of_session(cookie) is not None:
                return
            identity = self.callers.identify(authorization)
            if not identity.admin:
                raise Forbidden(f"{identity.name!r} may not use /admin") from None

    def admit_head(self, path: str, target_bytes: int, headers: Iterable[tuple[bytes, bytes]]) -> ApiError | None:
        """`admit` for a request known by its decoded `path`, the length of its target (raw path and query
        string) and its headers (lower-case names), without an ASGI scope."""
        if self.max_concurrent_requests and self.active >= self.max_concurrent_requests and path not in PROBE_PATHS:
            self.overloaded += 1
            return Overloaded(
                f"more than {self.max_concurrent_requests} requests in progress; retry shortly", self.retry_after_s
            )
        try:
            limit = self.max_header_bytes
            if limit:
                # check_head_bytes's sum, inline (once per request); it raises when over.
                size = target_bytes
                for name, value in headers:
                    size += len(name) + len(value) + 4
                if size > limit:
                    check_head_bytes(target_bytes, headers, limit)
            if self.protected and path.startswith(self.protected) and path not in OPEN_ADMIN_PATHS:
                self._check_admin(headers)
        except HeadersTooLarge as exc:
            self.headers_too_large += 1
            return exc
        except ApiError as exc:
            self.unauthorized += 1
            return exc
        self.active += 1
        return None

    def release(self) -> None:
        self.active -= 1

    def admit_caller(self, name: str) -> Overloaded | None:
        """Fair shedding, once an admitted request's caller is known: the refusal to answer instead of
        serving it (the request's place, taken by `admit_head`, is still given back by `release`), or None
        after counting it under `name` (then `release_caller(name)` when it is done).

        A caller is shed when it holds its share: `max_concurrent_per_caller` when set (always), and once the
        process is saturated (this request would take one of the `reserve` last places), the places before
        the reserve divided among the callers with requests in progress, this one included. So a caller
        alone is held to the places before the reserve, and a newcomer under its share takes the reserve
        while the flooder is shed. One dict lookup; ANONYMOUS (a cluster without access control) never
        comes here, so its admission is `admit_head`'s alone."""
        callers = self.per_caller
        held = callers.get(name, 0)
        share = self.max_concurrent_per_caller
        limit = self.max_concurrent_requests
        if limit and self.active > limit - self.reserve:
            fair = (limit - self.reserve) // (len(callers) + (held == 0)) or 1
            if not share or fair < share:
                share = fair
        if share and held >= share:
            self.overloaded += 1
            self.shed_callers += 1
            return Overloaded(
                f"caller {name!r} has {held} requests in progress, its share under load; retry shortly",
                self.retry_after_s,
            )
        callers[name] = held + 1
        return None

    def release_caller(self, name: str) -> None:
        """A request counted by `admit_caller(name)` is done."""
        count_down(self.per_caller, name)

    def refused(self, code: str) -> None:
        """Count a request refused with the API error `code` before it reached these checks: what the HTTP
        server calls `on_refusal` with (SERVER_REFUSALS). ValueError for a code that is not a REFUSAL_REASONS
        (its count would never be exported)."""
        if code not in _COUNTED:
            raise ValueError(f"{code!r} is not a refusal reason counted by Admission (one of {REFUSAL_REASONS})")
        setattr(self, code, getattr(self, code) + 1)


# Admin pages opened in a browser: without a session they redirect to the login form (so does an admin token
# in their URL, which is never honoured: URLs end up in logs and histories).
LOGIN_PAGES = frozenset({"/admin/ui"})
# Under /admin, yet open: the login form, and the logout (which only clears the cookie).
OPEN_ADMIN_PATHS = frozenset({LOGIN_PATH, LOGOUT_PATH})


class RequestGuard:
    """ASGI wrapper: `app` behind an `Admission` (given, to share it with another entry point, or built
    from the keyword options); refusals are answered with the API's JSON errors plus `error_headers`."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        admission: Admission | None = None,
        error_headers: Iterable[tuple[str, str]] = (),
        **options: Any,
    ) -> None:
        self.app = app
        self.admission = admission if admission is not None else Admission(**options)
        self._error_headers = [(n.lower().encode("latin-1"), v.encode("latin-1")) for n, v in error_headers]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        admission = self.admission
        refusal = admission.admit(scope)
        if refusal is not None:
            request_id = request_id_of(scope).encode("latin-1")
            await send_error(send, refusal, [*self._error_headers, (_REQUEST_ID, request_id)])
            return
        try:
            await self.app(scope, receive, send)
        finally:
            admission.release()


def check_header_bytes(scope: Scope, limit: int) -> None:
    """Raises HeadersTooLarge when the request head (target and header fields) exceeds `limit` bytes."""
    target_bytes = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
    check_head_bytes(target_bytes, scope["headers"], limit)


def check_head_bytes(target_bytes: int, headers: Iterable[tuple[bytes, bytes]], limit: int) -> None:
    """`check_header_bytes` for a target of `target_bytes` (raw path and query string) and `headers`."""
    size = target_bytes
    for name, value in headers:
        size += len(name) + len(value) + 4
    if size > limit:
        raise HeadersTooLarge(f"the request line and headers take {size} bytes; at most {limit} are allowed")


def request_id_of(scope: Scope) -> str:
    """The request's id, bound to it (keyroute.runtime.logs): the client's acceptable one, else a new one."""
    supplied = header(scope, _REQUEST_ID)
    return bind_request_id(scope, supplied.decode("latin-1") if supplied is not None else None)


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of header `name` (lower case) in an ASGI scope."""
    return first_header(scope["headers"], name)


def first_header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The first value of header `name` (lower case) in raw headers with lower-case names."""
    for key, value in headers:
        if key == name:
            return bytes(value)
    return None


def request_id_in(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The id of a request answered without an ASGI scope: the client's acceptable one, else a new one. It is
    not bound to the context (`request_id_of` does that for a request with a task of its own)."""
    supplied = first_header(headers, _REQUEST_ID)
    if supplied is not None:
        text = supplied.decode("latin-1")
        if acceptable_request_id(text):
            return text
    return new_request_id()


async def send_error(send: Send, exc: ApiError, extra: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """An ApiError as the API's JSON error response, sent with bare ASGI messages."""
    body = error_json(exc.code, exc.message)
    headers = error_headers(exc, extra)
    headers.append((b"content-length", str(len(body)).encode("ascii")))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The whole request body: BodyTooLarge as soon as it exceeds `limit` bytes, BodyTimeout when it has not
    all arrived within `timeout_s` (0: no limit, no timeout)."""
    declared = request.headers.get("content-length")
    if limit and declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"the body is larger than {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s or None):
            async for chunk in request.stream():
                size += len(chunk)
                if limit and size > limit:
                    raise BodyTooLarge(f"the body is larger than {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise BodyTimeout(f"the body did not arrive within {timeout_s:g} s") from None
    return b"".join(chunks)
