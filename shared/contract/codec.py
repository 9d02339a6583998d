"""JSON encoding with orjson, used for every message and stored value (pure)."""

from __future__ import annotations

from typing import Any

import orjson

#: Already encoded JSON, embedded as is by ``dumps``.
Fragment = orjson.Fragment

#: What ``loads`` raises on bad input (a ValueError subclass).
DecodeError = orjson.JSONDecodeError


def dumps(value: Any) -> bytes:
    return orjson.dumps(value)


def loads(data: bytes | str) -> Any:
    return orjson.loads(data)
