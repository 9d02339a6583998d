"""README stays true: every setting, metric and pinned header it must document is there."""

from __future__ import annotations

import re
from pathlib import Path

import prometheus_client

from shared.runtime import metrics
from shared.runtime.config import (
    CommonSettings,
    ConsoleSettings,
    DispatcherSettings,
    ExecutorSettings,
    SweeperSettings,
)

README = (Path(__file__).resolve().parents[3] / "README.md").read_text()


def test_every_setting_is_documented_and_nothing_else() -> None:
    fields = set()
    for cls in (
        CommonSettings,
        DispatcherSettings,
        ExecutorSettings,
        SweeperSettings,
        ConsoleSettings,
    ):
        fields |= {f"CRONBUS_{name.upper()}" for name in cls.model_fields}
    documented = set(re.findall(r"`(CRONBUS_[A-Z_]+)`", README))
    cli_only = {"CRONBUS_NAMESPACE"}
    assert fields - documented == set()
    assert documented - fields - cli_only == set()


def test_every_metric_is_documented() -> None:
    names = set()
    for value in vars(metrics).values():
        if isinstance(value, prometheus_client.metrics.MetricWrapperBase):
            name = value._name
            if isinstance(value, prometheus_client.Counter):
                name += "_total"
            names.add(name)
    documented = set(re.findall(r"`(cronbus_[a-z_]+)`", README))
    assert names - documented == set()
    assert documented - names == set()


def test_the_two_set_up_commands_exist() -> None:
    root = Path(__file__).resolve().parents[3]
    for command in ("./scripts/dev", "./scripts/test"):
        assert command in README
        assert (root / command).stat().st_mode & 0o111
    assert "./scripts/test" in (root / ".ci" / "run").read_text()
