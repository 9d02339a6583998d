"""The site's build hook: the reference tables are written from the code as each page is read,
so the site shows what the code says even before ``python -m cronbus.reference`` was run (the
test that compares the pages with the code fails until it is)."""

from __future__ import annotations

from typing import Any

from cronbus import reference


def on_page_markdown(markdown: str, **_: Any) -> str:
    return reference.render(markdown)
