"""What a newcomer checks first (issue 27): the counts agree with the execution rows, a retried
occurrence keeps its failed attempt and its lateness is the first attempt's, and a schedule
created by ``cronbus apply -f`` (upsert_many) has an audit row naming it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

from cronbus.cli.sink import Received, Sink
from tests.support.commands import CommandClient, an_hour_from_now
from tests.support.stack import Stack

NS = "newcomer"


def _flaky(request: Received) -> int:
    return 503 if request.path == "/flaky" and request.attempt == 1 else 200


async def _until(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not seen within {timeout_s:g}s: {what}")
        await asyncio.sleep(0.3)


async def test_fires_lateness_attempts_and_audit_agree_with_the_rows(
    stack: Stack, client: CommandClient, database_url: str
) -> None:
    sink = Sink(respond=_flaky)
    await sink.start()
    try:
        await stack.start_all()
        hook = {"kind": "webhook", "url": f"{sink.url}/hook"}
        reply = await client.send(
            NS,
            "upsert_many",
            {
                "schedules": [
                    {"id": "every-1s", "spec": {"kind": "interval", "every_s": 1}, "target": hook},
                    {
                        "id": "flaky",
                        # On the epoch's grid a whole hour would add a row to the trigger's.
                        "spec": {
                            "kind": "interval",
                            "every_s": 3600,
                            "start_at": an_hour_from_now(),
                        },
                        "target": {"kind": "webhook", "url": f"{sink.url}/flaky"},
                        "retry": {"max_attempts": 3, "initial_backoff_s": 1, "full_jitter": False},
                    },
                ]
            },
        )
        assert reply["ok"] and all(r["ok"] for r in reply["results"]), reply
        assert (await client.send(NS, "trigger", {"id": "flaky"}))["ok"]
        assert await sink.wait_for(
            lambda s: sum(r.schedule == f"{NS}/every-1s" for r in s.received) >= 5, 30
        )
        assert await sink.wait_for(
            lambda s: any(r.path == "/flaky" and r.status == 200 for r in s.received), 30
        )
        assert (await client.send(NS, "pause", {"id": "every-1s"}))["ok"]
        conn = await asyncpg.connect(database_url)
        try:

            async def rows_of(schedule_id: str) -> list[Any]:
                return list(
                    await conn.fetch(
                        "SELECT is_trigger, attempts, status, lateness_ms, "
                        "failed_attempts::text AS failed FROM executions "
                        "WHERE namespace = $1 AND id = $2",
                        NS,
                        schedule_id,
                    )
                )

            shown: dict[str, Any] = {}

            async def counts_agree() -> bool:
                got = await client.send(NS, "get", {"id": "every-1s"})
                rows = await rows_of("every-1s")
                regular = [r for r in rows if not r["is_trigger"] and r["status"] != "skipped"]
                shown.update(got=got["schedule"], rows=len(regular))
                return bool(regular) and (
                    got["schedule"]["fires"] == got["schedule"]["stats"]["fires"] == len(regular)
                )

            await _until(counts_agree, 20, "fires == stats.fires == execution rows")
            assert shown["rows"] >= 3, shown

            async def retried_row() -> bool:
                return any(r["status"] == "succeeded" for r in await rows_of("flaky"))

            await _until(retried_row, 20, "the flaky trigger's row")
            (row,) = await rows_of("flaky")
            assert row["attempts"] == 2
            # The first attempt failed with 503: it is kept beside the row's own (the success).
            assert '"http_status": 503' in row["failed"] and '"attempt": 1' in row["failed"]
            # Lateness is the first attempt's, not the retry's (which waited a 1 s backoff).
            assert 0 <= row["lateness_ms"] < 900, row["lateness_ms"]

            audit = await conn.fetch(
                "SELECT verb, outcome, version FROM commands "
                "WHERE namespace = $1 AND schedule_id = $2 ORDER BY seq",
                NS,
                "every-1s",
            )
            assert (audit[0]["verb"], audit[0]["outcome"], audit[0]["version"]) == (
                "upsert_many",
                "ok",
                1,
            )
        finally:
            await conn.close()
    finally:
        await sink.stop()
