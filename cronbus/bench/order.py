"""Whether the commands on each schedule were applied in the order sent, judged from replies (pure).

``cronbus bench intake`` sends M upserts to each of S schedules, the ``seq``-th carrying the
label ``seq``, and reads each reply's ``version``. Every applied upsert changes the definition,
so it raises the version by one: the order held iff, on every schedule, seq ``i`` was answered
with version ``base + i`` (no gaps, no repeats) and the schedule's final state carries the last
seq's label. ``base`` is what seq 0 would have had: the smallest version answered, less the
smallest seq answered (1 for a schedule that the first upsert created).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

#: Violations shown in the figures; the count says how many there were in all.
EXAMPLES = 5
#: The label each ordered upsert carries: its place among its schedule's commands.
SEQ_LABEL = "seq"


class Answer(NamedTuple):
    """One reply: the schedule and seq of the command it answers, the version it carried."""

    schedule: str
    seq: int
    #: None when the reply carried none (a refusal, or no reply at all).
    version: int | None


@dataclass(frozen=True)
class Violation:
    schedule: str
    #: The command's seq; for ``final``, the seq the final state should carry.
    seq: int
    #: ``version``, ``repeated``, ``unanswered``, ``unexpected`` or ``final``.
    kind: str
    detail: str

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def judge(
    sent: Mapping[str, int], answers: Iterable[Answer], finals: Mapping[str, str | None]
) -> list[Violation]:
    """Every violation of the order, schedule by schedule in ``sent``'s order.

    ``sent`` maps each schedule to the number of commands sent to it (seqs 0 to n-1);
    ``finals`` maps it to the seq label its final state carried (None: no label, or no state).
    """
    by_schedule: dict[str, list[Answer]] = {}
    found: list[Violation] = []
    for answer in answers:
        if answer.schedule not in sent:
            found.append(_unexpected(answer, "a schedule no command was sent to"))
            continue
        by_schedule.setdefault(answer.schedule, []).append(answer)
    for schedule, count in sent.items():
        found += _judge_schedule(schedule, count, by_schedule.get(schedule, []))
        found += _judge_final(schedule, count, finals.get(schedule))
    return found


def blind_counts(schedules: int, dispatchers: Iterable[int]) -> list[int]:
    """The dispatcher counts (above 1) the interleaved phase cannot test with ``schedules``.

    A schedule's commands are ``schedules`` apart in the queue; RabbitMQ hands messages to its
    consumers in turn while none has its prefetch full, so when the count divides
    ``schedules`` every command of a schedule goes to the same dispatcher and any order
    holds (seen: 100 schedules, 4 dispatchers, no violation on a shared queue; 101, 1,727).
    """
    return sorted({count for count in dispatchers if count > 1 and schedules % count == 0})


def summary(violations: list[Violation], examples: int = EXAMPLES) -> dict[str, Any]:
    """The figure: how many, of which kinds, on how many schedules, and the first few.

    One command applied late puts every command between its place and where it landed out of
    place too, so ``count`` measures the disorder, and ``schedules`` how far it spread.
    """
    by_kind: dict[str, int] = {}
    for violation in violations:
        by_kind[violation.kind] = by_kind.get(violation.kind, 0) + 1
    return {
        "count": len(violations),
        "schedules": len({violation.schedule for violation in violations}),
        "by_kind": by_kind,
        "examples": [violation.as_json() for violation in violations[:examples]],
    }


def version_of(reply: Mapping[str, Any] | None) -> int | None:
    """The version an upsert's (or a get's) reply carries; None for a refusal or no reply."""
    view = (reply or {}).get("schedule")
    version = view.get("version") if isinstance(view, Mapping) else None
    return version if isinstance(version, int) else None


def final_seq_of(reply: Mapping[str, Any] | None) -> str | None:
    """The seq label of a get's reply; None when it has none."""
    view = (reply or {}).get("schedule")
    labels = view.get("labels") if isinstance(view, Mapping) else None
    seq = labels.get(SEQ_LABEL) if isinstance(labels, Mapping) else None
    return seq if isinstance(seq, str) else None


def _judge_schedule(schedule: str, count: int, answers: list[Answer]) -> list[Violation]:
    found: list[Violation] = []
    first: dict[int, int | None] = {}
    for answer in answers:
        if not 0 <= answer.seq < count:
            found.append(_unexpected(answer, f"a seq outside 0..{count - 1}"))
        elif answer.seq in first:
            found.append(Violation(schedule, answer.seq, "repeated", "answered more than once"))
        else:
            first[answer.seq] = answer.version
    versioned = {seq: version for seq, version in first.items() if version is not None}
    base = min(versioned.values()) - min(versioned) if versioned else 0
    for seq in range(count):
        if seq not in versioned:
            found.append(Violation(schedule, seq, "unanswered", "no reply with a version"))
        elif versioned[seq] != base + seq:
            found.append(
                Violation(
                    schedule,
                    seq,
                    "version",
                    f"answered with version {versioned[seq]}, expected {base + seq}",
                )
            )
    return found


def _judge_final(schedule: str, count: int, final: str | None) -> list[Violation]:
    last = count - 1
    if count < 1 or final == str(last):
        return []
    return [Violation(schedule, last, "final", f"the final state carries seq {final}")]


def _unexpected(answer: Answer, what: str) -> Violation:
    return Violation(answer.schedule, answer.seq, "unexpected", f"a reply for {what}")
