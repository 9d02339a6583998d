"""The verbs that only read: ``get`` and ``list`` (with its cursors).

Reads change nothing, so they need no replay check; they are audited all the same. Gets ready
together are read, and audited, in one round trip to PostgreSQL. A schedule is shown as stored,
with its stats, and for ``get`` also its rate key's breaker and its running backfill.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Callable, Sequence
from typing import Any

from services.dispatcher import batch
from services.dispatcher.views import view
from shared.contract import commands, keys, models
from shared.contract.errors import ValidationFailed
from shared.contract.rows import CommandAudit, ScheduleRow
from shared.policy import limits, stats
from shared.postgres.store import Store
from shared.redis.batcher import GroupCommit
from shared.redis.index import Index
from shared.rules import compact
from shared.runtime import transient
from shared.runtime.config import DispatcherSettings


def encode_cursor(last_id: str) -> str:
    return base64.urlsafe_b64encode(last_id.encode()).decode()


def decode_cursor(cursor: str | None) -> str:
    if not cursor:
        return ""
    try:
        last_id = base64.urlsafe_b64decode(cursor.encode()).decode()
        return models.check_schedule_id(last_id)
    except (binascii.Error, ValueError):
        raise ValidationFailed(
            "invalid_command",
            "cursor: is not a cursor this cronbus returned",
            [{"field": "cursor", "reason": "is not a cursor this cronbus returned"}],
        ) from None


class Reads:
    """``get`` and ``list`` against PostgreSQL, with the live state Redis keeps."""

    def __init__(
        self,
        settings: DispatcherSettings,
        store: Store,
        index: Index,
        stopping: asyncio.Event,
        now_ms: Callable[[], int],
    ) -> None:
        self.store = store
        self.index = index
        self.stopping = stopping
        self.now_ms = now_ms
        #: Gets ready together are read (and audited) in one round trip.
        self.reader: GroupCommit[tuple[str, str, CommandAudit], ScheduleRow | None] = GroupCommit(
            self._read_schedules,
            max_items=settings.commands_batch,
            workers=settings.commands_commit_workers,
            name="get-batch",
        )

    async def get(self, namespace: str, schedule_id: str, audit: CommandAudit) -> dict[str, Any]:
        """One schedule as stored, with its stats, its rate key's breaker and its backfill."""
        row = await self.reader.submit((namespace, schedule_id, audit))
        if row is None or row.state == "deleted":
            raise batch.not_found(namespace, schedule_id)
        [shown] = await self._with_stats(namespace, [view(row, self.now_ms())])
        key = limits.rate_key(namespace, compact.decode(row.compact).target)
        fails, open_until, _, hold_until = await self.index.breaker_state(key)
        now = self.now_ms()
        shown["breaker"] = limits.breaker_view(key, fails, open_until, hold_until, now)
        remaining, indexed = await self.index.backfill_remaining_and_epoch(
            self.index.shard_of(namespace, schedule_id), keys.member(namespace, schedule_id)
        )
        if remaining is None and not indexed:
            # Redis lost its data and the rebuild has not put the backfill back yet: what
            # PostgreSQL keeps is where it will resume. (With the index present, Redis is
            # current: PostgreSQL learns of each completion a batch later.)
            remaining = row.backfill_remaining
        if remaining is not None:
            shown["backfill"] = {"remaining": remaining}
        return {"ok": True, "schedule": shown}

    async def _read_schedules(
        self, asked: Sequence[tuple[str, str, CommandAudit]]
    ) -> list[ScheduleRow | None]:
        members = [(namespace, schedule_id) for namespace, schedule_id, _ in asked]
        found = await transient.retry(
            lambda: self.store.get_schedules_and_audit(members, [a for _, _, a in asked]),
            what="get",
            stopping=self.stopping,
        )
        return [found.get(member) for member in members]

    async def _with_stats(
        self, namespace: str, shown: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """Views with their ``stats`` and ``paused_reason`` (one query for all of them)."""
        records = await self.store.schedule_stats(namespace, [item["id"] for item in shown])
        return [stats.decorate(item, records.get(item["id"])) for item in shown]

    # Last in the class: below it, ``list`` would name this method rather than the type.
    async def list(self, namespace: str, command: commands.ListCommand) -> dict[str, Any]:
        rows = await self.store.list_schedules(
            namespace,
            state=command.state,
            labels=command.labels,
            after_id=decode_cursor(command.cursor),
            limit=command.limit,
        )
        now = self.now_ms()
        next_cursor = encode_cursor(rows[-1].id) if len(rows) == command.limit else None
        return {
            "ok": True,
            "schedules": await self._with_stats(namespace, [view(row, now) for row in rows]),
            "next_cursor": next_cursor,
        }
