"""What a misfire policy may leave out between two deliveries of a schedule (pure, no I/O).

After an occurrence's delivery ends, the next one is chosen by the policy (``resolve_due``) at
some moment *t* the ledger cannot see, but can bound: no sooner than the first delivery of the
one before ended, no later than the first arrival of the one chosen. Every policy picks, in
nominal order, the candidate if it is on time at *t*, else a missed time (``fire_once``,
``fire_all``) or the first on-time one (``skip``); so every nominal time it passes over was
missed at *t*. Two things follow that hold under any fault:

- a time passed over whose due time was still within the grace at the latest possible *t* was
  on time when the choice jumped it: it was owed (under ``skip`` these are the occurrences a
  fault does not excuse, the ones that were on time);
- ``fire_all`` replays at most ``limit`` missed times: the times from the chosen one up to the
  first on-time one, counted at the earliest possible *t* (the fewest there can have been), are
  at most ``limit``; more is a broken limit. Likewise none older than ``window`` at that *t*.

Where the moment is known, the judgement is checked directly: an executor that skips an
occurrence as missed records when (its ``skipped`` execution row, by the Redis clock), and the
occurrence must have been more than the grace late then.
"""

from __future__ import annotations

from collections.abc import Sequence


def jumped_on_time(
    gap: Sequence[tuple[int, int]], chosen_arrival_ms: float, grace_ms: int, slack_ms: int
) -> list[int]:
    """The nominal times of ``gap`` ((nominal, due) of each time passed over) that were still
    on time at the latest moment the choice can have been made: owed, not delivered."""
    latest_choice = chosen_arrival_ms + slack_ms
    return [nominal for nominal, due in gap if due >= latest_choice - grace_ms]


def skipped_on_time(due_ms: int, decided_ms: int, grace_ms: int, slack_ms: int) -> bool:
    """An executor skipped an occurrence as missed at ``decided_ms`` (the Redis clock), but its
    due time was within the grace then: it was on time, and skipping it lost it."""
    return due_ms >= decided_ms - grace_ms + slack_ms


def replayed_past_limit(
    from_chosen: Sequence[int], earliest_choice_ms: float, grace_ms: int, slack_ms: int
) -> int:
    """How many times were surely missed from the chosen one on (``from_chosen``: their due
    times in nominal order, the chosen one first) when the choice was made at the earliest:
    those up to the first that may still have been on time. ``fire_all`` replays at most its
    ``limit`` of them."""
    missed_before = earliest_choice_ms - slack_ms - grace_ms
    count = 0
    for due in from_chosen:
        if due >= missed_before:
            break
        count += 1
    return count


def older_than_window(
    chosen_due_ms: int, earliest_choice_ms: float, window_ms: int, slack_ms: int
) -> bool:
    """``fire_all`` replays nothing older than its window when it chooses: the chosen time was
    out of the window at the earliest moment it can have been chosen."""
    return chosen_due_ms < earliest_choice_ms - slack_ms - window_ms
