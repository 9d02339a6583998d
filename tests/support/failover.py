"""What the failover tests share: schedules firing every second under ``fire_all`` into a local
sink, the commands sent while a replica lags, and the oracle that judges the deliveries.

A lagged failover (invariant 9): the replica stops receiving the primary's writes for ``lag``
seconds while commands are answered, then the primary dies and the replica, holding the index
as it was ``lag`` seconds earlier, is promoted. Whatever the lag, no deleted or paused schedule
may fire after its reply, no moved schedule may be called at its old URL, every created
schedule must fire and no ``fire_all`` occurrence may be lost; duplicates are counted.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from cronbus.cli.sink import Sink
from cronbus.client import Client
from shared.contract import keys, timefmt
from shared.policy import netpolicy
from shared.rules import schedule
from tests.support.commands import CommandClient
from tests.support.stack import Stack

#: Schedules each group of the lag scenario holds (four groups registered, one created).
GROUP = 20
#: Every other schedule has this jitter: its delivery comes up to 0.5 s after its time.
JITTER_S = 0.5


def jitter(n: int) -> float:
    """Every other schedule of a group has jitter."""
    return JITTER_S if n % 2 else 0.0


def firing_body(schedule_id: str, url: str, jitter_s: float = 0.0) -> dict[str, Any]:
    """A schedule firing every second under fire_all, retried for a while."""
    return {
        "schedule": {
            "id": schedule_id,
            "spec": {"kind": "interval", "every_s": 1},
            "target": {"kind": "webhook", "url": url},
            "misfire": {"policy": "fire_all", "window_s": 3600, "limit": 10_000},
            "retry": {"max_attempts": 20, "initial_backoff_s": 0.2, "max_backoff_s": 1},
            "jitter_s": jitter_s,
        }
    }


def services_env(
    redis: dict[str, str],
    prefix: str,
    amqp_url: str,
    database_url: str,
    *,
    shards: int,
    sweep_interval_s: float,
) -> dict[str, str]:
    """The services' settings for a failover test: short leases and sweeps, so a failover's
    cost shows within the test; ``redis`` names the servers (Sentinel or Cluster)."""
    return {
        **redis,
        "CRONBUS_REDIS_PREFIX": prefix,
        "CRONBUS_AMQP_URL": amqp_url,
        "CRONBUS_DATABASE_URL": database_url,
        "CRONBUS_SHARDS": str(shards),
        "CRONBUS_LEASE_S": "3",
        "CRONBUS_SWEEP_INTERVAL_S": str(sweep_interval_s),
        "CRONBUS_SHUTDOWN_GRACE_S": "5",
        "CRONBUS_EVENTS": "none",
        "CRONBUS_WEBHOOK_ALLOWED_NETWORKS": netpolicy.LOOPBACK_NETWORKS,
    }


def now_ms() -> float:
    return time.time() * 1000


@dataclass(frozen=True)
class Delivery:
    """One webhook call as the sink saw it."""

    schedule_id: str
    nominal_ms: int
    at_ms: float
    path: str


@dataclass
class Workload:
    """Schedules firing every second under fire_all, and what their deliveries show."""

    namespace: str
    first: dict[str, int] = field(default_factory=dict)

    async def add(self, client: Client, schedule_id: str, url: str, jitter_s: float) -> None:
        reply = await client.send(self.namespace, "upsert", firing_body(schedule_id, url, jitter_s))
        assert reply["ok"], reply
        self.first[schedule_id] = timefmt.parse_rfc3339_ms(reply["schedule"]["next_fires"][0])

    async def register(self, client: CommandClient, sink: Sink, count: int = 12) -> None:
        for i in range(count):
            await self.add(client, f"f{i}", f"{sink.url}/f{i}", 0.0)

    def expected(self, until_ms: int, ids: Iterable[str] | None = None) -> set[tuple[str, int]]:
        return {
            (schedule_id, t)
            for schedule_id in (self.first if ids is None else ids)
            for t in range(self.first[schedule_id], until_ms + 1, 1000)
        }

    def deliveries(self, sink: Sink) -> list[Delivery]:
        found = []
        for request in list(sink.received):
            namespace, _, schedule_id = request.schedule.partition("/")
            if namespace == self.namespace:
                nominal = timefmt.parse_rfc3339_ms(request.fire_time)
                assert request.key == schedule.idempotency_key(namespace, schedule_id, nominal)
                found.append(Delivery(schedule_id, nominal, request.at_ms, request.path))
        return found

    def delivered(self, sink: Sink) -> set[tuple[str, int]]:
        return {(d.schedule_id, d.nominal_ms) for d in self.deliveries(sink)}

    def check(self, sink: Sink, until_ms: int) -> tuple[int, int]:
        """(lost, duplicates) among the nominal times up to ``until_ms``."""
        seen = Counter((d.schedule_id, d.nominal_ms) for d in self.deliveries(sink))
        expected = self.expected(until_ms)
        lost = len(expected - set(seen))
        duplicates = sum(count - 1 for key, count in seen.items() if key in expected)
        return lost, duplicates


# --- the oracle (pure) ---------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """What the deliveries show against the replies. Every list must be empty but
    ``duplicates``, which is counted."""

    #: Deliveries of a deleted schedule's occurrence due after the delete was answered.
    fired_after_delete: list[Delivery]
    #: The same for paused schedules.
    fired_after_pause: list[Delivery]
    #: Calls at a moved schedule's old URL for an occurrence due after the move's reply.
    old_url_after_move: list[Delivery]
    #: Created schedules (answered ok) never delivered.
    created_silent: list[str]
    #: fire_all occurrences owed and not delivered (schedule id, nominal ms).
    lost: list[tuple[str, int]]
    #: Deliveries beyond the first of one occurrence.
    duplicates: int
    #: How late each created schedule's first occurrence was delivered (ms after its time).
    created_late_ms: list[float]

    @property
    def violations(self) -> int:
        return (
            len(self.fired_after_delete)
            + len(self.fired_after_pause)
            + len(self.old_url_after_move)
            + len(self.created_silent)
            + len(self.lost)
        )


def after_reply(deliveries: Iterable[Delivery], replied_ms: dict[str, float]) -> list[Delivery]:
    """Deliveries of an occurrence whose time comes after the command's reply.

    An occurrence due before the reply may have been claimed already, in flight (invariant 9
    excepts it); one whose nominal time is after the reply cannot have been: no claim takes an
    occurrence before its time."""
    return [
        d
        for d in deliveries
        if d.schedule_id in replied_ms and d.nominal_ms > replied_ms[d.schedule_id]
    ]


def judge(
    deliveries: list[Delivery],
    *,
    deleted: dict[str, float],
    paused: dict[str, float],
    moved: dict[str, float],
    old_path: Callable[[str], str],
    created: dict[str, int],
    owed: set[tuple[str, int]],
) -> Verdict:
    """``deleted``, ``paused`` and ``moved`` map a schedule to its reply time (ms);
    ``created`` to its first time; ``owed`` is every fire_all occurrence that must arrive."""
    moved_old = [
        d for d in deliveries if d.schedule_id in moved and d.path == old_path(d.schedule_id)
    ]
    seen = Counter((d.schedule_id, d.nominal_ms) for d in deliveries)
    firsts: dict[str, float] = {}
    for d in deliveries:
        if d.schedule_id in created and d.nominal_ms == created[d.schedule_id]:
            firsts[d.schedule_id] = min(firsts.get(d.schedule_id, d.at_ms), d.at_ms)
    return Verdict(
        fired_after_delete=after_reply(deliveries, deleted),
        fired_after_pause=after_reply(deliveries, paused),
        old_url_after_move=after_reply(moved_old, moved),
        created_silent=sorted(
            i for i in created if not any(d.schedule_id == i for d in deliveries)
        ),
        lost=sorted(owed - set(seen)),
        duplicates=sum(count - 1 for count in seen.values()),
        created_late_ms=[firsts[i] - created[i] for i in sorted(firsts)],
    )


# --- the lag scenario ---------------------------------------------------------------------


@dataclass(frozen=True)
class Promotion:
    """A failover to a lagging replica, as measured."""

    killed_ms: float
    #: Seconds from the kill until the replica was the primary.
    promoted_s: float
    #: Replication bytes the primary wrote that the promoted replica never received.
    behind_bytes: int
    #: The shards the dead primary held (None: every shard).
    shards: frozenset[int] | None = None


def replication_offset(port: int) -> int:
    """How far a server's replication stream goes (a primary's, or what a replica applied)."""
    info = subprocess.run(
        ["redis-cli", "-p", str(port), "INFO", "replication"],
        capture_output=True,
        text=True,
        timeout=5,
        check=False,
    ).stdout
    fields = dict(line.strip().split(":", 1) for line in info.splitlines() if ":" in line)
    return int(fields.get("slave_repl_offset") or fields["master_repl_offset"])


class LaggedFailover(Protocol):
    """A Redis primary whose replica falls behind, then the primary dies and the replica is
    promoted (tests/support/sentinel.py, tests/support/cluster.py)."""

    def begin_lag(self) -> None:
        """From now on the replica receives nothing from the primary."""

    def end_lag(self) -> Promotion:
        """Kill the primary, let the replica go on and wait until it is promoted."""


@dataclass
class Answered:
    verb: str
    schedule_id: str
    sent_ms: float
    reply_ms: float
    reply: dict[str, Any]


@dataclass
class LagScenario:
    """80 schedules firing (keep, delete, pause, move: 20 each, every other one with jitter);
    during the lag 20 deleted, 20 paused, 20 moved to a new URL and 20 created."""

    namespace: str
    sink: Sink
    workload: Workload = field(init=False)
    answered: list[Answered] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.workload = Workload(self.namespace)

    @staticmethod
    def ids(group: str) -> list[str]:
        return [f"{group}{i}" for i in range(GROUP)]

    def old_path(self, schedule_id: str) -> str:
        return f"/old/{schedule_id}"

    def new_path(self, schedule_id: str) -> str:
        return f"/new/{schedule_id}"

    async def register(self, client: CommandClient) -> None:
        bodies = [
            (i, self.old_path(i) if group == "m" else f"/{i}", jitter(n))
            for group in "kdpm"
            for n, i in enumerate(self.ids(group))
        ]
        await asyncio.gather(
            *(self.workload.add(client, i, f"{self.sink.url}{path}", j) for i, path, j in bodies)
        )

    async def _send(self, client: CommandClient, verb: str, schedule_id: str, body: Any) -> None:
        sent = now_ms()
        reply = await client.send(self.namespace, verb, body, timeout_s=90)
        self.answered.append(Answered(verb, schedule_id, sent, now_ms(), reply))

    async def change(self, client: CommandClient) -> None:
        """The 80 commands, all sent at once; each reply is recorded with its time."""
        url = self.sink.url
        sends = [
            *(self._send(client, "delete", i, {"id": i}) for i in self.ids("d")),
            *(self._send(client, "pause", i, {"id": i}) for i in self.ids("p")),
            # Only the URL changes (the same jitter): the rotation goes on, and fire_all owes
            # every occurrence of it, those due while the failover held firing back included.
            *(
                self._send(
                    client, "upsert", i, firing_body(i, f"{url}{self.new_path(i)}", jitter(n))
                )
                for n, i in enumerate(self.ids("m"))
            ),
            *(
                self._send(client, "upsert", i, firing_body(i, f"{url}/{i}", jitter(n)))
                for n, i in enumerate(self.ids("c"))
            ),
        ]
        await asyncio.gather(*sends)

    def replied(self, verb: str, group: str) -> dict[str, float]:
        return {
            a.schedule_id: a.reply_ms
            for a in self.answered
            if a.verb == verb and a.schedule_id.startswith(group)
        }

    def created(self) -> dict[str, int]:
        return {
            a.schedule_id: timefmt.parse_rfc3339_ms(a.reply["schedule"]["next_fires"][0])
            for a in self.answered
            if a.schedule_id.startswith("c")
        }

    def owed(self, until_ms: int) -> set[tuple[str, int]]:
        """Every occurrence of the kept, moved and created schedules up to ``until_ms``."""
        created = self.created()
        kept = self.workload.expected(until_ms, [*self.ids("k"), *self.ids("m")])
        return kept | {
            (i, t) for i, first in created.items() for t in range(first, until_ms + 1, 1000)
        }

    def verdict(self, until_ms: int) -> Verdict:
        return judge(
            self.workload.deliveries(self.sink),
            deleted=self.replied("delete", "d"),
            paused=self.replied("pause", "p"),
            moved=self.replied("upsert", "m"),
            old_path=self.old_path,
            created=self.created(),
            owed=self.owed(until_ms),
        )


@dataclass
class Figures:
    lag_s: float
    promotion: Promotion
    first_fire_s: float
    inside_window: int
    slowest_reply_s: float
    verdict: Verdict
    #: What the sweepers logged about repairing or rebuilding the index.
    repairs: list[str]
    tails: str

    def line(self, where: str) -> str:
        v = self.verdict
        late = max(v.created_late_ms, default=0.0) / 1000
        parts = [
            f"{where} failover, replica {self.lag_s:g}s behind",
            f"replication bytes never received {self.promotion.behind_bytes}",
            f"shards on the dead primary {len(self.promotion.shards or ()) or 'all'}",
            f"promoted {self.promotion.promoted_s:.1f}s after the kill",
            f"first occurrence of the dead primary's shards due after the kill delivered "
            f"{self.first_fire_s:.1f}s after it",
            f"commands answered inside the lag window {self.inside_window}/80",
            f"slowest reply {self.slowest_reply_s:.1f}s",
            f"fired after delete {len(v.fired_after_delete)}",
            f"fired after pause {len(v.fired_after_pause)}",
            f"old URL after move {len(v.old_url_after_move)}",
            f"created never fired {len(v.created_silent)} (first fire at most {late:.1f}s late)",
            f"fire_all lost {len(v.lost)}",
            f"duplicates {v.duplicates}",
            f"sweeper repairs: {' | '.join(self.repairs) or 'none'}",
        ]
        return "\n" + "; ".join(parts)

    def assert_nothing_undone(self, where: str) -> None:
        """Invariant 9, with the first few offending deliveries and the services' logs."""
        v = self.verdict
        found = {
            "fired after delete": v.fired_after_delete[:3],
            "fired after pause": v.fired_after_pause[:3],
            "old URL after move": v.old_url_after_move[:3],
            "created never fired": v.created_silent[:3],
            "fire_all lost": v.lost[:3],
        }
        broken = {what: first for what, first in found.items() if first}
        assert not broken, f"{self.line(where)}\nfirst of each: {broken}\n{self.tails}"


#: What a sweeper logs when it puts the index right (the words of its log lines).
REPAIR_WORDS = ("repair", "rebuil", "replay", "behind")


def repairs_logged(stack: Stack) -> list[str]:
    """The sweepers' log lines about repairing the index: time, message and counts."""
    found = []
    for proc in stack.procs.get("sweeper", []):
        for line in proc.log.read_text(errors="replace").splitlines():
            if not any(word in line for word in REPAIR_WORDS):
                continue
            try:
                record = json.loads(line)
            except ValueError:
                found.append(line.strip()[:160])
                continue
            counts = " ".join(
                f"{k}={v}" for k, v in record.items() if isinstance(v, int | float) and k != "ts"
            )
            found.append(f"{str(record.get('ts', ''))[11:23]} {record.get('msg', '')} {counts}")
    return found


async def run_lag_case(
    failover: LaggedFailover,
    env: dict[str, str],
    amqp_url: str,
    sink: Sink,
    logs: Path,
    lag_s: float,
    namespace: str,
) -> Figures:
    """The scenario end to end: services started, schedules firing, the replica held back for
    ``lag_s`` while the 80 commands are answered, the primary killed, the replica promoted;
    then enough time for a wrong index to show (three sweeps), and the deliveries judged."""
    stack = Stack(env, logs)
    scenario = LagScenario(namespace, sink)
    sweep_s = float(env.get("CRONBUS_SWEEP_INTERVAL_S", "1"))
    try:
        await stack.start_all(("dispatcher", "executor", "sweeper"))
        async with CommandClient(amqp_url) as client:
            await scenario.register(client)
            everyone = set(scenario.workload.first)

            def all_fired_twice(s: Sink) -> bool:
                counts = Counter(d.schedule_id for d in scenario.workload.deliveries(s))
                return all(counts[i] >= 2 for i in everyone)

            assert await sink.wait_for(all_fired_twice, 30), stack.tails()
            await asyncio.to_thread(failover.begin_lag)
            cut_ms = now_ms()
            changing = asyncio.create_task(scenario.change(client))
            await asyncio.sleep(max(0.0, lag_s - (now_ms() - cut_ms) / 1000))
            promotion = await asyncio.to_thread(failover.end_lag)
            kill_ms = promotion.killed_ms
            await asyncio.wait_for(changing, 120)
            # A wrong index shows within a few sweeps: wait that long before judging.
            await asyncio.sleep(max(8.0, 3 * sweep_s))
        until_ms = int(now_ms()) - 2000
        owed = scenario.owed(until_ms)
        await sink.wait_for(lambda s: owed <= scenario.workload.delivered(s), 40)
        await asyncio.sleep(1.5)  # late duplicates, if any, arrive meanwhile
        for name in ("dispatcher", "executor", "sweeper"):
            assert len(stack.running(name)) == 1, f"{name} died:\n{stack.tails()}"
        refused = [a.reply for a in scenario.answered if not a.reply.get("ok")]
        assert refused == [], refused
        count = int(env.get("CRONBUS_SHARDS", "16"))
        failed = promotion.shards or frozenset(range(count))
        after_kill = [
            d.at_ms
            for d in scenario.workload.deliveries(sink)
            if d.nominal_ms > kill_ms and keys.shard_of(namespace, d.schedule_id, count) in failed
        ]
        return Figures(
            lag_s=lag_s,
            promotion=promotion,
            first_fire_s=(min(after_kill, default=kill_ms) - kill_ms) / 1000,
            inside_window=sum(1 for a in scenario.answered if a.reply_ms < kill_ms),
            slowest_reply_s=max((a.reply_ms - a.sent_ms for a in scenario.answered), default=0)
            / 1000,
            verdict=scenario.verdict(until_ms),
            repairs=repairs_logged(stack),
            tails=stack.tails(),
        )
    finally:
        stack.stop_all()
