"""The HTTP data API shared by routers and nodes: header names, error codes, answer bodies.

    ApiError                       status + code + human message (+ headers); rendered as JSON
     ├── StoreNotFound             404 store_not_found
     ├── KeyNotFound               404 key_not_found
     ├── BadKey                    400 bad_key (does not fit the store's key format)
     ├── KeyTooLong                414 key_too_long (400 for a key inside a batch-get body)
     ├── BadRequest                400 bad_request
     ├── NotLive                   400 not_live (min_offset asked of a store that does not follow a topic)
     ├── NotFound                  404 not_found (no such route)
     ├── PayloadTooLarge           413 too_many_keys
     ├── BodyTooLarge              413 body_too_large
     ├── Unauthorized              401 unauthorized, with WWW-Authenticate: Bearer
     ├── Forbidden                 403 forbidden (the caller may not read the store it names)
     ├── HeadersTooLarge           431 headers_too_large
     └── RetryLater                503, with Retry-After
          ├── Overloaded           503 overloaded
          ├── PartitionUnavailable 503 partition_unavailable
          ├── NoPartitionMap       503 no_partition_map (a router that has not read a partition map yet)
          └── NotUpToBound         503 not_up_to_bound (and X-Keyroute-Offset when known)

Limits shared by routers and nodes (`DEFAULT_MAX_*`) are checked by helpers here, so every path that
reads a key (the full application or a leaner one in front of it) applies the same rules.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable, Mapping
from decimal import Decimal
from itertools import accumulate
from json.encoder import encode_basestring
from typing import Any
from urllib.parse import parse_qsl, unquote_to_bytes

HEADER_PARTITION = "x-keyroute-partition"
HEADER_NODE = "x-keyroute-node"
HEADER_VERSION = "x-keyroute-version"
HEADER_HOPS = "x-keyroute-hops"
HEADER_GENERATION = "x-keyroute-generation"
HEADER_FORWARDED_BY = "x-keyroute-forwarded-by"
HEADER_REQUEST_ID = "x-request-id"
# Answers of live stores: the partition's last applied offset (-1: none yet) and how many records it is behind.
HEADER_OFFSET = "x-keyroute-offset"
HEADER_LAG = "x-keyroute-lag"
# A read's freshness bound (`?min_offset=N`, or "min_offset"/"min_offsets" in a batch-get body).
MIN_OFFSET = "min_offset"
# Kafka offsets are signed 64-bit integers.
MAX_OFFSET = (1 << 63) - 1
# Set by routers on requests to nodes: the node may still forward once (the router's view may be stale).
HEADER_ROUTER = "x-keyroute-router"
# Proves a request comes from a cluster member (keyroute.auth.security); without it, the member headers
# above are a client's words and are ignored when a cluster secret is configured.
HEADER_AUTH = "x-keyroute-auth"
MEMBER_HEADERS = frozenset(
    {HEADER_HOPS, HEADER_ROUTER, HEADER_PARTITION, HEADER_GENERATION, HEADER_FORWARDED_BY, HEADER_AUTH}
)

DEFAULT_MAX_KEY_BYTES = 1024
DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024
DEFAULT_MAX_HEADER_BYTES = 32 * 1024
DEFAULT_MAX_CONCURRENT_REQUESTS = 1024
DEFAULT_BODY_TIMEOUT_S = 10.0

KEYS_PREFIX = "/stores/"


class ApiError(Exception):
    """An error answer. A subclass names its status and code where it is declared:
    `class KeyNotFound(ApiError, status=404, code="key_not_found"): ...` (a subclass of a subclass may name
    only the one it changes); the attributes stay readable and overridable as class attributes."""

    status = 500
    code = "internal_error"

    def __init_subclass__(cls, status: int | None = None, code: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if status is not None:
            cls.status = status
        if code is not None:
            cls.code = code

    def __init__(self, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": self.code, "message": self.message}


class StoreNotFound(ApiError, status=404, code="store_not_found"):
    # How many of the stores that exist an answer names.
    SHOWN = 10

    @classmethod
    def named(cls, name: str, stores: Iterable[str]) -> StoreNotFound:
        """404 for a store `name` that is not among `stores` (those that exist): the message names a few of
        them, sorted, and the closest ones by spelling as "did you mean"."""
        known = sorted(stores)
        # A name far longer than any store's is no typo of one (and would make the comparison costly).
        close = difflib.get_close_matches(name, known, n=3) if len(name) <= 200 else []
        message = f"no store named {name!r}"
        if close:
            message += f"; did you mean {' or '.join(repr(c) for c in close)}?"
        if known:
            more = len(known) - cls.SHOWN
            shown = ", ".join(known[: cls.SHOWN]) + (f" and {more} more" if more > 0 else "")
            message += f" (stores: {shown})"
        else:
            message += " (no store is published)"
        return cls(message)


class KeyNotFound(ApiError, status=404, code="key_not_found"): ...


class BadKey(ApiError, status=400, code="bad_key"): ...


# Key formats whose batch-get keys may also be JSON integers (their decimal text is the key).
INTEGER_KEY_FORMATS = frozenset({"int16", "int32", "int64", "avro", "protobuf", "json_schema"})


def bad_batch_key(store: str, key_format: str, raw: Any) -> BadKey:
    """The 400 of a batch-get key that is no form `key_format` takes in a JSON body (a float, null, a list,
    an integer for a store whose keys are not integers): the message names the forms it does take."""
    forms = "a JSON string or integer" if key_format in INTEGER_KEY_FORMATS else "a JSON string"
    try:
        shown = json.dumps(raw, ensure_ascii=False)
    except (TypeError, ValueError):
        shown = repr(raw)
    if len(shown) > 40:
        shown = shown[:37] + "..."
    return BadKey(f"store {store!r} has {key_format} keys: a batch-get key is {forms}, not {shown}")


class KeyTooLong(ApiError, status=414, code="key_too_long"): ...


class BatchKeyTooLong(KeyTooLong, status=400):
    """The same limit for one key of a batch-get body: that entry is a 400, the batch goes on."""


class BadRequest(ApiError, status=400, code="bad_request"): ...


class PayloadTooLarge(ApiError, status=413, code="too_many_keys"): ...


class NotFound(ApiError, status=404, code="not_found"): ...


class BodyTooLarge(ApiError, status=413, code="body_too_large"): ...


class BodyTimeout(ApiError, status=408, code="body_timeout"):
    """The body did not arrive in time; the connection is closed (the rest may still be on its way)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, {"Connection": "close"})


class Unauthorized(ApiError, status=401, code="unauthorized"):
    def __init__(self, message: str, invalid_token: bool = False) -> None:
        challenge = 'Bearer error="invalid_token"' if invalid_token else "Bearer"
        super().__init__(message, {"WWW-Authenticate": challenge})


class Forbidden(ApiError, status=403, code="forbidden"): ...


class HeadersTooLarge(ApiError, status=431, code="headers_too_large"): ...


class RetryLater(ApiError, status=503):
    """A 503 whose request may succeed later: it says when to ask again (Retry-After, in seconds)."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message, {"Retry-After": str(retry_after_s)})


class Overloaded(RetryLater, code="overloaded"): ...


class PartitionUnavailable(RetryLater, code="partition_unavailable"): ...


class NoPartitionMap(RetryLater, code="no_partition_map"):
    """A router that has not yet read a partition map (ZooKeeper unreachable since it started) knows no
    store: it cannot tell "no such store" from "not known yet"."""


class PolicyNotSatisfied(RetryLater, code="policy_not_satisfied"):
    """This router or node does not satisfy the cluster's security policy (keyroute.cluster.cluster_policy) since it
    was tightened: it serves no read until its settings or the policy change."""


class NotLive(ApiError, status=400, code="not_live"): ...


class NotUpToBound(RetryLater, code="not_up_to_bound"):
    """The partition has not applied the asked offset within the wait: another replica may have, or this
    one soon will."""

    def __init__(self, message: str, retry_after_s: int = 1, offset: int | None = None) -> None:
        super().__init__(message, retry_after_s)
        if offset is not None:
            self.headers[HEADER_OFFSET] = str(offset)


# -- integers in requests --------------------------------------------------------------------------------
#
# Every integer a request carries is read by one of two functions, whatever field it is:
#   in a JSON body    `json_integer`: a JSON number with no fractional part, however it is written (14571,
#                     14571.0, 1.4571e4: JSON Schema 2020-12 counts all three as the integer 14571), read
#                     exactly (never through a binary float); never a boolean; within the field's range.
#                     Bodies are parsed with `loads_json`, which reads such numbers as ints.
#   in a query string `integer_text` (`text_integer` raises for it): decimal digits only (a '-' first where
#                     the field may be negative): no sign '+', no spaces, no fraction, no exponent. Every
#                     query parameter that is an integer is read by it (min_offset here; limit, from and to
#                     of an integer timeline in keyroute.storage.timeline; limit and version of a range in
#                     keyroute.storage.ranges), each with its own message.
# A value outside these rules or the field's range is a 400 bad_request naming the field and the range.

# A number written with more digits than this before its point is no int64 (and is never expanded: 1e999999).
_MAX_INTEGER_DIGITS = 40

# -- bounded request bodies ---------------------------------------------------------------------------------
#
# A request body is decoded only within these bounds, so that no body, however it nests or writes its numbers,
# costs more than its bytes or reaches an error no answer names (a RecursionError of the decoder, Python's
# limit on the digits of an int): past them the answer is 400 bad_request naming the limit. docs/http-api.md
# ("Request bodies") states both.

# The deepest nesting of arrays and objects a request body may have (`{"keys": [...]}` is 2 deep).
MAX_JSON_DEPTH = 32
# The longest number, in characters, a request body may write (an int64 takes 20).
MAX_JSON_NUMBER_CHARS = 1000

# A JSON string (its brackets are text, not nesting); the unrolled form matches in one pass.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# bytes.translate's delete argument: every byte but the four brackets.
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
# The nesting step of each bracket byte left after the translation.
_DEPTH_STEP = tuple(1 if b in b"[{" else -1 for b in range(256))


def json_depth(body: bytes) -> int:
    """How deep arrays and objects nest in the JSON text `body` (0 for a scalar), counted without decoding it
    and without recursion; brackets inside strings are text. A body that is not JSON gets some number, which
    the decoder's own error then makes moot."""
    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0)


def _number_too_long(text: str) -> BadRequest:
    return BadRequest(
        f"a number in the body is written with {len(text)} characters; at most {MAX_JSON_NUMBER_CHARS} are allowed"
    )


def _json_int(text: str) -> int:
    """A JSON number without fraction or exponent, within MAX_JSON_NUMBER_CHARS."""
    if len(text) > MAX_JSON_NUMBER_CHARS:
        raise _number_too_long(text)
    return int(text)


def _json_number(text: str) -> int | float:
    """A JSON number with a fraction or exponent: an int when it has no fractional part, else a float. A
    number beyond a float's range (1e999) is refused, as is one written with more than MAX_JSON_NUMBER_CHARS."""
    if len(text) > MAX_JSON_NUMBER_CHARS:
        raise _number_too_long(text)
    try:
        number: Decimal | None = Decimal(text)
    except ArithmeticError:  # an exponent beyond even Decimal's reach (0e99999999999999999999)
        number = None
    if number is None:
        if not text.lower().partition("e")[0].strip("-0."):
            return 0  # zero, whatever its exponent
    elif number.adjusted() < _MAX_INTEGER_DIGITS and number == number.to_integral_value():
        return int(number)
    value = float(text)
    if value in (_INFINITY, -_INFINITY):
        raise BadRequest(f"a number in the body is beyond the range of a double: {text[:40]}")
    return value


_INFINITY = float("inf")


def _no_constant(name: str) -> Any:
    raise BadRequest(f"{name} is not a JSON number: the body may not hold NaN, Infinity or -Infinity")


def loads_json(body: bytes | str) -> Any:
    """A request body's JSON, its integral numbers as ints (`_json_number`), decoded within the bounds above
    (raises BadRequest past them: nesting deeper than MAX_JSON_DEPTH, a number longer than
    MAX_JSON_NUMBER_CHARS or beyond a double's range, NaN or Infinity). Raises ValueError (and
    UnicodeDecodeError) as `json.loads` does for text that is not JSON."""
    raw = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    # A body with fewer brackets than the limit cannot nest past it: the common case costs two counts.
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and json_depth(raw) > MAX_JSON_DEPTH:
        raise BadRequest(f"the body nests arrays and objects more than {MAX_JSON_DEPTH} deep (the limit)")
    return json.loads(body, parse_float=_json_number, parse_int=_json_int, parse_constant=_no_constant)


def json_integer(value: Any, what: str, low: int, high: int, meaning: str = "an integer") -> int:
    """`value` (from `loads_json`) as an integer field from `low` to `high`. Raises BadRequest for a boolean,
    a number with a fractional part, anything else that is not a number, or a number out of range."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # a body parsed with plain json.loads
    if value.__class__ is not int or not low <= value <= high:
        raise BadRequest(f"{what} must be {meaning} from {low} to {high}, got {value!r:.40}")
    return value


def integer_text(text: str, signed: bool = False) -> int | None:
    """The integer a query parameter's `text` spells, or None: decimal digits only (a '-' first when `signed`),
    at most 19 of them (an int64 has at most 19). The caller checks the range, and says what it expected."""
    digits = text[1:] if signed and text[:1] == "-" else text
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 19:
        return None
    return int(text)


def text_integer(text: str, what: str, low: int, high: int, meaning: str = "an integer") -> int:
    """A query parameter's `text` as an integer from `low` to `high` (`integer_text`, signed when `low` is
    negative). Raises BadRequest otherwise."""
    value = integer_text(text, low < 0)
    if value is None or not low <= value <= high:
        raise BadRequest(f"{what} must be {meaning} from {low} to {high}, got {text[:40]!r}")
    return value


def query_params(raw_query: bytes, allowed: tuple[str, ...], error: type[Exception]) -> dict[str, str]:
    """The parameters of a query string (raw, percent-encoded), each of `allowed` at most once. Raises `error`
    (the caller's own class: each read names its mistakes in its own terms) for a malformed query string,
    an unknown parameter or one given twice."""
    try:
        text = raw_query.decode("ascii")
        pairs = parse_qsl(text, keep_blank_values=True, strict_parsing=bool(text), errors="strict")
    except (UnicodeDecodeError, ValueError):
        raise error("the query string is malformed") from None
    given: dict[str, str] = {}
    for name, value in pairs:
        if name not in allowed:
            raise error(f"unknown query parameter {name!r} (expected some of: {', '.join(allowed)})")
        if name in given:
            raise error(f"query parameter {name!r} is given twice")
        given[name] = value
    return given


def parse_min_offset(text: str) -> int:
    """A `min_offset` given as text (a query parameter): a decimal offset in 0..MAX_OFFSET. Raises BadRequest.
    (`text_integer`, written out: a bounded read pays for it.)"""
    value = integer_text(text)
    if value is None or value > MAX_OFFSET:
        raise BadRequest(f"min_offset must be an offset: an integer from 0 to {MAX_OFFSET}, got {text[:40]!r}")
    return value


def min_offset_query(query: bytes) -> int | None:
    """The `min_offset` of a raw query string (without '?'), or None when it has none. Other parameters are
    ignored, as they always were. Raises BadRequest for a malformed or repeated one."""
    found: int | None = None
    for pair in query.split(b"&"):
        name, _, value = pair.partition(b"=")
        if name != b"min_offset":
            continue
        if found is not None:
            raise BadRequest("min_offset is given more than once")
        found = parse_min_offset(value.decode("latin-1"))
    return found


def offset_value(value: Any, what: str = MIN_OFFSET) -> int:
    """A bound given as JSON (a batch-get body): an integer in 0..MAX_OFFSET (`json_integer`: 14571.0 is
    14571). Raises BadRequest."""
    return json_integer(value, what, 0, MAX_OFFSET, "an offset: an integer")


def error_json(code: str, message: str) -> bytes:
    return json.dumps({"error": code, "message": message}, ensure_ascii=False).encode("utf-8")


def error_headers(exc: ApiError, extra: Iterable[tuple[bytes, bytes]] = ()) -> list[tuple[bytes, bytes]]:
    """The raw headers of an ApiError's JSON answer: content type, `extra`, the error's own (no length)."""
    headers = [(b"content-type", b"application/json"), *extra]
    for name, value in exc.headers.items():
        headers.append((name.lower().encode("latin-1"), value.encode("latin-1")))
    return headers


def is_key_read(method: str, raw_path: bytes) -> bool:
    """Whether a request may be a single-key read: GET or HEAD of a raw path under /stores/ with /keys/ in
    it (cheap; `key_path_segment` checks the path fully)."""
    return method in ("GET", "HEAD") and raw_path.startswith(b"/stores/") and raw_path.find(b"/keys/", 8) > 0


# The path parameter that names a key: the one that may be empty (the empty key is a key) and whose
# faults are `bad_key` rather than `bad_request`.
KEY_PARAMETER = "key"


# A '%' that does not start an escape: not followed by two hex digits.
_MALFORMED_ESCAPE = re.compile(rb"%(?![0-9A-Fa-f]{2})")


def path_parameter(raw: bytes, name: str, max_bytes: int = DEFAULT_MAX_KEY_BYTES) -> str:
    """The one rule by which a path parameter is read from its raw (still percent-encoded) path segment:
    percent-decoded, then decoded as UTF-8, strictly: a segment that is not UTF-8 is refused, never guessed
    at (no Latin-1 fallback, no replacement character). A `%` not followed by two hex digits is refused too,
    never taken as itself: `%ZZ` is far likelier a client's encoding slip than a key, and a key read as
    something else than its writer meant would answer 404 for a key that exists (a `%` is written `%25`).

    Because each segment is decoded alone, after the path was split, a %2F is part of the parameter and
    never a separator. Raises BadKey (400 bad_key) for a key and BadRequest (400 bad_request) for another
    parameter that is not UTF-8 or holds a malformed escape, and KeyTooLong (414 key_too_long) when the
    decoded parameter is longer than `max_bytes` (0: no limit)."""
    # Checked before decoding too: a percent-encoded byte is 3 characters, so this bounds the work.
    if max_bytes and len(raw) > 3 * max_bytes:
        raise KeyTooLong(f"the {name} is longer than {max_bytes} bytes")
    if 37 in raw:  # 37: '%' (an int is one memchr, cheaper than b"%")
        bad = _MALFORMED_ESCAPE.search(raw)
        if bad is not None:
            shown = raw[bad.start() : bad.start() + 3].decode("ascii", "backslashreplace")
            message = f"the {name} holds {shown!r}, not a percent-escape (a % is written %25)"
            raise BadKey(message) if name == KEY_PARAMETER else BadRequest(message)
        data = unquote_to_bytes(raw)
    else:
        data = raw
    if max_bytes and len(data) > max_bytes:
        raise KeyTooLong(f"the {name} is longer than {max_bytes} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        message = f"the {name} is not valid UTF-8 after percent-decoding"
        raise (BadKey(message) if name == KEY_PARAMETER else BadRequest(message)) from None


def key_path_segment(raw_path: bytes, max_key_bytes: int = DEFAULT_MAX_KEY_BYTES) -> tuple[str, str] | None:
    """(store, key) from the raw request path `/stores/{store}/keys/{key}`, or None if it is not one.

    The raw path is used because servers percent-decode `path`, which would turn a key's `%2F` into a
    separator. Each parameter is read by `path_parameter` (raises as it does).
    """
    parts = raw_path.split(b"/")
    if len(parts) != 5 or parts[0] != b"" or parts[1] != b"stores" or parts[3] != b"keys" or not parts[2]:
        return None
    return path_parameter(parts[2], "store", max_key_bytes), path_parameter(parts[4], KEY_PARAMETER, max_key_bytes)


# The reads of a key's timeline, by the path segment after the key (keyroute.storage.timeline).
TIMELINE_READS = (b"history", b"windows")


def timeline_path_segment(raw_path: bytes, max_key_bytes: int = DEFAULT_MAX_KEY_BYTES) -> tuple[str, str, str] | None:
    """(store, key, read) from the raw path `/stores/{store}/keys/{key}/{read}` with read `history` or
    `windows`, or None if it is not one; raises as `key_path_segment` does."""
    head, _, read = raw_path.rpartition(b"/")
    if read not in TIMELINE_READS:
        return None
    located = key_path_segment(head, max_key_bytes)
    return None if located is None else (located[0], located[1], read.decode("ascii"))


def key_too_long(text: str, max_key_bytes: int) -> bool:
    """Whether a key given as text (a batch-get entry) is longer than `max_key_bytes` in UTF-8 (0: no limit).

    A lone surrogate (only possible as a JSON escape) counts as the 3 bytes it would take.
    """
    if not max_key_bytes or len(text) * 4 <= max_key_bytes:
        return False  # the common case needs no encoding: no character takes more than 4 bytes
    return len(text) > max_key_bytes or len(text.encode("utf-8", "surrogatepass")) > max_key_bytes


# A JSON string as `json.dumps(text, ensure_ascii=False)` writes it: the function that `dumps` (through
# `JSONEncoder.encode`) calls for a str, called directly (`dumps` with an option makes an encoder per call).
_json_string = encode_basestring


def found_body(store: str, key: str, partition: int, version: int, value_json: bytes) -> bytes:
    """The 200 answer, built around the stored value bytes so the value is never re-parsed: what
    `json.dumps({"store": store, "key": key, "partition": partition, "version": version, "value": <value>},
    ensure_ascii=False)` writes, in one format, without a dict."""
    return b'{"store": %s, "key": %s, "partition": %d, "version": %d, "value": %s}' % (
        _json_string(store).encode("utf-8"),
        _json_string(key).encode("utf-8"),
        partition,
        version,
        value_json,
    )


def timeline_body(
    store: str, key: str, partition: int, version: int, field: str, entries: list[bytes], next_cursor: str | None
) -> bytes:
    """The 200 answer to a history or windows read: the stored entries' JSON as they are, in a list under
    `field` ("rows" or "windows"), and `next` when a cursor continues the read."""
    head: dict[str, Any] = {"store": store, "key": key, "partition": partition, "version": version}
    if next_cursor is not None:
        head["next"] = next_cursor
    encoded = json.dumps(head, ensure_ascii=False).encode("utf-8")
    return b"".join((encoded[:-1], b', "', field.encode("ascii"), b'": [', b",".join(entries), b"]}"))


class WrongStoreKind(ApiError, status=400, code="wrong_store_kind"):
    """A history read on a store that is not a history store, a windows read on one that is not windowed."""


class BadCursor(ApiError, status=400, code="bad_cursor"): ...


class CursorExpired(ApiError, status=410, code="cursor_expired"):
    """The cursor continues a version of the store no longer served: start the read again."""
