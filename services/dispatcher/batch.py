"""Many upserts applied as one: what each does to PostgreSQL, the index and its reply (pure).

Items are applied in order, each exactly as a single upsert would be: an item sees the effect of
the items before it (the same schedule twice gets versions n+1 and n+2), an ``expected_version``
that does not match refuses that item only, and the reply of each is what a single upsert would
answer. The caller locks the stored rows, writes ``rows`` and ``audits`` in one transaction,
then ``index_writes``, then answers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from services.dispatcher.views import view
from shared import compact, keys, models, rotation
from shared.errors import ValidationFailed
from shared.index import Upsert
from shared.plan import Plan
from shared.store import AppliedCommand, CommandAudit, NewScheduleRow, ScheduleRow

Key = tuple[str, str]


@dataclass(frozen=True, slots=True)
class UpsertItem:
    namespace: str
    schedule: models.Schedule
    #: The checked plan (version 0).
    plan: Plan
    expected_version: int | None = None
    #: The audit row of the command (None: the command's own row is written by the caller).
    audit: CommandAudit | None = None
    #: The command's message_id and body: a replay is answered, a reuse is a conflict.
    message_id: str | None = None
    body: Any = None


@dataclass
class BatchEffect:
    #: Per item, in order: the reply of a single upsert, or why it was refused.
    results: list[dict[str, Any] | ValidationFailed] = field(default_factory=list)
    #: The final row of each schedule touched.
    rows: dict[Key, NewScheduleRow] = field(default_factory=dict)
    #: The final index write of each schedule touched: an upsert, or a removal (None).
    index_writes: dict[Key, tuple[Upsert | None, int]] = field(default_factory=dict)
    audits: list[CommandAudit] = field(default_factory=list)


def apply_upserts(
    items: list[UpsertItem],
    stored: dict[Key, ScheduleRow],
    now_ms: int,
    txn_now_ms: int,
    applied: dict[Key, AppliedCommand] | None = None,
) -> BatchEffect:
    """The effect of ``items`` on the schedules ``stored`` (locked by the caller).

    ``now_ms`` is the clock the rotation is placed by; ``txn_now_ms`` is what PostgreSQL writes
    as ``updated_at`` (the transaction's ``now()``), so replies show what a ``get`` will.
    ``applied`` maps (namespace, message_id) to the command already applied under it.
    """
    effect = BatchEffect()
    current = dict(stored)
    seen = dict(applied or {})
    for item in items:
        earlier = seen.get((item.namespace, item.message_id)) if item.message_id else None
        if earlier is not None:
            effect.results.append(_replay_of(item, earlier))
            continue
        key = (item.namespace, item.schedule.id)
        outcome = _apply_one(item, current.get(key), now_ms, txn_now_ms)
        if isinstance(outcome, ValidationFailed):
            effect.results.append(outcome)
            continue
        row, new_row, index_write, reply = outcome
        current[key] = row
        effect.rows[key] = new_row
        effect.index_writes[key] = (index_write, row.version)
        effect.results.append(reply)
        if item.message_id:
            seen[(item.namespace, item.message_id)] = AppliedCommand("upsert", item.body, reply)
        if item.audit is not None:
            effect.audits.append(dataclasses.replace(item.audit, version=row.version, reply=reply))
    return effect


def _apply_one(
    item: UpsertItem, old: ScheduleRow | None, now_ms: int, txn_now_ms: int
) -> ValidationFailed | tuple[ScheduleRow, NewScheduleRow, Upsert | None, dict[str, Any]]:
    live = old is not None and old.state != "deleted"
    current_version = old.version if old is not None and live else 0
    if item.expected_version is not None and item.expected_version != current_version:
        return version_conflict(item.expected_version, current_version)
    version = (old.version if old is not None else 0) + 1
    plan = dataclasses.replace(item.plan, version=version)
    current = _current_of(old) if live and old is not None else None
    placement = rotation.place_upsert(current, plan, item.schedule.paused, now_ms)
    raw_plan = compact.encode(plan)
    definition = item.schedule.model_dump(mode="json")
    new_row = NewScheduleRow(
        item.namespace,
        item.schedule.id,
        version,
        placement.state,
        definition,
        raw_plan,
        item.schedule.priority,
        item.schedule.labels,
        placement.fires,
        placement.last_fire_ms,
        placement.next_nominal,
    )
    row = ScheduleRow(
        item.namespace,
        item.schedule.id,
        version,
        placement.state,
        definition,
        raw_plan,
        item.schedule.priority,
        item.schedule.labels,
        placement.fires,
        placement.last_fire_ms,
        placement.next_nominal,
        old.created_ms if live and old is not None else txn_now_ms,
        txn_now_ms,
    )
    index_write = rotation.index_write(item.namespace, item.schedule.id, plan, raw_plan, placement)
    reply = {"ok": True, "created": not live, "schedule": view(row, now_ms)}
    return row, new_row, index_write, reply


def _replay_of(item: UpsertItem, earlier: AppliedCommand) -> dict[str, Any] | ValidationFailed:
    """The stored reply of the same command again; a conflict for a reused message_id."""
    if earlier.verb == "upsert" and earlier.body == item.body:
        return {**earlier.reply, "duplicate": True}
    return message_id_conflict(item.namespace, item.message_id or "", earlier.verb)


def message_id_conflict(namespace: str, message_id: str, verb: str) -> ValidationFailed:
    return ValidationFailed(
        "conflict",
        f"message_id {message_id!r} was already used for another command "
        f"({namespace}.{verb}); send this one with a new message_id",
        [{"field": "message_id", "reason": "was already used for another command"}],
    )


def version_conflict(expected: int, found: int) -> ValidationFailed:
    return ValidationFailed(
        "version_conflict",
        f"expected version {expected}, found {found}",
        [{"field": "expected_version", "reason": f"the stored version is {found}"}],
    )


def _current_of(row: ScheduleRow) -> rotation.Current:
    return rotation.Current(
        compact.decode(row.compact), row.state, row.fires, row.last_fire_ms, row.next_fire_ms
    )


def member_of(key: Key) -> str:
    return keys.member(*key)
