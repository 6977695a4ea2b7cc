"""Time to live: a store's `ttl` ("7 days") says how old a value (a history row) may be and still be served.

A value's age is "now" minus its time: the store's `order_by` column as the value holds it (a `latest` store;
its answer must carry that column), or a history row's time. "Now" is the serving node's clock (its wall
clock, `time.time`), so replicas whose clocks differ may disagree on a value within the difference of their
clocks of its boundary. A value is expired once `time + ttl <= now`: one whose time is exactly `ttl` old is
not served.

An expired value is not served: a key read answers 404 `expired`, a batch-get's entry is the same, a range
leaves the key out, and history answers drop the rows (a history read's lower bound is raised to the
cutoff, so the expired rows are never read). Expired values leave the disk later: a build leaves out what is
expired at the build's clock (keyroute.pipeline.compute.unexpired), and a node deletes those of the live
partitions it holds now and then (keyroute.replica.expiry).

Times are read as the build reads them (keyroute.storage.timeline): an integer column as milliseconds since
the epoch, a timestamp from its text (microseconds), a date from its `YYYY-MM-DD` text (its day's start).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from keyroute.api import ApiError
from keyroute.storage.live import loads_json
from keyroute.storage.timeline import TimelineError, TimeType, parse_duration_us, parse_order_text

_US_PER_MS = 1000
_US_PER_DAY = 86_400_000_000


class Expired(ApiError, status=404, code="expired"):
    """The key's value is older than its store's time to live."""


@dataclass(frozen=True, slots=True)
class Ttl:
    """A store's time to live: `text` as the spec gives it, `span_us` the same in microseconds, and
    `column`, the value field holding a value's time (None: a history store's row time is used)."""

    text: str
    span_us: int
    column: str | None = None

    @classmethod
    def parse(cls, text: str, column: str | None = None) -> Ttl:
        """A `ttl` text ("7 days", "90 minutes"); raises TimelineError for one that is not a duration."""
        span = parse_duration_us(text)
        if span <= 0:
            raise TimelineError(f"ttl {text!r}: expected a positive duration")
        return cls(text, span, column)

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"text": self.text, "span_us": self.span_us}
        if self.column is not None:
            doc["column"] = self.column
        return doc

    @classmethod
    def from_dict(cls, doc: Any) -> Ttl:
        if not isinstance(doc, dict):
            raise ValueError(f"a ttl is an object, got {doc!r}")
        span = int(doc["span_us"])
        if span <= 0:
            raise ValueError(f"ttl span_us must be positive, got {span}")
        column = doc.get("column")
        return cls(str(doc["text"]), span, None if column is None else str(column))

    def cutoff_us(self, now_s: float) -> int:
        """The oldest time (microseconds since the epoch) still served at `now_s` (seconds since the epoch):
        a time is served when it is greater than now - ttl."""
        return int(round(now_s * 1_000_000)) - self.span_us

    def timeline_low(self, now_s: float, time_type: TimeType) -> int:
        """The least time, in a timeline's unit, a history row may have to be served at `now_s`."""
        cutoff = self.cutoff_us(now_s)
        if time_type is TimeType.TIMESTAMP:
            return cutoff + 1
        unit = _US_PER_DAY if time_type is TimeType.DATE else _US_PER_MS
        # The least whole unit whose start is after the cutoff.
        return cutoff // unit + 1

    def expired(self, value_json: bytes, now_s: float) -> bool:
        """Whether a stored value (its JSON) is expired at `now_s`: its `column` holds a time no later than
        now - ttl. A value without a readable time is never expired (a ttl cannot tell its age)."""
        column = self.column
        if column is None:
            return False
        try:
            # orjson without loads_json's scan for long integers: a time beyond 64 bits, read as a float, is
            # as far from any boundary as the integer
            value = orjson.loads(value_json)
        except orjson.JSONDecodeError:
            try:
                value = loads_json(value_json)
            except ValueError:
                return False
        if not isinstance(value, dict):
            return False
        time_us = time_in_us(value.get(column))
        return time_us is not None and time_us <= self.cutoff_us(now_s)


def time_in_us(raw: Any) -> int | None:
    """A value's time in microseconds since the epoch: an integer as milliseconds, a timestamp text, a date
    text (the start of its day); None for anything else."""
    if isinstance(raw, bool) or raw is None:
        return None
    if isinstance(raw, int):
        return raw * _US_PER_MS
    if isinstance(raw, float):
        return int(raw * _US_PER_MS)
    if isinstance(raw, str):
        micros = parse_order_text(raw, TimeType.TIMESTAMP)
        if micros is not None:
            return micros
        days = parse_order_text(raw, TimeType.DATE)
        if days is not None:
            return days * _US_PER_DAY
    return None


def expired_message(store: str, key: str, ttl: Ttl) -> str:
    return f"key {key!r} of store {store!r} is older than the store's time to live ({ttl.text})"
