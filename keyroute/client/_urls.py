"""Keys, times and stores as the API's paths and parameters take them: `key_text`, `key_segment`,
`time_text`, `key_path`."""

from __future__ import annotations

import base64
import datetime as dt
import json
import uuid
from collections.abc import Mapping
from functools import lru_cache
from typing import Any
from urllib.parse import quote

AnyKey = str | int | bytes | uuid.UUID  # a key as a read takes it (`key_text`)


def key_text(key: str | int | bytes | uuid.UUID | Mapping[str, Any]) -> str:
    """A key as the API takes it: text as is, integers in decimal, uuids as their text, bytes in base64url, a
    Schema Registry record key (a mapping) as compact JSON."""
    if key.__class__ is str:  # the common case first: no ABC check
        return key  # type: ignore[return-value]
    if isinstance(key, Mapping):
        return json.dumps(key, separators=(",", ":"), ensure_ascii=False)
    if isinstance(key, bool):
        raise TypeError("a key is str, int, bytes or uuid.UUID, not bool")
    if isinstance(key, str):
        return key
    if isinstance(key, int):
        return str(key)
    if isinstance(key, uuid.UUID):
        return str(key)
    if isinstance(key, (bytes, bytearray, memoryview)):
        return base64.urlsafe_b64encode(bytes(key)).rstrip(b"=").decode("ascii")
    raise TypeError(f"a key is str, int, bytes or uuid.UUID, not {type(key).__name__}")


def key_segment(key: str | int | bytes | uuid.UUID) -> str:
    """A key as one percent-encoded path segment ('.' and '..' too, which a path would otherwise resolve)."""
    text = key_text(key)
    if text.isascii() and text.isalnum():
        return text  # nothing to encode (what `quote` would find out more slowly)
    if text in (".", ".."):
        return text.replace(".", "%2E")
    return quote(text, safe="")


def time_text(moment: dt.datetime | dt.date | int | str) -> str:
    """A time bound as the API takes it."""
    if isinstance(moment, bool):
        raise TypeError("a time is a datetime, date, int or ISO 8601 text, not bool")
    if isinstance(moment, dt.datetime):
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=dt.UTC)
        return moment.isoformat()
    if isinstance(moment, dt.date):
        return moment.isoformat()
    if isinstance(moment, (int, str)):
        return str(moment)
    raise TypeError(f"a time is a datetime, date, int or ISO 8601 text, not {type(moment).__name__}")


def store_path(store: str, rest: str) -> str:
    return _store_prefix(store) + rest


@lru_cache(maxsize=1024)
def _store_prefix(store: str) -> str:
    return f"/stores/{quote(store, safe='')}/"


def key_path(store: str, key: Any) -> str:
    return _store_prefix(store) + "keys/" + key_segment(key)
