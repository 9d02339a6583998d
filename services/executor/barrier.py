"""Which rebuild request an executor may answer (pure; the audit writer does the I/O).

A rebuild of a lost index reads the schedules' checkpoints from PostgreSQL. A completion that
Redis acknowledged before it lost its data, and whose checkpoint still waited in an executor's
audit buffer, would be missing from that read: the rebuild would place the occurrence again
and, where the misfire policy moves on to a later time, count one fire too few (one fire more
than ``max_fires``). So a rebuild first asks for a barrier (a request number in PostgreSQL)
and waits until every live executor has answered it; an executor answers a request only once
every completion it had begun to settle when it read the request is written.

Settlements are numbered as they begin. Redis acknowledging a completion happens after its
settlement began, and the request was committed after Redis lost its data, so a completion
the rebuild must see was begun before the executor read the request: its number is below the
one noted then.
"""

from __future__ import annotations


class Barrier:
    def __init__(self) -> None:
        self._next_ticket = 0
        self._open: set[int] = set()
        #: The latest request read, and the first ticket begun after it was read.
        self._requested = 0
        self._first_after = 0
        #: The latest request answered in PostgreSQL.
        self.answered = 0

    def settling(self) -> int:
        """A settlement begins (before its completions go to Redis): its ticket."""
        ticket = self._next_ticket
        self._next_ticket += 1
        self._open.add(ticket)
        return ticket

    def settled(self, ticket: int) -> None:
        """A settlement ended: whatever it wrote in Redis is in the audit buffer (or never
        will be: its round trip failed)."""
        self._open.discard(ticket)

    def learn(self, requested: int) -> None:
        """The request number just read from PostgreSQL."""
        if requested > self._requested:
            self._requested = requested
            self._first_after = self._next_ticket

    @property
    def asked(self) -> bool:
        """A request is known that is not answered yet (the buffer should be written now)."""
        return self._requested > self.answered

    def answerable(self) -> int:
        """The latest request that may be answered once what is buffered now is written."""
        if self.asked and min(self._open, default=self._first_after) >= self._first_after:
            return self._requested
        return self.answered
