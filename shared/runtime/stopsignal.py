"""SIGTERM (or SIGINT) noted from the first line of a service's start to its last.

Until the event loop installs its own handler, and again once the loop is closed, the
default disposition would end the process with status -15 and nothing logged: a pod deleted
while its service imports its libraries, or a service that exits by itself just as it is
asked to stop. This module imports nothing heavy so that ``services/<name>/__main__.py`` can
install the handler before anything else; the run loop asks whether a signal came meanwhile.
"""

from __future__ import annotations

import atexit
import signal
from types import FrameType

#: The signals that ask a service to stop.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

_received: list[int] = []


def _note(signum: int, _frame: FrameType | None) -> None:
    _received.append(signum)


def catch() -> None:
    """Note stop signals instead of dying of them (until the loop installs its handler, and
    from when it gives them back until the process ends)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _note)
    atexit.unregister(_ignore)  # registered once, whatever the number of calls
    atexit.register(_ignore)


def _ignore() -> None:
    """At exit, once the status is decided: the interpreter gives signals handled in Python
    back their default as it winds down, ignored ones stay ignored."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def received() -> bool:
    """Whether a stop signal came while only ``catch``'s handler was installed."""
    return bool(_received)
