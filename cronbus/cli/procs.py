"""Running the services as child processes (``cronbus dev``, ``cronbus bench``, the e2e tests)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

SERVICES = ("dispatcher", "executor", "sweeper")


@dataclass
class ServiceProcess:
    name: str
    popen: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def get(self, path: str, timeout_s: float = 2) -> tuple[int, str]:
        """(status, body) of a GET on the service's health port; status 0 when unreachable."""
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.port}{path}", timeout=timeout_s
            ) as response:
                return int(response.status), response.read().decode()
        except urllib.error.HTTPError as exc:
            return int(exc.code), exc.read().decode(errors="replace")
        except OSError:
            return 0, ""

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def cpu_seconds(self) -> float:
        """User plus system CPU time the process has used so far (Linux /proc)."""
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        ticks = os.sysconf("SC_CLK_TCK")
        return (int(fields[11]) + int(fields[12])) / ticks

    async def wait_ready(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while (await asyncio.to_thread(self.get, "/readyz"))[0] != 200:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready after {timeout_s:g}s:\n{self.tail()}")
            await asyncio.sleep(0.1)

    def signal(self, sig: int) -> None:
        if self.alive():
            self.popen.send_signal(sig)

    def stop(self, timeout_s: float = 30) -> int:
        """SIGTERM, wait, SIGKILL after the timeout; returns the exit status."""
        self.signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            return self.popen.wait()


def start(name: str, env: dict[str, str], port: int, log: Path) -> ServiceProcess:
    """``python -m services.<name>`` with ``env`` (over this process's environment)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        popen = subprocess.Popen(
            [sys.executable, "-m", f"services.{name}"],
            env={**os.environ, **env, "CRONBUS_METRICS_PORT": str(port)},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return ServiceProcess(name, popen, port, log)


def stop_all(processes: list[ServiceProcess], timeout_s: float = 30) -> None:
    for process in processes:
        process.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.popen.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            process.popen.kill()
            process.popen.wait()


def supervise(name: str, count: int, base_port: int) -> int:
    """Run ``count`` processes of a service (metrics ports ``base_port`` + i), restarting one
    that dies, until SIGTERM or SIGINT, which is passed on to all of them."""
    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for child in children:
            child.signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def launch(i: int) -> ServiceProcess:
        port = base_port + i if base_port else 0
        popen = subprocess.Popen(
            [sys.executable, "-m", f"services.{name}"],
            env={**os.environ, "CRONBUS_METRICS_PORT": str(port)},
        )
        return ServiceProcess(name, popen, port, Path(os.devnull))

    children = [launch(i) for i in range(count)]
    restarts = [0.0] * count
    while not stopping:
        time.sleep(0.5)
        for i, child in enumerate(children):
            if child.alive() or stopping:
                continue
            # A crash is restarted, at most once every few seconds.
            if time.monotonic() - restarts[i] > 5:
                restarts[i] = time.monotonic()
                children[i] = launch(i)
    codes = [child.popen.wait() for child in children]
    return max(codes, default=0)
