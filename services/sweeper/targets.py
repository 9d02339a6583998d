"""At start, say how many stored schedules have an AMQP target the settings refuse.

Such a schedule stays stored (nothing is dropped silently) and fails at every delivery until
it is changed; the warning line points the operator to ``cronbus doctor``, which lists them.
"""

from __future__ import annotations

import asyncio
import logging

from shared.policy import exchanges
from shared.postgres.store import Store
from shared.runtime import transient

log = logging.getLogger(__name__)

#: Schedules read per page (keyset pages: no long snapshot).
PAGE = 5000
#: Refused schedules named in the warning line; ``cronbus doctor`` lists them all.
EXAMPLES = 5


async def report_refused(
    store: Store, policy: exchanges.ExchangePolicy, stopping: asyncio.Event
) -> int | None:
    """How many live schedules ``policy`` refuses (None: not known, PostgreSQL went away or
    the service is stopping); one warning line when there are some."""
    count = 0
    examples: list[str] = []
    try:
        async for page in store.amqp_targets(PAGE):
            for item in exchanges.refused_targets(page, policy):
                count += 1
                if len(examples) < EXAMPLES:
                    examples.append(f"{item.namespace}/{item.id} -> {item.exchange!r}")
            if stopping.is_set():
                return None
    except transient.ERRORS as exc:
        # Only a report: the next start checks again, and cronbus doctor can be run any time.
        log.warning(
            "stored AMQP targets not checked: %r",
            exc,
            extra={"action": "amqp_targets_unchecked"},
        )
        return None
    if count:
        log.warning(
            "%d stored schedule(s) have an AMQP target refused by %s=%r: each of their "
            "occurrences fails until the target is changed; `cronbus doctor` lists them",
            count,
            exchanges.SETTING,
            policy.describe(),
            extra={"action": "amqp_targets_refused", "count": count, "examples": examples},
        )
    return count
