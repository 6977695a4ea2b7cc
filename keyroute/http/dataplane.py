"""The data-plane skeleton routers and nodes share: admission, routing, path decoding, error answers and the
handlers' tasks, written once. A service declares its routes and handlers; everything else is here.

`RoutedDataPlane` is a `keyroute.http.exchange.DataPlane` for every request under /stores/. For each one:

    1. admission (`keyroute.http.admission.Admission.admit_head`; before it, `Admission.withheld` while the
       process may serve no read): a refusal is answered at once, and no place is taken; an admitted
       request's place is given back by its exchange's end (`keyroute.http.exchange.Exchange.on_done`),
       never by a handler
    2. routing (`keyroute.http.routing.RouteTable`): 404 not_found, or 405 method_not_allowed with `Allow`
    3. path parameters decoded by one rule (`keyroute.api.path_parameter`): 400 or 414 when they do not
       decode
    4. with access control on (`callers`, keyroute.http.authn.Callers): the caller identified and allowed
       the store, else 401 unauthorized or 403 forbidden; `Call.identity` is whom the handler reads for;
       then the caller's fair share of admission (`Call.admit_as`), else 503 overloaded
    5. `handler(plane, call, *parameters)`: it answers the `Call`, now or later from a callback, or returns
       an awaitable, which runs in a task of its own (the request's id bound to its log lines)

Contract, for every request admitted:

    answered once          the first `Call.answer` counts; later ones are ignored
    admission released     exactly once, when the exchange ends: at its answer, or as soon as it is lost
                           unanswered (the client left, or the connection closes: the server is stopping),
                           even while a handler's task still runs (its answer is then dropped)
    ApiError               raised by the handler or its task (or given to `Call.fail`): its status, the
                           service's error headers and the error's own, `{"error", "message"}`
    anything else          logged with its traceback and the request's id, answered 500 internal_error with
                           no detail; a task that ends without answering is such a failure too
    counted                every answer of a route with a `kind`, by (store, kind, status), through the
                           service's `count`, unless the handler counted it itself (`Call.answer_counted`);
                           404/405 and admission's refusals are not reads and are not counted here
    timed                  the same answers, by (store, status), with the seconds from admission to the
                           answer, through the service's `observe` (a batch once, not per key): one
                           monotonic read at admission, one at the answer
    by caller              the same answers of a named caller (`Call.admit_as`; and every 401), by
                           (identity, store, status, seconds), through the service's `caller_answered`;
                           ANONYMOUS's others are not (a cluster without access control pays nothing)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from time import monotonic
from typing import TYPE_CHECKING, Any, ClassVar, Final

from keyroute.api import ApiError, NotFound, error_headers, error_json
from keyroute.auth.access import ANONYMOUS, Identity
from keyroute.http import openapi
from keyroute.http.routing import MethodNotAllowed, Route, RouteTable
from keyroute.runtime.logs import bind_request_id
from keyroute.runtime.metrics import KIND_BATCH, KIND_KEY, KIND_TIMELINE
from keyroute.runtime.native import mypyc_attr

if TYPE_CHECKING:
    from keyroute.http.admission import Admission
    from keyroute.http.authn import Callers
    from keyroute.http.exchange import Answerable, Request

__all__ = ["JSON", "NOT_A_KEY_PATH", "Call", "MethodNotAllowed", "RoutedDataPlane", "Route", "RouteTable"]

log = logging.getLogger(__name__)
_monotonic: Final = monotonic  # C statics in the compiled build, not globals looked up per answer
_ANONYMOUS: Final = ANONYMOUS

JSON = [(b"content-type", b"application/json")]
Headers = list[tuple[bytes, bytes]]
Count = Callable[[str, str, int], None]
Observe = Callable[[str, int, float], None]
Answered = Callable[[str, str, int, float], None]
CallerAnswered = Callable[[str, str, int, float], None]


class Call:
    """One admitted, routed data-plane request as its handler sees it: `request` (keyroute.http.exchange's
    Request: method, raw path and query, headers, body, request_id), the `store` it is counted under, and
    one way to answer it (`answer`, `answer_counted`, `fail`): counted, errors mapped to the API's JSON."""

    __slots__ = ("request", "store", "identity", "_exchange", "_plane", "_kind", "_open", "_admitted")

    def __init__(self, plane: RoutedDataPlane, exchange: Answerable, kind: str | None, admitted: float = 0.0) -> None:
        self.request: Request = exchange.request
        self.store = ""  # until the route's first parameter, the store, is decoded
        self.identity: Identity = _ANONYMOUS  # who asks (keyroute.auth.access): set before the handler
        self._exchange = exchange
        self._plane = plane
        self._kind = kind
        self._open = True
        self._admitted = admitted  # monotonic time of admission (timed answers only)

    @property
    def answered(self) -> bool:
        return not self._open

    @property
    def gone(self) -> bool:
        """The client closed the connection: an answer would be dropped."""
        return self._exchange.gone

    @property
    def transport(self) -> Any:
        """The asyncio transport of the connection the request came on (with TLS: its peer's certificate)."""
        return self._exchange.transport

    def admit_as(self, identity: Identity) -> ApiError | None:
        """The call is made under `identity`: a named caller also takes its place among its requests in
        progress (`Admission.admit_caller`, given back when the exchange ends), or gets the refusal to
        answer with (503 overloaded: over its share under load). ANONYMOUS costs nothing."""
        self.identity = identity
        if identity is _ANONYMOUS:
            return None
        exchange = self._exchange
        if exchange._on_done is None:  # the exchange is over already: nothing to hold a place for
            return None
        refusal = self._plane.admission.admit_caller(identity.name)
        if refusal is None:
            exchange._on_done = self._caller_done
        return refusal

    def _caller_done(self) -> None:
        """The exchange of a named caller's request ended: both its places are given back."""
        admission = self._plane.admission
        admission.release()
        admission.release_caller(self.identity.name)

    def answer(self, status: int, headers: Headers, body: bytes) -> None:
        """Answer (the first time only), counted under the route's kind; the server adds framing headers."""
        if not self._open:
            return
        self._open = False
        kind = self._kind
        if kind is not None:
            plane = self._plane
            answered = plane.answered
            if answered is not None:
                answered(self.store, kind, status, _monotonic() - self._admitted)
            else:
                plane.count(self.store, kind, status)
                observe = plane.observe
                if observe is not None:
                    observe(self.store, status, _monotonic() - self._admitted)
            if self.identity is not _ANONYMOUS or status == 401:
                self._by_caller(status)
        try:
            self._exchange.answer(status, headers, body)
        except Exception:
            self._unwritable()

    def settle(self, result: Any) -> None:
        """Answer with the result of work done elsewhere (a callback's argument): a reply, anything with
        `status`, `headers` and `body` (an upstream's answer, passed on as it is), or the exception the work
        failed with (`fail`)."""
        if isinstance(result, BaseException):
            self.fail(result)
            return
        self.answer(result.status, result.headers, result.body)

    def answer_counted(self, status: int, headers: Headers, body: bytes) -> None:
        """`answer`, for an answer the handler has counted itself (a batch counts each of its keys): only
        timed here, then answered with no kind left to count it under."""
        if self._open and self._kind is not None:
            self._kind = None
            observe = self._plane.observe
            if observe is not None:
                observe(self.store, status, _monotonic() - self._admitted)
            if self.identity is not _ANONYMOUS or status == 401:
                self._by_caller(status)
        self.answer(status, headers, body)

    def _by_caller(self, status: int) -> None:
        """The answer, by the caller who asked (see the module docstring: by caller)."""
        caller_answered = self._plane.caller_answered
        if caller_answered is not None:
            caller_answered(self.identity.name, self.store, status, _monotonic() - self._admitted)

    def fail(self, error: BaseException) -> None:
        """Answer with `error`: an ApiError as the API's JSON error; anything else logged with its traceback
        and answered 500 without detail."""
        if not isinstance(error, ApiError):
            request = self.request
            log.error(
                "answering %s %r failed",
                request.method,
                request.path[:200],
                exc_info=error,
                extra={"request_id": request.request_id},
            )
            error = ApiError("internal error")  # the base class is the 500 internal_error
        self.answer(error.status, self._plane.error_headers(error), error_json(error.code, error.message))

    def _unwritable(self) -> None:
        """An answer that could not be written (headers that do not encode): logged, and a 500 instead,
        never a hung connection. Called from an except clause."""
        request = self.request
        log.exception("writing the answer to %r failed", request.path[:200], extra={"request_id": request.request_id})
        error = ApiError("internal error")
        self._exchange.answer(500, self._plane.error_headers(error), error_json(error.code, error.message))

    def __repr__(self) -> str:
        return f"Call({self.request!r}, answered={not self._open})"


@mypyc_attr(allow_interpreted_subclasses=True)
class RoutedDataPlane:
    """The skeleton of a service's data plane (see the module docstring). A subclass declares `routes` (a
    RouteTable of its handlers, functions taking the plane, the `Call` and the decoded path parameters)
    and passes its admission checks, its answer counter (`count(store, kind, status)`), what times its
    answers (`observe(store, status, seconds)`, None: untimed), the headers its error answers carry (say
    X-Keyroute-Node) and the most bytes a path parameter may decode to. A service that counts and times
    each answer together may pass `answered(store, kind, status, seconds)` instead, one call per answer,
    which then stands for both `count` and `observe` of the answers `Call.answer` counts. `caller_answered
    (identity, store, status, seconds)` counts and times named callers' answers too (None: not at all)."""

    routes: ClassVar[RouteTable]

    def __init__(
        self,
        admission: Admission,
        count: Count,
        *,
        max_parameter_bytes: int = 0,
        error_headers: Iterable[tuple[bytes, bytes]] = (),
        observe: Observe | None = None,
        answered: Answered | None = None,
        caller_answered: CallerAnswered | None = None,
    ) -> None:
        self.admission = admission
        self.observe = observe
        self.answered = answered
        self.caller_answered = caller_answered
        # What each admitted exchange calls when it ends: one bound method for all of them.
        self._release = admission.release
        self.count = count
        self.max_parameter_bytes = max_parameter_bytes
        self._error_headers = tuple(error_headers)
        self._tasks: set[asyncio.Task[None]] = set()  # handlers' tasks in progress (the loop keeps weak refs)
        # /stores/: every route's path starts with it; the server compares a request's raw path with it (the
        # `accepts` of a server that does not look for `prefix`).
        self.prefix = self.routes.prefix
        # What the admission checks are given as a request's path: the prefix, neither a probe's path nor a
        # protected one, as no percent-decoding of a path that starts with it can be.
        self._admitted_path = self.prefix.decode("ascii")
        self._fast = self.routes.fast_route()
        # Who may read which store (keyroute.http.authn): None, without access control, checks nothing.
        self.callers: Callers | None = None

    def accepts(self, method: str, path: bytes) -> bool:
        return path.startswith(self.prefix)

    def handle(self, exchange: Answerable) -> None:
        withheld = self.admission.withheld
        if withheld is not None:  # this process may serve no read now: said at once, no place taken
            exchange.answer(withheld.status, self.error_headers(withheld), error_json(withheld.code, withheld.message))
            return
        request = exchange.request
        refusal = self.admission.admit_head(self._admitted_path, request.target_bytes, request.headers)
        if refusal is not None:
            exchange.answer(refusal.status, self.error_headers(refusal), error_json(refusal.code, refusal.message))
            return
        admitted = _monotonic()
        # Exchange.on_done, inline (once per request): a fresh exchange has no callback yet.
        exchange._on_done = self._release
        parts = request.path.split(b"/")
        fast = self._fast
        if (
            fast is not None
            and len(parts) == fast.length
            and parts[fast.at] == fast.literal
            and request.method in fast.allowed
        ):
            # The table's fast route (a key read, `RouteTable.fast_route`), matched and decoded here when
            # both parameters are plain: not empty (the key may be), nothing percent-encoded, within the
            # limit, UTF-8. That is what the table and `path_parameter` would decide too; they decide every
            # other case, and every error, below.
            one = parts[fast.first]
            two = parts[fast.second]
            limit = self.max_parameter_bytes
            if (
                one
                and (two or not fast.second_required)
                and 37 not in one  # '%'
                and 37 not in two
                and not (limit and (len(one) > limit or len(two) > limit))
            ):
                try:
                    store = one.decode()
                    key = two.decode()
                except UnicodeDecodeError:
                    pass
                else:
                    call = Call(self, exchange, fast.route.kind, admitted)
                    call.store = store
                    try:
                        if self.callers is not None:
                            self._identify(call, admitted)
                        work = fast.route.handler(self, call, store, key)
                    except Exception as exc:
                        call.fail(exc)
                        return
                    if work is not None:
                        self.spawn(call, work)
                    return
        route = self.routes.resolve(request.method, parts)
        if isinstance(route, ApiError):
            Call(self, exchange, None).fail(route)
            return
        call = Call(self, exchange, route.kind, admitted)
        try:
            parameters = route.decode(parts, self.max_parameter_bytes)
        except ApiError as exc:
            call.store = route.store_label(parts)
            call.fail(exc)
            return
        call.store = parameters[0]
        try:
            if self.callers is not None:
                self._identify(call, admitted)
            work = route.handler(self, call, *parameters)
        except Exception as exc:
            call.fail(exc)
            return
        if work is not None:
            self.spawn(call, work)

    def _identify(self, call: Call, admitted: float) -> None:
        """Access control's check of `call` (`callers`: raises 401 or 403), then its caller's fair share of
        admission (raises 503 overloaded)."""
        self.callers.admit(call, admitted)  # type: ignore[union-attr]
        refusal = call.admit_as(call.identity)
        if refusal is not None:
            raise refusal

    def spawn(self, call: Call, work: Awaitable[None]) -> None:
        """Run `work` (what a handler returned) in a task that answers `call` if `work` fails."""
        task = asyncio.get_running_loop().create_task(self._run(call, work))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, call: Call, work: Awaitable[None]) -> None:
        bind_request_id({}, call.request.request_id)  # this task's log lines carry it
        try:
            await work
        except Exception as exc:
            call.fail(exc)
        # Cancelled, the task ends here unanswered: its exchange's end gives the admission place back.
        if not call.answered:
            call.fail(RuntimeError(f"the handler's task of {call.request!r} ended without answering"))

    def error_headers(self, error: ApiError) -> Headers:
        """The headers of an error answer: content type, the service's own, the error's own."""
        return error_headers(error, self._error_headers)


def _not_a_key_path(plane: RoutedDataPlane, call: Call, store: str) -> None:
    raise NotFound("not a key path: a key containing '/' must be percent-encoded as %2F")


# Every path under /stores/{store}/keys/ that no route of a key fits: a GET is told why (most often a key
# with an unencoded '/'), another method is a 405 as for a key. Both services declare it last.
NOT_A_KEY_PATH = Route("/stores/{store}/keys/{rest:path}", ("GET",), _not_a_key_path)


_BATCH_GET = openapi.batch_get(any_key=False)


def store_routes(
    read_key: Callable[..., Any],
    read_history: Callable[..., Any],
    read_windows: Callable[..., Any],
    batch_get: Callable[..., Any],
    *own: Route,
    batch_operation: Any = None,
) -> RouteTable:
    """The data API as routers and nodes both serve it, from their handlers: a key first (`fast_route`), its
    history and windows, batch-get, the service's `own` routes (its range read: a store's on a router, one
    partition's on a node; the answers' schema), NOT_A_KEY_PATH last. Each with its OpenAPI operation
    (`batch_operation`: the batch-get's, a node's unless given)."""
    key = "/stores/{store}/keys/{key}"
    return RouteTable(
        [
            Route(key, ("GET",), read_key, KIND_KEY, (openapi.GET_KEY,)),
            Route(f"{key}/history", ("GET",), read_history, KIND_TIMELINE, (openapi.GET_HISTORY,)),
            Route(f"{key}/windows", ("GET",), read_windows, KIND_TIMELINE, (openapi.GET_WINDOWS,)),
            Route("/stores/{store}/batch-get", ("POST",), batch_get, KIND_BATCH, (batch_operation or _BATCH_GET,)),
            *own,
            NOT_A_KEY_PATH,
        ]
    )
