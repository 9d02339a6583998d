"""A client that is not connected, or was closed, says so at once instead of waiting out its
timeout (no I/O: nothing is opened)."""

from __future__ import annotations

import time

import pytest

from cronbus import Client, NoReply


async def test_a_closed_client_refuses_at_once() -> None:
    c = Client("amqp://guest:guest@127.0.0.1:5672/", timeout_s=30)
    await c.close()
    started = time.monotonic()
    with pytest.raises(NoReply, match="not connected"):
        await c.send("billing", "get", {"id": "x"})
    with pytest.raises(NoReply):
        await c.get("billing", "x")
    assert time.monotonic() - started < 1
