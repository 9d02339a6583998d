"""What each component of a bench run cost in CPU, and whether the import overlapped the window.

The arithmetic is pure (samples in, milliseconds per fire out); reading ``/proc`` is kept to
the few functions at the bottom. A sample maps each component to ``{pid: CPU seconds}``, so a
process that starts during the window (a new PostgreSQL backend) counts fully, and one that
exits during it counts up to the last sample that saw it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

#: One component's processes: pid -> user plus system CPU seconds used so far.
PidTimes = Mapping[int, float]
#: Every component of a run at one instant.
Sample = Mapping[str, PidTimes]

#: Components in the order they are reported; the services first, then the servers.
COMPONENTS = (
    "executors",
    "dispatcher",
    "sweeper",
    "redis",
    "rabbitmq",
    "postgresql",
    "sink",
)
SERVICES = ("executors", "dispatcher", "sweeper")


def cpu_spent(before: PidTimes, after: PidTimes) -> float:
    """CPU seconds the processes spent between two samples.

    A pid only in ``after`` started inside the window: all of its time counts. A pid only in
    ``before`` exited inside the window: its last stretch is unknown and not counted.
    """
    return sum(max(0.0, spent - before.get(pid, 0.0)) for pid, spent in after.items())


def ms_per_fire(before: Sample, after: Sample, fires: int) -> dict[str, float]:
    """Milliseconds of CPU per fire of each component sampled in ``after``."""
    per = max(fires, 1)
    return {
        name: round(cpu_spent(before.get(name, {}), times) * 1000 / per, 4)
        for name, times in after.items()
    }


def services_total(by_component: Mapping[str, float]) -> float:
    """cronbus's own CPU per fire: its three services, without the servers or the sink."""
    return round(sum(by_component.get(name, 0.0) for name in SERVICES), 4)


def ticks_from_stat(text: str) -> int:
    """utime + stime, in clock ticks, from the text of ``/proc/<pid>/stat``.

    The command name (field 2) is in parentheses and may hold spaces or parentheses itself,
    so fields are counted from the last ``)``.
    """
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


@dataclass(frozen=True)
class ImportWindow:
    """When the import ended against when the measured window starts (epoch milliseconds)."""

    import_end_ms: int
    window_start_ms: int

    @property
    def overlap_ms(self) -> int:
        """How far the import ran into the measured window (0 when it ended before it)."""
        return max(0, self.import_end_ms - self.window_start_ms)

    @property
    def margin_s(self) -> float:
        """Seconds between the end of the import and the window (negative: overlap)."""
        return round((self.window_start_ms - self.import_end_ms) / 1000, 3)

    def refusal(self) -> str | None:
        """Why the run cannot be trusted as measured, or None when the import ended in time."""
        if self.overlap_ms == 0:
            return None
        return (
            f"the import ended {self.overlap_ms / 1000:.1f}s into the measured window, so the "
            f"window measures the import too: raise --lead-s (or pass --allow-overlap to "
            f"report the run flagged)"
        )


def is_own_postgres(title: str, database: str) -> bool:
    """Whether a PostgreSQL process (by its process title) works for the run's database.

    Client backends (``postgres: 15/main: user db 127.0.0.1(5555) idle``) count only for the
    run's own database: other databases are other people's load. The server's own processes
    (checkpointer, WAL writer, background writer, autovacuum) count: the run's writes are
    much of their work.
    """
    words = title.split()
    if "[local]" in title or any("(" in word for word in words):
        return database in words
    return True


# --- /proc ----------------------------------------------------------------------------------


def _ticks_per_s() -> int:
    return os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """The CPU time a process has used so far; None when it is gone."""
    try:
        return ticks_from_stat(Path(f"/proc/{pid}/stat").read_text()) / _ticks_per_s()
    except (OSError, IndexError, ValueError):
        return None


def times_of(pids: Iterable[int]) -> dict[int, float]:
    found = {pid: cpu_seconds(pid) for pid in pids}
    return {pid: spent for pid, spent in found.items() if spent is not None}


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _listening_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                inodes.add(inode)
    return inodes


def listening_pids(port: int) -> set[int]:
    """Processes holding a socket that listens on ``port`` (every nginx worker, say)."""
    inodes = {f"socket:[{inode}]" for inode in _listening_inodes(port)}
    if not inodes:
        return set()
    holders: set[int] = set()
    for pid in _all_pids():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    holders.add(pid)
                    break
            except OSError:
                continue
    return holders


def children_of(parents: set[int]) -> set[int]:
    found: set[int] = set()
    for pid in _all_pids():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) in parents:
            found.add(pid)
    return found


def title_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def postgres_pids(port: int, database: str) -> set[int]:
    """The postmaster on ``port`` and those of its children that work for ``database``."""
    masters = listening_pids(port)
    return masters | {
        pid for pid in children_of(masters) if is_own_postgres(title_of(pid), database)
    }


def host_cpu_seconds() -> float:
    """CPU time the whole machine spent (all processes: other people's too)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    busy = sum(int(v) for i, v in enumerate(fields) if i not in (3, 4))  # not idle, iowait
    return busy / _ticks_per_s()
