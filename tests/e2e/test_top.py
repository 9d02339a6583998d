"""``cronbus top`` in a real terminal (tmux) against running services: read the screen."""

from __future__ import annotations

import asyncio
import re
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cronbus.cli.sink import Sink
from tests.support import tools
from tests.support.commands import CommandClient
from tests.support.stack import Stack


@pytest.fixture
def tmux() -> Iterator[list[str]]:
    """tmux on a private server socket: the test stops only the server it started."""
    tools.require("tmux")
    command = ["tmux", "-L", f"cronbus-top-{uuid.uuid4().hex[:8]}"]
    yield command
    subprocess.run([*command, "kill-server"], capture_output=True, check=False)


def _screen(tmux: list[str]) -> str:
    done = subprocess.run(
        [*tmux, "capture-pane", "-p", "-t", "top"], capture_output=True, text=True, check=False
    )
    return done.stdout


async def test_top_shows_fires_lateness_backlog_and_failures(
    stack: Stack, client: CommandClient, sink: Sink, tmux: list[str]
) -> None:
    await stack.start_all()
    for i in range(10):
        reply = await client.send(
            "topdemo",
            "upsert",
            {
                "schedule": {
                    "id": f"every-second-{i}",
                    "spec": {"kind": "interval", "every_s": 1},
                    "target": {"kind": "webhook", "url": f"{sink.url}/ok"},
                }
            },
        )
        assert reply["ok"], reply
    ports = [
        str(p.port) for name in ("dispatcher", "executor", "sweeper") for p in stack.procs[name]
    ]
    argv = [str(Path(sys.executable).parent / "cronbus"), "top", "--interval", "1"]
    for port in ports:
        argv += ["--port", port]
    await asyncio.to_thread(
        subprocess.run,
        [*tmux, "new-session", "-d", "-s", "top", "-x", "80", "-y", "24", shlex.join(argv)],
        check=True,
    )
    deadline = time.monotonic() + 30
    screen = ""
    while time.monotonic() < deadline:
        await asyncio.sleep(1)
        screen = await asyncio.to_thread(_screen, tmux)
        rates = re.search(r"fires/s.*\n.*\n\s*([\d,.]+)\s+([\d,.]+)\s+([\d,.]+)\s+≤", screen)
        shards = screen.partition("Due backlog per shard")[2]
        shown = re.findall(r"(\d+):\s+[\d,]+", shards)
        if "3/3 endpoints answering" in screen and rates and float(rates.group(1)) > 0 and shown:
            break
    else:
        raise AssertionError(f"cronbus top never showed fires:\n{screen}")
    assert "fires/s" in screen
    assert "late p99" in screen
    assert re.search(r"late p50.*\n.*\n.*≤ [\d,]+ ms", screen)
    assert "Due backlog per shard" in screen
    # Every shard of this stack (CRONBUS_SHARDS=4) is on the screen, and so is its namespace.
    assert shown == ["0", "1", "2", "3"], screen
    assert re.search(r"^topdemo\s+[\d,.]+", screen, re.M), screen
    assert "dead letters" in screen
