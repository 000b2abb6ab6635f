"""bench/tables.py: the exact McNemar test every demo bench uses to call a difference shown or not."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from tables import mcnemar  # noqa: E402


def test_mcnemar_counts_discordant_prompts_and_gives_the_exact_binomial_p():
    a = [True, True, True, False, False, True]
    b = [True, False, False, False, True, True]
    # discordant: a alone right at 1 and 2, b alone right at 4 -> 2 vs 1; two-sided exact p = 2 * P(X <= 1), X ~ Bin(3, 1/2)
    assert mcnemar(a, b) == (2, 1, 1.0)  # 2 * (1 + 3) / 8 = 1.0, capped at 1
    five_to_none = [True] * 5 + [False] * 3
    assert mcnemar(five_to_none, [False] * 8) == (5, 0, 2 / 32)
    # 20 better, 11 worse (the README's round-2 PPO row): 2 * sum_{i<=11} C(31, i) / 2^31
    a = [True] * 20 + [False] * 11 + [True] * 50
    b = [False] * 20 + [True] * 11 + [True] * 50
    wins, losses, p = mcnemar(a, b)
    assert (wins, losses) == (20, 11)
    assert abs(p - 0.1496) < 5e-4


def test_mcnemar_without_discordant_prompts_is_p_one():
    assert mcnemar([True, False], [True, False]) == (0, 0, 1.0)
