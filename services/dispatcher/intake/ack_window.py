"""Which deliveries of one channel can be acknowledged, several in one frame (pure).

An ack with ``multiple`` settles every unsettled delivery up to its tag, so it may only name a
tag below every delivery still in progress: commands finish out of order (commands on different
schedules run concurrently). Deliveries are begun in the order of their tags (the consumer
starts each command as it arrives); should one ever begin out of order, the window stops
trusting the order and acknowledges each delivery on its own from then on. Finished deliveries
held back behind a slow command are acknowledged one by one once more than ``max_held`` of them
wait, so that a stuck command cannot take the whole prefetch window with it. A delivery
abandoned (its command ended neither acknowledged nor given back) stays unsettled for good: no
ack of several may cover it, and those after it are acknowledged one by one.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

#: Finished deliveries held back behind a command in progress, at most.
MAX_HELD = 64


@dataclass(frozen=True, slots=True)
class Ack:
    """One ack frame: ``tag`` (and with ``multiple``, every unsettled tag below it)."""

    tag: int
    multiple: bool
    #: The finished deliveries it settles.
    settles: tuple[int, ...]


@dataclass(slots=True)
class AckWindow:
    """One channel's deliveries in progress and those finished but not yet acknowledged."""

    max_held: int = MAX_HELD
    in_progress: set[int] = field(default_factory=set)
    #: The tags in progress, lowest first (settled ones removed lazily).
    _lowest: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    highest_begun: int = 0
    in_order: bool = True
    #: The lowest delivery abandoned (None: none).
    abandoned: int | None = None

    def begin(self, tag: int) -> None:
        if tag <= self.highest_begun:
            self.in_order = False
        self.highest_begun = max(self.highest_begun, tag)
        self.in_progress.add(tag)
        heapq.heappush(self._lowest, tag)

    def finish(self, tag: int) -> None:
        """The delivery is answered: it is to be acknowledged."""
        self.in_progress.discard(tag)
        self.finished.append(tag)

    def drop(self, tag: int) -> None:
        """The delivery was settled otherwise (a nack, sent before any later ack)."""
        self.in_progress.discard(tag)

    def abandon(self, tag: int) -> bool:
        """The delivery's command ended without an ack or a nack; False (and nothing done)
        when it had one."""
        if tag not in self.in_progress:
            return False
        self.in_progress.discard(tag)
        self.abandoned = tag if self.abandoned is None else min(self.abandoned, tag)
        return True

    def idle(self) -> bool:
        return not self.in_progress and not self.finished

    def take(self) -> list[Ack]:
        """The acks to send now (the finished deliveries they settle are forgotten)."""
        if not self.finished:
            return []
        if not self.in_order:
            return self._one_by_one(self._take_finished(lambda _: True))
        floors = [f for f in (self._lowest_in_progress(), self.abandoned) if f is not None]
        floor = min(floors, default=None)
        below = self._take_finished(lambda tag: floor is None or tag < floor)
        acks = [Ack(max(below), True, tuple(below))] if below else []
        abandoned = self.abandoned
        if abandoned is not None:
            acks += self._one_by_one(self._take_finished(lambda tag: tag > abandoned))
        if len(self.finished) > self.max_held:
            acks += self._one_by_one(self._take_finished(lambda _: True))
        return acks

    def _lowest_in_progress(self) -> int | None:
        while self._lowest and self._lowest[0] not in self.in_progress:
            heapq.heappop(self._lowest)
        return self._lowest[0] if self._lowest else None

    def _take_finished(self, taken: Callable[[int], bool]) -> list[int]:
        out = [tag for tag in self.finished if taken(tag)]
        self.finished = [tag for tag in self.finished if not taken(tag)]
        return out

    @staticmethod
    def _one_by_one(tags: list[int]) -> list[Ack]:
        return [Ack(tag, False, (tag,)) for tag in sorted(tags)]
