"""The Lua registry's includes: a ``--!include lib/NAME.lua`` line becomes that file's text,
and anything else an include could mean is refused when the scripts are read."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.redis import lua


def _tree(tmp_path: Path, libs: dict[str, str]) -> Path:
    (tmp_path / "lib").mkdir()
    for name, text in libs.items():
        (tmp_path / "lib" / name).write_text(text)
    return tmp_path


def test_an_include_line_becomes_the_library_text_exactly(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"a.lua": "local function a()\n  return 1\nend\n", "b.lua": "-- b"})
    source = (
        "local x = KEYS[1]\n--!include lib/a.lua\nlocal y = a()\n--!include lib/b.lua\nreturn y\n"
    )
    assert lua.expand("s", source, root) == (
        "local x = KEYS[1]\nlocal function a()\n  return 1\nend\nlocal y = a()\n-- b\nreturn y\n"
    )


def test_a_script_without_includes_is_unchanged(tmp_path: Path) -> None:
    source = "-- --!include lib/a.lua in a comment is no directive\n  --!include lib/a.lua\n"
    assert lua.expand("s", source, _tree(tmp_path, {})) == source


@pytest.mark.parametrize(
    ("directive", "libs", "reason"),
    [
        ("--!include lib/missing.lua", {}, "no such file"),
        ("--!include upsert.lua", {}, "lib/NAME.lua"),
        ("--!include lib/../upsert.lua", {}, "lib/NAME.lua"),
        ("--!include lib/a.lua\n--!include lib/a.lua", {"a.lua": "-- a\n"}, "included twice"),
        ("--!include lib/a.lua", {"a.lua": "--!include lib/b.lua\n", "b.lua": ""}, "another"),
        ("--!include lib/a.lua", {"a.lua": "  KEYS[1] due ZSET\n"}, "may not declare KEYS"),
    ],
)
def test_an_include_that_cannot_be_expanded_is_refused_naming_it(
    tmp_path: Path, directive: str, libs: dict[str, str], reason: str
) -> None:
    with pytest.raises(ValueError, match=reason) as refused:
        lua.expand("myscript", f"local x = 1\n{directive}\n", _tree(tmp_path, libs))
    assert "myscript.lua: --!include" in str(refused.value)


def test_the_shipped_scripts_are_read_expanded() -> None:
    scripts = lua.scripts()
    assert all("--!include" not in s.source for s in scripts.values())
    assert "local function free_revoked(occ, member, token)" in scripts["complete"].source
    assert "local function clock_ms(given)" in scripts["forget"].source
    # The libraries declare no KEYS: each script's count is its own header's.
    assert scripts["begin"].key_count == 2
    assert scripts["remove"].key_count == 7
    assert "local function requeue(" in scripts["park"].source
    assert "lib" not in scripts
