"""Bulk import: many schedules through the same validation and placement as ``upsert``, written
with one COPY and one statement per batch to PostgreSQL, then pipelined into the index.

Each line is a schedule (the ``schedule`` object of an upsert). A line that is refused is
reported with its number and the reasons, and changes nothing; the other lines go on.

Validation is the costly part and needs no I/O, so batches are validated in worker processes
(one per core) while the importing process writes the batches before them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import time
import uuid
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import asyncpg
import pydantic

from shared.contract import keys, models, validation
from shared.contract.entries import Upsert, resting_occ_state
from shared.contract.errors import ValidationFailed
from shared.contract.rows import CommandAudit, NewScheduleRow, ScheduleRow
from shared.postgres.store import Store
from shared.redis.index import Index
from shared.rules import compact, rotation, schedule
from shared.runtime import transient

DEFAULT_BATCH = 5000
#: An import at least this large is followed by ANALYZE of the schedules table.
ANALYZE_AFTER = 10_000
T = TypeVar("T")
log = logging.getLogger(__name__)
FieldErrors = list[dict[str, str]]


@dataclass
class ImportResult:
    imported: int = 0
    created: int = 0
    #: (line number, field errors) of every refused line.
    refused: list[tuple[int, FieldErrors]] = field(default_factory=list)
    #: Earliest fire time written to the index (to wake dispatchers).
    earliest_fire_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Prepared:
    """A validated line, reduced to what writing it needs (cheap to pass between processes)."""

    line: int
    id: str
    #: The compact schedule at version 0 (the real version is stamped in when written).
    raw_plan: bytes
    definition: bytes
    priority: int
    labels: dict[str, str]
    paused: bool
    #: Where a new rotation would start, its fire time (jitter applied) and occ state.
    first_nominal: int | None
    first_fire: int | None
    first_occ: str


def _prepare_one(
    number: int, raw: bytes, now_ms: int, policy: validation.TargetPolicy, namespace: str
) -> Prepared | FieldErrors:
    try:
        item = models.Schedule.model_validate_json(raw)
        plan = validation.check_schedule(item, 0, now_ms, policy, namespace=namespace)
    except pydantic.ValidationError as exc:
        return validation.field_errors(exc)
    except ValidationFailed as failure:
        return failure.details
    nominal = rotation.fresh_start(plan, now_ms, keys.member(namespace, item.id))
    fire = (
        None
        if nominal is None
        else schedule.fire_at_ms(plan, keys.member(namespace, item.id), nominal)
    )
    occ = (
        ""
        if nominal is None or fire is None
        else resting_occ_state(nominal, fire, 0, plan.max_fires is not None)
    )
    return Prepared(
        number,
        item.id,
        compact.encode(plan),
        item.model_dump_json().encode(),
        item.priority,
        item.labels,
        item.paused,
        nominal,
        fire,
        occ,
    )


def prepare_batch(
    batch: list[tuple[int, bytes]], now_ms: int, policy: validation.TargetPolicy, namespace: str
) -> tuple[list[Prepared], list[tuple[int, FieldErrors]]]:
    """Validate a batch of lines (pure: runs in a worker process)."""
    prepared: list[Prepared] = []
    refused: list[tuple[int, FieldErrors]] = []
    for number, raw in batch:
        checked = _prepare_one(number, raw, now_ms, policy, namespace)
        if isinstance(checked, list):
            refused.append((number, checked))
        else:
            prepared.append(checked)
    return prepared, refused


def _numbered(lines: Iterable[bytes], size: int) -> Iterator[list[tuple[int, bytes]]]:
    batch: list[tuple[int, bytes]] = []
    for number, raw in enumerate(lines, start=1):
        if raw.strip():
            batch.append((number, raw))
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


async def import_lines(
    lines: Iterable[bytes],
    namespace: str,
    store: Store,
    index: Index,
    policy: validation.TargetPolicy,
    *,
    batch_size: int = DEFAULT_BATCH,
    app_id: str | None = "cronbus-import",
    workers: int | None = None,
    clock: Any = time.time,
) -> ImportResult:
    validation.check_namespace(namespace)
    result = ImportResult()
    workers = workers if workers is not None else (os.cpu_count() or 1)
    pool = concurrent.futures.ProcessPoolExecutor(workers) if workers > 1 else None
    try:
        async for prepared, refused, now in _validated(
            _numbered(lines, batch_size), pool, workers, policy, namespace, clock
        ):
            result.refused += refused
            latest = {p.id: p for p in prepared}  # a later line for the same id wins
            if latest:
                await _write_batch(
                    list(latest.values()), namespace, store, index, now, result, app_id
                )
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    if result.imported >= ANALYZE_AFTER:
        # Fresh statistics, so plans fit the table's new size at once: autovacuum may be off,
        # or come by only after the services have planned with the old ones.
        try:
            await _with_retries(store.analyze_schedules, "analyze")
        except _RETRYABLE as exc:
            # Every schedule is written by now: statistics that could not be gathered must
            # not report the import as failed (autovacuum gathers them later).
            log.warning(
                "ANALYZE after the import failed; the import itself is complete",
                extra={"action": "import_analyze_failed", "error": repr(exc)},
            )
    return result


async def _validated(
    batches: Iterator[list[tuple[int, bytes]]],
    pool: concurrent.futures.ProcessPoolExecutor | None,
    workers: int,
    policy: validation.TargetPolicy,
    namespace: str,
    clock: Any,
) -> AsyncIterator[tuple[list[Prepared], list[tuple[int, FieldErrors]], int]]:
    """Batches validated in order, up to ``workers + 1`` of them ahead of the writer."""
    loop = asyncio.get_running_loop()
    pending: deque[tuple[asyncio.Future[Any], int]] = deque()
    for batch in batches:
        now = int(clock() * 1000)
        if pool is None:
            prepared, refused = prepare_batch(batch, now, policy, namespace)
            yield prepared, refused, now
            continue
        pending.append(
            (loop.run_in_executor(pool, prepare_batch, batch, now, policy, namespace), now)
        )
        if len(pending) > workers:
            future, at = pending.popleft()
            prepared, refused = await future
            yield prepared, refused, at
    while pending:
        future, at = pending.popleft()
        prepared, refused = await future
        yield prepared, refused, at


def _placed(
    entry: Prepared, old: ScheduleRow | None, namespace: str, now: int
) -> tuple[NewScheduleRow, Upsert | None, bool]:
    """The row, the index write and whether it is new, for one valid line (as upsert does)."""
    live = old is not None and old.state != "deleted"
    version = (old.version if old is not None else 0) + 1
    raw_plan = compact.with_version(entry.raw_plan, version)
    if old is not None and live:
        # Replacing a schedule: the same placement rules as an upsert command.
        plan = compact.decode(raw_plan)
        current = rotation.Current(
            compact.decode(old.compact), old.state, old.fires, old.last_fire_ms, old.next_fire_ms
        )
        placement = rotation.place_upsert(
            current, plan, entry.paused, now, keys.member(namespace, entry.id)
        )
        upsert = rotation.index_write(namespace, entry.id, plan, raw_plan, placement)
    else:
        placement = _fresh_placement(entry)
        member = keys.member(namespace, entry.id)
        upsert = (
            None
            if placement.mode is None
            else Upsert(
                member, version, raw_plan, placement.mode, entry.first_fire, entry.first_occ
            )
        )
    row = NewScheduleRow(
        namespace,
        entry.id,
        version,
        placement.state,
        entry.definition,
        raw_plan,
        entry.priority,
        entry.labels,
        placement.fires,
        placement.last_fire_ms,
        placement.next_nominal,
        placement.rotation_version(version),
    )
    return row, upsert, not live


def _fresh_placement(entry: Prepared) -> rotation.Placement:
    if entry.paused:
        return rotation.Placement("paused", "park", None, 0, None, new_rotation=True)
    if entry.first_nominal is None:
        return rotation.Placement("completed", None, None, 0, None, new_rotation=True)
    return rotation.Placement("active", "reset", entry.first_nominal, 0, None, new_rotation=True)


class CreatedMeanwhile(Exception):
    """A schedule of the batch was created by another transaction while the batch was placed."""


#: Attempts at each write of a batch: a statement cancelled by its timeout while PostgreSQL
#: checkpoints, or a moment without a connection, must not end an import hours long.
WRITE_ATTEMPTS = 6
_RETRYABLE: tuple[type[BaseException], ...] = (
    *transient.ERRORS,
    asyncpg.QueryCanceledError,
    asyncpg.DeadlockDetectedError,
    asyncpg.SerializationError,
    CreatedMeanwhile,
)


async def _with_retries(operation: Callable[[], Awaitable[T]], what: str) -> T:
    """``operation``, again after a growing pause while it fails for a passing reason."""
    attempt = 1
    while True:
        try:
            return await operation()
        except _RETRYABLE as exc:
            if attempt >= WRITE_ATTEMPTS:
                raise
            log.warning(
                "import write failed; trying again",
                extra={"action": "import_retry", "operation": what, "error": repr(exc)},
            )
            await asyncio.sleep(0.5 * 2 ** (attempt - 1))
            attempt += 1


@dataclass
class _Written:
    """What one batch's transaction wrote, counted only once it committed."""

    rows: int = 0
    created: int = 0
    earliest_fire_ms: int | None = None
    upserts: dict[int, list[Upsert]] = field(default_factory=lambda: defaultdict(list))
    removals: dict[int, list[tuple[str, int | None]]] = field(
        default_factory=lambda: defaultdict(list)
    )


async def _write_batch(
    batch: list[Prepared],
    namespace: str,
    store: Store,
    index: Index,
    now: int,
    result: ImportResult,
    app_id: str | None,
) -> None:
    # The transaction is tried again as a whole (it rolled back); the index writes after it,
    # each its own retry, are fenced by version, so writing one twice changes nothing.
    # A connection lost during COMMIT leaves it unknown whether the transaction committed: the
    # batch's audit row, under a message id of its own, tells. Tried again after it committed,
    # the batch would bump every version once more and count what it created as replaced.
    token = f"cronbus-import-{uuid.uuid4()}"
    tries: list[_Written] = []
    written = await _with_retries(
        lambda: _write_rows(batch, namespace, store, index, now, app_id, token, tries),
        "schedules",
    )
    if written.upserts:
        await _with_retries(lambda: index.upsert(dict(written.upserts)), "index upserts")
    if written.removals:
        await _with_retries(lambda: index.remove(dict(written.removals)), "index removals")
    result.imported += written.rows
    result.created += written.created
    if written.earliest_fire_ms is not None and (
        result.earliest_fire_ms is None or written.earliest_fire_ms < result.earliest_fire_ms
    ):
        result.earliest_fire_ms = written.earliest_fire_ms


async def _write_rows(
    batch: list[Prepared],
    namespace: str,
    store: Store,
    index: Index,
    now: int,
    app_id: str | None,
    token: str,
    tries: list[_Written],
) -> _Written:
    written = _Written()
    rows: list[NewScheduleRow] = []
    async with store.transaction() as conn:
        existing = await store.lock_schedules(conn, namespace, [p.id for p in batch])
        # Asked with the rows locked: a previous try still committing on the server (its
        # client gone) holds them until it ends, so its audit row is visible by now if it did.
        if tries and await store.command_recorded(token, conn):
            return tries[-1]
        for entry in batch:
            row, upsert, created = _placed(entry, existing.get(entry.id), namespace, now)
            rows.append(row)
            written.created += created
            shard = index.shard_of(namespace, entry.id)
            if upsert is None:
                written.removals[shard].append((keys.member(namespace, entry.id), row.version))
                continue
            written.upserts[shard].append(upsert)
            if upsert.next_fire_ms is not None and (
                written.earliest_fire_ms is None or upsert.next_fire_ms < written.earliest_fire_ms
            ):
                written.earliest_fire_ms = upsert.next_fire_ms
        if await store.put_schedules(conn, rows, fenced=True) < len(rows):
            # A command created one of them after lock_schedules looked: written over at the
            # version computed without it, both writes would share a version (the index keeps
            # either, and drift repair, comparing versions, never sees it). Rolled back, the
            # batch is placed again over what is there now.
            raise CreatedMeanwhile(namespace)
        await store.record_command(
            CommandAudit(
                namespace=namespace,
                verb="import",
                schedule_id=None,
                outcome="ok",
                body={"schedules": len(rows)},
                app_id=app_id,
                message_id=token,
            ),
            conn,
        )
        written.rows = len(rows)
        # Kept before COMMIT: what the batch wrote if COMMIT succeeds but its reply is lost.
        tries.append(written)
    return written


def refused_lines(result: ImportResult) -> list[str]:
    return [
        f"line {number}: " + "; ".join(f"{d['field']}: {d['reason']}" for d in details)
        for number, details in result.refused
    ]
