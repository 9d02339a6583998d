"""``cronbus bench held``'s figures from its samples (pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cronbus.bench.held import deadline_spread, peak_per_s


def test_the_peak_is_the_largest_increase_per_second() -> None:
    assert peak_per_s([(0.0, 0.0), (1.0, 10.0), (2.0, 40.0), (4.0, 50.0)]) == 30.0
    assert peak_per_s([(0.0, 5.0)]) == 0.0
    assert peak_per_s([]) == 0.0


@given(st.lists(st.floats(0, 10_000), min_size=1, max_size=200))
def test_the_peak_per_second_never_exceeds_the_deadlines_and_counts_each(
    deadlines: list[float],
) -> None:
    spread = deadline_spread(deadlines)
    assert spread["parked"] == len(deadlines)
    assert 1 <= spread["parked_due_peak_per_s"] <= len(deadlines)
    assert spread["parked_due_span_s"] <= 10.0


def test_deadlines_all_in_one_millisecond_peak_at_their_count() -> None:
    assert deadline_spread([5000.0] * 7) == {
        "parked": 7,
        "parked_due_peak_per_s": 7,
        "parked_due_span_s": 0.0,
    }
    assert deadline_spread([])["parked_due_peak_per_s"] == 0
