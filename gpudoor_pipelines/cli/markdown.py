"""Markdown pieces of the rules page: tables, code spans, paths as the page names them."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from gpudoor_pipelines.launch.resolve.fleet import PROJECT_ROOT


def display(path: str | Path) -> str:
    """A path as the page names it: relative to the project when inside it, so the page never names a home folder."""
    p = Path(path).resolve()
    try:
        return p.relative_to(PROJECT_ROOT).as_posix()
    except ValueError:
        return p.name


def cell(value: object) -> str:
    return " ".join(str(value).split()).replace("|", "\\|")


def table(header: Iterable[str], rows: Iterable[Iterable[object]]) -> list[str]:
    head = [cell(h) for h in header]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return lines + [""]


def codes(names: Iterable[str]) -> str:
    names = list(names)
    return ", ".join(f"`{n}`" for n in names) if names else "none"


def yes(flag: bool) -> str:
    return "yes" if flag else "no"


def usd(value: float) -> str:
    return f"{value:.2f}"
