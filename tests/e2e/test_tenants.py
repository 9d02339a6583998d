"""Namespaces enforced by the broker: per-tenant RabbitMQ users with topic permissions, as the
security page (docs/security.md) tells an operator to set them up."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import aio_pika
import aiormq.exceptions
import asyncpg
import pytest

from cronbus.client import AccessRefused, Client
from tests.support import services
from tests.support.commands import CommandClient
from tests.support.stack import Stack

HOOK = {"kind": "webhook", "url": "http://127.0.0.1:9/hook"}


def hourly(schedule_id: str) -> dict[str, Any]:
    return {
        "schedule": {
            "id": schedule_id,
            "spec": {"kind": "interval", "every_s": 3600},
            "target": HOOK,
        }
    }


def tenant_permissions(namespace: str) -> tuple[list[str], dict[str, tuple[str, str]]]:
    """(configure, write, read) and the topic permissions (exchange -> (write, read)) of a
    tenant who owns ``namespace``: exactly the security page's recipe."""
    own_queues = r"^amq\.gen-.*"
    return (
        [own_queues, r"^(cronbus\.commands|amq\.gen-.*)$", r"^(cronbus\.events|amq\.gen-.*)$"],
        {
            "cronbus.commands": (rf"^{namespace}\.", "^$"),
            "cronbus.events": ("^$", rf"^{namespace}\."),
        },
    )


@pytest.fixture
def tenants(endpoints: services.Endpoints, amqp_url: str) -> Iterator[dict[str, str]]:
    """Two users in the test's vhost, alpha and beta, each owning its namespace; deleted after."""
    ctl = endpoints.rabbitmqctl
    vhost = unquote(urlsplit(amqp_url).path.lstrip("/"))
    urls: dict[str, str] = {}
    users = []
    try:
        for namespace in ("alpha", "beta"):
            user = services.unique(f"tenant-{namespace}-")
            password = services.unique("pw")
            users.append(user)
            subprocess.run([*ctl, "add_user", user, password], check=True, capture_output=True)
            permissions, topics = tenant_permissions(namespace)
            subprocess.run(
                [*ctl, "set_permissions", "-p", vhost, user, *permissions],
                check=True,
                capture_output=True,
            )
            for exchange, (write, read) in topics.items():
                subprocess.run(
                    [*ctl, "set_topic_permissions", "-p", vhost, user, exchange, write, read],
                    check=True,
                    capture_output=True,
                )
            parts = urlsplit(amqp_url)
            netloc = f"{quote(user)}:{quote(password)}@{parts.hostname}:{parts.port or 5672}"
            urls[namespace] = urlunsplit((parts.scheme, netloc, parts.path, "", ""))
        yield urls
    finally:
        for user in users:
            subprocess.run([*ctl, "delete_user", user], check=False, capture_output=True)


async def test_a_tenant_can_neither_command_nor_watch_another_namespace(
    stack: Stack,
    tenants: dict[str, str],
    database_url: str,
    stack_env: dict[str, str],
) -> None:
    await stack.start_all(("dispatcher",))
    async with CommandClient(tenants["alpha"]) as alpha:
        own = await alpha.send(
            "alpha",
            "upsert",
            {"schedule": {"id": "a1", "spec": {"kind": "interval", "every_s": 60}, "target": HOOK}},
        )
        assert own["ok"] is True
    async with CommandClient(tenants["beta"]) as beta:
        theirs = await beta.send(
            "beta",
            "upsert",
            {"schedule": {"id": "b1", "spec": {"kind": "interval", "every_s": 60}, "target": HOOK}},
        )
        assert theirs["ok"] is True

    # The public client takes its replies on direct reply-to: the tenant's permissions do.
    async with Client(tenants["alpha"], timeout_s=20) as public:
        assert (await public.get("alpha", "a1")).id == "a1"
        with pytest.raises(AccessRefused):
            await public.get("beta", "b1")

    # alpha publishing a command for beta's namespace: the broker refuses it.
    async with CommandClient(tenants["alpha"]) as alpha:
        with pytest.raises(AccessRefused) as refused:
            await alpha.send("beta", "delete", {"id": "b1"}, timeout_s=5)
        assert "beta.delete" in str(refused.value)

    # alpha binding to beta's events: refused; to its own: allowed.
    connection = await aio_pika.connect(tenants["alpha"])
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(exclusive=True)
        await queue.bind("cronbus.events", routing_key="alpha.#")
        with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
            await queue.bind("cronbus.events", routing_key="beta.#")
    finally:
        await connection.close()

    # The CLI says so in one line, and exits 2.
    env = {**os.environ, **stack_env, "CRONBUS_AMQP_URL": tenants["alpha"]}
    cli = [str(Path(sys.executable).parent / "cronbus"), "delete", "b1", "-n", "beta"]
    result = await asyncio.to_thread(
        subprocess.run, cli, capture_output=True, text=True, env=env, timeout=60, check=False
    )
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "ACCESS_REFUSED" in lines[0] and "'beta'" in lines[0], lines

    # beta's schedule is untouched, and the audit names who sent each command (the user the
    # broker checked the user_id property against).
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch(
            "SELECT namespace, user_id, outcome FROM commands WHERE verb = 'upsert' ORDER BY seq"
        )
        states = await conn.fetch("SELECT id, state FROM schedules ORDER BY id")
    finally:
        await conn.close()
    alpha_user = unquote(urlsplit(tenants["alpha"]).username or "")
    beta_user = unquote(urlsplit(tenants["beta"]).username or "")
    assert [(r["namespace"], r["user_id"], r["outcome"]) for r in rows] == [
        ("alpha", alpha_user, "ok"),
        ("beta", beta_user, "ok"),
    ]
    assert [(r["id"], r["state"]) for r in states] == [("a1", "active"), ("b1", "active")]
