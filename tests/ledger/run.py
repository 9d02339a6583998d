"""The ledger run: the mix registered, commands and faults applied in turns while it fires,
everything recorded, then judged by the oracle; and the no-fault herd of each spec kind.

Profiles: the short one (CI, about four minutes, and one more for the herd) applies every
fault once; a long one (``scripts/ledger --minutes N``) repeats the pass of every fault for N
minutes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg

from cronbus.cli.sink import Sink
from shared.contract import codec, keys, timefmt
from shared.rules import schedule
from tests.ledger import faults, mix, oracle
from tests.ledger import sink as ledger_sink
from tests.support import private
from tests.support.commands import CommandClient
from tests.support.stack import Stack


def now_ms() -> int:
    return int(time.time() * 1000)


#: The calm after the last fault, beyond a calm stretch: its window's recovery pad and the
#: settling time (oracle.judge, oracle.SETTLE_MS) end before the horizon.
TAIL_S = 10.0


@dataclass(frozen=True)
class Profile:
    #: 0: the short profile (one pass of every fault).
    minutes: float
    seed: int
    schedules: int
    herd_per_kind: int
    burst: int
    #: The calm between two faults: longer than one fault window's padding (2 s before, 6 s
    #: after, oracle.judge), so the windows of two faults do not join into one stretch and
    #: what each policy owes is judged fault by fault.
    calm_s: float
    commands_per_calm: int

    @property
    def drain_s(self) -> float:
        """How long the judgement waits for what is still owed: late is not lost, and a long
        run ends with the backlog of its last overload burst still draining."""
        return 45.0 if self.minutes <= 0 else 180.0

    @property
    def run_s(self) -> float:
        return max(self.minutes * 60, 100.0)


def profile(minutes: float, seed: int) -> Profile:
    if minutes <= 0:
        return Profile(
            0, seed, schedules=40, herd_per_kind=400, burst=1000, calm_s=10, commands_per_calm=3
        )
    return Profile(
        minutes, seed, schedules=120, herd_per_kind=1000, burst=3000, calm_s=12, commands_per_calm=6
    )


@dataclass
class Ledger:
    """One mix run on one stack: what was asked, when, and what the sink received."""

    stack: Stack
    servers: private.PrivateServices
    env: dict[str, str]
    sinks: ledger_sink.Sinks
    profile: Profile
    rng: random.Random = field(init=False)
    items: dict[str, mix.Item] = field(default_factory=dict)
    timelines: dict[str, oracle.Timeline] = field(default_factory=dict)
    state: dict[str, str] = field(default_factory=dict)
    applied: list[oracle.Fault] = field(default_factory=list)
    commands: dict[str, int] = field(default_factory=dict)
    #: Schedules left out of the judgement because a command's outcome is unknown.
    excluded: dict[str, str] = field(default_factory=dict)
    bursts: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.profile.seed)

    # --- commands --------------------------------------------------------------------------

    async def _send(
        self, client: CommandClient, verb: str, body: dict[str, Any], member: str, label: str = ""
    ) -> tuple[int, int, dict[str, Any]] | None:
        sent = now_ms()
        try:
            reply = await client.send(mix.NAMESPACE, verb, body, timeout_s=30)
        except TimeoutError:
            reply = {"ok": False, "error": {"code": "timeout"}}
        replied = now_ms()
        label = label or verb
        self.commands[label] = self.commands.get(label, 0) + 1
        if not reply.get("ok"):
            self.excluded[member] = f"{verb} failed: {reply.get('error')}"
            return None
        return sent, replied, reply

    async def register(self) -> None:
        now = now_ms()
        made = mix.mix(
            self.profile.seed,
            self.profile.schedules,
            now,
            self.profile.run_s,
            self.sinks.main.url,
            self.sinks.other.url,
        )
        async with CommandClient(self.env["CRONBUS_AMQP_URL"], app_id="ledger") as client:
            await asyncio.gather(*(self._register_one(client, item) for item in made))

    async def _register_one(self, client: CommandClient, item: mix.Item) -> None:
        member = keys.member(mix.NAMESPACE, item.id)
        self.items[member] = item
        self.timelines[member] = oracle.Timeline(mix.NAMESPACE, item.id, [])
        done = await self._send(client, "upsert", {"schedule": item.body}, member, "create")
        if done is not None:
            sent, replied, _ = done
            self.timelines[member].rotations.append(oracle.Rotation(item.plan, sent, replied))
            self.state[member] = "active"

    def _eligible(self, verb: str) -> list[str]:
        def fits(member: str) -> bool:
            item, state = self.items[member], self.state.get(member)
            if member in self.excluded or state is None or state == "deleted":
                return False
            if verb in {"pause", "reset"}:
                return item.commandable and state == "active"
            if verb == "resume":
                return state == "paused"
            if verb == "trigger":
                bounded = any(b in item.body["spec"] for b in ("end_at", "max_fires"))
                return state == "active" and item.kind != "once" and not bounded
            return True  # delete

        return sorted(m for m in self.items if fits(m))

    async def random_command(self, client: CommandClient) -> None:
        deleted = sum(1 for s in self.state.values() if s == "deleted")
        verbs = ["pause", "resume", "trigger", "reset", "trigger"]
        if deleted < len(self.items) // 6:
            verbs.append("delete")
        verb = self.rng.choice(verbs)
        eligible = self._eligible(verb)
        if eligible:
            await self.command(client, verb, self.rng.choice(eligible))

    async def command(self, client: CommandClient, verb: str, member: str) -> None:
        item, timeline = self.items[member], self.timelines[member]
        body: dict[str, Any] = {"id": item.id}
        if verb == "reset":
            new_body = mix.reset_body(item.body, self.rng)
            done = await self._send(client, "upsert", {"schedule": new_body}, member, "reset")
            if done is not None:
                self.items[member] = mix.Item(item.id, item.kind, new_body)
                plan = mix.plan_of_body(new_body)
                timeline.rotations.append(oracle.Rotation(plan, done[0], done[1]))
            return
        done = await self._send(client, verb, body, member)
        if done is None:
            return
        sent, replied, reply = done
        if verb == "pause":
            timeline.pauses.append(oracle.Pause(sent, replied))
            self.state[member] = "paused"
        elif verb == "resume":
            last = timeline.pauses[-1]
            timeline.pauses[-1] = oracle.Pause(last.sent_ms, last.reply_ms, sent, replied)
            self.state[member] = "active"
        elif verb == "delete":
            timeline.deleted = (sent, replied)
            self.state[member] = "deleted"
        elif verb == "trigger":
            fire = timefmt.parse_rfc3339_ms(reply["trigger"]["fire_time"])
            timeline.triggers.append(
                oracle.Trigger(sent, replied, fire, reply["trigger"]["idempotency_key"])
            )

    async def calm(self, seconds: float, count: int) -> None:
        """A stretch without faults, with ``count`` commands at random moments."""
        moments = sorted(self.rng.uniform(0, seconds) for _ in range(count))
        started = time.monotonic()
        async with CommandClient(self.env["CRONBUS_AMQP_URL"], app_id="ledger") as client:
            for moment in moments:
                await asyncio.sleep(max(0.0, started + moment - time.monotonic()))
                await self.random_command(client)
        await asyncio.sleep(max(0.0, started + seconds - time.monotonic()))

    async def send_triggers(self) -> None:
        async with CommandClient(self.env["CRONBUS_AMQP_URL"], app_id="ledger") as client:
            for member in self._eligible("trigger")[:4]:
                await self.command(client, "trigger", member)

    # --- the overload burst ----------------------------------------------------------------

    async def burst(self) -> None:
        """Far more occurrences due at one instant than the executors deliver at once: one-shot
        schedules (default policy, fire_once: their only time is their own catch-up)."""
        at = (now_ms() // 1000 + 6) * 1000
        # A namespace per burst: the ids repeat from one pass to the next.
        self.bursts += 1
        namespace = f"burst{self.bursts}"
        bodies = [
            mix.herd_body("once", i, at, self.sinks.main.url, "burst")
            for i in range(self.profile.burst)
        ]
        sent = now_ms()
        await import_schedules(self.env, namespace, bodies, self.stack.logs)
        replied = now_ms()
        for body in bodies:
            # Judged like the mix, but never commanded (they live in their own namespace).
            member = keys.member(namespace, body["id"])
            rotation = oracle.Rotation(mix.plan_of_body(body), sent, replied)
            self.timelines[member] = oracle.Timeline(namespace, body["id"], [rotation])
        members = {keys.member(namespace, body["id"]) for body in bodies}

        def drained(sink: Sink) -> bool:
            return len({r.schedule for r in sink.received if r.schedule in members}) >= len(members)

        await self.sinks.main.wait_for(drained, timeout_s=90)

    # --- the run ---------------------------------------------------------------------------

    def kit(self) -> faults.Kit:
        return faults.Kit(
            self.stack,
            self.servers,
            self.env["CRONBUS_REDIS_PREFIX"],
            self.rng,
            self.send_triggers,
            self.burst,
            self.sinks,
            commands=self.calm,
        )

    async def run(self) -> oracle.Verdict:
        kit = self.kit()
        await self.register()
        # A long stretch with commands and no fault first: what every policy owes on time.
        await self.calm(2 * self.profile.calm_s, 3 * self.profile.commands_per_calm)
        deadline = time.monotonic() + self.profile.minutes * 60
        while True:
            # The snapshot the old-snapshot fault restores: taken a whole pass earlier.
            await kit.take_snapshot()
            for name in faults.of_profile(self.profile.minutes):
                await self.calm(self.profile.calm_s, self.profile.commands_per_calm)
                self.applied.append(await faults.apply(name, kit))
            if time.monotonic() >= deadline:
                break
        # A calm tail longer than the last fault's window and its settling: what the last
        # fault's stretches owe is judged too (a stretch still settling at the horizon is not).
        await self.calm(self.profile.calm_s + TAIL_S, self.profile.commands_per_calm)
        horizon = now_ms() - 1000
        return await self.drain_and_judge(horizon, self.profile.drain_s)

    def breaker_transitions(self) -> dict[str, int]:
        """How often the executors opened and closed a circuit breaker (from their logs): the
        run had the breaker in reach only if it opened."""
        counts = {"open": 0, "closed": 0}
        for path in sorted(self.stack.logs.glob("executor-*.log")):
            text = path.read_text(errors="replace")
            for state in counts:
                counts[state] += text.count(f'"action":"breaker_{state}"')
        return counts

    def history(self) -> dict[str, Any]:
        """The command history of every mix schedule, for the JSON report."""
        return {
            member: {
                "rotations": [[r.sent_ms, r.reply_ms, self._spec_of(r)] for r in t.rotations],
                "pauses": [list(dataclasses.astuple(p)) for p in t.pauses],
                "deleted": list(t.deleted) if t.deleted else None,
                "triggers": [[g.sent_ms, g.reply_ms, g.fire_ms] for g in t.triggers],
            }
            for member, t in self.timelines.items()
            if t.namespace == mix.NAMESPACE
        }

    @staticmethod
    def _spec_of(rotation: oracle.Rotation) -> str:
        plan = rotation.plan
        return f"{plan.rule} misfire={plan.misfire.policy} jitter_ms={plan.jitter_ms}"

    def judge(
        self, horizon: int, skipped: dict[tuple[str, int], int] | None = None
    ) -> oracle.Verdict:
        timelines = [t for m, t in self.timelines.items() if m not in self.excluded]
        return oracle.judge(
            timelines,
            self.sinks.requests(),
            self.applied,
            horizon,
            unreached=unreached_occurrences(self.stack.logs),
            skipped=skipped,
        )

    async def drain_and_judge(self, horizon: int, timeout_s: float = 45) -> oracle.Verdict:
        """Wait until every required occurrence has arrived (or the timeout), then a little
        longer for late duplicates, and judge."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.judge(horizon).total("lost") == 0:
                break
            await asyncio.sleep(2)
        await asyncio.sleep(3)
        skipped = await skipped_occurrences(self.env["CRONBUS_DATABASE_URL"])
        return self.judge(horizon, skipped)


async def skipped_occurrences(database_url: str) -> dict[tuple[str, int], int]:
    """(schedule, nominal) -> the Redis time (epoch ms) at which an executor skipped it as
    missed, from the ``skipped`` execution rows in the run's PostgreSQL."""
    connection = await asyncpg.connect(database_url)
    try:
        rows = await connection.fetch(
            "SELECT namespace, id, nominal_at, finished_at FROM executions"
            " WHERE status = 'skipped' AND NOT is_trigger"
        )
    finally:
        await connection.close()
    return {
        (keys.member(row["namespace"], row["id"]), _epoch_ms(row["nominal_at"])): _epoch_ms(
            row["finished_at"]
        )
        for row in rows
    }


def _epoch_ms(moment: datetime) -> int:
    return round(moment.timestamp() * 1000)


def unreached_occurrences(logs: Path) -> dict[tuple[str, int], int]:
    """(schedule, nominal) -> when (epoch ms) an executor logged it dead with no HTTP answer
    (a host down refused its attempts), from the executors' JSON logs. The oracle counts it
    unreached only if its own host was down then."""
    found: dict[tuple[str, int], int] = {}
    for path in sorted(logs.glob("executor-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if '"occurrence_dead"' not in line:
                continue
            try:
                record = json.loads(line)
                at = datetime.fromisoformat(record["ts"].replace("Z", "+00:00"))
            except (ValueError, KeyError, AttributeError):
                continue
            if record.get("http_status") is None and "schedule" in record:
                key = (record["schedule"], int(record["nominal_ms"]))
                found[key] = round(at.timestamp() * 1000)
    return found


# --- import and herds ----------------------------------------------------------------------


async def import_schedules(
    env: dict[str, str], namespace: str, bodies: list[dict[str, Any]], directory: Path
) -> None:
    """``cronbus import FILE -n NS``, as a user loads many schedules."""
    path = directory / f"import-{namespace}-{now_ms()}.jsonl"
    path.write_bytes(b"\n".join(codec.dumps(b) for b in bodies) + b"\n")
    command = [str(Path(sys.executable).parent / "cronbus"), "import", str(path), "-n", namespace]
    result = await asyncio.to_thread(
        subprocess.run,
        command,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if result.returncode != 0:
        raise AssertionError(f"cronbus import failed: {result.stdout}{result.stderr}")


Expected = dict[str, dict[tuple[str, int], str]]


#: The herd's first lead (s): its schedules are imported before their common due time.
HERD_LEAD_S = 15
#: Import rounds: a round whose imports overran its lead is dropped and the herd imported
#: again in fresh namespaces, with a lead twice as long as the imports took.
HERD_ROUNDS = 3


async def herd(env: dict[str, str], sink: Sink, per_kind: int, logs: Path) -> oracle.Verdict:
    """``per_kind`` schedules of each spec kind, all due at one instant (and as many triggers
    sent at that instant), with no fault: each occurrence delivered once.

    The due instant must come after every import has been answered (an import that overran it
    would make the herd a catch-up, not a herd): on a loaded machine the imports can take
    longer than the first lead, so the round is dropped and the herd imported again."""
    lead_s: float = HERD_LEAD_S
    for round_ in range(HERD_ROUNDS):
        started = time.monotonic()
        at = (now_ms() // 1000 + math.ceil(lead_s)) * 1000
        expected = await _import_herd(env, sink, per_kind, logs, at, round_)
        took = time.monotonic() - started
        if time.time() * 1000 < at - 1000:
            break
        print(f"herd round {round_}: imports took {took:.1f} s, past the lead; again")
        lead_s = 2 * took + 5
    else:
        raise AssertionError(f"the herd's imports overran their lead {HERD_ROUNDS} times")
    await asyncio.sleep(max(0.0, at / 1000 - time.time()))
    expected["trigger"] = await _trigger_all(env, mix.herd_namespace("trigger", round_), per_kind)
    wanted = {item for items in expected.values() for item in items}

    def arrived(found: Sink) -> bool:
        seen = {(r.schedule, timefmt.parse_rfc3339_ms(r.fire_time)) for r in found.received}
        return wanted <= seen

    await sink.wait_for(arrived, timeout_s=120)
    await asyncio.sleep(3)  # late duplicates, if any, arrive meanwhile
    return oracle.judge_herd(expected, ledger_sink.requests(sink))


async def _import_herd(
    env: dict[str, str], sink: Sink, per_kind: int, logs: Path, at: int, round_: int
) -> Expected:
    expected: Expected = {}
    for kind in mix.HERD_KINDS:
        namespace = mix.herd_namespace(kind, round_)
        bodies = [mix.herd_body(kind, i, at, sink.url) for i in range(per_kind)]
        await import_schedules(env, namespace, bodies, logs)
        if kind != "trigger":
            expected[kind] = {
                (keys.member(namespace, b["id"]), at): schedule.idempotency_key(
                    namespace, b["id"], at
                )
                for b in bodies
            }
    return expected


async def _trigger_all(
    env: dict[str, str], namespace: str, count: int
) -> dict[tuple[str, int], str]:
    found: dict[tuple[str, int], str] = {}
    async with CommandClient(env["CRONBUS_AMQP_URL"], app_id="ledger") as client:

        async def one(index: int) -> None:
            schedule_id = f"h{index:05d}"
            reply = await client.send(namespace, "trigger", {"id": schedule_id}, timeout_s=60)
            assert reply.get("ok"), reply
            fire = timefmt.parse_rfc3339_ms(reply["trigger"]["fire_time"])
            found[(keys.member(namespace, schedule_id), fire)] = reply["trigger"]["idempotency_key"]

        await _bounded(one, count, concurrency=50)
    return found


async def _bounded(work: Callable[[int], Awaitable[None]], count: int, concurrency: int) -> None:
    gate = asyncio.Semaphore(concurrency)

    async def guarded(index: int) -> None:
        async with gate:
            await work(index)

    await asyncio.gather(*(guarded(i) for i in range(count)))
