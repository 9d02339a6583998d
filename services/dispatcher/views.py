"""How replies show a schedule: its definition plus what cronbus assigns (pure)."""

from __future__ import annotations

from typing import Any

from shared.contract import timefmt
from shared.contract.rows import ScheduleRow
from shared.rules import compact, schedule
from shared.rules.plan import AfterCompletionRule, Plan

NEXT_FIRES_SHOWN = 5


def _next_fires(row: ScheduleRow, plan: Plan, now_ms: int) -> list[str]:
    if row.state != "active":
        return []
    remaining = NEXT_FIRES_SHOWN
    if plan.max_fires is not None:
        remaining = min(remaining, max(plan.max_fires - row.fires, 0))
    times: list[int] = []
    current = row.next_fire_ms
    if current is None or current < now_ms:
        times = schedule.upcoming(plan, now_ms, remaining, fires=0)
    else:
        while current is not None and len(times) < remaining:
            times.append(current)
            current = (
                None
                if isinstance(plan.rule, AfterCompletionRule)
                else (schedule.next_nominal(plan, current))
            )
    return [timefmt.format_ms(t) for t in times]


def view(row: ScheduleRow, now_ms: int, plan: Plan | None = None) -> dict[str, Any]:
    """A schedule as replies show it: the definition plus what cronbus assigns. ``plan``: the
    row's plan when the caller holds it already (decoding it again costs more than the rest)."""
    out = dict(row.definition)
    out.update(
        namespace=row.namespace,
        version=row.version,
        state=row.state,
        fires=row.fires,
        last_fire_at=None if row.last_fire_ms is None else timefmt.format_ms(row.last_fire_ms),
        next_fires=[]
        if row.state == "deleted"
        else _next_fires(row, plan or compact.decode(row.compact), now_ms),
        created_at=timefmt.format_ms(row.created_ms),
        updated_at=timefmt.format_ms(row.updated_ms),
    )
    return out
