"""Adversarial review of issue 10 (SSRF guard, bounded HTTP, signatures, secret headers):
each test pins a defect found by trying to break a promise, against a raw server on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from services.executor.http import HttpClient
from services.executor.secrets import SecretHeaders
from services.executor.targets import Webhooks
from shared.contract.delivery import Occurrence
from shared.policy import netpolicy
from shared.rules import schedule
from shared.rules.plan import IntervalRule, Plan, WebhookPlan

Reply = Callable[[bytes], bytes]


async def _serve(reply: Reply) -> AsyncIterator[str]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            writer.write(reply(head))
            await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


@pytest.fixture
async def echoing() -> AsyncIterator[str]:
    """A receiver that refuses the call and quotes the Authorization header it got, as many
    APIs do ("invalid token: ...")."""

    def reply(head: bytes) -> bytes:
        quoted = b""
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"authorization:"):
                quoted = b"invalid credentials " + line.split(b":", 1)[1].strip()
        return b"HTTP/1.1 401 Unauthorized\r\nContent-Length: %d\r\n\r\n%s" % (
            len(quoted),
            quoted,
        )

    async for url in _serve(reply):
        yield url


@pytest.fixture
async def trailing() -> AsyncIterator[str]:
    """A 503 whose Retry-After comes only in the chunked trailer section."""

    def reply(head: bytes) -> bytes:
        return (
            b"HTTP/1.1 503 Busy\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"4\r\nbusy\r\n0\r\nRetry-After: 86400\r\n\r\n"
        )

    async for url in _serve(reply):
        yield url


def _occurrence(url: str, **target: object) -> Occurrence:
    plan = Plan(1, IntervalRule(60_000), WebhookPlan(url=url, **target))  # type: ignore[arg-type]
    return Occurrence(0, "acme/hook", 1, 0, 0, 1, 0, plan, "acme", "hook", None)


async def test_a_secret_header_value_quoted_back_by_the_receiver_is_not_kept_in_the_error(
    echoing: str, tmp_path: Path
) -> None:
    """The failure reason of an attempt goes to PostgreSQL and into events; it quotes the
    response body. A receiver that echoes the secret (or a tenant who points a schedule at
    one) would put the secret's value there, which the design says never happens."""
    (tmp_path / "acme").mkdir()
    (tmp_path / "acme" / "token").write_text("Bearer sk_live_0123456789abcdef\n")
    hooks = Webhooks(
        HttpClient(2, netpolicy.AddressPolicy.from_text(netpolicy.LOOPBACK)),
        secret_headers=SecretHeaders(str(tmp_path)),
    )
    key = schedule.idempotency_key("acme", "hook", 0)
    try:
        outcome = await hooks.deliver(
            _occurrence(f"{echoing}/x", secret_headers=(("Authorization", "token"),)), key
        )
    finally:
        await hooks.close()
    assert not outcome.ok and outcome.http_status == 401
    assert outcome.error is not None and outcome.error.startswith("HTTP 401")
    assert "sk_live_0123456789abcdef" not in outcome.error


async def test_retry_after_in_a_chunked_trailer_is_not_obeyed(trailing: str) -> None:
    """RFC 9110 6.5.1: trailer fields are not merged into the header section unless the
    field's definition allows it, and Retry-After's does not. A hostile receiver can hide a
    hold in the trailer where a proxy or a log would not show it."""
    client = HttpClient(2, netpolicy.AddressPolicy.from_text(netpolicy.LOOPBACK))
    try:
        response = await client.request("POST", f"{trailing}/t", [], b"{}", 5)
    finally:
        await client.close()
    assert response.status == 503 and response.body == b"busy"
    assert response.retry_after is None


async def test_an_idle_connection_is_closed_once_it_expires_without_further_traffic() -> None:
    """'Idle connections expire': today an expired connection is only closed when another
    call puts or takes one, so after a burst the executor keeps every socket open (up to the
    total bound) for as long as no other call comes, holding the receivers' slots."""
    closed = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await writer.drain()
        if await reader.read() == b"":
            closed.set()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = HttpClient(2, netpolicy.AddressPolicy.from_text(netpolicy.LOOPBACK), idle_s=0.2)
    try:
        response = await client.request("GET", f"http://127.0.0.1:{port}/", [], None, 5)
        assert response.status == 204 and response.keep_alive
        await asyncio.wait_for(closed.wait(), 2.0)
    finally:
        await client.close()
        server.close()
        await server.wait_closed()
