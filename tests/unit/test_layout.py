"""The layout keeps its promises (CONTRIBUTING.md): pure packages do no I/O, nothing climbs back
up the layers, no import circles, no module past 600 lines. Read from the sources with ``ast``."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("shared", "services", "cronbus")
PURE = ("shared.contract", "shared.rules", "shared.policy")
#: Libraries that talk to the network, a disk or another process: never in a pure package.
IO_LIBRARIES = (
    "redis",
    "hiredis",
    "aio_pika",
    "aiormq",
    "asyncpg",
    "aiohttp",
    "httptools",
    "socket",
    "subprocess",
    "asyncio",
    "os",
    "pathlib",
    "prometheus_client",
    "logging",
)
MAX_LINES = 600


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[module_name(path)] = path
    return found


MODULES = project_modules()


def imported(path: Path) -> Iterator[str]:
    """Every module an import statement names, anywhere in the file (lazy imports included)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                if candidate in MODULES:
                    yield candidate


def project_imports(name: str) -> set[str]:
    """The project modules that ``name`` imports (a package's ``__init__`` stands for it)."""
    return {target for target in imported(MODULES[name]) if target in MODULES and target != name}


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_layout_finds_the_modules_it_judges() -> None:
    assert "shared.rules.cron" in MODULES
    assert "services.dispatcher.service" in MODULES
    assert "shared.rules.schedule" in project_imports("shared.contract.delivery")


@pytest.mark.parametrize("name", [m for m in MODULES if within(m, PURE)])
def test_a_pure_module_does_no_io(name: str) -> None:
    offending = sorted(
        target
        for target in imported(MODULES[name])
        if within(target, IO_LIBRARIES)
        or (within(target, ("shared",)) and not within(target, PURE))
    )
    assert offending == [], f"{name} is in a pure package but imports {offending}"


@pytest.mark.parametrize("name", [m for m in MODULES if within(m, ("shared",))])
def test_shared_never_imports_the_services_or_the_command_line(name: str) -> None:
    assert not [t for t in imported(MODULES[name]) if within(t, ("services", "cronbus"))]


@pytest.mark.parametrize("name", [m for m in MODULES if within(m, ("services",))])
def test_services_use_the_client_but_never_the_command_line(name: str) -> None:
    climbing = [
        t for t in imported(MODULES[name]) if within(t, ("cronbus",)) and t != "cronbus.client"
    ]
    assert climbing == [], f"{name} imports {climbing}: services may use only cronbus.client"


def test_the_client_stands_on_shared_alone() -> None:
    # cronbus.forms is the client's own pure half (forms, validation, upsert_many's chunks).
    assert {t for t in project_imports("cronbus.client") if not within(t, ("shared",))} == {
        "cronbus.forms"
    }
    assert {t for t in project_imports("cronbus.forms") if not within(t, ("shared",))} == set()


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the import graph, or None (depth-first search, colours white/grey/black)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_a_circle_of_three() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def loaded_by_import(name: str) -> set[str]:
    """What importing ``name`` runs of the project: each module it imports and every package
    above that module (their ``__init__`` runs first), less the packages above ``name`` itself."""
    loaded: set[str] = set()
    for target in imported(MODULES[name]):
        parts = target.split(".")
        for end in range(1, len(parts) + 1):
            candidate = ".".join(parts[:end])
            if candidate in MODULES and candidate != name and not name.startswith(candidate + "."):
                loaded.add(candidate)
    return loaded


def test_no_import_circles() -> None:
    assert find_cycle({name: loaded_by_import(name) for name in MODULES}) is None


#: Imports each named module with none of the project's modules loaded before it, in one
#: process (the libraries stay loaded: only the project's own import order matters here).
IMPORT_EACH_ALONE = """
import importlib, sys
from prometheus_client import REGISTRY
own = tuple(sys.argv[1].split(","))
for name in sys.argv[2:]:
    for loaded in [m for m in sys.modules if m.split(".")[0] in own]:
        del sys.modules[loaded]
    for collector in list(REGISTRY._collector_to_names):  # metrics are declared again
        REGISTRY.unregister(collector)
    try:
        importlib.import_module(name)
    except ImportError as exc:
        print(f"{name}: {exc}")
"""


# Every module imported in a fresh state, one after another: about 40 s on a quiet machine.
@pytest.mark.timeout(400)
def test_every_module_imports_on_its_own() -> None:
    """A circle through a package's ``__init__`` shows only when that module is imported first."""
    names = sorted(m for m in MODULES if not m.endswith("__main__"))
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH_ALONE, ",".join(PACKAGES), *names],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout == ""


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_is_too_long_to_hold_in_mind(name: str) -> None:
    lines = MODULES[name].read_text().count("\n")
    assert lines <= MAX_LINES, f"{name} has {lines} lines (at most {MAX_LINES})"
