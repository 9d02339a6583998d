"""The documentation stays true: its reference tables are the code's (settings, metrics), every
setting, metric and alert it must document is there and nothing that does not exist, and the
README is the short page it promises to be."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

from cronbus import reference

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DOCS = {path.name: path.read_text() for path in sorted((ROOT / "docs").glob("*.md"))}
EVERYTHING = README + "".join(DOCS.values())


def test_the_generated_tables_agree_with_the_code() -> None:
    stale = [str(path.relative_to(ROOT)) for path in reference.stale_pages()]
    assert stale == [], f"{stale}: run python -m cronbus.reference"


def test_every_setting_is_documented_and_nothing_else() -> None:
    settings = reference.settings_names()
    in_the_reference = set(re.findall(r"`(CRONBUS_[A-Z_]+)`", DOCS["configuration.md"]))
    assert settings - in_the_reference == set()
    mentioned = set(re.findall(r"`(CRONBUS_[A-Z_]+)`", EVERYTHING))
    cli_only = {"CRONBUS_NAMESPACE"}
    assert mentioned - settings - cli_only == set()


def test_every_setting_says_what_it_means() -> None:
    for cls, _ in reference.SETTINGS_SECTIONS:
        comments = reference.field_comments(cls)
        listed = [name for name in comments if not reference._inherited(cls, name)]
        assert [name for name in listed if not comments[name]] == [], cls.__name__


def test_every_metric_is_documented_and_nothing_else() -> None:
    names = {reference.metric_name(metric) for metric in reference.declared_metrics()}
    assert names - set(re.findall(r"`(cronbus_[a-z_]+)`", DOCS["metrics.md"])) == set()
    assert set(re.findall(r"`(cronbus_[a-z_]+)`", EVERYTHING)) - names == set()


def test_every_alert_has_a_line_saying_what_to_do() -> None:
    rules = yaml.safe_load(
        (ROOT / "deploy/k8s/overlays/production/prometheusrule.yaml").read_text()
    )
    alerts = {rule["alert"] for group in rules["spec"]["groups"] for rule in group["rules"]}
    section = DOCS["metrics.md"].split("## Alerts and what to do", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| (Cronbus\w+) \| \w+ \| (.+) \|$", section, re.MULTILINE))
    assert set(rows) == alerts
    assert all(len(text) > 20 for text in rows.values())


def test_the_readme_is_a_short_page_with_the_two_commands() -> None:
    assert len(README.splitlines()) <= 300
    for command in ("./scripts/dev", "./scripts/test"):
        assert command in README
        assert (ROOT / command).stat().st_mode & 0o111
    assert "./scripts/test" in (ROOT / ".ci" / "run").read_text()


def test_the_readmes_links_lead_somewhere() -> None:
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target


def test_every_page_is_in_the_sites_navigation() -> None:
    config = (ROOT / "mkdocs.yml").read_text()
    assert {name for name in DOCS} == set(re.findall(r": ([a-z-]+\.md)$", config, re.MULTILINE))


def test_no_page_tells_a_reader_to_install_into_whatever_python_is_first_on_the_path() -> None:
    # `pip install -e '.[docs]' && mkdocs serve` installed into the global Python unless .venv
    # was active; ./scripts/docs runs from the checkout's own .venv.
    pages = {"README.md": README, "DEVELOPERS.md": (ROOT / "DEVELOPERS.md").read_text(), **DOCS}
    told = [
        name
        for name, text in pages.items()
        if re.search(r"^\s*mkdocs (serve|build)", text, re.M) or "pip install -e '.[docs]'" in text
    ]
    assert told == []
    assert "./scripts/docs" in README
    script = ROOT / "scripts" / "docs"
    assert script.stat().st_mode & 0o111, "scripts/docs is not executable"
    assert 'source "$(dirname "$0")/bootstrap.sh"' in script.read_text()


def test_a_newcomer_is_told_how_to_give_dev_its_own_redis_database_or_prefix() -> None:
    exe = Path(sys.executable).parent / "cronbus"
    dev_help = subprocess.run(
        [str(exe), "dev", "--help"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    for name, text in (
        ("README.md", README),
        ("getting-started.md", DOCS["getting-started.md"]),
        ("cronbus dev --help", " ".join(dev_help.split())),
    ):
        assert "CRONBUS_REDIS_URL=redis://127.0.0.1:6379/1" in text, name
        assert "CRONBUS_REDIS_PREFIX=mine" in text, name
