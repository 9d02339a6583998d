"""The client is typed for its users' checkers too: PEP 561 markers in the packages the wheel
ships (hatch ships every file under them)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_the_client_packages_carry_py_typed_into_the_wheel() -> None:
    wheel = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]
    packages = wheel["targets"]["wheel"]["packages"]
    for package in ("cronbus", "shared"):
        assert package in packages
        assert (ROOT / package / "py.typed").is_file()
