"""Operating cronbus like a hosted scheduler, end to end with two executors: exclusions,
per-schedule stats, auto-pause."""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cronbus.cli.sink import Sink
from shared.contract import codec, timefmt
from tests.e2e.test_firing import events_queue
from tests.support.commands import CommandClient
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

    printed = cli(amqp_url, "get", "flaky", "-n", "acme", "-o", "json")
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


def worst_window(arrivals_ms: list[float], window_ms: float) -> int:
    """Most arrivals in any window of ``window_ms`` (each window starts at an arrival)."""
    ordered = sorted(arrivals_ms)
    worst, start = 0, 0
    for end, at in enumerate(ordered):
        while at - ordered[start] >= window_ms:
            start += 1
        worst = max(worst, end - start + 1)
    return worst


async def test_a_rate_limit_holds_across_two_executors_and_drops_nothing(
    stack: Stack, sink: Sink, client: CommandClient
) -> None:
    await stack.start_all(TWO_EXECUTORS)
    count, per_s, burst = 60, 5, 5
    start_ms = (int(time.time()) + 4) * 1000
    schedules = [
        {
            "id": f"r{i}",
            # All due at once; `skip` would drop any that is judged late a second time.
            "spec": {"kind": "interval", "every_s": 3600, "start_at": timefmt.format_ms(start_ms)},
            "misfire": {"policy": "skip"},
            "target": webhook(sink, rate_limit={"per_s": per_s, "burst": burst}),
        }
        for i in range(count)
    ]
    reply = await client.send("acme", "upsert_many", {"schedules": schedules})
    if not reply.get("ok"):  # before the bulk verb lands: one upsert each
        for item in schedules:
            single = await client.send("acme", "upsert", {"schedule": item})
            assert single["ok"], single
    assert await sink.wait_for(lambda s: len(s.received) >= count, timeout_s=40), stack.tails()
    await asyncio.sleep(1)
    arrivals = [r.at_ms for r in sink.received]
    assert len(arrivals) == count
    assert {r.schedule for r in sink.received} == {f"acme/r{i}" for i in range(count)}
    assert {r.fire_time for r in sink.received} == {timefmt.format_ms(start_ms)}
    worst = worst_window(arrivals, 5000)
    print(f"rate limit {per_s}/s burst {burst}: worst 5 s window {worst} deliveries")
    assert worst <= burst + 5 * per_s + 1, worst
    drain_s = (max(arrivals) - min(arrivals)) / 1000
    assert drain_s >= (count - burst) / per_s - 1.5, drain_s
    # Parked until slots free up, not re-polled: a few holds per occurrence at most.
    scraped = [
        (await asyncio.to_thread(proc.get, "/metrics"))[1] for proc in stack.running("executor")
    ]
    held = sum(metric_sum(text, "cronbus_rate_held_total") for text in scraped)
    print(f"held {held:.0f} times for {count} occurrences")
    assert held <= 3 * count, held


async def test_retry_after_delays_the_attempt_and_holds_the_rate_key(
    stack: Stack, sink: Sink, client: CommandClient
) -> None:
    asked_s = 3
    answered = {"/slow": 0}

    def respond(request: Any) -> int:
        if request.path == "/slow":
            answered["/slow"] += 1
            return 429 if answered["/slow"] == 1 else 200
        return 200

    sink.respond = respond
    sink.headers_by_status = {429: {"Retry-After": str(asked_s)}}
    await stack.start_all(TWO_EXECUTORS)
    for schedule_id, path in (("slow", "/slow"), ("neighbour", "/other")):
        reply = await client.send(
            "acme",
            "upsert",
            {
                "schedule": {
                    "id": schedule_id,
                    "spec": {"kind": "interval", "every_s": 1},
                    "target": webhook(sink, path),
                    "retry": {"max_attempts": 3, "initial_backoff_s": 0.1, "full_jitter": False},
                }
            },
        )
        assert reply["ok"], reply
    assert await sink.wait_for(
        lambda s: sum(r.path == "/slow" for r in s.received) >= 2, timeout_s=20
    ), stack.tails()
    slow = [r for r in sink.received if r.path == "/slow"]
    refused_at, retried = slow[0].at_ms, slow[1]
    assert retried.attempt == 2 and retried.fire_time == slow[0].fire_time
    delay_s = (retried.at_ms - refused_at) / 1000
    print(f"Retry-After {asked_s} s: next attempt after {delay_s:.2f} s")
    assert asked_s <= delay_s < asked_s + 1.5, delay_s
    # The neighbour shares the rate key (same scheme://host:port): held meanwhile.
    during = [
        r.at_ms - refused_at
        for r in sink.received
        if r.path == "/other" and 300 < r.at_ms - refused_at < asked_s * 1000 - 100
    ]
    assert during == [], during
    assert await sink.wait_for(
        lambda s: any(
            r.path == "/other" and r.at_ms > refused_at + asked_s * 1000 for r in s.received
        ),
        timeout_s=10,
    )


async def test_a_circuit_breaker_opens_shared_by_executors_then_probes(
    stack: Stack, sink: Sink, client: CommandClient
) -> None:
    sink.respond = lambda _: 500
    await stack.start_all(
        TWO_EXECUTORS, CRONBUS_BREAKER_FAILURES="3", CRONBUS_BREAKER_COOLDOWN_S="3"
    )
    for i in range(3):
        reply = await client.send(
            "acme",
            "upsert",
            {
                "schedule": {
                    "id": f"down{i}",
                    "spec": {"kind": "interval", "every_s": 1},
                    "target": webhook(sink, rate_key="billing-api"),
                    "retry": {"max_attempts": 1},
                }
            },
        )
        assert reply["ok"], reply
    assert await sink.wait_for(lambda s: len(s.received) >= 3, timeout_s=15), stack.tails()
    await asyncio.sleep(0.5)
    shown = await client.send("acme", "get", {"id": "down0"})
    breaker = shown["schedule"]["breaker"]
    assert breaker["rate_key"] == "billing-api" and breaker["state"] == "open", breaker
    opened_at = sink.received[2].at_ms
    await asyncio.sleep(6)
    later = [r.at_ms - opened_at for r in sink.received[3:]]
    # Nothing during the cooldown (a few in flight when it opened may land just after),
    # then one probe per cooldown: it fails, and the breaker opens again.
    assert all(t < 300 or t >= 2900 for t in later), later
    probes = [t for t in later if t >= 2900]
    assert 1 <= len(probes) <= 2, later
    scraped = [
        (await asyncio.to_thread(proc.get, "/metrics"))[1] for proc in stack.running("executor")
    ]
    opened = sum(
        metric_sum(text, 'cronbus_breaker_transitions_total{namespace="acme",state="open"}')
        for text in scraped
    )
    assert opened >= 2


async def test_a_path_answering_404_does_not_open_the_breaker_for_its_neighbours(
    stack: Stack, sink: Sink, client: CommandClient
) -> None:
    """Issue 26: a 404 is the host answering about one request. A schedule whose path is
    missing, beside a healthy one on the same host (one rate key), must not open the breaker:
    the healthy one keeps its every-second deliveries, with nothing held."""
    sink.respond = lambda request: 404 if request.path == "/missing" else 200
    await stack.start_all(
        TWO_EXECUTORS, CRONBUS_BREAKER_FAILURES="3", CRONBUS_BREAKER_COOLDOWN_S="5"
    )
    for schedule_id, path in (("gone", "/missing"), ("healthy", "/hook")):
        reply = await client.send(
            "acme",
            "upsert",
            {
                "schedule": {
                    "id": schedule_id,
                    "spec": {"kind": "interval", "every_s": 1},
                    "target": webhook(sink, path),
                    "retry": {"max_attempts": 2, "initial_backoff_s": 0.1, "full_jitter": False},
                }
            },
        )
        assert reply["ok"], reply
    assert await sink.wait_for(
        lambda s: sum(r.path == "/missing" for r in s.received) >= 8, timeout_s=20
    ), stack.tails()
    await asyncio.sleep(4)
    misses = [r.at_ms for r in sink.received if r.path == "/missing"]
    healthy = sorted(r.at_ms for r in sink.received if r.path == "/hook" and r.at_ms > misses[2])
    gaps = [b - a for a, b in itertools.pairwise(healthy)]
    # Every second; an open breaker (cooldown 5 s) would leave a gap of 5 s or more.
    assert len(healthy) >= 6 and max(gaps) < 3000, (len(healthy), gaps)
    shown = await client.send("acme", "get", {"id": "healthy"})
    breaker = shown["schedule"].get("breaker")
    assert breaker is None or breaker["state"] == "closed", breaker
    scraped = [
        (await asyncio.to_thread(proc.get, "/metrics"))[1] for proc in stack.running("executor")
    ]
    held = sum(metric_sum(text, 'cronbus_rate_held_total{namespace="acme"}') for text in scraped)
    opened = sum(
        metric_sum(text, 'cronbus_breaker_transitions_total{namespace="acme",state="open"}')
        for text in scraped
    )
    assert held == 0 and opened == 0, (held, opened)


async def test_quotas_refuse_schedules_over_max_and_delay_fires_over_the_rate(
    stack: Stack, sink: Sink, client: CommandClient, tmp_path: Path
) -> None:
    quota_file = tmp_path / "quotas.json"
    quota_file.write_text('{"acme": {"max_schedules": 2}, "busy": {"max_fires_per_s": 4}, "*": {}}')
    await stack.start_all(TWO_EXECUTORS, CRONBUS_QUOTAS_FILE=str(quota_file))

    def one(schedule_id: str, **spec: Any) -> dict[str, Any]:
        return {
            "schedule": {
                "id": schedule_id,
                "spec": {"kind": "interval", "every_s": 3600, **spec},
                "target": webhook(sink),
            }
        }

    for schedule_id in ("x1", "x2"):
        assert (await client.send("acme", "upsert", one(schedule_id)))["ok"]
    refused = await client.send("acme", "upsert", one("x3"))
    assert refused["ok"] is False and refused["error"]["code"] == "quota_exceeded", refused
    assert refused["error"]["details"][0]["field"] == "id"
    assert (await client.send("acme", "get", {"id": "x3"}))["error"]["code"] == "not_found"
    assert (await client.send("acme", "upsert", one("x1", every_s=1800)))["ok"]  # an update
    assert (await client.send("acme", "delete", {"id": "x2"}))["ok"]
    assert (await client.send("acme", "upsert", one("x3")))["ok"]

    start_ms = (int(time.time()) + 3) * 1000
    start = timefmt.format_ms(start_ms)
    for i in range(20):
        assert (await client.send("busy", "upsert", one(f"b{i}", start_at=start)))["ok"]
    for i in range(3):
        assert (await client.send("calm", "upsert", one(f"c{i}", start_at=start)))["ok"]
    assert await sink.wait_for(
        lambda s: sum(r.schedule.startswith("busy/") for r in s.received) >= 20, timeout_s=30
    ), stack.tails()
    busy = sorted(r.at_ms for r in sink.received if r.schedule.startswith("busy/"))
    calm = [r.at_ms - start_ms for r in sink.received if r.schedule.startswith("calm/")]
    print(f"busy: 20 fires over {(busy[-1] - busy[0]) / 1000:.2f} s at max_fires_per_s 4")
    assert busy[-1] - busy[0] >= (20 - 4) / 4 * 1000 - 1000
    assert worst_window(busy, 1000) <= 4 + 4 + 1
    assert len(calm) == 3 and max(calm) < 1500, calm


async def test_a_herd_in_one_namespace_does_not_delay_another(
    stack: Stack, sink: Sink, client: CommandClient, stack_env: dict[str, str]
) -> None:
    from cronbus.bench import harness  # noqa: PLC0415

    sink.delay_s = 0.02  # a target that takes 20 ms: with 10 slots per executor, ~1000/s
    sink.keep = True
    # Little in flight (claims of 100, a short deliveries queue, small prefetch): the herd waits
    # in Redis, where only fair claims can let the other namespace through.
    await stack.start_all(
        TWO_EXECUTORS,
        CRONBUS_SHARDS="16",
        CRONBUS_CLAIM_BATCH="100",
        CRONBUS_CONCURRENCY="10",
        CRONBUS_PREFETCH="2",
        CRONBUS_DELIVERIES_HIGH_WATER="2",
    )
    found = harness.Corner(
        stack_env["CRONBUS_REDIS_URL"],
        stack_env["CRONBUS_REDIS_PREFIX"],
        stack_env["CRONBUS_AMQP_URL"],
        stack_env["CRONBUS_DATABASE_URL"],
    )
    # Both namespaces in place well before the instant they are due (importing 3,000 takes
    # seconds on a busy machine: the herd must not start while the few are still on the way).
    due_ms = (int(time.time()) + 15) * 1000
    # "zulu" sorts after "alpha": without fair claims its entries would come last.
    await harness.seed(found, harness.herd_lines(20, due_ms, f"{sink.url}/b"), "zulu")
    await harness.seed(found, harness.herd_lines(3000, due_ms, f"{sink.url}/a"), "alpha")
    assert time.time() * 1000 < due_ms, "the import ran past the due time"
    arrived = await sink.wait_for(lambda s: len(s.received) >= 3020, timeout_s=90)
    by_namespace = collections.Counter(r.schedule.split("/")[0] for r in sink.received)
    assert arrived, (by_namespace, stack.tails())
    herd_last = max(r.at_ms for r in sink.received if r.schedule.startswith("alpha/"))
    few = sorted(r.at_ms - due_ms for r in sink.received if r.schedule.startswith("zulu/"))
    print(f"herd drained in {(herd_last - due_ms) / 1000:.2f} s; few: worst {few[-1]:.0f} ms")
    assert len(few) == 20
    assert few[-1] < (herd_last - due_ms) / 3, (few, herd_last - due_ms)
