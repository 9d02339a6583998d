"""The sweeper service: recovery and housekeeping, with health and metrics."""

from __future__ import annotations

import asyncio
import logging

from services.sweeper.sweeper import Sweeper
from shared import db, index, keys, transient
from shared.config import SweeperSettings
from shared.service import Dependencies, Tasks
from shared.store import Store

log = logging.getLogger(__name__)


class SweeperService:
    name = "sweeper"

    def __init__(self, settings: SweeperSettings) -> None:
        self.settings = settings
        self.deps: Dependencies | None = None
        self.tasks: Tasks | None = None

    def readiness(self) -> dict[str, bool]:
        return dict(self.deps.status) if self.deps else {"redis": False, "postgres": False}

    def alive(self) -> bool:
        return self.tasks is None or self.tasks.alive()

    async def run(self, stopping: asyncio.Event) -> None:
        settings = self.settings
        tasks = self.tasks = Tasks(stopping)
        if settings.migrate_on_start:
            await transient.retry(
                lambda: db.migrate(
                    settings.database_url, partitions_ahead_days=settings.partitions_ahead_days
                ),
                what="migrate",
                stopping=stopping,
            )
        redis = index.connect(settings)
        idx = index.Index(redis, keys.RedisKeys(settings.redis_prefix), settings.shards)
        await transient.retry(idx.load_scripts, what="redis", stopping=stopping)
        store = await transient.retry(
            lambda: Store.open(settings.database_url), what="postgres", stopping=stopping
        )
        try:
            self.deps = Dependencies({"redis": idx.client.ping, "postgres": store.ping})
            tasks.start("dependencies", self.deps.watch(stopping))
            sweeper = Sweeper(settings, idx, store, stopping)
            tasks.start("sweep-loop", sweeper.run())
            log.info("sweeper ready", extra={"action": "ready"})
            await stopping.wait()
            await tasks.wait_all(settings.shutdown_grace_s)
        finally:
            await store.close()
            await redis.aclose()
