"""The broker's own tool, for tests that make RabbitMQ do what an outage would."""

from __future__ import annotations

import subprocess
import urllib.parse


def close_connections(amqp_url: str, name: str, *, prefix: bool = False) -> int:
    """Have the broker close the connections of ``amqp_url``'s vhost whose client name is
    ``name`` (with ``prefix``: starts with it); how many it closed (one that went away
    between the listing and the close is not counted)."""
    vhost = urllib.parse.unquote(urllib.parse.urlsplit(amqp_url).path.lstrip("/")) or "/"
    listed = subprocess.run(
        ["rabbitmqctl", "-q", "list_connections", "pid", "vhost", "client_properties"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    wanted = f'"{name}' if prefix else f'"{name}"'
    closed = 0
    for line in listed.splitlines():
        fields = line.split("\t")
        if len(fields) >= 3 and fields[1] == vhost and wanted in fields[2]:
            done = subprocess.run(
                ["rabbitmqctl", "-q", "close_connection", fields[0], "closed by a test"],
                check=False,
                capture_output=True,
                timeout=60,
            )
            closed += done.returncode == 0
    return closed
