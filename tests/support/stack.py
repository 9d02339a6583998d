"""The cronbus services as real processes, for end-to-end tests.

Each test's stack points at its own Redis prefix, RabbitMQ vhost and database. Processes are
started with ``python -m services.<name>`` and stopped (or killed) by PID.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.support import services

SERVICES = ("dispatcher", "executor", "sweeper")
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    port: int
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class Stack:
    env: dict[str, str]
    logs: Path
    procs: dict[str, list[Proc]] = field(default_factory=dict)

    def start(self, name: str, **extra: str) -> Proc:
        port = services.free_port()
        index = len(self.procs.get(name, []))
        log = self.logs / f"{name}-{index}-{int(time.time() * 1000)}.log"
        env = {**os.environ, **self.env, "CRONBUS_METRICS_PORT": str(port), **extra}
        with log.open("wb") as out:
            popen = subprocess.Popen(
                [sys.executable, "-m", f"services.{name}"],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        proc = Proc(name, popen, port, log)
        self.procs.setdefault(name, []).append(proc)
        return proc

    def running(self, name: str) -> list[Proc]:
        return [p for p in self.procs.get(name, []) if p.alive()]

    async def wait_ready(self, proc: Proc, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not proc.alive():
                raise AssertionError(f"{proc.name} exited:\n{proc.tail()}")
            if await asyncio.to_thread(_get_status, proc.url("/readyz")) == 200:
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"{proc.name} not ready after {timeout_s}s:\n{proc.tail()}")

    async def start_all(self, names: tuple[str, ...] = SERVICES, **extra: str) -> None:
        procs = [self.start(name, **extra) for name in names]
        for proc in procs:
            await self.wait_ready(proc)

    def kill(self, proc: Proc, sig: int = signal.SIGKILL) -> None:
        if proc.alive():
            proc.popen.send_signal(sig)

    async def stop(self, proc: Proc, timeout_s: float = 30) -> int:
        """SIGTERM and wait for the exit status (SIGKILL after the timeout)."""
        self.kill(proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while proc.alive() and time.monotonic() < deadline:  # noqa: ASYNC110 - polling a child
            await asyncio.sleep(0.05)
        if proc.alive():
            self.kill(proc)
        return await asyncio.to_thread(proc.popen.wait)

    def stop_all(self) -> None:
        for procs in self.procs.values():
            for proc in procs:
                if proc.alive():
                    proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for procs in self.procs.values():
            for proc in procs:
                try:
                    proc.popen.wait(max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    proc.popen.kill()
                    proc.popen.wait()

    def tails(self) -> str:
        return "\n".join(
            f"--- {p.name} ({p.log.name}) ---\n{p.tail()}"
            for procs in self.procs.values()
            for p in procs
        )


def _get_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status)
    except OSError as exc:
        return int(getattr(exc, "code", 0) or 0)
