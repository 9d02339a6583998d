"""``cronbus apply -f`` refuses input that would grow or nest without bound, before parsing it."""

from __future__ import annotations

import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cronbus.cli import commands
from cronbus.cli.common import CliError

BILLION_LAUGHS = "\n".join(
    ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    + [
        f"{chr(ord('a') + i)}: &{chr(ord('a') + i)} "
        + "["
        + ",".join([f"*{chr(ord('a') + i - 1)}"] * 9)
        + "]"
        for i in range(1, 9)
    ]
    + ["schedule: *i"]
)


def _limit_memory() -> None:
    # The old code expanded the aliases until memory ran out: fail fast instead of swapping.
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


def apply(path: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("cronbus", path=str(Path(sys.executable).parent))
    assert exe is not None, "the cronbus console script is not installed"
    return subprocess.run(
        [exe, "apply", "-f", str(path), "-n", "billing"],
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
        preexec_fn=_limit_memory,
        env={"PATH": "/usr/bin:/bin", "CRONBUS_AMQP_URL": "amqp://guest:guest@127.0.0.1:1/"},
    )


def test_a_billion_laughs_file_is_refused_at_once_naming_the_file_and_the_alias(
    tmp_path: Path,
) -> None:
    path = tmp_path / "laughs.yaml"
    path.write_text(BILLION_LAUGHS)
    result = apply(path)
    assert result.returncode != 0
    assert f"-f {path}" in result.stderr
    assert "aliases" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_anchor_without_an_alias_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "one.yaml"
    path.write_text("id: &name invoice-42\nspec: {kind: cron, expr: '0 * * * *'}\n")
    assert commands.load_schedules(str(path))[0]["id"] == "invoice-42"


def test_nesting_deeper_than_the_limit_is_refused_naming_the_line(tmp_path: Path) -> None:
    depth = commands.MAX_INPUT_DEPTH + 1
    path = tmp_path / "deep.json"
    path.write_text('{"id": "x", "deep": ' + "[" * depth + "]" * depth + "}")
    with pytest.raises(CliError, match=r"deep\.json: line 1: nested deeper than the 64 levels"):
        commands.load_schedules(str(path))


def test_a_file_over_the_size_limit_is_refused_before_it_is_parsed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(commands, "MAX_INPUT_BYTES", 1024)
    path = tmp_path / "big.yaml"
    # Not valid YAML past the limit: a parse would report that instead of the size.
    path.write_text("id: x\n" + "note: " + "y" * 2000 + "\n: : :\n")
    with pytest.raises(CliError, match=r"big\.yaml: the file is larger than the .* allowed"):
        commands.load_schedules(str(path))


def test_a_refusal_of_the_whole_body_reads_as_the_command_not_a_field() -> None:
    reply = {
        "ok": False,
        "error": {
            "code": "too_large",
            "message": "the command is 300000 bytes; at most 262144 are accepted",
            "details": [
                {
                    "field": "(body)",
                    "reason": "is 300000 bytes, over the 262144 bytes allowed "
                    "(CRONBUS_MAX_COMMAND_BYTES)",
                },
                {"field": "spec.expr", "reason": "is empty"},
            ],
        },
    }
    assert commands._error_line(reply) == (
        "too_large: the command's body is 300000 bytes, over the 262144 bytes allowed "
        "(CRONBUS_MAX_COMMAND_BYTES); spec.expr: is empty"
    )
