"""The command line tells a newcomer how to fix what went wrong (issue 27, point 5): an
unchanged file applied again says so and keeps its version, a ``once`` in the past is
accepted with a warning, and a broker that refuses or does not answer gets one line naming
the setting."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

from cronbus.cli.sink import Sink
from shared.contract import codec
from tests.support import services
from tests.support.stack import Stack

CRONBUS = str(Path(sys.executable).parent / "cronbus")


async def test_apply_twice_says_unchanged_and_warns_of_a_once_in_the_past(
    stack: Stack, stack_env: dict[str, str], sink: Sink, tmp_path: Path
) -> None:
    await stack.start_all(("dispatcher",))
    path = tmp_path / "schedules.yaml"
    path.write_text(f"""
- id: nightly
  spec: {{kind: cron, expr: "0 3 * * *"}}
  target: {{kind: webhook, url: "{sink.url}/nightly"}}
- id: missed
  spec: {{kind: once, at: "2020-01-01T00:00:00Z"}}
  target: {{kind: webhook, url: "{sink.url}/missed"}}
""")
    env = {**os.environ, **stack_env}

    def apply(*options: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [CRONBUS, "apply", "-f", str(path), "-n", "nc", *options],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )

    first = await asyncio.to_thread(apply)
    assert first.returncode == 0, first.stderr
    assert "missed: warning: spec.at: 2020-01-01T00:00:00Z is in the past" in first.stderr
    assert "unchanged" not in first.stderr
    again = await asyncio.to_thread(apply, "-o", "json")
    assert again.returncode == 0, again.stderr
    results = [codec.loads(line) for line in again.stdout.splitlines()]
    nightly = next(r for r in results if r["id"] == "nightly")
    assert nightly["version"] == 1 and nightly["unchanged"] is True
    assert "nightly: unchanged (still version 1)" in again.stderr


def _get(url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).parent / "cronbus"), "get", "x", "-n", "nc"],
        capture_output=True,
        text=True,
        env={**os.environ, "CRONBUS_AMQP_URL": url},
        timeout=60,
        check=False,
    )


def test_a_refused_or_absent_broker_is_one_line_naming_the_setting(
    endpoints: services.Endpoints,
) -> None:
    where = urlsplit(endpoints.amqp_url)
    refused = _get(f"amqp://guest:not-the-password@{where.hostname}:{where.port or 5672}/")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        "cronbus get: RabbitMQ refused the login (ACCESS_REFUSED): wrong user name or "
        "password; check the user and password in CRONBUS_AMQP_URL"
    ]
    absent = _get(f"amqp://guest:guest@127.0.0.1:{services.free_port()}/")
    assert absent.returncode == 2
    (line,) = absent.stderr.strip().splitlines()
    assert "cannot reach RabbitMQ at 127.0.0.1:" in line and "CRONBUS_AMQP_URL" in line
