"""The documentation site builds in strict mode, and its API reference shows the client as its
docstrings describe it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cronbus import Client, SyncClient

ROOT = Path(__file__).resolve().parents[2]


def test_the_site_builds_strictly_with_the_client_reference(tmp_path: Path) -> None:
    site = tmp_path / "site"
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    page = (site / "client" / "index.html").read_text()
    for cls in (Client, SyncClient):
        public = [name for name in vars(cls) if not name.startswith("_")]
        assert public, cls
        missing = [name for name in public if f"{cls.__name__}.{name}" not in page]
        assert missing == [], f"{cls.__name__}: {missing} are not in the API reference"
    assert "NotFound" in page and "CommandRefused" in page
    configuration = (site / "configuration" / "index.html").read_text()
    assert "CRONBUS_SHARDS" in configuration  # the generated table made it into the site
