"""Delivering one occurrence to its target: an HTTP webhook or an AMQP publish."""

from __future__ import annotations

import asyncio
import time

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractRobustConnection

from services.executor.http import HttpClient, HttpError
from services.executor.settle import Outcome
from shared import limits, timefmt
from shared.delivery import Occurrence
from shared.plan import AmqpPlan, WebhookPlan

USER_AGENT = "cronbus/0.1"


def pinned_headers(occ: Occurrence, key: str) -> dict[str, str]:
    """The headers every delivery carries (the pinned contract)."""
    headers = {
        "Idempotency-Key": key,
        "X-Cronbus-Schedule": f"{occ.namespace}/{occ.id}",
        "X-Cronbus-Fire-Time": timefmt.format_ms(occ.nominal_ms),
        "X-Cronbus-Attempt": str(occ.attempt),
    }
    if occ.is_trigger:
        headers["X-Cronbus-Trigger"] = "manual"
    return headers


class Webhooks:
    """One pooled HTTP client for every webhook this executor calls."""

    def __init__(self, connections_per_host: int) -> None:
        self.client = HttpClient(connections_per_host, user_agent=USER_AGENT)

    async def close(self) -> None:
        await self.client.close()

    async def deliver(self, occ: Occurrence, key: str) -> Outcome:
        target = occ.plan.target
        assert isinstance(target, WebhookPlan)
        headers = list(target.headers)
        headers += pinned_headers(occ, key).items()
        if target.body is not None:
            headers.append(("Content-Type", "application/json"))
        try:
            response = await self.client.request(
                target.method, target.url, headers, target.body, target.timeout_ms / 1000
            )
        except TimeoutError:
            return Outcome(False, None, f"timed out after {target.timeout_ms / 1000:g}s")
        except HttpError as exc:
            return Outcome(False, None, str(exc)[:500])
        status = response.status
        if _succeeded(status, target.success_codes):
            return Outcome(True, status)
        text = response.body.decode("utf-8", "replace").strip()
        return Outcome(
            False,
            status,
            f"HTTP {status}" + (f": {text}" if text else ""),
            _retry_after_ms(status, response.retry_after),
        )


def _retry_after_ms(status: int, value: str | None) -> int | None:
    """What a 429 or 503 asks with Retry-After (capped by the executor's limits)."""
    if status not in limits.BACKPRESSURE_STATUSES:
        return None
    return limits.retry_after_ms(value, int(time.time() * 1000), limits.MAX_RETRY_AFTER_MS)


def _succeeded(status: int, codes: frozenset[int] | None) -> bool:
    return status in codes if codes is not None else 200 <= status < 300


class AmqpTargets:
    """Publishes to users' exchanges with publisher confirms; ``message_id`` is the key."""

    def __init__(self, connection: AbstractRobustConnection) -> None:
        self.connection = connection
        self._channel: AbstractChannel | None = None
        self._lock = asyncio.Lock()

    async def _ensure_channel(self) -> AbstractChannel:
        async with self._lock:
            if self._channel is None or self._channel.is_closed:
                self._channel = await self.connection.channel(
                    publisher_confirms=True, on_return_raises=True
                )
            return self._channel

    async def deliver(self, occ: Occurrence, key: str) -> Outcome:
        target = occ.plan.target
        assert isinstance(target, AmqpPlan)
        headers: dict[str, object] = dict(target.headers)
        pinned = pinned_headers(occ, key)
        del pinned["Idempotency-Key"]
        headers.update(pinned)
        message = aio_pika.Message(
            target.body or b"",
            content_type="application/json",
            message_id=key,
            headers=headers,  # type: ignore[arg-type]
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            timestamp=occ.nominal_ms / 1000,
        )
        try:
            channel = await self._ensure_channel()
            exchange = (
                await channel.get_exchange(target.exchange, ensure=False)
                if (target.exchange)
                else channel.default_exchange
            )
            await exchange.publish(
                message,
                routing_key=target.routing_key,
                mandatory=True,
                timeout=target.timeout_ms / 1000,
            )
        except aio_pika.exceptions.DeliveryError as exc:
            return Outcome(False, None, f"not routed: {exc}"[:500])
        except Exception as exc:  # noqa: BLE001 - a failed attempt, retried by policy
            return Outcome(False, None, f"{type(exc).__name__}: {exc}"[:500])
        return Outcome(True)
