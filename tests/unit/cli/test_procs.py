"""Child processes (``cronbus.cli.procs``): a group is signalled only while its leader is
ours, and a supervisor stops its children whenever the signal comes, even before they exist."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cronbus.cli import procs

SLEEPER = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); " + (
    "time.sleep(30)"
)


def _child(code: str = SLEEPER) -> procs.ServiceProcess:
    popen = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    return procs.ServiceProcess("test", popen, 0, Path(os.devnull))


def test_a_group_is_not_signalled_once_its_leader_was_reaped_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Reaped by someone else's wait (or by a wait a signal handler interrupted before it set
    # returncode): returncode still says nothing, yet the id may name another group by now.
    child = _child("pass")
    os.waitpid(child.pid, 0)
    assert child.popen.returncode is None
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "killpg", lambda pgid, sig: sent.append((pgid, sig)))
    child.signal_group(signal.SIGKILL)
    assert sent == []
    assert child.reaped() is True
    child.popen.wait()  # (finds it gone: sets returncode)


def test_a_group_is_signalled_while_its_leader_runs_or_waits_to_be_reaped() -> None:
    child = _child()
    try:
        assert child.reaped() is False
        child.signal_group(signal.SIGTERM)
        assert child.wait_exit(10)
        # Exited, not reaped: its id is still ours.
        assert child.reaped() is None
        assert child.popen.returncode is None
    finally:
        child.popen.kill()
        child.popen.wait()
    assert child.reaped() is True


def test_stop_all_stops_a_child_and_reaps_it() -> None:
    child = _child()
    procs.stop_all([child], timeout_s=10)
    # 0, or SIGTERM's status when it came before the child's handler was set.
    assert child.popen.returncode in (0, -signal.SIGTERM)


def test_supervise_stops_on_a_signal_that_comes_before_its_children_exist(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # SIGTERM while the first child is being started: the supervisor stops the one started,
    # starts no other, and returns (it raised NameError here before).
    real_popen = subprocess.Popen
    started: list[subprocess.Popen[bytes]] = []

    def popen(args: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        child = real_popen([sys.executable, "-c", SLEEPER])
        started.append(child)
        os.kill(os.getpid(), signal.SIGTERM)
        return child

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    monkeypatch.setattr(subprocess, "Popen", popen)
    try:
        assert procs.supervise("executor", 3, 0) in (0, -signal.SIGTERM)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for child in started:
            if child.poll() is None:
                child.kill()
                child.wait()
    assert len(started) == 1
    assert started[0].returncode in (0, -signal.SIGTERM)


def test_supervise_restarts_a_child_that_dies_and_passes_sigint_on_to_all(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The first child dies at once (a crash): it is started again. SIGINT later reaches every
    # child alive, the restarted one included, and the supervisor returns once they stopped.
    real_popen = subprocess.Popen
    started: list[subprocess.Popen[bytes]] = []

    def sleeper(ready: Path) -> str:
        # Says it is ready once its handler is set, so the SIGINT below waits for both rather
        # than for a fixed time a loaded machine may need more of to start Python.
        return (
            "import pathlib, signal, sys, time; "
            "signal.signal(signal.SIGINT, lambda *a: sys.exit(0)); "
            f"pathlib.Path({str(ready)!r}).touch(); time.sleep(30)"
        )

    def interrupt_once_ready(ready: list[Path]) -> None:
        deadline = time.monotonic() + 30
        while not all(path.exists() for path in ready) and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)

    def popen(args: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        if list(args) != [sys.executable, "-m", "services.executor"]:
            # Not the supervisor's: another thread of this pytest worker (left by an earlier
            # test) ran a program meanwhile. Taken for a child, it once made a fourth sleeper.
            foreign: subprocess.Popen[bytes] = real_popen(args, **kwargs)  # type: ignore[call-overload]
            return foreign
        ready = tmp_path / f"ready-{len(started)}"
        code = "import sys; sys.exit(3)" if not started else sleeper(ready)
        child = real_popen([sys.executable, "-c", code])
        started.append(child)
        if len(started) == 3:  # both running: the dead one restarted, the other one
            both = [tmp_path / "ready-1", tmp_path / "ready-2"]
            threading.Thread(target=interrupt_once_ready, args=(both,), daemon=True).start()
        return child

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    monkeypatch.setattr(subprocess, "Popen", popen)
    try:
        assert procs.supervise("executor", 2, 0) in (0, -signal.SIGINT)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for child in started:
            if child.poll() is None:
                child.kill()
                child.wait()
    codes = [child.returncode for child in started]
    assert len(started) == 3, f"started {len(started)} children, exit codes {codes}"
    assert started[0].returncode == 3
    assert all(c.returncode == 0 for c in started[1:]), codes
