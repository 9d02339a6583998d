"""``cronbus bench console``: page times of the console at millions of schedules and executions.

Generates the data once inside PostgreSQL (INSERT ... SELECT generate_series: no row crosses
the network), into its own database (``cronbus_console_bench`` unless given), then serves the
console in this process and times each page over HTTP, the way a browser would ask for it.
``--reuse`` measures an existing generated database again without regenerating it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from typing import Any

import aiohttp
import asyncpg
from aiohttp import web

from cronbus.cli import procs
from cronbus.cli.common import CliError
from services.console.readmodel import ReadModel
from services.console.web import Console
from shared.contract import keys, models, validation
from shared.postgres import db
from shared.postgres.db import split_database_url
from shared.redis import connection, index
from shared.rules import compact
from shared.runtime.config import ConsoleSettings

DEFAULT_DATABASE = "cronbus_console_bench"

#: One valid schedule; every generated row is a copy of it under another id and labels.
TEMPLATE = {
    "id": "template",
    "spec": {"kind": "cron", "expr": "*/5 * * * *", "timezone": "Europe/Berlin"},
    "target": {"kind": "webhook", "url": "http://billing.example:8080/remind"},
    "labels": {"team": "t0"},
}

GENERATE_SCHEDULES = """
INSERT INTO schedules (namespace, id, version, state, definition, compact, priority, labels,
                       fires, last_fire_at, next_fire_at)
SELECT ns, sid, 1,
       CASE WHEN i % 50 = 0 THEN 'paused' WHEN i % 97 = 0 THEN 'completed' ELSE 'active' END,
       jsonb_set(jsonb_set($1::jsonb, '{id}', to_jsonb(sid)), '{labels}', lbl),
       $2::bytea, 0, lbl, 10, now() - interval '5 minutes',
       now() + make_interval(secs => i % 300)
FROM (SELECT i,
             -- Skewed tenants: namespace 0 holds half of everything.
             CASE WHEN i % 2 = 0 THEN 'ns-000'
                  ELSE 'ns-' || lpad((i % $4 + 1)::text, 3, '0') END AS ns,
             'sched-' || lpad(i::text, 8, '0') AS sid,
             jsonb_build_object('team', 't' || (i % 10),
                                'tier', CASE WHEN i % 1000 = 0 THEN 'gold' ELSE 'std' END) AS lbl
      FROM generate_series($3::bigint, $5::bigint) AS i) AS g
"""

#: Executions of schedules [$1, $2): 1 in 40 failed, lateness mostly small with a long tail.
GENERATE_EXECUTIONS = """
INSERT INTO executions (namespace, id, nominal_at, is_trigger, attempts, status, http_status,
                        error, idempotency_key, started_at, finished_at, lateness_ms)
SELECT g.ns, g.sid, t.nominal, false,
       CASE WHEN t.r % 40 = 0 THEN 5 ELSE 1 END,
       CASE WHEN t.r % 80 = 0 THEN 'dead' WHEN t.r % 40 = 0 THEN 'retrying'
            ELSE 'succeeded' END,
       CASE WHEN t.r % 40 = 0 THEN 503 ELSE 200 END,
       CASE WHEN t.r % 40 = 0 THEN 'HTTP 503' END,
       md5(g.sid || t.nominal::text),
       t.nominal + make_interval(secs => t.late / 1000.0),
       t.nominal + make_interval(secs => t.late / 1000.0 + 0.05),
       t.late
FROM (SELECT i,
             CASE WHEN i % 2 = 0 THEN 'ns-000'
                  ELSE 'ns-' || lpad((i % $5 + 1)::text, 3, '0') END AS ns,
             'sched-' || lpad(i::text, 8, '0') AS sid
      FROM generate_series($1::bigint, $2::bigint - 1) AS i) AS g
CROSS JOIN LATERAL (
    SELECT now() - make_interval(secs => (j * $4 + (g.i % 600))::double precision) AS nominal,
           (g.i * 31 + j * 7) AS r,
           CASE WHEN (g.i + j) % 100 = 0 THEN 200 + (g.i % 2000) ELSE (g.i + j) % 40 END AS late
    FROM generate_series(0, $3 - 1) AS j) AS t
"""


def _template() -> tuple[str, bytes]:
    item = models.Schedule.model_validate(TEMPLATE)
    plan = validation.check_schedule(
        item, 1, int(time.time() * 1000), validation.TargetPolicy(), namespace="bench"
    )
    return item.model_dump_json(), compact.encode(plan)


def _bench_url(base: str, name: str) -> str:
    maintenance, _ = split_database_url(base)
    return maintenance.rsplit("/", 1)[0] + "/" + name


async def _generate(url: str, schedules: int, executions: int, namespaces: int) -> None:
    maintenance, name = split_database_url(url)
    conn = await asyncpg.connect(maintenance)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()
    await db.migrate(url)
    per_schedule = max(executions // max(schedules, 1), 1)
    spacing_s = 7 * 86400 // per_schedule
    definition, raw = _template()
    conn = await asyncpg.connect(url)
    try:
        today = dt.datetime.now(dt.UTC).date()
        await db.ensure_partitions(conn, today, 1, behind_days=8)
        started = time.monotonic()
        chunk = 100_000
        for low in range(0, schedules, chunk):
            high = min(low + chunk, schedules) - 1
            await conn.execute(GENERATE_SCHEDULES, definition, raw, low, namespaces - 1, high)
        print(f"schedules: {schedules} in {time.monotonic() - started:.0f} s", flush=True)
        started = time.monotonic()
        for low in range(0, schedules, chunk // 10):
            high = min(low + chunk // 10, schedules)
            await conn.execute(
                GENERATE_EXECUTIONS, low, high, per_schedule, spacing_s, namespaces - 1
            )
            if low % (chunk * 5) == 0:
                print(f"  executions for {high} schedules", flush=True)
        print(
            f"executions: {schedules * per_schedule} in {time.monotonic() - started:.0f} s",
            flush=True,
        )
        await conn.execute("VACUUM (ANALYZE) schedules")
        await conn.execute("ANALYZE executions")
        await conn.execute("VACUUM executions")
    finally:
        await conn.close()


def _pages(namespace: str) -> dict[str, str]:
    sid = "sched-00000042"
    return {
        "namespaces": "/",
        "schedules": f"/ns/{namespace}",
        "schedules, page 100": f"/ns/{namespace}?after=sched-00100000",
        "schedules, id prefix": f"/ns/{namespace}?q=sched-0004",
        "schedules, paused": f"/ns/{namespace}?state=paused",
        "schedules, common label": f"/ns/{namespace}?label=team%3Dt2",
        "schedules, rare label": f"/ns/{namespace}?label=tier%3Dgold",
        "schedule": f"/ns/{namespace}/s/{sid}",
        "failures": "/failures",
        "failures, older": "/failures?before="
        + ((dt.datetime.now(dt.UTC) - dt.timedelta(days=3)).strftime("%Y-%m-%dT%H:%M:%SZ")),
    }


async def _measure(url: str, repeat: int) -> dict[str, dict[str, float]]:
    settings = ConsoleSettings(database_url=url)
    redis = connection.connect(settings)
    idx = index.Index(redis, keys.RedisKeys(settings.redis_prefix + "-console-bench"), 16)
    model = await ReadModel.open(url, idx, settings.console_page_size)
    runner = web.AppRunner(Console(settings, model).app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    results: dict[str, dict[str, float]] = {}
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
            for name, path in _pages("ns-000").items():
                times = []
                for _ in range(repeat + 1):
                    started = time.perf_counter()
                    async with http.get(path) as response:
                        await response.read()
                        if response.status != 200:
                            raise CliError(f"{path}: HTTP {response.status}")
                    times.append((time.perf_counter() - started) * 1000)
                times = sorted(times[1:])  # the first request warms the caches
                results[name] = {
                    "median_ms": round(statistics.median(times), 1),
                    "max_ms": round(times[-1], 1),
                }
    finally:
        await runner.cleanup()
        await model.close()
        await redis.aclose()
    return results


async def _run(args: argparse.Namespace) -> int:
    url = args.database_url or _bench_url(ConsoleSettings().database_url, DEFAULT_DATABASE)
    if not args.reuse:
        await _generate(url, args.schedules, args.executions, args.namespaces)
    conn = await asyncpg.connect(url)
    try:
        counted = await conn.fetchval("SELECT sum(schedules) FROM schedule_counts")
        rows = await conn.fetchval(
            "SELECT reltuples::bigint FROM pg_class WHERE relname = 'executions_default'"
        )
        parts = await conn.fetchval(
            """SELECT sum(c.reltuples)::bigint FROM pg_inherits i
               JOIN pg_class c ON c.oid = i.inhrelid
               WHERE i.inhparent = 'executions'::regclass"""
        )
    finally:
        await conn.close()
    results = await _measure(url, args.repeat)
    figures: dict[str, Any] = {
        "schedules": int(counted or 0),
        "executions_estimate": max(parts or 0, rows or 0),
        "pages": results,
    }
    if args.json:
        print(json.dumps(figures))
        return 0
    print(f"schedules {int(counted or 0)}, executions ≈ {figures['executions_estimate']}")
    for name, result in results.items():
        print(f"  {name:28} median {result['median_ms']:7.1f} ms   max {result['max_ms']:7.1f} ms")
    return 0


def run(args: argparse.Namespace) -> int:
    # It starts no process, but a signal still ends it in order (its connections closed).
    return procs.run_until_signal(_run(args))


def add_kind(kinds: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = kinds.add_parser(
        "console", help="generate N schedules and M executions, then time every console page"
    )
    p.add_argument("--schedules", type=int, default=1_000_000)
    p.add_argument("--executions", type=int, default=10_000_000)
    p.add_argument("--namespaces", type=int, default=20)
    p.add_argument("--repeat", type=int, default=10, help="requests per page measured")
    p.add_argument("--database-url", help=f"database to fill (default: {DEFAULT_DATABASE})")
    p.add_argument("--reuse", action="store_true", help="measure the generated data again")
    p.add_argument("--json", action="store_true", help="one JSON line of figures")
    p.set_defaults(handler=run)
    return p
