"""Delivery messages the broker dead-lettered: their occurrences end dead, and their rotations
go on (a part of ``Executor``)."""

from __future__ import annotations

import logging

from aio_pika.abc import AbstractIncomingMessage

from services.executor import settle, tally
from services.executor.settling import Settling
from shared.contract import delivery
from shared.contract.delivery import Occurrence

log = logging.getLogger("services.executor.executor")


class DeadLetters(Settling):
    async def begin(self, occ: Occurrence) -> int | None:
        raise NotImplementedError

    async def settle_dead_letter(self, message: AbstractIncomingMessage) -> None:
        """A delivery message the broker dead-lettered (redelivered past its limit: it kept
        crashing executors, or was parked as a bug): each occurrence still current ends
        ``dead`` with the reason, an event is published, and its rotation goes on."""
        try:
            occurrences = delivery.decode(message.body)
        except (ValueError, KeyError, TypeError) as exc:
            log.error(
                "dead-lettered delivery message is not one: dropped",
                extra={
                    "action": "dead_letter_dropped",
                    "error": repr(exc),
                    "body": message.body[:1024].decode("utf-8", "replace"),
                },
            )
            await message.ack()
            return
        reason = tally.poison_reason(message.headers or {})
        for occ in occurrences:
            now = await self.begin(occ)
            if now is not None:
                key = occ.idempotency_key
                log.error(
                    "poison delivery: occurrence ends dead",
                    extra={"action": "poison", "schedule": occ.member, "reason": reason},
                )
                await self._settle_many([(occ, settle.poisoned(occ, key, reason, now))])
        await message.ack()
