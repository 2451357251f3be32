"""Tables of the benchmarks' terminal output (``rich``), one way for every benchmark.

Offers:
    table     a right-aligned ``rich.table.Table`` from a title, column names and rows
    cell      one value as text: ``-`` for ``None``, floats to two decimals
    console   a ``rich.console.Console`` wide enough that a log file keeps rows unwrapped
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["cell", "console", "table"]


def table(
    title: str,
    columns: str | Sequence[str],
    rows: Iterable[Sequence[object]],
    *,
    caption: str | None = None,
    justify: str = "right",
) -> Any:
    """A ``rich`` table: ``columns`` as names or one comma-separated string; every cell
    through ``cell`` (strings are kept as given, ``rich`` markup included)."""
    from rich.table import Table

    out = Table(title=title, caption=caption)
    for column in columns.split(",") if isinstance(columns, str) else columns:
        out.add_column(column, justify=justify)  # type: ignore[arg-type]
    for row in rows:
        out.add_row(*(cell(v) for v in row))
    return out


def cell(value: object) -> str:
    """``-`` for ``None``, a float with two decimals, anything else as ``str``."""
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def console(width: int = 170) -> Any:
    """A console ``width`` columns wide (output to a log file is not wrapped)."""
    from rich.console import Console

    return Console(width=width)
