"""cronbus on a RabbitMQ cluster of three nodes started by the test (loopback ports, stopped
by PID): the node leading ``cronbus.deliveries`` killed with SIGKILL while commands flow and
schedules fire under ``fire_all``, then (that node back) the one leading a command partition.

The services are given the three URLs. Judged from outside: no deleted or paused schedule
fires after its reply, no ``fire_all`` occurrence is lost, every command sent is answered ok;
duplicates, and how long firing and the intake took to resume, are counted and printed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import pytest

from cronbus.cli.sink import Sink
from cronbus.client import Client, NoReply
from shared.contract import keys
from tests.support import failover, services
from tests.support.failover import Workload, firing_body
from tests.support.rabbitcluster import ClusterNode, RabbitCluster, rabbit_cluster
from tests.support.stack import Stack

pytestmark = [
    pytest.mark.rabbitcluster,
    pytest.mark.timeout(240),
    pytest.mark.xfail(
        strict=False,
        reason="known (issue 39's closing note): after the node leading cronbus.deliveries is "
        "killed, firing resumes but commands sent after the kill get no reply within 30 s "
        "(a client or intake connection that was on the killed node does not get its "
        "channels back on the next node in time); the partition-leader kill is not reached",
    ),
]

SCHEDULES = 8
#: Deleted and paused just after each kill.
CHANGED = 6


@pytest.fixture(scope="module")
def cluster() -> Iterator[RabbitCluster]:
    with rabbit_cluster() as found:
        yield found


@dataclass
class Commands:
    """A new schedule every 0.2 s, each reply timed (an occurrence an hour away)."""

    client: Client
    namespace: str
    sent: list[tuple[float, float | None]] = field(default_factory=list)
    refused: list[object] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        i = 0
        while not stop.is_set() and i < 600:
            sent = time.time() * 1000
            reply = await self.client.send(
                self.namespace,
                "upsert",
                {
                    "schedule": {
                        "id": f"c{i}",
                        "spec": {"kind": "interval", "every_s": 3600},
                        "target": {"kind": "webhook", "url": "http://127.0.0.1:9/c"},
                    }
                },
                timeout_s=60,
            )
            if reply.get("ok"):
                self.sent.append((sent, time.time() * 1000))
            else:
                self.refused.append(reply)
            i += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)

    def resumed_s(self, kill_ms: float) -> float:
        """From the kill to the first reply to a command sent after it."""
        replies = [r for s, r in self.sent if s > kill_ms and r is not None]
        return (min(replies) - kill_ms) / 1000 if replies else float("inf")


@dataclass
class Round:
    """One node killed, as measured."""

    killed: ClusterNode
    kill_ms: float
    deleted: dict[str, float]
    paused: dict[str, float]
    firing_resumed_s: float
    intake_resumed_s: float = 0.0


def _broker_state(cluster: RabbitCluster, vhost: str) -> str:
    """What the broker holds when a command got no reply: its queues and who is connected."""
    where = quote(vhost, safe="")
    lines = ["queues (ready, unacked, consumers, leader):"]
    for q in cluster.api(f"/api/queues/{where}"):
        lines.append(
            f"  {q['name']}: {q.get('messages_ready')} {q.get('messages_unacknowledged')} "
            f"{q.get('consumers')} {q.get('leader')}"
        )
    lines.append("connections (node, name):")
    for c in cluster.api(f"/api/vhosts/{where}/connections"):
        name = (c.get("client_properties") or {}).get("connection_name")
        lines.append(f"  {c.get('node')} {name}")
    return "\n".join(lines)


async def _kill_and_judge(
    cluster: RabbitCluster,
    queue: str,
    vhost: str,
    client: Client,
    workload: Workload,
    sink: Sink,
    stack: Stack,
    round_: int,
) -> Round:
    leader = cluster.node_named(cluster.leader_of(vhost, queue))
    leader.kill()
    kill_ms = time.time() * 1000
    # Deleted and paused while the cluster is electing new leaders: none may fire again.
    deleted: dict[str, float] = {}
    paused: dict[str, float] = {}
    diagnosed: list[bool] = []  # the broker's state printed once per round

    async def change(verb: str, schedule_id: str, into: dict[str, float]) -> None:
        sent = time.time()
        try:
            reply = await client.send(workload.namespace, verb, {"id": schedule_id}, timeout_s=30)
        except NoReply:
            print(f"\n{verb} {schedule_id}: no reply within 30s of {sent - kill_ms / 1000:.1f}s")
            if not diagnosed:
                diagnosed.append(True)
                try:
                    print(_broker_state(cluster, vhost))
                except (RuntimeError, OSError, KeyError, TypeError) as exc:
                    print(f"broker state unavailable: {exc!r}")
            return
        assert reply.get("ok"), reply
        into[schedule_id] = time.time() * 1000

    await asyncio.gather(
        *(change("delete", f"d{round_}_{i}", deleted) for i in range(CHANGED)),
        *(change("pause", f"p{round_}_{i}", paused) for i in range(CHANGED)),
    )

    def served_after_kill(s: Sink) -> bool:
        return any(
            d.nominal_ms > kill_ms and d.schedule_id.startswith("f") for d in workload.deliveries(s)
        )

    resumed = await sink.wait_for(served_after_kill, 40)
    assert resumed, stack.tails()
    first_ms = min(
        d.at_ms
        for d in workload.deliveries(sink)
        if d.nominal_ms > kill_ms and d.schedule_id.startswith("f")
    )
    await asyncio.sleep(4)
    return Round(leader, kill_ms, deleted, paused, (first_ms - kill_ms) / 1000)


async def test_killing_the_deliveries_leader_then_a_partition_leader_undoes_nothing(
    cluster: RabbitCluster,
    sink: Sink,
    endpoints: services.Endpoints,
    redis_prefix: str,
    database_url: str,
    tmp_path: Path,
) -> None:
    vhost = services.unique("cbrc")
    cluster.add_vhost(vhost)
    url = cluster.url_of(vhost)
    env = failover.services_env(
        {"CRONBUS_REDIS_URL": endpoints.redis_url},
        redis_prefix,
        url,
        database_url,
        shards=4,
        sweep_interval_s=1,
    )
    stack = Stack(env, tmp_path)
    stop = asyncio.Event()
    rounds: list[Round] = []
    try:
        await stack.start_all(("dispatcher", "executor", "sweeper"))
        workload = Workload(services.unique("ns").lower())
        async with Client(url, timeout_s=60) as client:
            for i in range(SCHEDULES):
                await workload.add(client, f"f{i}", f"{sink.url}/f{i}", 0.0)
            for round_ in range(2):
                for i in range(CHANGED):
                    for group in "dp":
                        schedule_id = f"{group}{round_}_{i}"
                        reply = await client.send(
                            workload.namespace,
                            "upsert",
                            firing_body(schedule_id, f"{sink.url}/{schedule_id}"),
                        )
                        assert reply["ok"], reply
            commands = Commands(client, workload.namespace)
            flowing = asyncio.create_task(commands.run(stop))
            assert await sink.wait_for(lambda s: len(workload.delivered(s)) >= SCHEDULES * 3, 20), (
                stack.tails()
            )

            first = await _kill_and_judge(
                cluster, keys.DELIVERIES_QUEUE, vhost, client, workload, sink, stack, 0
            )
            first.intake_resumed_s = commands.resumed_s(first.kill_ms)
            rounds.append(first)
            await asyncio.to_thread(first.killed.start)
            await asyncio.sleep(3)  # it rejoins its queues

            second = await _kill_and_judge(
                cluster, keys.partition_queue(0), vhost, client, workload, sink, stack, 1
            )
            second.intake_resumed_s = commands.resumed_s(second.kill_ms)
            rounds.append(second)
            stop.set()
            await asyncio.wait_for(flowing, 90)

        until_ms = int(time.time() * 1000) - 1500
        owed = workload.expected(until_ms, [f"f{i}" for i in range(SCHEDULES)])
        await sink.wait_for(lambda s: owed <= workload.delivered(s), 40)
        await asyncio.sleep(1.5)  # late duplicates, if any, arrive meanwhile
        deleted = {k: v for r in rounds for k, v in r.deleted.items()}
        paused = {k: v for r in rounds for k, v in r.paused.items()}
        verdict = failover.judge(
            workload.deliveries(sink),
            deleted=deleted,
            paused=paused,
            moved={},
            old_path=lambda i: "",
            created={},
            owed=owed,
        )
        for name in ("dispatcher", "executor", "sweeper"):
            assert len(stack.running(name)) == 1, f"{name} died:\n{stack.tails()}"
        for where, found in zip(("deliveries leader", "partition leader"), rounds, strict=True):
            print(
                f"\nrabbitmq cluster, node leading the {where} killed: firing resumed "
                f"{found.firing_resumed_s:.1f}s after the kill, intake answered again "
                f"{found.intake_resumed_s:.1f}s after it"
            )
        for where, found in zip(("deliveries leader", "partition leader"), rounds, strict=True):
            # A run with every command after a kill unanswered passed before: judged now.
            assert found.intake_resumed_s < 40, f"intake never answered after the {where} kill"
        print(
            f"rabbitmq cluster: commands answered ok {len(commands.sent)}, refused "
            f"{len(commands.refused)}; fired after delete {len(verdict.fired_after_delete)}, "
            f"after pause {len(verdict.fired_after_pause)}, fire_all lost {len(verdict.lost)} "
            f"of {len(owed)}, duplicates {verdict.duplicates}"
        )
        assert verdict.fired_after_delete == [], stack.tails()
        assert verdict.fired_after_pause == [], stack.tails()
        assert verdict.lost == [], stack.tails()
        assert commands.refused == []
    finally:
        stop.set()
        stack.stop_all()
