"""Backfills as a user sees them, with the services as processes and two executors: the past
replayed oldest first with the regular keys, one occurrence of a schedule at a target at a time
while its rotation goes on, pause, replacement, a killed executor, and `get`."""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from typing import Any

from cronbus.cli.sink import Received, Sink
from shared.contract import timefmt
from shared.redis.index import Index
from shared.rules import schedule
from tests.e2e.test_operations import cli, get_until
from tests.e2e.test_triggers import wait_until
from tests.integration.test_console import _client as console_client
from tests.support.commands import CommandClient
from tests.support.stack import Stack

NS = "acme"
SERVICES = ("dispatcher", "executor", "executor", "sweeper")
SECOND = 1000
#: The sink answers each delivery this long after it arrives: overlaps would show.
SLOW_S = 0.2


def every_second(sink: Sink, schedule_id: str, **extra: Any) -> dict[str, Any]:
    return {
        "id": schedule_id,
        "spec": {"kind": "interval", "every_s": 1},
        "target": {"kind": "webhook", "url": f"{sink.url}/{schedule_id}", "timeout_s": 5},
        **extra,
    }


def past_window(seconds_ago: int, length_s: int) -> tuple[int, int]:
    """[from, to) on whole seconds, in the past."""
    start = (int(time.time()) - seconds_ago) * SECOND
    return start, start + length_s * SECOND


def backfill_body(schedule_id: str, window: tuple[int, int], **extra: Any) -> dict[str, Any]:
    return {
        "id": schedule_id,
        "from": timefmt.format_ms(window[0]),
        "to": timefmt.format_ms(window[1]),
        **extra,
    }


def of(sink: Sink, schedule_id: str) -> list[Received]:
    return [r for r in sink.received if r.path == f"/{schedule_id}"]


def backfilled(sink: Sink, schedule_id: str) -> list[Received]:
    return [r for r in of(sink, schedule_id) if r.headers.get("x-cronbus-backfill") == "true"]


def nominal(request: Received) -> int:
    return timefmt.parse_rfc3339_ms(request.fire_time)


def overlaps(requests: list[Received]) -> list[tuple[str, str]]:
    """Deliveries of one schedule that reached the target while another was unanswered."""
    found = []
    ordered = sorted(requests, key=lambda r: r.at_ms)
    for earlier, later in itertools.pairwise(ordered):
        if later.at_ms < earlier.answered_ms:
            found.append((earlier.fire_time, later.fire_time))
    return found


def has_regular_keys(requests: list[Received], schedule_id: str) -> bool:
    return all(r.key == schedule.idempotency_key(NS, schedule_id, nominal(r)) for r in requests)


async def start(stack: Stack, sink: Sink, **env: str) -> None:
    sink.delay_s = SLOW_S
    await stack.start_all(SERVICES, **env)


async def upsert(client: CommandClient, body: dict[str, Any]) -> None:
    reply = await client.send(NS, "upsert", {"schedule": body})
    assert reply["ok"], reply


async def remaining(client: CommandClient, schedule_id: str) -> int | None:
    reply = await client.send(NS, "get", {"id": schedule_id})
    assert reply["ok"], reply
    shown = reply["schedule"].get("backfill")
    return None if shown is None else int(shown["remaining"])


async def test_a_backfill_replays_the_past_in_order_one_at_a_time_beside_the_rotation(
    stack: Stack, sink: Sink, client: CommandClient
) -> None:
    await start(stack, sink)
    await upsert(client, every_second(sink, "ticks"))
    cron = {
        "id": "cron",
        "spec": {"kind": "cron", "expr": "*/3 * * * * *", "timezone": "Europe/Berlin"},
        "target": {"kind": "webhook", "url": f"{sink.url}/cron", "timeout_s": 5},
    }
    await upsert(client, cron)
    assert await sink.wait_for(lambda s: len(of(s, "ticks")) >= 2, timeout_s=15), stack.tails()

    window = past_window(300, 20)
    reply = await client.send(NS, "backfill", backfill_body("ticks", window))
    assert reply == {"ok": True, "backfill": {"occurrences": 20}}, reply
    cron_window = past_window(600, 30)
    reply = await client.send(NS, "backfill", backfill_body("cron", cron_window))
    assert reply == {"ok": True, "backfill": {"occurrences": 10}}, reply

    seen: list[int | None] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        seen.append(await remaining(client, "ticks"))
        if seen[-1] is None and len(backfilled(sink, "cron")) >= 10:
            break
        await asyncio.sleep(0.5)
    # `get` showed it running, counting down, then not at all.
    counts = [n for n in seen if n is not None]
    assert counts and counts == sorted(counts, reverse=True) and seen[-1] is None, seen
    assert any(0 < n < 20 for n in counts), seen

    ticks = backfilled(sink, "ticks")
    assert [nominal(r) for r in ticks] == list(range(window[0], window[1], SECOND))
    assert has_regular_keys(ticks, "ticks")
    assert {r.attempt for r in ticks} == {1}
    crons = backfilled(sink, "cron")
    expected = [t for t in range(cron_window[0], cron_window[1], SECOND) if t // SECOND % 3 == 0]
    assert [nominal(r) for r in crons] == expected
    assert has_regular_keys(crons, "cron")
    # The rotation went on meanwhile, and never beside a backfill delivery.
    first, last = ticks[0].at_ms, ticks[-1].answered_ms
    regular = [r for r in of(sink, "ticks") if r not in ticks and first <= r.at_ms <= last]
    assert len(regular) >= 2, "the regular rotation stopped while the backfill ran"
    assert all(r.headers.get("x-cronbus-backfill") is None for r in regular)
    assert overlaps(of(sink, "ticks")) == []
    assert overlaps(of(sink, "cron")) == []
    # Stats count them as fires, beside the rotation's.
    delivered_so_far = len(of(sink, "ticks"))
    shown = await get_until(
        client, NS, "ticks", lambda s: s["stats"]["succeeded"] >= delivered_so_far
    )
    assert shown["stats"]["fires"] >= delivered_so_far, (shown["stats"], delivered_so_far)
    # Metrics count them (per executor; summed).
    delivered = 0.0
    for proc in stack.running("executor"):
        _, text = proc.get("/metrics")
        for line in text.splitlines():
            if line.startswith('cronbus_backfill_delivered_total{outcome="succeeded"}'):
                delivered += float(line.split()[-1])
    assert delivered == 30


async def test_a_paused_schedules_backfill_waits_for_the_resume(
    stack: Stack, sink: Sink, client: CommandClient, amqp_url: str
) -> None:
    await start(stack, sink)
    await upsert(client, every_second(sink, "held", paused=True))
    window = past_window(200, 5)
    # Through the CLI.
    printed = cli(
        amqp_url,
        "backfill",
        "held",
        "-n",
        NS,
        "--from",
        timefmt.format_ms(window[0]),
        "--to",
        timefmt.format_ms(window[1]),
    )
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout == (
        f"backfill of {NS}/held started: 5 occurrences to deliver, oldest first\n"
    ), printed.stdout
    await asyncio.sleep(3)
    assert of(sink, "held") == []
    assert await remaining(client, "held") == 5
    assert (await client.send(NS, "resume", {"id": "held"}))["ok"]
    assert await sink.wait_for(lambda s: len(backfilled(s, "held")) >= 5, timeout_s=30)
    assert [nominal(r) for r in backfilled(sink, "held")] == list(
        range(window[0], window[1], SECOND)
    )
    assert overlaps(of(sink, "held")) == []
    assert await wait_until(lambda: _absent(client, "held"), 10)


async def _absent(client: CommandClient, schedule_id: str) -> bool:
    return await remaining(client, schedule_id) is None


async def test_a_new_backfill_replaces_the_running_one(
    stack: Stack, sink: Sink, client: CommandClient
) -> None:
    await start(stack, sink)
    await upsert(client, every_second(sink, "redo"))
    old_window = past_window(900, 40)
    await client.send(NS, "backfill", backfill_body("redo", old_window))
    assert await sink.wait_for(lambda s: len(backfilled(s, "redo")) >= 3, timeout_s=30)
    new_window = past_window(400, 5)
    reply = await client.send(NS, "backfill", backfill_body("redo", new_window))
    assert reply["backfill"] == {"occurrences": 5}
    replaced_at = time.time() * 1000
    wanted = list(range(new_window[0], new_window[1], SECOND))
    assert await sink.wait_for(
        lambda s: [nominal(r) for r in backfilled(s, "redo")][-5:] == wanted, timeout_s=30
    ), [r.fire_time for r in backfilled(sink, "redo")]
    assert await wait_until(lambda: _absent(client, "redo"), 10)
    await asyncio.sleep(2)
    times = [nominal(r) for r in backfilled(sink, "redo")]
    old = [t for t in times if old_window[0] <= t < old_window[1]]
    # The old backfill stopped: at most its delivery in flight arrived after the replacement.
    late_old = [r for r in backfilled(sink, "redo") if r.at_ms > replaced_at and nominal(r) in old]
    assert len(late_old) <= 1, late_old
    assert len(old) < 40
    assert old == sorted(old) and times[-5:] == wanted and len(times) == len(old) + 5
    assert overlaps(of(sink, "redo")) == []


async def test_an_executor_killed_mid_backfill_loses_nothing(
    stack: Stack, sink: Sink, client: CommandClient
) -> None:
    await start(stack, sink, CRONBUS_LEASE_S="3")
    await upsert(client, every_second(sink, "tough"))
    window = past_window(500, 20)
    await client.send(NS, "backfill", backfill_body("tough", window))
    assert await sink.wait_for(lambda s: len(backfilled(s, "tough")) >= 5, timeout_s=30)
    victim = stack.running("executor")[0]
    stack.kill(victim)
    wanted = set(range(window[0], window[1], SECOND))
    assert await sink.wait_for(
        lambda s: {nominal(r) for r in backfilled(s, "tough")} >= wanted, timeout_s=60
    ), (sorted(wanted - {nominal(r) for r in backfilled(sink, "tough")}), stack.tails())
    got = backfilled(sink, "tough")
    # Nothing outside the window, a re-delivery (if any) with the same key, oldest first.
    assert {nominal(r) for r in got} == wanted
    assert has_regular_keys(got, "tough")
    firsts: list[int] = []
    for r in got:
        if nominal(r) not in firsts:
            firsts.append(nominal(r))
    assert firsts == sorted(wanted)
    assert await wait_until(lambda: _absent(client, "tough"), 15)


async def test_the_consoles_backfill_form_sends_the_command(
    stack: Stack,
    sink: Sink,
    client: CommandClient,
    amqp_url: str,
    database_url: str,
    index: Index,
) -> None:
    await start(stack, sink)
    await upsert(client, every_second(sink, "from-console"))
    console = await console_client(database_url, index, console_actions=True, amqp_url=amqp_url)
    try:
        page = await (await console.get(f"/ns/{NS}/s/from-console")).text()
        assert f'action="/ns/{NS}/s/from-console/backfill"' in page
        token = re.search(r'name="csrf" value="([^"]+)"', page)
        assert token is not None
        window = past_window(100, 3)
        sent = await console.post(
            f"/ns/{NS}/s/from-console/backfill",
            data={
                "csrf": token.group(1),
                "from": timefmt.format_ms(window[0]),
                "to": timefmt.format_ms(window[1]),
            },
        )
        assert sent.status == 200  # the redirect to the schedule's page, followed
        assert "backfill: done" in await sent.text()
    finally:
        await console.close()
    assert await sink.wait_for(lambda s: len(backfilled(s, "from-console")) >= 3, timeout_s=30)
    assert [nominal(r) for r in backfilled(sink, "from-console")] == list(
        range(window[0], window[1], SECOND)
    )
