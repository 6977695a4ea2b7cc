"""The data plane's route table: which handler a request's method and raw path go to, or why none does.

A route is a path template (`/stores/{store}/keys/{key}`) and its methods. The table is compiled once, when
a data plane class is defined, and matches a request as Starlette's `Route.matches` and `Router` do:

    Match.FULL      the path and the method fit a route: that route answers (the first such route)
    Match.PARTIAL   the path fits a route, the method does not: 405 method_not_allowed, `Allow` saying that
                    route's methods (the first such route), unless a later route fits fully
    Match.NONE      no route's path fits: 404 not_found

Matching is done on the raw path split at '/', never on a decoded path (a key's %2F must not become a
separator): one split and a few byte comparisons per request, no regular expression. A template segment is
a literal, a parameter `{name}` (one segment, not empty, except the key: the empty key is a key), or, last,
`{name:path}` (the rest of the path, '/' included, perhaps empty; not passed to the handler). The parameters of
the route that answers are decoded by `keyroute.api.path_parameter`, one rule for every parameter.
GET routes take HEAD too.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from keyroute.api import KEY_PARAMETER, ApiError, NotFound, path_parameter
from keyroute.http.errors import MethodNotAllowed

__all__ = ["FastRoute", "Match", "MethodNotAllowed", "Route", "RouteTable"]


class Match(enum.Enum):
    NONE = 0
    PARTIAL = 1
    FULL = 2


@dataclass(frozen=True, slots=True)
class Route:
    """`handler(plane, call, *parameters)` answers `methods` (HEAD with GET) on paths that fit `template`;
    its answers are counted under `kind` (None: not counted). `operations`: what each method does, as the
    API's OpenAPI document says it (keyroute.http.openapi `Operation`s, one per method); none for a route
    that is not part of the API (one that only explains a 404)."""

    template: str
    methods: tuple[str, ...]
    handler: Callable[..., Any]
    kind: str | None = None
    operations: tuple[Any, ...] = ()
    # Compiled from the template (by __post_init__): the number of segments (the least, for a `:path`
    # route), the literal segments by index, the parameters by index, whether the rest of a path is taken.
    length: int = field(init=False)
    literals: tuple[tuple[int, bytes], ...] = field(init=False)
    parameters: tuple[tuple[int, str], ...] = field(init=False)
    required: tuple[int, ...] = field(init=False)  # the parameters that may not be empty
    open_ended: bool = field(init=False)
    allowed: frozenset[str] = field(init=False)
    allow: str = field(init=False)  # the `Allow` header of a 405 from this route
    # decode(parts, max_bytes): the parameters of a path that fits, decoded (`path_parameter` raises).
    decode: Callable[[Sequence[bytes], int], tuple[str, ...]] = field(init=False)

    def __post_init__(self) -> None:
        if not self.template.startswith("/"):
            raise ValueError(f"a route template starts with '/': {self.template!r}")
        segments = self.template.split("/")
        literals: list[tuple[int, bytes]] = []
        parameters: list[tuple[int, str]] = []
        open_ended = False
        for index, segment in enumerate(segments):
            if segment.startswith("{") and segment.endswith("}"):
                name, _, converter = segment[1:-1].partition(":")
                if converter == "path":
                    if index != len(segments) - 1:
                        raise ValueError(f"{{{name}:path}} must be the last segment: {self.template!r}")
                    open_ended = True
                elif converter:
                    raise ValueError(f"unknown converter {converter!r} in {self.template!r}")
                else:
                    parameters.append((index, name))
            elif "{" in segment or "}" in segment:
                raise ValueError(f"a parameter is a whole segment: {self.template!r}")
            else:
                literals.append((index, segment.encode("ascii")))
        set_ = object.__setattr__  # frozen: set once, here
        if not parameters:
            raise ValueError(f"a route names its store (its first parameter): {self.template!r}")
        set_(self, "length", len(segments))
        set_(self, "literals", tuple(literals))
        set_(self, "parameters", tuple(parameters))
        set_(self, "required", tuple(index for index, name in parameters if name != KEY_PARAMETER))
        set_(self, "open_ended", open_ended)
        methods = list(self.methods)
        if "GET" in methods and "HEAD" not in methods:
            methods.insert(methods.index("GET") + 1, "HEAD")
        set_(self, "allowed", frozenset(methods))
        set_(self, "allow", ", ".join(methods))
        set_(self, "decode", _decoder(tuple(parameters)))

    def store_label(self, parts: Sequence[bytes]) -> str:
        """The store an answer to a path whose parameters do not all decode is counted under: the first
        parameter when it decodes, else ""."""
        index, name = self.parameters[0]
        try:
            return path_parameter(parts[index], name, 0)
        except ApiError:
            return ""

    def matches(self, method: str, parts: Sequence[bytes]) -> Match:
        """How this route fits a request: `parts` is its raw path split at '/'."""
        if not self.fits(parts):
            return Match.NONE
        return Match.FULL if method in self.allowed else Match.PARTIAL

    def fits(self, parts: Sequence[bytes]) -> bool:
        """Whether the raw path `parts` fits the template (whatever the method)."""
        if len(parts) != self.length and not (self.open_ended and len(parts) >= self.length):
            return False
        return all(parts[i] == literal for i, literal in self.literals) and all(parts[i] for i in self.required)


# '%' as a byte value: `37 in segment` is one memchr, several times cheaper than `b"%" in segment`.
_PERCENT = ord("%")


def _decoder(parameters: tuple[tuple[int, str], ...]) -> Callable[[Sequence[bytes], int], tuple[str, ...]]:
    """`Route.decode` for these parameters. It runs once per request: the common two parameters (a store
    and a key) are written out, with a fast path for segments with nothing percent-encoded in them that
    gives what `path_parameter` gives (which decides every other case, errors included)."""
    if len(parameters) == 2:
        (i0, n0), (i1, n1) = parameters

        def decode_two(parts: Sequence[bytes], limit: int) -> tuple[str, ...]:
            a, b = parts[i0], parts[i1]
            try:
                one = path_parameter(a, n0, limit) if _PERCENT in a or (limit and len(a) > limit) else a.decode()
                two = path_parameter(b, n1, limit) if _PERCENT in b or (limit and len(b) > limit) else b.decode()
            except UnicodeDecodeError:  # raw bytes that are not UTF-8 (never percent-encoded): refused there
                return path_parameter(a, n0, limit), path_parameter(b, n1, limit)
            return one, two

        return decode_two
    return lambda parts, limit: tuple(path_parameter(parts[i], n, limit) for i, n in parameters)


class RouteTable:
    """Routes, in order, compiled for matching: routes are looked up by the number of segments of the path,
    so a request is compared with the few routes of its length only. `prefix` is what every route's path
    starts with (its leading literal segments): `resolve` is only given paths that start with it."""

    def __init__(self, routes: Iterable[Route]) -> None:
        self.routes = tuple(routes)
        if not self.routes:
            raise ValueError("a route table has routes")
        longest = max(route.length for route in self.routes)
        # The leading literal segments every route has: the prefix, checked once by the caller, not per route.
        first = self.routes[0].literals
        shared = 0
        while shared < len(first) and first[shared][0] == shared:
            if not all(first[shared] in route.literals for route in self.routes):
                break
            shared += 1
        self.prefix = b"/".join(literal for _, literal in first[:shared]) + b"/"
        self._shared = shared
        # candidates[n]: the routes a path of n segments may fit, in table order; the last entry is for every
        # path longer than any template (only `:path` routes).
        self._candidates = tuple(
            tuple(route for route in self.routes if route.length == n or (route.open_ended and n >= route.length))
            for n in range(longest + 2)
        )
        self._longest = longest + 1

    def resolve(self, method: str, parts: Sequence[bytes]) -> Route | ApiError:
        """The route that answers a request (`parts`: its raw path, which starts with `prefix`, split at
        '/'), or the error that answers it instead: MethodNotAllowed for the first route its path fits, when
        none fits fully; else NotFound."""
        n = len(parts)
        partial: Route | None = None
        for route in self._candidates[n if n < self._longest else self._longest]:
            if route.fits(parts):
                if method in route.allowed:
                    return route
                if partial is None:
                    partial = route
        if partial is not None:
            return MethodNotAllowed(partial.allow)
        return NotFound("Not Found")

    def fast_route(self) -> FastRoute | None:
        """The table's first route when `resolve` answers every path of its length that fits it with it: a
        route of two parameters (a store and a key) and one literal segment past the prefix, the first
        candidate of its length. A data plane may match and decode that route's plain paths itself
        (`FastRoute`); None when the first route is not such a route."""
        route = self.routes[0]
        extra = [(i, literal) for i, literal in route.literals if i >= self._shared]
        if route.open_ended or len(route.parameters) != 2 or len(extra) != 1:
            return None
        if self._candidates[route.length][0] is not route:
            return None
        (first, _), (second, _) = route.parameters
        if first not in route.required:
            return None
        (at, literal) = extra[0]
        return FastRoute(route, route.length, at, literal, route.allowed, first, second, second in route.required)


@dataclass(frozen=True, slots=True)
class FastRoute:
    """`RouteTable.fast_route`: a route whose paths are `length` segments, `literal` at index `at` past the
    prefix, its two parameters at `first` (never empty) and `second` (empty allowed unless
    `second_required`)."""

    route: Route
    length: int
    at: int
    literal: bytes
    allowed: frozenset[str]
    first: int
    second: int
    second_required: bool
