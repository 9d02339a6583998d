"""The documentation's reference tables, written from the code they describe: the settings from
the settings classes (``shared/runtime/config.py``, each field's ``#:`` comment is its meaning),
the metrics from their declarations (``shared/runtime/metrics.py``).

The tables live in the pages between ``<!-- generated: NAME -->`` and ``<!-- end generated -->``.
``python -m cronbus.reference`` rewrites them; ``--check`` exits 1 when a page disagrees with the
code (a test does the same), and the site's build hook renders them from the code as well.
It writes ``docs/asyncapi.yaml`` from the contract's models the same way (``cronbus.asyncapi``).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import prometheus_client
from pydantic_settings import BaseSettings

from cronbus import asyncapi
from shared.runtime import config, metrics

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
REGION = re.compile(
    r"(<!-- generated: (?P<name>[a-z-]+) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.DOTALL
)
PREFIX = "CRONBUS_"

#: Who reads which settings class, in the order the page lists them. A class's own fields are
#: listed under it; fields it inherits, under the class that declares them.
SETTINGS_SECTIONS: tuple[tuple[type[BaseSettings], str], ...] = (
    (config.CommonSettings, "Every service (and the CLI) reads"),
    (config.DispatcherSettings, "The dispatcher also reads"),
    (config.ExecutorSettings, "The executor also reads"),
    (
        config.WebhookPolicySettings,
        "The dispatcher and the executor both read where webhooks may go (checked at upsert "
        "for literal addresses and host names, and again at every delivery for every address "
        "the host resolves to; see [Security](security.md))",
    ),
    (config.SweeperSettings, "The sweeper also reads"),
    (config.ConsoleSettings, "The console also reads"),
)
#: The services whose settings class overrides a common default (their metrics ports).
SERVICES: tuple[tuple[str, type[BaseSettings]], ...] = (
    ("dispatcher", config.DispatcherSettings),
    ("executor", config.ExecutorSettings),
    ("sweeper", config.SweeperSettings),
    ("console", config.ConsoleSettings),
)


def field_comments(cls: type) -> dict[str, str]:
    """Each annotated field of ``cls`` (declared in its own body) -> its ``#:`` comment."""
    source = textwrap.dedent(inspect.getsource(cls))
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    found: dict[str, str] = {}
    lines = source.splitlines()
    for node in body.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            comment: list[str] = []
            above = node.lineno - 2
            while above >= 0 and lines[above].strip().startswith("#:"):
                comment.insert(0, lines[above].strip().removeprefix("#:").strip())
                above -= 1
            found[node.target.id] = " ".join(comment)
    return found


def _default(value: object) -> str:
    if value == "":
        return "empty"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def _default_of(cls: type[BaseSettings], name: str) -> str:
    overridden = [
        (service, settings.model_fields[name].default)
        for service, settings in SERVICES
        if settings is not cls
        and issubclass(settings, cls)
        and name in vars(settings).get("__annotations__", {})
    ]
    if overridden:
        return ", ".join(f"{service} {_default(value)}" for service, value in overridden)
    return _default(cls.model_fields[name].default)


def settings_tables() -> str:
    parts: list[str] = []
    for cls, heading in SETTINGS_SECTIONS:
        comments = field_comments(cls)
        own = [name for name in comments if not _inherited(cls, name)]
        if not own:
            continue
        parts += [f"{heading}:", "", "| variable | default | meaning |", "| --- | --- | --- |"]
        for name in own:
            parts.append(
                f"| `{PREFIX}{name.upper()}` | {_default_of(cls, name)} "
                f"| {_escape(comments[name])} |"
            )
        parts.append("")
    return "\n".join(parts)


def _inherited(cls: type[BaseSettings], name: str) -> bool:
    """Declared by a parent settings class too (an override of its default, not a setting)."""
    return any(name in getattr(base, "model_fields", {}) for base in cls.__mro__[1:])


def settings_names() -> set[str]:
    """Every setting a service reads."""
    return {PREFIX + name.upper() for cls, _ in SETTINGS_SECTIONS for name in cls.model_fields}


def declared_metrics() -> Iterator[prometheus_client.metrics.MetricWrapperBase]:
    """Every metric, in the order ``metrics.py`` declares them."""
    for node in ast.parse(inspect.getsource(metrics)).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            value = getattr(metrics, node.targets[0].id)
            if isinstance(value, prometheus_client.metrics.MetricWrapperBase):
                yield value


def metric_name(metric: prometheus_client.metrics.MetricWrapperBase) -> str:
    """The name as exported (a counter's ``_total`` included)."""
    name: str = metric._name
    return name + "_total" if isinstance(metric, prometheus_client.Counter) else name


def metrics_table() -> str:
    rows = ["| metric | type | labels | exported by | meaning |", "| --- | --- | --- | --- | --- |"]
    for metric in declared_metrics():
        # A metric no service claims is never unregistered: every service exports it.
        owners = [service for service, owned in metrics.OWNERS.items() if metric in owned] or [
            "every service"
        ]
        labels = ", ".join(f"`{label}`" for label in metric._labelnames)
        rows.append(
            f"| `{metric_name(metric)}` | {metric._type} | {labels} | {', '.join(owners)} "
            f"| {_escape(metric._documentation)} |"
        )
    return "\n".join(rows) + "\n"


GENERATORS: dict[str, Callable[[], str]] = {
    "settings": settings_tables,
    "metrics": metrics_table,
}


def render(markdown: str) -> str:
    """The page with every generated region written from the code."""

    def fill(match: re.Match[str]) -> str:
        body = GENERATORS[match["name"]]()
        return f"{match[1]}\n{body}\n{match[4]}"

    return REGION.sub(fill, markdown)


ASYNCAPI = DOCS / "asyncapi.yaml"


def stale_pages() -> list[Path]:
    stale = [path for path in sorted(DOCS.glob("*.md")) if render(text := path.read_text()) != text]
    if not ASYNCAPI.exists() or ASYNCAPI.read_text() != asyncapi.render():
        stale.append(ASYNCAPI)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cronbus.reference", description=__doc__)
    parser.add_argument("--check", action="store_true", help="only say which pages are stale")
    args = parser.parse_args(argv)
    stale = stale_pages()
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} disagrees with the code: run {parser.prog}")
        return 1 if stale else 0
    for path in stale:
        path.write_text(asyncapi.render() if path == ASYNCAPI else render(path.read_text()))
        print(f"rewrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
