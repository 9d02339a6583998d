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


async def test_a_run_that_needed_two_attempts_shows_its_first_attempts_error(
    store: Store, console: TestClient[Any, Any]
) -> None:
    """Issue 36, newcomer 5: the flaky schedule's run succeeded on its second attempt; its
    Error cell was blank, hiding what the first attempt met."""
    await _seed(store)
    page = await (await console.get("/ns/demo/s/flaky")).text()
    table = page.split('id="executions"', 1)[1].split("</table>", 1)[0]
    (row,) = re.findall(r"<tr>(.*?)</tr>", table.split("<tbody>", 1)[1], re.S)
    error_cell = re.findall(r'<td class="err">(.*?)</td>', row, re.S)[-1]
    assert error_cell.strip() == "attempt 1: HTTP 503", row
    failures = await (await console.get("/failures?namespace=demo")).text()
    assert '<td class="err">attempt 1: HTTP 503</td>' in failures


async def test_an_unknown_namespace_is_not_found(
    store: Store, console: TestClient[Any, Any]
) -> None:
    """Issue 36, newcomer 5: /ns/<unknown> answered 200 with an empty list, as if it existed."""
    await _seed(store)
    unknown = await console.get("/ns/no-such-namespace")
    assert unknown.status == 404
    text = await unknown.text()
    assert "No such namespace" in text and "&#39;no-such-namespace&#39;" in text
    assert 'href="/"' in text  # back to the namespaces
    # A namespace that exists answers, even when a filter leaves nothing to list.
    assert (await console.get("/ns/demo?q=zzz")).status == 200
    # Its schedules all deleted, a namespace still listed on the home page (last hour's
    # deliveries) answers too.
    await store.pool.execute("UPDATE schedules SET state = 'deleted' WHERE namespace = 'other'")
    await store.pool.execute(
        "INSERT INTO namespace_minutes (namespace, minute, fires) VALUES ('other', now(), 1)"
    )
    assert (await console.get("/ns/other")).status == 200


async def test_a_new_namespaces_rate_is_taken_over_the_time_it_was_recorded(
    database_url: str, index: Index, store: Store
) -> None:
    """Issue 36, newcomer 5: right after start the home page said 0 fires / min beside 1 fire
    in the last hour (the current minute was left out, and five minutes were counted that the
    namespace had not been running)."""
    now = dt.datetime(2026, 11, 25, 12, 5, 20, tzinfo=dt.UTC)
    this_minute = now.replace(second=0)
    # 'fresh' fired once, in this minute; 'young' fires every second since 12:03:00.
    await store.pool.executemany(
        "INSERT INTO namespace_minutes (namespace, minute, fires) VALUES ($1, $2, $3)",
        [
            ("fresh", this_minute, 1),
            ("young", this_minute - dt.timedelta(minutes=2), 60),
            ("young", this_minute - dt.timedelta(minutes=1), 60),
            ("young", this_minute, 20),
        ],
    )
    model = await ReadModel.open(database_url, index, 10)
    try:
        found = {s.namespace: s.rates for s in await model.namespaces(now)}
    finally:
        await model.close()
    # Less than a minute recorded: no rate yet, rather than a 0 that is not true.
    assert found["fresh"].fires_per_min is None and found["fresh"].hour_fires == 1
    assert "less than a minute" in found["fresh"].window
    # 140 fires in the 2 min 20 s since it began: 60 a minute (the old page said 24).
    assert found["young"].fires_per_min == pytest.approx(60)
    assert found["young"].window == "per minute over the last 2 min 20 s"
