"""SQL lives in .sql files: named queries in ``queries.sql``, numbered migrations beside them."""

from __future__ import annotations

import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
MIGRATIONS_DIR = HERE / "migrations"
_BLOCK = re.compile(r"^-- (?P<name>[a-z_]+) --\n(?P<body>.*?)(?=^-- [a-z_]+ --\n|\Z)", re.S | re.M)


def parse_queries(text: str) -> dict[str, str]:
    """``-- name --`` headed blocks -> {name: sql}; the block's comment lines stay with it."""
    queries: dict[str, str] = {}
    for match in _BLOCK.finditer(text):
        name = match.group("name")
        if name in queries:
            raise ValueError(f"query {name!r} is defined twice")
        queries[name] = match.group("body").strip()
    return queries


QUERIES = parse_queries((HERE / "queries.sql").read_text())


def migrations() -> list[tuple[int, str, str]]:
    """(number, name, sql) of every migration file ``NNNN_name.sql``, in order."""
    found = []
    for path in sorted(MIGRATIONS_DIR.glob("*.sql")):
        number, _, name = path.stem.partition("_")
        found.append((int(number), name, path.read_text()))
    numbers = [number for number, _, _ in found]
    if numbers != list(range(1, len(numbers) + 1)):
        raise ValueError(f"migrations must be numbered 1..n without gaps, found {numbers}")
    return found
