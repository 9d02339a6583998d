"""The console service: the web pages on CRONBUS_CONSOLE_PORT, health and metrics beside them."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from services.console.readmodel import ReadModel
from services.console.web import Console
from shared.runtime import transient
from shared.runtime.config import ConsoleSettings
from shared.runtime.service import ServiceBase, Tasks

log = logging.getLogger(__name__)


class ConsoleService(ServiceBase):
    name = "console"
    # Actions open their own short connection with the console's broker user, per action.
    uses_amqp = False

    def __init__(self, settings: ConsoleSettings) -> None:
        super().__init__(settings)
        self.settings = settings
        self.serving = False

    def readiness(self) -> dict[str, bool]:
        status = super().readiness()
        status["serving"] = self.serving
        return status

    async def run(self, stopping: asyncio.Event) -> None:
        tasks = self.tasks = Tasks(stopping)
        settings, connections = self.settings, self.connections
        model: ReadModel | None = None
        try:
            await connections.open(stopping, tasks)
            model = await transient.retry(
                lambda: ReadModel.open(
                    settings.database_url, connections.index, settings.console_page_size
                ),
                what="postgres",
                stopping=stopping,
            )
            runner = web.AppRunner(
                Console(settings, model).app(),
                access_log=None,
                handle_signals=False,
                shutdown_timeout=settings.shutdown_grace_s,
            )
            await runner.setup()
            site = web.TCPSite(runner, settings.console_host, settings.console_port)
            await site.start()
            self.serving = True
            log.info(
                "console ready",
                extra={"action": "ready", "url": site.name, "actions": settings.console_actions},
            )
            await stopping.wait()
            # Stop accepting, let the pages being rendered finish, then close the pools.
            self.serving = False
            await runner.cleanup()
            await tasks.wait_all(settings.shutdown_grace_s)
        finally:
            if model is not None:
                await model.close()
            await connections.close()
