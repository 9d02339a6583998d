"""Many upserts applied as one: what each does to PostgreSQL, the index and its reply (pure).

Items are applied in order, each exactly as a single upsert would be: an item sees the effect of
the items before it (the same schedule twice gets versions n+1 and n+2), an ``expected_version``
that does not match refuses that item only, and the reply of each is what a single upsert would
answer. The caller locks the stored rows, writes ``rows`` and ``audits`` in one transaction,
then ``index_writes``, then answers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from services.dispatcher.views import view
from shared.contract import errors, keys, models, validation
from shared.contract.entries import Upsert
from shared.contract.errors import ValidationFailed
from shared.contract.rows import AppliedCommand, CommandAudit, NewScheduleRow, ScheduleRow
from shared.rules import compact, rotation
from shared.rules.plan import Plan

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
    #: Its reply shows only the schedule's id and version (an upsert_many's item: the
    #: command's reply says no more of it, and the full view costs more than the rest).
    brief: bool = False


@dataclass(frozen=True, slots=True)
class ChangeItem:
    """A delete, pause or resume of one schedule."""

    namespace: str
    schedule_id: str
    verb: Literal["delete", "pause", "resume"]
    audit: CommandAudit | None = None
    message_id: str | None = None
    body: Any = None


Item = UpsertItem | ChangeItem


@dataclass(frozen=True, slots=True)
class _Applied:
    row: ScheduleRow
    #: None: nothing to write (a pause of a paused schedule).
    new_row: NewScheduleRow | None
    #: None: the index stays as it is; else an upsert or a removal (None) at a version.
    index_write: tuple[Upsert | None, int] | None
    reply: dict[str, Any]


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
    items: Sequence[Item],
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
        key = (item.namespace, schedule_id_of(item))
        if isinstance(item, UpsertItem):
            outcome = _apply_one(item, current.get(key), now_ms, txn_now_ms)
        else:
            outcome = _change_one(item, current.get(key), now_ms, txn_now_ms)
        if isinstance(outcome, ValidationFailed):
            effect.results.append(outcome)
            continue
        current[key] = outcome.row
        if outcome.new_row is not None:
            effect.rows[key] = outcome.new_row
        if outcome.index_write is not None:
            effect.index_writes[key] = outcome.index_write
        effect.results.append(outcome.reply)
        if item.message_id:
            seen[(item.namespace, item.message_id)] = AppliedCommand(
                verb_of(item), item.body, outcome.reply
            )
        if item.audit is not None:
            effect.audits.append(
                dataclasses.replace(item.audit, version=outcome.row.version, reply=outcome.reply)
            )
    return effect


def schedule_id_of(item: Item) -> str:
    return item.schedule.id if isinstance(item, UpsertItem) else item.schedule_id


def verb_of(item: Item) -> str:
    return "upsert" if isinstance(item, UpsertItem) else item.verb


def _apply_one(
    item: UpsertItem, old: ScheduleRow | None, now_ms: int, txn_now_ms: int
) -> ValidationFailed | _Applied:
    live = old is not None and old.state != "deleted"
    current_version = old.version if old is not None and live else 0
    if item.expected_version is not None and item.expected_version != current_version:
        return version_conflict(item.expected_version, current_version)
    definition = item.schedule.model_dump(mode="json")
    warnings = validation.warnings_of(item.plan, now_ms)
    resumes = old is not None and old.state == "paused" and not item.schedule.paused
    if live and old is not None and old.definition == definition and not resumes:
        # The same definition again (a file applied twice): nothing to change, no new version.
        # Unless it resumes a schedule paused for it (pause_after_failures): that is a change.
        # No warnings: they say what this command makes the schedule do, and it does nothing
        # new (a once in the past fired when it was created, or is completed).
        shown = _brief(old) if item.brief else view(old, now_ms)
        reply = {"ok": True, "created": False, "unchanged": True, "schedule": shown}
        return _Applied(old, None, None, reply)
    version = (old.version if old is not None else 0) + 1
    plan = dataclasses.replace(item.plan, version=version)
    current = _current_of(old) if live and old is not None else None
    member = keys.member(item.namespace, item.schedule.id)
    placement = rotation.place_upsert(current, plan, item.schedule.paused, now_ms, member)
    raw_plan = compact.encode(plan)
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
        placement.rotation_version(version),
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
    shown = _brief(row) if item.brief else view(row, now_ms, plan)
    reply = {"ok": True, "created": not live, "schedule": shown}
    return _Applied(row, new_row, (index_write, version), _warned(reply, warnings))


def _brief(row: ScheduleRow) -> dict[str, Any]:
    return {"id": row.id, "version": row.version}


def _warned(reply: dict[str, Any], warnings: list[Any]) -> dict[str, Any]:
    """A reply with its ``warnings`` (an extension of the pinned reply), when there are any."""
    return {**reply, "warnings": warnings} if warnings else reply


def _change_one(
    item: ChangeItem, old: ScheduleRow | None, now_ms: int, txn_now_ms: int
) -> ValidationFailed | _Applied:
    """delete, pause or resume, as the single commands do."""
    if old is None or old.state == "deleted":
        return not_found(item.namespace, item.schedule_id)
    paused = item.verb == "pause"
    if item.verb != "delete" and (old.state == "completed" or (old.state == "paused") == paused):
        # Already where the command asks it to be: nothing changes, no new version.
        return _Applied(
            old, None, None, {"ok": True, "unchanged": True, "schedule": view(old, now_ms)}
        )
    version = old.version + 1
    if item.verb == "delete":
        placement = rotation.Placement("deleted", None, None, old.fires, old.last_fire_ms)
        new_row = next_version(old, placement, old.definition)
        row = _stored(new_row, old.created_ms, txn_now_ms)
        return _Applied(row, new_row, (None, version), {"ok": True, "schedule": view(row, now_ms)})
    plan = dataclasses.replace(compact.decode(old.compact), version=version)
    current = _current_of(old)
    member = keys.member(item.namespace, item.schedule_id)
    placement = (
        rotation.place_pause(current) if paused else rotation.place_resume(current, now_ms, member)
    )
    new_row = next_version(old, placement, {**old.definition, "paused": paused})
    row = _stored(new_row, old.created_ms, txn_now_ms)
    index_write = rotation.index_write(
        item.namespace, item.schedule_id, plan, compact.encode(plan), placement
    )
    return _Applied(
        row, new_row, (index_write, version), {"ok": True, "schedule": view(row, now_ms)}
    )


def _stored(new_row: NewScheduleRow, created_ms: int, updated_ms: int) -> ScheduleRow:
    """The row as PostgreSQL will hold it once ``new_row`` is written."""
    definition = new_row.definition
    assert isinstance(definition, dict)
    return ScheduleRow(
        new_row.namespace,
        new_row.id,
        new_row.version,
        new_row.state,
        definition,
        new_row.compact,
        new_row.priority,
        new_row.labels,
        new_row.fires,
        new_row.last_fire_ms,
        new_row.next_fire_ms,
        created_ms,
        updated_ms,
    )


def next_version(
    old: ScheduleRow, placement: rotation.Placement, definition: dict[str, Any]
) -> NewScheduleRow:
    """The row of ``old`` at its next version, where ``placement`` puts it."""
    version = old.version + 1
    return NewScheduleRow(
        old.namespace,
        old.id,
        version,
        placement.state,
        definition,
        compact.with_version(old.compact, version),
        old.priority,
        old.labels,
        placement.fires,
        placement.last_fire_ms,
        placement.next_nominal,
        placement.rotation_version(version),
    )


def not_found(namespace: str, schedule_id: str) -> ValidationFailed:
    return ValidationFailed(
        errors.NOT_FOUND,
        f"no schedule {namespace}/{schedule_id}",
        [{"field": "id", "reason": f"no schedule {schedule_id!r} in namespace {namespace!r}"}],
    )


def _replay_of(item: Item, earlier: AppliedCommand) -> dict[str, Any] | ValidationFailed:
    """The stored reply of the same command again; a conflict for a reused message_id."""
    if earlier.verb == verb_of(item) and earlier.body == item.body:
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
