"""The README's first schedule, from Python and from the CLI, run exactly as written."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.support.stack import Stack

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def block(language: str, holding: str) -> str:
    """The README's ``language`` block that holds ``holding``."""
    found = [b for b in re.findall(rf"```{language}\n(.*?)```", README, re.DOTALL) if holding in b]
    assert len(found) == 1, f"no single {language} block with {holding!r} in README.md"
    return str(found[0])


def run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=120, check=False
    )


async def test_the_python_example_works_as_written(
    stack: Stack, stack_env: dict[str, str], tmp_path: Path
) -> None:
    await stack.start_all(("dispatcher",))
    script = tmp_path / "first.py"
    script.write_text(block("python", "Client("))
    env = {**os.environ, **stack_env}
    done = await asyncio.to_thread(run, [sys.executable, str(script)], env, tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("invoice-42 1 active 20"), lines
    assert lines[1].startswith("triggered, key ") and lines[2:] == ["invoice-42 active", "deleted"]


async def test_the_aio_pika_example_works_as_written(
    stack: Stack, stack_env: dict[str, str], tmp_path: Path
) -> None:
    """A robust connection names its exclusive queue itself (``amq_<hex>``): it is answered."""
    await stack.start_all(("dispatcher",))
    script = tmp_path / "robust.py"
    script.write_text(block("python", "connect_robust("))
    env = {**os.environ, **stack_env}
    done = await asyncio.to_thread(run, [sys.executable, str(script)], env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["True 1"]


async def test_the_cli_example_works_as_written(
    stack: Stack, stack_env: dict[str, str], tmp_path: Path
) -> None:
    await stack.start_all(("dispatcher",))
    # "cronbus" as README says to get it: on the PATH after pip install -e .
    env = {
        **os.environ,
        **stack_env,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    done = await asyncio.to_thread(
        run, ["bash", "-euc", block("sh", "cronbus apply")], env, tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cronbus apply" not in done.stderr
    applied, table = done.stdout.split("\n", 1)  # apply says what it did, in a line
    assert applied.startswith("schedule billing/invoice-42 created (version 1, next fire 20")
    assert re.search(r"ID\s+STATE\s+SCHEDULE\s+NEXT FIRE", table), done.stdout
    assert re.search(r"invoice-42\s+active\s+cron 0 9 \* \* MON-FRI \(Europe/Berlin\)", table)
    assert re.search(r"^triggered billing/invoice-42: run 20\S+Z \(idempotency key ", table, re.M)
    assert done.stdout.endswith("\ndeleted billing/invoice-42\n"), done.stdout
