"""A service started with a bad CRONBUS_* value says which and why, and does not start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


def start(service: str, **settings: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", f"services.{service}"],
        env={**os.environ, **settings},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.mark.parametrize("service", ["dispatcher", "executor"])
def test_a_bad_network_in_the_webhook_policy_stops_the_start(service: str) -> None:
    result = start(service, CRONBUS_WEBHOOK_ALLOWED_NETWORKS="127.0.0.0/8,localhost")
    assert result.returncode == 2
    assert f"cronbus {service}: configuration: CRONBUS_WEBHOOK_ALLOWED_NETWORKS:" in result.stderr
    assert "'localhost' is not a network" in result.stderr


def test_a_bad_signing_secrets_file_stops_the_executor(tmp_path: Path) -> None:
    secrets = tmp_path / "signing.json"
    secrets.write_text('{"acme": ["not-a-secret"]}')
    result = start("executor", CRONBUS_SIGNING_SECRETS_FILE=str(secrets))
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"cronbus executor: configuration: CRONBUS_SIGNING_SECRETS_FILE {secrets}: "
        "'acme'[0]: must start with whsec_"
    )
