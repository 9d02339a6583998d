"""Several dispatchers and executors at once: shards split, a dead dispatcher taken over."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from cronbus.cli.procs import ServiceProcess
from cronbus.cli.sink import Sink
from shared.contract import timefmt
from shared.rules import schedule
from tests.support import services
from tests.support.commands import CommandClient
from tests.support.stack import Stack


def shards_owned(metrics_text: str) -> float:
    match = re.search(r"^cronbus_shards_owned (\S+)$", metrics_text, re.M)
    return float(match.group(1)) if match else -1


async def test_dispatchers_share_shards_and_survive_one_dying(
    stack: Stack, sink: Sink, client: CommandClient, stack_env: dict[str, str]
) -> None:
    stack_env["CRONBUS_SHARD_LEASE_S"] = "2"
    await stack.start_all(("dispatcher", "dispatcher", "executor", "executor"))
    first_ms = {}
    for i in range(30):
        reply = await client.send(
            "scale",
            "upsert",
            {
                "schedule": {
                    "id": f"s{i}",
                    "spec": {"kind": "interval", "every_s": 1},
                    "target": {"kind": "webhook", "url": f"{sink.url}/s{i}"},
                    "misfire": {"policy": "fire_all"},
                }
            },
        )
        assert reply["ok"], reply
        first_ms[f"s{i}"] = timefmt.parse_rfc3339_ms(reply["schedule"]["next_fires"][0])
    await asyncio.sleep(3)
    dispatchers = stack.running("dispatcher")
    owned = [shards_owned((await asyncio.to_thread(d.get, "/metrics"))[1]) for d in dispatchers]
    assert sorted(owned) == [2, 2], owned  # 4 shards, split evenly
    quiet_until = int(time.time() * 1000)
    stack.kill(dispatchers[0], signal.SIGKILL)
    await asyncio.sleep(6)
    until_ms = int(time.time() * 1000) - 2000

    expected = {(sid, t) for sid, first in first_ms.items() for t in range(first, until_ms, 1000)}

    def got(s: Sink) -> set[tuple[str, int]]:
        return {(r.path[1:], timefmt.parse_rfc3339_ms(r.fire_time)) for r in s.received}

    assert await sink.wait_for(lambda s: expected <= got(s), 20), stack.tails()
    keys: dict[tuple[str, int], set[str]] = {}
    for request in sink.received:
        identity = (request.path[1:], timefmt.parse_rfc3339_ms(request.fire_time))
        keys.setdefault(identity, set()).add(request.key)
        assert request.key == schedule.idempotency_key("scale", *identity)
    assert all(len(k) == 1 for k in keys.values())  # never under two different keys
    before_kill = [r for r in sink.received if timefmt.parse_rfc3339_ms(r.fire_time) < quiet_until]
    # While both ran, nothing was delivered twice.
    assert len(before_kill) == len({(r.path, r.fire_time) for r in before_kill})
    survivor = stack.running("dispatcher")[0]
    assert shards_owned((await asyncio.to_thread(survivor.get, "/metrics"))[1]) == 4


async def test_one_executor_per_core_with_a_single_command(
    stack_env: dict[str, str], stack: Stack
) -> None:
    # The two children's metrics ports, base and base + 1: below the ephemeral range, where
    # the other pytest worker's client sockets could take base + 1 before the child binds it.
    base = services.quiet_ports(2)
    env = {**os.environ, **stack_env, "CRONBUS_METRICS_PORT": str(base)}
    parent = subprocess.Popen(  # noqa: ASYNC220 - started once, waited on in a thread
        [str(Path(sys.executable).parent / "cronbus"), "run", "executor", "--processes", "2"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        children = [
            ServiceProcess("executor", parent, port, Path(os.devnull)) for port in (base, base + 1)
        ]
        for child in children:
            await child.wait_ready(90)  # two interpreters starting at once on a busy machine
        parent.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(parent.wait, 30) == 0
        for child in children:
            assert (await asyncio.to_thread(child.get, "/healthz"))[0] == 0  # gone
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
