"""The verbs that change something print for people (issue 36, newcomer 3): apply, pause,
resume, trigger, backfill and delete print one line saying what happened, ``-o json`` the reply
exactly as before (one JSON line), ``-o yaml`` the same as YAML; a refusal is one line on stderr
with the exit status it had."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from cronbus.cli.sink import Sink
from shared.contract import codec, timefmt
from tests.support.stack import Stack

CLI = str(Path(sys.executable).parent / "cronbus")
INSTANT = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z"


# A dozen CLI processes, each an interpreter start: slow on a busy machine, not stuck.
@pytest.mark.timeout(300)
async def test_each_verb_prints_a_line_for_people_and_the_reply_with_o_json(
    stack: Stack, sink: Sink, stack_env: dict[str, str], tmp_path: Path
) -> None:
    await stack.start_all(("dispatcher",))
    env = {**os.environ, **stack_env}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [CLI, *args, "-n", "ops"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )

    async def said(*args: str) -> str:
        done = await asyncio.to_thread(run, *args)
        assert done.returncode == 0, done.stderr
        return done.stdout

    path = tmp_path / "nightly.yaml"
    path.write_text(f"""
id: nightly
spec: {{kind: cron, expr: "0 3 * * *"}}
target: {{kind: webhook, url: "{sink.url}/nightly"}}
""")
    created = await said("apply", "-f", str(path))
    assert re.fullmatch(
        rf"schedule ops/nightly created \(version 1, next fire {INSTANT}\)\n", created
    ), created
    again = await asyncio.to_thread(run, "apply", "-f", str(path))
    assert again.stdout.startswith("schedule ops/nightly unchanged (version 1, next fire")
    assert again.stderr == "", again.stderr  # the line says it: no second note on stderr

    assert await said("pause", "nightly") == "paused ops/nightly (version 2, paused)\n"
    assert await said("pause", "nightly") == "ops/nightly unchanged: already paused (version 2)\n"
    assert (await said("resume", "nightly")).startswith("resumed ops/nightly (version 3, next fire")

    triggered = await said("trigger", "nightly")
    assert re.fullmatch(
        rf"triggered ops/nightly: run {INSTANT} \(idempotency key \S+\)\n", triggered
    ), triggered
    # -o json: the reply exactly as it came, on one line, as these verbs printed before.
    as_json = await said("trigger", "nightly", "-o", "json")
    (line,) = as_json.splitlines()
    reply = codec.loads(line)
    assert reply["ok"] is True and reply["schedule"]["id"] == "nightly"
    assert set(reply["trigger"]) == {"fire_time", "idempotency_key"}
    assert line == codec.dumps(reply).decode()
    as_yaml = yaml.safe_load(await said("trigger", "nightly", "-o", "yaml"))
    assert as_yaml["ok"] is True and "fire_time" in as_yaml["trigger"]

    hour_ago = timefmt.format_ms((int(time.time() * 1000) // 3_600_000 - 30) * 3_600_000)
    now = timefmt.format_ms(int(time.time() * 1000))
    backfilled = await said("backfill", "nightly", "--from", hour_ago, "--to", now)
    assert re.fullmatch(
        r"backfill of ops/nightly started: \d occurrences? to deliver, oldest first\n", backfilled
    ), backfilled

    assert await said("delete", "nightly") == "deleted ops/nightly\n"
    # A refusal: nothing on stdout, one line on stderr, exit status 1, as before.
    missing = await asyncio.to_thread(run, "delete", "nightly")
    assert missing.returncode == 1 and missing.stdout == ""
    (refusal,) = missing.stderr.strip().splitlines()
    assert refusal.startswith("cronbus delete: not_found"), refusal
    refused_json = await asyncio.to_thread(run, "delete", "nightly", "-o", "json")
    assert refused_json.returncode == 1
    assert codec.loads(refused_json.stdout)["error"]["code"] == "not_found"

    # A file of several: a line per schedule in file order; -o json a result line each.
    many = tmp_path / "many.yaml"
    many.write_text(f"""
- id: a
  spec: {{kind: interval, every_s: 3600}}
  target: {{kind: webhook, url: "{sink.url}/a"}}
- id: b
  spec: {{kind: cron, expr: "0 25 * * *"}}
  target: {{kind: webhook, url: "{sink.url}/b"}}
""")
    several = await asyncio.to_thread(run, "apply", "-f", str(many))
    assert several.returncode == 1
    assert several.stdout == "schedule ops/a created (version 1)\n", several.stdout
    assert "b: invalid_schedule: spec.expr: hour: 25 is out of range 0-23" in several.stderr
    several_json = await asyncio.to_thread(run, "apply", "-f", str(many), "-o", "json")
    results = [codec.loads(text) for text in several_json.stdout.splitlines()]
    assert [(r["id"], r["ok"]) for r in results] == [("a", True), ("b", False)]
    assert results[0]["unchanged"] is True
