"""What a newcomer missed in the console (issue 27, point 7): a retried attempt is shown,
failures filter by namespace, reads are not listed as changes, a UTC schedule has one time
column, and the words say what they mean."""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from services.console.readmodel import ReadModel
from shared.contract.rows import CommandAudit, failed_attempt
from shared.postgres.store import Store
from shared.redis.index import Index
from tests.integration.test_console import _client, _execution, _row


@pytest.fixture
async def console(database_url: str, index: Index) -> AsyncIterator[TestClient[Any, Any]]:
    client = await _client(database_url, index)
    yield client
    await client.close()


async def _seed(store: Store) -> None:
    async with store.transaction() as conn:
        await store.put_schedules(
            conn,
            [
                _row("demo", "flaky", spec={"kind": "interval", "every_s": 20}),
                _row("other", "broken", spec={"kind": "interval", "every_s": 20}),
            ],
        )
    first = _execution("demo", "flaky", 40, "retrying", http_status=503, error="HTTP 503")
    first.failed_attempts = [failed_attempt(first)]
    # The same occurrence (nominal time) as the first attempt, wherever the clock has moved.
    retried = dataclasses.replace(
        _execution("demo", "flaky", 40, "succeeded", attempts=2, late_ms=1_200),
        nominal_ms=first.nominal_ms,
        idempotency_key=first.idempotency_key,
    )
    dead = _execution("other", "broken", 30, "dead", http_status=500, error="HTTP 500")
    dead.failed_attempts = [failed_attempt(dead)]
    await store.write_executions([first, retried, dead])
    await store.record_command(CommandAudit("demo", "upsert", "flaky", "ok", version=1))
    await store.record_command(CommandAudit("demo", "get", "flaky", "ok"))


async def test_a_retried_attempt_filters_and_words(
    store: Store, console: TestClient[Any, Any]
) -> None:
    await _seed(store)
    page = await (await console.get("/ns/demo/s/flaky")).text()
    executions = page.split('id="executions"', 1)[1].split("</table>", 1)[0]
    # The success after a retry shows both attempts, the failed one with its status.
    assert "2 attempts" in executions and "HTTP 503" in executions
    # Lateness is the first attempt's (12 ms), not the retry's.
    assert "p50 12 ms" in page
    audit = page.split('id="audit-h"', 1)[1]
    assert "upsert" in audit and "<td>get</td>" not in audit
    # A UTC schedule: one time column, and no "in UTC and in UTC".
    assert "in UTC and in UTC" not in page
    assert page.count('<th scope="col">UTC</th>') == 1
    assert "not in the index" not in page

    everywhere = await (await console.get("/failures")).text()
    assert "demo/flaky" in everywhere and "other/broken" in everywhere
    only = await (await console.get("/failures?namespace=demo")).text()
    assert re.findall(r'href="/ns/[^/]+/s/[^"]+">([^<]+)<', only) == ["demo/flaky"]
    bad = await console.get("/failures?namespace=no%20such")
    assert bad.status == 400


async def test_the_home_rates_are_whole_minutes_so_they_do_not_read_low(
    database_url: str, index: Index, store: Store
) -> None:
    now = dt.datetime(2026, 11, 25, 12, 5, 30, tzinfo=dt.UTC)
    this_minute = now.replace(second=0)
    # 60 fires in each of the five whole minutes before this one; this one, half gone, 30.
    minutes = [(this_minute - dt.timedelta(minutes=m), 60) for m in range(1, 6)]
    minutes += [(this_minute, 30), (this_minute - dt.timedelta(minutes=6), 60)]
    await store.pool.executemany(
        "INSERT INTO namespace_minutes (namespace, minute, fires) VALUES ('steady', $1, $2)",
        minutes,
    )
    model = await ReadModel.open(database_url, index, 10)
    try:
        (summary,) = [s for s in await model.namespaces(now) if s.namespace == "steady"]
    finally:
        await model.close()
    assert summary.rates.fires_per_min == 60
    assert summary.rates.hour_fires == 60 * 6 + 30
