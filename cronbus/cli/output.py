"""How ``cronbus get``, ``list`` and ``executions`` print: aligned tables for people by default,
``-o json`` (the reply as it came, for scripts), ``-o yaml``, ``-o wide`` (a table with more)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import yaml
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from cronbus.cli import said
from shared.contract import codec, models, timefmt
from shared.contract.replies import StoredSchedule

FORMATS = ("table", "wide", "json", "yaml")


def add_option(parser: argparse.ArgumentParser, rows: str = "the reply, for scripts") -> None:
    parser.add_argument(
        "-o",
        "--output",
        choices=FORMATS,
        default="table",
        help=f"table (default), wide (a table with more columns), json ({rows}), yaml",
    )


def add_action_option(parser: argparse.ArgumentParser) -> None:
    """``-o`` of the verbs that change something (apply, pause, resume, delete, trigger,
    backfill): a line for people by default, whatever stdout is, as get and list print tables."""
    parser.add_argument(
        "-o",
        "--output",
        choices=said.FORMATS,
        default="text",
        help="text (default: one line per command, for people), json (the reply exactly as "
        "cronbus sent it, on one line, for scripts), yaml",
    )


def print_table(table: Table) -> None:
    # A pipe gets every column whole, never squeezed to 80 characters; no line ends in the
    # padding of its last cell. Cells are user text (labels, URLs, errors): never read as rich
    # markup or emoji codes.
    console = Console(
        width=None if sys.stdout.isatty() else 1_000_000,
        markup=False,
        emoji=False,
        highlight=False,
    )
    with console.capture() as captured:
        console.print(table)
    print("\n".join(line.rstrip() for line in captured.get().splitlines()))


def print_json(value: Any) -> None:
    print(codec.dumps(value).decode())


def print_yaml(value: Any) -> None:
    print(yaml.safe_dump(value, sort_keys=False, allow_unicode=True).rstrip())


def _table(*headers: str) -> Table:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, header_style="bold")
    for header in headers:
        table.add_column(header, overflow="fold")
    return table


def _add_row(table: Table, cells: Sequence[str]) -> None:
    """A row of plain text: ``[bold]`` or ``:thumbs_up:`` in a label is printed as written."""
    table.add_row(*(Text(cell) for cell in cells))


def new_table(*headers: str) -> Table:
    """A table in the commands' style, for another module's rows."""
    return _table(*headers)


def add_row(table: Table, cells: Sequence[str]) -> None:
    _add_row(table, cells)


def instant(value: Any) -> str:
    """An instant as the contract writes it (UTC, ``Z``); ``-`` for none."""
    if value is None:
        return "-"
    return timefmt.format_ms(timefmt.datetime_to_ms(value))


def spec_text(spec: Any) -> str:
    if isinstance(spec, models.CronSpec):
        return f"cron {spec.expr} ({spec.timezone})"
    if isinstance(spec, models.IntervalSpec):
        return f"every {spec.every_s:g}s"
    if isinstance(spec, models.AfterCompletionSpec):
        return f"{spec.delay_s:g}s after completion"
    assert isinstance(spec, models.OnceSpec)
    return f"once at {instant(spec.at)}"


def target_text(target: Any) -> str:
    if isinstance(target, models.WebhookTarget):
        return f"{target.method} {target.url}"
    assert isinstance(target, models.AmqpTarget)
    return f"amqp {target.exchange or '(default)'} {target.routing_key}".rstrip()


def state_text(schedule: StoredSchedule) -> str:
    if schedule.paused_reason == "failures":
        return f"{schedule.state} (failures)"
    return schedule.state


def labels_text(labels: Mapping[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in labels.items()) or "-"


def last_text(schedule: StoredSchedule) -> str:
    stats = schedule.stats
    if stats is None or stats.last_status is None:
        return "-"
    return f"{stats.last_status} ({stats.last_error})" if stats.last_error else stats.last_status


def fires_text(schedule: StoredSchedule) -> str:
    """Occurrences started, triggers included (``stats``); without stats, the rotation's count,
    which is written in batches and trails a little."""
    return str(schedule.stats.fires if schedule.stats is not None else schedule.fires)


def fires_detail(schedule: StoredSchedule) -> str:
    """``get``'s fires: every occurrence started (``stats.fires``), and the rotation's regular
    count beside it when that differs, named for what it is: a trigger made the reply's
    ``schedule.fires`` read 0 where ``get`` said 1, with nothing to tell the two apart."""
    shown = fires_text(schedule)
    if schedule.stats is None or schedule.stats.fires == schedule.fires:
        return shown
    return f"{shown} ({schedule.fires} regular in the current rotation, which max_fires counts)"


def schedules_table(schedules: Sequence[StoredSchedule], *, wide: bool) -> Table:
    headers = ["ID", "STATE", "SCHEDULE", "NEXT FIRE", "LAST", "FIRES"]
    if wide:
        headers += ["VERSION", "TARGET", "LABELS", "LAST FIRE", "FAILED", "DEAD"]
    table = _table(*headers)
    for s in schedules:
        stats = s.stats
        row = [
            s.id,
            state_text(s),
            spec_text(s.spec),
            instant(s.next_fires[0]) if s.next_fires else "-",
            last_text(s),
            fires_text(s),
        ]
        if wide:
            row += [
                str(s.version),
                target_text(s.target),
                labels_text(s.labels),
                instant(stats.last_fire_at if stats else None),
                str(stats.failed if stats else "-"),
                str(stats.dead if stats else "-"),
            ]
        _add_row(table, row)
    return table


def schedule_table(s: StoredSchedule, *, wide: bool) -> Table:
    """One schedule, a field a line."""
    table = _table("FIELD", "VALUE")
    table.show_header = False
    rows: list[tuple[str, str]] = [
        ("schedule", f"{s.namespace}/{s.id}"),
        ("state", state_text(s)),
        ("version", str(s.version)),
        ("spec", spec_text(s.spec)),
        ("target", target_text(s.target)),
        ("next fires", "\n".join(instant(t) for t in s.next_fires) or "-"),
        ("fires", fires_detail(s)),
        ("last", last_text(s)),
        ("labels", labels_text(s.labels)),
    ]
    if s.stats is not None:
        st = s.stats
        rows.append(
            (
                "stats",
                f"succeeded {st.succeeded}, failed {st.failed}, dead {st.dead}, skipped "
                f"{st.skipped}, excluded {st.excluded}, consecutive failures "
                f"{st.consecutive_failures}",
            )
        )
    if s.breaker is not None and (wide or s.breaker.state != "closed" or s.breaker.held_until):
        held = f", held until {instant(s.breaker.held_until)}" if s.breaker.held_until else ""
        rows.append(("breaker", f"{s.breaker.state} ({s.breaker.rate_key}){held}"))
    if s.backfill is not None:
        rows.append(("backfill", f"{s.backfill.remaining} remaining"))
    if wide:
        rows += _wide_rows(s)
    for field, value in rows:
        _add_row(table, (field, value))
    return table


def _wide_rows(s: StoredSchedule) -> list[tuple[str, str]]:
    retry = s.retry
    exclusions = [codec.dumps(e.model_dump(mode="json")).decode() for e in s.spec.exclude]
    window = f"{instant(s.spec.start_at)} .. {instant(s.spec.end_at)}"
    return [
        ("window", window if s.spec.start_at or s.spec.end_at else "-"),
        ("max fires", str(s.spec.max_fires or "-")),
        ("exclude", "\n".join(exclusions) or "-"),
        (
            "retry",
            f"{retry.max_attempts} attempts, {retry.initial_backoff_s:g}s x{retry.multiplier:g} "
            f"up to {retry.max_backoff_s:g}s",
        ),
        ("misfire", codec.dumps(s.misfire.model_dump(mode="json")).decode()),
        ("jitter", f"{s.jitter_s:g}s"),
        ("priority", str(s.priority)),
        ("pause after failures", str(s.pause_after_failures or "-")),
        ("last fire", instant(s.last_fire_at)),
        ("created", instant(s.created_at)),
        ("updated", instant(s.updated_at)),
    ]


# --- executions (rows from PostgreSQL, not a reply) ---------------------------------------------

#: Fixed widths (negative: aligned right), so rows that --watch prints later line up under the
#: header; the error takes the rest of the line.
_COLUMNS = (
    ("FIRE TIME", 24),
    ("KIND", 8),
    ("STATUS", 9),
    ("TRY", -3),
    ("HTTP", -4),
    ("LATE MS", -8),
)
_WIDE_COLUMNS = (("STARTED", 24), ("FINISHED", 24), ("IDEMPOTENCY KEY", 36))


def _columns(*, wide: bool) -> tuple[tuple[str, int], ...]:
    return (*_COLUMNS, *(_WIDE_COLUMNS if wide else ()), ("ERROR", 0))


def _line(cells: Sequence[str], *, wide: bool) -> str:
    columns = _columns(wide=wide)
    parts = [
        cell.rjust(-width) if width < 0 else cell.ljust(width)
        for (_, width), cell in zip(columns, cells, strict=True)
    ]
    return "  ".join(parts).rstrip()


def plain(row: Mapping[str, Any]) -> dict[str, Any]:
    """An execution row as JSON: times as RFC 3339."""
    return {k: instant(v) if hasattr(v, "tzinfo") else v for k, v in row.items()}


def execution_header(*, wide: bool) -> str:
    return _line([name for name, _ in _columns(wide=wide)], wide=wide)


def execution_line(row: Mapping[str, Any], *, wide: bool) -> str:
    kind = "trigger" if row["is_trigger"] else ("backfill" if row["is_backfill"] else "")
    cells = [
        instant(row["nominal_at"]),
        kind,
        str(row["status"]),
        str(row["attempts"]),
        str(row["http_status"] or ""),
        str(row["lateness_ms"]),
    ]
    if wide:
        cells += [instant(row["started_at"]), instant(row["finished_at"]), row["idempotency_key"]]
    return _line([*cells, row["error"] or ""], wide=wide)


def identity(row: Mapping[str, Any]) -> tuple[Any, bool, bool]:
    """An execution row's key among its schedule's (as in PostgreSQL): its nominal time and
    kind. A backfill of an occurrence has the occurrence's idempotency key, not its identity."""
    return (row["nominal_at"], bool(row["is_trigger"]), bool(row["is_backfill"]))


def news(seen: dict[tuple[Any, bool, bool], Any], rows: Sequence[Mapping[str, Any]]) -> list[Any]:
    """Of ``rows`` (newest first, as queried), those not printed yet or changed since, oldest
    first (as they happened); ``seen`` learns them."""
    changed = [row for row in reversed(rows) if seen.get(identity(row)) != row]
    seen.update((identity(row), row) for row in changed)
    return changed


def print_executions(rows: Iterable[Mapping[str, Any]], fmt: str, *, header: bool) -> None:
    """Rows as the format wants them; ``header`` False for the rows --watch adds later."""
    rows = list(rows)
    if fmt == "json":
        for row in rows:
            print_json(plain(row))
    elif fmt == "yaml":
        if rows:
            print_yaml([plain(row) for row in rows])
    else:
        wide = fmt == "wide"
        if header:
            print(execution_header(wide=wide))
        for row in rows:
            print(execution_line(row, wide=wide))
    sys.stdout.flush()
