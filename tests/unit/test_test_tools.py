"""A missing browser skips its tests with the reason and the command, or fails them in CI
(issue 27, point 4)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import tools


def test_missing_programs_skip_with_the_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CRONBUS_TEST_REQUIRE_TOOLS", raising=False)
    with pytest.raises(pytest.skip.Exception) as skipped:
        tools.require("chromium", "chromedriver")
    assert "sudo apt-get install -y chromium chromium-driver" in str(skipped.value)
    monkeypatch.setenv("CRONBUS_TEST_REQUIRE_TOOLS", "1")
    with pytest.raises(pytest.fail.Exception):
        tools.require("tmux")
