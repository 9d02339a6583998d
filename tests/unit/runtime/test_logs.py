"""Text logs keep the structured fields a JSON line has (issue 27, point 6)."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.contract import codec
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


@given(st.text())
def test_a_field_value_never_splits_the_line_nor_reaches_the_terminal_raw(value: str) -> None:
    text = logs._text(value)
    assert text.isprintable()  # no newline, escape sequence or NUL
    assert text == value or codec.loads(text.encode()) == value  # quoted values read back
    if text == value:
        assert value and not any(c in value for c in ' "=\\')


@pytest.mark.parametrize("value", ["\x1b[2J", "a\x00b", "line\nbreak", "tab\there", "\u2028"])
def test_control_characters_are_quoted(value: str) -> None:
    assert logs._text(value).startswith('"')


def test_the_message_and_traceback_are_escaped_too(capsys: pytest.CaptureFixture[str]) -> None:
    factory = logging.getLogRecordFactory()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        logs.setup("INFO", "text", service="dispatcher")
        try:
            raise ValueError("tenant sent \x1b[2J")
        except ValueError:
            logging.getLogger("t").exception("command failed \x07")
    finally:
        logging.setLogRecordFactory(factory)
        root.handlers[:] = handlers
        root.setLevel(level)
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err
    assert "\\u001b[2J" in err and "Traceback" in err
