"""The ledger's table (policy x fault) as text and as JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.ledger import oracle

COLUMNS = (
    "policy",
    "fault",
    "expected",
    "delivered",
    "lost",
    "duplicates",
    "unexpected",
    "overlaps",
    "skipped",
    "unreached",
    "bad_keys",
    "p99_late_s",
)


def row_values(row: oracle.Row) -> dict[str, Any]:
    return {
        "policy": row.policy,
        "fault": row.fault,
        "expected": row.expected,
        "delivered": row.delivered,
        "lost": row.lost,
        "duplicates": row.duplicates,
        "unexpected": row.unexpected,
        "overlaps": row.overlaps,
        "skipped": row.skipped,
        "unreached": row.unreached,
        "bad_keys": row.bad_keys,
        "p99_late_s": round(row.p99_lateness_s, 2),
    }


def rows(verdict: oracle.Verdict) -> list[dict[str, Any]]:
    return [row_values(verdict.rows[k]) for k in sorted(verdict.rows)]


def totals(verdict: oracle.Verdict) -> dict[str, Any]:
    every = oracle.Row("all", "all")
    for row in verdict.rows.values():
        for name in ("expected", "delivered", "lost", "duplicates", "unexpected", "overlaps"):
            setattr(every, name, getattr(every, name) + getattr(row, name))
        every.skipped += row.skipped
        every.unreached += row.unreached
        every.bad_keys += row.bad_keys
        every.lateness_ms.extend(row.lateness_ms)
    return row_values(every)


def table(title: str, verdict: oracle.Verdict) -> str:
    lines = [*rows(verdict), totals(verdict)]
    cells = [[str(line[c]) for c in COLUMNS] for line in lines]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(COLUMNS)]

    def fmt(values: list[str]) -> str:
        return "  ".join(
            v.ljust(w) if i < 2 else v.rjust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        )

    out = [title, fmt(list(COLUMNS)), fmt(["-" * w for w in widths])]
    out.extend(fmt(r) for r in cells[:-1])
    out.append(fmt(["-" * w for w in widths]))
    out.append(fmt(cells[-1]))
    return "\n".join(out)


def write_json(path: Path, section: str, payload: dict[str, Any]) -> None:
    """Merge one section (``mix`` or ``herd``) into the JSON report at ``path``."""
    current: dict[str, Any] = {}
    if path.exists():
        try:
            current = json.loads(path.read_text())
        except ValueError:
            current = {}
    current[section] = payload
    path.write_text(json.dumps(current, indent=2, sort_keys=True) + "\n")


def section(verdict: oracle.Verdict, **extra: Any) -> dict[str, Any]:
    return {
        **extra,
        "rows": rows(verdict),
        "totals": totals(verdict),
        "findings": verdict.findings[:500],
    }
