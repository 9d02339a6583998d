"""A Redis that may evict is refused at start: an evicted index key is a schedule that stops
firing with nothing to say so (issue 39, item 5).

Each service is started against a Redis of its own (a loopback port, stopped by PID) whose
``maxmemory-policy`` is ``allkeys-lru``, the default of some managed Redis: it must exit with
the refusal's status and one line naming the setting, and write nothing to that Redis."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from tests.support.services import free_port, port_open

pytestmark = pytest.mark.e2e

EXIT_REFUSED = 2


@contextlib.contextmanager
def evicting_redis(directory: Path) -> Iterator[str]:
    if shutil.which("redis-server") is None:
        raise RuntimeError("redis-server is needed to start a Redis that evicts")
    port = free_port()
    process = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(directory),
            "--maxmemory",
            "64mb",
            "--maxmemory-policy",
            "allkeys-lru",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not port_open("127.0.0.1", port, 0.2):
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError("the evicting Redis did not start")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()


async def test_every_service_refuses_a_redis_that_may_evict(
    stack_env: dict[str, str], tmp_path: Path
) -> None:
    with evicting_redis(tmp_path) as redis_url:
        env = {**os.environ, **stack_env, "CRONBUS_REDIS_URL": redis_url}
        env["CRONBUS_METRICS_PORT"] = "0"
        for service in ("dispatcher", "executor", "sweeper", "console"):
            result = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", f"services.{service}"],
                env={**env, "CRONBUS_CONSOLE_PORT": str(free_port())},
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            naming = [line for line in result.stderr.splitlines() if "maxmemory-policy" in line]
            assert result.returncode == EXIT_REFUSED, result.stderr[-2000:]
            assert len(naming) == 1, result.stderr[-2000:]
            line = naming[0]
            assert line.startswith(f"cronbus {service}: CRONBUS_REDIS_URL: "), line
            assert "allkeys-lru" in line and "set maxmemory-policy noeviction" in line
            assert "Traceback" not in result.stderr
            print(f"\n{line}")
        # Refused before anything was written: no index was bound to this database.
        redis = aioredis.Redis.from_url(redis_url)
        try:
            assert await redis.dbsize() == 0
        finally:
            await redis.aclose()
