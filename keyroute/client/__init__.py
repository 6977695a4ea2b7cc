"""A Python client of keyroute's HTTP API: `Client` (blocking) and `AsyncClient` (asyncio).

    from keyroute.client import Client, KeyNotFound

    with Client("http://keyroute.example:8080") as kr:
        booking = kr.get("bookings", "C000042")          # Value(store, key, partition, version, value, ...)
        found = kr.get_many("bookings", ["C1", "C2"])    # one Value or KeyrouteError per key, in order
        for row in kr.history("trips", "C000042", start=datetime(2024, 6, 1, tzinfo=UTC)):
            ...                                          # every row, page after page (cursors followed)
        for window in kr.windows("fares_5m", "C000042", start=..., end=...):
            ...
        for key, value in kr.range("bookings", prefix="C0000"):
            ...

Keys are given as the store's key format has them: `str`, `int` (integer formats), `uuid.UUID` or `str`
(uuid), `bytes` (bytes keys, sent as base64url). Times (`start` inclusive, `end` exclusive) as `datetime`
(naive means UTC), `date`, `int` (a store ordered by an integer column) or ISO 8601 text.

Answers come as JSON, or as Avro with `Client(url, answer_format="avro")` (or `answer_format="avro"` on one
read: `get`, `get_many`, `history`, `windows`): smaller on the wire, decoded to the same Python values.

Every error answer is raised as its `KeyrouteError` subclass (`KeyNotFound`, `StoreNotFound`, `BadKey`,
`BadRequest`, `BadCursor`, `CursorExpired`, `WrongStoreKind`, `Unauthorized`, `Forbidden`, `Unavailable`
with `retry_after`, ...), and
no answer at all (nothing listens, a timeout) as `ConnectionFailed`, an `Unavailable` too.
Reads are retried on 503 (after the answer's Retry-After, capped, with back-off) and on connection
failures, up to `retries` times; connections are kept alive; clients close with `close()` or as context
managers. Reads go over a wire of the client's own (keep-alive HTTP/1.1 on sockets for `Client`, keyroute.http's
member wire for `AsyncClient`); httpx reads the partition map, and carries every request when a `transport`
(an httpx transport) is given.

Over HTTPS: `Client("https://keyroute.example", verify="ca.pem", cert=("client.crt", "client.key"))`;
`verify` is a CA bundle (or True for the system's CAs, False for none), `cert` the client certificate a
router requiring one (`--tls-client-ca`) or, in direct mode, the nodes (`--member-ca`) ask for.

The modules: `_base` (every decision: requests, direct routing from the partition map, retries, reading
answers), `_sync` and `_async` (the I/O of `Client` and `AsyncClient`), and one per concern: `_config`
(settings, TLS), `_urls` (keys, times, paths), `_models` (answers, values), `_paging`, `_plans`, `_direct`
(direct routing's map), `_wire` (the blocking wire), `_errors` (the exceptions).
"""

from keyroute.client._async import AsyncClient
from keyroute.client._errors import (
    BadCursor,
    BadKey,
    BadRequest,
    ConnectionFailed,
    CursorExpired,
    Forbidden,
    KeyNotFound,
    KeyrouteError,
    NotLive,
    StoreNotFound,
    Unauthorized,
    Unavailable,
    WrongStoreKind,
)
from keyroute.client._models import Value
from keyroute.client._paging import paged_params as paged_params
from keyroute.client._paging import range_params as range_params
from keyroute.client._sync import Client
from keyroute.client._urls import key_segment as key_segment
from keyroute.client._urls import key_text as key_text
from keyroute.client._urls import time_text as time_text

__all__ = [
    "AsyncClient",
    "BadCursor",
    "BadKey",
    "BadRequest",
    "Client",
    "ConnectionFailed",
    "CursorExpired",
    "Forbidden",
    "KeyNotFound",
    "KeyrouteError",
    "NotLive",
    "StoreNotFound",
    "Unauthorized",
    "Unavailable",
    "Value",
    "WrongStoreKind",
]
