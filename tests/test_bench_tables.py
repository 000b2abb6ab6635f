"""bench/tables.py: the table every benchmark prints, with rich and, where rich is missing, as aligned plain text."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from tables import print_table  # noqa: E402

HEADERS = ["method", "tokens/s", "vs HF"]
ROWS = [["HF generate", "438", "1.00x"], ["ours, compiled", "1008", "2.30x"]]


def test_rich_table_has_the_title_headers_and_every_cell(capsys):
    print_table(HEADERS, ROWS, "Generation speed")
    out = capsys.readouterr().out
    assert "Generation speed" in out
    assert all(cell in out for cell in HEADERS + [c for row in ROWS for c in row])


def test_without_rich_the_columns_are_right_aligned_plain_text(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "rich.console", None)  # `from rich.console import Console` raises ImportError
    print_table(HEADERS, ROWS, "Generation speed")
    assert capsys.readouterr().out.splitlines() == [
        "Generation speed",
        "        method  tokens/s  vs HF",
        "   HF generate       438  1.00x",
        "ours, compiled      1008  2.30x",
    ]
