"""``cronbus import FILE.jsonl``: bulk-load schedules (one JSON schedule per line)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from cronbus.cli.common import CliError
from shared.contract import keys
from shared.contract.errors import ValidationFailed
from shared.postgres import bulk
from shared.postgres.store import Store
from shared.redis import connection, index
from shared.runtime import transient
from shared.runtime.config import DispatcherSettings


def _lines(path: str) -> Iterator[bytes]:
    if path == "-":
        yield from sys.stdin.buffer
        return
    try:
        with Path(path).open("rb") as handle:
            yield from handle
    except OSError as exc:
        raise CliError(f"{path}: {exc.strerror or exc}") from None


async def import_file(
    path: str, namespace: str, batch: int, settings: DispatcherSettings | None = None
) -> bulk.ImportResult:
    settings = settings or DispatcherSettings()
    redis = connection.connect(settings)
    try:
        idx = index.Index(
            redis, keys.RedisKeys(settings.redis_prefix), settings.shards, settings.compact_form
        )
        await idx.load_scripts()
        store = await Store.open(
            settings.database_url, min_size=1, max_size=2, compact_form=settings.compact_form
        )
        try:
            result = await bulk.import_lines(
                _lines(path), namespace, store, idx, settings.target_policy(), batch_size=batch
            )
        finally:
            await store.close()
        if result.earliest_fire_ms is not None:
            await redis.publish(idx.keys.wake_channel, str(result.earliest_fire_ms))
        return result
    finally:
        await redis.aclose()


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    try:
        result = asyncio.run(import_file(args.file, args.namespace, args.batch))
    except ValidationFailed as failure:
        raise CliError(str(failure)) from None
    except transient.ERRORS as exc:
        raise CliError(f"cannot reach Redis or PostgreSQL: {exc}") from None
    for line in bulk.refused_lines(result):
        print(f"cronbus import: {line}", file=sys.stderr)
    elapsed = time.monotonic() - started
    print(
        f"imported {result.imported} schedules ({result.created} new) into "
        f"{args.namespace} in {elapsed:.1f}s; refused {len(result.refused)}"
    )
    return 1 if result.refused else 0
