"""Which rebuild barrier an executor may answer (pure; the audit writer does the I/O).

A rebuild of a lost index reads the schedules' checkpoints from PostgreSQL. A fire that Redis
knew of and PostgreSQL did not (a completion whose checkpoint still waited in an executor's
audit buffer, or a delivery under way when Redis lost its data) would be missing from that
read: the rebuild would place the occurrence again and, where the misfire policy moves on to
a later time, count one fire too few (one fire more than ``max_fires``). So a rebuild first
asks for a barrier (a request number in PostgreSQL) and waits until every live executor has
answered it; an executor answers a request once every occurrence it had begun (its delivery
started) when it read the request is settled and written.

An occurrence begun before the data loss was begun before the request was committed, hence
before the executor read it: its ticket, taken before begin.lua was called, is below the
first one taken after the read. Tickets are per copy of an occurrence (a broker may hand one
process two copies of a message), and every message's are ended when it is done with, so a
bug on the way cannot hold every later barrier back.
"""

from __future__ import annotations

from collections.abc import Hashable


class Barrier:
    def __init__(self) -> None:
        self._next_ticket = 0
        #: Occurrences begun and not yet settled (their rows not buffered): key -> ticket.
        self._open: dict[Hashable, int] = {}
        #: The latest request read, and the first ticket taken after it was read.
        self._requested = 0
        self._first_after = 0
        #: The latest request answered in PostgreSQL.
        self.answered = 0

    def begin(self, key: Hashable) -> None:
        """An occurrence's delivery begins (or its settlement, for one not delivered)."""
        self._open[key] = self._next_ticket
        self._next_ticket += 1

    def end(self, key: Hashable) -> None:
        """It is settled, its row and checkpoint in the audit buffer (or it was parked or
        handed back, or its settlement's round trip failed: nothing to write)."""
        self._open.pop(key, None)

    def end_all(self) -> None:
        """Every occurrence begun was handed back (shutdown)."""
        self._open.clear()

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
        if self.asked and min(self._open.values(), default=self._first_after) >= self._first_after:
            return self._requested
        return self.answered
