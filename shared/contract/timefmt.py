"""RFC 3339 instants <-> Unix epoch milliseconds (pure)."""

from __future__ import annotations

import functools
import re
from datetime import UTC, datetime, timedelta

_RFC3339 = re.compile(
    r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d{1,9})?([Zz]|[+-]\d{2}:\d{2})$"
)
_FRACTION = re.compile(r"\.(\d+)")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: The range of instants cronbus works with: the Unix epoch to the end of year 9999 UTC.
MIN_MS = 0
MAX_MS = 253_402_300_799_999


def parse_rfc3339_ms(text: str) -> int:
    """``2027-01-01T09:00:00Z`` (any offset, optional fraction) -> epoch ms.

    Raises ValueError with a reason a user can act on.
    """
    if not _RFC3339.match(text):
        raise ValueError(f"{text!r} is not an RFC 3339 time with a zone, like 2027-01-01T09:00:00Z")
    normalised = text[:-1] + "+00:00" if text[-1] in "Zz" else text
    fraction = _FRACTION.search(normalised)
    if fraction and len(fraction.group(1)) > 6:
        normalised = normalised.replace(fraction.group(0), fraction.group(0)[:7])
    try:
        value = datetime.fromisoformat(normalised.replace("t", "T"))
        return datetime_to_ms(value)
    except ValueError as exc:
        raise ValueError(f"{text!r} is not a valid date and time ({exc})") from None
    except OverflowError:
        # Year 1 or 9999 with an offset: the UTC instant falls outside what datetime holds.
        raise ValueError(f"{text!r} is outside the years 1970-9999 UTC") from None


def datetime_to_ms(value: datetime) -> int:
    delta = value.astimezone(UTC) - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1000 + delta.microseconds // 1000


def ms_to_datetime(ms: int) -> datetime:
    return _EPOCH + timedelta(milliseconds=ms)


def format_ms(ms: int) -> str:
    """Epoch ms -> ``2027-01-04T08:00:00Z`` (milliseconds shown only when not zero)."""
    text = _format_second(ms // 1000)
    if ms % 1000:
        return f"{text}.{ms % 1000:03d}Z"
    return text + "Z"


@functools.lru_cache(maxsize=4096)
def _format_second(second: int) -> str:
    # Every delivery formats its fire time, and fire times cluster: format each second once.
    return ms_to_datetime(second * 1000).strftime("%Y-%m-%dT%H:%M:%S")
