"""Tables of ``fedopt info`` and ``fedopt selftest``: rich's where rich is installed (the
``sim`` extra), aligned plain text otherwise -- the commands a user runs first on a new
machine work on a lean install."""

from __future__ import annotations

import sys
from typing import List, Optional, Sequence, Tuple, Union

# A cell: its text, or (text, colour) -- the colour is rich's, dropped in plain text.
Cell = Union[str, Tuple[str, str]]


def have_rich() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def _text(cell: Cell) -> str:
    return cell if isinstance(cell, str) else cell[0]


def plain(columns: Sequence[str], rows: Sequence[Sequence[Cell]], *, header: bool = True) -> str:
    """The rows as aligned text columns (a dashed line under the header)."""
    lines = ([list(columns)] if header else []) + [[_text(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in lines) for i in range(len(columns))]
    out = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in lines]
    if header:
        out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Cell]], *, header: bool = True,
                no_wrap: Sequence[str] = (), stream=None, use_rich: Optional[bool] = None) -> None:
    """Print one table on ``stream`` (stdout): with rich when ``use_rich`` (default:
    whenever rich is installed), else as :func:`plain` text under its title."""
    stream = stream or sys.stdout
    if use_rich is None:
        use_rich = have_rich()
    if not use_rich:
        print(title, file=stream)
        print(plain(columns, rows, header=header), file=stream)
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title, show_header=header)
    for c in columns:
        table.add_column(c, no_wrap=c in no_wrap)
    for r in rows:
        table.add_row(*(escape(c) if isinstance(c, str) else f"[{c[1]}]{escape(c[0])}[/]" for c in r))
    Console(file=stream).print(table)


def print_tables(tables: List[tuple], stream=None) -> None:
    """Several ``(title, columns, rows, header)`` tables, one after the other."""
    use_rich = have_rich()
    for i, (title, columns, rows, header) in enumerate(tables):
        if i and not use_rich:
            print(file=stream or sys.stdout)  # rich's tables stand apart by their borders
        print_table(title, columns, rows, header=header, stream=stream, use_rich=use_rich)
