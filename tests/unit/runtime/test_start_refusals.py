"""Review r16 (issue 16): start-up errors that retrying fixes must wait, not crash."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import asyncpg
import pytest

from shared.runtime import transient


@pytest.mark.parametrize(
    "error",
    [
        # SQLSTATE 53300: max_connections, or a role's/database's CONNECTION LIMIT, is reached
        # while other clients hold their connections: it clears when they let go.
        asyncpg.TooManyConnectionsError("sorry, too many clients already"),
        asyncpg.TooManyConnectionsError('too many connections for role "cronbus"'),
    ],
)
async def test_postgres_too_many_connections_at_start_is_waited_out(error: Exception) -> None:
    calls = 0

    async def open_store() -> str:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise error
        return "open"

    assert transient.refusal(error) is None
    opened = await asyncio.wait_for(
        transient.retry(open_store, what="postgres", setting="CRONBUS_DATABASE_URL"), 5
    )
    assert opened == "open"
    assert calls == 2


@pytest.mark.parametrize(
    ("setting", "url"),
    [
        ("CRONBUS_REDIS_URL", "redis://:not-the-password@127.0.0.1:notaport/0"),
        ("CRONBUS_DATABASE_URL", "postgresql://u:not-the-password@127.0.0.1:notaport/db"),
    ],
)
def test_a_malformed_dependency_url_stops_the_start_with_one_line(setting: str, url: str) -> None:
    """A URL no driver can parse is a bad setting: one line naming it, exit 2, no traceback
    (today: a ValueError traceback from urllib or asyncpg, exit 1)."""
    result = subprocess.run(
        [sys.executable, "-m", "services.sweeper"],
        env={**os.environ, setting: url, "CRONBUS_METRICS_PORT": "0"},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2, result.stderr[-500:]
    assert "Traceback" not in result.stderr
    assert "not-the-password" not in result.stderr
    assert any(
        line.startswith("cronbus sweeper: ") and setting in line
        for line in result.stderr.splitlines()
    ), result.stderr[-500:]
