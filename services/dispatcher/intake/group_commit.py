"""The group commit: upserts, deletes, pauses and resumes ready together, in one transaction.

Under load, one PostgreSQL transaction (locks, one COPY, one audit statement) and one index call
per shard serve many commands; under light load a command is committed at once, alone. Each
command is still applied exactly as it would be alone (``batch``, the pure part): its replay
check, its ``expected_version``, its namespace's ``max_schedules`` and its reply are its own,
and a batch that fails for a reason other than an outage is applied again one command at a time,
so that one bad command fails only itself. An upsert_many is one such batch of its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from services.dispatcher import batch
from services.dispatcher.fence import Fence
from services.dispatcher.intake.answers import error_of
from services.dispatcher.intake.index_writes import IndexWrites
from services.dispatcher.intake.receiving import Received
from services.dispatcher.intake.replays import AlreadyApplied
from shared.contract import commands, keys
from shared.contract.entries import Upsert
from shared.contract.errors import ValidationFailed
from shared.contract.rows import CommandAudit, PendingRun, ScheduleRow
from shared.postgres import positions
from shared.postgres.store import Store
from shared.redis.batcher import GroupCommit
from shared.runtime import metrics, quotas, transient
from shared.runtime.config import DispatcherSettings

# The package's logger: the intake's log lines keep one logger name whatever module writes them.
log = logging.getLogger("services.dispatcher.intake")

#: Verbs that go through group commit besides upsert.
CHANGE_VERBS: dict[str, Literal["delete", "pause", "resume"]] = {
    "delete": "delete",
    "pause": "pause",
    "resume": "resume",
}


class Committer:
    """Commands that change schedules, committed in groups, then written to the index."""

    def __init__(
        self,
        settings: DispatcherSettings,
        store: Store,
        writes: IndexWrites,
        stopping: asyncio.Event,
        now_ms: Callable[[], int],
        fence: Fence | None = None,
    ) -> None:
        self.settings = settings
        #: This dispatcher's claim fence, told of each position answered (None: no claim loop).
        self.fence = fence
        self.store = store
        self.writes = writes
        self.index = writes.index
        self.stopping = stopping
        self.now_ms = now_ms
        self.quotas = quotas.QuotaFile(settings.quotas_file)
        self.group: GroupCommit[batch.Item, dict[str, Any] | Exception] = GroupCommit(
            self.commit_upserts,
            max_items=settings.commands_batch,
            workers=settings.commands_commit_workers,
            name="upsert-commit",
        )

    async def upsert(
        self,
        namespace: str,
        command: commands.UpsertCommand,
        received: Received,
        audit: CommandAudit,
    ) -> dict[str, Any]:
        """With the upserts ready at the same time, replay check included."""
        assert received.plan is not None
        item = batch.UpsertItem(
            namespace,
            command.schedule,
            received.plan,
            command.expected_version,
            audit,
            received.meta.message_id,
            received.parsed,
        )
        result = await self.group.submit(item)
        if isinstance(result, Exception):
            raise result
        return result

    async def change(
        self,
        namespace: str,
        schedule_id: str,
        verb: Literal["delete", "pause", "resume"],
        received: Received,
        audit: CommandAudit,
    ) -> dict[str, Any]:
        """A delete, pause or resume, with the commands ready at the same time."""
        change = batch.ChangeItem(
            namespace,
            schedule_id,
            verb,
            audit,
            received.meta.message_id,
            received.parsed,
        )
        changed = await self.group.submit(change)
        if isinstance(changed, Exception):
            raise changed
        return changed

    async def upsert_many(
        self,
        items: list[batch.UpsertItem | ValidationFailed],
        ids: list[str | None],
        audit: CommandAudit,
    ) -> dict[str, Any]:
        """Each schedule applied or refused on its own, as a single upsert; one transaction."""
        valid = [item for item in items if isinstance(item, batch.UpsertItem)]
        results: list[dict[str, Any]] = []

        def answered(effect: batch.BatchEffect) -> list[CommandAudit]:
            outcomes = iter(effect.results)
            for item, schedule_id in zip(items, ids, strict=True):
                outcome = item if isinstance(item, ValidationFailed) else next(outcomes)
                results.append(_item_result(schedule_id, outcome))
            own = dataclasses.replace(audit, reply={"ok": True, "results": results})
            return [own, *_item_audits(audit, results)]

        message_id = audit.message_id
        own = (audit.namespace or "", message_id) if message_id else None
        try:
            await self.apply_batch(valid, answered, own)
        except AlreadyApplied as done:
            if done.applied.verb != "upsert_many" or done.applied.body != audit.body:
                raise batch.message_id_conflict(
                    audit.namespace or "", message_id or "", done.applied.verb
                ) from None
            return {**done.applied.reply, "duplicate": True}
        return {"ok": True, "results": results}

    async def commit_upserts(self, items: Sequence[batch.Item]) -> list[dict[str, Any] | Exception]:
        """One transaction for the upserts ready together. Should it fail for a reason other
        than an outage, each is applied alone, so that one bad command fails only itself."""
        try:
            effect = await transient.retry(
                lambda: self.apply_batch(list(items)), what="commands", stopping=self.stopping
            )
        except transient.Stopped:
            raise
        except Exception as exc:  # noqa: BLE001 - isolated below: each command fails alone
            if len(items) == 1:
                return [exc]
            log.warning(
                "a batch of commands failed; applying them one at a time",
                extra={"action": "command_batch_split", "commands": len(items)},
            )
            results: list[dict[str, Any] | Exception] = []
            for item in items:
                results += await self.commit_upserts([item])
            return results
        return list(effect.results)

    async def apply_batch(
        self,
        items: Sequence[batch.Item],
        more_audits: Callable[[batch.BatchEffect], list[CommandAudit]] | None = None,
        own: tuple[str, str] | None = None,
    ) -> batch.BatchEffect:
        """Upserts in one PostgreSQL transaction (locks, one COPY, one audit statement), then
        one index call per shard. ``more_audits`` adds rows that need the outcome. ``own`` is
        the (namespace, message_id) of the command the batch is (an upsert_many): applied
        already, nothing is written and ``AlreadyApplied`` says with what."""
        metrics.COMMAND_BATCH.observe(len(items))
        now = self.now_ms()
        members = sorted({(item.namespace, batch.schedule_id_of(item)) for item in items})
        async with self.store.transaction() as conn:
            txn_now, stored = await self.store.lock_schedule_keys(conn, members)
            message_ids = [(i.namespace, i.message_id) for i in items if i.message_id]
            message_ids += [own] if own is not None else []
            # Another batch may carry the same message_id for another schedule.
            await self.store.lock_message_ids(conn, message_ids)
            applied = await self.store.applied_commands(conn, message_ids)
            if own is not None and own in applied:
                # A copy committed by another dispatcher since the check before the batch.
                raise AlreadyApplied(applied[own])
            refused = await self._over_quota(conn, items, stored)
            kept = [item for i, item in enumerate(items) if i not in refused]
            effect = batch.apply_upserts(kept, stored, now, txn_now, applied)
            effect.results = _with_refusals(effect.results, refused, len(items))
            created = [
                key
                for key, row in effect.rows.items()
                if row.state != "deleted"
                and (stored.get(key) is None or stored[key].state == "deleted")
            ]
            await self.store.reset_stats_many(conn, created)
            audits = effect.audits + (more_audits(effect) if more_audits else [])
            await self.store.put_schedules_and_audit(conn, list(effect.rows.values()), audits)
            taken = await positions.take(
                conn, [(ns, i, self.index.shard_of(ns, i)) for ns, i in effect.rows]
            )
            # A command applied already (a redelivery after a crash) is answered ok again,
            # though the first delivery may have died before its index writes: its schedules'
            # positions are answered too, so the shard is fenced until it is replayed.
            earlier = await positions.of_schedules(
                conn, [key for key in members if key not in effect.rows]
            )
            dropped: list[PendingRun] = []
            for (namespace, schedule_id), row in effect.rows.items():
                if row.state == "deleted":
                    dropped += await self.store.drop_pending_runs(conn, namespace, schedule_id)
                if row.state in ("deleted", "completed"):
                    # Its index entry is removed, backfill included (remove.lua): a row kept
                    # here would never be restored nor removed by a completion.
                    await self.store.drop_backfill(conn, namespace, schedule_id)
        written = await self._index_batch(effect, dropped)
        await self.answer_positions(taken, written, earlier)
        return effect

    async def answer_positions(
        self, taken: dict[int, int], written: bool, earlier: Mapping[int, int]
    ) -> None:
        """The writes of these positions are in Redis (a group commit's, a trigger's, a
        backfill's): they are recorded there (after the writes: a replica that has them has
        the writes), then in PostgreSQL as answered, and only then are the commands answered.
        Answered they are even when Redis refused the writes or the note: the reply says ok
        (PostgreSQL has the change), so the shard, behind its answered position, is fenced
        until the sweeper has replayed it; otherwise a deleted or paused schedule would fire
        from the index that refused its removal, and a trigger would never fire.
        ``earlier``: positions of changes made by earlier deliveries of commands answered
        again, answered (not noted: this intake did not write them)."""
        answered = positions.highest(taken, earlier)
        if not answered:
            return
        settings = self.settings
        if written and taken:
            await self.writes.write(
                lambda: self.index.advance(
                    taken,
                    "note",
                    wait_replicas=settings.redis_wait_replicas,
                    wait_timeout_ms=settings.redis_wait_timeout_ms,
                )
            )
        try:
            await transient.retry(
                lambda: positions.mark_answered(self.store.pool, answered),
                what="answered positions",
                stopping=self.stopping,
            )
        except transient.Stopped:
            return
        if self.fence is not None:
            self.fence.raise_to(answered)

    async def _over_quota(
        self,
        conn: Any,
        items: Sequence[batch.Item],
        stored: dict[tuple[str, str], ScheduleRow],
    ) -> dict[int, ValidationFailed]:
        """Upserts that would create a schedule in a namespace already at its max_schedules
        (counted under the namespace's creation lock, so racing creations cannot both pass)."""
        refused: dict[int, ValidationFailed] = {}
        room: dict[str, int] = {}
        #: New schedules already given a place: naming one again in the batch is an update.
        placed: set[tuple[str, str]] = set()
        for i, item in enumerate(items):
            if not isinstance(item, batch.UpsertItem):
                continue
            key = (item.namespace, item.schedule.id)
            old = stored.get(key)
            if (old is not None and old.state != "deleted") or key in placed:
                continue
            if item.expected_version not in (None, 0):
                continue  # refused for its version (nothing stored to match): creates nothing
            quota = self.quotas.of(item.namespace)
            if quota is None or quota.max_schedules is None:
                continue
            if item.namespace not in room:
                live = await self.store.count_live_schedules(conn, item.namespace)
                room[item.namespace] = quota.max_schedules - live
            if room[item.namespace] <= 0:
                reason = (
                    f"namespace {item.namespace!r} is at its max_schedules ({quota.max_schedules})"
                )
                refused[i] = ValidationFailed(
                    "quota_exceeded",
                    f"quota exceeded: {reason}",
                    [{"field": "id", "reason": f"a new schedule is over the quota: {reason}"}],
                )
            else:
                room[item.namespace] -= 1
                placed.add(key)
        return refused

    async def _index_batch(
        self, effect: batch.BatchEffect, dropped: Sequence[PendingRun] = ()
    ) -> bool:
        """The batch's index writes, one call per shard, and one wake-up for the soonest;
        whether they were all made."""
        upserts: dict[int, list[Upsert]] = {}
        removals: dict[int, list[tuple[str, int | None]]] = {}
        # A deleted schedule's pending triggers go too, even one already handed to the
        # broker: fenced out.
        for run in dropped:
            if run.kind == "trigger":
                member = keys.trigger_member(run.namespace, run.id, run.nominal_ms)
                removals.setdefault(self.index.shard_of(run.namespace, run.id), []).append(
                    (member, None)
                )
        earliest: dict[int, int] = {}
        for (namespace, schedule_id), (write, version) in effect.index_writes.items():
            shard = self.index.shard_of(namespace, schedule_id)
            if write is None:
                member = keys.member(namespace, schedule_id)
                removals.setdefault(shard, []).append((member, version))
                continue
            upserts.setdefault(shard, []).append(write)
            if write.next_fire_ms is not None:
                earliest[shard] = min(earliest.get(shard, write.next_fire_ms), write.next_fire_ms)
        made = True
        if upserts:
            made = await self.writes.write(lambda: self.index.upsert(upserts))
        if removals:
            made = await self.writes.write(lambda: self.index.remove(removals)) and made
        soonest = min(earliest.items(), key=lambda item: item[1], default=None)
        if soonest is not None and soonest[1] < self.now_ms() + self.settings.max_sleep_s * 1000:
            # Later fires are found by the dispatchers' own next look: no wake-up needed.
            await self.writes.wake(*soonest)
        return made


def _item_result(
    schedule_id: str | None, outcome: dict[str, Any] | ValidationFailed
) -> dict[str, Any]:
    """One entry of an upsert_many reply."""
    if isinstance(outcome, ValidationFailed):
        return {"id": schedule_id, "ok": False, "error": error_of(outcome)}
    schedule = outcome["schedule"]
    result = {"id": schedule["id"], "ok": True, "version": schedule["version"]}
    # Extensions of a single upsert's reply, passed on per item.
    result.update({k: outcome[k] for k in ("unchanged", "warnings") if k in outcome})
    return result


def _item_audits(audit: CommandAudit, results: list[dict[str, Any]]) -> list[CommandAudit]:
    """A row per schedule the command named, so that each schedule's audit shows it. They
    carry no message_id (the command's own row answers replays) nor body (it is there too)."""
    return [
        dataclasses.replace(
            audit,
            schedule_id=result["id"],
            outcome="ok" if result["ok"] else result["error"]["code"],
            body=None,
            error=None if result["ok"] else result["error"],
            version=result.get("version"),
            message_id=None,
            reply=None,
        )
        for result in results
        if isinstance(result.get("id"), str)
    ]


def _with_refusals(
    results: list[Any], refused: dict[int, ValidationFailed], count: int
) -> list[Any]:
    """The batch's results back in item order, the items refused before it in their place."""
    kept = iter(results)
    return [refused[i] if i in refused else next(kept) for i in range(count)]
