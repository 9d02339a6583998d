"""The npm projects of the repository (``examples/node``, ``tools/asyncapi``): ``scripts/npm.sh``
installs them with ``npm ci`` (once per lock file); a test that needs one checks it is there."""

from __future__ import annotations

from pathlib import Path

from tests.support import tools

ROOT = Path(__file__).resolve().parents[2]


def installed(project: str) -> Path:
    """The project's folder, once ``node`` is on the PATH and its lock file is installed; skips
    (or, in CI, fails) otherwise, saying how to install it."""
    tools.require("node")
    folder = ROOT / project
    stamp = folder / "node_modules" / ".package-lock.json"
    lock = folder / "package-lock.json"
    if not stamp.exists() or stamp.stat().st_mtime < lock.stat().st_mtime:
        tools.skip_or_fail(f"{project} is not installed: run `bash scripts/npm.sh`")
    return folder
