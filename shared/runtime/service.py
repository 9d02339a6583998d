"""The run-loop shape every service shares: signals, named side tasks, health, metrics.

A service runs until SIGTERM (or SIGINT), then stops taking new work, finishes or hands back
what it holds within ``shutdown_grace_s``, and exits. If one of its named tasks dies, the
service stops and exits non-zero so that its supervisor (Kubernetes) restarts it.

The grace period is a bound, whatever is unreachable: once it is nearly spent the work still
under way (a reconnect, a retried write, a pool refill) is cancelled, and what the service
could not hand back is left to the leases and the sweeper, as after a crash. The last log
line says what was left behind. A watchdog thread ends the process if even that hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Literal, Protocol, TypeVar

import prometheus_client
import pydantic
from aio_pika.abc import AbstractRobustConnection
from aiohttp import web

from shared.contract import codec, errors, keys
from shared.policy import eviction
from shared.postgres import db, positions
from shared.postgres.store import Store
from shared.rabbitmq import amqp
from shared.redis import connection, index
from shared.runtime import logs, metrics, stopsignal, transient
from shared.runtime.config import CommonSettings

log = logging.getLogger(__name__)

Check = Callable[[], Awaitable[object]]
#: How a stopping service's work ended: by itself, cancelled, or hanging on even then.
Ending = Literal["finished", "cut_off", "hung"]
SettingsT = TypeVar("SettingsT", bound=CommonSettings)

#: Of the grace period, the part kept back to cancel what is still under way and close the
#: connections (at most half of the period).
CUT_OFF_RESERVE_S = 1.0
#: Of the grace period, the part kept for handing back (leases released, last writes) after
#: the work under way had its share.
HAND_BACK_RESERVE_S = 2.0
#: How long after the grace period the watchdog ends a process whose shutdown hangs anyway.
WATCHDOG_MARGIN_S = 1.0
#: Longest wait for one connection to close politely before it is dropped.
CLOSE_TIMEOUT_S = 1.0
#: Exit status of a service that could not start: a setting must change (as for a bad value).
EXIT_REFUSED = 2


class Service(Protocol):
    name: str

    async def run(self, stopping: asyncio.Event) -> None:
        """Work until ``stopping`` is set, then finish or hand back what is held."""

    def readiness(self) -> dict[str, bool]:
        """Each dependency (or state) the service needs to do useful work: whether it has it."""

    def alive(self) -> bool:
        """False when a task the service depends on died: /healthz fails, the process exits 1."""

    def left_behind(self) -> dict[str, int]:
        """What the service still holds as it exits (counts by kind), for the last log line."""


def finish_budget_s(grace_s: float) -> float:
    """How long, of ``grace_s``, a stopping service lets the work under way finish: the rest
    is kept to hand back what is held and to cut off what hangs."""
    return max(grace_s - HAND_BACK_RESERVE_S - CUT_OFF_RESERVE_S, grace_s / 2)


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
                        extra={
                            "action": "dependency_down",
                            "dependency": name,
                            "error": transient.said(exc),
                        },
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

    def unfinished(self) -> int:
        return sum(1 for task in self.tasks.values() if not task.done())

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


async def serve(service: Service, settings: CommonSettings) -> tuple[int, bool]:
    """Run ``service`` with its health server until a signal (or a dead task) stops it.

    Returns the exit status and whether the service ended cleanly; when it did not (it was
    cancelled and still hangs), the caller must not wait for the event loop to wind down.
    """
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in stopsignal.STOP_SIGNALS:
        loop.add_signal_handler(sig, stopping.set)
    if stopsignal.received():  # while the process was starting
        stopping.set()
    runner, port = await _start_http(_health_app(service), settings.metrics_port)
    log.info("service starting", extra={"action": "service_starting", "metrics_port": port})
    started = time.monotonic()
    # Asked to stop before it began: nothing to start, nothing to hand back.
    work = asyncio.create_task(
        _stopped_at_once() if stopping.is_set() else service.run(stopping), name="service"
    )
    grace_s = settings.shutdown_grace_s
    stopped_at = await _until_stopping(work, stopping)
    _keep_catching_stop_signals(loop)
    _arm_watchdog(service, grace_s + WATCHDOG_MARGIN_S)
    ending = "finished" if work.done() else await _end_within(work, stopped_at + grace_s)
    cut_off = ending != "finished"
    with contextlib.suppress(Exception):
        await asyncio.wait_for(runner.cleanup(), CLOSE_TIMEOUT_S)
    code = 0 if service.alive() else 1
    error = work.exception() if work.done() and not work.cancelled() else None
    if isinstance(error, errors.DependencyRefused):
        # One line naming the setting and the reason: an operator must change it.
        print(f"cronbus {service.name}: {error.setting}: {error.reason}", file=sys.stderr)
        return EXIT_REFUSED, True
    if error is not None and not isinstance(error, transient.Stopped):
        if not cut_off:
            raise error  # a bug: its traceback is wanted
        # Cancelled work may end in whatever the call it was cut off in raised.
        log.warning("cut-off work ended in an error", extra={"error": repr(error)})
    log.log(
        logging.WARNING if cut_off else logging.INFO,
        "service stopped",
        extra={
            "action": "service_stopped",
            "uptime_s": round(time.monotonic() - started, 1),
            "stop_s": round(time.monotonic() - stopped_at, 2),
            "cut_off": cut_off,
            "left_behind": _left_behind(service),
        },
    )
    return code, ending != "hung"


def _keep_catching_stop_signals(loop: asyncio.AbstractEventLoop) -> None:
    """Hand the stop signals from the loop back to ``stopsignal`` once the stop is decided.

    Closing the loop would give them back their default disposition (death by the signal):
    a SIGTERM while the interpreter winds down would turn a clean exit status into -15.
    """
    for sig in stopsignal.STOP_SIGNALS:
        loop.remove_signal_handler(sig)
    stopsignal.catch()


async def _stopped_at_once() -> None:
    log.info("stop asked for while starting", extra={"action": "stopped_while_starting"})


async def _until_stopping(work: asyncio.Task[None], stopping: asyncio.Event) -> float:
    """Wait until the service is asked to stop (or ends by itself); when that happened."""
    asked = asyncio.create_task(stopping.wait(), name="stop-signal")
    await asyncio.wait({work, asked}, return_when=asyncio.FIRST_COMPLETED)
    asked.cancel()
    stopping.set()
    return time.monotonic()


async def _end_within(work: asyncio.Task[None], deadline: float) -> Ending:
    """Let ``work`` finish or hand back what it holds; near the deadline, cancel what is still
    under way (a reconnect, a retried write)."""
    total = max(deadline - time.monotonic(), 0.0)
    reserve = min(CUT_OFF_RESERVE_S, total / 2)
    await asyncio.wait({work}, timeout=total - reserve)
    if work.done():
        return "finished"
    log.warning(
        "grace period nearly spent: cancelling what is still under way",
        extra={"action": "shutdown_cut_off"},
    )
    work.cancel()
    await asyncio.wait({work}, timeout=max(deadline - time.monotonic(), 0.1))
    return "cut_off" if work.done() else "hung"


def _left_behind(service: Service) -> dict[str, int]:
    try:
        return {kind: count for kind, count in service.left_behind().items() if count}
    except Exception:  # the last log line must not fail the exit
        log.exception("could not count what is left behind")
        return {}


def _arm_watchdog(service: Service, after_s: float) -> None:
    """End the process ``after_s`` from now whatever hangs (a blocked loop, a stuck close)."""

    def expire() -> None:
        log.error(
            "shutdown overran the grace period; exiting now",
            extra={
                "action": "service_stopped",
                "cut_off": True,
                "left_behind": _left_behind(service),
            },
        )
        _exit_now(0 if service.alive() else 1)

    timer = threading.Timer(after_s, expire)
    timer.daemon = True
    timer.start()


def _exit_now(code: int) -> None:
    """Exit without unwinding (what is held is left to leases, as after a crash)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def load_settings(name: str, cls: type[SettingsT]) -> SettingsT:
    """The service's settings from CRONBUS_* variables; a bad value stops the start with one
    line per variable naming it and the reason (exit status 2), not a traceback."""
    try:
        return cls()
    except pydantic.ValidationError as exc:
        for error in exc.errors():
            print(f"cronbus {name}: configuration: {_config_error(error)}", file=sys.stderr)
        sys.exit(2)


def _config_error(error: Any) -> str:
    """``CRONBUS_X: reason``; an error of several settings together names them itself."""
    if not error["loc"]:
        return str(error["msg"]).removeprefix("Value error, ")
    variable = "CRONBUS_" + "_".join(str(part) for part in error["loc"]).upper()
    return f"{variable}: {error['msg']}"


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
        code, clean = runner.run(serve(service, settings))
        if not clean:
            _exit_now(code)  # cancelling the rest of the loop's tasks could hang as well
    sys.exit(code)


class Connections:
    """Redis, PostgreSQL and (optionally) RabbitMQ of one service, with their health checks.

    The checks exist before anything is connected, so /readyz and ``cronbus_dependency_up``
    report a dependency that is down at start just as one that goes away later.
    """

    def __init__(self, settings: CommonSettings, name: str, *, amqp: bool) -> None:
        self.settings = settings
        self.name = name
        self.redis = connection.connect(settings)
        self.index = index.Index(
            self.redis,
            keys.RedisKeys(settings.redis_prefix),
            settings.shards,
            settings.compact_form,
        )
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
        """Connect everything, waiting out dependencies that are not there yet.

        A refusal that waiting cannot mend (credentials, a missing vhost or database) raises
        errors.DependencyRefused naming the setting to change.
        """
        tasks.start("dependencies", self.dependencies.watch(stopping))
        settings = self.settings
        if settings.migrate_on_start:
            await transient.retry(
                lambda: db.migrate(settings.database_url),
                what="migrate",
                stopping=stopping,
                setting="CRONBUS_DATABASE_URL",
            )
        await transient.retry(
            self.index.load_scripts, what="redis", stopping=stopping, setting="CRONBUS_REDIS_URL"
        )
        await self._check_eviction(stopping)
        self._store = await transient.retry(
            lambda: Store.open(settings.database_url, compact_form=settings.compact_form),
            what="postgres",
            stopping=stopping,
            setting="CRONBUS_DATABASE_URL",
        )
        await self._check_binding(stopping)
        if self.wants_amqp:
            self._amqp = await transient.retry(
                lambda: amqp.connect(settings.amqp_url, f"cronbus-{self.name}"),
                what="rabbitmq",
                stopping=stopping,
                setting="CRONBUS_AMQP_URL",
            )

    async def _check_eviction(self, stopping: asyncio.Event) -> None:
        """Refuse a Redis that may evict the index's keys (a schedule would stop firing in
        silence)."""
        info = await transient.retry(
            lambda: self.redis.info("memory"), what="redis", stopping=stopping
        )
        refusal = eviction.eviction_refusal(eviction.policies_in(info))
        if refusal is not None:
            raise errors.DependencyRefused("CRONBUS_REDIS_URL", refusal)

    async def _check_binding(self, stopping: asyncio.Event) -> None:
        """Refuse an index that belongs to another database (another deployment under the
        same prefix): firing it would fire that deployment's schedules (invariant 9). An
        index with no owner recorded is bound to this database."""
        store = self.store
        identity = await transient.retry(
            lambda: positions.database_identity(store.pool), what="postgres", stopping=stopping
        )
        foreign = await transient.retry(
            lambda: self.index.bind(identity), what="redis", stopping=stopping
        )
        if foreign is not None:
            raise errors.DependencyRefused(
                "CRONBUS_REDIS_URL, CRONBUS_REDIS_PREFIX",
                f"the index under prefix {self.settings.redis_prefix!r} belongs to another "
                f"database ({foreign}), not this one ({identity}); give this deployment its "
                "own Redis or prefix",
            )

    async def close(self) -> None:
        """Close each connection, dropping it when it does not close politely in time (a
        server that is down or slow must not hold the shutdown)."""
        if self._amqp is not None:
            await _close_within(self._amqp.close(), "rabbitmq")
        if self._store is not None:
            pool = self._store.pool
            if not await _close_within(pool.close(), "postgres"):
                pool.terminate()
        await _close_within(self.redis.aclose(), "redis")


async def _close_within(closing: Awaitable[object], what: str) -> bool:
    """Await a close for at most CLOSE_TIMEOUT_S; False when it failed or took too long."""
    try:
        await asyncio.wait_for(closing, CLOSE_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - whatever the driver raises, the exit goes on
        log.warning(
            "connection dropped at shutdown",
            extra={
                "action": "connection_dropped",
                "dependency": what,
                "error": transient.said(exc),
            },
        )
        return False
    return True


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

    def left_behind(self) -> dict[str, int]:
        """Named tasks that had to be cut off; services add what they hold."""
        return {"tasks": self.tasks.unfinished() if self.tasks is not None else 0}
