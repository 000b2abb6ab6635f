"""The results table every bench script prints (rich when available, aligned plain text otherwise). The research
tools in experiments/ print theirs with it too; their significance tests are in experiments/stats.py."""

from __future__ import annotations


def print_table(headers: list[str], rows: list[list[str]], title: str, *, label_columns: int = 1,
                wrap_values: bool = False, min_width: int = 120) -> None:
    """Label columns (the first ``label_columns``) are left-aligned, numbers right-aligned."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text
        print(title)
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
        for row in [headers, *rows]:
            print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
        return
    table = Table(title=title)
    for i, header in enumerate(headers):
        label = i < label_columns
        table.add_column(header, justify="left" if label else "right", no_wrap=label or not wrap_values)
    for row in rows:
        table.add_row(*row)
    Console(width=max(min_width, Console().width)).print(table)
