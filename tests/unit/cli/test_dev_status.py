"""``cronbus dev``'s status line and logs do not drown or pile up (issue 27, point 6)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cronbus.cli import dev

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
