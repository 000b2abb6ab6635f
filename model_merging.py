"""Checkpoint merging: pure tensor building blocks.

This module combines several fine-tuned checkpoints of one base model into a
single set of weights without further training. Everything here works on
plain ``torch.Tensor`` objects, one parameter at a time, and has no knowledge
of models, adapters or files; the higher-level merging code builds on these
functions.

Most methods work on *task tensors* (task vectors): for one parameter,
``task_tensor = finetuned - base``. All task tensors passed to one call must
have the same shape, and the merged result is a task tensor of that shape
which the caller adds back onto the base parameter. ``slerp`` instead
interpolates between two full parameter tensors.

The semantics of the functions that PEFT also has match
``peft.utils.merge_utils`` (same pruning counts, same sign election, same
order of random draws), apart from stricter argument checking: bad arguments
raise ``ValueError``.

Public names:

- ``magnitude_prune``: keep the largest-magnitude fraction of a tensor.
- ``random_prune``: Bernoulli (DARE) drop of a tensor, optional rescaling.
- ``calculate_majority_sign_mask``: TIES sign election on stacked tensors.
- ``disjoint_merge``: TIES disjoint mean over sign-agreeing entries.
- ``task_arithmetic``: weighted sum of task tensors.
- ``ties``: TIES-Merging (trim, elect sign, disjoint merge).
- ``dare_linear``: DARE drop-and-rescale followed by a weighted sum.
- ``dare_ties``: DARE drop-and-rescale followed by sign election and
  disjoint merge.
- ``slerp``: spherical linear interpolation between two tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "calculate_majority_sign_mask",
    "dare_linear",
    "dare_ties",
    "disjoint_merge",
    "magnitude_prune",
    "random_prune",
    "slerp",
    "task_arithmetic",
    "ties",
]

MAJORITY_SIGN_METHODS = ("total", "frequency")

WeightsLike = Sequence[float] | torch.Tensor


# --------------------------------------------------------------------------
# Argument checking helpers (private)
# --------------------------------------------------------------------------


def _check_density(density: float) -> float:
    """Return ``density`` as a float, or raise if it is not in (0, 1]."""
    try:
        value = float(density)
    except (TypeError, ValueError):
        raise ValueError(
            f"density must be a number in (0, 1], got {density!r}"
        ) from None
    if not (0.0 < value <= 1.0):  # also rejects NaN
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    return value


def _check_sign_method(method: str) -> None:
    if method not in MAJORITY_SIGN_METHODS:
        raise ValueError(
            f"majority_sign_method must be one of {list(MAJORITY_SIGN_METHODS)}, "
            f"got {method!r}"
        )


def _check_task_tensors(task_tensors: Sequence[torch.Tensor]) -> None:
    if isinstance(task_tensors, torch.Tensor):
        raise TypeError(
            "task_tensors must be a list of tensors (one per task), got a single tensor"
        )
    if len(task_tensors) == 0:
        raise ValueError("task_tensors must contain at least one tensor, got 0")
    shape = task_tensors[0].shape
    for i, tensor in enumerate(task_tensors):
        if tensor.shape != shape:
            raise ValueError(
                "task_tensors must all have the same shape: task_tensors[0] has "
                f"shape {tuple(shape)} but task_tensors[{i}] has shape "
                f"{tuple(tensor.shape)}"
            )


def _check_weights(weights: WeightsLike, num_tasks: int) -> torch.Tensor:
    """Return ``weights`` as a 1-D tensor of length ``num_tasks``, or raise."""
    if isinstance(weights, torch.Tensor):
        w = weights.detach()
        if w.dim() != 1:
            raise ValueError(
                f"weights must be 1-D (one weight per task), got shape {tuple(w.shape)}"
            )
    else:
        try:
            w = torch.tensor([float(x) for x in weights], dtype=torch.float64)
        except (TypeError, ValueError):
            raise ValueError(
                f"weights must be a sequence of numbers or a 1-D tensor, got "
                f"{weights!r}"
            ) from None
    if w.shape[0] != num_tasks:
        raise ValueError(
            f"weights must have one entry per task tensor: got {w.shape[0]} "
            f"weights for {num_tasks} task_tensors"
        )
    return w


def _apply_weights(stacked: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Multiply task ``i`` of ``stacked`` (tasks on dim 0) by ``weights[i]``.

    The weights are cast to the dtype and device of ``stacked`` so the result
    keeps the dtype of the task tensors.
    """
    w = weights.to(device=stacked.device, dtype=stacked.dtype)
    return stacked * w.view((stacked.shape[0],) + (1,) * (stacked.dim() - 1))


# --------------------------------------------------------------------------
# Pruning
# --------------------------------------------------------------------------


def magnitude_prune(tensor: torch.Tensor, density: float) -> torch.Tensor:
    """Keep the largest-magnitude ``density`` fraction of entries, zero the rest.

    This is the "trim" step of TIES-Merging (Yadav et al. 2023, "TIES-Merging:
    Resolving Interference When Merging Models"). The number of kept entries
    is ``k = int(density * tensor.numel())`` (truncated, as in PEFT's
    ``magnitude_based_pruning``); entries are ranked by ``abs`` with
    ``torch.topk``. ``density == 1`` returns an unpruned copy.

    Shapes: ``tensor`` is any shape ``S``; the result has shape ``S`` and the
    same dtype and device.

    Raises:
        ValueError: if ``density`` is not in (0, 1].
    """
    density = _check_density(density)
    if density >= 1.0:
        return tensor.clone()
    flat = tensor.reshape(-1)
    k = int(density * flat.numel())
    mask = torch.zeros_like(flat)
    if k > 0:
        keep = torch.topk(flat.abs(), k=k, largest=True).indices
        mask[keep] = 1
    return tensor * mask.reshape(tensor.shape)


def random_prune(
    tensor: torch.Tensor,
    density: float,
    rescale: bool,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Randomly keep each entry with probability ``density`` (DARE drop).

    This is the "drop and rescale" step of DARE (Yu et al. 2024, "Language
    Models are Super Mario: Absorbing Abilities from Homologous Models as a
    Free Lunch"). Each entry is kept independently with probability
    ``density`` (one ``torch.bernoulli`` draw per entry); if ``rescale`` the
    survivors are divided by ``density`` so the expectation of every entry is
    unchanged. ``density == 1`` returns a copy and draws no random numbers
    (as PEFT does, so random streams stay aligned with PEFT).

    ``generator`` is passed to ``torch.bernoulli``; ``None`` uses torch's
    global random state.

    Shapes: ``tensor`` is any floating shape ``S``; the result has shape ``S``
    and the same dtype and device.

    Raises:
        ValueError: if ``density`` is not in (0, 1].
    """
    density = _check_density(density)
    if density >= 1.0:
        return tensor.clone()
    probs = torch.full_like(tensor, fill_value=density)
    mask = torch.bernoulli(probs, generator=generator)
    pruned = tensor * mask
    if rescale:
        pruned = pruned / density
    return pruned


# --------------------------------------------------------------------------
# TIES building blocks
# --------------------------------------------------------------------------


def calculate_majority_sign_mask(
    tensor: torch.Tensor, method: str = "total"
) -> torch.Tensor:
    """Elect a sign per entry and mark which tasks agree with it.

    This is the "elect sign" step of TIES-Merging (Yadav et al. 2023,
    "TIES-Merging: Resolving Interference When Merging Models"). Tasks are
    stacked on dimension 0. With ``method="total"`` the elected sign is the
    sign of the sum of the values over tasks (mass-weighted vote, as in the
    paper); with ``method="frequency"`` it is the sign of the sum of signs
    (one vote per task). A tie (sum exactly 0) elects ``+1``. The mask is
    ``True`` where a task's sign equals the elected sign, so zero entries
    (e.g. trimmed ones) never count as agreeing.

    Shapes: ``tensor`` is ``(num_tasks, *S)``; the result is a bool tensor
    of shape ``(num_tasks, *S)``.

    Raises:
        ValueError: if ``method`` is not ``"total"`` or ``"frequency"``.
    """
    if method not in MAJORITY_SIGN_METHODS:
        raise ValueError(
            f"method must be one of {list(MAJORITY_SIGN_METHODS)}, got {method!r}"
        )
    sign = tensor.sign()
    if method == "total":
        vote = tensor.sum(dim=0)
    else:
        vote = sign.sum(dim=0)
    elected = torch.where(vote >= 0, 1, -1).to(sign.dtype)
    return sign == elected


def disjoint_merge(
    task_tensors: torch.Tensor | Sequence[torch.Tensor],
    majority_sign_mask: torch.Tensor,
) -> torch.Tensor:
    """Average each entry over the tasks that agree with the elected sign.

    This is the "disjoint merge" step of TIES-Merging (Yadav et al. 2023,
    "TIES-Merging: Resolving Interference When Merging Models"): for every
    entry, the values of the tasks whose mask is ``True`` are summed and
    divided by the number of such tasks (at least 1, so an entry with no
    agreeing task becomes 0). As in PEFT, the divisor is the *count* of
    agreeing tasks, not the sum of their weights; callers that want weights
    pass already-weighted task tensors.

    Shapes: ``task_tensors`` is a tensor ``(num_tasks, *S)`` or a list of
    ``num_tasks`` tensors of shape ``S``; ``majority_sign_mask`` is
    ``(num_tasks, *S)``; the result has shape ``S``.

    Raises:
        ValueError: if the shapes of ``task_tensors`` and
            ``majority_sign_mask`` do not match.
    """
    if isinstance(task_tensors, torch.Tensor):
        stacked = task_tensors
    else:
        _check_task_tensors(task_tensors)
        stacked = torch.stack(list(task_tensors), dim=0)
    if stacked.shape != majority_sign_mask.shape:
        raise ValueError(
            "majority_sign_mask must have the same shape as the stacked "
            f"task_tensors {tuple(stacked.shape)}, got "
            f"{tuple(majority_sign_mask.shape)}"
        )
    mask = majority_sign_mask.to(stacked.dtype)
    total = (stacked * mask).sum(dim=0)
    count = mask.sum(dim=0)
    return total / torch.clamp(count, min=1.0)


# --------------------------------------------------------------------------
# Merge methods
# --------------------------------------------------------------------------


def task_arithmetic(
    task_tensors: Sequence[torch.Tensor], weights: WeightsLike
) -> torch.Tensor:
    """Weighted sum of task tensors.

    Task Arithmetic (Ilharco et al. 2023, "Editing Models with Task
    Arithmetic"): ``merged = sum_i weights[i] * task_tensors[i]``. Weights are
    used as given (not normalised); negative weights implement "task
    negation". ``weights`` is a sequence of floats or a 1-D tensor; it is
    cast to the dtype and device of the task tensors.

    Shapes: ``task_tensors`` is a list of ``n`` tensors of shape ``S``;
    ``weights`` has length ``n``; the result has shape ``S``.

    Raises:
        ValueError: if the list is empty, the shapes differ, or the number of
            weights is not the number of task tensors.
    """
    _check_task_tensors(task_tensors)
    w = _check_weights(weights, len(task_tensors))
    stacked = torch.stack(list(task_tensors), dim=0)
    return _apply_weights(stacked, w).sum(dim=0)


def _sign_elect_and_merge(
    stacked: torch.Tensor, weights: torch.Tensor, majority_sign_method: str
) -> torch.Tensor:
    # Sign is elected from the (pruned) *unweighted* task tensors, then the
    # weighted tensors are averaged over the agreeing tasks (PEFT order).
    mask = calculate_majority_sign_mask(stacked, method=majority_sign_method)
    weighted = _apply_weights(stacked, weights)
    return disjoint_merge(weighted, mask)


def ties(
    task_tensors: Sequence[torch.Tensor],
    weights: WeightsLike,
    density: float,
    majority_sign_method: str = "total",
) -> torch.Tensor:
    """Merge task tensors with TIES-Merging.

    TIES-Merging (Yadav et al. 2023, "TIES-Merging: Resolving Interference
    When Merging Models"), in three steps:

    1. **Trim**: ``magnitude_prune`` each task tensor to ``density``.
    2. **Elect sign**: ``calculate_majority_sign_mask`` over the trimmed,
       *unweighted* task tensors (``"total"`` or ``"frequency"``).
    3. **Disjoint merge**: multiply each trimmed task tensor by its weight,
       then ``disjoint_merge``: per entry, the mean over the tasks whose sign
       agrees with the elected sign.

    As in PEFT, weights scale the task tensors but the mean divides by the
    number of agreeing tasks, so with all weights equal to ``w`` the result
    is ``w`` times the plain TIES mean.

    Shapes: ``task_tensors`` is a list of ``n`` tensors of shape ``S``;
    ``weights`` has length ``n``; the result has shape ``S``.

    Raises:
        ValueError: on bad ``density`` (not in (0, 1]), an unknown
            ``majority_sign_method``, mismatched shapes or weight count.
    """
    density = _check_density(density)
    _check_sign_method(majority_sign_method)
    _check_task_tensors(task_tensors)
    w = _check_weights(weights, len(task_tensors))
    trimmed = [magnitude_prune(t, density) for t in task_tensors]
    stacked = torch.stack(trimmed, dim=0)
    return _sign_elect_and_merge(stacked, w, majority_sign_method)


def dare_linear(
    task_tensors: Sequence[torch.Tensor],
    weights: WeightsLike,
    density: float,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Merge task tensors with DARE followed by a weighted sum.

    DARE (Yu et al. 2024, "Language Models are Super Mario: Absorbing
    Abilities from Homologous Models as a Free Lunch"): each task tensor is
    passed through ``random_prune(t, density, rescale=True)`` (drop entries
    with probability ``1 - density``, divide survivors by ``density``), then
    combined with Task Arithmetic (weighted sum). Random draws are made task
    by task, in list order, from ``generator`` (or torch's global state).
    With ``density == 1`` this equals ``task_arithmetic``.

    Shapes: ``task_tensors`` is a list of ``n`` tensors of shape ``S``;
    ``weights`` has length ``n``; the result has shape ``S``.

    Raises:
        ValueError: on bad ``density`` (not in (0, 1]), mismatched shapes or
            weight count.
    """
    density = _check_density(density)
    _check_task_tensors(task_tensors)
    w = _check_weights(weights, len(task_tensors))
    dropped = [
        random_prune(t, density, rescale=True, generator=generator)
        for t in task_tensors
    ]
    return _apply_weights(torch.stack(dropped, dim=0), w).sum(dim=0)


def dare_ties(
    task_tensors: Sequence[torch.Tensor],
    weights: WeightsLike,
    density: float,
    majority_sign_method: str = "total",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Merge task tensors with DARE pruning and TIES sign election.

    DARE (Yu et al. 2024, "Language Models are Super Mario: Absorbing
    Abilities from Homologous Models as a Free Lunch") replaces the TIES trim
    step: each task tensor goes through ``random_prune(t, density,
    rescale=True)``; then the TIES-Merging (Yadav et al. 2023) steps follow:
    elect sign on the dropped, unweighted tensors, weight them, and
    ``disjoint_merge``. Random draws are made task by task, in list order,
    from ``generator`` (or torch's global state).

    Shapes: ``task_tensors`` is a list of ``n`` tensors of shape ``S``;
    ``weights`` has length ``n``; the result has shape ``S``.

    Raises:
        ValueError: on bad ``density`` (not in (0, 1]), an unknown
            ``majority_sign_method``, mismatched shapes or weight count.
    """
    density = _check_density(density)
    _check_sign_method(majority_sign_method)
    _check_task_tensors(task_tensors)
    w = _check_weights(weights, len(task_tensors))
    dropped = [
        random_prune(t, density, rescale=True, generator=generator)
        for t in task_tensors
    ]
    stacked = torch.stack(dropped, dim=0)
    return _sign_elect_and_merge(stacked, w, majority_sign_method)


# --------------------------------------------------------------------------
# SLERP
# --------------------------------------------------------------------------


def slerp(
    t: float,
    v0: torch.Tensor,
    v1: torch.Tensor,
    dot_threshold: float = 0.9995,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Spherical linear interpolation between two tensors.

    SLERP (Shoemake 1985, "Animating Rotation with Quaternion Curves"). The
    tensors are treated as flattened vectors. With ``theta`` the angle
    between ``v0`` and ``v1``::

        slerp(t) = sin((1 - t) * theta) / sin(theta) * v0
                 + sin(t * theta) / sin(theta) * v1

    The original (unnormalised) vectors are interpolated, so for unit
    vectors the result stays on the unit sphere. When the vectors are nearly
    colinear (``|cos theta| > dot_threshold``) or either has norm
    ``<= eps``, it falls back to linear interpolation
    ``(1 - t) * v0 + t * v1``. The computation is done in at least float32
    and the result is cast back to the promoted dtype of ``v0`` and ``v1``.

    Shapes: ``v0`` and ``v1`` have the same shape ``S``; ``t`` is a scalar in
    [0, 1]; the result has shape ``S``.

    Raises:
        ValueError: if ``t`` is not in [0, 1] or the shapes differ.
    """
    try:
        t = float(t)
    except (TypeError, ValueError):
        raise ValueError(f"t must be a number in [0, 1], got {t!r}") from None
    if not (0.0 <= t <= 1.0):
        raise ValueError(f"t must be in [0, 1], got {t!r}")
    if v0.shape != v1.shape:
        raise ValueError(
            f"v0 and v1 must have the same shape, got {tuple(v0.shape)} and "
            f"{tuple(v1.shape)}"
        )
    out_dtype = torch.result_type(v0, v1)
    work_dtype = torch.promote_types(out_dtype, torch.float32)
    a = v0.to(work_dtype)
    b = v1.to(work_dtype)

    def lerp() -> torch.Tensor:
        return ((1.0 - t) * a + t * b).to(out_dtype)

    a_flat = a.reshape(-1).double()
    b_flat = b.reshape(-1).double()
    norm_a = float(torch.linalg.vector_norm(a_flat))
    norm_b = float(torch.linalg.vector_norm(b_flat))
    if norm_a <= eps or norm_b <= eps:
        return lerp()
    dot = float(torch.dot(a_flat, b_flat)) / (norm_a * norm_b)
    if abs(dot) > dot_threshold:
        return lerp()
    theta = math.acos(max(-1.0, min(1.0, dot)))
    sin_theta = math.sin(theta)
    s0 = math.sin((1.0 - t) * theta) / sin_theta
    s1 = math.sin(t * theta) / sin_theta
    return (s0 * a + s1 * b).to(out_dtype)
