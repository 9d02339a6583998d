"""Operating cronbus like a hosted scheduler, end to end with two executors: exclusions,
per-schedule stats, auto-pause."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cronbus.client import CommandClient
from cronbus.sink import Sink
from shared import codec, timefmt
from tests.e2e.test_firing import events_queue
from tests.support.stack import Stack

TWO_EXECUTORS = ("dispatcher", "executor", "executor")


def webhook(sink: Sink, path: str = "/hook", **extra: Any) -> dict[str, Any]:
    return {"kind": "webhook", "url": f"{sink.url}{path}", **extra}


def second_of(rfc3339: str) -> int:
    return timefmt.parse_rfc3339_ms(rfc3339) // 1000 % 60


async def get_until(
    client: CommandClient,
    namespace: str,
    schedule_id: str,
    done: Callable[[dict[str, Any]], bool],
    timeout_s: float = 20,
) -> dict[str, Any]:
    """Poll ``get`` until ``done(schedule)`` holds (stats are written in batches)."""
    deadline = time.monotonic() + timeout_s
    while True:
        reply = await client.send(namespace, "get", {"id": schedule_id})
        assert reply["ok"], reply
        if done(reply["schedule"]) or time.monotonic() > deadline:
            return dict(reply["schedule"])
        await asyncio.sleep(0.3)


def cli(amqp_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).parent / "cronbus"
    env = {**os.environ, "CRONBUS_AMQP_URL": amqp_url}
    return subprocess.run(
        [str(exe), *args], capture_output=True, text=True, timeout=60, env=env, check=False
    )


async def test_excluded_times_are_neither_delivered_nor_shown_and_are_counted(
    stack: Stack, sink: Sink, client: CommandClient
) -> None:
    await stack.start_all(TWO_EXECUTORS)
    reply = await client.send(
        "acme",
        "upsert",
        {
            "schedule": {
                "id": "odd-seconds",
                # Every second, except the even ones (a 6-field cron covers one second).
                "spec": {"kind": "interval", "every_s": 1, "exclude": [{"cron": "*/2 * * * * *"}]},
                "target": webhook(sink),
            }
        },
    )
    assert reply["ok"], reply
    shown = reply["schedule"]["next_fires"]
    assert len(shown) == 5 and all(second_of(t) % 2 == 1 for t in shown), shown
    assert reply["schedule"]["spec"]["exclude"] == [{"cron": "*/2 * * * * *"}]
    assert await sink.wait_for(lambda s: len(s.received) >= 4, timeout_s=15), stack.tails()
    fired = [second_of(r.fire_time) for r in sink.received]
    assert all(second % 2 == 1 for second in fired), fired
    shown = await get_until(client, "acme", "odd-seconds", lambda s: s["stats"]["excluded"] >= 3)
    assert shown["stats"]["excluded"] >= 3, shown["stats"]
    assert shown["stats"]["fires"] >= 3

    refused = await client.send(
        "acme",
        "upsert",
        {
            "schedule": {
                "id": "never",
                "spec": {"kind": "cron", "expr": "0 9 * * *", "exclude": [{"cron": "* * * * *"}]},
                "target": webhook(sink),
            }
        },
    )
    assert refused["ok"] is False
    assert refused["error"]["code"] == "invalid_schedule"
    assert refused["error"]["details"][0]["field"] == "spec.exclude"
    missing = await client.send("acme", "get", {"id": "never"})
    assert missing["error"]["code"] == "not_found"


async def test_stats_count_each_outcome_and_cronbus_get_shows_them(
    stack: Stack, sink: Sink, client: CommandClient, amqp_url: str
) -> None:
    failures_left = [3]

    def respond(_: object) -> int:
        if failures_left[0] > 0:
            failures_left[0] -= 1
            return 500
        return 200

    sink.respond = respond
    await stack.start_all(TWO_EXECUTORS)
    reply = await client.send(
        "acme",
        "upsert",
        {
            "schedule": {
                "id": "flaky",
                "spec": {"kind": "interval", "every_s": 1},
                "target": webhook(sink),
                "retry": {"max_attempts": 2, "initial_backoff_s": 0.1, "full_jitter": False},
            }
        },
    )
    assert reply["ok"], reply
    # 1st occurrence: 500, 500 -> dead. 2nd: 500, 200 -> succeeded. Then successes.
    shown = await get_until(client, "acme", "flaky", lambda s: s["stats"]["succeeded"] >= 3)
    counted = shown["stats"]
    assert counted["failed"] == 3 and counted["dead"] == 1, counted
    assert counted["succeeded"] >= 3 and counted["fires"] >= counted["succeeded"] + 1, counted
    assert counted["consecutive_failures"] == 0 and counted["last_status"] == "succeeded"
    assert counted["last_fire_at"] is not None and counted["skipped"] == 0
    assert shown["paused_reason"] is None

    listed = await client.send("acme", "list", {})
    assert listed["schedules"][0]["stats"]["dead"] == 1

    printed = cli(amqp_url, "get", "flaky", "-n", "acme")
    assert printed.returncode == 0, printed.stderr
    assert '"stats":' in printed.stdout and '"dead":1' in printed.stdout, printed.stdout


def metric_sum(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


async def test_consecutive_dead_occurrences_pause_the_schedule_until_resumed(
    stack: Stack, sink: Sink, client: CommandClient, amqp_url: str
) -> None:
    healthy = [False]
    sink.respond = lambda _: 200 if healthy[0] else 503
    await stack.start_all(TWO_EXECUTORS)
    async with events_queue(amqp_url, "acme.paused") as events:
        reply = await client.send(
            "acme",
            "upsert",
            {
                "schedule": {
                    "id": "hammer",
                    "spec": {"kind": "interval", "every_s": 1},
                    "target": webhook(sink),
                    "retry": {"max_attempts": 1},
                    "pause_after_failures": 3,
                }
            },
        )
        assert reply["ok"], reply
        assert reply["schedule"]["pause_after_failures"] == 3
        event = await events.get(within_s=20)
        assert event is not None, stack.tails()
        body = codec.loads(event.body)
        assert body["outcome"] == "paused" and body["reason"] == "failures"
        assert body["id"] == "hammer" and body["consecutive_failures"] >= 3

    shown = await get_until(client, "acme", "hammer", lambda s: s["state"] == "paused")
    assert shown["state"] == "paused" and shown["paused_reason"] == "failures", shown
    assert shown["next_fires"] == []
    # Out of rotation for real: nothing more reaches the target.
    await asyncio.sleep(1.5)
    delivered = len(sink.received)
    assert delivered == 3, [r.fire_time for r in sink.received]
    await asyncio.sleep(2.5)
    assert len(sink.received) == delivered
    scraped = [
        (await asyncio.to_thread(proc.get, "/metrics"))[1] for proc in stack.running("executor")
    ]
    assert sum(metric_sum(text, "cronbus_auto_paused_total") for text in scraped) == 1

    healthy[0] = True
    resumed = await client.send("acme", "resume", {"id": "hammer"})
    assert resumed["ok"], resumed
    assert resumed["schedule"]["state"] == "active"
    assert await sink.wait_for(lambda s: len(s.received) >= delivered + 2, timeout_s=10)
    after = await get_until(client, "acme", "hammer", lambda s: s["stats"]["succeeded"] >= 2)
    assert after["paused_reason"] is None and after["state"] == "active"
    assert after["stats"]["dead"] == 3 and after["stats"]["consecutive_failures"] == 0
