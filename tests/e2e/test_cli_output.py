"""The CLI for people: aligned tables by default, the reply itself with ``-o json`` (and yaml,
wide), executions as they come with ``--watch``, and shell completion."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cronbus.cli.sink import Sink
from shared.contract import codec
from tests.support.stack import Stack

CLI = str(Path(sys.executable).parent / "cronbus")


def columns_of(header: str, line: str, names: list[str]) -> list[str]:
    """The cells of ``line`` under each of ``names``: a table is aligned when every cell
    starts where its header does."""
    starts = [header.index(name) for name in names]
    ends = [*starts[1:], None]
    return [line[start:end].strip() for start, end in zip(starts, ends, strict=True)]


# A dozen CLI processes, each an interpreter start: slow on a busy machine, not stuck.
@pytest.mark.timeout(300)
async def test_list_get_and_executions_print_tables_and_the_reply(
    stack: Stack, sink: Sink, stack_env: dict[str, str], tmp_path: Path
) -> None:
    await stack.start_all(("dispatcher", "executor"))
    env = {**os.environ, **stack_env}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [CLI, *args], capture_output=True, text=True, env=env, timeout=60, check=False
        )

    path = tmp_path / "schedules.yaml"
    path.write_text(f"""
- id: nightly
  spec: {{kind: cron, expr: "0 3 * * *", timezone: Europe/Berlin}}
  target: {{kind: webhook, url: "{sink.url}/nightly"}}
  labels: {{team: ops}}
- id: every-second-with-a-long-id
  spec: {{kind: interval, every_s: 1}}
  target: {{kind: webhook, url: "{sink.url}/soon"}}
""")
    applied = await asyncio.to_thread(run, "apply", "-f", str(path), "-n", "team")
    assert applied.returncode == 0, applied.stderr

    table = await asyncio.to_thread(run, "list", "-n", "team")
    assert table.returncode == 0, table.stderr
    lines = [line for line in table.stdout.splitlines() if line.strip()]
    header = lines[0]
    names = ["ID", "STATE", "SCHEDULE", "NEXT FIRE", "LAST", "FIRES"]
    assert [name in header for name in names] == [True] * len(names), header
    rows = {
        columns_of(header, line, names)[0]: columns_of(header, line, names) for line in lines[2:]
    }
    assert set(rows) == {"nightly", "every-second-with-a-long-id"}, table.stdout
    assert rows["nightly"][1:3] == ["active", "cron 0 3 * * * (Europe/Berlin)"]
    assert rows["nightly"][3].endswith(":00:00Z")  # 03:00 in Berlin, in UTC
    assert rows["every-second-with-a-long-id"][2] == "every 1s"

    as_json = await asyncio.to_thread(run, "list", "-n", "team", "-o", "json")
    reply = codec.loads(as_json.stdout)
    assert reply["ok"] is True and reply["next_cursor"] is None
    assert [s["id"] for s in reply["schedules"]] == ["every-second-with-a-long-id", "nightly"]
    as_yaml = await asyncio.to_thread(run, "list", "-n", "team", "-l", "team=ops", "-o", "yaml")
    assert [s["id"] for s in yaml.safe_load(as_yaml.stdout)["schedules"]] == ["nightly"]
    wide = await asyncio.to_thread(run, "list", "-n", "team", "-o", "wide")
    assert all(name in wide.stdout.splitlines()[0] for name in ("VERSION", "TARGET", "LABELS"))
    assert "team=ops" in wide.stdout

    got = await asyncio.to_thread(run, "get", "nightly", "-n", "team")
    assert got.returncode == 0, got.stderr
    # A field a line; a value of several lines (the next fires) continues under its first.
    fields = dict(line.split(None, 1) for line in got.stdout.splitlines() if line[:1].strip())
    assert fields["schedule"] == "team/nightly" and fields["state"] == "active"
    assert fields["version"] == "1" and fields["labels"] == "team=ops"
    got_json = await asyncio.to_thread(run, "get", "nightly", "-n", "team", "-o", "json")
    assert codec.loads(got_json.stdout)["schedule"]["labels"] == {"team": "ops"}
    missing = await asyncio.to_thread(run, "get", "nope", "-n", "team")
    assert missing.returncode == 1 and missing.stdout == "" and "not_found" in missing.stderr

    # Executions: a table, then --watch adds the ones that come after, aligned under it.
    assert await sink.wait_for(lambda s: len(s.received) >= 2, 15)
    await asyncio.sleep(1.0)  # execution rows are written in batches
    executions = await asyncio.to_thread(
        run, "executions", "every-second-with-a-long-id", "-n", "team"
    )
    header, *rows_printed = executions.stdout.splitlines()
    assert header.split() == [
        "FIRE",
        "TIME",
        "KIND",
        "STATUS",
        "TRY",
        "HTTP",
        "LATE",
        "MS",
        "ERROR",
    ]
    # A loaded machine may fire the every-second schedule past its grace: its skip policy then
    # records the missed time as skipped, a row like any other.
    assert rows_printed and all(
        columns_of(header, row, ["STATUS", "TRY", "HTTP"])[:2]
        in (["succeeded", "1"], ["skipped", "1"])
        for row in rows_printed
    ), executions.stdout
    assert any("succeeded" in row for row in rows_printed), executions.stdout
    watcher = await asyncio.create_subprocess_exec(
        *[CLI, "executions", "every-second-with-a-long-id", "-n", "team", "--limit", "1"],
        *["--watch", "--interval", "0.5"],
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        assert watcher.stdout is not None
        seen = [(await watcher.stdout.readline()).decode() for _ in range(4)]
    finally:
        watcher.terminate()
        await watcher.wait()
    fire_times = [row.split()[0] for row in seen[1:]]
    assert fire_times == sorted(set(fire_times)), seen  # the latest, then each new one
    assert all(columns_of(seen[0], row, ["STATUS", "TRY"])[0] == "succeeded" for row in seen[1:])


def test_shell_completion_knows_the_subcommands_and_their_options() -> None:
    script = subprocess.run(
        [CLI, "completion", "bash"], capture_output=True, text=True, check=True
    ).stdout

    def complete(*words: str) -> list[str]:
        program = (
            f"{script}\nCOMP_WORDS=({' '.join(repr(w) for w in ('cronbus', *words))}); "
            f'COMP_CWORD={len(words)}; _cronbus; printf "%s\\n" "${{COMPREPLY[@]}}"'
        )
        done = subprocess.run(["bash", "-c", program], capture_output=True, text=True, check=True)
        return done.stdout.split()

    assert complete("li") == ["list"]
    assert "--output" in complete("list", "--")
    assert complete("list", "-o", "") == ["table", "wide", "json", "yaml"]
    assert complete("executions", "x", "--wa") == ["--watch"]
    assert {"bash", "zsh"} <= set(complete("completion", ""))
    assert complete("completion", "z") == ["zsh"]
    assert complete("bench", "he") == ["herd", "held"]
    zsh = subprocess.run([CLI, "completion", "zsh"], capture_output=True, text=True, check=True)
    assert "bashcompinit" in zsh.stdout and "_cronbus()" in zsh.stdout
