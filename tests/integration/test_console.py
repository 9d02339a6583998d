"""The console's pages over a real PostgreSQL and Redis: counts, filters, escaping, CSRF."""

from __future__ import annotations

import datetime as dt
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.console.readmodel import ReadModel
from services.console.web import CSRF_COOKIE, Console
from shared.contract import keys, models, validation
from shared.contract.rows import ExecutionRow, NewScheduleRow
from shared.policy import stats
from shared.postgres.store import Store
from shared.redis.index import Index
from shared.rules import compact
from shared.runtime.config import ConsoleSettings

HOSTILE = '<script>alert("x")</script>'


def _now_ms() -> int:
    return int(time.time() * 1000)


def _row(namespace: str, schedule_id: str, **extra: Any) -> NewScheduleRow:
    spec = extra.pop("spec", {"kind": "cron", "expr": "30 2 * * *", "timezone": "Europe/Berlin"})
    item = models.Schedule.model_validate(
        {
            "id": schedule_id,
            "spec": spec,
            "target": {"kind": "webhook", "url": "http://billing.example/hook"},
            "labels": extra.pop("labels", {}),
        }
    )
    plan = validation.check_schedule(
        item, 1, _now_ms(), validation.TargetPolicy(), namespace=namespace
    )
    return NewScheduleRow(
        namespace,
        schedule_id,
        1,
        extra.pop("state", "active"),
        item.model_dump(mode="json"),
        compact.encode(plan),
        0,
        item.labels,
        next_fire_ms=_now_ms() + 60_000,
    )


def _execution(
    namespace: str, schedule_id: str, ago_s: int, status: str, **extra: Any
) -> ExecutionRow:
    nominal = _now_ms() - ago_s * 1000
    return ExecutionRow(
        namespace,
        schedule_id,
        nominal,
        False,
        extra.get("attempts", 1),
        status,
        extra.get("http_status", 200),
        extra.get("error"),
        f"key-{schedule_id}-{nominal}",
        nominal + extra.get("late_ms", 12),
        nominal + extra.get("late_ms", 12) + 40,
    )


async def _client(database_url: str, index: Index, **settings: Any) -> TestClient[Any, Any]:
    config = ConsoleSettings(database_url=database_url, console_page_size=3, **settings)
    model = await ReadModel.open(database_url, index, config.console_page_size)
    app = Console(config, model).app()

    async def close_model(_: object) -> None:
        await model.close()

    app.on_cleanup.append(close_model)
    client: TestClient[Any, Any] = TestClient(TestServer(app))
    await client.start_server()
    return client


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
                _row("billing", "invoice-1", labels={"team": "billing"}),
                _row("billing", "invoice-2", labels={"team": "ops", "x": HOSTILE}),
                _row("billing", "invoice-3", state="paused"),
                _row("billing", "report-1"),
                _row("billing", "report-2"),
                _row("acme", "nightly", spec={"kind": "interval", "every_s": 60}),
            ],
        )
    rows = [
        _execution("billing", "invoice-1", 7200, "dead", http_status=503, error=HOSTILE),
        _execution("billing", "invoice-1", 600, "succeeded", late_ms=250),
        _execution("billing", "invoice-2", 300, "retrying", http_status=500, error="HTTP 500"),
        # 90 s back: it finished in a whole minute before the page's. (60 s back, seeded in a
        # minute's last 52 ms, it finished in that minute: the page's own, which rates leave out.)
        _execution("acme", "nightly", 90, "dead", http_status=None, error="timeout"),
    ]
    await store.write_executions(rows)
    # As the executors' audit writer does with each batch.
    await store.write_minutes(stats.minutes(rows))


async def test_namespaces_show_counts_per_state_and_the_last_hours_failures(
    store: Store, console: TestClient[Any, Any], database_url: str
) -> None:
    await _seed(store)
    text = await (await console.get("/")).text()
    rows = dict(
        re.findall(r'<th scope="row"><a href="/ns/([a-z-]+)">.*?</th>(.*?)</tr>', text, re.S)
    )
    cells = {
        ns: [
            re.sub(r"<[^>]+>", "", c).strip()
            for c in re.findall(r'class="num"[^>]*>(.*?)</td>', row)
        ]
        for ns, row in rows.items()
    }
    # total, active, paused, completed; fires and failed attempts per minute over the last 5
    # minutes, or since acme's first recorded minute (90 s ago: 1 fire over 1.5 to 2.5 min);
    # the last hour's fires, failed attempts and dead (the 2 h old one is not in it)
    assert cells["acme"][:4] + cells["acme"][6:] == ["1", "1", "0", "0", "1", "1", "1"]
    assert all(re.fullmatch(r"0\.[4-7]/min", rate) for rate in cells["acme"][4:6]), cells
    assert cells["billing"][:4] + cells["billing"][6:] == ["5", "4", "1", "0", "2", "1", "0"]

    # The counts follow state changes and deletions, whatever statement makes them.
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute("UPDATE schedules SET state = 'paused' WHERE id = 'report-1'")
        await conn.execute("UPDATE schedules SET state = 'deleted' WHERE id = 'report-2'")
        await conn.execute("DELETE FROM schedules WHERE id = 'nightly'")
        counted = await conn.fetch(
            "SELECT namespace, state, schedules FROM schedule_counts WHERE schedules > 0 "
            "ORDER BY 1, 2"
        )
        truth = await conn.fetch(
            "SELECT namespace, state, count(*) AS schedules FROM schedules GROUP BY 1, 2 "
            "ORDER BY 1, 2"
        )
    finally:
        await conn.close()
    assert [tuple(r) for r in counted] == [tuple(r) for r in truth]


async def test_a_namespace_lists_pages_and_filters_by_prefix_label_and_state(
    store: Store, console: TestClient[Any, Any], index: Index
) -> None:
    await _seed(store)
    shard = keys.shard_of("billing", "invoice-1", index.shards)
    await index.client.zadd(index.keys.due(shard), {"billing/invoice-1": _now_ms() + 5000})

    async def ids(query: str) -> list[str]:
        response = await console.get(f"/ns/billing?{query}")
        assert response.status == 200
        return re.findall(r'href="/ns/billing/s/([^"]+)"', await response.text())

    assert await ids("") == ["invoice-1", "invoice-2", "invoice-3"]  # a page is 3 rows
    assert await ids("after=invoice-3") == ["report-1", "report-2"]
    assert await ids("q=rep") == ["report-1", "report-2"]
    assert await ids("label=team%3Dops") == ["invoice-2"]
    assert await ids("state=paused") == ["invoice-3"]
    assert await ids("q=nothing") == []
    page = await (await console.get("/ns/billing")).text()
    assert "due in" in page  # live state from Redis
    assert 'rel="next" href="/ns/billing?after=invoice-3"' in page
    bad = await console.get("/ns/billing?state=deleted")
    assert bad.status == 400
    assert "state: must be one of" in await bad.text()


async def test_hostile_labels_and_errors_are_escaped_everywhere(
    store: Store, console: TestClient[Any, Any]
) -> None:
    await _seed(store)
    for path in ("/ns/billing", "/failures", "/ns/billing/s/invoice-1", "/ns/billing/s/invoice-2"):
        text = await (await console.get(path)).text()
        assert "<script>alert" not in text, path
    assert "&lt;script&gt;" in await (await console.get("/failures")).text()
    missing = await console.get("/ns/billing/s/%3Cscript%3E")
    assert missing.status == 404
    assert "<script>" not in await missing.text()


async def test_a_schedule_shows_definition_fires_with_dst_history_and_chart(
    store: Store, console: TestClient[Any, Any]
) -> None:
    await _seed(store)
    response = await console.get("/ns/billing/s/invoice-1")
    text = await response.text()
    assert response.status == 200
    assert response.headers["Content-Security-Policy"].startswith("default-src 'none'")
    assert "Europe/Berlin" in text
    assert text.count("<tr") >= 10 + 2  # ten next fires and two executions
    assert "&#34;expr&#34;: &#34;30 2 * * *&#34;" in text
    assert "<svg" in text
    assert 'class="bar failed"' in text
    assert "HTTP" in text
    assert "Pause" not in text  # actions are off by default
    failures = await (await console.get("/failures")).text()
    order = re.findall(r'href="/ns/([a-z-]+/s/[a-z0-9-]+)"', failures)
    assert order == ["acme/s/nightly", "billing/s/invoice-2", "billing/s/invoice-1"]


async def test_actions_need_the_setting_a_form_token_and_the_same_origin(
    store: Store, database_url: str, index: Index
) -> None:
    await _seed(store)
    off = await _client(database_url, index)
    try:
        assert (await off.post("/ns/billing/s/invoice-1/pause")).status == 404
    finally:
        await off.close()
    on = await _client(database_url, index, console_actions=True)
    try:
        page = await on.get("/ns/billing/s/invoice-1")
        text = await page.text()
        assert 'action="/ns/billing/s/invoice-1/pause"' in text
        token = re.search(r'name="csrf" value="([^"]+)"', text)
        assert token is not None
        assert on.session.cookie_jar.filter_cookies(on.make_url("/")).get(CSRF_COOKIE)
        refused = await on.post("/ns/billing/s/invoice-1/pause", data={"csrf": "forged"})
        assert refused.status == 403
        cross = await on.post(
            "/ns/billing/s/invoice-1/pause",
            data={"csrf": token.group(1)},
            headers={"Origin": "https://evil.example"},
        )
        assert cross.status == 403
        assert "cross-origin" in await cross.text()
        unknown = await on.post("/ns/billing/s/invoice-1/explode", data={"csrf": token.group(1)})
        assert unknown.status == 404
    finally:
        await on.close()
    async with store.pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM commands") == 0


async def test_older_pages_of_history_and_failures_follow_the_cursor(
    store: Store, console: TestClient[Any, Any]
) -> None:
    await _seed(store)
    before = (dt.datetime.now(dt.UTC) - dt.timedelta(minutes=30)).strftime("%Y-%m-%dT%H:%M:%SZ")
    text = await (await console.get(f"/failures?before={before}")).text()
    assert re.findall(r'href="/ns/([a-z-]+/s/[a-z0-9-]+)"', text) == ["billing/s/invoice-1"]
    bad = await console.get("/failures?before=yesterday")
    assert bad.status == 400
    assert "before: is not an RFC 3339 time" in await bad.text()


async def test_a_crafted_link_cannot_put_its_text_on_the_page(
    store: Store, console: TestClient[Any, Any]
) -> None:
    await _seed(store)
    await console.get("/")  # a session token
    page = await console.get("/ns/billing/s/invoice-1?message=Call+0800+now&sig=00")
    assert "Call 0800 now" not in await page.text()
