"""The audit barrier in PostgreSQL (``services.executor.barrier`` says why): a rebuild asks
for one and waits until every live executor answered it."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import asyncpg

from shared.postgres.sql import QUERIES

#: A rebuild waits for an executor's audit writer that has not answered its barrier if it was
#: heard of within ``AUDIT_WRITER_RECENT_S`` before the barrier was asked for, until it has
#: been silent for ``AUDIT_WRITER_ALIVE_S`` (it heartbeats every half second, beside its
#: flushes): a dead one's unwritten rows are lost with it, and one PostgreSQL could not hear
#: from for a while (an outage) is given those seconds to come back with what it holds.
AUDIT_WRITER_RECENT_S = 60.0
AUDIT_WRITER_ALIVE_S = 5.0


@dataclass(frozen=True, slots=True)
class Request:
    """A barrier asked for: its number, and when (PostgreSQL's clock)."""

    number: int
    at: dt.datetime


async def answer(pool: asyncpg.Pool, writer: str, answered: int) -> int:
    """An executor is alive and answered barrier ``answered``; returns the latest one asked
    for."""
    return int(await pool.fetchval(QUERIES["answer_audit_barrier"], writer, answered))


async def forget(pool: asyncpg.Pool, writer: str) -> None:
    """An executor stopped: no rebuild waits for it."""
    await pool.execute(QUERIES["forget_audit_writer"], writer)


async def request(pool: asyncpg.Pool) -> Request:
    """A new barrier, for a rebuild about to read the checkpoints."""
    record = await pool.fetchrow(QUERIES["request_audit_barrier"])
    assert record is not None
    return Request(int(record["requested"]), record["at"])


async def writers_behind(pool: asyncpg.Pool, asked: Request) -> list[str]:
    """The executors taken for alive that have not answered barrier ``asked``."""
    records = await pool.fetch(
        QUERIES["audit_writers_behind"],
        asked.number,
        asked.at,
        AUDIT_WRITER_RECENT_S,
        AUDIT_WRITER_ALIVE_S,
    )
    return [str(r["writer"]) for r in records]


async def trim(pool: asyncpg.Pool, before: dt.datetime) -> None:
    """Writers not heard of since ``before`` are forgotten (they died long ago)."""
    await pool.execute(QUERIES["trim_audit_writers"], before)
