"""What happens after a delivery attempt, decided without I/O.

Success or a final failure completes the occurrence and places the schedule's next one (the
"ack by rescheduling"); a failure with attempts left puts the same occurrence back with a
backoff; a missed occurrence the misfire policy does not want is completed without a delivery.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from shared.contract.delivery import Occurrence
from shared.contract.entries import Completion, resting_occ_state
from shared.contract.rows import Checkpoint, ExecutionRow, failed_attempt
from shared.rules import backfill, backoff, schedule
from shared.rules.plan import AfterCompletionRule

EventKind = Literal["succeeded", "failed", "dead", "skipped"]


@dataclass(frozen=True, slots=True)
class Outcome:
    ok: bool
    http_status: int | None = None
    error: str | None = None
    #: A 429 or 503 answered with Retry-After: how long it asked to wait (ms).
    retry_after_ms: int | None = None
    #: Refused by the operator's policy before anything was sent: another attempt would be
    #: refused the same way, so the occurrence ends dead at once (its rotation goes on).
    permanent: bool = False
    #: The target answered (an HTTP status, or the broker confirmed or returned the message):
    #: the host is up, whatever the answer said of this one request.
    reached: bool = False
    #: Something went out (False: refused before sending, e.g. by the operator's policy).
    sent: bool = True


@dataclass(slots=True)
class Settlement:
    #: complete.lua input (None: retry instead).
    completion: Completion | None
    #: retry.lua delay (None: complete instead).
    retry_delay_ms: int | None
    row: ExecutionRow
    #: The rotation checkpoint for PostgreSQL, written once Redis accepted the completion.
    checkpoint: Checkpoint | None
    event: EventKind
    #: A delivery went out (a fire, whatever the target answered).
    sent: bool = False


def _rotate(
    occ: Occurrence, next_nominal: int | None, fires: int, passed_ms: int, catch_up: bool = False
) -> tuple[Completion, Checkpoint]:
    """Complete ``occ`` and put the schedule's next occurrence (or finish it).

    ``catch_up`` marks a next occurrence the misfire policy chose: it is delivered when
    claimed, however late, instead of being judged (and perhaps skipped) again.
    """
    plan = occ.plan
    # Without max_fires the index keeps no count (``resting_occ_state``): the checkpoint then
    # adds this occurrence's fire to PostgreSQL's count instead of setting it.
    counted = plan.max_fires is not None
    told = fires if counted else fires - occ.fires
    if next_nominal is None:
        return (
            Completion(occ.member, occ.token, None, "", finish=True),
            Checkpoint(
                occ.namespace,
                occ.id,
                passed_ms,
                None,
                told,
                finished=True,
                version=plan.version,
                counted=counted,
            ),
        )
    fire = schedule.fire_at_ms(plan, occ.member, next_nominal)
    state = resting_occ_state(next_nominal, fire, fires, counted, catch_up)
    return (
        Completion(occ.member, occ.token, fire, state),
        Checkpoint(
            occ.namespace,
            occ.id,
            passed_ms,
            next_nominal,
            told,
            version=plan.version,
            counted=counted,
        ),
    )


def next_nominal_after(
    occ: Occurrence, fires: int, finished_ms: int, now_ms: int
) -> tuple[int | None, bool]:
    """The schedule's next nominal time after ``occ``, and whether the misfire policy chose it
    (the rule's next time was already missed when ``occ`` finished)."""
    chosen, catch_up, _ = next_nominal_counted(occ, fires, finished_ms, now_ms)
    return chosen, catch_up


def next_nominal_counted(
    occ: Occurrence, fires: int, finished_ms: int, now_ms: int
) -> tuple[int | None, bool, int]:
    """``next_nominal_after``, and how many excluded times (``spec.exclude``) the rotation
    stepped over to reach it."""
    plan = occ.plan
    if schedule.is_exhausted(plan, fires):
        return None, False, 0
    candidate, excluded = schedule.following_counted(plan, occ.nominal_ms, finished_ms)
    chosen = schedule.resolve_due(plan, candidate, now_ms, occ.member)
    missed = candidate is not None and schedule.is_missed(plan, occ.member, candidate, now_ms)
    return chosen, missed, excluded


def finish(
    occ: Occurrence, finished_ms: int, now_ms: int
) -> tuple[Completion, Checkpoint | None, int]:
    """The completion of a finished occurrence (succeeded, or dead after its last attempt),
    and how many excluded times the rotation stepped over."""
    if occ.is_trigger:
        return Completion(occ.member, occ.token, None, ""), None, 0
    if occ.is_backfill:
        # complete.lua decides whether the backfill goes on (its `to`, its count).
        following = backfill.next_after(occ.plan, occ.nominal_ms)
        return Completion(occ.member, occ.token, following, ""), None, 0
    fires = occ.fires + 1
    following, catch_up, excluded = next_nominal_counted(occ, fires, finished_ms, now_ms)
    completion, checkpoint = _rotate(occ, following, fires, occ.nominal_ms, catch_up)
    return completion, checkpoint, excluded


def row_of(
    occ: Occurrence,
    key: str,
    status: str,
    outcome: Outcome | None,
    started_ms: int,
    finished_ms: int,
) -> ExecutionRow:
    row = ExecutionRow(
        namespace=occ.namespace,
        id=occ.id,
        nominal_ms=occ.nominal_ms,
        is_trigger=occ.is_trigger,
        attempts=occ.attempt,
        status=status,
        http_status=outcome.http_status if outcome else None,
        error=outcome.error if outcome else None,
        idempotency_key=key,
        started_ms=started_ms,
        finished_ms=finished_ms,
        is_backfill=occ.is_backfill,
        due_ms=occ.due_ms,
    )
    if outcome is not None and not outcome.ok:
        # The row keeps only the latest attempt; the log keeps each failed one.
        row.failed_attempts = [failed_attempt(row)]
    return row


def settle(
    occ: Occurrence,
    key: str,
    outcome: Outcome,
    started_ms: int,
    finished_ms: int,
    now_ms: int,
    rng: random.Random,
    *,
    final: bool = False,
) -> Settlement:
    """``final``: no attempt follows, whatever the retry policy says (a poison message); nor
    does one after a ``permanent`` failure."""
    final = final or outcome.permanent
    if not outcome.ok and not final and backoff.attempts_left(occ.plan.retry, occ.attempt):
        # A target that said when to come back is not asked sooner.
        delay = max(backoff.delay_ms(occ.plan.retry, occ.attempt, rng), outcome.retry_after_ms or 0)
        return Settlement(
            None,
            delay,
            row_of(occ, key, "retrying", outcome, started_ms, finished_ms),
            None,
            "failed",
        )
    completion, checkpoint, excluded = finish(occ, finished_ms, now_ms)
    status: EventKind = "succeeded" if outcome.ok else "dead"
    row = row_of(occ, key, status, outcome, started_ms, finished_ms)
    row.excluded = excluded
    return Settlement(completion, None, row, checkpoint, status, sent=outcome.sent)


def missed_choice(occ: Occurrence, now_ms: int) -> int | None:
    """For a regular first attempt: the nominal time the misfire policy wants fired instead
    of ``occ`` (None: none at all), or ``occ.nominal_ms`` itself when it should fire.

    ``now_ms`` is the Redis clock. A trigger, a backfilled occurrence (the past, asked for), a
    retry and a catch-up the policy already chose are delivered, never judged again.
    """
    if occ.is_trigger or occ.is_backfill or occ.attempt > 1 or occ.catch_up:
        return occ.nominal_ms
    return schedule.resolve_due(occ.plan, occ.nominal_ms, now_ms, occ.member)


def misfire_cutoff(occ: Occurrence) -> int | None:
    """The Redis time after which ``missed_choice`` would judge ``occ`` missed (its due time
    plus the misfire grace); None when it is never judged (delivered however late). begin.lua
    flags a delivery as begun only up to it."""
    if occ.is_trigger or occ.is_backfill or occ.attempt > 1 or occ.catch_up:
        return None
    plan = occ.plan
    if isinstance(plan.rule, AfterCompletionRule):
        return None
    return schedule.fire_at_ms(plan, occ.member, occ.nominal_ms) + plan.misfire.grace_ms


def skip(occ: Occurrence, key: str, chosen: int | None, now_ms: int) -> Settlement:
    """Complete a missed occurrence without delivering it; the rotation moves to ``chosen``,
    which the policy chose and which is therefore delivered when it comes."""
    completion, checkpoint = _rotate(occ, chosen, occ.fires, occ.nominal_ms, catch_up=True)
    return Settlement(
        completion, None, row_of(occ, key, "skipped", None, now_ms, now_ms), checkpoint, "skipped"
    )


def poisoned(occ: Occurrence, key: str, reason: str, now_ms: int) -> Settlement:
    """An occurrence whose delivery message kept crashing (or failing) its executors until
    the broker dead-lettered it: it ends ``dead`` with the reason, and its rotation goes on."""
    return settle(
        occ,
        key,
        Outcome(False, None, reason[:500], sent=False),
        now_ms,
        now_ms,
        now_ms,
        random.Random(0),
        final=True,
    )
