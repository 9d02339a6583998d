"""Bulk import: many schedules through the same validation and placement as ``upsert``, written
with one COPY and one statement per batch to PostgreSQL, then pipelined into the index.

Each line is a schedule (the ``schedule`` object of an upsert). A line that is refused is
reported with its number and the reasons, and changes nothing; the other lines go on.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

import pydantic

from shared import codec, compact, keys, models, rotation, validation
from shared.errors import ValidationFailed
from shared.index import Index, Upsert
from shared.store import CommandAudit, NewScheduleRow, ScheduleRow, Store

DEFAULT_BATCH = 5000


@dataclass
class ImportResult:
    imported: int = 0
    created: int = 0
    #: (line number, field errors) of every refused line.
    refused: list[tuple[int, list[dict[str, str]]]] = field(default_factory=list)
    #: Earliest fire time written to the index (to wake dispatchers).
    earliest_fire_ms: int | None = None


@dataclass
class _Valid:
    line: int
    item: models.Schedule
    plan: Any


def _validate(
    line_number: int, raw: bytes, now_ms: int, policy: validation.TargetPolicy
) -> _Valid | list[dict[str, str]]:
    try:
        item = models.Schedule.model_validate_json(raw)
    except pydantic.ValidationError as exc:
        return validation.field_errors(exc)
    try:
        plan = validation.check_schedule(item, 0, now_ms, policy)
    except ValidationFailed as failure:
        return failure.details
    return _Valid(line_number, item, plan)


async def _batches(
    lines: Iterable[bytes] | AsyncIterator[bytes], size: int
) -> AsyncIterator[list[tuple[int, bytes]]]:
    batch: list[tuple[int, bytes]] = []
    number = 0
    if isinstance(lines, AsyncIterator):
        async for raw in lines:
            number += 1
            if raw.strip():
                batch.append((number, raw))
            if len(batch) >= size:
                yield batch
                batch = []
    else:
        for raw in lines:
            number += 1
            if raw.strip():
                batch.append((number, raw))
            if len(batch) >= size:
                yield batch
                batch = []
    if batch:
        yield batch


async def import_lines(
    lines: Iterable[bytes] | AsyncIterator[bytes],
    namespace: str,
    store: Store,
    index: Index,
    policy: validation.TargetPolicy,
    *,
    batch_size: int = DEFAULT_BATCH,
    app_id: str | None = "cronbus-import",
    clock: Any = time.time,
) -> ImportResult:
    validation.check_namespace(namespace)
    result = ImportResult()
    writing: asyncio.Task[None] | None = None
    async for batch in _batches(lines, batch_size):
        now = int(clock() * 1000)
        valid: dict[str, _Valid] = {}
        for number, raw in batch:
            checked = _validate(number, raw, now, policy)
            if isinstance(checked, list):
                result.refused.append((number, checked))
            else:
                valid[checked.item.id] = checked  # a later line for the same id wins
        # One batch is written while the next is validated: PostgreSQL and Redis work on
        # the other core meanwhile. Batches still commit one after the other, in order.
        if writing is not None:
            await writing
            writing = None
        if valid:
            writing = asyncio.create_task(
                _write_batch(list(valid.values()), namespace, store, index, now, result, app_id)
            )
    if writing is not None:
        await writing
    return result


def _placed(
    entry: _Valid, old: ScheduleRow | None, namespace: str, now: int
) -> tuple[NewScheduleRow, Upsert | None, bool]:
    """The row, the index write and whether it is new, for one valid line (as upsert does)."""
    live = old is not None and old.state != "deleted"
    version = (old.version if old is not None else 0) + 1
    current = (
        rotation.Current(
            compact.decode(old.compact), old.state, old.fires, old.last_fire_ms, old.next_fire_ms
        )
        if (old is not None and live)
        else None
    )
    placement = rotation.place_upsert(current, entry.plan, entry.item.paused, now)
    # The plan was validated at version 0: stamp the real version into the encoding only.
    raw_plan = compact.with_version(compact.encode(entry.plan), version)
    row = NewScheduleRow(
        namespace,
        entry.item.id,
        version,
        placement.state,
        entry.item.model_dump_json().encode(),
        raw_plan,
        entry.item.priority,
        entry.item.labels,
        placement.fires,
        placement.last_fire_ms,
        placement.next_nominal,
    )
    upsert = rotation.index_write(
        namespace, entry.item.id, entry.plan, raw_plan, placement, version=version
    )
    return row, upsert, not live


async def _write_batch(
    valid: list[_Valid],
    namespace: str,
    store: Store,
    index: Index,
    now: int,
    result: ImportResult,
    app_id: str | None,
) -> None:
    rows: list[NewScheduleRow] = []
    upserts: dict[int, list[Upsert]] = defaultdict(list)
    removals: dict[int, list[tuple[str, int | None]]] = defaultdict(list)
    async with store.transaction() as conn:
        existing = await store.lock_schedules(conn, namespace, [v.item.id for v in valid])
        for entry in valid:
            row, upsert, created = _placed(entry, existing.get(entry.item.id), namespace, now)
            rows.append(row)
            result.created += created
            shard = index.shard_of(namespace, entry.item.id)
            if upsert is None:
                removals[shard].append((keys.member(namespace, entry.item.id), row.version))
                continue
            upserts[shard].append(upsert)
            if upsert.next_fire_ms is not None and (
                result.earliest_fire_ms is None or upsert.next_fire_ms < result.earliest_fire_ms
            ):
                result.earliest_fire_ms = upsert.next_fire_ms
        await store.put_schedules(conn, rows)
        await store.record_command(
            CommandAudit(
                namespace=namespace,
                verb="import",
                schedule_id=None,
                outcome="ok",
                body={"schedules": len(rows)},
                app_id=app_id,
            ),
            conn,
        )
    if upserts:
        await index.upsert(dict(upserts))
    if removals:
        await index.remove(dict(removals))
    result.imported += len(rows)


def refused_lines(result: ImportResult) -> list[str]:
    return [
        f"line {number}: " + "; ".join(f"{d['field']}: {d['reason']}" for d in details)
        for number, details in result.refused
    ]


def dumps_line(item: dict[str, Any]) -> bytes:
    return codec.dumps(item)
