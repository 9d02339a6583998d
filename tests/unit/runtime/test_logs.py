"""Text logs keep the structured fields a JSON line has (issue 27, point 6)."""

from __future__ import annotations

import logging

import pytest

from shared.runtime import logs


def test_a_text_line_carries_the_fields(capsys: pytest.CaptureFixture[str]) -> None:
    factory = logging.getLogRecordFactory()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        logs.setup("INFO", "text", service="executor")
        logging.getLogger("t").warning(
            "occurrence dead",
            extra={"schedule": "demo/flaky", "attempt": 3, "error": "HTTP 503 from target"},
        )
    finally:
        logging.setLogRecordFactory(factory)
        root.handlers[:] = handlers
        root.setLevel(level)
    err = capsys.readouterr().err
    (line,) = err.splitlines()
    assert " executor WARNING occurrence dead " in line
    assert line.endswith('schedule=demo/flaky attempt=3 error="HTTP 503 from target"')
