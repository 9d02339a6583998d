"""``cronbus top``: a live terminal view of running services, read from their /metrics.

Each refresh scrapes every given metrics endpoint; rates and lateness quantiles come from the
difference between two scrapes, so they describe the last interval, not the whole uptime.
The arithmetic (``Sample``, ``summarize``) is pure and unit-tested; only ``run`` does I/O.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

#: The local services' metrics ports (dispatcher, executor, sweeper, console), as `cronbus dev`.
DEFAULT_PORTS = (9101, 9102, 9103)
FAILED_OUTCOMES = ("failed", "dead")
#: The namespace outcomes ``top`` shows, in its columns' order.
OUTCOMES = ("succeeded", "failed", "dead")
#: Namespaces shown (the busiest); the rest are counted in one line. With the shard grid this
#: keeps the whole screen within 80x24.
NAMESPACE_ROWS = 5
#: Shards per line of the backlog grid.
SHARDS_PER_LINE = 6
#: Lines the backlog grid takes at most (the screen stays within 80x24 at any shard count).
BACKLOG_LINES = 3

Labels = tuple[tuple[str, str], ...]


@dataclass
class Sample:
    """Every series of one scrape of all endpoints: (name, labels) -> values, one per source."""

    at_s: float
    series: dict[tuple[str, Labels], list[float]] = field(default_factory=dict)
    reached: int = 0
    missed: list[str] = field(default_factory=list)

    def add(self, text: str) -> None:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                self.series.setdefault(key, []).append(float(s.value))
        self.reached += 1

    def total(self, name: str, **match: str) -> float:
        """Sum over sources and over the series whose labels include ``match``."""
        return sum(
            sum(values)
            for (found, labels), values in self.series.items()
            if found == name and set(match.items()) <= set(labels)
        )

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """The highest value per label value (several dispatchers report the same shard)."""
        out: dict[str, float] = {}
        for (found, labels), values in self.series.items():
            if found != name:
                continue
            key = dict(labels).get(label)
            if key is not None:
                out[key] = max(out.get(key, -math.inf), *values)
        return out

    def values(self, name: str) -> list[float]:
        """Every value of a metric, from every source and series."""
        return [v for (found, _), values in self.series.items() if found == name for v in values]

    def buckets(self, name: str) -> list[tuple[float, float]]:
        """Cumulative histogram buckets (upper bound, count), summed over sources."""
        found: dict[float, float] = {}
        for (series, labels), values in self.series.items():
            if series == f"{name}_bucket":
                bound = float(dict(labels)["le"])
                found[bound] = found.get(bound, 0.0) + sum(values)
        return sorted(found.items())


@dataclass(frozen=True, slots=True)
class View:
    fires_per_s: float | None
    delivered_per_s: float | None
    failures_per_s: float | None
    lateness_p50_s: float | None
    lateness_p99_s: float | None
    backlog: dict[int, float]
    in_flight: float
    deliveries_ready: float
    failures_total: float
    dead_total: float
    dead_lettered_total: float
    reached: int
    missed: tuple[str, ...]
    #: Per namespace, busiest first: (namespace, succeeded/s, failed attempts/s, dead/s); the
    #: rates are None on the first scrape.
    namespaces: tuple[tuple[str, float | None, float | None, float | None], ...] = ()
    #: The lateness histogram's highest finite bound (what "above every bucket" exceeds).
    lateness_cap_s: float | None = None


def histogram_quantile(buckets: Sequence[tuple[float, float]], q: float) -> float | None:
    """The upper bound of the bucket holding the q-th observation (None without any)."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    wanted = q * buckets[-1][1]
    for bound, count in buckets:
        if count >= wanted:
            return bound
    return buckets[-1][0]


def _delta_buckets(
    now: Sequence[tuple[float, float]], before: Sequence[tuple[float, float]]
) -> list[tuple[float, float]]:
    earlier = dict(before)
    return [(bound, max(count - earlier.get(bound, 0.0), 0.0)) for bound, count in now]


def _rate(now: Sample, before: Sample | None, name: str, **match: str) -> float | None:
    if before is None or now.at_s <= before.at_s:
        return None
    # A restarted service starts its counters at 0 again: never show a negative rate.
    return max(now.total(name, **match) - before.total(name, **match), 0.0) / (
        now.at_s - before.at_s
    )


def _per_namespace(
    now: Sample, before: Sample | None
) -> tuple[tuple[str, float | None, float | None, float | None], ...]:
    name = "cronbus_namespace_outcomes_total"
    found: dict[str, dict[str, float]] = {}
    for (series, labels), values in now.series.items():
        if series == name:
            tags = dict(labels)
            namespace, outcome = tags.get("namespace", "?"), tags.get("outcome", "?")
            found.setdefault(namespace, {})[outcome] = sum(values)
    rows: list[tuple[str, float | None, float | None, float | None]] = []
    for namespace in found:
        ok, failed, dead = (
            _rate(now, before, name, namespace=namespace, outcome=o) for o in OUTCOMES
        )
        rows.append((namespace, ok, failed, dead))

    def busiest(row: tuple[str, float | None, float | None, float | None]) -> tuple[Any, ...]:
        # By rate, else by the counts so far, then by name.
        namespace, *rates = row
        return (-sum(v or 0.0 for v in rates), -sum(found[namespace].values()), namespace)

    return tuple(sorted(rows, key=busiest))


def _failures(sample: Sample) -> float:
    return sum(sample.total("cronbus_delivered_total", outcome=o) for o in FAILED_OUTCOMES)


def summarize(now: Sample, before: Sample | None) -> View:
    """What the screen shows, from this scrape and the one before it."""
    lateness = now.buckets("cronbus_fire_lateness_seconds")
    if before is not None:
        window = _delta_buckets(lateness, before.buckets("cronbus_fire_lateness_seconds"))
        if window and window[-1][1] > 0:
            lateness = window
    failures_rate = None
    if before is not None and now.at_s > before.at_s:
        failures_rate = max(_failures(now) - _failures(before), 0.0) / (now.at_s - before.at_s)
    backlog = {
        int(shard): value
        for shard, value in now.by_label("cronbus_due_backlog", "shard").items()
        if shard.isdigit()
    }
    return View(
        fires_per_s=_rate(now, before, "cronbus_published_total"),
        delivered_per_s=_rate(now, before, "cronbus_delivered_total"),
        failures_per_s=failures_rate,
        lateness_p50_s=histogram_quantile(lateness, 0.5),
        lateness_p99_s=histogram_quantile(lateness, 0.99),
        backlog=dict(sorted(backlog.items())),
        in_flight=now.total("cronbus_deliveries_in_flight"),
        deliveries_ready=max(now.values("cronbus_deliveries_ready"), default=0.0),
        failures_total=_failures(now),
        dead_total=now.total("cronbus_dead_total"),
        dead_lettered_total=now.total("cronbus_dead_lettered_total"),
        reached=now.reached,
        missed=tuple(now.missed),
        namespaces=_per_namespace(now, before),
        lateness_cap_s=max((b for b, _ in lateness if not math.isinf(b)), default=None),
    )


# --- the screen -------------------------------------------------------------------------------


def _number(value: float | None, unit: str = "", digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}{unit}"


def _compact(value: float) -> str:
    """At most 7 characters: 999,999 as it is, then 1.2M, 3.4G (a grid cell keeps its width)."""
    if value < 1_000_000:
        return f"{value:,.0f}"
    for unit, size in (("M", 1e6), ("G", 1e9), ("T", 1e12)):
        if value < size * 1000:
            return f"{value / size:.1f}{unit}"
    return f"{value:.1e}"[:7]


def _one_line(head: str, names: Sequence[str], width: int = 78) -> str:
    """``head`` and as many names as fit ``width``, then how many more."""
    text = head
    for i, name in enumerate(names):
        rest = f" … {len(names) - i} more"
        piece = (", " if i else "") + name
        if (len(text) + len(piece) + len(rest) > width and i < len(names) - 1) or (
            len(text) + len(piece) > width
        ):
            return text + rest
        text += piece
    return text


def bound_text(value: float | None, cap: float | None = None) -> str:
    """A histogram quantile's bucket bound (seconds) as ``≤ 50 ms``; above the highest finite
    bound ``cap``, ``> 60,000 ms`` (never ``≤ +Inf``)."""
    if value is None:
        return "—"
    if math.isinf(value):
        return "—" if cap is None else f"> {cap * 1000:,.0f} ms"
    return f"≤ {value * 1000:,.0f} ms"


def _table(title: str, *columns: str) -> Table:
    table = Table(
        title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False
    )
    for column in columns:
        table.add_column(column, justify="right")
    return table


def render(view: View, sources: Sequence[str], interval_s: float) -> Group:
    """The screen: it fits 80x24 whatever the number of shards and namespaces."""
    head = Text.assemble(
        ("cronbus top", "bold"),
        f"  {time.strftime('%H:%M:%S')}  every {interval_s:g}s  ",
        (
            f"{view.reached}/{len(sources)} endpoints answering",
            "green" if not view.missed else "red",
        ),
    )
    rates = _table("Last interval", "fires/s", "delivered/s", "failures/s", "late p50", "late p99")
    rates.add_row(
        _number(view.fires_per_s),
        _number(view.delivered_per_s),
        _number(view.failures_per_s),
        bound_text(view.lateness_p50_s, view.lateness_cap_s),
        bound_text(view.lateness_p99_s, view.lateness_cap_s),
    )
    now = _table("Now", "in flight", "queue ready", "failures", "dead", "dead letters")
    now.add_row(
        _number(view.in_flight, digits=0),
        _number(view.deliveries_ready, digits=0),
        _number(view.failures_total, digits=0),
        _number(view.dead_total, digits=0),
        _number(view.dead_lettered_total, digits=0),
    )
    namespaces = _table("Namespaces, busiest first", "namespace", "ok/s", "failed/s", "dead/s")
    namespaces.columns[0].justify = "left"
    for namespace, ok, failed, dead in view.namespaces[:NAMESPACE_ROWS]:
        namespaces.add_row(namespace[:30], _number(ok), _number(failed), _number(dead))
    if len(view.namespaces) > NAMESPACE_ROWS:
        namespaces.add_row(f"… {len(view.namespaces) - NAMESPACE_ROWS} more", "", "", "")
    if not view.namespaces:
        namespaces.add_row("— no executor reports", "", "", "")
    parts: list[Text | Table] = [head, rates, now, namespaces, _backlog(view.backlog)]
    if view.missed:
        parts.append(Text(_one_line("not answering: ", view.missed), style="red"))
    return Group(*parts)


def _backlog(backlog: dict[int, float]) -> Text:
    """Due backlog per shard as a grid, SHARDS_PER_LINE to a line (a table would take a line
    per shard: 16 shards alone would fill the screen). More shards than BACKLOG_LINES hold:
    the busiest are shown, in shard order, and a last line counts the rest."""
    text = Text("Due backlog per shard (due now or earlier)\n", style="italic")
    if not backlog:
        return text.append("  no dispatcher reports")
    shown = backlog
    if len(backlog) > SHARDS_PER_LINE * BACKLOG_LINES:
        room = SHARDS_PER_LINE * (BACKLOG_LINES - 1)
        busiest = sorted(backlog, key=lambda shard: (-backlog[shard], shard))[:room]
        shown = {shard: backlog[shard] for shard in sorted(busiest)}
    cells = [f"{shard:>3}:{_compact(value):>7}"[-11:] for shard, value in shown.items()]
    lines = [
        "  ".join(cells[i : i + SHARDS_PER_LINE]) for i in range(0, len(cells), SHARDS_PER_LINE)
    ]
    hidden = [value for shard, value in backlog.items() if shard not in shown]
    if hidden:
        lines.append(
            f"  … {len(hidden)} more shards (busiest shown): {sum(hidden):,.0f} due, "
            f"at most {max(hidden):,.0f} on one"
        )
    return text.append("\n".join(lines))


# --- I/O ----------------------------------------------------------------------------------------


def endpoints(urls: Sequence[str] | None, ports: Sequence[int] | None) -> list[str]:
    found = list(urls or [])
    found += [f"http://127.0.0.1:{port}/metrics" for port in ports or ()]
    return found or [f"http://127.0.0.1:{port}/metrics" for port in DEFAULT_PORTS]


def _scrape_one(url: str, timeout_s: float) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            text: str = response.read().decode()
            return text
    except (urllib.error.URLError, OSError, ValueError):
        return None


async def scrape(urls: Sequence[str], timeout_s: float = 2.0) -> Sample:
    texts = await asyncio.gather(*(asyncio.to_thread(_scrape_one, u, timeout_s) for u in urls))
    sample = Sample(at_s=time.monotonic())
    for url, text in zip(urls, texts, strict=True):
        if text is None:
            sample.missed.append(url)
        else:
            sample.add(text)
    return sample


async def _loop(urls: list[str], interval_s: float, iterations: int | None) -> None:
    console = Console()
    before: Sample | None = None
    done = 0
    with Live(console=console, auto_refresh=False, screen=False) as live:
        while iterations is None or done < iterations:
            now = await scrape(urls)
            live.update(render(summarize(now, before), urls, interval_s), refresh=True)
            before = now
            done += 1
            if iterations is None or done < iterations:
                await asyncio.sleep(interval_s)


def run(args: argparse.Namespace) -> int:
    urls = endpoints(args.url, args.port)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_loop(urls, args.interval, args.iterations))
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "top", help="live view of fires/s, lateness, backlog and failures from /metrics"
    )
    p.add_argument("--url", action="append", help="a metrics URL (repeatable)")
    p.add_argument(
        "--port",
        type=int,
        action="append",
        help="a local metrics port (repeatable; default: 9101, 9102, 9103)",
    )
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    p.add_argument("--iterations", type=int, help="stop after this many refreshes")
    p.set_defaults(handler=run)
