"""Structured logs: one JSON object per line, with the fields passed in ``extra``."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from shared.contract import codec

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
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return codec.dumps(entry).decode()


def setup(level: str = "INFO", fmt: str = "json", service: str | None = None) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        prefix = f"{service} " if service else ""
        handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(message)s"))
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
