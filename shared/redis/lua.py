"""The Lua scripts: read once from ``lua/``, loaded into Redis, called by SHA.

Each script is one file with a header naming its KEYS, ARGV and return codes. Code several
scripts share lives in ``lua/lib/``; a script takes it in by a line ``--!include lib/NAME.lua``,
which is replaced by that file's text as the script is read (Redis only ever sees, and the SHA
is of, the expanded script). Calls go by EVALSHA; when Redis answers NOSCRIPT (it restarted or
flushed its script cache) the script is loaded again and the call repeated.
"""

from __future__ import annotations

import enum
import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis import exceptions as redis_errors

from shared.contract.errors import LuaScriptError, StaleWriteError


class Code(enum.IntEnum):
    """Per-item results the scripts return."""

    OK = 1
    STALE_TOKEN = 0
    STALE_VERSION = -1


def raise_for_code(script: str, code: int) -> None:
    """Map a script's result code to a typed error (OK and STALE_TOKEN are not errors)."""
    if code == Code.STALE_VERSION:
        raise StaleWriteError(script, code)
    if code not in (Code.OK, Code.STALE_TOKEN):
        raise LuaScriptError(script, code)


def lua_dir() -> Path:
    """``shared/redis/lua`` inside an installed wheel, else ``lua/`` at the project's root."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "lua", here.parents[1] / "lua"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError("the lua/ directory of cronbus is missing")


@dataclass(frozen=True, slots=True)
class Script:
    name: str
    source: str
    sha: str
    #: How many KEYS the script's header declares.
    key_count: int


def _key_count(source: str) -> int:
    return sum(1 for line in source.splitlines() if line.strip().startswith("KEYS["))


INCLUDE = "--!include "


def expand(name: str, source: str, root: Path) -> str:
    """``source`` with each ``--!include lib/NAME.lua`` line replaced by that file's text.

    Refused (ValueError naming the script and the include): an include outside ``lib/`` or
    missing, one included twice, and a library that includes another (one level keeps what
    a script runs readable in one place) or declares KEYS (the header's KEYS lines are counted
    as the script's keys)."""
    out: list[str] = []
    seen: set[str] = set()
    for line in source.splitlines(keepends=True):
        if not line.startswith(INCLUDE):
            out.append(line)
            continue
        target = line[len(INCLUDE) :].strip()
        where = f"{name}.lua: --!include {target}"
        if not (target.startswith("lib/") and target.endswith(".lua")) or ".." in target:
            raise ValueError(f"{where}: an include names a file lib/NAME.lua")
        if target in seen:
            raise ValueError(f"{where}: included twice")
        path = root / target
        if not path.is_file():
            raise ValueError(f"{where}: no such file in {root.name}/lib")
        text = path.read_text()
        if any(lib_line.startswith(INCLUDE) for lib_line in text.splitlines()):
            raise ValueError(f"{where}: a library file may not include another")
        if _key_count(text):
            raise ValueError(f"{where}: a library file may not declare KEYS")
        seen.add(target)
        out.append(text if text.endswith("\n") else text + "\n")
    return "".join(out)


@functools.cache
def scripts() -> dict[str, Script]:
    found = {}
    root = lua_dir()
    for path in sorted(root.glob("*.lua")):
        name = path.stem
        source = expand(name, path.read_text(), root)
        sha = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()
        found[name] = Script(name, source, sha, _key_count(source))
    return found


async def load_all(client: Any) -> None:
    """SCRIPT LOAD every script (on every primary of a cluster)."""
    for script in scripts().values():
        await client.script_load(script.source)


async def call(client: Any, name: str, keys: tuple[str, ...] | list[str], args: list[Any]) -> Any:
    """Run a script by SHA, loading it first if Redis does not know it."""
    script = scripts()[name]
    try:
        return await client.evalsha(script.sha, len(keys), *keys, *args)
    except redis_errors.NoScriptError:
        await client.script_load(script.source)
        return await client.evalsha(script.sha, len(keys), *keys, *args)


def queue(pipe: Any, name: str, keys: tuple[str, ...] | list[str], args: list[Any]) -> None:
    """Add a script call to a pipeline (scripts must be loaded: see ``run_pipeline``)."""
    script = scripts()[name]
    pipe.evalsha(script.sha, len(keys), *keys, *args)


def is_noscript(result: Any) -> bool:
    return isinstance(result, redis_errors.NoScriptError)
