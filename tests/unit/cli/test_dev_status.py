"""``cronbus dev``'s status line and logs do not drown or pile up (issue 27, point 6)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cronbus.cli import dev
from cronbus.cli.common import CliError

BUCKET = "cronbus_fire_lateness_seconds_bucket,le="


def test_lateness_beyond_the_last_bucket_reads_as_more_than_it() -> None:
    samples = {f"{BUCKET}0.05": 90.0, f"{BUCKET}60.0": 98.0, f"{BUCKET}inf": 100.0}
    p50, p99 = dev._quantile(samples, 0.5), dev._quantile(samples, 0.99)
    assert p50 is not None and p99 is not None
    assert dev._bound_text(p50, samples) == "≤ 50 ms"
    assert dev._bound_text(p99, samples) == "> 60,000 ms"


def test_off_a_terminal_the_status_speaks_on_a_change_or_every_half_minute(
    capsys: pytest.CaptureFixture[str],
) -> None:
    now = [0.0]
    status = dev.StatusLine(tty=False, quiet_s=30, clock=lambda: now[0])
    for second in range(120):
        now[0] = float(second)
        state = "executor ready" if second < 50 else "executor down"
        status.show(f"{second} {state} | delivered ok {second}", state)
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in printed] == ["0", "30", "50", "80", "110"]


def test_each_run_starts_its_logs_afresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dev, "LOG_DIR", tmp_path)
    for run in range(3):
        log = dev.fresh_log("executor")
        log.write_text(f"run {run}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["executor.log", "executor.previous.log"]
    assert (tmp_path / "executor.log").read_text() == "run 2\n"


def test_a_service_that_does_not_start_is_named_with_its_log_and_how_to_pick_another_redis(
    tmp_path: Path,
) -> None:
    log = tmp_path / "dispatcher.log"
    log.write_text(
        "2026-11-28 15:00:00 dispatcher INFO starting\n"
        "2026-11-28 15:00:01 dispatcher ERROR the index under prefix 'cronbus' belongs to "
        "another database (5/prod); give this deployment its own Redis or CRONBUS_REDIS_PREFIX\n"
        "2026-11-28 15:00:01 dispatcher INFO stopped\n"
    )

    class NeverReady:
        name = "dispatcher"

        def __init__(self) -> None:
            self.log = log

        async def wait_ready(self, timeout_s: float) -> None:
            raise RuntimeError("not ready")

    with pytest.raises(CliError) as raised:
        asyncio.run(dev._wait_ready([NeverReady()], 0.1))  # type: ignore[list-item]
    said = str(raised.value)
    assert "dispatcher did not become ready" in said
    assert "belongs to another database (5/prod)" in said
    assert "INFO starting" not in said
    assert "CRONBUS_REDIS_URL=redis://127.0.0.1:6379/1" in said
    assert "CRONBUS_REDIS_PREFIX" in said
