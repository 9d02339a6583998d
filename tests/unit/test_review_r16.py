"""Review r16 (issue 16): start-up errors that retrying fixes must wait, not crash."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from shared import transient


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
