"""Running the services as child processes (``cronbus dev``, ``cronbus bench``, the e2e tests).

A command that starts services stops them however it ends. Each child is started here
(``start``), in a process group of its own, and remembered in one place until stopped:

- an error or a crash of the command's own code: the ``finally`` blocks of ``cronbus dev`` and
  of the bench harness stop what they started, and ``cronbus``'s ``main`` stops whatever is
  still remembered (``stop_started``) before it exits;
- SIGTERM, SIGINT or SIGHUP: ``run_until_signal`` turns the first into an orderly exit (the
  command's coroutine is cancelled, so those ``finally`` blocks run: SIGTERM to each group, a
  bounded grace, then SIGKILL), raised afterwards as ``Interrupted``; a second signal kills
  every group at once;
- a hard crash of the command (SIGKILL, the OOM killer), which no handler sees: each child is
  started with ``PR_SET_PDEATHSIG`` (Linux), so the kernel sends it SIGTERM when the command
  dies, and the service stops as it would on any SIGTERM (within ``CRONBUS_SHUTDOWN_GRACE_S``).
  The kernel sends it when the *thread* that started the child ends, so children are started
  from the main thread only (the event loop's, never ``asyncio.to_thread``). Elsewhere than on
  Linux this last net is missing; the others hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

SERVICES = ("dispatcher", "executor", "sweeper")
#: The signals a command that runs services turns into an orderly exit.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: Seconds a child gets to stop after SIGTERM before its group is killed.
GRACE_S = 30.0
#: From <sys/prctl.h>.
PR_SET_PDEATHSIG = 1

T = TypeVar("T")


class Interrupted(Exception):
    """The command was asked to stop by a signal; what it started has been stopped."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(f"stopped by {self.name}")


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

    def signal_group(self, sig: int) -> None:
        """``sig`` to the child's whole process group (it leads one: ``start``). Only while
        the child is not reaped (running, or exited and not yet waited for): until then its
        id, and so its group's, cannot name anyone else's. ``returncode`` alone would not
        tell: a wait that reaped it may not have set it yet (a signal handler runs between
        the two), or someone else may have reaped it."""
        if self.reaped() is not True:
            self._killpg(sig)

    def reaped(self) -> bool | None:
        """True once the child was reaped; False while it runs; None: it exited and waits to
        be reaped (its id still held). Checked without reaping it (``WNOWAIT``)."""
        if self.popen.returncode is not None:
            return True
        if not hasattr(os, "waitid"):  # not on every platform: returncode is all there is
            return False
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        return None if info is not None else False

    def wait_exit(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the child to exit, without reaping it (so its group's
        id stays ours to signal); False when it is still running."""
        deadline = time.monotonic() + timeout_s
        while self.reaped() is False:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def _killpg(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def stop(self, timeout_s: float = GRACE_S) -> int:
        """SIGTERM, wait, SIGKILL after the timeout; returns the exit status."""
        stop_all([self], timeout_s)
        return self.popen.wait()


#: Every child ``start`` started and no ``stop_all`` has stopped yet: what ``stop_started``
#: and a second stop signal reach.
_started: list[ServiceProcess] = []
_started_lock = threading.Lock()


def _libc_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    prctl: Callable[..., int] = libc.prctl
    return prctl


_PRCTL = _libc_prctl()


def _die_with(parent_pid: int) -> Callable[[], None]:
    """The child's preexec function: SIGTERM when the parent dies (see the module's doc).

    A preexec function runs between fork and exec, where a lock another thread held at the
    fork stays held: this one takes none (a C function resolved beforehand, and getppid).
    The alternative, children that watch their parent, would need the same code in every
    service and a poll; the kernel's death signal is immediate and needs nothing of them.
    """

    def preexec() -> None:
        if _PRCTL is None:
            return
        _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        # The parent may have died between fork and prctl: then nobody would ever tell us.
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec


def _main_thread_only() -> None:
    if threading.current_thread() is not threading.main_thread():
        # The death signal follows the starting thread, not the process.
        raise RuntimeError("services are started from the main thread only")


def start(name: str, env: dict[str, str], port: int, log: Path) -> ServiceProcess:
    """``python -m services.<name>`` with ``env`` (over this process's environment)."""
    _main_thread_only()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        # A process group of its own: a signal for it reaches whatever it starts, and a
        # terminal's Ctrl-C reaches this command only, which stops the child in order.
        popen = subprocess.Popen(
            [sys.executable, "-m", f"services.{name}"],
            env={**os.environ, **env, "CRONBUS_METRICS_PORT": str(port)},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with(os.getpid()),  # noqa: PLW1509 - see _die_with
        )
    process = ServiceProcess(name, popen, port, log)
    with _started_lock:
        _started.append(process)
    return process


def stop_all(processes: list[ServiceProcess], timeout_s: float = GRACE_S) -> None:
    """SIGTERM to each child's group, up to ``timeout_s`` for all of them to exit, then
    SIGKILL to the groups of those that have not; each is forgotten once it exited."""
    pending = [p for p in processes if p.popen.returncode is None]
    for process in pending:
        process.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for process in pending:
        if not process.wait_exit(max(deadline - time.monotonic(), 0.1)):
            process.signal_group(signal.SIGKILL)
            process.wait_exit(GRACE_S)
        # Whatever the child started and left in its group goes too, while the child is not
        # reaped yet (its id, so the group's, cannot be anyone else's until then).
        process.signal_group(signal.SIGKILL)
        process.popen.wait()
    with _started_lock:
        _started[:] = [p for p in _started if p not in processes]


def stop_started(timeout_s: float = GRACE_S) -> None:
    """Stop every child started here and not stopped yet (the last ``finally``)."""
    with _started_lock:
        left = list(_started)
    if left:
        stop_all(left, timeout_s)


def kill_started() -> None:
    """SIGKILL to the group of every child not stopped yet (a second stop signal: no more
    patience). Only signals: safe inside a signal handler; ``stop_all`` reaps them."""
    for process in list(_started):
        process.signal_group(signal.SIGKILL)


def run_until_signal(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, where SIGTERM, SIGINT or SIGHUP cancels ``main`` (so its
    ``finally`` blocks stop what it started) and is then raised as ``Interrupted``; a second
    signal kills every child's group at once."""
    received: list[int] = []

    async def guarded() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            if received:
                kill_started()
                return
            received.append(signum)
            loop.call_soon_threadsafe(task.cancel)

        previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
        try:
            result = await main
        except asyncio.CancelledError:
            if received:
                raise Interrupted(received[0]) from None
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if received:
            raise Interrupted(received[0])
        return result

    return asyncio.run(guarded())


def supervise(name: str, count: int, base_port: int) -> int:
    """Run ``count`` processes of a service (metrics ports ``base_port`` + i), restarting one
    that dies, until SIGTERM or SIGINT, which is passed on to all of them."""
    # The signal received (0: none yet). The handler only records it: it may come at any
    # point, before the children exist or in the middle of a wait that reaps one; the loop
    # below passes it on.
    stopping = 0
    children: list[ServiceProcess] = []

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = signum

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def launch(i: int) -> ServiceProcess:
        port = base_port + i if base_port else 0
        # In this process's group (a terminal's Ctrl-C reaches them as it reaches this one),
        # with the death signal: a supervisor killed outright leaves none of them running.
        popen = subprocess.Popen(
            [sys.executable, "-m", f"services.{name}"],
            env={**os.environ, "CRONBUS_METRICS_PORT": str(port)},
            preexec_fn=_die_with(os.getpid()),  # noqa: PLW1509 - see _die_with
        )
        return ServiceProcess(name, popen, port, Path(os.devnull))

    for i in range(count):
        if stopping:
            break
        children.append(launch(i))
    restarts = [0.0] * count
    while not stopping:
        time.sleep(0.1)
        for i, child in enumerate(children):
            if stopping or child.alive():
                continue
            # A crash is restarted, at most once every few seconds.
            if time.monotonic() - restarts[i] > 5:
                restarts[i] = time.monotonic()
                children[i] = launch(i)
    for child in children:
        child.signal(stopping)
    codes = [child.popen.wait() for child in children]
    return max(codes, default=0)
