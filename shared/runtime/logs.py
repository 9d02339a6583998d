"""Structured logs: one JSON object per line, with the fields passed in ``extra``."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from shared.contract import codec, urls

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if hasattr(record, "service"):
            entry["service"] = record.service
        entry.update(_fields(record))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        # Any URL a line quotes (an error, a setting) loses its password, whatever it came from.
        return urls.masked(codec.dumps(entry).decode())


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return {
        key: value
        for key, value in vars(record).items()
        if key not in _STANDARD and not key.startswith("_") and key != "service"
    }


class TextFormatter(logging.Formatter):
    """A line a person reads: time, service, level, message, then the structured fields as
    ``key=value`` (an "occurrence dead" says which occurrence and why)."""

    def format(self, record: logging.LogRecord) -> str:
        # The message and a traceback may carry a tenant's text too: what a terminal would
        # act on is escaped there as well, keeping the traceback's line breaks.
        line = "".join(c if c == "\n" else _escaped(c) for c in super().format(record))
        fields = " ".join(f"{k}={_text(v)}" for k, v in _fields(record).items())
        return urls.masked(f"{line} {fields}" if fields else line)


def _text(value: Any) -> str:
    try:
        text = value if isinstance(value, str) else codec.dumps(value).decode()
    except TypeError:
        text = repr(value)
    # Quoted (JSON string escapes) when it would split the line or the field, or carries a
    # control character: a value a tenant sent may hold an escape sequence for the terminal.
    plain = text and text.isprintable() and not any(c in text for c in ' "=\\')
    return text if plain else "".join(map(_escaped, json.dumps(text, ensure_ascii=False)))


def _escaped(char: str) -> str:
    """A character JSON leaves as it is but a terminal would not show (format, unassigned)."""
    if char.isprintable():
        return char
    code = ord(char)
    if code < 0x10000:
        return f"\\u{code:04x}"
    code -= 0x10000
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def setup(level: str = "INFO", fmt: str = "json", service: str | None = None) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        prefix = f"{service} " if service else ""
        handler.setFormatter(TextFormatter(f"%(asctime)s {prefix}%(levelname)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("aiormq", "aio_pika", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    if service:
        old_factory = logging.getLogRecordFactory()

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = old_factory(*args, **kwargs)
            record.service = service
            return record

        logging.setLogRecordFactory(factory)
