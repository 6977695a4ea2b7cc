"""The client's errors: every answer of the API that is not a success, as one exception per error code.

KeyrouteError (status, code, message, retry_after)
├── KeyNotFound       404 key_not_found, expired
├── StoreNotFound     404 store_not_found
├── BadKey            400 bad_key, 414 key_too_long
├── BadRequest        400 bad_request, unknown_fields
├── BadCursor         400 bad_cursor
├── WrongStoreKind    400 wrong_store_kind
├── NotLive           400 not_live
├── Unauthorized      401 unauthorized
├── Forbidden         403 forbidden
├── CursorExpired     410 cursor_expired
└── Unavailable       503 (any code), after the client's retries
     └── ConnectionFailed  no answer at all (nothing listens, timed out, reset), after the retries
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from keyroute.client._models import Answer


class KeyrouteError(Exception):
    """An answer of the API that is not a success: its HTTP `status`, error `code` and `message`."""

    def __init__(self, status: int, code: str, message: str, retry_after: float | None = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after


class KeyNotFound(KeyrouteError):
    """404 key_not_found; 404 expired: the value is older than its store's time to live."""


class StoreNotFound(KeyrouteError):
    """404 store_not_found."""


class BadKey(KeyrouteError):
    """400 bad_key (or 414 key_too_long): the key does not fit the store's key format."""


class BadRequest(KeyrouteError):
    """400 bad_request: a malformed parameter or body; 400 unknown_fields: a projection naming fields the store
    lacks."""


class BadCursor(KeyrouteError):
    """400 bad_cursor."""


class WrongStoreKind(KeyrouteError):
    """400 wrong_store_kind: a history read of a store that is not a history store, and so on."""


class NotLive(KeyrouteError):
    """400 not_live: `min_offset` on a store that follows no topic."""


class Unauthorized(KeyrouteError):
    """401 unauthorized."""


class Forbidden(KeyrouteError):
    """403 forbidden: the caller may not read the store (or use /admin); the message names it."""


class CursorExpired(KeyrouteError):
    """410 cursor_expired: the version a paged read started on is no longer served; start again."""


class Unavailable(KeyrouteError):
    """503 (partition_unavailable, overloaded, not_up_to_bound), after the client's retries; `retry_after`
    is the answer's Retry-After in seconds."""


class ConnectionFailed(Unavailable):
    """No answer at all, after the client's retries: nothing listens at the address, the connection or the
    answer timed out, or the connection was reset. `status` is 0 (there was no HTTP answer), `code`
    "connection_failed"; the transport's own exception (httpx's) is the `__cause__`."""

    def __init__(self, message: str) -> None:
        super().__init__(0, "connection_failed", message)

    def __str__(self) -> str:
        return f"connection_failed: {self.message}"


def connection_failed(url: str, exc: httpx.TransportError, attempts: int) -> ConnectionFailed:
    """The error of a request to `url` that got no answer in `attempts` attempts, the last failing with `exc`."""
    reason = str(exc) or type(exc).__name__
    tries = f" ({attempts} attempts)" if attempts > 1 else ""
    return ConnectionFailed(f"no answer from {url}{tries}: {type(exc).__name__}: {reason}")


_ERRORS: dict[str, type[KeyrouteError]] = {
    "key_not_found": KeyNotFound,
    "expired": KeyNotFound,
    "store_not_found": StoreNotFound,
    "bad_key": BadKey,
    "key_too_long": BadKey,
    "bad_request": BadRequest,
    "unknown_fields": BadRequest,
    "bad_cursor": BadCursor,
    "wrong_store_kind": WrongStoreKind,
    "not_live": NotLive,
    "unauthorized": Unauthorized,
    "forbidden": Forbidden,
    "cursor_expired": CursorExpired,
}


def _kind(code: str, status: object) -> type[KeyrouteError]:
    return _ERRORS.get(code) or (Unavailable if status == 503 else KeyrouteError)


def error_of_answer(answer: Answer) -> KeyrouteError:
    """The error an answer that is not a success says (its JSON error body, else its status and text)."""
    try:
        body = answer.json()
        code, message = str(body["error"]), str(body["message"])
    except (ValueError, KeyError, TypeError):
        code, message = "http_error", answer.text[:200] or answer.reason_phrase
    retry_after = None
    header = answer.header("retry-after")
    if header is not None:
        try:
            retry_after = float(header)
        except ValueError:
            retry_after = None
    return _kind(code, answer.status_code)(answer.status_code, code, message, retry_after)


def error_of_entry(entry: Mapping[str, Any]) -> KeyrouteError:
    """The error one entry of a batch-get answer says."""
    code = str(entry.get("error", "http_error"))
    return _kind(code, entry.get("status"))(int(entry.get("status", 500)), code, str(entry.get("message", "")))
