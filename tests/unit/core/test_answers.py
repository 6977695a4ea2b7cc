"""keyroute.runtime.answers: an answer counted and timed in one step gives exactly what counting it
(`RequestCounts.add`) and timing it (`observe_duration`, `Histogram.observe`) one by one give."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from keyroute.runtime.answers import Answers
from keyroute.runtime.metrics import LATENCY_BUCKETS_S, Histogram, RequestCounts, observe_duration

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
