"""Programs some end-to-end tests drive (chromium, chromedriver, tmux): ``scripts/tools.sh``
installs them where it can; where they are still missing, those tests skip, saying why and
with the command that installs them, unless CI requires them (``CRONBUS_TEST_REQUIRE_TOOLS``,
set by ``.ci/run``), where a missing one is a failure."""

from __future__ import annotations

import os
import shutil

import pytest

#: The Debian package that holds each program.
PACKAGES = {
    "chromium": "chromium",
    "chromedriver": "chromium-driver",
    "tmux": "tmux",
    "node": "nodejs npm",
}


def missing(*programs: str) -> list[str]:
    return [name for name in programs if shutil.which(name) is None]


def require(*programs: str) -> None:
    """Skip (or, in CI, fail) the test when one of ``programs`` is not installed."""
    absent = missing(*programs)
    if not absent:
        return
    packages = " ".join(dict.fromkeys(PACKAGES.get(name, name) for name in absent))
    reason = (
        f"{', '.join(absent)} not installed: install with "
        f"`sudo apt-get install -y {packages}` (or run ./.ci/run, which does)"
    )
    skip_or_fail(reason)


def skip_or_fail(reason: str) -> None:
    if os.environ.get("CRONBUS_TEST_REQUIRE_TOOLS") == "1":
        pytest.fail(reason)
    pytest.skip(reason)
