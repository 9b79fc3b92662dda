"""Rewrite the text between `<!-- NAME:start -->` and `<!-- NAME:end -->` in a docs page (the benchmarks' tables)."""

from __future__ import annotations

from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def update_doc(page: str, marker: str, text: str) -> None:
    """Put `text` between the page's `marker` comments; an error when the page lacks them."""
    path = DOCS / page
    body = path.read_text()
    start, end = f"<!-- {marker}:start -->\n", f"<!-- {marker}:end -->"
    if start not in body or end not in body:
        raise SystemExit(f"{path} has no {start.strip()} / {end} markers")
    head, rest = body.split(start, 1)
    path.write_text(head + start + text + end + rest.split(end, 1)[1])
