"""max_schedules across concurrent batches, and per-schedule
order when a command on several schedules waits for one of them."""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
import time
from typing import Any

import redis.exceptions
from aio_pika.abc import AbstractRobustConnection

from services.dispatcher import batch
from services.dispatcher.intake import Intake, Meta, Received
from shared.contract import codec, validation
from shared.contract.rows import CommandAudit
from shared.postgres import positions
from shared.postgres.store import Store
from shared.redis.index import Index
from shared.runtime.config import DispatcherSettings
from tests.conftest import SHARDS
from tests.integration.conftest import no_wake


def every(schedule_id: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "id": schedule_id,
        "spec": {"kind": "interval", "every_s": 60},
        "target": {"kind": "webhook", "url": "https://example.com/x"},
        "labels": labels or {},
    }


def upsert_item(namespace: str, raw: dict[str, Any]) -> batch.UpsertItem:
    schedule = validation.parse_schedule(raw)
    plan = validation.check_schedule(
        schedule, 0, int(time.time() * 1000), validation.TargetPolicy(), namespace=namespace
    )
    audit = CommandAudit(namespace, "upsert", raw["id"], "ok")
    return batch.UpsertItem(namespace, schedule, plan, audit=audit)


class SlowCountStore(Store):
    """The same PostgreSQL; the quota count is followed by a pause (a slow batch holding the
    namespace's creation lock), so that another dispatcher's batch queues behind it."""

    async def count_live_schedules(self, conn: Any, namespace: str) -> int:
        live = await super().count_live_schedules(conn, namespace)
        await asyncio.sleep(0.5)
        return live


async def test_max_schedules_holds_for_two_dispatchers_creating_at_once(
    database_url: str,
    store: Store,
    index: Index,
    connection: AbstractRobustConnection,
    redis_prefix: str,
    tmp_path: pathlib.Path,
) -> None:
    quotas = tmp_path / "quotas.json"
    quotas.write_bytes(codec.dumps({"q": {"max_schedules": 1}}))
    settings = DispatcherSettings(redis_prefix=redis_prefix, shards=SHARDS, quotas_file=str(quotas))
    slow_store = await SlowCountStore.open(database_url)
    try:
        channel = await connection.channel()
        first = Intake(settings, slow_store, index, channel, no_wake, asyncio.Event())
        second = Intake(settings, store, index, channel, no_wake, asyncio.Event())
        one = asyncio.create_task(first.apply_batch([upsert_item("q", every("a"))]))
        await asyncio.sleep(0.2)  # the first holds the creation lock, not yet committed
        other = asyncio.create_task(second.apply_batch([upsert_item("q", every("b"))]))
        effects = await asyncio.gather(one, other)
    finally:
        await slow_store.close()
    outcomes = [
        r.code if isinstance(r := effect.results[0], Exception) else "ok" for effect in effects
    ]
    live = [s for s in ("a", "b") if await store.get_schedule("q", s) is not None]
    assert len(live) == 1, f"max_schedules 1, yet {live} were created: {outcomes}"


async def test_a_command_on_two_schedules_keeps_its_place_on_the_one_it_does_not_wait_for(
    store: Store, index: Index, connection: AbstractRobustConnection, redis_prefix: str
) -> None:
    channel = await connection.channel()
    settings = DispatcherSettings(redis_prefix=redis_prefix, shards=SHARDS)
    intake = Intake(settings, store, index, channel, no_wake, asyncio.Event())

    def command(verb: str, body: dict[str, Any]) -> Received:
        return Received(codec.dumps(body), Meta(routing_key=f"o.{verb}"))

    # An earlier command on "a" is still being applied (it holds a's lock).
    release = asyncio.Event()
    holding = asyncio.Event()

    async def earlier_on_a() -> None:
        async with intake.order.turn("o", ["a"]):
            holding.set()
            await release.wait()

    earlier = asyncio.create_task(earlier_on_a())
    await holding.wait()
    # Then, in this order: an upsert_many of a and b, and an upsert of b alone.
    many = asyncio.create_task(
        intake._apply(
            command("upsert_many", {"schedules": [every("a"), every("b", {"by": "first"})]})
        )
    )
    await asyncio.sleep(0)
    single = asyncio.create_task(
        intake._apply(command("upsert", {"schedule": every("b", {"by": "second"})}))
    )
    await asyncio.sleep(0.5)
    release.set()
    await asyncio.gather(earlier, many, single)
    row = await store.get_schedule("o", "b")
    assert row is not None
    assert row.labels == {"by": "second"}, (
        "the upsert of b that arrived last was applied first and then overwritten"
    )


async def test_a_batch_whose_index_write_fails_after_the_commit_is_not_applied_twice(
    store: Store, index: Index, connection: AbstractRobustConnection, redis_prefix: str
) -> None:
    channel = await connection.channel()
    settings = DispatcherSettings(redis_prefix=redis_prefix, shards=SHARDS)
    intake = Intake(settings, store, index, channel, no_wake, asyncio.Event())
    real_upsert = index.upsert
    failures = [redis.exceptions.ResponseError("OOM command not allowed")]

    async def upsert_once_refused(*args: Any, **kwargs: Any) -> Any:
        if failures:
            raise failures.pop()
        return await real_upsert(*args, **kwargs)

    index.upsert = upsert_once_refused  # type: ignore[method-assign]
    # Two upserts ready together: one group commit; Redis refuses its index write once.
    results = await intake.commits.commit_upserts(
        [upsert_item("d", every("a")), upsert_item("d", every("b"))]
    )
    versions = {s: row.version for s in ("a", "b") if (row := await store.get_schedule("d", s))}
    assert versions == {"a": 1, "b": 1}, (
        f"each upsert was applied once, yet PostgreSQL holds versions {versions}; "
        f"replies {[r if isinstance(r, Exception) else r['schedule']['version'] for r in results]}"
    )


async def test_one_new_schedule_twice_in_a_batch_counts_once_against_max_schedules(
    store: Store,
    index: Index,
    connection: AbstractRobustConnection,
    redis_prefix: str,
    tmp_path: pathlib.Path,
) -> None:
    quotas = tmp_path / "quotas.json"
    quotas.write_bytes(codec.dumps({"u": {"max_schedules": 1}}))
    settings = DispatcherSettings(redis_prefix=redis_prefix, shards=SHARDS, quotas_file=str(quotas))
    intake = Intake(settings, store, index, await connection.channel(), no_wake, asyncio.Event())
    # As an upsert_many with the id twice sends it: the second is an update of the first.
    effect = await intake.apply_batch(
        [upsert_item("u", every("a")), upsert_item("u", every("a", {"v": "2"}))]
    )
    outcomes = [
        r.code if isinstance(r, Exception) else r["schedule"]["version"] for r in effect.results
    ]
    assert outcomes == [1, 2]


class SlowReplayStore(Store):
    """The same PostgreSQL; a pause after the replay check (a slow batch, not yet committed)."""

    async def applied_commands(self, conn: Any, members: Any) -> Any:
        found = await super().applied_commands(conn, members)
        await asyncio.sleep(0.5)
        return found


async def test_one_message_id_on_two_commands_in_concurrent_batches_applies_only_one(
    database_url: str,
    store: Store,
    index: Index,
    connection: AbstractRobustConnection,
    redis_prefix: str,
) -> None:
    settings = DispatcherSettings(redis_prefix=redis_prefix, shards=SHARDS)
    slow_store = await SlowReplayStore.open(database_url)

    def command(schedule_id: str) -> batch.UpsertItem:
        raw = every(schedule_id)
        item = upsert_item("m", raw)
        body = {"schedule": raw}
        assert item.audit is not None
        audit = dataclasses.replace(item.audit, message_id="same-id", body=body)
        return dataclasses.replace(item, message_id="same-id", body=body, audit=audit)

    try:
        channel = await connection.channel()
        first = Intake(settings, slow_store, index, channel, no_wake, asyncio.Event())
        second = Intake(settings, store, index, channel, no_wake, asyncio.Event())
        # Two commit workers (or two dispatchers): batches on different schedules overlap.
        one = asyncio.create_task(first.apply_batch([command("a")]))
        await asyncio.sleep(0.2)
        other = asyncio.create_task(second.apply_batch([command("b")]))
        effects = await asyncio.gather(one, other)
    finally:
        await slow_store.close()
    outcomes = [r.code if isinstance(r := e.results[0], Exception) else "ok" for e in effects]
    assert sorted(outcomes) == ["conflict", "ok"], (
        f"message_id 'same-id' was used by two different commands, answered {outcomes}"
    )


class SlowAuditStore(Store):
    """The same PostgreSQL; a pause before a command's audit row is written in its transaction
    (a trigger committing slowly)."""

    async def record_command(self, audit: CommandAudit, conn: Any = None) -> None:
        if conn is not None:
            await asyncio.sleep(0.5)
        await super().record_command(audit, conn)


async def test_a_trigger_redelivered_to_another_dispatcher_mid_commit_runs_once(
    database_url: str,
    store: Store,
    index: Index,
    connection: AbstractRobustConnection,
    redis_prefix: str,
) -> None:
    settings = DispatcherSettings(redis_prefix=redis_prefix, shards=SHARDS)
    slow_store = await SlowAuditStore.open(database_url)
    try:
        channel = await connection.channel()
        first = Intake(settings, slow_store, index, channel, no_wake, asyncio.Event())
        second = Intake(settings, store, index, channel, no_wake, asyncio.Event())
        await second.apply_batch([upsert_item("t", every("a"))])

        def trigger() -> Received:
            meta = Meta(routing_key="t.trigger", message_id="trigger-1")
            return Received(codec.dumps({"id": "a"}), meta)

        # The first dispatcher's connection drops mid-command: the broker redelivers the same
        # message to the second while the first is still committing it.
        one = asyncio.create_task(first._apply(trigger()))
        await asyncio.sleep(0.2)
        other = asyncio.create_task(second._apply(trigger()))
        replies = await asyncio.gather(one, other)
    finally:
        await slow_store.close()
    pending = await store.pool.fetchval(
        "SELECT count(*) FROM pending_runs WHERE namespace = 't' AND id = 'a'"
    )
    keys = [reply["trigger"]["idempotency_key"] for reply in replies if reply and reply["ok"]]
    assert pending == 1, f"one trigger command, {pending} runs pending (keys {keys})"


async def test_a_delete_between_a_triggers_commit_and_its_index_write_leaves_nothing_to_fire(
    store: Store, index: Index, connection: AbstractRobustConnection, redis_prefix: str
) -> None:
    settings = DispatcherSettings(redis_prefix=redis_prefix, shards=SHARDS)
    channel = await connection.channel()
    first = Intake(settings, store, index, channel, no_wake, asyncio.Event())
    second = Intake(settings, store, index, channel, no_wake, asyncio.Event())
    await second.apply_batch([upsert_item("r", every("a"))])
    real_index = first.writes.place

    async def slow_index(*args: Any) -> None:
        await asyncio.sleep(0.5)  # the trigger is committed; its index writes come late
        await real_index(*args)

    first.writes.place = slow_index  # type: ignore[method-assign,assignment]
    trigger = asyncio.create_task(first.trigger("r", "a", CommandAudit("r", "trigger", "a", "ok")))
    await asyncio.sleep(0.2)
    delete = CommandAudit("r", "delete", "a", "ok")
    await second.apply_batch([batch.ChangeItem("r", "a", "delete", delete)])
    reply = await trigger
    fire_ms = reply["trigger"]["fire_time"]
    claimed = [
        c
        for result in await index.claim(range(index.shards), 100, 30_000, now_ms=2_000_000_000_000)
        for c in result.claimed
    ]
    assert claimed == [], f"schedule deleted, yet the index hands out {claimed} (trigger {fire_ms})"


async def test_an_upsert_refused_for_its_version_takes_no_place_under_max_schedules(
    store: Store,
    index: Index,
    connection: AbstractRobustConnection,
    redis_prefix: str,
    tmp_path: pathlib.Path,
) -> None:
    quotas = tmp_path / "quotas.json"
    quotas.write_bytes(codec.dumps({"v": {"max_schedules": 1}}))
    settings = DispatcherSettings(redis_prefix=redis_prefix, shards=SHARDS, quotas_file=str(quotas))
    intake = Intake(settings, store, index, await connection.channel(), no_wake, asyncio.Event())
    stale = dataclasses.replace(upsert_item("v", every("x")), expected_version=3)
    # Ready together: one batch. The stale upsert refuses itself only.
    effect = await intake.apply_batch([stale, upsert_item("v", every("y"))])
    outcomes = [r.code if isinstance(r, Exception) else "ok" for r in effect.results]
    assert outcomes == ["version_conflict", "ok"]


async def test_an_upsert_many_redelivered_to_another_dispatcher_mid_commit_applies_once(
    database_url: str,
    store: Store,
    index: Index,
    connection: AbstractRobustConnection,
    redis_prefix: str,
) -> None:
    settings = DispatcherSettings(redis_prefix=redis_prefix, shards=SHARDS)
    slow_store = await SlowReplayStore.open(database_url)
    try:
        channel = await connection.channel()
        first = Intake(settings, slow_store, index, channel, no_wake, asyncio.Event())
        second = Intake(settings, store, index, channel, no_wake, asyncio.Event())

        def many() -> Received:
            meta = Meta(routing_key="w.upsert_many", message_id="many-1")
            return Received(codec.dumps({"schedules": [every("a"), every("b")]}), meta)

        one = asyncio.create_task(first._apply(many()))
        await asyncio.sleep(0.2)
        other = asyncio.create_task(second._apply(many()))
        replies = await asyncio.gather(one, other)
    finally:
        await slow_store.close()
    versions = {s: row.version for s in ("a", "b") if (row := await store.get_schedule("w", s))}
    assert versions == {"a": 1, "b": 1}, f"one command, applied twice: versions {versions}"
    assert sorted(bool(reply and reply.get("duplicate")) for reply in replies) == [False, True]


async def test_two_dispatchers_creating_one_schedule_with_expected_version_0_create_it_once(
    database_url: str,
    store: Store,
    index: Index,
    connection: AbstractRobustConnection,
    redis_prefix: str,
) -> None:
    settings = DispatcherSettings(redis_prefix=redis_prefix, shards=SHARDS)
    slow_store = await SlowReplayStore.open(database_url)

    def create(by: str) -> batch.UpsertItem:
        return dataclasses.replace(upsert_item("c", every("a", {"by": by})), expected_version=0)

    try:
        channel = await connection.channel()
        first = Intake(settings, slow_store, index, channel, no_wake, asyncio.Event())
        second = Intake(settings, store, index, channel, no_wake, asyncio.Event())
        # Competing consumers of cronbus.commands: each dispatcher gets one of the two.
        one = asyncio.create_task(first.apply_batch([create("first")]))
        await asyncio.sleep(0.2)
        other = asyncio.create_task(second.apply_batch([create("second")]))
        effects = await asyncio.gather(one, other)
    finally:
        await slow_store.close()
    outcomes = [
        r.code
        if isinstance(r := e.results[0], Exception)
        else (r["created"], r["schedule"]["version"])
        for e in effects
    ]
    # "Create only if absent" holds for one of them; the other is told of the conflict.
    assert sorted(map(str, outcomes)) == ["(True, 1)", "version_conflict"], outcomes


async def test_a_delete_whose_index_write_redis_refused_fences_its_shard_until_replayed(
    store: Store, index: Index, connection: AbstractRobustConnection, redis_prefix: str
) -> None:
    """Invariant 9: the delete is answered ok (PostgreSQL has it) though Redis refused its
    index write; the schedule is still due in that index, so its shard's answered position
    must be past the index's: dispatchers claim nothing from it until the sweeper replays."""
    channel = await connection.channel()
    settings = DispatcherSettings(redis_prefix=redis_prefix, shards=SHARDS)
    intake = Intake(settings, store, index, channel, no_wake, asyncio.Event())
    await intake.commits.commit_upserts([upsert_item("d", every("gone"))])
    real_remove = index.remove

    async def remove_refused(*args: Any, **kwargs: Any) -> Any:
        raise redis.exceptions.ResponseError(
            "OOM command not allowed when used memory > 'maxmemory'"
        )

    index.remove = remove_refused  # type: ignore[method-assign]
    try:
        audit = CommandAudit("d", "delete", "gone", "ok")
        [reply] = await intake.commits.commit_upserts(
            [batch.ChangeItem("d", "gone", "delete", audit)]
        )
    finally:
        index.remove = real_remove  # type: ignore[method-assign]
    assert not isinstance(reply, Exception) and reply.get("ok"), reply
    shard = index.shard_of("d", "gone")
    assert await index.knows(shard, "d/gone"), "the refused removal left the schedule due"
    answered = (await positions.read(store.pool))[shard].answered
    held = (await index.positions())[shard]
    assert held < answered, (
        f"the delete was answered ok, yet shard {shard}'s answered position ({answered}) is not "
        f"past the index's ({held}): a dispatcher would claim the deleted schedule from it"
    )
    claimed = await index.claim(
        [shard], 10, 30_000, now_ms=int(time.time() * 1000) + 3_600_000, answered={shard: answered}
    )
    assert claimed[0].fenced and not claimed[0].claimed


async def test_a_delete_redelivered_after_its_intake_died_before_the_index_fences_its_shard(
    store: Store, index: Index, connection: AbstractRobustConnection, redis_prefix: str
) -> None:
    """Invariant 9: the first dispatcher commits the delete and dies before its index write;
    the broker redelivers it to another, which answers ok (applied already). The schedule is
    still due in the index, so the shard must be fenced until the sweeper replays it."""
    channel = await connection.channel()
    settings = DispatcherSettings(redis_prefix=redis_prefix, shards=SHARDS)
    first = Intake(settings, store, index, channel, no_wake, asyncio.Event())
    second = Intake(settings, store, index, channel, no_wake, asyncio.Event())
    await second.commits.commit_upserts([upsert_item("d", every("gone"))])
    body = {"id": "gone"}

    def delete() -> batch.ChangeItem:
        audit = CommandAudit("d", "delete", "gone", "ok", body=body, message_id="del-1")
        return batch.ChangeItem("d", "gone", "delete", audit, "del-1", body)

    real_remove, never = index.remove, asyncio.Event()

    async def remove_hangs(*args: Any, **kwargs: Any) -> Any:
        await never.wait()  # the process dies here, after PostgreSQL committed

    index.remove = remove_hangs  # type: ignore[method-assign]
    dying = asyncio.create_task(first.commits.commit_upserts([delete()]))
    try:
        for _ in range(200):
            row = await store.get_schedule("d", "gone")
            if row is not None and row.state == "deleted":
                break
            await asyncio.sleep(0.02)
    finally:
        dying.cancel()
        index.remove = real_remove  # type: ignore[method-assign]
    [reply] = await second.commits.commit_upserts([delete()])
    assert not isinstance(reply, Exception) and reply.get("ok"), reply
    shard = index.shard_of("d", "gone")
    assert await index.knows(shard, "d/gone"), "the died delivery's removal never landed"
    answered = (await positions.read(store.pool))[shard].answered
    held = (await index.positions())[shard]
    assert held < answered, (
        f"the redelivered delete was answered ok, yet shard {shard}'s answered position "
        f"({answered}) is not past the index's ({held}): the deleted schedule would fire"
    )
