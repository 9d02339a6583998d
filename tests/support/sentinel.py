"""A throwaway Redis primary, its replica and three Sentinels on free loopback ports, with
short failover timings (a failover takes a few seconds); every process stopped by PID.

Sentinel runs from ``redis-server --sentinel`` (the binary every Redis install has; Debian's
``redis-sentinel`` package only adds a service around it)."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.failover import Promotion, replication_offset
from tests.support.services import free_port, port_open

MASTER = "cronbus-test"
#: A primary that does not answer for this long is subjectively down (two Sentinels agreeing
#: make it objectively down and start the failover).
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 5000


def _redis_cli(port: int, *args: str) -> str:
    return subprocess.run(
        ["redis-cli", "-p", str(port), *args],
        capture_output=True,
        text=True,
        timeout=5,
        check=False,
    ).stdout


@dataclass
class Node:
    port: int
    process: subprocess.Popen[bytes]

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()


@dataclass
class SentinelGroup:
    directory: Path
    servers: list[Node] = field(default_factory=list)
    sentinels: list[Node] = field(default_factory=list)
    _lagging: tuple[Node, Node] = field(init=False)

    @property
    def setting(self) -> str:
        """CRONBUS_REDIS_SENTINELS."""
        return ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)

    @property
    def url(self) -> str:
        """CRONBUS_REDIS_URL: only its database number counts with Sentinel; the port named
        here is nobody's, so a client that ignored Sentinel would fail at once."""
        return "redis://127.0.0.1:1/0"

    @property
    def settings(self) -> dict[str, str]:
        """The services' Redis settings for this group."""
        return {
            "CRONBUS_REDIS_URL": self.url,
            "CRONBUS_REDIS_SENTINELS": self.setting,
            "CRONBUS_REDIS_SENTINEL_MASTER": MASTER,
        }

    def primary_port(self) -> int | None:
        """The primary as the first Sentinel that answers names it."""
        for sentinel in self.sentinels:
            if not sentinel.alive():
                continue
            reply = _redis_cli(sentinel.port, "SENTINEL", "get-master-addr-by-name", MASTER)
            lines = reply.split()
            if len(lines) == 2 and lines[1].isdigit():
                return int(lines[1])
        return None

    def primary(self) -> Node:
        port = self.primary_port()
        return next(n for n in self.servers if n.port == port)

    def replica(self) -> Node:
        port = self.primary_port()
        return next(n for n in self.servers if n.port != port)

    def wait_primary_is(self, port: int, timeout_s: float) -> float:
        """Seconds until every living Sentinel names ``port`` the primary and it says so."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            named = {
                _redis_cli(s.port, "SENTINEL", "get-master-addr-by-name", MASTER).split()[-1:]
                == [str(port)]
                for s in self.sentinels
                if s.alive()
            }
            if named == {True} and "role:master" in _redis_cli(port, "INFO", "replication"):
                return time.monotonic() - started
            time.sleep(0.05)
        raise RuntimeError(f"the Sentinels did not promote {port} within {timeout_s:g}s")

    def wait_ready(self, timeout_s: float = 30) -> None:
        """Every Sentinel knows the replica and the two other Sentinels, and the replica is in
        sync: a failover can happen."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready = all(
                _fields(_redis_cli(s.port, "SENTINEL", "master", MASTER)).get("num-slaves") == "1"
                and _fields(_redis_cli(s.port, "SENTINEL", "master", MASTER)).get(
                    "num-other-sentinels"
                )
                == "2"
                for s in self.sentinels
            )
            replica = _redis_cli(self.servers[1].port, "INFO", "replication")
            if ready and "master_link_status:up" in replica:
                return
            time.sleep(0.2)
        raise RuntimeError("the Sentinels did not come to know each other and the replica")

    def begin_lag(self) -> None:
        """The replica stops (SIGSTOP) and the primary drops its link: from now on the
        replica receives nothing. Stopping it alone would not do: the kernel keeps receiving
        the replication stream meanwhile and the replica would apply it all on SIGCONT."""
        self._lagging = (self.primary(), self.replica())
        self._lagging[1].process.send_signal(signal.SIGSTOP)
        _redis_cli(self._lagging[0].port, "CLIENT", "KILL", "TYPE", "replica")

    def end_lag(self, timeout_s: float = 30) -> Promotion:
        """Kill the primary while the replica is still stopped, let the replica go on and
        wait until the Sentinels have promoted it. The replica is promoted although the
        Sentinels found it down meanwhile: it answers again before they choose (within
        down-after-milliseconds of the kill)."""
        primary, replica = self._lagging
        written = replication_offset(primary.port)
        primary.kill()
        killed_ms = time.time() * 1000
        replica.process.send_signal(signal.SIGCONT)
        behind = written - replication_offset(replica.port)
        return Promotion(killed_ms, self.wait_primary_is(replica.port, timeout_s), behind)

    def stop(self) -> None:
        for node in [*self.sentinels, *self.servers]:
            node.kill()


def _fields(reply: str) -> dict[str, str]:
    lines = reply.split()
    return dict(zip(lines[::2], lines[1::2], strict=False))


def _server(port: int, directory: Path, *extra: str) -> Node:
    directory.mkdir()
    process = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(directory),
            "--logfile",
            str(directory / "redis.log"),
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return Node(port, process)


def _sentinel(port: int, primary: int, directory: Path) -> Node:
    conf = directory / f"sentinel-{port}.conf"
    conf.write_text(
        f"port {port}\n"
        "bind 127.0.0.1\n"
        f"dir {directory}\n"
        f"logfile {directory / f'sentinel-{port}.log'}\n"
        f"sentinel monitor {MASTER} 127.0.0.1 {primary} 2\n"
        f"sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}\n"
        f"sentinel failover-timeout {MASTER} {FAILOVER_TIMEOUT_MS}\n"
        f"sentinel parallel-syncs {MASTER} 1\n"
    )
    process = subprocess.Popen(
        ["redis-server", str(conf), "--sentinel"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return Node(port, process)


def _wait_ports(nodes: list[Node], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(port_open("127.0.0.1", n.port, 0.2) for n in nodes):
        if time.monotonic() > deadline or not all(n.alive() for n in nodes):
            raise RuntimeError("a Redis server or Sentinel did not start")
        time.sleep(0.05)


@contextlib.contextmanager
def sentinel_group() -> Iterator[SentinelGroup]:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        raise RuntimeError("redis-server and redis-cli are needed for Redis Sentinel")
    directory = Path(tempfile.mkdtemp(prefix="cbt-sentinel-"))
    group = SentinelGroup(directory)
    try:
        primary = free_port()
        group.servers.append(_server(primary, directory / "primary"))
        replica = free_port()
        group.servers.append(
            _server(replica, directory / "replica", "--replicaof", "127.0.0.1", str(primary))
        )
        _wait_ports(group.servers, 20)
        group.sentinels = [_sentinel(free_port(), primary, directory) for _ in range(3)]
        _wait_ports(group.sentinels, 20)
        group.wait_ready()
        yield group
    finally:
        group.stop()
        shutil.rmtree(directory, ignore_errors=True)
