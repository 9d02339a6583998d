"""The cronbus services as real processes, for end-to-end tests.

Each test's stack points at its own Redis prefix, RabbitMQ vhost and database. Processes are
started with ``python -m services.<name>`` and stopped (or killed) by PID.
"""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from cronbus.cli import procs
from cronbus.cli.procs import SERVICES, ServiceProcess
from tests.support import services

Proc = ServiceProcess


@dataclass
class Stack:
    env: dict[str, str]
    logs: Path
    procs: dict[str, list[Proc]] = field(default_factory=dict)

    def start(self, name: str, **extra: str) -> Proc:
        index = len(self.procs.get(name, []))
        log = self.logs / f"{name}-{index}-{int(time.time() * 1000)}.log"
        proc = procs.start(name, {**self.env, **extra}, services.free_port(), log)
        self.procs.setdefault(name, []).append(proc)
        return proc

    def running(self, name: str) -> list[Proc]:
        return [p for p in self.procs.get(name, []) if p.alive()]

    async def wait_ready(self, proc: Proc, timeout_s: float = 30) -> None:
        try:
            await proc.wait_ready(timeout_s)
        except RuntimeError as exc:
            raise AssertionError(str(exc)) from None

    async def start_all(self, names: tuple[str, ...] = SERVICES, **extra: str) -> None:
        started = [self.start(name, **extra) for name in names]
        for proc in started:
            await self.wait_ready(proc)

    def kill(self, proc: Proc, sig: int = signal.SIGKILL) -> None:
        proc.signal(sig)

    async def stop(self, proc: Proc, timeout_s: float = 30) -> int:
        """SIGTERM and wait for the exit status (SIGKILL after the timeout)."""
        return await asyncio.to_thread(proc.stop, timeout_s)

    def stop_all(self) -> None:
        procs.stop_all([p for ps in self.procs.values() for p in ps], timeout_s=15)

    def tails(self) -> str:
        return "\n".join(
            f"--- {p.name} ({p.log.name}) ---\n{p.tail()}" for ps in self.procs.values() for p in ps
        )


async def time_exits(procs: list[Proc], timeout_s: float) -> dict[str, float]:
    """SIGTERM every process at once; seconds until each one exited (killed after timeout)."""
    started = time.monotonic()
    for proc in procs:
        proc.signal(signal.SIGTERM)
    exits: dict[str, float] = {}
    while len(exits) < len(procs) and time.monotonic() - started < timeout_s:
        for proc in procs:
            if proc.name not in exits and proc.popen.poll() is not None:
                exits[proc.name] = time.monotonic() - started
        await asyncio.sleep(0.02)
    for proc in procs:
        if proc.alive():
            proc.popen.kill()
            proc.popen.wait()
    return exits
