"""A service started with a bad CRONBUS_* value says which and why, and does not start."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("service", ["dispatcher", "executor", "sweeper"])
def test_a_bad_setting_stops_the_start_naming_the_variable(service: str) -> None:
    env = {**os.environ, "CRONBUS_SHARDS": "0", "CRONBUS_LOG_FORMAT": "yaml"}
    result = subprocess.run(
        [sys.executable, "-m", f"services.{service}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert any(
        line.startswith(f"cronbus {service}: configuration: CRONBUS_SHARDS:") for line in lines
    ), lines
    assert any("CRONBUS_LOG_FORMAT" in line for line in lines), lines
    assert "Traceback" not in result.stderr
