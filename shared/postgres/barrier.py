"""The audit barrier in PostgreSQL (``services.executor.barrier`` says why): a rebuild asks
for one and waits until every live executor answered it."""

from __future__ import annotations

import datetime as dt

import asyncpg

from shared.postgres.sql import QUERIES

#: A rebuild waits for an executor's audit writer that has not answered its barrier while it
#: was heard of within this long (s): it heartbeats every half second, beside its flushes and
#: until its last rows are written at shutdown. One silent longer is taken for dead (its
#: unwritten rows are lost with it), or cut off from PostgreSQL (a double fault: the rows it
#: holds are written later, and the rebuild does not wait for them).
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


async def writers_behind(pool: asyncpg.Pool, asked: int) -> list[str]:
    """The executors taken for alive that have not answered barrier ``asked``."""
    records = await pool.fetch(QUERIES["audit_writers_behind"], asked, AUDIT_WRITER_ALIVE_S)
    return [str(r["writer"]) for r in records]


async def trim(pool: asyncpg.Pool, before: dt.datetime) -> None:
    """Writers not heard of since ``before`` are forgotten (they died long ago)."""
    await pool.execute(QUERIES["trim_audit_writers"], before)
