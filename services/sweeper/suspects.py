"""Drift repair's rule for rows the index lacks: put back only what two checks in a row found
missing. An executor ends a run or a backfill in Redis a moment before its audit batch removes
the PostgreSQL row, and one check could fall in between; the next one no longer sees the row.
Pure: the callers read the rows and write the index.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Set
from typing import TypeVar

Row = TypeVar("Row")
Key = TypeVar("Key", bound=Hashable)


def confirm(
    suspects: Set[Key], missing: Iterable[Row], key: Callable[[Row], Key]
) -> tuple[list[Row], set[Key]]:
    """``(confirmed, next_suspects)``: the rows of ``missing`` the previous check suspected
    already (in the order given), and the keys of the others, to confirm at the next check."""
    confirmed: list[Row] = []
    fresh: set[Key] = set()
    for row in missing:
        k = key(row)
        if k in suspects:
            confirmed.append(row)
        else:
            fresh.add(k)
    return confirmed, fresh
