"""The ledger's oracle: what the contract says each schedule must, may and must not deliver (pure).

Inputs are plain records: each schedule's rotations (the plan and when the upsert that started
it was sent and answered), its pauses, delete and triggers (each command's send and reply
times), the fault windows, and every request the sink received. Nominal times come from the
project's own pure math (``shared.rules.schedule``, ``shared.rules.cron``); nothing here does I/O.

Every occurrence of a schedule is one of:

- *required*: the contract leaves no choice, it must be delivered at least once. Its due time
  (nominal + jitter offset) falls while the rotation is active (after the reply of the upsert
  that started it, not between a pause and a little after its resume, before the delete was
  sent, within ``max_fires``) and up to the horizon, and either the policy replays every missed
  time (``fire_all`` with a window and limit larger than the run) or no fault or backlog was
  under way at its due time (a disturbed window), so no misfire policy may drop it;
- *allowed*: a policy may legitimately drop or replace it (``skip`` and ``fire_once`` during a
  fault or a backlog, occurrences missed while paused and caught up after the resume, those due
  while a command was being applied);
- *forbidden*: after the delete, after a reset's reply (old rotation), while paused, after
  ``end_at``, beyond ``max_fires``, or not a nominal time of the schedule at all.

In-flight tolerance, precisely: an occurrence whose due time is at or before a command's reply
may have been claimed before the command was applied, so it (and its retries) may still be
delivered after that reply; an occurrence due after the reply may not. Nothing else is excused.

``fire_once`` owes one catch-up for each stretch of its times that came due during a fault or
a backlog: one of them must be delivered (a stretch with none is one *lost* catch-up).

Fixed-delay (``after_completion``) schedules have no nominal grid; their chain is checked
instead: each occurrence is due no sooner than ``delay`` after its predecessor's last answer
(sooner is *unexpected*), and a chain that stops while the schedule is active is *lost*,
unless a delete was sent before its next occurrence had its chance (as for a grid time: its
due time, or the end of the fault or backlog under way then, plus the slack).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from shared.contract import keys
from shared.rules import schedule
from shared.rules.plan import AfterCompletionRule, OnceRule, Plan, WebhookPlan
from tests.ledger import gaps, owed

#: A first attempt later than this (ms) from its due time marks a backlog window.
LATE_MS = 500
#: Slack (ms) between the sink's answer and the executor's completion, and for clock reads.
CLOCK_SLACK_MS = 50
#: How long after a resume's reply an occurrence may still be judged by the policy (ms).
RESUME_SETTLE_MS = 1500
#: How long past its due time a fixed-delay occurrence may take before it counts as lost (ms;
#: it is never missed, only late, and the run drains before it is judged).
CHAIN_SLACK_MS = 2000
#: How long an occurrence has, after its due time (or after the fault or backlog under way
#: then), to be delivered before a command may legitimately keep it from firing (ms).
SETTLE_MS = 2000
#: Slack (ms) between the sink's clock at an answer and the Redis clock of the choice after it.
CHOICE_SLACK_MS = 250
#: The most candidate nominal times enumerated per rotation (bounds the work).
MAX_CANDIDATES = 200_000
#: ``fire_all`` replays every missed time when its window and limit exceed the run.
UNLIMITED_LIMIT = 1000
UNLIMITED_WINDOW_MS = 600_000


@dataclass(frozen=True, slots=True)
class Request:
    """One request the sink received."""

    schedule: str
    key: str
    fire_time_ms: int
    attempt: int
    trigger: bool
    arrived_ms: float
    answered_ms: float
    status: int


@dataclass(frozen=True, slots=True)
class Rotation:
    """A rotation started by an upsert (the first one, or one that changed the fire times)."""

    plan: Plan
    sent_ms: int
    reply_ms: int


@dataclass(frozen=True, slots=True)
class Pause:
    sent_ms: int
    reply_ms: int
    #: None: still paused at the end of the run.
    resume_sent_ms: int | None = None
    resume_reply_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Trigger:
    sent_ms: int
    reply_ms: int
    fire_ms: int
    key: str


@dataclass
class Timeline:
    """Everything the oracle needs to know about one schedule."""

    namespace: str
    id: str
    rotations: list[Rotation]
    pauses: list[Pause] = field(default_factory=list)
    #: (sent, reply) of the delete, if any.
    deleted: tuple[int, int] | None = None
    triggers: list[Trigger] = field(default_factory=list)

    @property
    def member(self) -> str:
        return keys.member(self.namespace, self.id)

    @property
    def url(self) -> str:
        """The webhook URL of its first rotation ("" for another target): a fault scoped to a
        host disturbs only the schedules whose URL starts with it."""
        if not self.rotations:
            return ""
        target = self.rotations[0].plan.target
        return target.url if isinstance(target, WebhookPlan) else ""


@dataclass(frozen=True, slots=True)
class Fault:
    name: str
    start_ms: int
    end_ms: int
    #: A URL prefix (one host): the fault disturbs only the schedules whose target URL starts
    #: with it (a host down). "": every schedule.
    scope: str = ""


@dataclass
class Row:
    """One line of the ledger table (a policy under a fault, or ``none``)."""

    policy: str
    fault: str
    expected: int = 0
    delivered: int = 0
    lost: int = 0
    duplicates: int = 0
    unexpected: int = 0
    overlaps: int = 0
    skipped: int = 0
    bad_keys: int = 0
    #: Attempted, but every attempt refused by a host that was down (ended dead, not lost).
    unreached: int = 0
    lateness_ms: list[float] = field(default_factory=list)

    @property
    def p99_lateness_s(self) -> float:
        return percentile(self.lateness_ms, 0.99) / 1000


@dataclass
class Verdict:
    rows: dict[tuple[str, str], Row] = field(default_factory=dict)
    #: Human-readable lines about each lost, unexpected, overlapping or badly keyed occurrence.
    findings: list[str] = field(default_factory=list)

    def row(self, policy: str, fault: str) -> Row:
        found = self.rows.get((policy, fault))
        if found is None:
            found = self.rows[(policy, fault)] = Row(policy, fault)
        return found

    def total(self, attribute: str) -> int:
        return sum(int(getattr(row, attribute)) for row in self.rows.values())


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# --- windows -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Windows:
    """Named [start, end] intervals, sorted by start. Overlapping ones are kept apart (a point
    inside several belongs to the one that started last) unless ``merge`` joins them."""

    spans: tuple[tuple[int, int, str], ...]

    @classmethod
    def of(cls, spans: Iterable[tuple[int, int, str]], *, merge: bool = False) -> Windows:
        ordered = sorted(spans)
        if not merge:
            return cls(tuple(ordered))
        merged: list[tuple[int, int, str]] = []
        for start, end, name in ordered:
            if merged and start <= merged[-1][1]:
                last = merged[-1]
                merged[-1] = (last[0], max(last[1], end), last[2])
            else:
                merged.append((start, end, name))
        return cls(tuple(merged))

    def until(self, at_ms: float) -> int | None:
        """The latest end of the windows holding ``at_ms`` (None: none holds it)."""
        index = bisect.bisect_right(self.spans, (at_ms, math.inf, ""))
        ends = [end for start, end, _ in self.spans[:index] if start <= at_ms <= end]
        return max(ends) if ends else None

    def find(self, at_ms: float) -> str | None:
        index = bisect.bisect_right(self.spans, (at_ms, math.inf, ""))
        for start, end, name in reversed(self.spans[:index]):
            if start <= at_ms <= end:
                return name
        return None


EMPTY = Windows(())


def fault_windows(
    faults: Sequence[Fault], before_ms: int, after_ms: int, scope: str = ""
) -> Windows:
    """Each fault of ``scope`` widened: work in flight when it began, and the recovery after
    it ended."""
    return Windows.of(
        (f.start_ms - before_ms, f.end_ms + after_ms, f.name) for f in faults if f.scope == scope
    )


def backlog_windows(late: Iterable[tuple[int, float]], pad_ms: int = 1000) -> Windows:
    """Spans where the system was measurably behind: from the due time of each first attempt
    that arrived more than ``LATE_MS`` late to its arrival (padded)."""
    return Windows.of(
        (
            (due - pad_ms, int(arrived) + pad_ms, "backlog")
            for due, arrived in late
            if arrived - due > LATE_MS
        ),
        merge=True,
    )


# --- occurrences ---------------------------------------------------------------------------


@dataclass
class Occurrence:
    """What the requests of one occurrence showed."""

    requests: list[Request] = field(default_factory=list)

    @property
    def first_arrival(self) -> float:
        return min(r.arrived_ms for r in self.requests)

    @property
    def first_attempts(self) -> int:
        return sum(1 for r in self.requests if r.attempt == 1)

    def episodes(self) -> list[tuple[float, float]]:
        """(start, end) of each delivery run: attempt 1 and the retries that follow it."""
        spans: list[tuple[float, float]] = []
        for request in sorted(self.requests, key=lambda r: r.arrived_ms):
            if request.attempt == 1 or not spans:
                spans.append((request.arrived_ms, request.answered_ms))
            else:
                start, end = spans[-1]
                spans[-1] = (start, max(end, request.answered_ms))
        return spans


def group(requests: Iterable[Request]) -> dict[tuple[str, bool, int], Occurrence]:
    """Requests by occurrence: (schedule, trigger?, nominal fire time)."""
    found: dict[tuple[str, bool, int], Occurrence] = defaultdict(Occurrence)
    for request in requests:
        found[(request.schedule, request.trigger, request.fire_time_ms)].requests.append(request)
    return found


def is_unlimited(plan: Plan) -> bool:
    misfire = plan.misfire
    return (
        misfire.policy == "fire_all"
        and misfire.limit >= UNLIMITED_LIMIT
        and misfire.window_ms >= UNLIMITED_WINDOW_MS
    )


def policy_label(plan: Plan) -> str:
    if isinstance(plan.rule, AfterCompletionRule):
        return "after_completion"
    if plan.misfire.policy == "fire_all" and not is_unlimited(plan):
        return "fire_all(limit)"
    return plan.misfire.policy


def candidates(plan: Plan, from_ms: int, until_ms: int) -> list[int]:
    """The rule's nominal times in [from, until] (pure math; bounded)."""
    if isinstance(plan.rule, OnceRule):
        at = schedule.first_nominal(plan, from_ms)
        return [at] if at is not None and from_ms <= at <= until_ms else []
    found: list[int] = []
    current = schedule.next_nominal(plan, from_ms - 1)
    while current is not None and current <= until_ms and len(found) < MAX_CANDIDATES:
        found.append(current)
        current = schedule.next_nominal(plan, current)
    return found


# --- the judgement -------------------------------------------------------------------------

REQUIRED, ALLOWED, FORBIDDEN = "required", "allowed", "forbidden"
#: Allowed because a fault or a backlog was under way at its due time.
DISTURBED = "disturbed"


@dataclass
class Context:
    """What the judgement of every schedule shares."""

    horizon_ms: int
    faults: Windows
    backlog: Windows
    #: Faults and backlogs of one host (URL prefix -> windows): they disturb its schedules.
    scoped_faults: dict[str, Windows] = field(default_factory=dict)
    scoped_backlog: dict[str, Windows] = field(default_factory=dict)
    #: (schedule, nominal) -> when the executors ended it dead after attempts no host
    #: answered. Attempted, so not lost, but never at a sink: only while a fault of its own
    #: host (a host down) was under way (``unreached_then``); otherwise it is a loss.
    unreached: Mapping[tuple[str, int], int] = field(default_factory=dict)
    #: (schedule, nominal) -> the Redis time at which an executor skipped it as missed (its
    #: ``skipped`` execution row): the moment the misfire policy judged it.
    skipped: Mapping[tuple[str, int], int] = field(default_factory=dict)

    def unreached_then(self, member: str, nominal: int, url: str) -> bool:
        """Ended dead with no answer while a fault scoped to its host was under way."""
        dead_ms = self.unreached.get((member, nominal))
        if dead_ms is None:
            return False
        return any(
            self.scoped_faults[scope].find(dead_ms) is not None
            for scope in self._scopes(url)
            if scope in self.scoped_faults
        )

    def _scopes(self, url: str) -> list[str]:
        return [
            scope
            for scope in self.scoped_faults.keys() | self.scoped_backlog
            if url.startswith(scope)
        ]

    def disturbed_until(self, at_ms: int, url: str = "") -> int | None:
        """When the fault or backlog under way at ``at_ms`` was over (None: calm then), for a
        schedule whose target URL is ``url``."""
        windows = [self.faults, self.backlog]
        for scope in self._scopes(url):
            windows += [self.scoped_faults.get(scope, EMPTY), self.scoped_backlog.get(scope, EMPTY)]
        ends = [e for e in (w.until(at_ms) for w in windows) if e is not None]
        return max(ends) if ends else None

    def fault_of(self, at_ms: float, url: str = "") -> str:
        for scope in self._scopes(url):
            found = self.scoped_faults.get(scope, EMPTY).find(at_ms)
            if found:
                return found
        return self.faults.find(at_ms) or "none"


def _pause_class(timeline: Timeline, due: int, plan: Plan) -> str | None:
    """How a pause touches an occurrence due at ``due``: None when it does not."""
    for pause in timeline.pauses:
        if pause.sent_ms <= due <= pause.reply_ms:
            return ALLOWED
        resumed = pause.resume_sent_ms
        if pause.reply_ms < due and (resumed is None or due < resumed):
            return "paused"
        settled = pause.resume_reply_ms
        if (
            resumed is not None
            and settled is not None
            and resumed <= due <= settled + RESUME_SETTLE_MS
        ):
            return ALLOWED
    return None


def classify(
    timeline: Timeline, rotation_index: int, nominal: int, ordinal: int, ctx: Context
) -> str:
    """required, allowed, disturbed (allowed: a fault or backlog was under way at its due
    time), forbidden, or paused (delivered while paused: forbidden; after the resume: a
    catch-up the policy may make, except under ``skip``)."""
    rotation = timeline.rotations[rotation_index]
    plan = rotation.plan
    due = schedule.fire_at_ms(plan, timeline.member, nominal)
    ends = _rotation_end(timeline, rotation_index)
    if ends is not None and due > ends[1]:
        return FORBIDDEN
    if plan.max_fires is not None and ordinal >= plan.max_fires:
        return ALLOWED  # fires may have been skipped; the count check bounds these
    paused = _pause_class(timeline, due, plan)
    if paused is not None:
        return paused
    if ends is not None and due >= ends[0]:
        return ALLOWED
    if nominal < rotation.reply_ms or due > ctx.horizon_ms:
        return ALLOWED
    disturbed_until = ctx.disturbed_until(due, timeline.url)
    if disturbed_until is not None and not is_unlimited(plan):
        return DISTURBED
    # Required only if the rotation stayed as it was until the occurrence had its chance: a
    # pause, delete or reset sent before then may legitimately keep it from firing.
    chance_until = (disturbed_until if disturbed_until is not None else due) + SETTLE_MS
    if _changed_between(timeline, rotation_index, due, chance_until):
        return ALLOWED
    return REQUIRED


def _changed_between(timeline: Timeline, rotation_index: int, start: int, end: int) -> bool:
    """A pause, a delete or a reset sent in [start, end]."""
    sent = [p.sent_ms for p in timeline.pauses]
    if timeline.deleted is not None:
        sent.append(timeline.deleted[0])
    sent.extend(r.sent_ms for r in timeline.rotations[rotation_index + 1 :])
    return any(start <= at <= end for at in sent)


def _rotation_end(timeline: Timeline, index: int) -> tuple[int, int] | None:
    """(sent, reply) of the command that ended this rotation: the next reset, or the delete."""
    if index + 1 < len(timeline.rotations):
        following = timeline.rotations[index + 1]
        return following.sent_ms, following.reply_ms
    return timeline.deleted


def judge(
    timelines: Sequence[Timeline],
    requests: Sequence[Request],
    faults: Sequence[Fault],
    horizon_ms: int,
    *,
    fault_before_ms: int = 2000,
    fault_after_ms: int = 6000,
    unreached: Mapping[tuple[str, int], int] | None = None,
    skipped: Mapping[tuple[str, int], int] | None = None,
) -> Verdict:
    """The ledger: every schedule's occurrences judged against what the sink received."""
    occurrences = group(requests)
    scopes = sorted({f.scope for f in faults if f.scope})
    late = _late_first_attempts(timelines, occurrences)
    ctx = Context(
        horizon_ms,
        fault_windows(faults, fault_before_ms, fault_after_ms),
        backlog_windows((d, a) for d, a, url in late if not _in_any(url, scopes)),
        {s: fault_windows(faults, fault_before_ms, fault_after_ms, s) for s in scopes},
        {s: backlog_windows((d, a) for d, a, url in late if url.startswith(s)) for s in scopes},
        unreached or {},
        skipped or {},
    )
    verdict = Verdict()
    by_schedule: dict[str, list[tuple[tuple[str, bool, int], Occurrence]]] = defaultdict(list)
    for found_key, occurrence in occurrences.items():
        by_schedule[found_key[0]].append((found_key, occurrence))
    known = {t.member for t in timelines}
    for timeline in timelines:
        seen = dict(by_schedule.get(timeline.member, []))
        _judge_schedule(timeline, seen, ctx, verdict)
    for member, items in by_schedule.items():
        if member not in known:
            for _, occurrence in items:
                _unexpected(verdict, "unknown", ctx, occurrence, f"{member}: unknown schedule")
    return verdict


def _in_any(url: str, scopes: Sequence[str]) -> bool:
    return any(url.startswith(scope) for scope in scopes)


def _late_first_attempts(
    timelines: Sequence[Timeline], occurrences: dict[tuple[str, bool, int], Occurrence]
) -> list[tuple[int, float, str]]:
    """(due, first arrival, target URL) of each regular occurrence: a backlog seen on a
    scoped host (one that was down) disturbs only that host's schedules."""
    found = {t.member: (t.rotations[-1].plan, t.url) for t in timelines if t.rotations}
    late = []
    for (member, trigger, nominal), occurrence in occurrences.items():
        plan, url = found.get(member, (None, ""))
        if trigger or plan is None or isinstance(plan.rule, AfterCompletionRule):
            continue
        due = schedule.fire_at_ms(plan, member, nominal)
        late.append((due, occurrence.first_arrival, url))
    return late


def _judge_schedule(
    timeline: Timeline,
    seen: dict[tuple[str, bool, int], Occurrence],
    ctx: Context,
    verdict: Verdict,
) -> None:
    regular = {k[2]: o for k, o in seen.items() if not k[1]}
    triggered = {k[2]: o for k, o in seen.items() if k[1]}
    _judge_triggers(timeline, triggered, ctx, verdict)
    if not timeline.rotations:
        return
    label = policy_label(timeline.rotations[0].plan)
    if isinstance(timeline.rotations[0].plan.rule, AfterCompletionRule):
        _judge_chain(timeline, regular, ctx, verdict, label)
    else:
        _judge_grid(timeline, regular, ctx, verdict, label)
    _count_overlaps(timeline, regular, ctx, verdict, label)


def _judge_grid(
    timeline: Timeline,
    regular: dict[int, Occurrence],
    ctx: Context,
    verdict: Verdict,
    label: str,
) -> None:
    until = max([ctx.horizon_ms, *regular]) if regular else ctx.horizon_ms
    classes: dict[int, tuple[str, int, Plan]] = {}
    for index, rotation in enumerate(timeline.rotations):
        ends = _rotation_end(timeline, index)
        stop = until if ends is None else min(until, ends[1] + 60_000)
        for ordinal, nominal in enumerate(candidates(rotation.plan, rotation.sent_ms, stop)):
            verdict_class = classify(timeline, index, nominal, ordinal, ctx)
            previous = classes.get(nominal)
            if previous is None or _rank(verdict_class) > _rank(previous[0]):
                classes[nominal] = (verdict_class, index, rotation.plan)
    for nominal, (verdict_class, _, plan) in classes.items():
        due = schedule.fire_at_ms(plan, timeline.member, nominal)
        occurrence = regular.get(nominal)
        _account(timeline, verdict, ctx, label, verdict_class, due, nominal, occurrence)
    _check_catch_ups(timeline, regular, classes, ctx, verdict, label)
    _check_choices(timeline, regular, classes, ctx, verdict, label)
    _check_gaps(timeline, regular, classes, ctx, verdict, label)
    _check_skipped(timeline, regular, classes, ctx, verdict, label)
    for nominal, occurrence in regular.items():
        if nominal not in classes:
            _unexpected(
                verdict, label, ctx, occurrence, f"{timeline.member}@{nominal}: not a nominal time"
            )
    _check_max_fires(timeline, regular, ctx, verdict, label)


def _disturbed_runs(classes: dict[int, tuple[str, int, Plan]]) -> list[tuple[int, list[int]]]:
    """Consecutive nominal times of one rotation that came due during a fault or backlog.

    Consecutive within that rotation: a time of another rotation in between (an old rotation's
    forbidden time after a reset) does not split a stretch."""
    by_rotation: dict[int, list[int]] = defaultdict(list)
    for nominal in sorted(classes):
        by_rotation[classes[nominal][1]].append(nominal)
    runs: list[tuple[int, list[int]]] = []
    for rotation_index, nominals in sorted(by_rotation.items()):
        current: list[int] = []
        for nominal in nominals:
            if classes[nominal][0] == DISTURBED:
                current.append(nominal)
            elif current:
                runs.append((rotation_index, current))
                current = []
        if current:
            runs.append((rotation_index, current))
    return runs


def _check_catch_ups(
    timeline: Timeline,
    regular: dict[int, Occurrence],
    classes: dict[int, tuple[str, int, Plan]],
    ctx: Context,
    verdict: Verdict,
    label: str,
) -> None:
    """Each stretch of times that came due during a fault, a backlog or a hold owes what its
    policy promises (``tests.ledger.owed``): ``fire_once`` one catch-up, a limited
    ``fire_all`` ``min(limit, times in its window)``, ``skip`` nothing. Judged once the system
    is back (unless a command changed the rotation meanwhile, or the run reaches the horizon).
    """
    for rotation_index, run in _disturbed_runs(classes):
        plan = timeline.rotations[rotation_index].plan
        dues = [schedule.fire_at_ms(plan, timeline.member, n) for n in run]
        first, last = min(dues), max(dues)
        settled = (ctx.disturbed_until(last, timeline.url) or last) + SETTLE_MS
        if settled > ctx.horizon_ms or _changed_between(timeline, rotation_index, first, settled):
            continue
        # Only missed times are owed, and only a missed time delivered pays: the stretch's
        # times delivered on time (before the fault took hold, or once the system was back)
        # are no catch-up, and must not hide one the policy dropped.
        missed = [n for n in run if _missed(timeline, regular, plan, n, ctx)]
        missed_dues = [schedule.fire_at_ms(plan, timeline.member, n) for n in missed]
        owes = owed.owed(plan.misfire, missed_dues, settled)
        if owes.count == 0:
            continue
        delivered = sum(1 for n in missed if n in regular) + sum(
            1 for n in missed if ctx.unreached_then(timeline.member, n, timeline.url)
        )
        short = owed.delivered_enough(owes, delivered)
        row = verdict.row(label, ctx.fault_of(last, timeline.url))
        # The stretch's own times count as expected one by one only when they are required;
        # what the policy owes for it is counted here, as one expectation per owed delivery.
        row.expected += owes.count
        row.lost += short
        if short:
            verdict.findings.append(
                f"lost catch-up {timeline.member}: {delivered} of {len(run)} missed from "
                f"{run[0]} to {run[-1]} delivered, {owes.reason}"
            )


def _missed(
    timeline: Timeline, regular: dict[int, Occurrence], plan: Plan, nominal: int, ctx: Context
) -> bool:
    """Not delivered on time: never at a sink (or unreached), or first there after its due
    time plus the grace (a catch-up is chosen once its time was missed, so it arrives
    later than that; the slack counts a borderline arrival as late, where it pays)."""
    occurrence = regular.get(nominal)
    if occurrence is None:
        return True
    due = schedule.fire_at_ms(plan, timeline.member, nominal)
    return occurrence.first_arrival > due + plan.misfire.grace_ms - CHOICE_SLACK_MS


def _check_choices(
    timeline: Timeline,
    regular: dict[int, Occurrence],
    classes: dict[int, tuple[str, int, Plan]],
    ctx: Context,
    verdict: Verdict,
    label: str,
) -> None:
    """What ``skip`` and ``fire_once`` must not deliver. The occurrence after a delivered one
    is chosen no sooner than that one's first delivery ended (its completion, or a later
    look at a missed time), by the Redis clock; so of two occurrences delivered one after
    the other in a rotation, with no pause between them:

    - ``skip``: the second was on time when chosen, its due time at most the grace before
      the first one's end (an older one is a missed time skip delivered);
    - ``fire_once``: the second was the latest missed time or on time, so the nominal time
      after it was on time when chosen (otherwise an older missed time was caught up).
    """
    delivered = sorted(n for n in regular if n in classes)
    for before, after in itertools.pairwise(delivered):
        rotation_index, plan = classes[before][1], classes[before][2]
        if classes[after][1] != rotation_index or plan.misfire.policy not in ("skip", "fire_once"):
            continue
        ended = regular[before].episodes()[0][1]
        if _paused_between(timeline, ended, regular[after].first_arrival):
            continue
        floor = ended - plan.misfire.grace_ms - CHOICE_SLACK_MS
        judged = after
        if plan.misfire.policy == "fire_once":
            following = schedule.next_nominal(plan, after)
            if following is None or following in regular:
                continue
            judged = following
        due = schedule.fire_at_ms(plan, timeline.member, judged)
        if due < floor:
            _unexpected(
                verdict,
                label,
                ctx,
                regular[after],
                f"{plan.misfire.policy} {timeline.member}@{after}: chosen after {before} ended "
                f"at {ended:.0f}, but {judged} was due at {due}, missed by then",
            )


def _check_gaps(
    timeline: Timeline,
    regular: dict[int, Occurrence],
    classes: dict[int, tuple[str, int, Plan]],
    ctx: Context,
    verdict: Verdict,
    label: str,
) -> None:
    """Between two deliveries of a rotation (``tests.ledger.gaps``): no time passed over that
    was still on time when the choice was made at the latest (lost, whatever the fault), and
    under ``fire_all`` no more than ``limit`` missed times replayed, none older than
    ``window`` (unexpected)."""
    delivered = sorted(n for n in regular if n in classes)
    for before, after in itertools.pairwise(delivered):
        rotation_index, plan = classes[before][1], classes[before][2]
        if classes[after][1] != rotation_index:
            continue
        ended = regular[before].episodes()[0][1]
        arrival = regular[after].first_arrival
        if arrival < regular[before].first_arrival or _paused_between(timeline, ended, arrival):
            continue
        same = [n for n in sorted(classes) if classes[n][1] == rotation_index]
        _check_jumped(timeline, regular, classes, ctx, verdict, label, same, before, after)
        if plan.misfire.policy == "fire_all":
            _check_replays(timeline, regular[after], plan, ctx, verdict, label, same, after, ended)


def _check_skipped(
    timeline: Timeline,
    regular: dict[int, Occurrence],
    classes: dict[int, tuple[str, int, Plan]],
    ctx: Context,
    verdict: Verdict,
    label: str,
) -> None:
    """An occurrence an executor skipped as missed must have been missed then: its due time
    more than the grace before the Redis time of the judgement. One skipped while still on
    time is lost (a required one is already counted lost where it is accounted)."""
    for nominal, (verdict_class, _, plan) in classes.items():
        decided = ctx.skipped.get((timeline.member, nominal))
        if decided is None or nominal in regular or verdict_class not in (DISTURBED, ALLOWED):
            continue
        due = schedule.fire_at_ms(plan, timeline.member, nominal)
        if not gaps.skipped_on_time(due, decided, plan.misfire.grace_ms, CHOICE_SLACK_MS):
            continue
        row = verdict.row(label, ctx.fault_of(due, timeline.url))
        row.expected += 1
        row.lost += 1
        verdict.findings.append(
            f"lost {timeline.member}@{nominal} (due {due}): skipped as missed at {decided}, "
            f"within its grace of {plan.misfire.grace_ms} ms"
        )


def _check_jumped(
    timeline: Timeline,
    regular: dict[int, Occurrence],
    classes: dict[int, tuple[str, int, Plan]],
    ctx: Context,
    verdict: Verdict,
    label: str,
    same: list[int],
    before: int,
    after: int,
) -> None:
    plan = classes[before][2]
    gap = [
        (n, schedule.fire_at_ms(plan, timeline.member, n))
        for n in same
        if before < n < after
        and classes[n][0] == DISTURBED
        and not ctx.unreached_then(timeline.member, n, timeline.url)
    ]
    arrival = regular[after].first_arrival
    for nominal in gaps.jumped_on_time(gap, arrival, plan.misfire.grace_ms, CHOICE_SLACK_MS):
        due = schedule.fire_at_ms(plan, timeline.member, nominal)
        row = verdict.row(label, ctx.fault_of(due, timeline.url))
        row.expected += 1
        row.lost += 1
        verdict.findings.append(
            f"lost {timeline.member}@{nominal} (due {due}): passed over for {after}, first "
            f"at a sink at {arrival:.0f}, while it was still on time"
        )


def _check_replays(
    timeline: Timeline,
    chosen: Occurrence,
    plan: Plan,
    ctx: Context,
    verdict: Verdict,
    label: str,
    same: list[int],
    after: int,
    ended: float,
) -> None:
    misfire = plan.misfire
    from_chosen = [schedule.fire_at_ms(plan, timeline.member, n) for n in same if n >= after]
    replayed = gaps.replayed_past_limit(from_chosen, ended, misfire.grace_ms, CHOICE_SLACK_MS)
    if replayed > misfire.limit:
        _unexpected(
            verdict,
            label,
            ctx,
            chosen,
            f"fire_all {timeline.member}@{after}: chosen with {replayed} missed times from it "
            f"on when the one before ended at {ended:.0f}, over its limit {misfire.limit}",
        )
    elif gaps.older_than_window(from_chosen[0], ended, misfire.window_ms, CHOICE_SLACK_MS):
        _unexpected(
            verdict,
            label,
            ctx,
            chosen,
            f"fire_all {timeline.member}@{after}: due at {from_chosen[0]}, out of its window "
            f"({misfire.window_ms} ms) when the one before ended at {ended:.0f}",
        )


def _paused_between(timeline: Timeline, start: float, end: float) -> bool:
    """A pause (to its resume's reply) overlapping [start, end]: the resume chose again."""
    for pause in timeline.pauses:
        resumed = pause.resume_reply_ms if pause.resume_reply_ms is not None else math.inf
        if pause.sent_ms <= end and resumed >= start:
            return True
    return False


def _rank(verdict_class: str) -> int:
    return {FORBIDDEN: 0, "paused": 1, ALLOWED: 2, DISTURBED: 2, REQUIRED: 3}[verdict_class]


def _account(
    timeline: Timeline,
    verdict: Verdict,
    ctx: Context,
    label: str,
    verdict_class: str,
    due: int,
    nominal: int,
    occurrence: Occurrence | None,
) -> None:
    row = verdict.row(label, ctx.fault_of(due, timeline.url))
    name = f"{timeline.member}@{nominal} ({verdict_class}, due {due})"
    if occurrence is None and ctx.unreached_then(timeline.member, nominal, timeline.url):
        # Attempted while its host refused every attempt: not lost (nothing reached a sink).
        row.expected += verdict_class == REQUIRED
        row.unreached += 1
        return
    if verdict_class == REQUIRED:
        row.expected += 1
        if occurrence is None:
            row.lost += 1
            verdict.findings.append(f"lost {name}")
    if occurrence is None:
        if verdict_class in (ALLOWED, DISTURBED):
            row.skipped += 1
        return
    if _forbidden_delivery(timeline, verdict_class, due, occurrence):
        _unexpected(verdict, label, ctx, occurrence, f"forbidden {name}")
        return
    row.delivered += 1
    if verdict_class == DISTURBED and label == "skip":
        # Chosen on time (``_check_choices`` holds that): under a fault, skip owes what was on
        # time, these and those it passed over on time (``_check_gaps``, ``_check_skipped``).
        row.expected += 1
    row.lateness_ms.append(max(0.0, occurrence.first_arrival - due))
    _count_copies(verdict, ctx, label, occurrence, name, timeline, nominal, trigger_key=None)


def _forbidden_delivery(
    timeline: Timeline, verdict_class: str, due: int, occurrence: Occurrence
) -> bool:
    if verdict_class == FORBIDDEN:
        return True
    if verdict_class != "paused":
        return False
    # Delivered while paused, or (under skip) caught up after the resume: forbidden.
    for pause in timeline.pauses:
        if pause.reply_ms < due and (pause.resume_sent_ms is None or due < pause.resume_sent_ms):
            resumed = pause.resume_sent_ms
            if resumed is None or occurrence.first_arrival < resumed:
                return True
            plan = timeline.rotations[-1].plan
            return plan.misfire.policy == "skip" and due < resumed - plan.misfire.grace_ms
    return False


def _count_copies(
    verdict: Verdict,
    ctx: Context,
    label: str,
    occurrence: Occurrence,
    name: str,
    timeline: Timeline,
    nominal: int,
    trigger_key: str | None,
) -> None:
    """Duplicates (extra first attempts, each charged to the fault under way when it arrived)
    and keys (every copy must carry the expected key)."""
    expected_key = trigger_key or schedule.idempotency_key(timeline.namespace, timeline.id, nominal)
    firsts = sorted((r for r in occurrence.requests if r.attempt == 1), key=lambda r: r.arrived_ms)
    for extra in firsts[1:]:
        verdict.row(label, ctx.fault_of(extra.arrived_ms)).duplicates += 1
    bad = [r for r in occurrence.requests if r.key != expected_key]
    if bad:
        verdict.row(label, ctx.fault_of(bad[0].arrived_ms)).bad_keys += len(bad)
        verdict.findings.append(f"bad key {name}: {bad[0].key} != {expected_key}")


def _unexpected(
    verdict: Verdict, label: str, ctx: Context, occurrence: Occurrence, name: str
) -> None:
    verdict.row(label, ctx.fault_of(occurrence.first_arrival)).unexpected += 1
    verdict.findings.append(f"unexpected {name}, first arrival {occurrence.first_arrival:.0f}")


def _may_be_the_next_rotations(following: Rotation | None, nominal: int) -> bool:
    """While a reset is in flight, a time of the new rule may already be the new rotation's
    (whose own max_fires counts it, from its own sent_ms)."""
    return (
        following is not None
        and following.sent_ms <= nominal
        and bool(candidates(following.plan, nominal, nominal))
    )


def _check_max_fires(
    timeline: Timeline, regular: dict[int, Occurrence], ctx: Context, verdict: Verdict, label: str
) -> None:
    """No rotation delivers more distinct regular occurrences than its ``max_fires``."""
    for index, rotation in enumerate(timeline.rotations):
        if rotation.plan.max_fires is None:
            continue
        ends = _rotation_end(timeline, index)
        stop = ends[1] if ends is not None else math.inf
        following = timeline.rotations[index + 1] if index + 1 < len(timeline.rotations) else None
        mine = sorted(
            n
            for n in regular
            if rotation.sent_ms <= n <= stop and not _may_be_the_next_rotations(following, n)
        )
        for nominal in mine[rotation.plan.max_fires :]:
            _unexpected(
                verdict,
                label,
                ctx,
                regular[nominal],
                f"{timeline.member}@{nominal}: beyond max_fires",
            )


def _judge_chain(
    timeline: Timeline,
    regular: dict[int, Occurrence],
    ctx: Context,
    verdict: Verdict,
    label: str,
) -> None:
    """Fixed delay: each occurrence no sooner than ``delay`` after the previous one's answer,
    and the chain goes on while the schedule is active."""
    rotation = timeline.rotations[-1]
    plan = rotation.plan
    assert isinstance(plan.rule, AfterCompletionRule)
    delay = plan.rule.delay_ms
    earliest = plan.start_ms if plan.start_ms is not None else rotation.sent_ms + delay
    previous_end: float | None = None
    fired = 0
    for nominal, occurrence in sorted(regular.items()):
        floor = earliest if previous_end is None else previous_end + delay
        if nominal < floor - CLOCK_SLACK_MS:
            _unexpected(verdict, label, ctx, occurrence, f"{timeline.member}@{nominal}: too soon")
            continue
        row = verdict.row(label, ctx.fault_of(nominal, timeline.url))
        row.expected += 1
        row.delivered += 1
        row.lateness_ms.append(max(0.0, occurrence.first_arrival - nominal))
        name = f"{timeline.member}@{nominal}"
        _count_copies(verdict, ctx, label, occurrence, name, timeline, nominal, trigger_key=None)
        previous_end = _chain_link_end(ctx, timeline.member, nominal, occurrence)
        fired += 1
    next_due = earliest if previous_end is None else int(previous_end) + delay
    if _chain_finished(plan, next_due, fired):
        return
    if next_due + CHAIN_SLACK_MS >= ctx.horizon_ms:
        return
    # As for a grid time (``classify``): a delete sent before the next occurrence had its
    # chance (its due time, or the end of the fault or backlog under way then, plus the slack)
    # may keep it from firing. A dead dispatcher's shards wait for its leases to expire, so
    # what comes due meanwhile is late, and a delete may remove it first.
    disturbed_until = ctx.disturbed_until(next_due, timeline.url)
    chance_until = (disturbed_until if disturbed_until is not None else next_due) + CHAIN_SLACK_MS
    if timeline.deleted is None or timeline.deleted[0] > chance_until:
        row = verdict.row(label, ctx.fault_of(next_due, timeline.url))
        row.expected += 1
        row.lost += 1
        verdict.findings.append(f"lost {timeline.member}: chain stopped, next due {next_due}")


def _chain_link_end(ctx: Context, member: str, nominal: int, occurrence: Occurrence) -> float:
    """When the executors saw an occurrence end, as the next one's delay counts from it: its
    first answer at the sink, or sooner when it ended dead with no answer (a host that went
    down mid-request: the sink answered a request whose connection was already cut, so the
    executor counted the attempt failed and the delay from its death)."""
    answered = min(end for _, end in occurrence.episodes())
    dead_ms = ctx.unreached.get((member, nominal))
    return answered if dead_ms is None else min(answered, dead_ms)


def _chain_finished(plan: Plan, next_due: int, fired: int) -> bool:
    """Nothing more to fire: past ``end_at``, or ``max_fires`` reached."""
    if plan.end_ms is not None and next_due > plan.end_ms:
        return True
    return plan.max_fires is not None and fired >= plan.max_fires


def _judge_triggers(
    timeline: Timeline, triggered: dict[int, Occurrence], ctx: Context, verdict: Verdict
) -> None:
    accepted = {t.fire_ms: t for t in timeline.triggers}
    for trigger in timeline.triggers:
        row = verdict.row("trigger", ctx.fault_of(trigger.fire_ms))
        if trigger.key == schedule.idempotency_key(
            timeline.namespace, timeline.id, trigger.fire_ms
        ):
            # A trigger has its own identity: never the key of a regular occurrence.
            row.bad_keys += 1
            verdict.findings.append(f"bad key trigger {timeline.member}@{trigger.fire_ms}: regular")
        occurrence = triggered.get(trigger.fire_ms)
        deleted_after = timeline.deleted is not None and timeline.deleted[0] >= trigger.sent_ms
        if not deleted_after and trigger.fire_ms <= ctx.horizon_ms:
            row.expected += 1
            if occurrence is None:
                row.lost += 1
                verdict.findings.append(f"lost trigger {timeline.member}@{trigger.fire_ms}")
        if occurrence is None:
            continue
        row.delivered += 1
        row.lateness_ms.append(max(0.0, occurrence.first_arrival - trigger.fire_ms))
        name = f"trigger {timeline.member}@{trigger.fire_ms}"
        _count_copies(
            verdict, ctx, "trigger", occurrence, name, timeline, trigger.fire_ms, trigger.key
        )
    for fire_ms, occurrence in triggered.items():
        if fire_ms not in accepted:
            _unexpected(
                verdict, "trigger", ctx, occurrence, f"trigger {timeline.member}@{fire_ms}: unknown"
            )


def _count_overlaps(
    timeline: Timeline, regular: dict[int, Occurrence], ctx: Context, verdict: Verdict, label: str
) -> None:
    """Invariant 3: two regular occurrences of one schedule in flight at once, seen at the
    sink: a request of one arrives while a request of another is still being answered
    (checkable with slow targets; triggers are outside the rotation and not counted)."""
    spans = sorted(
        (request.arrived_ms, request.answered_ms, nominal)
        for nominal, occurrence in regular.items()
        for request in occurrence.requests
    )
    active: list[tuple[float, int]] = []
    counted: set[tuple[int, int]] = set()
    for start, end, nominal in spans:
        active = [(e, n) for e, n in active if e > start + CLOCK_SLACK_MS]
        for _, other in active:
            pair = (min(other, nominal), max(other, nominal))
            if other != nominal and pair not in counted:
                counted.add(pair)
                verdict.row(label, ctx.fault_of(start, timeline.url)).overlaps += 1
                verdict.findings.append(
                    f"overlap {timeline.member}: {pair[0]} and {pair[1]} at {start:.0f}"
                )
        active.append((end, nominal))


# --- herds ---------------------------------------------------------------------------------


def judge_herd(
    expected: dict[str, dict[tuple[str, int], str]], requests: Sequence[Request]
) -> Verdict:
    """A herd with no fault: per spec kind, every occurrence delivered with its key, none twice.

    ``expected`` maps each kind to its occurrences ((schedule, fire time) -> idempotency key).
    """
    verdict = Verdict()
    kind_of = {item: kind for kind, items in expected.items() for item in items}
    for kind, items in expected.items():
        verdict.row(f"herd:{kind}", "none").expected = len(items)
    for (member, _, nominal), occurrence in group(requests).items():
        found = kind_of.get((member, nominal))
        if found is None:
            continue
        kind = found
        row = verdict.row(f"herd:{kind}", "none")
        row.delivered += 1
        row.duplicates += max(0, occurrence.first_attempts - 1)
        row.lateness_ms.append(max(0.0, occurrence.first_arrival - nominal))
        key = expected[kind][(member, nominal)]
        row.bad_keys += sum(1 for r in occurrence.requests if r.key != key)
    for row in verdict.rows.values():
        row.lost = row.expected - row.delivered
    return verdict
