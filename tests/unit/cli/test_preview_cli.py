"""``cronbus preview`` run as a user runs it: the installed console script."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest


def preview(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("cronbus", path=str(__import__("pathlib").Path(sys.executable).parent))
    assert exe is not None, "the cronbus console script is not installed"
    return subprocess.run(
        [exe, "preview", *args], capture_output=True, text=True, timeout=30, check=False
    )


def lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_the_design_examples() -> None:
    assert lines(
        preview(
            "--cron",
            "0 9 * * MON-FRI",
            "--timezone",
            "Europe/Berlin",
            "--after",
            "2027-01-01T00:00:00Z",
            "--count",
            "3",
        )
    ) == [
        "2027-01-01T08:00:00Z",
        "2027-01-04T08:00:00Z",
        "2027-01-05T08:00:00Z",
    ]
    # 02:30 does not exist in Berlin on 2027-03-28: it fires shifted by the gap, 03:30 local.
    assert lines(
        preview(
            "--cron",
            "30 2 * * *",
            "--timezone",
            "Europe/Berlin",
            "--after",
            "2027-03-27T00:00:00Z",
            "--count",
            "3",
        )
    ) == [
        "2027-03-27T01:30:00Z",
        "2027-03-28T01:30:00Z",
        "2027-03-29T00:30:00Z",
    ]
    # Fall back: a fixed hour fires at the first 02:30 only, a wildcard hour at both.
    assert lines(
        preview(
            "--cron",
            "30 2 * * *",
            "--timezone",
            "Europe/Berlin",
            "--after",
            "2027-10-30T12:00:00Z",
            "--count",
            "2",
        )
    ) == [
        "2027-10-31T00:30:00Z",
        "2027-11-01T01:30:00Z",
    ]
    assert lines(
        preview(
            "--cron",
            "0 * * * *",
            "--timezone",
            "Europe/Berlin",
            "--after",
            "2027-10-30T23:30:00Z",
            "--count",
            "3",
        )
    ) == [
        "2027-10-31T00:00:00Z",
        "2027-10-31T01:00:00Z",
        "2027-10-31T02:00:00Z",
    ]


def test_seconds_first_cron_and_strictly_after() -> None:
    assert lines(
        preview("--cron", "*/20 * * * * *", "--after", "2027-01-01T00:00:00Z", "--count", "3")
    ) == [
        "2027-01-01T00:00:20Z",
        "2027-01-01T00:00:40Z",
        "2027-01-01T00:01:00Z",
    ]


def test_interval() -> None:
    assert lines(preview("--every-s", "90", "--after", "2027-01-01T00:00:00Z", "--count", "2")) == [
        "2027-01-01T00:01:30Z",
        "2027-01-01T00:03:00Z",
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cron", "0 25 * * *", "--after", "2027-01-01T00:00:00Z"], "hour: 25 is out of range"),
        (["--cron", "0 0 30 2 *", "--after", "2027-01-01T00:00:00Z"], "never fires"),
        (
            [
                "--cron",
                "* * * * *",
                "--timezone",
                "Nowhere/Land",
                "--after",
                "2027-01-01T00:00:00Z",
            ],
            "unknown time zone 'Nowhere/Land'",
        ),
        (["--cron", "* * * * *", "--after", "yesterday"], "--after"),
        (
            ["--cron", "* * * * *", "--every-s", "5", "--after", "2027-01-01T00:00:00Z"],
            "exactly one of --cron or --every-s",
        ),
        (["--every-s", "0", "--after", "2027-01-01T00:00:00Z"], "--every-s"),
        (["--cron", "* * * * *", "--after", "2027-01-01T00:00:00Z", "--count", "0"], "--count"),
    ],
)
def test_bad_input_exits_non_zero_naming_the_problem(args: list[str], message: str) -> None:
    result = preview(*args)
    assert result.returncode != 0
    assert message in result.stderr
    assert result.stdout == ""
