"""``-n``: an empty namespace is refused naming -n; none at all says 'default' is used."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def cronbus(*args: str, namespace_env: str | None = None) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("cronbus", path=str(Path(sys.executable).parent))
    assert exe is not None, "the cronbus console script is not installed"
    env = {k: v for k, v in os.environ.items() if k != "CRONBUS_NAMESPACE"}
    # No broker there: the command fails fast once past its arguments.
    env["CRONBUS_AMQP_URL"] = "amqp://guest:guest@127.0.0.1:1/"
    if namespace_env is not None:
        env["CRONBUS_NAMESPACE"] = namespace_env
    return subprocess.run(
        [exe, *args, "--timeout", "2"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env=env,
    )


def test_an_empty_n_is_refused_naming_n_not_a_field_of_the_command() -> None:
    result = cronbus("get", "invoice-42", "-n", "")
    assert result.returncode == 2
    assert "-n/--namespace: empty" in result.stderr
    assert "routing_key" not in result.stderr


def test_an_empty_cronbus_namespace_is_refused_naming_it() -> None:
    result = cronbus("delete", "invoice-42", namespace_env="")
    assert result.returncode == 2
    assert "-n/--namespace: empty" in result.stderr and "CRONBUS_NAMESPACE" in result.stderr


def test_without_n_the_default_namespace_is_said_not_silent() -> None:
    result = cronbus("get", "invoice-42")
    assert "using namespace 'default'" in result.stderr
    assert "using namespace" not in cronbus("get", "invoice-42", "-n", "billing").stderr
    assert "using namespace" not in cronbus("get", "x", namespace_env="billing").stderr
