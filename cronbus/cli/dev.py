"""``cronbus dev``: migrations, all three services and the console locally, with a status line.

With ``--demo`` it also starts a sink that prints every delivery and registers a few demo
schedules that fire into it, so a newcomer sees cronbus work within a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from cronbus.cli import output, procs, top
from cronbus.cli.common import CliError
from cronbus.cli.procs import SERVICES, ServiceProcess
from cronbus.cli.sink import Received, Sink
from cronbus.client import Client
from shared.contract import timefmt
from shared.contract.errors import CommandRefused
from shared.policy import netpolicy
from shared.postgres import db
from shared.runtime import transient
from shared.runtime.config import CommonSettings

LOG_DIR = Path(".cronbus-dev")


def demo_schedules(sink_url: str, now_ms: int) -> list[dict[str, Any]]:
    hook = {"kind": "webhook", "url": f"{sink_url}/demo"}
    return [
        {
            "id": "every-5s",
            "spec": {"kind": "interval", "every_s": 5},
            "target": {**hook, "body": {"hello": "every 5 seconds"}},
        },
        {
            "id": "cron-every-10s",
            "spec": {"kind": "cron", "expr": "*/10 * * * * *"},
            "target": {**hook, "body": {"hello": "cron, seconds first"}},
        },
        {
            "id": "once-in-15s",
            "spec": {"kind": "once", "at": timefmt.format_ms(now_ms - now_ms % 1000 + 15_000)},
            "target": {**hook, "body": {"hello": "just once"}},
        },
        {
            "id": "flaky",
            "spec": {"kind": "interval", "every_s": 20},
            "target": {"kind": "webhook", "url": f"{sink_url}/flaky"},
            "retry": {"max_attempts": 3, "initial_backoff_s": 1},
        },
    ]


def _print_delivery(request: Received) -> None:
    late = request.at_ms - timefmt.parse_rfc3339_ms(request.fire_time) if request.fire_time else 0
    _clear_status()
    print(
        f"delivery  {request.schedule:24} fire {request.fire_time}  "
        f"attempt {request.attempt}  late {late:.0f} ms  key {request.key[:8]}…  "
        f"{request.body.decode(errors='replace')}",
        flush=True,
    )


def _flaky(request: Received) -> int:
    """The demo's flaky target fails its first attempt: watch the retry come back."""
    return 503 if request.path == "/flaky" and request.attempt == 1 else 200


class StatusLine:
    """The status line: rewritten in place on a terminal; elsewhere (a file, a pipe) printed
    when a service changes state and otherwise at most every ``quiet_s``, so that it does not
    drown the deliveries."""

    def __init__(self, tty: bool, quiet_s: float = 30.0, clock: Any = time.monotonic) -> None:
        self.tty = tty
        self.quiet_s = quiet_s
        self.clock = clock
        self.shown = False
        self._last_at: float | None = None
        self._last_states = ""

    def show(self, line: str, states: str) -> None:
        if self.tty:
            sys.stdout.write("\r\033[K" + line)
            sys.stdout.flush()
            self.shown = True
            return
        now = self.clock()
        quiet = self._last_at is not None and now - self._last_at < self.quiet_s
        if quiet and states == self._last_states:
            return
        self._last_at, self._last_states = now, states
        print(line, flush=True)

    def clear(self) -> None:
        if self.shown and self.tty:
            sys.stdout.write("\r\033[K")
        self.shown = False


STATUS = StatusLine(sys.stdout.isatty())


def _clear_status() -> None:
    STATUS.clear()


def _samples(text: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + "".join(f",{k}={v}" for k, v in sorted(sample.labels.items()))
            found[key] = found.get(key, 0) + sample.value
    return found


def _quantile(samples: dict[str, float], q: float) -> float | None:
    """The histogram's bucket bound that holds quantile ``q`` (inf: above every bound)."""
    prefix = "cronbus_fire_lateness_seconds_bucket,le="
    buckets = sorted(
        (float(k[len(prefix) :]), v) for k, v in samples.items() if k.startswith(prefix)
    )
    total = buckets[-1][1] if buckets else 0
    if not total:
        return None
    for bound, count in buckets:
        if count >= q * total:
            return bound
    return None


def _bound_text(bound: float, samples: dict[str, float]) -> str:
    """``≤ 50 ms``; above the highest finite bucket ``> 60,000 ms`` (not ``≤infms``)."""
    prefix = "cronbus_fire_lateness_seconds_bucket,le="
    finite = [float(k[len(prefix) :]) for k in samples if k.startswith(prefix)]
    return top.bound_text(bound, max((b for b in finite if b != math.inf), default=None))


def status_line(children: list[ServiceProcess]) -> tuple[str, str]:
    """The line, and the services' states alone (what makes a quiet status line speak)."""
    parts = []
    executor_metrics: dict[str, float] = {}
    dispatcher_metrics: dict[str, float] = {}
    for child in children:
        code, _ = child.get("/readyz")
        state = (
            "ready" if code == 200 else ("down" if child.popen.poll() is not None else "starting")
        )
        parts.append(f"{child.name} {state}")
        if child.name in ("executor", "dispatcher") and code:
            _, text = child.get("/metrics")
            target = executor_metrics if child.name == "executor" else dispatcher_metrics
            target.update(_samples(text))
    ok = sum(
        v
        for k, v in executor_metrics.items()
        if k.startswith("cronbus_delivered_total") and "outcome=succeeded" in k
    )
    failed = sum(
        v
        for k, v in executor_metrics.items()
        if k.startswith("cronbus_delivered_total") and "outcome=succeeded" not in k
    )
    backlog = sum(v for k, v in dispatcher_metrics.items() if k.startswith("cronbus_due_backlog"))
    p50, p99 = _quantile(executor_metrics, 0.5), _quantile(executor_metrics, 0.99)
    late = (
        ""
        if p50 is None or p99 is None
        else (
            f" | lateness p50 {_bound_text(p50, executor_metrics)} "
            f"p99 {_bound_text(p99, executor_metrics)}"
        )
    )
    line = (
        f"{time.strftime('%H:%M:%S')} "
        + " | ".join(parts)
        + f" | delivered ok {ok:.0f} failed {failed:.0f}{late} | due backlog {backlog:.0f}"
    )
    return line, " | ".join(parts)


def fresh_log(name: str) -> Path:
    """This run's log of a service; the previous run's is kept beside it as ``.previous.log``
    and older ones go, so the folder does not grow from run to run."""
    log = LOG_DIR / f"{name}.log"
    if log.exists():
        log.replace(LOG_DIR / f"{name}.previous.log")
    return log


def _start(name: str, port: int, env: dict[str, str]) -> ServiceProcess:
    return procs.start(
        name,
        {**env, "CRONBUS_LOG_FORMAT": "text", "CRONBUS_MIGRATE_ON_START": "false"},
        port,
        fresh_log(name),
    )


#: How to keep this run off an index or data that another deployment owns (printed on a
#: failed start and in ``cronbus dev --help``).
OWN_REDIS_HINT = (
    "if the Redis is another deployment's, give this one its own database or key prefix, "
    "e.g. CRONBUS_REDIS_URL=redis://127.0.0.1:6379/1 or CRONBUS_REDIS_PREFIX=mine"
)
_ERROR_MARKS = (" ERROR ", " CRITICAL ", "Error:", "refuse")


def failure_lines(log_text: str, at_most: int = 5) -> list[str]:
    """The log's last error lines (its last lines when none is marked as an error)."""
    lines = [line for line in log_text.splitlines() if line.strip()]
    errors = [line for line in lines if any(mark in line for mark in _ERROR_MARKS)]
    return (errors or lines)[-at_most:]


def not_ready_error(name: str, log: Path) -> CliError:
    try:
        reason = failure_lines(log.read_text(errors="replace"))
    except OSError:
        reason = []
    said = "".join(f"\n  {line}" for line in reason) or "\n  (its log is empty)"
    return CliError(f"{name} did not become ready; the end of {log}:{said}\n{OWN_REDIS_HINT}")


async def _wait_ready(children: list[ServiceProcess], timeout_s: float) -> None:
    for child in children:
        try:
            await child.wait_ready(timeout_s)
        except RuntimeError:
            raise not_ready_error(child.name, child.log) from None


async def _register_demo(settings: CommonSettings, sink: Sink) -> None:
    async with Client(settings.amqp_url, app_id="cronbus-dev") as client:
        for item in demo_schedules(sink.url, int(time.time() * 1000)):
            try:
                stored = await client.upsert("demo", item)
            except CommandRefused as refused:
                raise CliError(f"demo schedule {item['id']} refused: {refused}") from None
            upcoming = ", ".join(output.instant(t) for t in stored.next_fires[:2])
            print(f"registered demo/{item['id']}: next {upcoming}")


async def _dev(args: argparse.Namespace) -> None:
    settings = CommonSettings()
    try:
        applied = await db.migrate(settings.database_url)
    except transient.ERRORS as exc:
        raise CliError(f"cannot reach PostgreSQL at {settings.database_url}: {exc}") from None
    print("migrations: " + (", ".join(applied) if applied else "up to date"))
    sink: Sink | None = None
    if args.demo:
        sink = Sink(respond=_flaky, on_receive=_print_delivery, keep=False)
        await sink.start(port=args.sink_port)
        print(f"demo sink listening on {sink.url}")
    # Local sinks listen on loopback: allowed unless the developer chose otherwise.
    env = {"CRONBUS_WEBHOOK_ALLOWED_NETWORKS": netpolicy.LOOPBACK_NETWORKS, **os.environ}
    # Locally the console is for trying things: its actions are on unless said otherwise.
    console_env = {
        "CRONBUS_CONSOLE_ACTIONS": "1",
        **env,
        "CRONBUS_CONSOLE_PORT": str(args.console_port),
    }
    children: list[ServiceProcess] = []
    try:
        for i, name in enumerate(SERVICES):
            children.append(_start(name, args.port_base + i, env))
        children.append(_start("console", args.port_base + len(SERVICES), console_env))
        print("pids: " + " ".join(f"{c.name}={c.pid}" for c in children), flush=True)
        await _wait_ready(children, 60)
        print(f"cronbus is running (logs in {LOG_DIR}/); Ctrl-C stops it")
        print(f"console: http://127.0.0.1:{args.console_port}/", flush=True)
        if sink is not None:
            await _register_demo(settings, sink)
        # Until SIGINT, SIGTERM or SIGHUP cancels this (procs.run_until_signal).
        while True:
            STATUS.show(*await asyncio.to_thread(status_line, children))
            await asyncio.sleep(args.status_every)
    finally:
        _clear_status()
        print("\nstopping ...", flush=True)
        procs.stop_all(children, procs.GRACE_S)
        if sink is not None:
            await sink.stop()


def run(args: argparse.Namespace) -> int:
    try:
        procs.run_until_signal(_dev(args))
    except procs.Interrupted:
        return 0  # how a developer stops it: not a failure
    return 0


def run_sink(args: argparse.Namespace) -> int:
    async def serve() -> None:
        sink = Sink(on_receive=_print_delivery, keep=False)
        await sink.start(host=args.host, port=args.port)
        print(f"sink listening on {sink.url}", flush=True)
        await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())
    return 0
