"""The Redis index: typed calls of the Lua scripts, one shard at a time or pipelined.

Only this module (and ``shared.redis.lua``) talks to Redis about schedules. Every call that can be
batched is: one script call per shard carries many items, and calls for several shards go in
one pipeline.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

from redis.asyncio.cluster import RedisCluster

from shared.contract import keys
from shared.contract.entries import (
    BackfillStart,
    Claimed,
    ClaimResult,
    Completion,
    Upsert,
    parse_backfill,
    split_tail,
)
from shared.redis import lua
from shared.redis.connection import RedisClient
from shared.rules import compact

log = logging.getLogger(__name__)


def _opt(value: int | None) -> str | int:
    return "" if value is None else value


def _claimed(shard: int, row: list[Any]) -> Claimed:
    fires, catch_up = split_tail(row[5].decode())
    return Claimed(
        shard=shard,
        member=row[0].decode(),
        fire_ms=int(row[1]),
        nominal_ms=int(row[2]),
        attempt=int(row[3]),
        token=int(row[4]),
        fires=fires,
        plan=row[6],
        catch_up=catch_up,
    )


def _parse_claim(shard: int, reply: list[Any]) -> ClaimResult:
    next_due = int(reply[1])
    claimed = [_claimed(shard, reply[i : i + 7]) for i in range(6, len(reply), 7)]
    return ClaimResult(
        shard,
        int(reply[0]),
        None if next_due < 0 else next_due,
        int(reply[2]),
        claimed,
        int(reply[3]),
        int(reply[4]),
        bool(int(reply[5])),
    )


class Index:
    """The sharded index under one key prefix."""

    def __init__(
        self,
        client: RedisClient,
        redis_keys: keys.RedisKeys,
        shards: int,
        compact_form: compact.Form = "binary",
    ) -> None:
        self.client = client
        self.keys = redis_keys
        self.shards = shards
        #: The form schedules are written in (CRONBUS_COMPACT_FORM); both are read.
        self.compact_form = compact_form

    def shard_of(self, namespace: str, schedule_id: str) -> int:
        return keys.shard_of(namespace, schedule_id, self.shards)

    def _keys(self, shard: int, *roles: str) -> list[str]:
        names = {
            "due": self.keys.due,
            "lease": self.keys.lease,
            "occ": self.keys.occ,
            "sched": self.keys.sched,
            "seq": self.keys.seq,
            "gone": self.keys.gone,
            "bf": self.keys.backfill,
            "parked": self.keys.parked,
            "rates": self.keys.parked_rates,
            "pkm": self.keys.parked_marks,
            "pos": self.keys.position,
            "ahead": self.keys.ahead,
        }
        return [names[role](shard) for role in roles]

    async def load_scripts(self) -> None:
        await lua.load_all(self.client)

    async def _pipeline(self, calls: Sequence[tuple[str, list[str], list[Any]]]) -> list[Any]:
        """Run script calls in one round trip; calls Redis did not know the script for are
        loaded and run again (only those: the others have already taken effect)."""
        if len(calls) == 1:
            name, call_keys, args = calls[0]
            return [await lua.call(self.client, name, call_keys, args)]
        results = await self._execute(calls)
        missing = [i for i, result in enumerate(results) if lua.is_noscript(result)]
        if missing:
            await lua.load_all(self.client)
            again = await self._execute([calls[i] for i in missing])
            for i, result in zip(missing, again, strict=True):
                results[i] = result
        for result in results:
            if isinstance(result, Exception):
                raise result
        return results

    async def run(self, calls: Sequence[tuple[str, list[str], list[Any]]]) -> list[Any]:
        """Script calls (name, keys, args) of other modules' scripts, as ``_pipeline`` runs them."""
        return await self._pipeline(calls)

    async def _execute(self, calls: Sequence[tuple[str, list[str], list[Any]]]) -> list[Any]:
        if isinstance(self.client, RedisCluster):
            # redis-py does not pipeline EVALSHA on a cluster: the calls go concurrently
            # instead, each to the node that owns its shard's slot.
            return list(
                await asyncio.gather(
                    *(
                        lua.call(self.client, name, call_keys, args)
                        for name, call_keys, args in calls
                    ),
                    return_exceptions=True,
                )
            )
        pipe = self.client.pipeline(transaction=False)
        for name, call_keys, args in calls:
            lua.queue(pipe, name, call_keys, args)
        return list(await pipe.execute(raise_on_error=False))

    # --- dispatcher -------------------------------------------------------------------------

    async def claim(
        self,
        shards: Iterable[int],
        limit: int,
        lease_ms: int,
        now_ms: int | None = None,
        answered: Mapping[int, int] | None = None,
    ) -> list[ClaimResult]:
        """Up to ``limit`` due occurrences of each shard; none from a shard whose position is
        below its ``answered`` one (it lacks a command already answered: fenced)."""
        order = list(shards)
        answered = answered or {}
        calls = [
            (
                "claim",
                self._keys(s, "due", "lease", "occ", "sched", "seq", "bf", "pos"),
                [limit, lease_ms, _opt(now_ms), _opt(answered.get(s))],
            )
            for s in order
        ]
        replies = await self._pipeline(calls)
        return [_parse_claim(s, reply) for s, reply in zip(order, replies, strict=True)]

    # --- executor ---------------------------------------------------------------------------

    async def begin(
        self,
        items: Mapping[int, Sequence[tuple[str, int, int] | tuple[str, int, int, int | None]]],
        now_ms: int | None = None,
        *,
        delivering: bool = True,
    ) -> tuple[int, dict[int, list[int]]]:
        """Per shard, (member, token, hold_ms[, cutoff_ms]) -> 1 current (lease held), 2
        current and begun before (deliver it, do not judge it again), 3 current but missed
        (past its cutoff: judge it; it is not flagged as begun) or 0 stale; with the Redis
        clock (ms) at the call, for misfire decisions. No cutoff (or None): never missed.
        ``delivering=False`` only holds the leases (of occurrences waiting for a slot):
        nothing is flagged as begun."""
        flag = "1" if delivering else "0"
        calls = []
        for shard, batch in items.items():
            args: list[Any] = [_opt(now_ms), flag]
            for item in batch:
                cutoff = item[3] if len(item) > 3 else None
                args += [item[0], item[1], item[2], _opt(cutoff)]
            calls.append(("begin", self._keys(shard, "lease", "occ"), args))
        replies = await self._pipeline(calls)
        now = max((int(r[0]) for r in replies), default=0)
        return now, {s: [int(c) for c in r[1:]] for s, r in zip(items, replies, strict=True)}

    async def complete(
        self, items: dict[int, list[Completion]], now_ms: int | None = None
    ) -> dict[int, list[int]]:
        """Per shard, 1 completed or 0 stale for each completion."""
        calls = []
        for shard, batch in items.items():
            args: list[Any] = [_opt(now_ms)]
            for c in batch:
                args += [c.member, c.token, _opt(c.next_fire_ms), c.next_occ, int(c.finish)]
            calls.append(
                ("complete", self._keys(shard, "due", "lease", "occ", "sched", "gone", "bf"), args)
            )
        replies = await self._pipeline(calls)
        return {s: [int(c) for c in r] for s, r in zip(items, replies, strict=True)}

    async def retry(
        self, items: dict[int, list[tuple[str, int, int]]], now_ms: int | None = None
    ) -> dict[int, list[int]]:
        """Per shard, (member, token, delay_ms) -> 1 rescheduled or 0 stale."""
        calls = [
            (
                "retry",
                self._keys(s, "due", "lease", "occ"),
                [_opt(now_ms), *[v for item in batch for v in item]],
            )
            for s, batch in items.items()
        ]
        replies = await self._pipeline(calls)
        return {s: [int(c) for c in r] for s, r in zip(items, replies, strict=True)}

    async def count_failures(self, items: dict[int, list[tuple[str, str]]]) -> dict[int, list[int]]:
        """Per shard, (member, 'dead' | 'clear') -> consecutive dead occurrences after the call."""
        calls = [
            ("failures", [self.keys.fails(s)], [v for item in batch for v in item])
            for s, batch in items.items()
        ]
        replies = await self._pipeline(calls)
        return {s: [int(c) for c in r] for s, r in zip(items, replies, strict=True)}

    async def gate(
        self,
        items: Sequence[tuple[str, float, int, int]],
        breaker_failures: int,
        max_reserve_ms: int,
        now_ms: int | None = None,
    ) -> list[tuple[int, int, int]]:
        """(rate key, interval ms or 0, burst, probe ms) -> (code, ms, flags) per delivery:
        one gate.lua call for the batch (see the script for the codes)."""
        call_keys: list[str] = []
        args: list[Any] = [_opt(now_ms), breaker_failures, max_reserve_ms]
        for rate_key, interval, burst, probe_ms in items:
            call_keys += self.keys.rate(rate_key)
            args += [f"{interval:.3f}", burst, probe_ms]
        reply = await lua.call(self.client, "gate", call_keys, args)
        return [
            (int(reply[i]), int(reply[i + 1]), int(reply[i + 2])) for i in range(0, len(reply), 3)
        ]

    async def report(
        self,
        items: Sequence[tuple[str, int, int | None]],
        breaker_failures: int,
        cooldown_ms: int,
        idle_ms: int,
        now_ms: int | None = None,
    ) -> list[int]:
        """(rate key, ok, retry_after ms) -> 0 no change, 1 breaker closed, 2 breaker opened.
        ok: 1 (or True) the host is up, 0 down, 2 nothing was sent (a probe's slot is freed)."""
        call_keys: list[str] = []
        args: list[Any] = [_opt(now_ms), breaker_failures, cooldown_ms, idle_ms]
        for rate_key, ok, retry_after in items:
            _, hold, breaker = self.keys.rate(rate_key)
            call_keys += [hold, breaker]
            args += [int(ok), _opt(retry_after)]
        return [int(code) for code in await lua.call(self.client, "report", call_keys, args)]

    async def breaker_state(self, rate_key: str) -> tuple[int, int, int, int]:
        """(consecutive failures, open until ms, probe until ms, hold until ms) of a rate key."""
        _, hold, breaker = self.keys.rate(rate_key)
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(breaker, ["fails", "open_until", "probe_until"])
        pipe.get(hold)
        (fails, open_until, probe_until), held = await pipe.execute()
        return (
            int(fails or 0),
            int(float(open_until or 0)),
            int(float(probe_until or 0)),
            int(float(held or 0)),
        )

    async def release(
        self, items: dict[int, list[tuple[str, int]]], now_ms: int | None = None
    ) -> dict[int, list[int]]:
        """Per shard, (member, token) -> 1 released back to due or 0 stale."""
        calls = [
            (
                "release",
                self._keys(s, "due", "lease", "occ"),
                [_opt(now_ms), *[v for item in batch for v in item]],
            )
            for s, batch in items.items()
        ]
        replies = await self._pipeline(calls)
        return {s: [int(c) for c in r] for s, r in zip(items, replies, strict=True)}

    # --- sweeper ----------------------------------------------------------------------------

    async def reclaim(
        self, shards: Iterable[int], limit: int, now_ms: int | None = None
    ) -> dict[int, tuple[int, int]]:
        """Per shard, (reclaimed, dropped)."""
        order = list(shards)
        calls = [
            ("reclaim", self._keys(s, "due", "lease", "occ", "sched"), [limit, _opt(now_ms)])
            for s in order
        ]
        replies = await self._pipeline(calls)
        return {s: (int(r[0]), int(r[1])) for s, r in zip(order, replies, strict=True)}

    # --- intake and rebuild -----------------------------------------------------------------

    async def upsert(self, items: dict[int, list[Upsert]]) -> dict[int, list[int]]:
        """Per shard, 1 written or -1 stale (a newer version is stored) for each upsert."""
        calls = []
        for shard, batch in items.items():
            args: list[Any] = []
            for u in batch:
                plan = compact.stored_form(u.plan, self.compact_form)
                args += [u.member, u.version, plan, u.mode, _opt(u.next_fire_ms), u.next_occ]
            calls.append(
                (
                    "upsert",
                    self._keys(shard, "due", "lease", "occ", "sched", "gone", "bf", "pkm"),
                    args,
                )
            )
        replies = await self._pipeline(calls)
        return {s: [int(c) for c in r] for s, r in zip(items, replies, strict=True)}

    async def remove(
        self, items: dict[int, list[tuple[str, int | None]]], now_ms: int | None = None
    ) -> dict[int, list[int]]:
        """Per shard, (member, version or None) -> 1 removed, 0 absent, -1 newer stored.
        Each removal leaves a tombstone of its version (see ``RedisKeys.gone``)."""
        calls = [
            (
                "remove",
                self._keys(s, "due", "lease", "occ", "sched", "gone", "bf", "pkm"),
                [_opt(now_ms), *[v for member, version in batch for v in (member, _opt(version))]],
            )
            for s, batch in items.items()
        ]
        replies = await self._pipeline(calls)
        return {s: [int(c) for c in r] for s, r in zip(items, replies, strict=True)}

    async def own(
        self,
        shards: Iterable[int],
        dispatcher_id: str,
        ttl_ms: int,
        mode: Literal["acquire", "renew", "release"],
        owner_key: Callable[[int], str] | None = None,
    ) -> dict[int, bool]:
        """Per shard (or what ``owner_key`` names: a commands partition), whether
        ``dispatcher_id`` holds its lease after the call (own.lua)."""
        order = list(shards)
        key_of = owner_key or self.keys.shard_owner
        calls = [("own", [key_of(s)], [dispatcher_id, ttl_ms, mode]) for s in order]
        replies = await self._pipeline(calls) if calls else []
        return {s: bool(int(r)) for s, r in zip(order, replies, strict=True)}

    async def forget(self, shard: int, tombstones: Sequence[tuple[str, bytes]]) -> int:
        """Drop tombstones that still hold the value read (forget.lua); returns how many."""
        args = [v for member, value in tombstones for v in (member, value)]
        keys = [self.keys.gone(shard), self.keys.occ(shard)]
        return int(await lua.call(self.client, "forget", keys, args))

    async def wipe(self) -> None:
        """Drop every shard's keys (an index found stale is rebuilt from scratch)."""
        for shard in range(self.shards):
            await self.client.unlink(
                *self._keys(
                    shard,
                    "due",
                    "lease",
                    "occ",
                    "sched",
                    "gone",
                    "bf",
                    "parked",
                    "rates",
                    "pkm",
                    "pos",
                    "ahead",
                )
            )
            # The parked sets and their probes' rounds are one per rate key: found by name.
            for pattern in (
                self.keys.parked_on_pattern(shard),
                self.keys.probed_pattern(shard),
            ):
                found: list[Any] = []
                async for name in self.client.scan_iter(match=pattern, count=1000):
                    found.append(name)
                    if len(found) >= 1000:
                        await self.client.unlink(*found)
                        found = []
                if found:
                    await self.client.unlink(*found)

    # --- positions (invariant 9) ------------------------------------------------------------

    async def advance(
        self,
        positions: Mapping[int, int],
        mode: Literal["note", "floor", "start"],
        wait_replicas: int = 0,
        wait_timeout_ms: int = 0,
    ) -> dict[int, int]:
        """Per shard, record a position (advance.lua); returns each shard's position after.

        With ``wait_replicas``, WAIT follows on the same connection: replication is one
        stream, so the replicas that have this call have every write made before it."""
        order = sorted(positions)
        calls = [("advance", self._keys(s, "pos", "ahead"), [mode, positions[s]]) for s in order]
        if not calls:
            return {}
        if wait_replicas <= 0 or isinstance(self.client, RedisCluster):
            replies = await self._pipeline(calls)
        else:
            replies = await self._advance_and_wait(calls, wait_replicas, wait_timeout_ms)
        return {s: int(r) for s, r in zip(order, replies, strict=True)}

    async def _advance_and_wait(
        self, calls: Sequence[tuple[str, list[str], list[Any]]], replicas: int, timeout_ms: int
    ) -> list[Any]:
        for attempt in range(2):
            pipe = self.client.pipeline(transaction=False)
            for name, call_keys, args in calls:
                lua.queue(pipe, name, call_keys, args)
            pipe.execute_command("WAIT", replicas, timeout_ms)
            results = list(await pipe.execute(raise_on_error=False))
            if attempt == 0 and any(lua.is_noscript(r) for r in results):
                await lua.load_all(self.client)  # advance.lua only ever moves forward: again
                continue
            for result in results:
                if isinstance(result, Exception):
                    raise result
            acknowledged = int(results[-1])
            if acknowledged < replicas:
                log.warning(
                    "fewer replicas than asked acknowledged the index writes in time",
                    extra={"action": "wait_replicas", "acknowledged": acknowledged},
                )
            return results[:-1]
        raise AssertionError("unreachable")

    async def bind(self, database: str) -> str | None:
        """Record which database this index belongs to, unless one is recorded already;
        returns the other database's identity when the index is not this one's."""
        await self.client.set(self.keys.database, database, nx=True)
        found = await self.client.get(self.keys.database)
        if found is None:
            return None  # lost meanwhile: the next start (or rebuild) binds it
        text = found.decode() if isinstance(found, bytes) else str(found)
        return None if text == database else text

    async def positions(self) -> dict[int, int]:
        """Every shard's position (0: none recorded)."""
        pipe = self.client.pipeline(transaction=False)
        for shard in range(self.shards):
            pipe.get(self.keys.position(shard))
        values = await pipe.execute()
        return {shard: int(v or 0) for shard, v in enumerate(values)}

    async def knows(self, shard: int, member: str) -> bool:
        """Whether the member is due, in flight or has an occurrence state in the index."""
        due, lease, occ = await self.position(shard, member)
        return due is not None or lease is not None or occ is not None

    async def start_backfill(
        self, shard: int, start: BackfillStart, position: int | None = None
    ) -> bool:
        """Start (or replace, or restore) a schedule's backfill (backfill.lua); False when a
        generation at least as new is held already. With the ``position`` of the transaction
        that made it durable, the position is recorded with it, and nothing is written when
        the position is applied already (invariant 9)."""
        args = [
            start.member,
            start.generation,
            start.to_ms,
            start.remaining,
            _opt(start.first_ms),
            _opt(position),
        ]
        code = await lua.call(
            self.client,
            "backfill",
            self._keys(shard, "due", "lease", "occ", "bf", "pos", "ahead"),
            args,
        )
        return bool(int(code))

    async def backfill_remaining(self, shard: int, member: str) -> int | None:
        """Occurrences the schedule's running backfill has left (None: it has none)."""
        remaining, _ = await self.backfill_remaining_and_epoch(shard, member)
        return remaining

    async def backfill_remaining_and_epoch(
        self, shard: int, member: str
    ) -> tuple[int | None, bool]:
        """``backfill_remaining`` and whether the index has its epoch (False: Redis lost its
        data, or a rebuild has not finished), one round trip."""
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.hget(self.keys.backfill(shard), member)
            pipe.exists(self.keys.epoch)
            held, epoch = await pipe.execute()
        if held is None:
            return None, bool(epoch)
        text = held.decode() if isinstance(held, bytes) else str(held)
        return parse_backfill(text).remaining, bool(epoch)

    async def backfill_generations(self, shard: int, members: Sequence[str]) -> list[int | None]:
        """The generation of each schedule's running backfill (None: none), one round trip."""
        if not members:
            return []
        values = await self.client.hmget(self.keys.backfill(shard), list(members))
        return [
            None
            if v is None
            else parse_backfill(v.decode() if isinstance(v, bytes) else v).generation
            for v in values
        ]

    async def add_trigger(self, shard: int, member: str, fire_ms: int) -> None:
        await self.client.zadd(self.keys.due(shard), {member: fire_ms}, nx=True)

    async def add_run(self, shard: int, member: str, fire_ms: int, position: int) -> bool:
        """A trigger and the position of the transaction that made it durable, at once
        (run.lua); False when the position is applied already (the run was written then, and
        may have run since) or the run is due or in flight."""
        code = await lua.call(
            self.client,
            "run",
            self._keys(shard, "due", "lease", "pos", "ahead"),
            [member, fire_ms, position],
        )
        return bool(int(code))

    # --- reads ------------------------------------------------------------------------------

    async def stored_plan(self, shard: int, member: str) -> bytes | None:
        value = await self.client.hget(self.keys.sched(shard), member)
        return value.encode() if isinstance(value, str) else value

    async def lease_count(self, shard: int) -> int:
        return int(await self.client.zcard(self.keys.lease(shard)))

    async def position(self, shard: int, member: str) -> tuple[int | None, int | None, str | None]:
        """(due fire ms, lease deadline ms, occ value) of a member: for tests and ``get``."""
        pipe = self.client.pipeline(transaction=False)
        pipe.zscore(self.keys.due(shard), member)
        pipe.zscore(self.keys.lease(shard), member)
        pipe.hget(self.keys.occ(shard), member)
        due, lease, occ = await pipe.execute()
        return (
            None if due is None else int(due),
            None if lease is None else int(lease),
            None if occ is None else occ.decode(),
        )
