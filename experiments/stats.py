"""The paired significance tests the research tools share: the exact McNemar test of two policies' outcomes on the
same prompts, and the sign-flip permutation test of several seeds pooled per prompt."""

from __future__ import annotations

import math
import random


def mcnemar(a: list[bool], b: list[bool]) -> tuple[int, int, float]:
    """Discordant prompts (a right & b wrong, a wrong & b right) and the exact two-sided McNemar p-value."""
    wins = sum(x and not y for x, y in zip(a, b, strict=True))
    losses = sum(y and not x for x, y in zip(a, b, strict=True))
    total = wins + losses
    if not total:
        return wins, losses, 1.0
    tail = sum(math.comb(total, i) for i in range(min(wins, losses) + 1)) / 2 ** total
    return wins, losses, min(1.0, 2 * tail)


def sign_flip_p(differences: list[float], resamples: int, seed: int) -> float:
    """Two-sided p of the mean paired difference under random sign flips (the +1 counts the observed flip)."""
    observed = abs(sum(differences))
    rng = random.Random(seed)
    nonzero = [d for d in differences if d]
    extreme = sum(abs(sum(d if rng.random() < 0.5 else -d for d in nonzero)) >= observed - 1e-12
                  for _ in range(resamples))
    return (extreme + 1) / (resamples + 1)


def per_prompt_mean(runs: list[list[bool]]) -> list[float]:
    """Each prompt's outcome averaged over the runs (a prompt right in 3 of 4 runs counts 0.75)."""
    return [sum(flags) / len(flags) for flags in zip(*runs, strict=True)]
