"""What a misfire policy owes for a stretch of missed times (pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shared.rules.plan import MisfireRule
from tests.ledger import owed

DUES = st.lists(st.integers(0, 10_000_000), min_size=1, max_size=50)


@given(DUES, st.integers(0, 20_000_000))
def test_skip_owes_nothing_fire_once_one(dues: list[int], decided: int) -> None:
    assert owed.owed(MisfireRule("skip"), dues, decided).count == 0
    assert owed.owed(MisfireRule("fire_once"), dues, decided).count == 1


def test_an_empty_stretch_owes_nothing() -> None:
    for policy in ("skip", "fire_once", "fire_all"):
        assert owed.owed(MisfireRule(policy), [], 0).count == 0


@given(DUES, st.integers(1, 100), st.integers(1, 5_000_000), st.integers(0, 20_000_000))
def test_fire_all_owes_at_most_its_limit_of_the_times_in_its_window(
    dues: list[int], limit: int, window: int, decided: int
) -> None:
    found = owed.owed(MisfireRule("fire_all", 1000, window, limit), dues, decided).count
    in_window = sum(1 for d in dues if d >= decided - window)
    assert found == min(limit, in_window)
    assert 0 <= found <= min(limit, len(dues))


@given(DUES, st.integers(1, 100))
def test_fire_all_with_a_window_wider_than_the_run_owes_min_limit_and_count(
    dues: list[int], limit: int
) -> None:
    decided = max(dues) + 1000
    rule = MisfireRule("fire_all", 1000, decided + 1, limit)
    assert owed.owed(rule, dues, decided).count == min(limit, len(dues))


@given(st.integers(0, 10), st.integers(0, 10))
def test_short_is_what_is_owed_beyond_what_was_delivered(count: int, delivered: int) -> None:
    short = owed.delivered_enough(owed.Owed(count, ""), delivered)
    assert short == max(0, count - delivered)
