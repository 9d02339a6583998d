"""AMQP targets with the default CRONBUS_AMQP_ALLOWED_EXCHANGES ({namespace},{namespace}.*), with
the real services and broker: another namespace's exchange is refused at upsert, the namespace's
own is delivered to, and a schedule an older version stored with a refused exchange is listed by
``cronbus doctor``, counted by the sweeper at start, and fails at delivery, nothing published."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aio_pika
import asyncpg

from shared.contract import codec, validation
from shared.postgres import bulk
from shared.postgres.store import Store
from shared.redis.index import Index
from tests.support.commands import CommandClient, an_hour_from_now
from tests.support.stack import Stack

SETTING = "CRONBUS_AMQP_ALLOWED_EXCHANGES"


def amqp_schedule(schedule_id: str, exchange: str, every_s: int = 3600) -> dict[str, Any]:
    return {
        "id": schedule_id,
        "spec": {"kind": "interval", "every_s": every_s},
        "target": {"kind": "amqp", "exchange": exchange, "routing_key": "run"},
        "retry": {"max_attempts": 3, "initial_backoff_s": 1},
    }


def doctor(database_url: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).parent / "cronbus"
    env = {**os.environ, "CRONBUS_DATABASE_URL": database_url}
    return subprocess.run(
        [str(exe), "doctor"], capture_output=True, text=True, timeout=60, env=env, check=False
    )


async def store_as_an_older_version(database_url: str, index: Index) -> None:
    """evil/legacy publishing to billing, stored the way a version whose default was "*" did."""
    store = await Store.open(database_url)
    try:
        result = await bulk.import_lines(
            [codec.dumps(amqp_schedule("legacy", "billing", every_s=1))],
            "evil",
            store,
            index,
            validation.TargetPolicy(allowed_exchanges=("*",)),
            workers=1,
        )
    finally:
        await store.close()
    assert result.imported == 1 and not result.refused


def refused_metric(text: str) -> float:
    found = re.search(
        r'^cronbus_amqp_target_refused_total\{namespace="evil"\} ([0-9.e+]+)$', text, re.MULTILINE
    )
    return float(found[1]) if found else 0.0


async def test_default_exchanges_keep_a_namespace_to_its_own_and_old_schedules_fail_loudly(
    stack: Stack, client: CommandClient, amqp_url: str, database_url: str, index: Index
) -> None:
    await store_as_an_older_version(database_url, index)
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        billing = await channel.declare_exchange("billing", aio_pika.ExchangeType.TOPIC)
        stolen = await channel.declare_queue("billing.inbox", exclusive=True)
        await stolen.bind(billing, "#")
        own = await channel.declare_exchange("evil.jobs", aio_pika.ExchangeType.TOPIC)
        mine = await channel.declare_queue(exclusive=True)
        await mine.bind(own, "#")
        await stack.start_all(("dispatcher", "executor", "sweeper"))

        # At upsert: another namespace's exchange, the default exchange and reserved ones.
        for exchange, words in (
            ("billing", [SETTING, "{namespace},{namespace}.*", "'evil,evil.*'"]),
            ("", ["default exchange", SETTING]),
            ("amq.topic", ["reserved", SETTING]),
            ("cronbus.commands", ["reserved", SETTING]),
        ):
            reply = await client.send("evil", "upsert", {"schedule": amqp_schedule("x", exchange)})
            assert reply["ok"] is False, reply
            (detail,) = reply["error"]["details"]
            assert detail["field"] == "target.exchange", reply
            assert all(word in detail["reason"] for word in words), (words, reply)
        assert (await client.send("evil", "get", {"id": "x"}))["error"]["code"] == "not_found"

        # The namespace's own exchange is accepted and delivered to.
        own_schedule = amqp_schedule("own", "evil.jobs")
        # On the epoch's grid a whole hour could put a regular fire before the trigger's.
        own_schedule["spec"]["start_at"] = an_hour_from_now()
        reply = await client.send("evil", "upsert", {"schedule": own_schedule})
        assert reply["ok"] is True, reply
        triggered = await client.send("evil", "trigger", {"id": "own"})
        assert triggered["ok"] is True, triggered
        message = await mine.get(timeout=10, fail=False)
        for _ in range(100):
            if message is not None:
                break
            await asyncio.sleep(0.1)
            message = await mine.get(timeout=10, fail=False)
        assert message is not None, stack.tails()
        assert message.message_id == triggered["trigger"]["idempotency_key"]

        # The stored schedule fails at each delivery, dead at its first attempt, with the
        # reason; nothing reaches billing.
        conn = await asyncpg.connect(database_url)
        try:
            rows: list[Any] = []
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and len(rows) < 2:
                rows = await conn.fetch(
                    "SELECT status, attempts, error FROM executions "
                    "WHERE namespace = 'evil' AND id = 'legacy' "
                    "AND status NOT IN ('fired', 'skipped')"
                )
                await asyncio.sleep(0.3)
        finally:
            await conn.close()
        assert len(rows) >= 2, stack.tails()
        for row in rows:
            assert (row["status"], row["attempts"]) == ("dead", 1), dict(row)
            assert "'billing'" in row["error"] and SETTING in row["error"], dict(row)
        got = await client.send("evil", "get", {"id": "legacy"})
        assert got["schedule"]["state"] == "active"  # never dropped
        assert SETTING in got["schedule"]["stats"]["last_error"]
        status, metrics = await asyncio.to_thread(stack.running("executor")[0].get, "/metrics")
        assert status == 200 and refused_metric(metrics) >= len(rows)
        assert await stolen.get(fail=False) is None
    finally:
        await connection.close()

    # cronbus doctor lists it, with the reason, and exits 1; the sweeper counted it at start.
    listed = await asyncio.to_thread(doctor, database_url)
    assert listed.returncode == 1, listed
    (line,) = [text for text in listed.stdout.splitlines() if "legacy" in text]
    assert "evil" in line and "billing" in line and "not one namespace" in line
    assert "own" not in listed.stdout
    assert SETTING in listed.stderr and "1 stored schedule(s)" in listed.stderr
    sweeper_log = stack.running("sweeper")[0].log.read_text()
    assert "1 stored schedule(s) have an AMQP target refused" in sweeper_log
