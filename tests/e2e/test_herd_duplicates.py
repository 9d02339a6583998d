"""A herd with no fault at all delivers each occurrence exactly once, for every spec kind.

Drift repair used to take a `once` occurrence that had just completed in Redis (its checkpoint
still on its way to PostgreSQL in the next audit batch) for a missing index entry, and put it
back to fire again. The audit flush is slowed down here to widen that window, and drift checks
run every second, so a repair that can touch in-flight or finished work shows up as duplicates.
"""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import time
from typing import Any

import pytest

from cronbus.cli.sink import Sink
from shared.contract import codec, timefmt, validation
from shared.policy import netpolicy
from shared.postgres import bulk
from shared.postgres.store import Store
from shared.redis.index import Index
from tests.support.stack import Stack

HERD = 1500
LEAD_MS = 8000


def herd_spec(kind: str, at_ms: int) -> dict[str, Any]:
    at = timefmt.format_ms(at_ms)
    if kind == "once":
        return {"kind": "once", "at": at}
    if kind == "interval":
        return {"kind": "interval", "every_s": 3600, "start_at": at}
    if kind == "after_completion":
        return {"kind": "after_completion", "delay_s": 3600, "start_at": at}
    when = dt.datetime.fromtimestamp(at_ms / 1000, dt.UTC)
    return {"kind": "cron", "expr": f"{when.second} {when.minute} {when.hour} * * *"}


@pytest.mark.parametrize("kind", ["once", "interval", "cron", "after_completion"])
async def test_a_herd_without_faults_delivers_each_occurrence_once(
    kind: str,
    stack: Stack,
    stack_env: dict[str, str],
    sink: Sink,
    database_url: str,
    index: Index,
) -> None:
    stack_env.update(
        {
            "CRONBUS_AUDIT_FLUSH_MS": "4000",
            "CRONBUS_DRIFT_CHECK_INTERVAL_S": "1",
            "CRONBUS_SWEEP_INTERVAL_S": "0.5",
        }
    )
    await stack.start_all(("dispatcher", "executor", "executor", "sweeper"))
    at_ms = (int(time.time() * 1000) + LEAD_MS) // 1000 * 1000
    lines = [
        codec.dumps(
            {
                "id": f"h{i}",
                "spec": herd_spec(kind, at_ms),
                "target": {"kind": "webhook", "url": f"{sink.url}/h", "timeout_s": 5},
            }
        )
        for i in range(HERD)
    ]
    store = await Store.open(database_url)
    try:
        result = await bulk.import_lines(
            lines,
            "herd",
            store,
            index,
            validation.TargetPolicy(allowed_networks=netpolicy.LOOPBACK),
            workers=1,
        )
    finally:
        await store.close()
    assert result.imported == HERD and not result.refused
    assert int(time.time() * 1000) < at_ms, "the import overran the herd's lead time"

    assert await sink.wait_for(lambda s: len({r.key for r in s.received}) >= HERD, 60), (
        stack.tails()
    )
    # Several drift checks and audit flushes after the herd drained.
    await asyncio.sleep(6)
    copies = collections.Counter(r.key for r in sink.received)
    twice = {key: n for key, n in copies.items() if n > 1}
    assert len(copies) == HERD
    assert twice == {}, f"{len(twice)} keys delivered more than once"
    assert {r.fire_time for r in sink.received} == {timefmt.format_ms(at_ms)}
