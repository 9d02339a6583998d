"""The audit barrier in PostgreSQL (``services.executor.barrier`` says why): a rebuild asks
for one and waits until every live executor answered it."""

from __future__ import annotations

import datetime as dt

import asyncpg

from shared.postgres.sql import QUERIES

#: An executor's audit writer not heard of for this long (s) is taken for dead by a rebuild's
#: audit barrier: it heartbeats every half second, and a dead one's unwritten rows are lost.
AUDIT_WRITER_ALIVE_S = 5.0


async def answer(pool: asyncpg.Pool, writer: str, answered: int) -> int:
    """An executor is alive and answered barrier ``answered``; returns the latest one asked
    for."""
    return int(await pool.fetchval(QUERIES["answer_audit_barrier"], writer, answered))


async def forget(pool: asyncpg.Pool, writer: str) -> None:
    """An executor stopped: no rebuild waits for it."""
    await pool.execute(QUERIES["forget_audit_writer"], writer)


async def request(pool: asyncpg.Pool) -> int:
    """A new barrier, for a rebuild about to read the checkpoints."""
    return int(await pool.fetchval(QUERIES["request_audit_barrier"]))


async def writers_behind(pool: asyncpg.Pool, requested: int) -> list[str]:
    """The live executors (heard of within ``AUDIT_WRITER_ALIVE_S``) that have not answered
    barrier ``requested``."""
    records = await pool.fetch(QUERIES["audit_writers_behind"], requested, AUDIT_WRITER_ALIVE_S)
    return [str(r["writer"]) for r in records]


async def trim(pool: asyncpg.Pool, before: dt.datetime) -> None:
    """Writers not heard of since ``before`` are forgotten (they died long ago)."""
    await pool.execute(QUERIES["trim_audit_writers"], before)
