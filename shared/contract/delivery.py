"""The internal message on ``cronbus.deliveries``: many occurrences per message (pure).

One AMQP message carries up to ``CRONBUS_DELIVERY_BATCH`` occurrences: publishing (and
confirming) a message costs the same whatever it carries, so batching multiplies what one
dispatcher can hand to the executors. Each occurrence keeps its own shard, token and
attempt, so fencing and retries stay per occurrence.

Wire form: ``{"v":1,"o":[[shard, member, token, fire_ms, nominal_ms, attempt, fires, plan,
catch_up],...]}`` where ``plan`` is the compact schedule embedded as is (it is already JSON)
and ``catch_up`` (1 or 0, may be absent) marks an occurrence the misfire policy chose.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shared.contract import codec, keys
from shared.contract.entries import Claimed
from shared.rules import compact, schedule
from shared.rules.plan import Plan

VERSION = 1


@dataclass(slots=True)
class Occurrence:
    shard: int
    member: str
    token: int
    fire_ms: int
    nominal_ms: int
    attempt: int
    fires: int
    plan: Plan
    namespace: str
    id: str
    #: The trigger time when this is a triggered run outside the rotation.
    trigger_ms: int | None
    #: A catch-up the misfire policy chose: delivered however late, never judged again.
    catch_up: bool = False

    @property
    def is_trigger(self) -> bool:
        return self.trigger_ms is not None

    @property
    def due_ms(self) -> int:
        """When the occurrence was due: a regular one at its nominal time plus its jitter, a
        trigger or a backfilled one at its nominal time. Lateness is measured from here."""
        if self.is_trigger or self.is_backfill:
            return self.nominal_ms
        return schedule.fire_at_ms(self.plan, self.member, self.nominal_ms)

    @property
    def is_backfill(self) -> bool:
        """An occurrence of the schedule's backfill (member ``ns/id#b``): the regular
        occurrence at its nominal time again, one at a time, outside the rotation."""
        return keys.is_backfill_member(self.member)

    @property
    def backfill_generation(self) -> int:
        """Which backfill of the schedule this occurrence belongs to: a backfill member's
        state carries the generation where a regular one counts its fires."""
        return self.fires

    @property
    def idempotency_key(self) -> str:
        """A triggered run has its own key, apart from the regular occurrence at its time; a
        backfilled one has the regular occurrence's key (it is that occurrence)."""
        return schedule.occurrence_key(
            self.namespace, self.id, self.nominal_ms, trigger=self.is_trigger
        )


def encode(items: Sequence[Claimed]) -> bytes:
    parts = [
        b"[%d,%s,%d,%d,%d,%d,%d,%s,%d]"
        % (
            c.shard,
            codec.dumps(c.member),
            c.token,
            c.fire_ms,
            c.nominal_ms,
            c.attempt,
            c.fires,
            compact.as_json(c.plan),
            c.catch_up,
        )
        for c in items
    ]
    return b'{"v":%d,"o":[' % VERSION + b",".join(parts) + b"]}"


def _occurrence(row: list[Any]) -> Occurrence:
    shard, member, token, fire_ms, nominal_ms, attempt, fires, plan = row[:8]
    namespace, schedule_id, trigger_ms = keys.split_member(member)
    return Occurrence(
        shard,
        member,
        token,
        fire_ms,
        nominal_ms,
        attempt,
        fires,
        compact.decode_object(plan),
        namespace,
        schedule_id,
        trigger_ms,
        bool(row[8]) if len(row) > 8 else False,
    )


def decode(body: bytes) -> list[Occurrence]:
    """Raises ValueError (or a subclass) when the body is not a delivery message."""
    data = codec.loads(body)
    if not isinstance(data, dict) or data.get("v") != VERSION:
        raise ValueError("not a cronbus delivery message of a known version")
    return [_occurrence(row) for row in data["o"]]
