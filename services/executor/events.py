"""Outcome events on ``cronbus.events`` (routing key ``<namespace>.<outcome>``) for watchers.

Events are best effort: published without confirms so that watching never slows firing; the
execution rows in PostgreSQL are the record.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Literal

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractRobustConnection

from shared.contract import codec, keys, timefmt
from shared.contract.rows import ExecutionRow
from shared.runtime import metrics, transient

log = logging.getLogger(__name__)

Outcome = Literal["fired", "succeeded", "failed", "dead", "skipped", "paused"]
FAILURES = frozenset({"failed", "dead", "paused"})


class Events:
    def __init__(
        self, connection: AbstractRobustConnection, which: Literal["all", "failures", "none"]
    ) -> None:
        self.connection = connection
        self.which = which
        self._channel: AbstractChannel | None = None

    def wanted(self, outcome: Outcome) -> bool:
        if self.which == "none":
            return False
        return self.which == "all" or outcome in FAILURES

    async def publish(self, outcome: Outcome, row: ExecutionRow) -> None:
        if not self.wanted(outcome):
            return
        body = {
            "namespace": row.namespace,
            "id": row.id,
            "outcome": outcome,
            "fire_time": timefmt.format_ms(row.nominal_ms),
            "attempt": row.attempts,
            "idempotency_key": row.idempotency_key,
            "trigger": row.is_trigger,
            "backfill": row.is_backfill,
            "http_status": row.http_status,
            "error": row.error,
            "at": timefmt.format_ms(row.finished_ms),
        }
        await self.send(row.namespace, outcome, body)

    async def send(self, namespace: str, outcome: Outcome, event: dict[str, object]) -> None:
        """Publish one event body (best effort) if ``CRONBUS_EVENTS`` wants the outcome."""
        if not self.wanted(outcome):
            return
        body = codec.dumps(event)
        with contextlib.suppress(*transient.ERRORS):
            if self._channel is None or self._channel.is_closed:
                self._channel = await self.connection.channel(publisher_confirms=False)
            exchange = await self._channel.get_exchange(keys.EVENTS_EXCHANGE, ensure=False)
            await exchange.publish(
                aio_pika.Message(body, content_type="application/json"),
                routing_key=keys.event_routing_key(namespace, outcome),
                mandatory=False,
            )
            metrics.EVENTS.labels(outcome).inc()
