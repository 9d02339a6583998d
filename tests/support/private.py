"""Private Redis, RabbitMQ and PostgreSQL servers for the chaos tests.

Chaos tests flush, stop and restart their dependencies; doing that to the machine's shared
servers would hit everything else using them. So each chaos module starts its own servers
on free loopback ports, from the binaries the machine has, and stops them by PID (or by
their own control command) when it ends. RabbitMQ and PostgreSQL refuse to run as root, so
they run as their system users (``runuser``), as the machine's own servers do.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.support.services import free_port, port_open


def _wait_port(port: int, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not port_open("127.0.0.1", port, timeout=0.5):
        if time.monotonic() > deadline:
            raise RuntimeError(f"private {what} did not open port {port}")
        time.sleep(0.1)


def _wait_closed(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while port_open("127.0.0.1", port, timeout=0.2) and time.monotonic() < deadline:
        time.sleep(0.1)


def _owned_dir(prefix: str, user: str | None) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    if user and os.geteuid() == 0:
        shutil.chown(path, user, user)
    return path


def _as(user: str) -> list[str]:
    return ["runuser", "-u", user, "--"] if os.geteuid() == 0 else []


@dataclass
class PrivateRedis:
    port: int
    directory: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.directory),
                "--logfile",
                str(self.directory / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_port(self.port, 20, "Redis")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
        _wait_closed(self.port, 5)


@dataclass
class PrivateRabbit:
    port: int
    directory: Path
    node: str

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    @property
    def urls_of_one_node(self) -> tuple[str, str]:
        """This node by two names: a list the services take for two nodes."""
        return self.url, f"amqp://guest:guest@localhost:{self.port}/"

    def close_connections(self) -> None:
        """Every client connection closed by the broker, as when its node is lost."""
        self._ctl("close_all_connections", "cronbus test: node lost")

    @property
    def ctl(self) -> list[str]:
        return ["rabbitmqctl", "-q", "-n", self.node]

    def _ctl(self, *args: str, check: bool = True, timeout: float | None = 120) -> None:
        """rabbitmqctl on this node. Its own distribution ports: the CLI's default range
        (35672-35682) is shared by every rabbitmqctl on the machine, and a few hung ones
        (another broker's) make every other call fail with 'nodistribution'."""
        low = free_port()
        env = {
            **os.environ,
            "RABBITMQ_CTL_DIST_PORT_MIN": str(low),
            "RABBITMQ_CTL_DIST_PORT_MAX": str(min(low + 50, 65535)),
        }
        subprocess.run(
            [*self.ctl, *args], check=check, capture_output=True, env=env, timeout=timeout
        )

    def configure(self) -> None:
        (self.directory / "rabbitmq.conf").write_text(
            f"listeners.tcp.local = 127.0.0.1:{self.port}\n"
        )
        (self.directory / "enabled_plugins").write_text("[].\n")

    def start(self) -> None:
        self.configure()
        (self.directory / "env.conf").write_text("")
        for path in self.directory.iterdir():
            if os.geteuid() == 0:
                shutil.chown(path, "rabbitmq", "rabbitmq")
        server = shutil.which("rabbitmq-server", path="/usr/lib/rabbitmq/bin") or (
            "rabbitmq-server"
        )
        env = {
            **os.environ,
            "HOME": "/var/lib/rabbitmq",
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_CONF_ENV_FILE": str(self.directory / "env.conf"),
            "RABBITMQ_CONFIG_FILE": str(self.directory / "rabbitmq.conf"),
            "RABBITMQ_DIST_PORT": str(free_port()),
            "RABBITMQ_MNESIA_BASE": str(self.directory / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.directory / "log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.directory / "enabled_plugins"),
            "RABBITMQ_PID_FILE": str(self.directory / "pid"),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
        }
        subprocess.run(
            [*_as("rabbitmq"), server, "-detached"],
            env=env,
            check=True,
            cwd=self.directory,
            capture_output=True,
        )
        _wait_port(self.port, 90, "RabbitMQ")

    def stop_app(self) -> None:
        self._ctl("stop_app")
        _wait_closed(self.port, 20)

    def start_app(self) -> None:
        self._ctl("start_app")
        _wait_port(self.port, 60, "RabbitMQ")

    def add_vhost(self, vhost: str) -> None:
        self._ctl("add_vhost", vhost)
        self._ctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")

    def stop(self) -> None:
        self._ctl("stop", check=False, timeout=60)
        pid_file = self.directory / "pid"
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pid_file.read_text().strip()), signal.SIGKILL)


@dataclass
class PrivatePostgres:
    port: int
    directory: Path

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def bin(self) -> Path:
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
        if found:
            return Path(found[-1]).parent
        pg_ctl = shutil.which("pg_ctl")
        if pg_ctl is None:
            raise RuntimeError("pg_ctl is not installed")
        return Path(pg_ctl).parent

    def _ctl(self, *args: str) -> None:
        options = (
            f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 "
            "-c fsync=off -c full_page_writes=off"
        )
        subprocess.run(
            [
                *_as("postgres"),
                str(self.bin / "pg_ctl"),
                "-D",
                str(self.directory / "data"),
                "-l",
                str(self.directory / "log"),
                "-o",
                options,
                "-w",
                *args,
            ],
            check=True,
            capture_output=True,
        )

    def start(self) -> None:
        if not (self.directory / "data").exists():
            subprocess.run(
                [
                    *_as("postgres"),
                    str(self.bin / "initdb"),
                    "-D",
                    str(self.directory / "data"),
                    "-A",
                    "trust",
                    "-U",
                    "postgres",
                    "--no-sync",
                    "-E",
                    "UTF8",
                ],
                check=True,
                capture_output=True,
            )
        self._ctl("start")
        _wait_port(self.port, 30, "PostgreSQL")

    def restart(self) -> None:
        self._ctl("-m", "fast", "restart")

    def stop(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self._ctl("-m", "immediate", "stop")


@dataclass
class PrivateServices:
    redis: PrivateRedis
    rabbit: PrivateRabbit
    postgres: PrivatePostgres


def available() -> str | None:
    """Why private servers cannot run here, or None when they can."""
    for binary in ("redis-server", "rabbitmqctl"):
        if shutil.which(binary) is None:
            return f"{binary} is not installed"
    if not glob.glob("/usr/lib/postgresql/*/bin/pg_ctl") and not shutil.which("pg_ctl"):
        return "PostgreSQL server binaries are not installed"
    return None


@contextlib.contextmanager
def private_services() -> Iterator[PrivateServices]:
    run = os.urandom(3).hex()
    redis = PrivateRedis(free_port(), _owned_dir("cbt-redis-", None))
    rabbit = PrivateRabbit(free_port(), _owned_dir("cbt-rmq-", "rabbitmq"), f"cbt{run}@localhost")
    postgres = PrivatePostgres(free_port(), _owned_dir("cbt-pg-", "postgres"))
    try:
        redis.start()
        rabbit.start()
        postgres.start()
        yield PrivateServices(redis, rabbit, postgres)
    finally:
        for server in (postgres, rabbit, redis):
            with contextlib.suppress(Exception):
                server.stop()
        for directory in (redis.directory, rabbit.directory, postgres.directory):
            shutil.rmtree(directory, ignore_errors=True)
