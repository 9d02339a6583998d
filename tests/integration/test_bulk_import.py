"""Bulk import against the real PostgreSQL and Redis: same validation and placement as upsert."""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
from asyncpg.transaction import Transaction

from shared.contract import codec, keys, timefmt, validation
from shared.policy import netpolicy
from shared.postgres import bulk
from shared.postgres.store import Store
from shared.redis.index import Index
from shared.rules import compact
from shared.rules.plan import IntervalRule

NOW = int(time.time() * 1000)

#: The schedules here call a loopback address.
LOCAL = validation.TargetPolicy(allowed_networks=netpolicy.LOOPBACK)


def line(schedule_id: str, **spec: object) -> bytes:
    return codec.dumps(
        {
            "id": schedule_id,
            "spec": spec or {"kind": "interval", "every_s": 60},
            "target": {"kind": "webhook", "url": "http://127.0.0.1:9/x"},
        }
    )


async def cancel_statements_after_300_ms(admin: asyncpg.Connection) -> None:
    """PostgreSQL cancels any statement of a new connection to the test's database after
    300 ms, as a busy server's statement timeout would."""
    name = await admin.fetchval("SELECT current_database()")
    await admin.execute(f'ALTER DATABASE "{name}" SET statement_timeout = 300')


async def holding(conn: asyncpg.Connection, statement: str) -> Transaction:
    """A transaction of ``conn`` that ran ``statement`` and keeps its locks until rolled back."""
    held = conn.transaction()
    await held.start()
    await conn.execute(statement)
    return held


@pytest.mark.parametrize("workers", [1, 2])
async def test_import_validates_each_line_and_writes_both_stores(
    database_url: str, index: Index, workers: int
) -> None:
    lines = [line(f"s{i}") for i in range(12)]
    lines.insert(3, b'{"id": "bad", "spec": {"kind": "cron", "expr": "0 25 * * *"}}')
    lines.insert(7, b"not json at all")
    lines.append(b"")
    lines.append(line("later", kind="once", at=timefmt.format_ms(NOW + 3_600_000)))
    store = await Store.open(database_url)
    try:
        result = await bulk.import_lines(
            lines, "imp", store, index, LOCAL, batch_size=5, workers=workers
        )
    finally:
        await store.close()
    assert (result.imported, result.created) == (13, 13)
    assert [number for number, _ in result.refused] == [4, 8]
    assert any("spec.expr" in d["field"] for d in result.refused[0][1])
    assert bulk.refused_lines(result)[0].startswith("line 4: ")

    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch("SELECT id, version, state FROM schedules ORDER BY id")
        assert len(rows) == 13 and {r["version"] for r in rows} == {1}
        assert await conn.fetchval("SELECT count(*) FROM commands WHERE verb = 'import'") >= 1
    finally:
        await conn.close()
    member = keys.member("imp", "later")
    due, _, _ = await index.position(index.shard_of("imp", "later"), member)
    assert due == NOW + 3_600_000
    stored = await index.stored_plan(index.shard_of("imp", "s0"), "imp/s0")
    assert stored is not None and compact.version_of(stored) == 1
    interval_due, _, _ = await index.position(index.shard_of("imp", "s0"), "imp/s0")
    assert interval_due is not None and interval_due % 60_000 == 0


async def test_reimport_replaces_but_keeps_a_rotation_whose_times_did_not_change(
    database_url: str, index: Index
) -> None:
    store = await Store.open(database_url)
    try:
        first = [line("same"), line("changed")]
        await bulk.import_lines(first, "imp", store, index, LOCAL, workers=1)
        shard = index.shard_of("imp", "same")
        await index.client.zadd(index.keys.due(shard), {"imp/same": 42})  # a rotation mark
        second = [line("same"), line("changed", kind="interval", every_s=3600)]
        result = await bulk.import_lines(second, "imp", store, index, LOCAL, workers=1)
        assert (result.imported, result.created) == (2, 0)
        row = await store.get_schedule("imp", "changed")
        assert row is not None and row.version == 2
        assert row.next_fire_ms is not None and row.next_fire_ms % 3_600_000 == 0
    finally:
        await store.close()
    assert await index.client.zscore(index.keys.due(shard), "imp/same") == 42
    changed_due, _, _ = await index.position(index.shard_of("imp", "changed"), "imp/changed")
    assert changed_due == row.next_fire_ms


async def test_a_batch_cancelled_by_the_statement_timeout_is_written_on_a_later_try(
    database_url: str, index: Index, caplog: pytest.LogCaptureFixture
) -> None:
    store = await Store.open(database_url)
    try:
        await bulk.import_lines([line("held")], "imp", store, index, LOCAL, workers=1)
    finally:
        await store.close()
    admin = await asyncpg.connect(database_url)
    holder = await asyncpg.connect(database_url)
    try:
        await cancel_statements_after_300_ms(admin)
        held = await holding(holder, "SELECT 1 FROM schedules WHERE id = 'held' FOR UPDATE")
        store = await Store.open(database_url)
        try:
            lines = [line(f"s{i}") for i in range(5)]
            lines.append(line("held", kind="interval", every_s=120))
            importing = asyncio.create_task(
                bulk.import_lines(lines, "imp", store, index, LOCAL, workers=1)
            )
            await asyncio.sleep(1.5)  # the batch's lock wait was cancelled at least once
            assert not importing.done()
            await held.rollback()
            result = await asyncio.wait_for(importing, 60)
        finally:
            await store.close()
        rows = await admin.fetch("SELECT id, version FROM schedules ORDER BY id")
    finally:
        await holder.close()
        await admin.close()
    assert (result.imported, result.created) == (6, 5)
    assert {r["id"]: r["version"] for r in rows} == {
        "held": 2,
        **{f"s{i}": 1 for i in range(5)},
    }
    retries = [r for r in caplog.records if getattr(r, "action", None) == "import_retry"]
    assert retries and "QueryCanceled" in getattr(retries[0], "error", ""), caplog.records


class CommitReplyCutter:
    """A TCP relay to PostgreSQL that, once armed, closes the client's connection in place of
    passing on the server's reply to a COMMIT: the transaction committed, the client cannot
    tell (as when the network fails at that moment)."""

    #: CommandComplete with the tag COMMIT, as the server sends it.
    COMMITTED = b"C\x00\x00\x00\x0bCOMMIT\x00"

    def __init__(self, database_url: str) -> None:
        parts = urlsplit(database_url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 5432
        self.database_url = database_url
        self.armed = False
        self.cuts = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        """The URL of the database through the relay (plain text, so the reply can be seen)."""
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        parts = urlsplit(self.database_url)
        netloc = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
        query = "&".join(q for q in (parts.query, "sslmode=disable") if q)
        return urlunsplit((parts.scheme, f"{netloc}127.0.0.1:{port}", parts.path, query, ""))

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _serve(self, client: asyncio.StreamReader, to_client: asyncio.StreamWriter) -> None:
        server, to_server = await asyncio.open_connection(self.host, self.port)

        async def pipe(
            source: asyncio.StreamReader, sink: asyncio.StreamWriter, replies: bool
        ) -> None:
            try:
                while data := await source.read(65536):
                    if replies and self.armed and self.COMMITTED in data:
                        self.armed = False
                        self.cuts += 1
                        return
                    sink.write(data)
                    await sink.drain()
            except OSError:
                pass
            finally:
                to_client.close()
                to_server.close()

        await asyncio.gather(pipe(client, to_server, False), pipe(server, to_client, True))


async def test_a_batch_whose_commit_reply_was_lost_is_not_written_again(
    database_url: str, index: Index
) -> None:
    cutter = CommitReplyCutter(database_url)
    relayed = await cutter.start()
    store = await Store.open(relayed)
    try:
        cutter.armed = True
        result = await bulk.import_lines(
            [line(f"s{i}") for i in range(5)], "imp", store, index, LOCAL, workers=1
        )
    finally:
        await store.close()
        await cutter.stop()
    assert cutter.cuts == 1, "the relay never saw the batch's COMMIT"
    admin = await asyncpg.connect(database_url)
    try:
        rows = await admin.fetch("SELECT id, version FROM schedules ORDER BY id")
        audits = await admin.fetchval("SELECT count(*) FROM commands WHERE verb = 'import'")
    finally:
        await admin.close()
    # Five schedules created once: the retry found the batch committed and wrote it no more.
    assert (result.imported, result.created) == (5, 5)
    assert {r["id"]: r["version"] for r in rows} == {f"s{i}": 1 for i in range(5)}
    assert audits == 1
    for i in range(5):
        shard = index.shard_of("imp", f"s{i}")
        assert await index.client.hexists(index.keys.sched(shard), f"imp/s{i}")


async def test_an_analyze_that_fails_does_not_fail_the_import_it_follows(
    database_url: str, index: Index, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bulk, "ANALYZE_AFTER", 3)
    monkeypatch.setattr(bulk, "WRITE_ATTEMPTS", 2)
    admin = await asyncpg.connect(database_url)
    holder = await asyncpg.connect(database_url)
    try:
        await cancel_statements_after_300_ms(admin)
        # A lock ANALYZE waits for (as behind a long VACUUM): its statement times out.
        held = await holding(holder, "LOCK TABLE schedules IN SHARE UPDATE EXCLUSIVE MODE")
        store = await Store.open(database_url)
        try:
            result = await bulk.import_lines(
                [line(f"s{i}") for i in range(3)], "imp", store, index, LOCAL, workers=1
            )
        finally:
            await store.close()
            await held.rollback()
        count = await admin.fetchval("SELECT count(*) FROM schedules")
    finally:
        await holder.close()
        await admin.close()
    assert (result.imported, result.created, count) == (3, 3, 3)


async def test_a_schedule_created_by_a_command_while_the_batch_runs_is_replaced_at_a_new_version(
    database_url: str, index: Index
) -> None:
    store = await Store.open(database_url)
    try:
        await bulk.import_lines([line("model")], "imp", store, index, LOCAL, workers=1)
    finally:
        await store.close()
    creator = await asyncpg.connect(database_url)
    try:
        # A command creating "raced" as the intake does: its key's lock, then the row, not yet
        # committed when the import's batch looks for the rows it replaces.
        creating = creator.transaction()
        await creating.start()
        await creator.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended('cronbus-schedule:' || $1, 0))",
            "imp/raced",
        )
        await creator.execute(
            "INSERT INTO schedules (namespace, id, version, state, definition, compact, fires, "
            "next_fire_at, rotation_version) SELECT namespace, 'raced', version, state, "
            "definition, compact, fires, next_fire_at, rotation_version FROM schedules "
            "WHERE id = 'model'"
        )
        store = await Store.open(database_url)
        try:
            importing = asyncio.create_task(
                bulk.import_lines(
                    [line("raced", kind="interval", every_s=120)],
                    "imp",
                    store,
                    index,
                    LOCAL,
                    workers=1,
                )
            )
            await asyncio.sleep(0.5)
            await creating.commit()
            result = await asyncio.wait_for(importing, 30)
        finally:
            await store.close()
        version = await creator.fetchval("SELECT version FROM schedules WHERE id = 'raced'")
    finally:
        await creator.close()
    # Two writes of a schedule must not share a version: the index keeps the first it gets and
    # takes the other for one already applied, and drift repair, which compares versions,
    # never sees the difference.
    assert version == 2
    assert result.created == 0


@pytest.mark.parametrize("form", ["binary", "json"])
async def test_schedules_are_written_in_the_configured_form_and_read_in_either(
    database_url: str, index: Index, form: compact.Form
) -> None:
    """CRONBUS_COMPACT_FORM=json keeps what versions before the binary form can read, in
    PostgreSQL and in Redis, for the length of a rolling upgrade; services writing the binary
    form then read and replace those values."""

    async def stored_forms(version: int) -> tuple[bytes, bytes]:
        conn = await asyncpg.connect(database_url)
        try:
            row = await conn.fetchrow("SELECT version, compact FROM schedules WHERE id = 'f'")
        finally:
            await conn.close()
        in_redis = await index.stored_plan(index.shard_of("imp", "f"), "imp/f")
        assert row is not None and in_redis is not None and row["version"] == version
        assert compact.decode(in_redis) == compact.decode(row["compact"])
        return row["compact"], in_redis

    for version, (writer, every_s) in enumerate([(form, 60), ("binary", 120)], start=1):
        store = await Store.open(database_url, compact_form=writer)
        written_as = Index(index.client, index.keys, index.shards, writer)
        try:
            schedule = line("f", kind="interval", every_s=every_s)
            await bulk.import_lines([schedule], "imp", store, written_as, LOCAL, workers=1)
        finally:
            await store.close()
        in_postgres, in_redis = await stored_forms(version)
        assert compact.is_json(in_postgres) == compact.is_json(in_redis) == (writer == "json")
        assert compact.decode(in_redis).rule == IntervalRule(every_s * 1000)


@pytest.mark.parametrize("form", ["binary", "json"])
async def test_migrate_rewrites_every_schedule_in_one_form(
    database_url: str, index: Index, form: compact.Form
) -> None:
    """``cronbus migrate --compact-form``: rows of the other form rewritten, page by page,
    the same schedules; rows already in the form left alone."""
    writers: list[tuple[compact.Form, list[str]]] = [
        ("json", ["j0", "j1", "j2"]),
        ("binary", ["b0", "b1"]),
    ]
    for writer, ids in writers:
        store = await Store.open(database_url, compact_form=writer)
        try:
            lines = [line(i, kind="interval", every_s=60 + n) for n, i in enumerate(ids)]
            await bulk.import_lines(lines, "imp", store, index, LOCAL, workers=1)
        finally:
            await store.close()
    conn = await asyncpg.connect(database_url)
    try:
        before = {
            r["id"]: r["compact"] for r in await conn.fetch("SELECT id, compact FROM schedules")
        }
        store = await Store.open(database_url)
        try:
            assert await store.rewrite_compact_form(form, batch=2) == (3 if form == "binary" else 2)
            assert await store.rewrite_compact_form(form, batch=2) == 0
        finally:
            await store.close()
        after = {
            r["id"]: r["compact"] for r in await conn.fetch("SELECT id, compact FROM schedules")
        }
    finally:
        await conn.close()
    assert after.keys() == before.keys()
    for schedule_id, value in after.items():
        assert compact.is_json(value) == (form == "json")
        assert compact.decode(value) == compact.decode(before[schedule_id])


async def test_migrate_to_json_rewrites_a_binary_row_at_version_123(
    database_url: str, index: Index
) -> None:
    """msgpack packs 123 as ``{``: read by its first byte, such a row looked like JSON already,
    so going back (``cronbus migrate --compact-form json``) left it binary, unreadable by the
    version gone back to."""
    store = await Store.open(database_url)
    try:
        await bulk.import_lines(
            [line("v", kind="interval", every_s=60)], "imp", store, index, LOCAL
        )
        conn = await asyncpg.connect(database_url)
        try:
            row = await conn.fetchrow("SELECT compact FROM schedules WHERE id = 'v'")
            assert row is not None
            at_123 = compact.with_version(row["compact"], 123)
            await conn.execute(
                "UPDATE schedules SET version = 123, compact = $1 WHERE id = 'v'", at_123
            )
            assert await store.rewrite_compact_form("json") == 1
            value = await conn.fetchval("SELECT compact FROM schedules WHERE id = 'v'")
        finally:
            await conn.close()
    finally:
        await store.close()
    assert value.startswith(b'{"v":123,') and compact.decode(value) == compact.decode(at_123)
