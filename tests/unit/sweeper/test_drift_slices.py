"""The rolling full drift pass: each check's slice, and that a pass ends within the interval."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from services.sweeper import drift


def test_a_million_entries_are_compared_in_thirty_slices_at_the_defaults() -> None:
    # Checks every 30 s, everything compared every 900 s: 30 checks per pass.
    assert drift.slice_size(1_000_000, 30, 900) == 33_334


def test_a_small_index_is_compared_whole_at_every_check() -> None:
    assert drift.slice_size(500, 30, 900) == drift.SLICE_MIN


def test_a_full_interval_shorter_than_a_check_compares_everything_each_time() -> None:
    assert drift.slice_size(50_000, 30, 10) == 50_000


@given(
    entries=st.integers(0, 10**8),
    check_s=st.floats(0.1, 3600),
    full_s=st.floats(0.1, 86_400),
)
def test_a_pass_never_needs_more_checks_than_the_full_interval_holds(
    entries: int, check_s: float, full_s: float
) -> None:
    size = drift.slice_size(entries, check_s, full_s)
    assert size >= drift.SLICE_MIN
    checks_needed = math.ceil(entries / size)
    assert checks_needed <= max(1, math.floor(full_s / check_s))
