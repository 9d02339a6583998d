"""a hostile ``before`` gets a 400 naming the field, never a 500.

``before`` is parsed as RFC 3339 and then handed to PostgreSQL, which converts it to UTC: a
valid time at the edge of the calendar with a far offset (9999-12-31T23:59:59-14:00) lies
outside what datetime can hold, asyncpg raises DataError (OverflowError), and the page is an
unhandled 500 with a traceback in the log instead of "before: ..." (bad input must get a clear
error naming the field).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from shared.postgres.store import Store
from shared.redis.index import Index
from tests.integration.test_console import _client, _row, _seed


@pytest.mark.parametrize(
    "path",
    [
        "/failures?before=9999-12-31T23:59:59-14:00",
        "/failures?before=0001-01-01T00:00:00%2B14:00",
        "/ns/billing/s/invoice-1?before=9999-12-31T23:59:59-14:00",
    ],
)
async def test_a_before_outside_the_calendar_is_a_bad_request(
    database_url: str,
    index: Index,
    store: Store,
    path: str,
) -> None:
    await _seed(store)
    client: Any = await _client(database_url, index)
    try:
        response = await client.get(path)
        text = await response.text()
    finally:
        await client.close()
    assert response.status == 400, (response.status, text[:200])
    assert "before" in text


async def test_the_definition_view_does_not_show_header_values(
    database_url: str,
    index: Index,
    store: Store,
) -> None:
    """Target URLs may not carry credentials ("put them in headers"), so a webhook's headers
    hold tenants' tokens; the console shows every namespace to every user of the proxy, and
    its definition view must name the headers without their values."""
    row = _row("billing", "with-token")
    assert isinstance(row.definition, dict)
    definition = dict(row.definition)
    definition["target"] = {
        **definition["target"],
        "headers": {"Authorization": "Bearer tenant-token-123", "X-Api-Key": "key-456"},
    }
    async with store.transaction() as conn:
        await store.put_schedules(conn, [dataclasses.replace(row, definition=definition)])
    client: Any = await _client(database_url, index)
    try:
        response = await client.get("/ns/billing/s/with-token")
        text = await response.text()
    finally:
        await client.close()
    assert response.status == 200
    assert "Authorization" in text and "X-Api-Key" in text
    assert "tenant-token-123" not in text and "key-456" not in text
