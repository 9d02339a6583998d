"""The sweeper service: recovery and housekeeping, with health and metrics."""

from __future__ import annotations

import asyncio
import logging

from services.sweeper.sweeper import Sweeper
from shared.config import SweeperSettings
from shared.service import Connections, Tasks

log = logging.getLogger(__name__)


class SweeperService:
    name = "sweeper"

    def __init__(self, settings: SweeperSettings) -> None:
        self.settings = settings
        self.connections = Connections(settings, self.name, amqp=False)
        self.tasks: Tasks | None = None

    def readiness(self) -> dict[str, bool]:
        return dict(self.connections.dependencies.status)

    def alive(self) -> bool:
        return self.tasks is None or self.tasks.alive()

    async def run(self, stopping: asyncio.Event) -> None:
        tasks = self.tasks = Tasks(stopping)
        connections = self.connections
        try:
            await connections.open(stopping, tasks)
            sweeper = Sweeper(self.settings, connections.index, connections.store, stopping)
            tasks.start("sweep-loop", sweeper.run())
            log.info("sweeper ready", extra={"action": "ready"})
            await stopping.wait()
            # The loop finishes the step it is in (the lock expires if it cannot).
            await tasks.wait_all(self.settings.shutdown_grace_s)
        finally:
            await connections.close()
