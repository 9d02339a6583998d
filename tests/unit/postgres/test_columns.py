"""A batch's rows and checkpoints folded to one per key: nothing a later one hides is lost."""

from __future__ import annotations

from shared.contract.rows import Checkpoint, ExecutionRow, failed_attempt
from shared.postgres import columns

DUE = 1_800_000_000_000


def attempt(n: int, status: str, started: int) -> ExecutionRow:
    row = ExecutionRow("ns", "s", DUE, False, n, status, 503, "HTTP 503", "k", started, started + 5)
    row.due_ms = DUE
    if status != "succeeded":
        row.failed_attempts = [failed_attempt(row)]
    return row


def test_a_retry_in_the_same_batch_keeps_the_failed_attempt_and_the_first_lateness() -> None:
    (kept,) = columns.executions(
        [attempt(1, "retrying", DUE + 7), attempt(2, "succeeded", DUE + 1_007)]
    )
    assert kept.attempts == 2 and kept.status == "succeeded"
    assert [a["attempt"] for a in kept.failed_attempts] == [1]
    assert kept.lateness_ms == 7


def test_uncounted_checkpoints_add_up_and_counted_ones_keep_the_latest_total() -> None:
    folded = columns.checkpoints(
        [
            Checkpoint("ns", "a", 1_000, 2_000, 1, counted=False),
            Checkpoint("ns", "a", 2_000, 3_000, 1, counted=False),
            Checkpoint("ns", "a", 3_000, 4_000, 0, counted=False),  # a skip adds no fire
            Checkpoint("ns", "b", 1_000, 2_000, 4),
            Checkpoint("ns", "b", 2_000, 3_000, 5),
        ]
    )
    by_id = {c.id: c for c in folded}
    assert (by_id["a"].fires, by_id["a"].last_fire_ms, by_id["a"].counted) == (2, 3_000, False)
    assert (by_id["b"].fires, by_id["b"].last_fire_ms) == (5, 2_000)
