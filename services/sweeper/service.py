"""The sweeper service: recovery and housekeeping, with health and metrics."""

from __future__ import annotations

import asyncio
import logging

from services.sweeper.sweeper import Sweeper
from shared.runtime.config import SweeperSettings
from shared.runtime.service import ServiceBase, Tasks, finish_budget_s

log = logging.getLogger(__name__)


class SweeperService(ServiceBase):
    name = "sweeper"
    uses_amqp = False

    def __init__(self, settings: SweeperSettings) -> None:
        super().__init__(settings)
        self.settings = settings

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
            await tasks.wait_all(finish_budget_s(self.settings.shutdown_grace_s))
        finally:
            await connections.close()
