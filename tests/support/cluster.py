"""A throwaway 3-master Redis Cluster on free loopback ports, stopped by PID afterwards."""

from __future__ import annotations

import contextlib
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.support.services import port_open


@dataclass
class Cluster:
    ports: list[int]
    processes: list[subprocess.Popen[bytes]]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def flushall(self) -> None:
        for port in self.ports:
            subprocess.run(
                ["redis-cli", "-p", str(port), "FLUSHALL"], check=True, capture_output=True
            )


#: The node ports and their bus ports (port + 10000, up to 32767) stay below Linux's
#: ephemeral range (32768-60999): a port there can be taken at any moment by a client
#: socket of the tests' own traffic, and the node then fails to bind it.
FIRST_PORT, LAST_PORT = 20_000, 22_767


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    while True:
        port = random.randint(FIRST_PORT, LAST_PORT)
        if not port_open("127.0.0.1", port, 0.2) and not port_open("127.0.0.1", port + 10_000, 0.2):
            return port


def _state_ok(port: int) -> bool:
    out = subprocess.run(
        ["redis-cli", "-p", str(port), "CLUSTER", "INFO"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return "cluster_state:ok" in out


@contextlib.contextmanager
def redis_cluster(masters: int = 3) -> Iterator[Cluster]:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        raise RuntimeError("redis-server and redis-cli are needed for a Redis Cluster")
    directory = Path(tempfile.mkdtemp(prefix="cbt-cluster-"))
    ports = [_cluster_port() for _ in range(masters)]
    processes = []
    try:
        for port in ports:
            node = directory / str(port)
            node.mkdir()
            processes.append(
                subprocess.Popen(
                    [
                        "redis-server",
                        "--port",
                        str(port),
                        "--bind",
                        "127.0.0.1",
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        str(node / "nodes.conf"),
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                        "--dir",
                        str(node),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        deadline = time.monotonic() + 20
        while not all(port_open("127.0.0.1", p, 0.2) for p in ports):
            if time.monotonic() > deadline:
                raise RuntimeError("cluster nodes did not start")
            time.sleep(0.1)
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in ports),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        while not all(_state_ok(p) for p in ports):
            if time.monotonic() > deadline + 30:
                raise RuntimeError("cluster did not reach state ok")
            time.sleep(0.2)
        yield Cluster(ports, processes)
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
                process.wait()
        shutil.rmtree(directory, ignore_errors=True)
