"""``cronbus top``'s arithmetic: rates and lateness over the last interval, backlog per shard."""

from __future__ import annotations

import dataclasses

import pytest
from rich.console import Console

from cronbus.cli import top

DISPATCHER = """
# TYPE cronbus_published_total counter
cronbus_published_total {published}
# TYPE cronbus_due_backlog gauge
cronbus_due_backlog{{shard="0"}} 3
cronbus_due_backlog{{shard="1"}} {backlog}
# TYPE cronbus_deliveries_ready gauge
cronbus_deliveries_ready 7
"""

EXECUTOR = """
# TYPE cronbus_delivered_total counter
cronbus_delivered_total{{target="webhook",outcome="succeeded"}} {ok}
cronbus_delivered_total{{target="webhook",outcome="failed"}} {failed}
cronbus_delivered_total{{target="webhook",outcome="dead"}} 1
# TYPE cronbus_dead_total counter
cronbus_dead_total 1
# TYPE cronbus_deliveries_in_flight gauge
cronbus_deliveries_in_flight 4
# TYPE cronbus_fire_lateness_seconds histogram
cronbus_fire_lateness_seconds_bucket{{le="0.01"}} {fast}
cronbus_fire_lateness_seconds_bucket{{le="0.1"}} {mid}
cronbus_fire_lateness_seconds_bucket{{le="+Inf"}} {mid}
cronbus_fire_lateness_seconds_count {mid}
cronbus_fire_lateness_seconds_sum 1
"""


def _sample(at_s: float, **values: float) -> top.Sample:
    sample = top.Sample(at_s=at_s)
    sample.add(DISPATCHER.format(**values))
    sample.add(EXECUTOR.format(**values))
    return sample


def test_rates_and_quantiles_describe_the_last_interval() -> None:
    first = _sample(10, published=100, backlog=0, ok=90, failed=5, fast=90, mid=100)
    second = _sample(12, published=300, backlog=9, ok=280, failed=9, fast=90, mid=300)
    view = top.summarize(second, first)
    assert view.fires_per_s == 100
    assert view.delivered_per_s == (280 + 9 - 90 - 5) / 2
    assert view.failures_per_s == 2
    # In the interval every one of the 200 new observations was above 10 ms.
    assert view.lateness_p50_s == 0.1
    assert view.lateness_p99_s == 0.1
    assert view.backlog == {0: 3, 1: 9}
    assert (view.in_flight, view.deliveries_ready) == (4, 7)
    assert (view.failures_total, view.dead_total) == (10, 1)


def test_the_first_scrape_shows_no_rates_and_whole_uptime_quantiles() -> None:
    view = top.summarize(_sample(1, published=5, backlog=0, ok=5, failed=0, fast=9, mid=10), None)
    assert view.fires_per_s is None
    assert view.lateness_p50_s == 0.01
    assert view.lateness_p99_s == 0.1


def test_a_restarted_service_never_makes_a_negative_rate() -> None:
    first = _sample(1, published=500, backlog=0, ok=5, failed=0, fast=1, mid=1)
    second = _sample(2, published=10, backlog=0, ok=5, failed=0, fast=1, mid=1)
    assert top.summarize(second, first).fires_per_s == 0


def test_endpoints_default_to_the_local_services() -> None:
    assert top.endpoints(None, None) == [
        "http://127.0.0.1:9101/metrics",
        "http://127.0.0.1:9102/metrics",
        "http://127.0.0.1:9103/metrics",
    ]
    assert top.endpoints(["http://a:1/metrics"], [9]) == [
        "http://a:1/metrics",
        "http://127.0.0.1:9/metrics",
    ]


def _namespaces(scale: int) -> str:
    names = ["billing", "acme", "demo", "ops", "reports", "search", "mail"]
    return "# TYPE cronbus_namespace_outcomes_total counter\n" + "\n".join(
        f'cronbus_namespace_outcomes_total{{namespace="{ns}",outcome="{outcome}"}} {count}'
        for i, ns in enumerate(names)
        for outcome, count in (("succeeded", scale * 100 * i), ("failed", scale * i), ("dead", 0))
    )


def _wide_sample(at_s: float, scale: int) -> top.Sample:
    sample = _sample(at_s, published=10 * scale, backlog=4, ok=scale, failed=1, fast=1, mid=2)
    sample.add("\n".join(f'cronbus_due_backlog{{shard="{s}"}} {s * 1000}' for s in range(16)))
    sample.add(_namespaces(scale))
    return sample


def test_the_screen_fits_80_by_24_with_16_shards_and_shows_namespaces() -> None:
    view = top.summarize(_wide_sample(12, 2), _wide_sample(10, 1))
    assert [ns for ns, *_ in view.namespaces][:2] == ["mail", "search"]
    console = Console(width=80, height=24, record=True, color_system=None)
    console.print(top.render(view, ["a", "b", "c"], 2))
    lines = console.export_text().rstrip("\n").splitlines()
    assert len(lines) <= 24, "\n".join(lines)
    assert all(len(line) <= 80 for line in lines)
    screen = "\n".join(lines)
    assert "billing" not in screen and "… 2 more" in screen  # the two quietest, counted
    assert " 15:" in screen  # the last shard is on screen
    assert "+Inf" not in screen


@pytest.mark.parametrize("shards", [19, 32, 256])
def test_the_screen_fits_80_by_24_at_any_shard_count(shards: int) -> None:
    sample = _sample(12, published=20, backlog=4, ok=2, failed=1, fast=1, mid=2)
    # Shard 7 holds the most: it is on screen whatever the count.
    sample.add(
        "\n".join(
            f'cronbus_due_backlog{{shard="{s}"}} {99_999 if s == 7 else s}' for s in range(shards)
        )
    )
    sample.add(_namespaces(2))
    view = top.summarize(sample, _wide_sample(10, 1))
    console = Console(width=80, height=24, record=True, color_system=None)
    console.print(top.render(view, ["a", "b", "c"], 2))
    lines = console.export_text().rstrip("\n").splitlines()
    assert len(lines) <= 24, "\n".join(lines)
    assert all(len(line) <= 80 for line in lines)
    screen = "\n".join(lines)
    assert "  7: 99,999" in screen
    assert f"… {shards - 12} more shards" in screen


def test_huge_backlogs_and_many_silent_endpoints_still_fit_80_by_24() -> None:
    sample = _sample(12, published=20, backlog=4, ok=2, failed=1, fast=1, mid=2)
    sample.add(
        "\n".join(
            f'cronbus_due_backlog{{shard="{s}"}} {1_234_567_890 * (s + 1)}' for s in range(32)
        )
    )
    sample.add(_namespaces(2))
    view = top.summarize(sample, _wide_sample(10, 1))
    sources = [f"http://127.0.0.1:{9000 + i}/metrics" for i in range(40)]
    view = dataclasses.replace(view, missed=tuple(sources))
    console = Console(width=80, height=24, record=True, color_system=None)
    console.print(top.render(view, sources, 2))
    lines = console.export_text().rstrip("\n").splitlines()
    assert len(lines) <= 24, "\n".join(lines)
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    screen = "\n".join(lines)
    assert "39.5G" in screen  # shard 31's 39,506,172,480, compact
    assert "more" in lines[-1]
