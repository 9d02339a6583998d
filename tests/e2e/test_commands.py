"""Every verb, and every kind of bad input refused with nothing stored, through the real intake."""

from __future__ import annotations

import ast
import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aio_pika
import asyncpg
import redis.asyncio as aioredis

from cronbus.cli.sink import Sink
from shared.contract import codec, keys
from tests.support import services
from tests.support.commands import CommandClient, an_hour_from_now
from tests.support.stack import Stack

COMMANDS = (Path(__file__).resolve().parents[2] / "docs" / "commands.md").read_text()


def hook(sink: Sink, path: str = "/hook") -> dict[str, Any]:
    return {"kind": "webhook", "url": f"{sink.url}{path}"}


def every(sink: Sink, schedule_id: str, seconds: float = 1, **extra: Any) -> dict[str, Any]:
    return {
        "id": schedule_id,
        "spec": {"kind": "interval", "every_s": seconds},
        "target": hook(sink, f"/{schedule_id}"),
        **extra,
    }


async def index_members(endpoints: services.Endpoints, prefix: str) -> set[str]:
    client = aioredis.Redis.from_url(endpoints.redis_url)
    try:
        members: set[str] = set()
        for shard in range(4):
            found = await client.hkeys(f"{prefix}:{{{shard}}}:sched")
            members |= {m.decode() if isinstance(m, bytes) else m for m in found}
        return members
    finally:
        await client.aclose()


async def test_every_verb(
    stack: Stack,
    sink: Sink,
    client: CommandClient,
    endpoints: services.Endpoints,
    redis_prefix: str,
    database_url: str,
) -> None:
    await stack.start_all(("dispatcher", "executor"))
    created = await client.send(
        "acme", "upsert", {"schedule": every(sink, "a", 3600, labels={"team": "billing"})}
    )
    assert created["ok"] and created["created"] and created["schedule"]["version"] == 1
    assert created["schedule"]["state"] == "active"
    assert created["schedule"]["namespace"] == "acme"
    assert created["schedule"]["retry"]["max_attempts"] == 3  # defaults are filled in

    # Replace: a new version; compare-and-set refuses a stale expected_version.
    replaced = await client.send(
        "acme", "upsert", {"schedule": every(sink, "a", 1800), "expected_version": 1}
    )
    assert replaced["ok"] and not replaced["created"]
    assert replaced["schedule"]["version"] == 2
    conflict = await client.send(
        "acme", "upsert", {"schedule": every(sink, "a", 60), "expected_version": 1}
    )
    assert conflict["ok"] is False
    assert conflict["error"]["code"] == "version_conflict"
    assert conflict["error"]["details"][0]["field"] == "expected_version"
    got = await client.send("acme", "get", {"id": "a"})
    assert got["schedule"]["version"] == 2 and got["schedule"]["spec"]["every_s"] == 1800
    assert got["schedule"]["labels"] == {}
    create_only = await client.send(
        "acme", "upsert", {"schedule": every(sink, "a", 60), "expected_version": 0}
    )
    assert create_only["error"]["code"] == "version_conflict"

    # List: paging with a cursor, filtering by labels and state.
    for i in range(5):
        reply = await client.send(
            "acme",
            "upsert",
            {
                "schedule": every(
                    sink, f"b{i}", 3600, labels={"team": "ops" if i % 2 else "billing"}
                )
            },
        )
        assert reply["ok"], reply
    page1 = await client.send("acme", "list", {"limit": 4})
    assert [s["id"] for s in page1["schedules"]] == ["a", "b0", "b1", "b2"]
    page2 = await client.send("acme", "list", {"limit": 4, "cursor": page1["next_cursor"]})
    assert [s["id"] for s in page2["schedules"]] == ["b3", "b4"]
    assert page2["next_cursor"] is None
    ops = await client.send("acme", "list", {"labels": {"team": "ops"}})
    assert [s["id"] for s in ops["schedules"]] == ["b1", "b3"]
    other_namespace = await client.send("other", "list", {})
    assert other_namespace["schedules"] == []

    # Pause stops the firing; resume starts it again; both are idempotent.
    fast = await client.send("acme", "upsert", {"schedule": every(sink, "fast", 1)})
    assert fast["ok"]
    assert await sink.wait_for(lambda s: any(r.path == "/fast" for r in s.received), 10)
    paused = await client.send("acme", "pause", {"id": "fast"})
    assert paused["schedule"]["state"] == "paused" and paused["schedule"]["paused"] is True
    again = await client.send("acme", "pause", {"id": "fast"})
    assert again["ok"] and again["unchanged"]
    await asyncio.sleep(0.5)
    count = sum(1 for r in sink.received if r.path == "/fast")
    await asyncio.sleep(2.5)
    assert sum(1 for r in sink.received if r.path == "/fast") == count
    assert (await client.send("acme", "get", {"id": "fast"}))["schedule"]["next_fires"] == []
    resumed = await client.send("acme", "resume", {"id": "fast"})
    assert resumed["schedule"]["state"] == "active"
    assert await sink.wait_for(
        lambda s: sum(1 for r in s.received if r.path == "/fast") > count + 1, 10
    )

    # Delete: gone from get, from the index, and it stops firing.
    deleted = await client.send("acme", "delete", {"id": "fast"})
    assert deleted["ok"] and deleted["schedule"]["state"] == "deleted"
    missing = await client.send("acme", "get", {"id": "fast"})
    assert missing["error"]["code"] == "not_found"
    assert "acme/fast" not in await index_members(endpoints, redis_prefix)
    await asyncio.sleep(0.5)
    count = sum(1 for r in sink.received if r.path == "/fast")
    await asyncio.sleep(2)
    assert sum(1 for r in sink.received if r.path == "/fast") == count
    for verb in ("delete", "pause", "resume", "trigger", "get"):
        reply = await client.send("acme", verb, {"id": "never-existed"})
        assert reply["error"]["code"] == "not_found", (verb, reply)

    # Created again after a delete: versions keep increasing.
    recreated = await client.send("acme", "upsert", {"schedule": every(sink, "fast", 3600)})
    assert (
        recreated["created"] and recreated["schedule"]["version"] > deleted["schedule"]["version"]
    )

    conn = await asyncpg.connect(database_url)
    try:
        verbs = {
            row["verb"]
            for row in await conn.fetch("SELECT verb FROM commands WHERE outcome = 'ok'")
        }
        assert verbs == {"upsert", "get", "list", "pause", "resume", "delete"}
        app = await conn.fetchval("SELECT app_id FROM commands LIMIT 1")
        assert app == "e2e-tests"
    finally:
        await conn.close()


BAD_UPSERTS: list[tuple[dict[str, Any], str, str]] = [
    ({"id": "x", "spec": {"kind": "cron", "expr": "0 0 30 2 *"}}, "spec.expr", "never fires"),
    ({"id": "x", "spec": {"kind": "cron", "expr": "61 * * * *"}}, "spec.expr", "minute"),
    (
        {"id": "x", "spec": {"kind": "cron", "expr": "* * * * *", "timezone": "Moon/Base"}},
        "spec.timezone",
        "unknown time zone",
    ),
    (
        {"id": "x", "spec": {"kind": "interval", "every_s": 1}, "colour": "red"},
        "colour",
        "unknown field",
    ),
    (
        {"id": "x", "spec": {"kind": "interval", "every_s": 1, "extra": 1}},
        "spec.extra",
        "unknown field",
    ),
    (
        {
            "id": "x",
            "spec": {"kind": "interval", "every_s": 1},
            "target": {"kind": "webhook", "url": "http://169.254.169.254/latest"},
        },
        "target.url",
        "not allowed",
    ),
    (
        {
            "id": "x",
            "spec": {"kind": "interval", "every_s": 1},
            "target": {"kind": "amqp", "exchange": "cronbus.commands"},
        },
        "target.exchange",
        "reserved",
    ),
    ({"id": "x/y", "spec": {"kind": "interval", "every_s": 1}}, "id", "letters"),
    (
        {
            "id": "x",
            "spec": {"kind": "once", "at": "2020-01-01T00:00:00Z"},
            "misfire": {"policy": "skip"},
        },
        "spec.at",
        "never fire",
    ),
]


async def test_bad_input_is_refused_and_changes_nothing(
    stack: Stack,
    sink: Sink,
    client: CommandClient,
    amqp_url: str,
    database_url: str,
    endpoints: services.Endpoints,
    redis_prefix: str,
) -> None:
    await stack.start_all(("dispatcher",))
    for schedule, field, reason in BAD_UPSERTS:
        item = {"target": hook(sink), **schedule}
        reply = await client.send("acme", "upsert", {"schedule": item})
        assert reply["ok"] is False, schedule
        assert reply["error"]["code"] == "invalid_schedule"
        assert any(
            d["field"] == field and reason in d["reason"] for d in reply["error"]["details"]
        ), reply
    unknown_verb = await client.send("acme", "explode", {"id": "x"})
    assert unknown_verb["error"]["code"] == "unknown_verb"
    bad_namespace = await client.send("Not.Valid!", "get", {"id": "x"})
    assert bad_namespace["error"]["code"] == "invalid_command"
    not_json = await client.send("acme", "upsert", b"{this is not json")
    assert not_json["error"]["code"] == "invalid_command"
    # Without reply_to, a refused command is not lost either: it waits in the DLQ.
    await client.publish("acme", "upsert", {"schedule": {"id": "quiet", "spec": {}}})
    await client.publish("acme", "upsert", b"\xff\xfe garbage", content_type="text/plain")

    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        dlq = await channel.get_queue(keys.dead_letter_queue(keys.COMMANDS_QUEUE), ensure=False)
        reasons: list[str] = []
        for _ in range(100):
            message = await dlq.get(fail=False)
            if message is None:
                if len(reasons) >= 3:
                    break
                await asyncio.sleep(0.1)
                continue
            await message.ack()
            reasons.append(str((message.headers or {}).get(keys.DEAD_REASON_HEADER)))
        assert any("not valid JSON" in r for r in reasons), reasons
        assert any("spec.kind" in r or "invalid_schedule" in r for r in reasons), reasons
        assert len(reasons) == 3, reasons
    finally:
        await connection.close()

    listed = await client.send("acme", "list", {})
    assert listed["schedules"] == []
    assert await index_members(endpoints, redis_prefix) == set()
    conn = await asyncpg.connect(database_url)
    try:
        assert await conn.fetchval("SELECT count(*) FROM schedules") == 0
        outcomes = [row["outcome"] for row in await conn.fetch("SELECT outcome FROM commands")]
        assert outcomes.count("invalid_schedule") >= len(BAD_UPSERTS)
        assert "unknown_verb" in outcomes and "invalid_command" in outcomes
    finally:
        await conn.close()


async def test_cli_apply_get_trigger_and_executions(
    stack: Stack, sink: Sink, stack_env: dict[str, str], tmp_path: Path
) -> None:
    await stack.start_all(("dispatcher", "executor"))
    path = tmp_path / "schedules.yaml"
    path.write_text(f"""
- id: nightly
  spec: {{kind: cron, expr: "0 3 * * *", timezone: Europe/Berlin}}
  target: {{kind: webhook, url: "{sink.url}/nightly"}}
- id: soon
  spec: {{kind: interval, every_s: 1}}
  target: {{kind: webhook, url: "{sink.url}/soon"}}
---
id: invalid
spec: {{kind: cron, expr: "0 25 * * *"}}
target: {{kind: webhook, url: "{sink.url}/x"}}
""")
    env = {**os.environ, **stack_env}
    cli = [str(Path(sys.executable).parent / "cronbus")]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*cli, *args], capture_output=True, text=True, env=env, timeout=60, check=False
        )

    # For scripts, -o json: a result per schedule, one JSON line each.
    applied = await asyncio.to_thread(run, "apply", "-f", str(path), "-n", "team", "-o", "json")
    assert applied.returncode == 1  # one of the three was refused
    replies = [codec.loads(line) for line in applied.stdout.splitlines()]
    assert [r["ok"] for r in replies] == [True, True, False]
    assert "invalid_schedule: spec.expr: hour: 25 is out of range 0-23" in applied.stderr
    got = await asyncio.to_thread(run, "get", "nightly", "-n", "team", "-o", "json")
    assert got.returncode == 0
    assert codec.loads(got.stdout)["schedule"]["spec"]["timezone"] == "Europe/Berlin"
    missing = await asyncio.to_thread(run, "get", "nope", "-n", "team")
    assert missing.returncode == 1 and "not_found" in missing.stderr
    trigger = await asyncio.to_thread(run, "trigger", "nightly", "-n", "team")
    assert trigger.returncode == 0
    assert await sink.wait_for(
        lambda s: (
            any(r.path == "/nightly" for r in s.received)
            and sum(r.path == "/soon" for r in s.received) >= 2
        ),
        10,
    )
    await asyncio.sleep(1.0)  # execution rows are written in batches
    executions = await asyncio.to_thread(run, "executions", "soon", "-n", "team", "--json")
    assert executions.returncode == 0, executions.stderr
    rows = [codec.loads(line) for line in executions.stdout.splitlines()]
    assert rows and all(r["status"] == "succeeded" for r in rows)
    bad_file = await asyncio.to_thread(
        run, "apply", "-f", str(tmp_path / "missing.yaml"), "-n", "team"
    )
    assert bad_file.returncode == 2 and len(bad_file.stderr.strip().splitlines()) == 1


async def test_the_plain_amqp_example_works_as_written(
    stack: Stack, amqp_url: str, tmp_path: Path
) -> None:
    await stack.start_all(("dispatcher",))
    snippet = COMMANDS.split("```python\n", 1)[1].split("```", 1)[0]
    assert '"amqp://guest:guest@127.0.0.1:5672/"' in snippet
    script = tmp_path / "example.py"
    script.write_text(snippet.replace('"amqp://guest:guest@127.0.0.1:5672/"', repr(amqp_url)))
    result = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    reply = ast.literal_eval(result.stdout.strip())
    assert reply["ok"] is True
    assert reply["schedule"]["namespace"] == "billing"
    assert reply["schedule"]["id"] == "invoice-42"


async def test_a_redelivered_command_is_answered_not_applied_twice(
    stack: Stack, sink: Sink, client: CommandClient
) -> None:
    await stack.start_all(("dispatcher", "executor"))
    hourly = every(sink, "once-only", 3600)
    # On the epoch's grid a whole hour during the test would add a fire to the trigger's.
    hourly["spec"]["start_at"] = an_hour_from_now()
    first = await client.send("acme", "upsert", {"schedule": hourly}, message_id="m-upsert-1")
    again = await client.send("acme", "upsert", {"schedule": hourly}, message_id="m-upsert-1")
    assert first["schedule"]["version"] == again["schedule"]["version"] == 1
    assert again["duplicate"] is True and "duplicate" not in first
    trigger = await client.send("acme", "trigger", {"id": "once-only"}, message_id="m-t-1")
    repeat = await client.send("acme", "trigger", {"id": "once-only"}, message_id="m-t-1")
    assert repeat["trigger"] == trigger["trigger"] and repeat["duplicate"] is True
    assert await sink.wait_for(lambda s: len(s.received) >= 1, 10)
    await asyncio.sleep(1.5)
    assert [r.fire_time for r in sink.received] == [trigger["trigger"]["fire_time"]]


async def test_a_reused_message_id_replays_only_the_same_command(
    stack: Stack, sink: Sink, client: CommandClient
) -> None:
    await stack.start_all(("dispatcher",))
    first = await client.send(
        "acme", "upsert", {"schedule": every(sink, "m1", 3600)}, message_id="reused"
    )
    assert first["ok"] is True
    other = await client.send(
        "acme", "upsert", {"schedule": every(sink, "m2", 3600)}, message_id="reused"
    )
    assert other["ok"] is False and other["error"]["code"] == "conflict", other
    assert other["error"]["details"][0]["field"] == "message_id"
    missing = await client.send("acme", "get", {"id": "m2"})
    assert missing["error"]["code"] == "not_found"
    another_verb = await client.send("acme", "delete", {"id": "m1"}, message_id="reused")
    assert another_verb["error"]["code"] == "conflict"
    assert (await client.send("acme", "get", {"id": "m1"}))["ok"] is True

    # The same command, spelled with other spacing and key order, is a replay.
    same = codec.loads(codec.dumps({"schedule": every(sink, "m1", 3600)}))
    reordered = b'{ "schedule" : ' + codec.dumps(dict(reversed(same["schedule"].items()))) + b"}"
    replay = await client.send("acme", "upsert", reordered, message_id="reused")
    assert replay["duplicate"] is True and replay["schedule"]["version"] == 1
    # Message ids are the tenant's own: another namespace may use the same one.
    elsewhere = await client.send(
        "globex", "upsert", {"schedule": every(sink, "m2", 3600)}, message_id="reused"
    )
    assert elsewhere["ok"] is True and "duplicate" not in elsewhere


async def test_upsert_many_applies_or_refuses_each_schedule_on_its_own(
    stack: Stack,
    sink: Sink,
    client: CommandClient,
    endpoints: services.Endpoints,
    redis_prefix: str,
    database_url: str,
) -> None:
    await stack.start_all(("dispatcher",))
    existing = await client.send("bulk", "upsert", {"schedule": every(sink, "s1", 3600)})
    assert existing["schedule"]["version"] == 1
    schedules: list[Any] = [
        every(sink, "s0", 3600),
        every(sink, "s1", 1800),  # replaces version 1
        {**every(sink, "bad", 3600), "spec": {"kind": "cron", "expr": "0 25 * * *"}},
        "not a schedule",
        every(sink, "s0", 60),  # the same schedule again: applied after the first
        {**every(sink, "nul\x00", 3600)},
        *[every(sink, f"m{i}", 3600) for i in range(994)],
    ]
    reply = await client.send("bulk", "upsert_many", {"schedules": schedules}, timeout_s=60)
    assert reply["ok"] is True
    results = reply["results"]
    assert len(results) == 1000
    assert results[:2] == [
        {"id": "s0", "ok": True, "version": 1},
        {"id": "s1", "ok": True, "version": 2},
    ]
    assert results[2]["id"] == "bad" and results[2]["ok"] is False
    assert results[2]["error"]["code"] == "invalid_schedule"
    assert results[2]["error"]["details"][0]["field"] == "spec.expr"
    assert results[3] == {
        "id": None,
        "ok": False,
        "error": {
            "code": "invalid_schedule",
            "message": "(schedule): must be an object",
            "details": [{"field": "(schedule)", "reason": "must be an object"}],
        },
    }
    assert results[4] == {"id": "s0", "ok": True, "version": 2}
    assert results[5]["ok"] is False and results[5]["error"]["details"][0]["field"] == "id"
    assert all(r["ok"] and r["version"] == 1 for r in results[6:])

    # Each applied schedule is what a single upsert would have made, in PostgreSQL and Redis.
    got = await client.send("bulk", "get", {"id": "s0"})
    assert got["schedule"]["version"] == 2 and got["schedule"]["spec"]["every_s"] == 60
    members = await index_members(endpoints, redis_prefix)
    assert members == {"bulk/s0", "bulk/s1", *{f"bulk/m{i}" for i in range(994)}}
    conn = await asyncpg.connect(database_url)
    try:
        assert await conn.fetchval("SELECT count(*) FROM schedules") == 996
        # Audited once per partition the schedules fall in (docs/scaling.md), all of them.
        audited = await conn.fetch(
            "SELECT outcome, reply FROM commands WHERE verb = 'upsert_many' AND reply IS NOT NULL"
        )
        assert audited and all(row["outcome"] == "ok" for row in audited)
        assert sum(len(codec.loads(row["reply"])["results"]) for row in audited) == 1000
    finally:
        await conn.close()

    # More than 1000 is refused whole; so is a command over CRONBUS_MAX_COMMAND_BYTES.
    too_many = await client.send(
        "bulk", "upsert_many", {"schedules": [every(sink, f"x{i}", 60) for i in range(1001)]}
    )
    assert too_many["error"]["code"] == "invalid_command"
    assert too_many["error"]["details"][0]["field"] == "schedules"


async def test_commands_on_one_schedule_apply_in_arrival_order_under_load(
    stack: Stack, sink: Sink, client: CommandClient
) -> None:
    """Hundreds of interleaved commands in flight at once (group commit batches them): each
    schedule sees its own commands in the order they were published."""
    await stack.start_all(("dispatcher",))
    schedules, rounds = 20, 30
    sent: list[tuple[str, int, str]] = []
    for r in range(rounds):
        for k in range(schedules):
            verb = "pause" if r % 10 == 5 else "resume" if r % 10 == 6 else "upsert"
            sent.append((f"o{k}", r, verb))
    replies = await asyncio.gather(
        *(
            client.send(
                "order",
                verb,
                {"id": sid}
                if verb != "upsert"
                else {"schedule": every(sink, sid, 60 + r, paused=r % 10 == 5)},
            )
            for sid, r, verb in sent
        )
    )
    assert all(reply["ok"] for reply in replies), [r for r in replies if not r["ok"]][:3]
    for k in range(schedules):
        mine = [
            (r, verb, reply)
            for (sid, r, verb), reply in zip(sent, replies, strict=True)
            if sid == f"o{k}"
        ]
        versions = [reply["schedule"]["version"] for _, _, reply in mine]
        # Every command changed the schedule (pause after an upsert, resume after a pause):
        # in publish order, each reply is the next version.
        assert versions == list(range(1, rounds + 1)), versions
        got = await client.send("order", "get", {"id": f"o{k}"})
        assert got["schedule"]["version"] == rounds
        assert got["schedule"]["spec"]["every_s"] == 60 + rounds - 1
