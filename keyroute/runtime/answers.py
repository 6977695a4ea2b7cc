"""A data plane's answers counted and timed in one step, once per read: what a router's and a node's metrics do
with each answer (`RouterMetrics.answered`, `NodeMetrics.answered`). Compiled with mypyc (setup.py), so that an
answer costs no interpreted frame."""

from __future__ import annotations

from bisect import bisect_left
from typing import Any, Final

from keyroute.runtime.metrics import UNKNOWN_STORE, Histogram, code_class, outcome

_bisect_left: Final = bisect_left  # a C static in the compiled build, not a global looked up per answer
_UNKNOWN_STORE: Final = UNKNOWN_STORE


class _Cell:
    """The request counter's key and the duration histogram of one (store label, kind, status)."""

    __slots__ = ("key", "histogram", "bucket_counts", "bounds")

    def __init__(self, key: tuple[str, str, str], histogram: Histogram) -> None:
        # Any: held as the tuple object itself (the compiled build would keep a typed tuple unpacked and make a
        # new one per use), so that the counter's dict finds its key by identity.
        self.key: Any = key
        self.histogram = histogram
        self.bucket_counts = histogram.counts  # the histogram's own list, read without its attribute lookups
        self.bounds = histogram.bounds


class Answers:
    """Counts every answer into `counts` (`RequestCounts.counts`: (store, kind, outcome) -> answers) and times
    it into `durations` ((store, code class) -> Histogram), the dicts a service's metrics render: one cell per
    (store label, kind, status), made on its first answer, so that an answer costs three dict lookups, the
    count's increment and the histogram's bucket. The caller decides the store label (a store its map does not
    know counts under the unknown store's), which keeps the cells as few as the map's stores."""

    __slots__ = ("counts", "durations", "_cells")

    def __init__(self, counts: dict[tuple[str, str, str], int], durations: dict[tuple[str, str], Histogram]) -> None:
        self.counts = counts
        self.durations = durations
        self._cells: dict[str, dict[str, dict[int, _Cell]]] = {}

    def add(self, store: str, kind: str, status: int, seconds: float) -> None:
        """One answer of `store` (its label), `kind`, `status`, `seconds` after its admission."""
        by_kind = self._cells.get(store)
        if by_kind is None:
            by_kind = self._cells[store] = {}
        by_status = by_kind.get(kind)
        if by_status is None:
            by_status = by_kind[kind] = {}
        cell = by_status.get(status)
        if cell is None:
            cell = by_status[status] = self._cell(store, kind, status)
        # The same key object every time: its dict lookups find it by identity, without comparing tuples.
        key = cell.key
        counts = self.counts
        counts[key] = counts.get(key, 0) + 1
        # Histogram.observe, inline (once per read: a call into the interpreted Histogram costs more than the
        # answer's other counting together)
        cell.bucket_counts[_bisect_left(cell.bounds, seconds)] += 1
        cell.histogram.sum += seconds

    def _cell(self, store: str, kind: str, status: int) -> _Cell:
        code_key = (store, code_class(status))
        histogram = self.durations.get(code_key)
        if histogram is None:
            histogram = self.durations[code_key] = Histogram()
        return _Cell((store, kind, outcome(status)), histogram)


class MapAnswers:
    """`answered(store, kind, status, seconds)` of a service whose partition map is `source.map` (a node's
    `Ownership`; None until it is watched): `Answers.add` under the store's label, a store that map does not
    know counting as the unknown store. A callable object of this (compiled) module, so that the data plane's
    every answer costs no interpreted frame."""

    __slots__ = ("answers", "source")

    def __init__(self, answers: Answers) -> None:
        self.answers = answers
        self.source: Any = None

    def __call__(self, store: str, kind: str, status: int, seconds: float) -> None:
        source = self.source
        if source is None or store not in source.map.stores:
            store = _UNKNOWN_STORE
        self.answers.add(store, kind, status, seconds)
