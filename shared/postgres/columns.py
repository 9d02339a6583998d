"""Rows as the parameters of batched statements: one array per column for ``unnest``, one row
per key, audit values made safe for text and jsonb columns (pure)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

from shared.contract import codec
from shared.contract.rows import Checkpoint, CommandAudit, ExecutionRow

Row = TypeVar("Row")


def latest(
    rows: Sequence[Row], key: Callable[[Row], Hashable], rank: Callable[[Row], int]
) -> list[Row]:
    """One row per key, the highest ranked (a statement may not touch a row twice)."""
    latest: dict[Hashable, Row] = {}
    for row in rows:
        kept = latest.get(key(row))
        if kept is None or rank(kept) <= rank(row):
            latest[key(row)] = row
    return list(latest.values())


def _occurrence(r: ExecutionRow) -> Hashable:
    return (r.namespace, r.id, r.nominal_ms, r.is_trigger, r.is_backfill)


def _schedule(c: Checkpoint) -> Hashable:
    return (c.namespace, c.id)


def executions(rows: Sequence[ExecutionRow]) -> list[ExecutionRow]:
    """One row per occurrence, its latest attempt, carrying every failed attempt of the batch
    and the earliest lateness (the first attempt's)."""
    key = _occurrence
    kept = {key(r): r for r in latest(rows, key, lambda r: r.attempts)}
    earlier: dict[Hashable, list[ExecutionRow]] = {}
    for row in rows:
        if kept[key(row)] is not row:
            earlier.setdefault(key(row), []).append(row)
    out = []
    for k, last in kept.items():
        others = earlier.get(k)
        if not others:
            out.append(last)
            continue
        ordered = sorted([*others, last], key=lambda r: r.attempts)
        # A redelivered attempt logs its failure once.
        tried = list({e.get("attempt"): e for r in ordered for e in r.failed_attempts}.values())
        first = min(ordered, key=lambda r: r.lateness_ms)
        # Lateness is started_ms - due_ms: a due time that keeps the first attempt's.
        out.append(
            dataclasses.replace(
                last, failed_attempts=tried, due_ms=last.started_ms - first.lateness_ms
            )
        )
    return out


def checkpoints(rows: Sequence[Checkpoint]) -> list[Checkpoint]:
    """One checkpoint per schedule, the latest fire's; uncounted ones add up their fires."""
    key = _schedule
    added: dict[Hashable, int] = {}
    for c in rows:
        if not c.counted:
            added[key(c)] = added.get(key(c), 0) + c.fires
    return [
        c if c.counted else dataclasses.replace(c, fires=added[key(c)])
        for c in latest(rows, key, lambda c: c.last_fire_ms)
    ]


def json_text(value: dict[str, Any] | bytes) -> str:
    return (value if isinstance(value, bytes) else codec.dumps(value)).decode()


#: Longest text kept in an audit column (ids and AMQP properties are far shorter when honest).
AUDIT_TEXT_MAX = 1000


def audit_text(value: str | None) -> str | None:
    if value is None:
        return None
    return value.replace("\x00", "\ufffd")[:AUDIT_TEXT_MAX]


def audit_json(value: Any) -> Any:
    """``value`` as JSON that jsonb accepts: a NUL escape (``\\u0000``) becomes U+FFFD."""
    if value is None:
        return None
    try:
        encoded = codec.dumps(value)
    except TypeError:  # nested too deep to encode: validation refuses it; the audit drops it
        return None
    if b"\\u0000" in encoded:
        encoded = encoded.replace(b"\\u0000", b"\\ufffd")
    return codec.Fragment(encoded)


def as_json(value: dict[str, Any] | bytes) -> Any:
    return codec.Fragment(value) if isinstance(value, bytes) else value


def audit_columns(audits: Sequence[CommandAudit]) -> list[list[Any]]:
    """Audit rows as the column arrays of an unnest (sanitized as ``record_command`` does)."""
    return [
        [audit_text(a.namespace) for a in audits],
        [audit_text(a.verb) for a in audits],
        [audit_text(a.schedule_id) for a in audits],
        [audit_text(a.user_id) for a in audits],
        [audit_text(a.app_id) for a in audits],
        [audit_text(a.message_id) for a in audits],
        [audit_text(a.correlation_id) for a in audits],
        [audit_json(a.body) for a in audits],
        [audit_text(a.outcome) for a in audits],
        [audit_json(a.error) for a in audits],
        [a.version for a in audits],
        [audit_json(a.reply) for a in audits],
    ]


def stats_arguments(deltas: Sequence[Any]) -> list[list[Any]]:
    """write_stats's parameters: one array per column for a batch of ``stats.Delta``."""
    return [
        [d.namespace for d in deltas],
        [d.id for d in deltas],
        [d.fires for d in deltas],
        [d.succeeded for d in deltas],
        [d.failed for d in deltas],
        [d.dead for d in deltas],
        [d.skipped for d in deltas],
        [d.excluded for d in deltas],
        [d.trailing_dead for d in deltas],
        [d.last_status for d in deltas],
        [d.last_error for d in deltas],
        [d.last_ms for d in deltas],
    ]
