"""``cronbus dev --demo`` (the README's first command) brings everything up and shows it firing."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.support import services


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=5) as response:
        return int(response.status), response.read().decode()


async def test_dev_runs_the_services_and_prints_deliveries(
    stack_env: dict[str, str], tmp_path: Path
) -> None:
    # Metrics of the three services and the console: base..base+3; then the sink, the console.
    base = services.quiet_ports(6)
    sink_port, console_port = base + 4, base + 5
    log = (tmp_path / "dev.out").open("wb")
    dev = subprocess.Popen(  # noqa: ASYNC220 - one child, waited on in a thread
        [
            str(Path(sys.executable).parent / "cronbus"),
            "dev",
            "--demo",
            "--port-base",
            str(base),
            "--sink-port",
            str(sink_port),
            "--status-every",
            "2",
            "--console-port",
            str(console_port),
        ],
        env={**os.environ, **stack_env},
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            text = (tmp_path / "dev.out").read_text(errors="replace")
            if text.count("delivery ") >= 3 and "ready | executor ready | sweeper ready" in text:
                break
            await asyncio.sleep(0.5)
        else:
            raise AssertionError(f"no deliveries printed:\n{text}")
        assert "registered demo/every-5s" in text
        assert f"console: http://127.0.0.1:{console_port}/" in text
        status, page = await asyncio.to_thread(_get, f"http://127.0.0.1:{console_port}/")
        assert status == 200
        assert 'href="/ns/demo"' in page
        assert (tmp_path / ".cronbus-dev" / "dispatcher.log").exists()
    finally:
        dev.send_signal(signal.SIGINT)
        code = await asyncio.to_thread(dev.wait, 60)
        log.close()
    assert code == 0
    assert "stopping" in (tmp_path / "dev.out").read_text()
