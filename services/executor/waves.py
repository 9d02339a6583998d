"""Waiting on many futures at once: a message's slot claims and delivery attempts, taken a
batch at a time as they end."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

from services.executor import settle
from services.executor.settle import Outcome, Settlement
from shared.contract.delivery import Occurrence
from shared.runtime import transient


@dataclass(slots=True)
class Attempt:
    """A delivery attempt that ended, waiting to be settled."""

    occ: Occurrence
    key: str
    #: The Redis clock when it was begun (ms).
    now: int
    outcome: Outcome
    started: int
    finished: int
    #: The Redis clock when it ended (``now`` plus the host's time since it was begun).
    settled_now: int


#: What follows settlements (events, failure counts, pauses) and goes on beside the waves:
#: a message waits for it once all its occurrences are settled, before it is acknowledged.
Later = list[asyncio.Future[Any]]


class Arrivals:
    """Futures as they end, awaited a batch at a time: one callback per future, where
    ``asyncio.wait`` would add and remove one on every future still pending, every time."""

    def __init__(self) -> None:
        self._done: set[asyncio.Future[Any]] = set()
        self._wake: asyncio.Future[None] | None = None

    def add(self, future: asyncio.Future[Any]) -> None:
        self._done.add(future)
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def next(self) -> set[asyncio.Future[Any]]:
        """Those that ended since the last call (waiting for one if none did)."""
        if not self._done:
            self._wake = asyncio.get_running_loop().create_future()
            await self._wake
        done, self._done = self._done, set()
        return done


class Watched(set[asyncio.Future["Attempt | None"]]):
    """Attempts under way, each reported to ``arrivals`` when it ends."""

    def __init__(self, arrivals: Arrivals) -> None:
        super().__init__()
        self.arrivals = arrivals

    def add(self, attempt: asyncio.Future[Attempt | None]) -> None:
        attempt.add_done_callback(self.arrivals.add)
        super().add(attempt)


def ended(
    done: set[asyncio.Future[Any]], attempts: set[asyncio.Future[Attempt | None]]
) -> tuple[list[Attempt], BaseException | None]:
    """The attempts among ``done`` (taken out of ``attempts``) that ended with something to
    settle, and the first failure among them (a bug)."""
    ended: list[Attempt] = []
    failure: BaseException | None = None
    for attempt in done & attempts:
        attempts.discard(attempt)
        if attempt.cancelled():
            continue
        error = attempt.exception()
        if error is not None:
            failure = failure or error
            continue
        result = attempt.result()
        if result is not None:
            ended.append(result)
    return ended, failure


async def kept(step: Awaitable[BaseException | None]) -> BaseException | None:
    """A step of a message's waves (beginning some, settling some), with its failure (a bug,
    not an outage the service stops in) returned, to be raised once the others of the
    message are settled, as one attempt's is: the deliveries still under way are not cut off
    by it (they would go out again with the message's redelivery)."""
    try:
        return await step
    except transient.Stopped:
        raise
    except Exception as exc:  # noqa: BLE001 - raised by the caller once the rest is done
        return exc


def settlements(
    ended: Sequence[Attempt], rng: random.Random
) -> tuple[list[tuple[Occurrence, Settlement]], BaseException | None]:
    """What ended attempts settle to; one that cannot be decided (a bug) is left out, and
    the first such failure returned."""
    settled: list[tuple[Occurrence, Settlement]] = []
    failure: BaseException | None = None
    for a in ended:
        try:
            settled.append(
                (
                    a.occ,
                    settle.settle(
                        a.occ, a.key, a.outcome, a.now, a.settled_now, a.settled_now, rng
                    ),
                )
            )
        except Exception as exc:  # noqa: BLE001 - returned, raised once the rest is done
            failure = failure or exc
    return settled, failure
