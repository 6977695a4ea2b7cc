"""keyroute.runtime.answers: an answer counted and timed in one step gives exactly what counting it
(`RequestCounts.add`) and timing it (`observe_duration`, `Histogram.observe`) one by one give."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from keyroute.runtime.answers import Answers, MapAnswers
from keyroute.runtime.metrics import LATENCY_BUCKETS_S, UNKNOWN_STORE, Histogram, RequestCounts, observe_duration

ANSWERS = st.lists(
    st.tuples(
        st.sampled_from(["s", "t", "_unknown"]),
        st.sampled_from(["key", "batch", "timeline"]),
        st.sampled_from([200, 304, 400, 401, 404, 429, 500, 503]),
        st.one_of(st.floats(0, 20, allow_nan=False), st.sampled_from(LATENCY_BUCKETS_S)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ANSWERS)
def test_one_step_counts_and_times_as_the_counter_and_the_histograms_do(
    answers: list[tuple[str, str, int, float]],
) -> None:
    counts = RequestCounts()
    durations: dict[tuple[str, str], Histogram] = {}
    together = Answers(counts.counts, durations)
    plain_counts = RequestCounts()
    plain_durations: dict[tuple[str, str], Histogram] = {}
    for store, kind, status, seconds in answers:
        together.add(store, kind, status, seconds)
        plain_counts.add(store, kind, status)
        observe_duration(plain_durations, store, status, seconds)
    assert counts.counts == plain_counts.counts
    assert {k: (h.counts, h.sum) for k, h in durations.items()} == {
        k: (h.counts, h.sum) for k, h in plain_durations.items()
    }
    # observe_duration's own inline copy of Histogram.observe, pinned too
    for (store, code), histogram in plain_durations.items():
        observed = Histogram()
        for s, _, status, seconds in answers:
            if s == store and f"{status // 100}xx" == code:
                observed.observe(seconds)
        assert (observed.counts, observed.sum) == (histogram.counts, histogram.sum)


class _Source:
    """What `MapAnswers` reads of a node's `Ownership`: its partition map's stores."""

    def __init__(self, stores: set[str]) -> None:
        self.map = self
        self.stores = stores


@settings(max_examples=100, deadline=None)
@given(ANSWERS)
def test_a_map_answers_labels_a_store_its_map_does_not_know_as_the_unknown_store(
    answers: list[tuple[str, str, int, float]],
) -> None:
    labelled = Answers(RequestCounts().counts, {})
    answered = MapAnswers(labelled)
    by_hand = Answers(RequestCounts().counts, {})
    for store, kind, status, seconds in answers[:5]:  # no map watched yet: every store is unknown
        answered(store, kind, status, seconds)
        by_hand.add(UNKNOWN_STORE, kind, status, seconds)
    answered.source = _Source({"s"})
    for store, kind, status, seconds in answers[5:]:
        answered(store, kind, status, seconds)
        by_hand.add(store if store == "s" else UNKNOWN_STORE, kind, status, seconds)
    assert labelled.counts == by_hand.counts
    assert {k: (h.counts, h.sum) for k, h in labelled.durations.items()} == {
        k: (h.counts, h.sum) for k, h in by_hand.durations.items()
    }
