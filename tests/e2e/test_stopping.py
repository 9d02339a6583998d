"""``cronbus dev`` and ``cronbus bench`` stop every process they started, however they end.

Each test runs the command as a process of its own, waits until its services are up, reads
the command's whole process tree from /proc, ends the command one way (SIGTERM, SIGINT, its own
code raising, a service dying, SIGKILL) and checks that no process of that tree is left.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cronbus.bench import harness
from tests.support import services

ROOT = Path(__file__).resolve().parents[2]
#: Seconds a stopped command's processes get to be gone (the services' grace is 5 to 10 s).
GONE_S = 30.0


def _stat(pid: int) -> list[str] | None:
    """The fields after the command name of /proc/PID/stat (state first), None when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def tree(root: int) -> dict[int, str]:
    """Every descendant of ``root`` now, with its start time (so a reused PID is not it)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        fields = _stat(int(entry)) if entry.isdigit() else None
        if fields is not None:
            parents[int(entry)] = int(fields[1])
    found: dict[int, str] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid in [pid for pid, of in parents.items() if of == parent and pid not in found]:
            fields = _stat(pid)
            if fields is not None:
                found[pid] = fields[19]
                frontier.append(pid)
    return found


def left(processes: dict[int, str]) -> set[int]:
    """Those of ``processes`` still running (a zombie has stopped running)."""
    running = set()
    for pid, started in processes.items():
        fields = _stat(pid)
        if fields is not None and fields[19] == started and fields[0] != "Z":
            running.add(pid)
    return running


async def gone_within(processes: dict[int, str], timeout_s: float) -> set[int]:
    """What is still running of ``processes`` after up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = left(processes)
        if not running or time.monotonic() >= deadline:
            return running
        await asyncio.sleep(0.2)  # reading /proc: no event to wait on


@dataclass
class Command:
    """A ``cronbus`` command run as a process, its output in files."""

    popen: subprocess.Popen[bytes]
    out: Path
    err: Path

    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    async def wait_for(self, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.stdout() + self.stderr():
            if self.popen.poll() is not None:
                raise AssertionError(f"exited {self.popen.returncode}:\n{self.stderr()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} after {timeout_s:g}s:\n{self.stderr()}")
            await asyncio.sleep(0.2)

    async def exit_code(self, timeout_s: float) -> int:
        return await asyncio.to_thread(self.popen.wait, timeout_s)


Start = Callable[..., Command]


@pytest.fixture
def run_command(tmp_path: Path) -> Iterator[Start]:
    """Start commands; whatever the test leaves running is killed by PID at its end."""
    started: list[Command] = []

    def start(argv: list[str], env: dict[str, str], cwd: Path = ROOT) -> Command:
        n = len(started)
        out, err = tmp_path / f"cmd{n}.out", tmp_path / f"cmd{n}.err"
        with out.open("wb") as stdout, err.open("wb") as stderr:
            popen = subprocess.Popen(
                argv, env={**os.environ, **env}, cwd=cwd, stdout=stdout, stderr=stderr
            )
        command = Command(popen, out, err)
        started.append(command)
        return command

    yield start
    for command in started:
        descendants = tree(command.popen.pid)
        if command.popen.poll() is None:
            command.popen.kill()
            command.popen.wait()
        for pid in left(descendants):
            os.kill(pid, signal.SIGKILL)


def bench_env(endpoints: services.Endpoints) -> dict[str, str]:
    return {
        "CRONBUS_REDIS_URL": endpoints.redis_url,
        "CRONBUS_AMQP_URL": endpoints.amqp_url,
        "CRONBUS_DATABASE_URL": endpoints.database_url,
    }


def ready_pids(stderr: str) -> set[int]:
    """The PIDs the bench says it started (``cronbus bench: services ready: name=PID ...``)."""
    line = next(row for row in stderr.splitlines() if "services ready" in row)
    return {int(pid) for pid in re.findall(r"=(\d+)", line)}


def dev_argv() -> list[str]:
    # Metrics of the three services and the console: base..base+3; then the console's pages.
    # (The pages' port picked on its own once fell on base+3, and the console could not bind.)
    base = services.quiet_ports(5)
    return [
        str(Path(sys.executable).parent / "cronbus"),
        "dev",
        "--port-base",
        str(base),
        "--console-port",
        str(base + 4),
        "--status-every",
        "1",
    ]


# A herd due two minutes after it starts: the bench is waiting for it whenever it is stopped.
WAITING_HERD = ("herd", "--n", "5", "--executors", "1", "--lead-s", "120", "--json")
# 20,000 lists: seconds at the least, so the bench is inside the phase when it is stopped.
LONG_INTAKE = ("intake", "--n", "20000", "--only", "list", "--timeout-s", "100", "--json")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_dev_stops_its_services_on_a_signal(
    run_command: Start, stack_env: dict[str, str], tmp_path: Path, sig: signal.Signals
) -> None:
    dev = run_command(dev_argv(), stack_env, cwd=tmp_path)
    await dev.wait_for("cronbus is running", 60)
    descendants = tree(dev.popen.pid)
    said = {int(pid) for pid in re.findall(r"=(\d+)", dev.stdout().split("pids: ")[1])}
    assert len(descendants) == 4 and said == set(descendants), (descendants, said)
    dev.popen.send_signal(sig)
    assert await dev.exit_code(GONE_S + 10) == 0  # how a developer stops it
    assert "stopping" in dev.stdout()
    assert await gone_within(descendants, 1) == set()


async def test_dev_services_stop_when_dev_is_killed(
    run_command: Start, stack_env: dict[str, str], tmp_path: Path
) -> None:
    dev = run_command(dev_argv(), stack_env, cwd=tmp_path)
    await dev.wait_for("cronbus is running", 60)
    descendants = tree(dev.popen.pid)
    assert len(descendants) == 4
    dev.popen.kill()  # no handler, no finally: only the death signal reaches the services
    await dev.exit_code(10)
    assert await gone_within(descendants, GONE_S) == set()


@pytest.mark.parametrize(
    ("verb", "sig"),
    [
        (WAITING_HERD, signal.SIGTERM),
        (WAITING_HERD, signal.SIGINT),
        (LONG_INTAKE, signal.SIGTERM),
    ],
    ids=["herd-SIGTERM", "herd-SIGINT", "intake-SIGTERM"],
)
async def test_bench_stops_its_services_on_a_signal(
    run_command: Start,
    endpoints: services.Endpoints,
    verb: tuple[str, ...],
    sig: signal.Signals,
) -> None:
    bench = run_command([sys.executable, "-m", "cronbus.cli", "bench", *verb], bench_env(endpoints))
    await bench.wait_for("services ready", 60)
    descendants = tree(bench.popen.pid)
    assert ready_pids(bench.stderr()) <= set(descendants)
    bench.popen.send_signal(sig)
    # The services stop first; then the bench drops its corner (a vhost's deletion by
    # rabbitmqctl, bounded, can take a while on a loaded machine) and exits.
    assert await gone_within(descendants, GONE_S) == set()
    assert await bench.exit_code(harness.CTL_DROP_S + 10) == 128 + sig
    assert f"stopped by {sig.name}" in bench.stderr() and "no figures" in bench.stderr()
    assert bench.stdout() == ""


CRASHING_HERD = """
import asyncio, sys
from cronbus.bench import herd

async def crash(*_args):
    await asyncio.sleep(2)  # the test reads the process tree meanwhile
    raise RuntimeError("the bench's own code crashed")

herd._measured = crash
from cronbus.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


async def test_a_crash_of_the_bench_code_leaves_no_process(
    run_command: Start, endpoints: services.Endpoints
) -> None:
    bench = run_command(
        [sys.executable, "-c", CRASHING_HERD, "bench", *WAITING_HERD], bench_env(endpoints)
    )
    await bench.wait_for("services ready", 60)
    descendants = tree(bench.popen.pid)
    assert ready_pids(bench.stderr()) <= set(descendants)
    assert await bench.exit_code(GONE_S) == 1
    assert "RuntimeError: the bench's own code crashed" in bench.stderr()
    assert await gone_within(descendants, 1) == set()


async def test_a_bench_whose_service_dies_says_so_and_stops_the_rest(
    run_command: Start, endpoints: services.Endpoints
) -> None:
    bench = run_command(
        [sys.executable, "-m", "cronbus.cli", "bench", *WAITING_HERD], bench_env(endpoints)
    )
    await bench.wait_for("services ready", 60)
    descendants = tree(bench.popen.pid)
    sweeper = int(re.findall(r"sweeper=(\d+)", bench.stderr())[0])
    os.kill(sweeper, signal.SIGKILL)
    assert await bench.exit_code(GONE_S) == 2
    assert f"sweeper (pid {sweeper}) exited with status -9" in bench.stderr()
    assert bench.stdout() == ""  # no figures to be mistaken for a measurement
    assert await gone_within(descendants, 1) == set()


async def test_an_intake_bench_out_of_time_says_why_and_stops_its_dispatcher(
    run_command: Start, endpoints: services.Endpoints
) -> None:
    quick = ("intake", "--n", "20000", "--only", "list", "--timeout-s", "1", "--json")
    bench = run_command(
        [sys.executable, "-m", "cronbus.cli", "bench", *quick], bench_env(endpoints)
    )
    await bench.wait_for("services ready", 60)
    descendants = tree(bench.popen.pid)
    assert await bench.exit_code(GONE_S) == 2
    assert re.search(r"list: \d+ of 20000 commands answered after 1s", bench.stderr())
    assert bench.stdout() == ""
    assert await gone_within(descendants, 1) == set()


async def test_intake_refuses_an_unknown_figure_before_starting_anything(
    run_command: Start, endpoints: services.Endpoints
) -> None:
    bench = run_command(
        [sys.executable, "-m", "cronbus.cli", "bench", "intake", "--only", "lists"],
        bench_env(endpoints),
    )
    assert await bench.exit_code(30) == 2
    assert "--only: lists not among upsert, upsert_many, get, list" in bench.stderr()
    assert "services ready" not in bench.stderr()
