"""Safe for many tenants, tried with the real services: webhooks reach only allowed addresses,
hostile targets cannot make the executor hoard memory, deliveries are signed (verified with the
`standardwebhooks` package), and secret headers reach the target and nowhere else."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
from pathlib import Path
from typing import Any

import aio_pika
import asyncpg
import pytest
import redis.asyncio as aioredis
import standardwebhooks

from cronbus.cli.sink import Sink
from shared.contract import codec, keys
from shared.policy import tracing
from shared.rabbitmq import amqp
from tests.e2e.test_firing import events_queue
from tests.support.commands import CommandClient
from tests.support.hostile import HostileServer
from tests.support.stack import Proc, Stack


def interval_schedule(schedule_id: str, target: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "schedule": {
            "id": schedule_id,
            "spec": {"kind": "interval", "every_s": 1},
            "target": target,
            "retry": {"max_attempts": 1},
            **extra,
        }
    }


async def upsert(client: CommandClient, namespace: str, body: dict[str, Any]) -> None:
    reply = await client.send(namespace, "upsert", body)
    assert reply["ok"], reply


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{name} ([0-9.e+]+)$", text, re.MULTILINE)
    return float(found[1]) if found else 0.0


def memory_kib(proc: Proc, field: str) -> int:
    """VmRSS (now) or VmHWM (peak) of a process, in KiB."""
    status = Path(f"/proc/{proc.pid}/status").read_text()
    found = re.search(rf"^{field}:\s+(\d+) kB$", status, re.MULTILINE)
    assert found, status
    return int(found[1])


async def test_a_tighter_policy_refuses_stored_schedules_at_delivery(
    stack: Stack, sink: Sink, client: CommandClient, amqp_url: str
) -> None:
    # The dispatcher accepted these schedules; the executor's policy (tightened since) allows
    # no loopback address, whatever the host is called.
    stack.start("dispatcher")
    executor = stack.start("executor", CRONBUS_WEBHOOK_ALLOWED_NETWORKS="")
    for proc in [*stack.running("dispatcher"), executor]:
        await stack.wait_ready(proc)
    async with events_queue(amqp_url, "acme.*") as events:
        for schedule_id, url in (
            ("literal", f"{sink.url}/literal"),
            ("named", f"http://localhost:{sink.port}/named"),
        ):
            target = {"kind": "webhook", "url": url}
            await upsert(client, "acme", interval_schedule(schedule_id, target))
        errors: dict[str, str] = {}
        deadline = time.monotonic() + 15
        while len(errors) < 2 and time.monotonic() < deadline:
            message = await events.get(within_s=1)
            if message is not None:
                event = codec.loads(message.body)
                if event["outcome"] in ("failed", "dead"):
                    errors[event["id"]] = event["error"]
    assert errors == {
        "literal": "target address not allowed",
        "named": "target address not allowed",
    }, stack.tails()
    assert sink.received == []
    _, text = await asyncio.to_thread(executor.get, "/metrics")
    assert metric(text, "cronbus_webhook_refused_total") >= 2


async def test_the_executor_stays_small_against_a_hostile_server(
    stack: Stack, client: CommandClient, amqp_url: str
) -> None:
    hostile = await HostileServer().start()
    try:
        await stack.start_all(("dispatcher", "executor"))
        executor = stack.running("executor")[0]
        await asyncio.sleep(1)
        before_kib = memory_kib(executor, "VmRSS")
        paths = [
            "/endless-chunk-size",
            "/endless-chunk-extension",
            "/endless-trailer",
            "/huge-header",
            "/endless-headers",
            "/endless-interim",
            "/slow-drip",
            "/endless-body",
            "/endless-chunks",
            "/disagreeing-lengths",
        ]
        async with events_queue(amqp_url, "evil.*") as events:
            for path in paths:
                for copy in range(4):
                    # One circuit breaker per attack: a breaker opened by the first attacks
                    # to fail would otherwise hold the rest, which then never fail in time.
                    target = {
                        "kind": "webhook",
                        "url": f"{hostile.url}{path}",
                        "timeout_s": 3,
                        "rate_key": path[1:],
                    }
                    await upsert(client, "evil", interval_schedule(f"{path[1:]}-{copy}", target))
            reasons: dict[str, set[str]] = {}
            failing = {p[1:] for p in paths} - {"endless-body", "endless-chunks"}
            # Ten seconds of every attack at once at least; on a loaded machine, longer for
            # each failure to be reported.
            least, most = time.monotonic() + 10, time.monotonic() + 40
            while time.monotonic() < least or (
                not failing <= set(reasons) and time.monotonic() < most
            ):
                message = await events.get(within_s=0.5)
                if message is not None:
                    event = codec.loads(message.body)
                    if event["outcome"] in ("failed", "dead"):
                        path = event["id"].rsplit("-", 1)[0]
                        reasons.setdefault(path, set()).add(event["error"])
        peak_kib = memory_kib(executor, "VmHWM")
        print(
            f"\nexecutor RSS before {before_kib / 1024:.1f} MiB, peak {peak_kib / 1024:.1f} MiB "
            f"against {len(paths) * 4} hostile schedules; bytes the server got out: {hostile.sent}"
        )
        for path, why in sorted(reasons.items()):
            print(f"  {path}: {sorted(why)}")
        # Every attack failed, with its reason (the endless bodies are answered: 200).
        assert failing <= set(reasons)
        assert "timed out after 3s" in reasons["slow-drip"]
        assert any("head larger" in r for r in reasons["huge-header"])
        # 36 connections reading endless streams for seconds: bounded, not hoarded.
        assert peak_kib - before_kib < 48 * 1024, (before_kib, peak_kib)
    finally:
        await hostile.stop()


def whsec(seed: bytes) -> str:
    return "whsec_" + base64.b64encode(seed * 32).decode()


async def test_deliveries_are_signed_and_secrets_rotate_without_a_restart(
    stack: Stack, sink: Sink, client: CommandClient, tmp_path: Path
) -> None:
    old, new, star = whsec(b"o"), whsec(b"n"), whsec(b"s")
    secrets_file = tmp_path / "signing.json"
    secrets_file.write_text(json.dumps({"acme": [old], "*": [star]}))
    stack.start("dispatcher")
    stack.start("executor", CRONBUS_SIGNING_SECRETS_FILE=str(secrets_file))
    for proc in [*stack.running("dispatcher"), *stack.running("executor")]:
        await stack.wait_ready(proc)
    target = {"kind": "webhook", "url": f"{sink.url}/signed", "body": {"invoice": 42}}
    await upsert(client, "acme", interval_schedule("signed", target))
    await upsert(client, "other", interval_schedule("star", {**target, "url": f"{sink.url}/star"}))
    assert await sink.wait_for(
        lambda s: {r.path for r in s.received} >= {"/signed", "/star"}, timeout_s=10
    ), stack.tails()
    first = next(r for r in sink.received if r.path == "/signed")
    assert first.headers["webhook-id"] == first.key
    assert first.headers["traceparent"] == tracing.traceparent(first.key, first.attempt)
    assert abs(int(first.headers["webhook-timestamp"]) - time.time()) < 10
    assert standardwebhooks.Webhook(old).verify(first.body, first.headers) == {"invoice": 42}
    with pytest.raises(standardwebhooks.WebhookVerificationError):
        standardwebhooks.Webhook(star).verify(first.body, first.headers)
    starred = next(r for r in sink.received if r.path == "/star")
    standardwebhooks.Webhook(star).verify(starred.body, starred.headers)

    # Rotation, as a mounted Kubernetes Secret does it: a new file swapped in by rename.
    swapped = tmp_path / "signing.json.new"
    swapped.write_text(json.dumps({"acme": [new, old]}))
    swapped.replace(secrets_file)
    rotated_at = time.time()

    def both_signatures(s: Sink) -> bool:
        return any(r.path == "/signed" and r.at_ms / 1000 > rotated_at + 1.5 for r in s.received)

    assert await sink.wait_for(both_signatures, timeout_s=10), stack.tails()
    latest = [r for r in sink.received if r.path == "/signed"][-1]
    assert len(latest.headers["webhook-signature"].split(" ")) == 2
    for secret in (new, old):
        standardwebhooks.Webhook(secret).verify(latest.body, latest.headers)
    # "*" is gone from the file: the other namespace's deliveries go unsigned.
    sink.received.clear()
    assert await sink.wait_for(lambda s: any(r.path == "/star" for r in s.received), 10)
    assert "webhook-signature" not in next(r for r in sink.received if r.path == "/star").headers


SECRET_VALUE = "Bearer sk-live-7fJ2qT9xLw4Rz0Pc"


async def redis_value(redis: aioredis.Redis, key: bytes) -> str:
    """Everything a key holds, whatever its type (the repr keeps ASCII text readable)."""
    kind = await redis.type(key)
    if kind == b"none":
        # The services keep running while the test reads: a lease or claim seen by SCAN
        # may have been released or expired since, and a key that is gone holds nothing.
        return ""
    readers: dict[bytes, Any] = {
        b"string": lambda: redis.get(key),
        b"hash": lambda: redis.hgetall(key),
        b"zset": lambda: redis.zrange(key, 0, -1, withscores=True),
        b"set": lambda: redis.smembers(key),
        b"list": lambda: redis.lrange(key, 0, -1),
        b"stream": lambda: redis.xrange(key),
    }
    assert kind in readers, kind
    return repr(await readers[kind]())


async def test_secret_headers_reach_the_target_and_nowhere_else(
    stack: Stack,
    sink: Sink,
    client: CommandClient,
    tmp_path: Path,
    amqp_url: str,
    database_url: str,
    redis_prefix: str,
    stack_env: dict[str, str],
) -> None:
    secrets_dir = tmp_path / "secrets"
    (secrets_dir / "acme").mkdir(parents=True)
    (secrets_dir / "acme" / "billing-token").write_text(SECRET_VALUE + "\n")
    await stack.start_all(
        ("dispatcher", "executor"), CRONBUS_SECRETS_DIR=str(secrets_dir), CRONBUS_LOG_LEVEL="DEBUG"
    )
    connection = await aio_pika.connect(amqp_url)
    try:
        # A copy of every delivery message, as anyone reading the broker would see it.
        channel = await connection.channel()
        copies = await channel.declare_queue(exclusive=True)
        await copies.bind(keys.DELIVERIES_EXCHANGE, routing_key=amqp.DELIVERIES_ROUTING_KEY)
        async with events_queue(amqp_url, "acme.*") as events:
            target = {
                "kind": "webhook",
                "url": f"{sink.url}/billing",
                "secret_headers": {"Authorization": "billing-token"},
            }
            await upsert(client, "acme", interval_schedule("billing", target))
            missing = {**target, "url": f"{sink.url}/missing", "secret_headers": {"X-Key": "nope"}}
            await upsert(client, "acme", interval_schedule("missing", missing))
            assert await sink.wait_for(lambda s: len(s.received) >= 2, timeout_s=10), stack.tails()
            assert {r.path for r in sink.received} == {"/billing"}
            assert sink.received[0].headers["authorization"] == SECRET_VALUE
            seen_events: list[bytes] = []
            missing_error = None
            deadline = time.monotonic() + 10
            while missing_error is None and time.monotonic() < deadline:
                message = await events.get(within_s=0.5)
                if message is not None:
                    seen_events.append(message.body)
                    event = codec.loads(message.body)
                    if event["id"] == "missing" and event["outcome"] in ("failed", "dead"):
                        missing_error = event["error"]
        assert missing_error == "secret 'nope' not found for namespace 'acme'"
        messages = []
        while (message := await copies.get(fail=False)) is not None:
            messages.append(message.body)
        assert messages and any(b"billing-token" in m for m in messages)
    finally:
        await connection.close()
        reply = await client.send("acme", "get", {"id": "billing"})
        assert reply["ok"] and reply["schedule"]["target"]["secret_headers"] == {
            "Authorization": "billing-token"
        }
    needle = SECRET_VALUE.split()[1]
    # Not in any delivery message, event or reply ...
    assert not [m for m in messages + seen_events if needle.encode() in m]
    assert needle not in json.dumps(reply)
    # ... nor in any PostgreSQL row ...
    database = await asyncpg.connect(database_url)
    try:
        tables = await database.fetch(
            "SELECT schemaname, tablename FROM pg_tables WHERE schemaname = 'public'"
        )
        rows = 0
        for table in tables:
            for row in await database.fetch(
                f'SELECT t::text AS text FROM "{table["tablename"]}" t'
            ):
                rows += 1
                assert needle not in row["text"], table["tablename"]
        assert rows > 0
    finally:
        await database.close()
    # ... nor in any Redis value ...
    redis = aioredis.from_url(stack_env["CRONBUS_REDIS_URL"])
    try:
        found_keys = [k async for k in redis.scan_iter(match=f"{redis_prefix}*")]
        assert found_keys
        for key in found_keys:
            assert needle not in await redis_value(redis, key), key
    finally:
        await redis.aclose()
    # ... nor in any log line of the services (DEBUG logs every occurrence).
    await asyncio.sleep(0.5)
    for procs in stack.procs.values():
        for proc in procs:
            assert needle not in proc.log.read_text(errors="replace"), proc.name
