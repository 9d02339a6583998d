"""Drift repair's two-checks rule (services.sweeper.suspects), against a model of it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.sweeper.suspects import confirm

rows = st.lists(st.tuples(st.integers(0, 20), st.text(max_size=2)), max_size=30)


def key(row: tuple[int, str]) -> int:
    return row[0]


@given(st.sets(st.integers(0, 20)), rows)
def test_confirmed_are_the_missing_already_suspected_and_the_rest_are_suspected_next(
    previous: set[int], missing: list[tuple[int, str]]
) -> None:
    confirmed, suspected = confirm(previous, missing, key)
    assert confirmed == [row for row in missing if row[0] in previous]
    assert suspected == {row[0] for row in missing if row[0] not in previous}
    assert suspected.isdisjoint(previous)
    assert suspected.isdisjoint(key(row) for row in confirmed)


@given(rows, rows)
def test_a_row_is_put_back_only_when_two_checks_in_a_row_miss_it(
    first: list[tuple[int, str]], second: list[tuple[int, str]]
) -> None:
    confirmed, suspected = confirm(set(), first, key)
    assert confirmed == []
    confirmed, suspected = confirm(suspected, second, key)
    assert {key(row) for row in confirmed} == {key(r) for r in first} & {key(r) for r in second}
    # A confirmed row starts over: a third check that misses it again only suspects it.
    again, _ = confirm(suspected, confirmed, key)
    assert again == []


def test_a_check_that_misses_nothing_forgets_the_suspects() -> None:
    assert confirm({1, 2}, [], key) == ([], set())
