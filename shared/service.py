"""The run-loop shape every service shares: signals, named side tasks, health, metrics.

A service runs until SIGTERM (or SIGINT), then stops taking new work, finishes or hands back
what it holds within ``shutdown_grace_s``, and exits. If one of its named tasks dies, the
service stops and exits non-zero so that its supervisor (Kubernetes) restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol, TypeVar

import prometheus_client
import pydantic
from aio_pika.abc import AbstractRobustConnection
from aiohttp import web

from shared import amqp, codec, db, index, keys, logs, metrics, transient
from shared.config import CommonSettings
from shared.store import Store

log = logging.getLogger(__name__)

Check = Callable[[], Awaitable[object]]
SettingsT = TypeVar("SettingsT", bound=CommonSettings)


class Service(Protocol):
    name: str

    async def run(self, stopping: asyncio.Event) -> None:
        """Work until ``stopping`` is set, then finish or hand back what is held."""

    def readiness(self) -> dict[str, bool]:
        """Each dependency (or state) the service needs to do useful work: whether it has it."""

    def alive(self) -> bool:
        """False when a task the service depends on died: /healthz fails, the process exits 1."""


class Dependencies:
    """Checks each dependency every few seconds; /readyz and a gauge report the results."""

    def __init__(
        self, checks: dict[str, Check], interval_s: float = 2.0, timeout_s: float = 2.0
    ) -> None:
        self.checks = checks
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.status = dict.fromkeys(checks, False)

    async def check_once(self) -> None:
        for name, check in self.checks.items():
            try:
                await asyncio.wait_for(check(), self.timeout_s)
                up = True
            except Exception as exc:  # noqa: BLE001 - any failure means "down"
                up = False
                if self.status.get(name, True):
                    log.warning(
                        "dependency down",
                        extra={"action": "dependency_down", "dependency": name, "error": repr(exc)},
                    )
            if up and not self.status.get(name, False):
                log.info("dependency up", extra={"action": "dependency_up", "dependency": name})
            self.status[name] = up
            metrics.DEPENDENCY_UP.labels(name).set(1 if up else 0)

    async def watch(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            await self.check_once()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), self.interval_s)


class Tasks:
    """Named side tasks; the first one to die unexpectedly stops the service."""

    def __init__(self, stopping: asyncio.Event) -> None:
        self.stopping = stopping
        self.tasks: dict[str, asyncio.Task[Any]] = {}
        self.failed: str | None = None

    def start(self, name: str, coroutine: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(coroutine, name=name)
        self.tasks[name] = task
        task.add_done_callback(self._on_done)
        return task

    def _on_done(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled() or self.stopping.is_set():
            return
        error = task.exception()
        self.failed = task.get_name()
        log.error(
            "task stopped unexpectedly; stopping the service",
            extra={
                "action": "task_died",
                "task": task.get_name(),
                "error": repr(error) if error else None,
            },
            exc_info=error,
        )
        self.stopping.set()

    def alive(self) -> bool:
        return self.failed is None

    async def wait_all(self, timeout_s: float) -> None:
        """Wait for the tasks to end by themselves, then cancel what is left."""
        pending = [t for t in self.tasks.values() if not t.done()]
        if pending:
            _, still = await asyncio.wait(pending, timeout=timeout_s)
            for task in still:
                task.cancel()
            if still:
                await asyncio.wait(still, timeout=5)


def _health_app(service: Service) -> web.Application:
    async def metrics_view(_: web.Request) -> web.Response:
        return web.Response(
            body=prometheus_client.generate_latest(),
            headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST},
        )

    async def health_view(_: web.Request) -> web.Response:
        alive = service.alive()
        return web.Response(status=200 if alive else 500, text="ok" if alive else "task died")

    async def ready_view(_: web.Request) -> web.Response:
        status = service.readiness()
        ready = all(status.values())
        return web.Response(
            status=200 if ready else 503,
            content_type="application/json",
            body=codec.dumps({"ready": ready, **status}),
        )

    app = web.Application()
    app.router.add_get("/metrics", metrics_view)
    app.router.add_get("/healthz", health_view)
    app.router.add_get("/readyz", ready_view)
    return app


async def _start_http(app: web.Application, port: int) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "0.0.0.0", port, reuse_address=True)
    await site.start()
    bound = port
    server = site._server
    if port == 0 and server is not None and server.sockets:  # type: ignore[attr-defined]
        bound = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    return runner, bound


async def serve(service: Service, settings: CommonSettings) -> int:
    """Run ``service`` with its health server until a signal (or a dead task) stops it."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    runner, port = await _start_http(_health_app(service), settings.metrics_port)
    log.info("service starting", extra={"action": "service_starting", "metrics_port": port})
    started = time.monotonic()
    try:
        await service.run(stopping)
    finally:
        await runner.cleanup()
    log.info(
        "service stopped",
        extra={"action": "service_stopped", "uptime_s": round(time.monotonic() - started, 1)},
    )
    return 0 if service.alive() else 1


def load_settings(name: str, cls: type[SettingsT]) -> SettingsT:
    """The service's settings from CRONBUS_* variables; a bad value stops the start with one
    line per variable naming it and the reason (exit status 2), not a traceback."""
    try:
        return cls()
    except pydantic.ValidationError as exc:
        for error in exc.errors():
            variable = "CRONBUS_" + "_".join(str(part) for part in error["loc"]).upper()
            print(f"cronbus {name}: configuration: {variable}: {error['msg']}", file=sys.stderr)
        sys.exit(2)


def main(name: str, service: Service, settings: CommonSettings) -> None:
    """Entry point of ``python -m services.<name>``: logging, uvloop, run, exit status."""
    logs.setup(settings.log_level, settings.log_format, service=name)
    metrics.export_only(name)
    try:
        import uvloop  # noqa: PLC0415 - optional speed-up

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover - platforms without uvloop
        runner = asyncio.Runner()
    with runner:
        code = runner.run(serve(service, settings))
    sys.exit(code)


class Connections:
    """Redis, PostgreSQL and (optionally) RabbitMQ of one service, with their health checks.

    The checks exist before anything is connected, so /readyz and ``cronbus_dependency_up``
    report a dependency that is down at start just as one that goes away later.
    """

    def __init__(self, settings: CommonSettings, name: str, *, amqp: bool) -> None:
        self.settings = settings
        self.name = name
        self.redis = index.connect(settings)
        self.index = index.Index(self.redis, keys.RedisKeys(settings.redis_prefix), settings.shards)
        self._store: Store | None = None
        self._amqp: AbstractRobustConnection | None = None
        checks: dict[str, Check] = {"redis": self.redis.ping, "postgres": self._ping_postgres}
        if amqp:
            checks["rabbitmq"] = self._check_amqp
        self.dependencies = Dependencies(checks)
        self.wants_amqp = amqp

    @property
    def store(self) -> Store:
        assert self._store is not None, "PostgreSQL is not connected yet"
        return self._store

    @property
    def amqp(self) -> AbstractRobustConnection:
        assert self._amqp is not None, "RabbitMQ is not connected yet"
        return self._amqp

    async def _ping_postgres(self) -> None:
        if self._store is None:
            raise ConnectionError("PostgreSQL not connected yet")
        await self._store.ping()

    async def _check_amqp(self) -> None:
        if self._amqp is None or self._amqp.is_closed:
            raise ConnectionError("RabbitMQ connection is closed")
        # A robust connection is not "closed" while it reconnects, only not connected.
        connected = getattr(self._amqp, "connected", None)
        if connected is not None and not connected.is_set():
            raise ConnectionError("RabbitMQ connection is reconnecting")

    async def open(self, stopping: asyncio.Event, tasks: Tasks) -> None:
        """Connect everything, waiting out dependencies that are not there yet."""
        tasks.start("dependencies", self.dependencies.watch(stopping))
        settings = self.settings
        if settings.migrate_on_start:
            await transient.retry(
                lambda: db.migrate(settings.database_url), what="migrate", stopping=stopping
            )
        await transient.retry(self.index.load_scripts, what="redis", stopping=stopping)
        self._store = await transient.retry(
            lambda: Store.open(settings.database_url), what="postgres", stopping=stopping
        )
        if self.wants_amqp:
            self._amqp = await transient.retry(
                lambda: amqp.connect(settings.amqp_url, f"cronbus-{self.name}"),
                what="rabbitmq",
                stopping=stopping,
            )

    async def close(self) -> None:
        if self._amqp is not None:
            await self._amqp.close()
        if self._store is not None:
            await self._store.close()
        await self.redis.aclose()


class ServiceBase:
    """What the three services share: their settings, connections, tasks and health."""

    name: str = "service"
    uses_amqp: bool = True

    def __init__(self, settings: CommonSettings) -> None:
        self.connections = Connections(settings, self.name, amqp=self.uses_amqp)
        self.tasks: Tasks | None = None

    def readiness(self) -> dict[str, bool]:
        return dict(self.connections.dependencies.status)

    def alive(self) -> bool:
        return self.tasks is None or self.tasks.alive()
