"""Checkpoint merging: combine fine-tuned models of one base without further training.

The module imports torch only (PyYAML and rich lazily, for the config file and the command line; it
reads and writes the safetensors format itself, see section 3); it never imports ``rlhf`` or
transformers, so it works on any Hugging Face checkpoint directory. Sections, top to bottom:

1. Pure tensor operations on one parameter at a time. Most work on *task tensors* (task vectors):
   for one parameter, ``task_tensor = finetuned - base``; all task tensors passed to one call have
   the same shape and the result is a task tensor the caller adds back onto the base parameter.
   ``linear``, ``slerp`` and ``model_stock`` take full weights instead. The functions PEFT also has
   match ``peft.utils.merge_utils`` (same pruning counts, same sign election, same order of random
   draws), apart from stricter argument checking: bad arguments raise ``ValueError``.
2. Per-layer schedules: a parameter that varies with depth (mergekit's gradients), for SLERP's
   ``t``, the model weights, density and lambda.
3. Checkpoints: readers of row chunks of one tensor from safetensors shards (plain positioned reads,
   not memory maps) or from a LoRA adapter merged into its base on the fly, and a writer that
   streams rows into sharded safetensors.
4. ``MergeConfig``: the YAML config, checked field by field before anything is read.
5. ``ModelMerger``: merges checkpoint directories into a new Hugging Face directory, streaming:
   every tensor is read in row chunks from each model, merged and written before the next is read,
   so memory stays near a few copies of the largest tensor, never the whole models.
6. ``ModelSoup`` (uniform and greedy soups of models in memory) and ``EnsemblePolicy`` (generation
   by averaging the members' next-token log-probabilities, or majority vote over final answers).
7. The command line: ``python model_merging.py --config configs/merge_ties.yaml``.

Public names:

- ``magnitude_based_pruning``: keep the largest-magnitude fraction of one tensor.
- ``random_prune``: Bernoulli (DARE) drop of one tensor, optional rescaling.
- ``calculate_majority_sign_mask``: TIES sign election on stacked tensors.
- ``disjoint_merge``: TIES disjoint mean over sign-agreeing entries.
- ``linear``: (normalised) weighted average of full weights.
- ``task_arithmetic``: weighted sum of task tensors.
- ``magnitude_prune``: magnitude pruning of each task tensor, then a weighted sum.
- ``ties``: TIES-Merging (trim, elect sign, disjoint merge).
- ``dare_linear``: DARE drop-and-rescale followed by a weighted sum.
- ``dare_ties``: DARE drop-and-rescale followed by sign election and disjoint merge.
- ``slerp``: spherical linear interpolation between two tensors.
- ``model_stock``: Model Stock interpolation between the fine-tuned average and the base.
- ``layer_index``, ``layer_wise_interpolation``, ``setting_for_tensor``: per-layer schedules.
- ``Checkpoint``, ``LoraCheckpoint``, ``SafetensorsWriter``: streaming reads and writes.
- ``MergeConfig``, ``ModelSpec``, ``ModelMerger``, ``MergeResult``, ``MergeError``, ``MERGE_METHODS``.
- ``average_state_dicts``, ``ModelSoup``, ``SoupResult``.
- ``EnsemblePolicy``, ``VoteResult``.
- ``main``: the command line.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import difflib
import functools
import hashlib
import inspect
import json
import math
import os
import re
import shutil
import struct
import sys
import time
from collections.abc import Callable, Collection, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "MERGE_METHODS",
    "Checkpoint",
    "LoraCheckpoint",
    "SafetensorsWriter",
    "EnsemblePolicy",
    "MergeConfig",
    "MergeError",
    "MergeResult",
    "ModelMerger",
    "ModelSoup",
    "ModelSpec",
    "SoupResult",
    "VoteResult",
    "average_state_dicts",
    "calculate_majority_sign_mask",
    "dare_linear",
    "dare_ties",
    "disjoint_merge",
    "layer_index",
    "layer_wise_interpolation",
    "linear",
    "magnitude_based_pruning",
    "magnitude_prune",
    "main",
    "model_stock",
    "random_prune",
    "setting_for_tensor",
    "slerp",
    "task_arithmetic",
    "ties",
]

# The pure tensor functions (section 1): each docstring has a ``Shapes:`` line.
TENSOR_FUNCTIONS = (
    "magnitude_based_pruning", "random_prune", "calculate_majority_sign_mask", "disjoint_merge", "linear",
    "task_arithmetic", "magnitude_prune", "ties", "dare_linear", "dare_ties", "slerp", "model_stock",
)

MAJORITY_SIGN_METHODS = ("total", "frequency")

WeightsLike = Sequence[float] | torch.Tensor
GeneratorLike = torch.Generator | Sequence[torch.Generator] | None


class MergeError(ValueError):
    """A mistake in a merge config or its inputs; the message names the field or tensor and the fix.
    ``fields``: the config entries the mistake is about (``models[1]``, ``models``, ``density``, ...), so
    that a config read from YAML can say where the bad value was given: ``file:line`` or ``command line``
    for a ``key=value`` override."""

    def __init__(self, message: str, fields: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.fields = tuple(fields)


# ==== 1. Pure tensor operations ====================================================================


def _check_density(density: float) -> float:
    """Return ``density`` as a float, or raise if it is not in (0, 1]."""
    try:
        value = float(density)
    except (TypeError, ValueError):
        raise ValueError(f"density must be a number in (0, 1], got {density!r}") from None
    if not (0.0 < value <= 1.0):  # also rejects NaN
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    return value


def _check_sign_method(method: str) -> None:
    if method not in MAJORITY_SIGN_METHODS:
        raise ValueError(f"majority_sign_method must be one of {list(MAJORITY_SIGN_METHODS)}, got {method!r}")


def _check_task_tensors(task_tensors: Sequence[torch.Tensor], what: str = "task_tensors") -> None:
    if isinstance(task_tensors, torch.Tensor):
        raise TypeError(f"{what} must be a list of tensors (one per task), got a single tensor")
    if len(task_tensors) == 0:
        raise ValueError(f"{what} must contain at least one tensor, got 0")
    shape = task_tensors[0].shape
    for i, tensor in enumerate(task_tensors):
        if tensor.shape != shape:
            raise ValueError(f"{what} must all have the same shape: {what}[0] has shape {tuple(shape)} but "
                             f"{what}[{i}] has shape {tuple(tensor.shape)}")


def _check_weights(weights: WeightsLike, num_tasks: int) -> torch.Tensor:
    """Return ``weights`` as a 1-D tensor of length ``num_tasks``, or raise."""
    if isinstance(weights, torch.Tensor):
        w = weights.detach()
        if w.dim() != 1:
            raise ValueError(f"weights must be 1-D (one weight per task), got shape {tuple(w.shape)}")
    else:
        try:
            w = torch.tensor([float(x) for x in weights], dtype=torch.float64)
        except (TypeError, ValueError):
            raise ValueError(f"weights must be a sequence of numbers or a 1-D tensor, got {weights!r}") from None
    if w.shape[0] != num_tasks:
        raise ValueError(f"weights must have one entry per task tensor: got {w.shape[0]} weights for "
                         f"{num_tasks} task_tensors")
    return w


def _apply_weights(stacked: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Multiply task ``i`` of ``stacked`` (tasks on dim 0) by ``weights[i]``.

    The weights are cast to the dtype and device of ``stacked`` so the result keeps the dtype of the
    task tensors.
    """
    w = weights.to(device=stacked.device, dtype=stacked.dtype)
    return stacked * w.view((stacked.shape[0],) + (1,) * (stacked.dim() - 1))


def _generator_for(generator: GeneratorLike, index: int, num_tasks: int) -> torch.Generator | None:
    """One generator for every task (drawn from in task order, as PEFT does with the global state), or
    one per task: the streaming merger gives each task its own so that chunked draws equal whole ones."""
    if generator is None or isinstance(generator, torch.Generator):
        return generator
    if len(generator) != num_tasks:
        raise ValueError(f"generator must be one torch.Generator or one per task tensor: got {len(generator)} "
                         f"generators for {num_tasks} task_tensors")
    return generator[index]


# -- pruning ---------------------------------------------------------------------------------------


def magnitude_based_pruning(tensor: torch.Tensor, density: float) -> torch.Tensor:
    """Keep the largest-magnitude ``density`` fraction of entries, zero the rest.

    This is the "trim" step of TIES-Merging (Yadav et al. 2023, "TIES-Merging: Resolving Interference
    When Merging Models"). The number of kept entries is ``k = int(density * tensor.numel())``
    (truncated, as in PEFT's ``magnitude_based_pruning``); entries are ranked by ``abs`` with
    ``torch.topk``. ``density == 1`` returns an unpruned copy.

    Shapes: ``tensor`` is any shape ``S``; the result has shape ``S`` and the same dtype and device.

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


def random_prune(tensor: torch.Tensor, density: float, rescale: bool,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Randomly keep each entry with probability ``density`` (DARE drop).

    This is the "drop and rescale" step of DARE (Yu et al. 2024, "Language Models are Super Mario:
    Absorbing Abilities from Homologous Models as a Free Lunch"). Each entry is kept independently
    with probability ``density`` (one ``torch.bernoulli`` draw per entry); if ``rescale`` the
    survivors are divided by ``density`` so the expectation of every entry is unchanged.
    ``density == 1`` returns a copy and draws no random numbers (as PEFT does, so random streams stay
    aligned with PEFT).

    ``generator`` is passed to ``torch.bernoulli``; ``None`` uses torch's global random state.

    Shapes: ``tensor`` is any floating shape ``S``; the result has shape ``S`` and the same dtype and
    device.

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


# -- TIES building blocks --------------------------------------------------------------------------


def calculate_majority_sign_mask(tensor: torch.Tensor, method: str = "total") -> torch.Tensor:
    """Elect a sign per entry and mark which tasks agree with it.

    This is the "elect sign" step of TIES-Merging (Yadav et al. 2023, "TIES-Merging: Resolving
    Interference When Merging Models"). Tasks are stacked on dimension 0. With ``method="total"`` the
    elected sign is the sign of the sum of the values over tasks (mass-weighted vote, as in the
    paper); with ``method="frequency"`` it is the sign of the sum of signs (one vote per task). A tie
    (sum exactly 0) elects ``+1``. The mask is ``True`` where a task's sign equals the elected sign,
    so zero entries (e.g. trimmed ones) never count as agreeing.

    Shapes: ``tensor`` is ``(num_tasks, *S)``; the result is a bool tensor of shape
    ``(num_tasks, *S)``.

    Raises:
        ValueError: if ``method`` is not ``"total"`` or ``"frequency"``.
    """
    if method not in MAJORITY_SIGN_METHODS:
        raise ValueError(f"method must be one of {list(MAJORITY_SIGN_METHODS)}, got {method!r}")
    sign = tensor.sign()
    vote = tensor.sum(dim=0) if method == "total" else sign.sum(dim=0)
    elected = torch.where(vote >= 0, 1, -1).to(sign.dtype)
    return sign == elected


def disjoint_merge(task_tensors: torch.Tensor | Sequence[torch.Tensor],
                   majority_sign_mask: torch.Tensor) -> torch.Tensor:
    """Average each entry over the tasks that agree with the elected sign.

    This is the "disjoint merge" step of TIES-Merging (Yadav et al. 2023, "TIES-Merging: Resolving
    Interference When Merging Models"): for every entry, the values of the tasks whose mask is
    ``True`` are summed and divided by the number of such tasks (at least 1, so an entry with no
    agreeing task becomes 0). As in PEFT, the divisor is the *count* of agreeing tasks, not the sum of
    their weights; callers that want weights pass already-weighted task tensors.

    Shapes: ``task_tensors`` is a tensor ``(num_tasks, *S)`` or a list of ``num_tasks`` tensors of
    shape ``S``; ``majority_sign_mask`` is ``(num_tasks, *S)``; the result has shape ``S``.

    Raises:
        ValueError: if the shapes of ``task_tensors`` and ``majority_sign_mask`` do not match.
    """
    if isinstance(task_tensors, torch.Tensor):
        stacked = task_tensors
    else:
        _check_task_tensors(task_tensors)
        stacked = torch.stack(list(task_tensors), dim=0)
    if stacked.shape != majority_sign_mask.shape:
        raise ValueError(f"majority_sign_mask must have the same shape as the stacked task_tensors "
                         f"{tuple(stacked.shape)}, got {tuple(majority_sign_mask.shape)}")
    mask = majority_sign_mask.to(stacked.dtype)
    total = (stacked * mask).sum(dim=0)
    count = mask.sum(dim=0)
    return total / torch.clamp(count, min=1.0)


# -- merge methods ---------------------------------------------------------------------------------


def linear(tensors: Sequence[torch.Tensor], weights: WeightsLike, normalize: bool = True) -> torch.Tensor:
    """Weighted average of full weights (a uniform "model soup" when the weights are equal).

    Model soups (Wortsman et al. 2022, "Model soups: averaging weights of multiple fine-tuned models
    improves accuracy without increasing inference time"): ``merged = sum_i w_i * tensors[i]``,
    divided by ``sum_i w_i`` when ``normalize`` (so weights 1, 1, 2 mean 25%, 25%, 50%).

    Shapes: ``tensors`` is a list of ``n`` tensors of shape ``S`` (full weights, not task tensors);
    ``weights`` has length ``n``; the result has shape ``S`` and the tensors' dtype.

    Raises:
        ValueError: on an empty list, mismatched shapes or weight count, or weights summing to 0
            with ``normalize``.
    """
    _check_task_tensors(tensors, "tensors")
    w = _check_weights(weights, len(tensors))
    if normalize:
        total = float(w.double().sum())
        if total == 0.0:
            raise ValueError("weights sum to 0, so they cannot be normalised; set normalize to false or change them")
        w = w.double() / total
    return _apply_weights(torch.stack(list(tensors), dim=0), w).sum(dim=0)


def task_arithmetic(task_tensors: Sequence[torch.Tensor], weights: WeightsLike) -> torch.Tensor:
    """Weighted sum of task tensors.

    Task Arithmetic (Ilharco et al. 2023, "Editing Models with Task Arithmetic"): ``merged = sum_i
    weights[i] * task_tensors[i]``. Weights are used as given (not normalised); negative weights
    implement "task negation". ``weights`` is a sequence of floats or a 1-D tensor; it is cast to the
    dtype and device of the task tensors.

    Shapes: ``task_tensors`` is a list of ``n`` tensors of shape ``S``; ``weights`` has length ``n``;
    the result has shape ``S``.

    Raises:
        ValueError: if the list is empty, the shapes differ, or the number of weights is not the
            number of task tensors.
    """
    _check_task_tensors(task_tensors)
    w = _check_weights(weights, len(task_tensors))
    return _apply_weights(torch.stack(list(task_tensors), dim=0), w).sum(dim=0)


def magnitude_prune(task_tensors: Sequence[torch.Tensor], weights: WeightsLike, density: float) -> torch.Tensor:
    """Magnitude-prune every task tensor, then take their weighted sum.

    The TIES-Merging "trim" step alone (Yadav et al. 2023, "TIES-Merging: Resolving Interference When
    Merging Models"), followed by Task Arithmetic (Ilharco et al. 2023) without sign election; PEFT's
    ``magnitude_prune`` combination. Each task tensor keeps its ``int(density * numel)`` largest
    magnitudes (``magnitude_based_pruning``).

    Shapes: ``task_tensors`` is a list of ``n`` tensors of shape ``S``; ``weights`` has length ``n``;
    the result has shape ``S``.

    Raises:
        ValueError: on bad ``density`` (not in (0, 1]), mismatched shapes or weight count.
    """
    density = _check_density(density)
    _check_task_tensors(task_tensors)
    w = _check_weights(weights, len(task_tensors))
    trimmed = [magnitude_based_pruning(t, density) for t in task_tensors]
    return _apply_weights(torch.stack(trimmed, dim=0), w).sum(dim=0)


def _sign_elect_and_merge(stacked: torch.Tensor, weights: torch.Tensor, majority_sign_method: str) -> torch.Tensor:
    # Sign is elected from the (pruned) *unweighted* task tensors, then the weighted tensors are
    # averaged over the agreeing tasks (PEFT order).
    mask = calculate_majority_sign_mask(stacked, method=majority_sign_method)
    weighted = _apply_weights(stacked, weights)
    return disjoint_merge(weighted, mask)


def ties(task_tensors: Sequence[torch.Tensor], weights: WeightsLike, density: float,
         majority_sign_method: str = "total") -> torch.Tensor:
    """Merge task tensors with TIES-Merging.

    TIES-Merging (Yadav et al. 2023, "TIES-Merging: Resolving Interference When Merging Models"), in
    three steps:

    1. **Trim**: ``magnitude_based_pruning`` each task tensor to ``density``.
    2. **Elect sign**: ``calculate_majority_sign_mask`` over the trimmed, *unweighted* task tensors
       (``"total"`` or ``"frequency"``).
    3. **Disjoint merge**: multiply each trimmed task tensor by its weight, then ``disjoint_merge``:
       per entry, the mean over the tasks whose sign agrees with the elected sign.

    As in PEFT, weights scale the task tensors but the mean divides by the number of agreeing tasks,
    so with all weights equal to ``w`` the result is ``w`` times the plain TIES mean.

    Shapes: ``task_tensors`` is a list of ``n`` tensors of shape ``S``; ``weights`` has length ``n``;
    the result has shape ``S``.

    Raises:
        ValueError: on bad ``density`` (not in (0, 1]), an unknown ``majority_sign_method``,
            mismatched shapes or weight count.
    """
    density = _check_density(density)
    _check_sign_method(majority_sign_method)
    _check_task_tensors(task_tensors)
    w = _check_weights(weights, len(task_tensors))
    trimmed = [magnitude_based_pruning(t, density) for t in task_tensors]
    return _sign_elect_and_merge(torch.stack(trimmed, dim=0), w, majority_sign_method)


def _dare_drop(task_tensors: Sequence[torch.Tensor], density: float, generator: GeneratorLike) -> list[torch.Tensor]:
    n = len(task_tensors)
    gens = [_generator_for(generator, i, n) for i in range(n)]  # checked before any draw
    return [random_prune(t, density, rescale=True, generator=g) for t, g in zip(task_tensors, gens)]


def dare_linear(task_tensors: Sequence[torch.Tensor], weights: WeightsLike, density: float,
                generator: GeneratorLike = None) -> torch.Tensor:
    """Merge task tensors with DARE followed by a weighted sum.

    DARE (Yu et al. 2024, "Language Models are Super Mario: Absorbing Abilities from Homologous Models
    as a Free Lunch"): each task tensor is passed through ``random_prune(t, density, rescale=True)``
    (drop entries with probability ``1 - density``, divide survivors by ``density``), then combined
    with Task Arithmetic (weighted sum). Random draws are made task by task, in list order, from
    ``generator`` (or torch's global state); a list of generators gives each task its own. With
    ``density == 1`` this equals ``task_arithmetic``.

    Shapes: ``task_tensors`` is a list of ``n`` tensors of shape ``S``; ``weights`` has length ``n``;
    the result has shape ``S``.

    Raises:
        ValueError: on bad ``density`` (not in (0, 1]), mismatched shapes, weight or generator count.
    """
    density = _check_density(density)
    _check_task_tensors(task_tensors)
    w = _check_weights(weights, len(task_tensors))
    dropped = _dare_drop(task_tensors, density, generator)
    return _apply_weights(torch.stack(dropped, dim=0), w).sum(dim=0)


def dare_ties(task_tensors: Sequence[torch.Tensor], weights: WeightsLike, density: float,
              majority_sign_method: str = "total", generator: GeneratorLike = None) -> torch.Tensor:
    """Merge task tensors with DARE pruning and TIES sign election.

    DARE (Yu et al. 2024, "Language Models are Super Mario: Absorbing Abilities from Homologous Models
    as a Free Lunch") replaces the TIES trim step: each task tensor goes through ``random_prune(t,
    density, rescale=True)``; then the TIES-Merging (Yadav et al. 2023) steps follow: elect sign on
    the dropped, unweighted tensors, weight them, and ``disjoint_merge``. Random draws are made task
    by task, in list order, from ``generator`` (or torch's global state); a list of generators gives
    each task its own.

    Shapes: ``task_tensors`` is a list of ``n`` tensors of shape ``S``; ``weights`` has length ``n``;
    the result has shape ``S``.

    Raises:
        ValueError: on bad ``density`` (not in (0, 1]), an unknown ``majority_sign_method``,
            mismatched shapes, weight or generator count.
    """
    density = _check_density(density)
    _check_sign_method(majority_sign_method)
    _check_task_tensors(task_tensors)
    w = _check_weights(weights, len(task_tensors))
    dropped = _dare_drop(task_tensors, density, generator)
    return _sign_elect_and_merge(torch.stack(dropped, dim=0), w, majority_sign_method)


def _check_t(t: float) -> float:
    try:
        t = float(t)
    except (TypeError, ValueError):
        raise ValueError(f"t must be a number in [0, 1], got {t!r}") from None
    if not (0.0 <= t <= 1.0):
        raise ValueError(f"t must be in [0, 1], got {t!r}")
    return t


def _slerp_coefficients(t: float, dot: float, norm0: float, norm1: float, dot_threshold: float,
                        eps: float) -> tuple[float, float]:
    """``(s0, s1)`` with ``slerp = s0 * v0 + s1 * v1``, from the dot product and norms of the flattened
    vectors; ``(1 - t, t)`` (linear interpolation) for near-parallel or zero vectors. Shared by
    ``slerp`` and the streaming merger, which accumulates the dot product and norms chunk by chunk."""
    if norm0 <= eps or norm1 <= eps:
        return 1.0 - t, t
    cos = dot / (norm0 * norm1)
    if abs(cos) > dot_threshold:
        return 1.0 - t, t
    theta = math.acos(max(-1.0, min(1.0, cos)))
    sin_theta = math.sin(theta)
    return math.sin((1.0 - t) * theta) / sin_theta, math.sin(t * theta) / sin_theta


def slerp(t: float, v0: torch.Tensor, v1: torch.Tensor, dot_threshold: float = 0.9995,
          eps: float = 1e-8) -> torch.Tensor:
    """Spherical linear interpolation between two tensors.

    SLERP (Shoemake 1985, "Animating Rotation with Quaternion Curves"), as mergekit applies it to
    model weights. The tensors are treated as flattened vectors. With ``theta`` the angle between
    ``v0`` and ``v1``::

        slerp(t) = sin((1 - t) * theta) / sin(theta) * v0 + sin(t * theta) / sin(theta) * v1

    The original (unnormalised) vectors are interpolated, so for unit vectors the result stays on the
    unit sphere. When the vectors are nearly colinear (``|cos theta| > dot_threshold``) or either has
    norm ``<= eps``, it falls back to linear interpolation ``(1 - t) * v0 + t * v1``. The computation
    is done in at least float32 (dot product and norms in float64) and the result is cast back to the
    promoted dtype of ``v0`` and ``v1``.

    Shapes: ``v0`` and ``v1`` have the same shape ``S``; ``t`` is a scalar in [0, 1]; the result has
    shape ``S``.

    Raises:
        ValueError: if ``t`` is not in [0, 1] or the shapes differ.
    """
    t = _check_t(t)
    if v0.shape != v1.shape:
        raise ValueError(f"v0 and v1 must have the same shape, got {tuple(v0.shape)} and {tuple(v1.shape)}")
    out_dtype = torch.result_type(v0, v1)
    work_dtype = torch.promote_types(out_dtype, torch.float32)
    a = v0.to(work_dtype)
    b = v1.to(work_dtype)
    a64, b64 = a.reshape(-1).double(), b.reshape(-1).double()
    s0, s1 = _slerp_coefficients(t, float(torch.dot(a64, b64)), float(torch.linalg.vector_norm(a64)),
                                 float(torch.linalg.vector_norm(b64)), dot_threshold, eps)
    return (s0 * a + s1 * b).to(out_dtype)


def _model_stock_ratio(cos_theta: float, k: int) -> float:
    """Model Stock's interpolation ratio ``t = k cos / (1 + (k - 1) cos)`` (Jang et al. 2024, eq. 6); 0 (stay
    at the base) where the denominator vanishes (k = 2 exactly opposite task vectors, whose mean is the base)."""
    denominator = 1.0 + (k - 1) * cos_theta
    return 0.0 if abs(denominator) < 1e-12 else k * cos_theta / denominator


def _pair_cosine(dot: float, norm_i: float, norm_j: float) -> float:
    # mergekit clamps the norm product at 1e-6 and the cosine to [-1, 1]
    return max(-1.0, min(1.0, dot / max(norm_i * norm_j, 1e-6)))


def model_stock(base: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Model Stock: move from the base towards the average of the fine-tuned weights.

    Model Stock (Jang et al. 2024, "Model Stock: All we need is just a few fine-tuned models"), per
    tensor as mergekit applies it: with task vectors ``d_i = tensors[i] - base`` (flattened),
    ``cos`` is the mean over all pairs ``i < j`` of their cosine similarity (mergekit's reading of the
    paper's single angle), ``t = k cos / (1 + (k - 1) cos)`` for ``k`` fine-tuned models, and
    ``merged = t * mean(tensors) + (1 - t) * base``. Computed in float32 (dot products in float64);
    the result has the tensors' dtype.

    Shapes: ``base`` has shape ``S``; ``tensors`` is a list of ``k >= 2`` tensors of shape ``S`` (full
    weights); the result has shape ``S``.

    Raises:
        ValueError: with fewer than two fine-tuned tensors or mismatched shapes.
    """
    _check_task_tensors(tensors, "tensors")
    if len(tensors) < 2:
        raise ValueError(f"model_stock needs at least 2 fine-tuned tensors, got {len(tensors)}")
    if base.shape != tensors[0].shape:
        raise ValueError(f"base has shape {tuple(base.shape)} but tensors have {tuple(tensors[0].shape)}")
    b = base.float()
    deltas = [(t.float() - b).reshape(-1).double() for t in tensors]
    norms = [float(torch.linalg.vector_norm(d)) for d in deltas]
    cosines = [_pair_cosine(float(torch.dot(deltas[i], deltas[j])), norms[i], norms[j])
               for i in range(len(deltas)) for j in range(i + 1, len(deltas))]
    ratio = _model_stock_ratio(sum(cosines) / len(cosines), len(tensors))
    mean = torch.stack([t.float() for t in tensors]).mean(dim=0)
    return (ratio * mean + (1.0 - ratio) * b).to(tensors[0].dtype)


# ==== 2. Per-layer schedules ========================================================================

# `model.layers.3.`, `transformer.h.3.`, `backbone.layers.3.`, `encoder.layer.3.`, `blocks.3.`
LAYER_PATTERN = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)\.")
# non-layer tensors that come before the layers (mergekit's "pre weights"); the rest come after
EMBEDDING_MARKERS = ("embed", "wte", "wpe", "word_embeddings", "position_embeddings")

Setting = float | list  # a number, anchors over depth, or [{"filter": substring, "value": ...}, ...]


def layer_index(name: str) -> int | None:
    """The transformer block a parameter belongs to, parsed from its name (``model.layers.3.mlp...`` ->
    3, also ``h.N.`` of GPT-2, ``blocks.N.``, ``layer.N.``), or None for embeddings, final norms and
    heads."""
    match = LAYER_PATTERN.search(name)
    return int(match.group(1)) if match else None


def _gradient_value(anchors: Sequence[float], position: float) -> float:
    # mergekit's evaluate_setting: anchors spread evenly over [0, 1], linear in between
    scaled = position * (len(anchors) - 1)
    low = int(scaled)
    high = min(len(anchors) - 1, low + 1)
    frac = scaled - low
    return (1.0 - frac) * float(anchors[low]) + frac * float(anchors[high])


def layer_wise_interpolation(anchors: Sequence[float], num_layers: int) -> list[float]:
    """One value per layer, interpolated linearly over depth from a list of anchor values.

    mergekit's "gradient" parameters (Goddard et al. 2024, "Arcee's MergeKit: A Toolkit for Merging
    Large Language Models"), used for example to vary SLERP's ``t`` with depth: layer ``l`` of ``N``
    sits at position ``l / (N - 1)`` (1 when ``N == 1``) of the anchors, which are spread evenly over
    [0, 1]; ``[0, 1]`` over 5 layers gives ``0, 0.25, 0.5, 0.75, 1`` and ``[0, 0.5, 0.3]`` gives
    ``0, 0.25, 0.5, 0.4, 0.3``. A single anchor is a constant.

    Raises:
        ValueError: on an empty anchor list or ``num_layers < 1``.
    """
    if len(anchors) == 0:
        raise ValueError("anchors must hold at least one value")
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    return [_gradient_value(anchors, layer / (num_layers - 1) if num_layers > 1 else 1.0)
            for layer in range(num_layers)]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def setting_for_tensor(setting: Setting, name: str, num_layers: int) -> float:
    """The value of a merge parameter for one tensor.

    ``setting`` is a number (every tensor), a list of anchors (``layer_wise_interpolation`` over depth;
    following mergekit, tensors outside the layers take the first anchor when they are embeddings,
    which come before the layers, and the last one otherwise: final norm, ``lm_head``), or a list of
    ``{"filter": substring, "value": setting}`` entries, mergekit's conditional form, where the first
    entry whose filter occurs in the tensor name (or has no filter, or ``"*"``) applies.

    Raises:
        ValueError: if no conditional entry matches the tensor or the setting has another form.
    """
    if _is_number(setting):
        return float(setting)
    if isinstance(setting, (list, tuple)) and setting and all(_is_number(v) for v in setting):
        layer = layer_index(name)
        if layer is None:
            return float(setting[0] if any(m in name for m in EMBEDDING_MARKERS) else setting[-1])
        return layer_wise_interpolation(setting, max(num_layers, layer + 1))[layer]
    if isinstance(setting, (list, tuple)) and setting and all(isinstance(v, dict) for v in setting):
        for entry in setting:
            pattern = entry.get("filter")
            if pattern in (None, "*") or pattern in name:
                return setting_for_tensor(entry["value"], name, num_layers)
        raise ValueError(f"no entry of {setting!r} applies to tensor {name}; add a last entry without a filter")
    raise ValueError(f"a merge parameter is a number, a list of numbers or a list of {{filter, value}} entries, "
                     f"got {setting!r}")


# ==== 3. Checkpoints: streaming readers, LoRA adapters, a streaming safetensors writer ===============

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
SAFETENSORS_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}
OUTPUT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# what rlhf saves beside a scoring model (reward head, process reward model, reward-model ensemble); a PPO policy's
# value_head.safetensors is not one: the policy beside it merges as any other
SCORER_FILES = ("reward_head.safetensors", "reward_config.json", "prm_config.json", "ensemble.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "vocab.txt", "spiece.model", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json")
LORA_PREFIX = "base_model.model."


@dataclass(frozen=True)
class TensorInfo:
    """A stored tensor's dtype and shape, from the safetensors header (no data read)."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def _read_safetensors_header(path: Path, label: str) -> tuple[dict[str, TensorInfo], dict[str, int]]:
    """(tensor infos, file offset of each tensor's bytes) from a safetensors file's header: an 8-byte
    little-endian length, then that many bytes of JSON giving each tensor's dtype, shape and byte range."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < length <= min(size - 8, 100_000_000):
            raise MergeError(f"{label}: {path.name} is not a safetensors file; save the model again with "
                             "save_pretrained")
        try:
            header = json.loads(handle.read(length))
        except ValueError as err:
            raise MergeError(f"{label}: {path.name} has a corrupt safetensors header ({err})") from None
    if not isinstance(header, dict):
        raise MergeError(f"{label}: {path.name} has a corrupt safetensors header (not a JSON object)")
    infos, offsets = {}, {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:  # a hand-edited or foreign header: a wrong entry is this file's mistake, not a crash
            dtype, shape = entry["dtype"], tuple(map(int, entry["shape"]))
            begin, end = map(int, entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise MergeError(f"{label}: tensor {key} in {path.name} has a corrupt header entry (dtype, shape and "
                             "data_offsets expected)") from None
        if dtype not in SAFETENSORS_DTYPES:
            raise MergeError(f"{label}: tensor {key} has dtype {dtype}, which this merger cannot read")
        info = TensorInfo(SAFETENSORS_DTYPES[dtype], shape)
        if end - begin != info.numel * info.dtype.itemsize or 8 + length + end > size:
            raise MergeError(f"{label}: tensor {key} in {path.name} has inconsistent offsets (truncated file?); copy "
                             "or save the model again")
        infos[key], offsets[key] = info, 8 + length + begin
    return infos, offsets


class _RowReader:
    """Rows ``[start, stop)`` of one tensor, read with plain positioned reads into fresh memory.

    Not ``safe_open``: it memory-maps the file copy-on-write, so every page a merge touches stays
    resident until the handle closes (the whole tensor of every model, counted in the process's
    memory) and an in-place edit of a returned tensor changes what the next read of it returns.
    """

    def __init__(self, handle: Any, offset: int, info: TensorInfo) -> None:
        self.handle, self.offset, self.info = handle, offset, info
        self.row_bytes = math.prod(info.shape[1:]) * info.dtype.itemsize

    def _read(self, start: int, stop: int) -> torch.Tensor:
        shape = (stop - start, *self.info.shape[1:]) if self.info.shape else ()
        out = torch.empty(shape, dtype=self.info.dtype)
        buffer = out.reshape(-1).view(torch.uint8).numpy()
        self.handle.seek(self.offset + start * self.row_bytes)
        if self.handle.readinto(buffer) != buffer.nbytes:
            raise MergeError(f"{self.handle.name}: file ended inside a tensor (truncated checkpoint?)")
        return out

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """float32 rows (a 0-d tensor is read whole); the caller owns them."""
        return self._read(start, stop).float()

    def whole(self) -> torch.Tensor:
        """The tensor in its stored dtype (non-floating tensors are copied, not merged)."""
        return self._read(0, self.info.shape[0] if self.info.shape else 1)


class Checkpoint:
    """A Hugging Face model directory's safetensors weights (one file or an index of shards), read
    lazily: ``open(name)`` gives a reader of row chunks of one tensor; nothing else is held."""

    kind = "full"

    def __init__(self, directory: Path, label: str) -> None:
        self.directory, self.label = Path(directory), label
        self.files: dict[str, Path] = {}
        self.offsets: dict[str, int] = {}
        self.infos: dict[str, TensorInfo] = {}
        for file in self._weight_files():
            infos, offsets = _read_safetensors_header(file, label)
            self.infos.update(infos)
            self.offsets.update(offsets)
            self.files.update(dict.fromkeys(infos, file))

    def _weight_files(self) -> list[Path]:
        index = self.directory / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as err:
                raise MergeError(f"{self.label}: {index} is not a safetensors index ({err}); save the model "
                                 "again") from None
            files = list(dict.fromkeys(self.directory / f for f in weight_map.values()))
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise MergeError(f"{self.label}: shard {missing[0]} listed in {index.name} is missing; copy it "
                                 "there or save the model again")
            return files
        if (self.directory / "model.safetensors").is_file():
            return [self.directory / "model.safetensors"]
        if any(self.directory.glob("pytorch_model*.bin")):
            raise MergeError(f"{self.label}: only pickle weights (pytorch_model.bin), which are never loaded here; "
                             "convert them with AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir) "
                             "(safetensors)")
        raise MergeError(f"{self.label}: no model.safetensors or model.safetensors.index.json in {self.directory}; "
                         "give the directory a model was saved to (save_pretrained)")

    @property
    def names(self) -> list[str]:
        return list(self.infos)

    @property
    def config(self) -> dict | None:
        """config.json, read afresh (the caller may change it), or None without one."""
        path = self.directory / "config.json"
        if not path.is_file():
            return None
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as err:  # UnicodeDecodeError too
            raise MergeError(f"{self.label}: config.json is not valid JSON ({err}); fix it or save the model "
                             "again") from None
        if not isinstance(config, dict):
            raise MergeError(f"{self.label}: config.json is not a JSON object; fix it or save the model again")
        return config

    @property
    def config_dir(self) -> Path:
        return self.directory

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[_RowReader]:
        with open(self.files[name], "rb") as handle:
            yield _RowReader(handle, self.offsets[name], self.infos[name])


@dataclass(frozen=True)
class _LoraFactor:
    a_key: str
    b_key: str
    scale: float
    transposed: bool  # fan_in_fan_out (GPT-2 Conv1D) and embeddings store (B @ A)^T


class _LoraRowReader:
    """Rows of ``W + scale * B @ A`` (or its transpose) for one LoRA-adapted weight: the base rows plus
    the same rows of the low-rank product, computed from the small A and B factors."""

    def __init__(self, base: _RowReader, a: torch.Tensor, b: torch.Tensor, factor: _LoraFactor) -> None:
        self.base, self.a, self.b, self.factor, self.info = base, a, b, factor, base.info

    def rows(self, start: int, stop: int) -> torch.Tensor:
        if self.factor.transposed:  # W[r] = (B @ A)^T[r] = A[:, r]^T @ B^T
            delta = self.a[:, start:stop].t() @ self.b.t()
        else:
            delta = self.b[start:stop] @ self.a
        return self.base.rows(start, stop) + delta * self.factor.scale

    def whole(self) -> torch.Tensor:
        return self.rows(0, self.info.shape[0]).to(self.info.dtype)


class LoraCheckpoint:
    """A PEFT LoRA adapter directory seen as the full model ``base + scale * B @ A`` (what PEFT's
    ``merge_and_unload`` computes), tensor by tensor, without importing peft (Hu et al. 2022, "LoRA:
    Low-Rank Adaptation of Large Language Models"; rsLoRA's ``alpha / sqrt(r)`` scale, Kalajdzievski
    2023). ``modules_to_save`` and saved embedding layers replace the base's tensors."""

    kind = "lora"
    UNSUPPORTED = {"use_dora": "DoRA adapters", "lora_bias": "LoRA biases (lora_bias)",
                   "target_parameters": "LoRA on parameters (target_parameters)",
                   "trainable_token_indices": "trainable tokens", "layer_replication": "layer replication"}

    def __init__(self, directory: Path, label: str, base: Checkpoint) -> None:
        self.directory, self.label, self.base = Path(directory), label, base
        self.adapter_config = _read_adapter_config(self.directory, label)
        self.file = self.directory / "adapter_model.safetensors"
        if not self.file.is_file():
            raise MergeError(f"{label}: no adapter_model.safetensors in {self.directory} (pickled adapter_model.bin "
                             "is never loaded; re-save the adapter with safe_serialization)")
        self.adapter_infos, self.adapter_offsets = _read_safetensors_header(self.file, label)
        self.infos = base.infos
        self.factors: dict[str, _LoraFactor] = {}
        self.replacements: dict[str, str] = {}  # base tensor name -> adapter key
        factors: dict[str, dict] = {}
        for key in self.adapter_infos:
            self._classify(key, factors)
        for module, parts in factors.items():
            self._add_factor(module, parts)
        for name, key in self.replacements.items():
            self._check_target(name, self.adapter_infos[key].shape, key)

    def _classify(self, key: str, factors: dict[str, dict]) -> None:
        rest = key[len(LORA_PREFIX):] if key.startswith(LORA_PREFIX) else None
        linear = re.fullmatch(r"(.+)\.lora_([AB])\.weight", rest or "")
        embedding = re.fullmatch(r"(.+)\.lora_embedding_([AB])", rest or "")
        saved_base = re.fullmatch(r"(.+)\.base_layer\.(weight|bias)", rest or "")
        if linear or embedding:
            match = linear or embedding
            parts = factors.setdefault(match.group(1), {"embedding": bool(embedding)})
            parts[match.group(2)] = key
        elif saved_base:  # PEFT saves the embedding layers it adapted (save_embedding_layers)
            self.replacements[f"{saved_base.group(1)}.{saved_base.group(2)}"] = key
        elif rest is None or "lora_" in rest or "modules_to_save" in rest:
            raise MergeError(f"{self.label}: adapter tensor {key} is not a LoRA factor this merger knows; merge the "
                             "adapter with peft's merge_and_unload() and list the saved model instead")
        else:  # modules_to_save: a full replacement of the base tensor
            self.replacements[rest] = key

    def _add_factor(self, module: str, parts: dict) -> None:
        if "A" not in parts or "B" not in parts:
            raise MergeError(f"{self.label}: adapter has only one of lora_A / lora_B for {module}")
        a_shape, b_shape = self.adapter_infos[parts["A"]].shape, self.adapter_infos[parts["B"]].shape
        rank = a_shape[0]  # rank_pattern's r for this module, as saved
        config = self.adapter_config
        alpha = float(config.get("lora_alpha", 8))
        for pattern, value in (config.get("alpha_pattern") or {}).items():
            if re.match(rf"(.*\.)?({pattern})$", module):  # peft.utils.other.get_pattern_key
                alpha = float(value)
                break
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        transposed = parts["embedding"] or bool(config.get("fan_in_fan_out"))
        name = f"{module}.weight"
        self.factors[name] = _LoraFactor(parts["A"], parts["B"], scale, transposed)
        delta_shape = (a_shape[1], b_shape[0]) if transposed else (b_shape[0], a_shape[1])
        self._check_target(name, delta_shape, parts["A"])

    def _check_target(self, name: str, shape: tuple[int, ...], key: str) -> None:
        if name not in self.base.infos:
            raise MergeError(f"{self.label}: adapter tensor {key} adapts {name}, which the base "
                             f"({self.base.directory}) does not have; is it the adapter's base model?")
        if self.base.infos[name].shape != shape:
            raise MergeError(f"{self.label}: adapter tensor {key} gives {name} shape {_shape(shape)}, the base has "
                             f"{_shape(self.base.infos[name].shape)} (resized embeddings are not supported)")

    @property
    def names(self) -> list[str]:
        return self.base.names

    @property
    def config(self) -> dict | None:
        return self.base.config

    @property
    def config_dir(self) -> Path:
        return self.base.directory

    def _adapter_reader(self, handle: Any, key: str) -> _RowReader:
        return _RowReader(handle, self.adapter_offsets[key], self.adapter_infos[key])

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[_RowReader | _LoraRowReader]:
        factor = self.factors.get(name)
        with contextlib.ExitStack() as stack:
            if name in self.replacements or factor is not None:
                adapter = stack.enter_context(open(self.file, "rb"))
            if name in self.replacements:  # modules_to_save, or a saved embedding (then adapted below too)
                base = self._adapter_reader(adapter, self.replacements[name])
            else:
                base = stack.enter_context(self.base.open(name))
            if factor is None:
                yield base
                return
            a = self._adapter_reader(adapter, factor.a_key).rows(0, self.adapter_infos[factor.a_key].shape[0])
            b = self._adapter_reader(adapter, factor.b_key).rows(0, self.adapter_infos[factor.b_key].shape[0])
            yield _LoraRowReader(base, a, b, factor)


def _read_adapter_config(directory: Path, label: str) -> dict:
    try:
        config = json.loads((directory / "adapter_config.json").read_text())
    except ValueError as err:
        raise MergeError(f"{label}: adapter_config.json is not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise MergeError(f"{label}: adapter_config.json is not a JSON object; save the adapter again")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise MergeError(f"{label}: PEFT adapter type {kind} cannot be merged here (only LoRA); merge it with peft's "
                         "merge_and_unload() and list the saved model instead")
    for key, what in LoraCheckpoint.UNSUPPORTED.items():
        if config.get(key):
            raise MergeError(f"{label}: {what} are not supported by the streaming merge; merge the adapter with "
                             "peft's merge_and_unload() and list the saved model instead")
    return config


def _parse_size(value: int | str, field_name: str = "max_shard_size") -> int:
    """Bytes from ``500000000``, ``"500MB"`` or ``"2GiB"`` (decimal units, as Hugging Face's save_pretrained)."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(value), flags=re.IGNORECASE)
        if not match:
            raise MergeError(f"{field_name} must be a number of bytes or a size such as 500MB or 5GB, got {value!r}",
                             (field_name,))
        unit = (match.group(2) or "B").upper()
        power = "BKMGT".index(unit[0]) if unit != "B" else 0
        size = int(float(match.group(1)) * ((1024 if "I" in unit else 1000) ** power))
    if size < 1:
        raise MergeError(f"{field_name} must be positive, got {value!r}", (field_name,))
    return size


@dataclass(frozen=True)
class _OutputTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _plan_shards(tensors: Sequence[_OutputTensor], max_bytes: int) -> list[list[_OutputTensor]]:
    """Consecutive groups of at most ``max_bytes`` (a larger tensor gets a shard of its own), as
    transformers' ``save_pretrained`` shards."""
    shards: list[list[_OutputTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards


class SafetensorsWriter:
    """Writes planned tensors into sharded safetensors files chunk by chunk, never holding a tensor.

    The safetensors format is an 8-byte little-endian header length, a JSON header giving every
    tensor's dtype, shape and byte range, then the raw little-endian bytes. Shapes and dtypes are known
    before any value is computed, so each shard's header is written first and the merged rows are
    appended as they come. One shard is ``model.safetensors``; several are
    ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``, as transformers writes.
    """

    def __init__(self, directory: Path, tensors: Sequence[_OutputTensor], max_shard_bytes: int) -> None:
        self.directory = Path(directory)
        self.shards = _plan_shards(tensors, max_shard_bytes)
        count = len(self.shards)
        self.file_names = (["model.safetensors"] if count == 1 else
                           [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)])
        self._order = iter([(i, t) for i, shard in enumerate(self.shards) for t in shard])
        self._shard = -1
        self._file: Any = None
        self._current: _OutputTensor | None = None
        self._remaining = 0

    def begin(self, name: str) -> None:
        shard, tensor = next(self._order)
        if tensor.name != name:
            raise RuntimeError(f"tensors written out of order: expected {tensor.name}, got {name}")
        if shard != self._shard:
            self._open_shard(shard)
        self._current, self._remaining = tensor, tensor.nbytes

    def write(self, chunk: torch.Tensor) -> None:
        if chunk.dtype != self._current.dtype:
            raise RuntimeError(f"{self._current.name}: chunk dtype {chunk.dtype}, planned {self._current.dtype}")
        data = chunk.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        if data.nbytes > self._remaining:
            raise RuntimeError(f"{self._current.name}: more bytes than its planned shape")
        self._file.write(data)  # torch is little-endian on every supported platform, as safetensors wants
        self._remaining -= data.nbytes

    def end(self) -> None:
        if self._remaining:
            raise RuntimeError(f"{self._current.name}: {self._remaining} bytes short of its planned shape")

    def finish(self) -> int:
        """Close the last shard and write the index; returns the total bytes of tensor data."""
        if next(self._order, None) is not None:
            raise RuntimeError("not every planned tensor was written")
        self._close()
        total = sum(t.nbytes for shard in self.shards for t in shard)
        if len(self.shards) > 1:
            weight_map = {t.name: self.file_names[i] for i, shard in enumerate(self.shards) for t in shard}
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return total

    def _open_shard(self, shard: int) -> None:
        self._close()
        self._shard = shard
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for tensor in self.shards[shard]:
            header[tensor.name] = {"dtype": SAFETENSORS_CODES[tensor.dtype], "shape": list(tensor.shape),
                                   "data_offsets": [offset, offset + tensor.nbytes]}
            offset += tensor.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self._file = open(self.directory / self.file_names[shard], "wb")  # closed in _close()
        self._file.write(struct.pack("<Q", len(raw)) + raw)

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def abort(self) -> None:
        self._close()


# ==== 4. MergeConfig ================================================================================


@dataclass(frozen=True)
class MethodSpec:
    """What a merge method needs from the config: a base model, how many models, which parameters."""

    needs_base: bool
    min_models: int
    uses: tuple[str, ...]
    required: tuple[str, ...] = ()


_TASK_VECTOR_PARAMS = ("weight", "lambda")
METHOD_SPECS: dict[str, MethodSpec] = {
    "linear": MethodSpec(needs_base=False, min_models=1, uses=("weight", "normalize")),
    "task_arithmetic": MethodSpec(needs_base=True, min_models=1, uses=_TASK_VECTOR_PARAMS),
    "ties": MethodSpec(needs_base=True, min_models=1, uses=_TASK_VECTOR_PARAMS + ("density", "majority_sign_method"),
                       required=("density",)),
    "dare_linear": MethodSpec(needs_base=True, min_models=1, uses=_TASK_VECTOR_PARAMS + ("density", "seed"),
                              required=("density",)),
    "dare_ties": MethodSpec(needs_base=True, min_models=1,
                            uses=_TASK_VECTOR_PARAMS + ("density", "seed", "majority_sign_method"),
                            required=("density",)),
    "magnitude_prune": MethodSpec(needs_base=True, min_models=1, uses=_TASK_VECTOR_PARAMS + ("density",),
                                  required=("density",)),
    "slerp": MethodSpec(needs_base=False, min_models=1, uses=("t",), required=("t",)),  # two ends, checked below
    "model_stock": MethodSpec(needs_base=True, min_models=2, uses=()),
}
MERGE_METHODS = tuple(METHOD_SPECS)


@dataclass
class ModelSpec:
    """One model to merge: a checkpoint or LoRA adapter directory, its weight (a number or per-layer
    anchors) and, for a LoRA adapter, the base it is merged into first (default: the adapter's
    ``base_model_name_or_path`` when that directory exists, else the config's ``base_model``)."""

    model: str
    weight: Setting = 1.0
    base: str | None = None


class DuplicateYAMLKeyError(ValueError):
    """A key given twice in one YAML mapping: ``key``, the ``line`` of the repeat and the ``first`` one."""

    def __init__(self, key: str, line: int, first: int) -> None:
        super().__init__(key)
        self.key, self.line, self.first = key, line, first


@functools.cache
def unique_key_yaml_loader() -> type:
    """yaml.SafeLoader that refuses a key given twice in one mapping (SafeLoader keeps the last silently).
    rlhf.py reads its configs with it too."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict:
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                line = key_node.start_mark.line + 1
                if isinstance(key, Hashable) and key in seen:
                    raise DuplicateYAMLKeyError(str(key), line, seen[key])
                seen[key] = line
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def _key_lines(text: str) -> dict[str, int]:
    """The line (1-based) of each top-level key of a YAML mapping and of each ``models[i]`` entry, so that
    a message can point at ``file:line``; empty when the text is not a mapping."""
    import yaml

    root = yaml.compose(text, Loader=yaml.SafeLoader)
    lines: dict[str, int] = {}
    for key, value in root.value if isinstance(root, yaml.MappingNode) else ():
        lines[str(key.value)] = key.start_mark.line + 1
        if key.value == "models" and isinstance(value, yaml.SequenceNode):
            lines.update((f"models[{i}]", item.start_mark.line + 1) for i, item in enumerate(value.value))
    return lines


def _where(source: str, command_line: Collection[str], lines: dict[str, int], fields: Sequence[str]) -> str:
    """Where the entries ``fields`` were given: ``command line`` if one was a ``key=value`` override, else
    ``source`` with the line of the first field found there (``models[1]`` is listed before ``models`` so
    that the entry's own line wins)."""
    if any(f in command_line for f in fields):
        return "command line"
    line = next((lines[f] for f in fields if f in lines), None)
    return f"{source}:{line}" if line else source


def _did_you_mean(key: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(known)}"


def _check_setting(value: Any, field_name: str, low: float | None = None, high: float | None = None,
                   low_open: bool = False) -> None:
    """A number in range, a non-empty list of them (per-layer anchors), or mergekit's conditional
    ``[{filter, value}, ...]`` list whose values are such settings."""
    key = (re.match(r"\w+", field_name) or [field_name])[0]  # the config key: models[0].weight -> models
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, dict) for v in value):
        for i, entry in enumerate(value):
            unknown = set(entry) - {"filter", "value"}
            if unknown or "value" not in entry:
                raise MergeError(f"{field_name}[{i}] must be {{filter: <substring>, value: <number or list>}}, "
                                 f"got {entry!r}", (key,))
            _check_setting(entry["value"], f"{field_name}[{i}].value", low, high, low_open)
        return
    values = value if isinstance(value, (list, tuple)) else [value]
    if not values or not all(_is_number(v) and math.isfinite(v) for v in values):
        raise MergeError(f"{field_name} must be a number or a non-empty list of numbers (per-layer anchors), "
                         f"got {value!r}", (key,))
    lo_text = "(" if low_open else "["
    for v in values:
        if (low is not None and (v < low or (low_open and v == low))) or (high is not None and v > high):
            raise MergeError(f"{field_name} must be in {lo_text}{low}, {high}], got {v!r}", (key,))


CONFIG_KEYS_HELP = """\
config keys (YAML, or key=value on the command line):
  method                one of the methods above
  models                model directories (full checkpoints or LoRA adapters), or {model, weight, base} entries;
                        weight accepts per-layer anchors, base names a LoRA adapter's base model
  base_model            the common base: task-vector methods merge model - base; slerp's t = 0 end
  output_dir            the merged model's directory
  density               kept share of each task vector (ties, dare_*, magnitude_prune); per-layer anchors or
                        [{filter, value}] accepted
  lambda                scales the merged task vector (default 1.0)
  majority_sign_method  ties' sign election: total (mass-weighted, default) or frequency (one vote per model)
  t                     slerp's position between the two ends (0..1), per-layer anchors or [{filter, value}]
  normalize             linear divides by the sum of the weights (default true)
  seed                  DARE's random drops (default 0)
  dtype                 float32, bfloat16 or float16 output (default: each tensor keeps the reference's dtype)
  max_shard_size        bytes or e.g. 5GB per safetensors shard (default 5GB)
  tokenizer_source      where tokenizer and chat template come from (default: the first model, else the base)
  overwrite             replace an existing output_dir (default false)
"""


@dataclass
class MergeConfig:
    """What to merge and how (mergekit-like YAML; ``MergeConfig.from_yaml(path)``).

    ``method``: one of ``MERGE_METHODS``. ``models``: directories (or ``{model, weight, base}``
    entries) of full checkpoints or LoRA adapters. ``base_model``: the common base; task-vector methods
    (task_arithmetic, ties, dare_*, magnitude_prune, model_stock) merge ``model - base``; for slerp it
    is the ``t = 0`` end (then exactly one model), otherwise slerp takes two models. ``density``: the
    kept fraction for ties / dare / magnitude_prune. ``lambda_`` (YAML ``lambda``): scales the merged
    task vector. ``t``: slerp's position, a number, per-layer anchors or ``[{filter, value}]``.
    ``weight``, ``density`` and ``lambda`` accept per-layer anchors too. ``normalize``: linear divides
    by the sum of weights. ``seed``: DARE's random drops (per tensor and model, so reproducible).
    ``dtype``: output dtype (float32, bfloat16, float16; default: each tensor keeps the reference
    model's); arithmetic is float32 always. ``max_shard_size``: bytes or "5GB". ``tokenizer_source``:
    where tokenizer and chat template come from (default: the first model, else the base).
    """

    method: str = ""
    models: list = field(default_factory=list)
    base_model: str | None = None
    output_dir: str = ""
    density: Setting | None = None
    lambda_: Setting = 1.0
    majority_sign_method: str = "total"
    t: Setting | None = None
    normalize: bool = True
    seed: int = 0
    dtype: str | None = None
    max_shard_size: int | str = "5GB"
    tokenizer_source: str | None = None
    overwrite: bool = False

    # Where the values came from, (source, command-line keys, key lines), set by from_dict for messages; a
    # plain class attribute, not a config key.
    _origin = None

    def __post_init__(self) -> None:
        models = [] if self.models is None else self.models
        if not isinstance(models, (list, tuple)):  # a string would be read letter by letter, a mapping by key
            form = "a mapping (put '- ' before each entry)" if isinstance(models, dict) else repr(models)
            raise MergeError(f"models must be a list of model directories or {{model, weight}} entries, got {form}; "
                             "e.g. models: [outputs/dpo, outputs/grpo]", ("models",))
        self.models = [self._model_spec(i, m) for i, m in enumerate(models)]
        self.validate()

    @staticmethod
    def _model_spec(index: int, entry: Any) -> ModelSpec:
        if isinstance(entry, ModelSpec):
            return entry
        if isinstance(entry, (str, os.PathLike)):
            return ModelSpec(str(entry))
        if isinstance(entry, dict):
            known = [f.name for f in dataclasses.fields(ModelSpec)]
            for key in entry:
                if key not in known:
                    raise MergeError(f"models[{index}]: unknown key '{key}'{_did_you_mean(str(key), known)}",
                                     (f"models[{index}]", "models"))
            if not entry.get("model"):
                raise MergeError(f"models[{index}]: 'model' (the checkpoint directory) is missing",
                                 (f"models[{index}]", "models"))
            return ModelSpec(str(entry["model"]), entry.get("weight", 1.0),
                             None if entry.get("base") is None else str(entry["base"]))
        raise MergeError(f"models[{index}] must be a directory or {{model: DIR, weight: W}}, got {entry!r}",
                         (f"models[{index}]", "models"))

    @property
    def spec(self) -> MethodSpec:
        return METHOD_SPECS[self.method]

    def validate(self) -> None:
        """Check every field before anything is read; raises MergeError naming the field and the fix."""
        if not isinstance(self.method, str) or self.method not in METHOD_SPECS:
            close = difflib.get_close_matches(str(self.method), MERGE_METHODS, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            shown = f"'{self.method}'" if isinstance(self.method, str) else repr(self.method)
            raise MergeError(f"method {shown} is not one of {', '.join(MERGE_METHODS)}{hint}", ("method",))
        spec = self.spec
        self._validate_models(spec)
        if not str(self.output_dir or "").strip():
            raise MergeError("output_dir is missing: the directory the merged model is written to", ("output_dir",))
        for name in ("base_model", "output_dir", "tokenizer_source"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):  # a bare YAML number is not a path
                raise MergeError(f"{name} must be a directory path, got {value!r} (quote it if that is the "
                                 "directory's name)", (name,))
        for name in spec.required:
            if getattr(self, name) is None:
                example = {"density": "density: 0.5", "t": "t: 0.5"}[name]
                raise MergeError(f"{name} is required by method {self.method} (e.g. {example})", (name, "method"))
        if self.density is not None:
            _check_setting(self.density, "density", 0.0, 1.0, low_open=True)
        if self.t is not None:
            _check_setting(self.t, "t", 0.0, 1.0)
        _check_setting(self.lambda_, "lambda")
        if self.majority_sign_method not in MAJORITY_SIGN_METHODS:
            raise MergeError(f"majority_sign_method must be one of {', '.join(MAJORITY_SIGN_METHODS)}, "
                             f"got {self.majority_sign_method!r}", ("majority_sign_method",))
        if self.dtype is not None and self.dtype not in OUTPUT_DTYPES:
            raise MergeError(f"dtype must be one of {', '.join(OUTPUT_DTYPES)} (or left out to keep the inputs' "
                             f"dtype), got {self.dtype!r}", ("dtype",))
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise MergeError(f"seed must be an integer, got {self.seed!r}", ("seed",))
        for name in ("normalize", "overwrite"):
            if not isinstance(getattr(self, name), bool):
                raise MergeError(f"{name} must be true or false, got {getattr(self, name)!r}", (name,))
        _parse_size(self.max_shard_size)

    def _validate_models(self, spec: MethodSpec) -> None:
        if not self.models:
            raise MergeError("models is empty: list the fine-tuned model directories to merge", ("models",))
        for i, model in enumerate(self.models):
            try:
                _check_setting(model.weight, f"models[{i}].weight")
            except MergeError as err:  # the entry's own line, not the models: key's
                raise MergeError(str(err), (f"models[{i}]", *err.fields)) from None
        if spec.needs_base and not self.base_model:
            raise MergeError(f"method {self.method} merges task vectors (model - base): set base_model to the "
                             "model they were fine-tuned from", ("method", "base_model"))
        if self.method == "linear" and self.base_model:
            raise MergeError("method linear averages the models and does not use base_model; remove base_model "
                             "(or use task_arithmetic to add weighted task vectors to it)", ("base_model", "method"))
        count = len(self.models)
        if count < spec.min_models:
            raise MergeError(f"method {self.method} needs at least {spec.min_models} models, got {count}",
                             ("method", "models"))
        if self.method == "slerp" and count + bool(self.base_model) != 2:
            raise MergeError(f"slerp interpolates between two models: give base_model and one model, or two models "
                             f"without base_model (got {count} model(s){' and base_model' if self.base_model else ''})",
                             ("method", "models", "base_model"))
        weights = [m.weight for m in self.models]
        if self.method == "linear" and self.normalize and all(map(_is_number, weights)) and sum(weights) == 0:
            raise MergeError("the models' weights sum to 0, so linear cannot normalise them; change a weight "
                             "or set normalize: false", ("models", "method", "normalize"))

    def unused_fields(self) -> list[str]:
        """Fields set away from their defaults that this method ignores (reported, not errors, so that a
        config can switch methods with one override)."""
        uses = set(self.spec.uses)
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        names = {"density": "density", "lambda_": "lambda", "t": "t", "seed": "seed", "normalize": "normalize",
                 "majority_sign_method": "majority_sign_method"}
        unused = [label for attr, label in names.items() if label not in uses and getattr(self, attr) != defaults[attr]]
        if "weight" not in uses and any(m.weight != 1.0 for m in self.models):
            unused.append("models[].weight")
        return unused

    # -- YAML -----------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict, source: str = "config", command_line: Collection[str] = (),
                  lines: dict[str, int] | None = None) -> MergeConfig:
        """Build from a mapping with YAML keys (``lambda``, not ``lambda_``); unknown keys are errors
        with a suggestion; every message starts with ``source`` (``source:line`` for a key in ``lines``),
        or with ``command line`` when it is about a key in ``command_line`` (the keys given as
        ``key=value`` overrides). The config remembers this, so that ``ModelMerger`` can say where a bad
        input (a model directory, output_dir) was named."""
        if not isinstance(data, dict):
            raise MergeError(f"{source}: a merge config is a mapping of keys (method, models, ...), got "
                             f"{type(data).__name__}")
        given = frozenset("lambda" if key == "lambda_" else key for key in command_line)
        lines = dict(lines or {})
        known = [f.name if f.name != "lambda_" else "lambda" for f in dataclasses.fields(cls)]
        kwargs = {}
        for key, value in data.items():
            if key not in known and key != "lambda_":
                raise MergeError(f"{_where(source, given, lines, [key])}: unknown key '{key}'"
                                 f"{_did_you_mean(str(key), known)}")
            kwargs["lambda_" if key == "lambda" else key] = value
        try:
            config = cls(**kwargs)
        except MergeError as err:
            raise MergeError(f"{_where(source, given, lines, err.fields)}: {err}", err.fields) from None
        config._origin = (source, given, lines)
        return config

    def locate(self, err: MergeError) -> MergeError:
        """``err`` with where its fields were given in front (``file:line`` or ``command line``) for a config
        from from_dict / from_yaml; unchanged for one built in Python, whose caller knows."""
        if self._origin is None:
            return err
        return MergeError(f"{_where(*self._origin, err.fields)}: {err}", err.fields)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: Sequence[str] = ()) -> MergeConfig:
        """Load a YAML file; ``overrides`` are ``key=value`` strings (the value parsed as YAML, else kept
        as text) applied on top, e.g. ``["density=0.3", "output_dir=outputs/merged/ties-03"]``. Mistakes
        in the file name it (``file:line`` for syntax); mistakes in an override say ``command line``."""
        import yaml

        if isinstance(overrides, str):  # one string would be split into letters
            raise TypeError(f"overrides must be a list of key=value strings, got the string {overrides!r}")
        if not str(path).strip():
            raise MergeError("the config path is empty; give the merge YAML file (e.g. configs/merge_ties.yaml)")
        path = Path(path)
        if path.is_dir():
            raise MergeError(f"{path}: is a directory; give the merge YAML file (e.g. configs/merge_ties.yaml)")
        try:
            text = path.read_text(encoding="utf-8")
            data = yaml.load(text, Loader=unique_key_yaml_loader())
        except FileNotFoundError:
            raise MergeError(f"{path}: config file not found") from None
        except UnicodeDecodeError:
            raise MergeError(f"{path}: not UTF-8 text; save the config as UTF-8 YAML") from None
        except OSError as err:
            raise MergeError(f"{path}: cannot read it ({err.strerror or err})") from None
        except DuplicateYAMLKeyError as err:
            raise MergeError(f"{path}:{err.line}: duplicate key '{err.key}' (first at line {err.first}); keep one") \
                from None
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            line = f":{mark.line + 1}" if mark else ""
            raise MergeError(f"{path}{line}: invalid YAML "
                             f"({getattr(err, 'problem', None) or str(err).splitlines()[0]})") from None
        data = {} if data is None else data
        given = []
        for item in overrides:
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise MergeError(f"command line: override '{item}' must look like key=value (e.g. density=0.3)")
            try:
                parsed = yaml.safe_load(value)
            except yaml.YAMLError:  # e.g. output_dir=out[1: keep the text, as rlhf.py's overrides do
                parsed = value
            if isinstance(data, dict):
                data[key.strip()] = parsed
                given.append(key.strip())
        return cls.from_dict(data, source=str(path), command_line=given, lines=_key_lines(text))

    def to_dict(self) -> dict:
        """The YAML form (written next to the merged weights as merge_config.yaml)."""
        data = {f.name if f.name != "lambda_" else "lambda": getattr(self, f.name) for f in dataclasses.fields(self)}
        data["models"] = [dataclasses.asdict(m) for m in self.models]
        return data


# ==== 5. ModelMerger: streaming merges of checkpoint directories =====================================

DEFAULT_CHUNK_ELEMENTS = 1 << 20  # rows of about 4 MiB of float32 per model at a time
Source = Checkpoint | LoraCheckpoint


@dataclass
class TensorJob:
    """One output tensor: its reference shape and dtype, output dtype and the merge parameters resolved
    for it (per-layer anchors evaluated at its depth)."""

    name: str
    info: TensorInfo
    out_dtype: torch.dtype
    merged: bool  # False: not floating point (e.g. an integer buffer), copied from the reference
    weights: list[float]
    density: float | None = None
    t: float | None = None
    lam: float = 1.0

    def row_ranges(self, chunk_elements: int) -> list[tuple[int, int]]:
        if not self.info.shape:
            return [(0, 1)]
        rows = self.info.shape[0]
        per_row = max(1, math.prod(self.info.shape[1:]))
        step = max(1, chunk_elements // per_row)
        return [(start, min(start + step, rows)) for start in range(0, rows, step)]


class _TensorInputs:
    """Row chunks of one tensor from the base (if any) and every model, read again on every pass."""

    def __init__(self, job: TensorJob, base: Any, models: list, chunk_elements: int) -> None:
        self.job, self.base, self.models = job, base, models
        self.ranges = job.row_ranges(chunk_elements)

    def chunks(self, which: Sequence[int] | None = None) -> Iterator[tuple[torch.Tensor | None, list[torch.Tensor]]]:
        models = self.models if which is None else [self.models[i] for i in which]
        for start, stop in self.ranges:
            base = self.base.rows(start, stop) if self.base is not None else None
            yield base, [m.rows(start, stop) for m in models]

    def task_magnitudes(self, index: int) -> torch.Tensor:
        """``|model_index - base|`` of the whole tensor, flattened (one float32 tensor of its size)."""
        out = torch.empty(self.job.info.numel, dtype=torch.float32)
        offset = 0
        for base, (model,) in self.chunks([index]):
            flat = model.sub_(base).abs_().reshape(-1)
            out[offset:offset + flat.numel()] = flat
            offset += flat.numel()
        return out


@dataclass
class _MagnitudeTrim:
    """TIES' trim of one task tensor, applied chunk by chunk: keeps exactly ``k = int(density * numel)``
    entries, all with ``|x| > threshold`` plus the first ``ties_to_keep`` (in flat order) with ``|x| ==
    threshold``. Without ties at the threshold this is the set ``torch.topk`` (PEFT) keeps; with ties,
    where topk's choice is unspecified, the earliest entries win."""

    threshold: float = math.inf
    ties_to_keep: int = 0
    keep_all_ties: bool = False
    keep_all: bool = False

    @classmethod
    def from_magnitudes(cls, magnitudes: torch.Tensor, density: float) -> _MagnitudeTrim:
        n = magnitudes.numel()
        k = int(density * n)  # truncated, as PEFT
        if k >= n:
            return cls(keep_all=True)
        if k == 0:
            return cls()
        threshold = torch.kthvalue(magnitudes, n - k + 1).values  # the k-th largest magnitude
        greater = int((magnitudes > threshold).sum())
        equal = int((magnitudes == threshold).sum())
        return cls(float(threshold), k - greater, keep_all_ties=(k - greater == equal))

    def apply(self, chunk: torch.Tensor) -> torch.Tensor:
        if self.keep_all:
            return chunk
        magnitude = chunk.abs()
        keep = magnitude > self.threshold
        if self.keep_all_ties:
            keep |= magnitude == self.threshold
        elif self.ties_to_keep > 0:
            ties = (magnitude == self.threshold).reshape(-1)
            take = ties & (ties.cumsum(0) <= self.ties_to_keep)
            self.ties_to_keep -= int(take.sum())
            keep |= take.view(keep.shape)
        return chunk * keep


def _derived_seed(seed: int, name: str, index: int) -> int:
    """A seed per (config seed, tensor, model): DARE's drops do not depend on tensor order or chunking."""
    digest = hashlib.sha256(f"{seed}/{name}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class _Kernel:
    """How one method merges a tensor in the streaming merger: ``prepare`` makes whole-tensor passes
    (thresholds, norms) when the method needs them, ``merge`` combines one row chunk of the base and
    of every model into the merged full weights."""

    def __init__(self, config: MergeConfig) -> None:
        self.config = config

    def prepare(self, job: TensorJob, inputs: _TensorInputs) -> Any:
        return None

    def merge(self, job: TensorJob, base: torch.Tensor | None, models: list[torch.Tensor], state: Any) -> torch.Tensor:
        raise NotImplementedError


class _Linear(_Kernel):
    def merge(self, job, base, models, state):
        return linear(models, job.weights, self.config.normalize)


class _TaskVectors(_Kernel):
    """``base + lambda * combine(task vectors)`` for the task-vector methods."""

    def merge(self, job, base, models, state):
        tasks = [m.sub_(base) for m in models]  # the chunks are fresh copies
        return base + job.lam * self.combine(job, tasks, state)

    def combine(self, job: TensorJob, tasks: list[torch.Tensor], state: Any) -> torch.Tensor:
        raise NotImplementedError


class _TaskArithmetic(_TaskVectors):
    def combine(self, job, tasks, state):
        return task_arithmetic(tasks, job.weights)


class _Trimmed(_TaskVectors):
    """TIES and magnitude pruning: a first pass per model finds its magnitude threshold."""

    def prepare(self, job, inputs):
        return [_MagnitudeTrim.from_magnitudes(inputs.task_magnitudes(i), job.density)
                for i in range(len(inputs.models))]


class _Ties(_Trimmed):
    def combine(self, job, tasks, state):
        trimmed = torch.stack([trim.apply(t) for trim, t in zip(state, tasks)])
        weights = _check_weights(job.weights, len(tasks))
        return _sign_elect_and_merge(trimmed, weights, self.config.majority_sign_method)


class _MagnitudePrune(_Trimmed):
    def combine(self, job, tasks, state):
        return task_arithmetic([trim.apply(t) for trim, t in zip(state, tasks)], job.weights)


class _Dare(_TaskVectors):
    """One generator per model and tensor: successive chunks continue its stream, so the drops equal
    those of the whole tensor drawn at once (``torch.bernoulli`` draws entries in order on CPU)."""

    def prepare(self, job, inputs):
        return [torch.Generator().manual_seed(_derived_seed(self.config.seed, job.name, i))
                for i in range(len(inputs.models))]


class _DareLinear(_Dare):
    def combine(self, job, tasks, state):
        return dare_linear(tasks, job.weights, job.density, generator=state)


class _DareTies(_Dare):
    def combine(self, job, tasks, state):
        return dare_ties(tasks, job.weights, job.density, self.config.majority_sign_method, generator=state)


class _Slerp(_Kernel):
    """Two passes: dot product and norms of the whole flattened tensors, then ``s0 * v0 + s1 * v1``."""

    def prepare(self, job, inputs):
        dot = norm0 = norm1 = 0.0
        for _, (v0, v1) in inputs.chunks():
            a, b = v0.reshape(-1).double(), v1.reshape(-1).double()
            dot, norm0, norm1 = dot + float(a @ b), norm0 + float(a @ a), norm1 + float(b @ b)
        return _slerp_coefficients(job.t, dot, math.sqrt(norm0), math.sqrt(norm1), 0.9995, 1e-8)

    def merge(self, job, base, models, state):
        s0, s1 = state
        return s0 * models[0] + s1 * models[1]


class _ModelStock(_Kernel):
    """Two passes: pairwise dot products of the task vectors, then ``t * mean + (1 - t) * base``."""

    def prepare(self, job, inputs):
        k = len(inputs.models)
        gram = torch.zeros(k, k, dtype=torch.float64)
        for base, models in inputs.chunks():
            deltas = torch.stack([(m - base).reshape(-1) for m in models]).double()
            gram += deltas @ deltas.t()
        norms = gram.diagonal().sqrt().tolist()
        cosines = [_pair_cosine(float(gram[i, j]), norms[i], norms[j]) for i in range(k) for j in range(i + 1, k)]
        return _model_stock_ratio(sum(cosines) / len(cosines), k)

    def merge(self, job, base, models, state):
        return state * torch.stack(models).mean(dim=0) + (1.0 - state) * base


KERNELS: dict[str, type[_Kernel]] = {
    "linear": _Linear, "task_arithmetic": _TaskArithmetic, "ties": _Ties, "dare_linear": _DareLinear,
    "dare_ties": _DareTies, "magnitude_prune": _MagnitudePrune, "slerp": _Slerp, "model_stock": _ModelStock,
}


@dataclass
class MergePlan:
    """Everything checked and resolved before a byte is written: the inputs, one job per tensor, where
    config and tokenizer come from."""

    base: Source | None  # the task-vector base; None for linear and slerp (whose ends are both in models)
    models: list[Source]
    reference: Source  # names, order, shapes and config.json come from it: the base, else the first model
    jobs: list[TensorJob]
    num_layers: int
    tokenizer_dir: Path | None
    notes: list[str]


@dataclass
class MergeResult:
    """What a merge wrote, for the summary and the report."""

    output_dir: Path
    method: str
    models: list[str]
    base_model: str | None
    tensors: int
    copied: int
    shards: int
    total_bytes: int
    dtypes: list[str]
    seconds: float
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        base = f" onto {self.base_model}" if self.base_model else ""
        lines = [f"merged {len(self.models)} model(s) with {self.method}{base} into {self.output_dir}",
                 f"  tensors: {self.tensors} merged, {self.copied} copied | {self.shards} shard(s), "
                 f"{self.total_bytes / 1e6:.1f} MB {'/'.join(self.dtypes)} | {self.seconds:.1f} s"]
        return "\n".join(lines + [f"  note: {note}" for note in self.notes])


def _architecture(config: dict | None) -> tuple[str | None, tuple[str, ...]] | None:
    if config is None:
        return None
    return config.get("model_type"), tuple(config.get("architectures") or ())


def _entry(label: str) -> str:
    """The config entry of an input's label: ``models[1] (outputs/x)`` -> ``models[1]``."""
    return label.split(" (")[0]


def _entry_fields(entry: str) -> tuple[str, str]:
    """The config fields of an input's entry, most specific first: ``models[1]`` -> (models[1], models)."""
    return entry, (re.match(r"\w+", entry) or [entry])[0]


def _not_found(path: Path) -> str:
    # a relative path is read from the current directory, not the config file's: say which, the usual slip
    return "directory not found" + ("" if path.is_absolute() else f" (relative to the current directory {Path.cwd()})")


def _has_tokenizer(directory: Path) -> bool:
    return any((directory / f).is_file() for f in TOKENIZER_FILES)


def _vocabulary(directory: Path) -> dict[int, str] | None:
    """id -> token of the tokenizer saved in ``directory`` (tokenizer.json's vocab and added tokens, else
    vocab.json), or None when there is neither or it has a form not known here (then nothing is compared)."""
    try:
        if (directory / "tokenizer.json").is_file():
            data = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
            vocab = data["model"]["vocab"]  # {token: id}, or Unigram's [[piece, score], ...] in id order
            pairs = vocab.items() if isinstance(vocab, dict) else ((entry[0], i) for i, entry in enumerate(vocab))
            ids = {int(i): str(token) for token, i in pairs}
            ids.update((int(t["id"]), str(t["content"])) for t in data.get("added_tokens") or ())
            return ids
        if (directory / "vocab.json").is_file():
            vocab = json.loads((directory / "vocab.json").read_text(encoding="utf-8"))
            return {int(i): str(token) for token, i in vocab.items()}
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None
    return None


def _num_layers(config: dict | None, names: Sequence[str]) -> int:
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if config and isinstance(config.get(key), int):
            return config[key]
    layers = [i for i in map(layer_index, names) if i is not None]
    return max(layers) + 1 if layers else 1


class ModelMerger:
    """Merge checkpoint directories into a new Hugging Face directory, tensor by tensor.

    Implements the methods of ``MERGE_METHODS`` (TIES: Yadav et al. 2023; DARE: Yu et al. 2024; task
    arithmetic: Ilharco et al. 2023; SLERP as in mergekit, Goddard et al. 2024; Model Stock: Jang et
    al. 2024; linear soups: Wortsman et al. 2022). ``plan()`` opens every input (safetensors headers
    only), checks architectures, tensor names and shapes and resolves per-layer parameters;
    ``merge()`` then reads each tensor in row chunks of about ``chunk_elements`` entries from each
    model (LoRA adapters: base rows plus the same rows of ``B @ A``), merges them in float32 and
    appends the rows to the output shard, so memory stays near a few copies of the largest tensor.
    Methods that need whole-tensor statistics (TIES' magnitude threshold, SLERP's angle, Model Stock's
    cosines) make an extra read pass for them. The output goes to a temporary sibling directory that
    is renamed into place at the end: an interrupted merge leaves nothing half-written.

    ``ModelMerger(MergeConfig.from_yaml(path)).merge()`` is what ``python model_merging.py --config
    path`` runs.
    """

    def __init__(self, config: MergeConfig, *, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> None:
        if not isinstance(config, MergeConfig):
            raise TypeError(f"ModelMerger takes a MergeConfig (MergeConfig.from_yaml(path) or MergeConfig(**keys)), "
                            f"got {type(config).__name__}")
        if chunk_elements < 1:
            raise ValueError(f"chunk_elements must be >= 1, got {chunk_elements}")
        self.config = config
        self.chunk_elements = chunk_elements

    # -- planning -----------------------------------------------------------------------------------

    def plan(self) -> MergePlan:
        """Open and check every input; raises MergeError naming the model and tensor at fault, and for a
        config read from YAML, the file and line (or the command line) that named it."""
        try:
            return self._plan()
        except MergeError as err:
            raise self.config.locate(err) from None

    def _plan(self) -> MergePlan:
        config = self.config
        config.validate()
        models = [self._open(m.model, f"models[{i}]", m.base) for i, m in enumerate(config.models)]
        base = self._open(config.base_model, "base_model", None) if config.base_model else None
        if config.method == "slerp" and base is not None:
            base, models = None, [base, *models]  # the base is slerp's t = 0 end
        inputs = ([base] if base is not None else []) + models
        reference = inputs[0]
        self._check_inputs(reference, inputs[1:])
        tokenizer_dir = self._tokenizer_dir(models, base)
        self._check_tokenizers(inputs)
        num_layers = _num_layers(reference.config, reference.names)
        jobs = [self._job(name, reference.infos[name], num_layers) for name in reference.names]
        self._check_weight_sums(jobs)
        self._check_output(inputs)
        notes = self._notes(reference, jobs)
        return MergePlan(base, models, reference, jobs, num_layers, tokenizer_dir, notes)

    def _open(self, path: str, entry: str, lora_base: str | None) -> Source:
        """The checkpoint or LoRA adapter that config entry ``entry`` (``models[1]``, ``base_model``) names;
        its mistakes carry the entry, so that they can be traced to where it was given."""
        label = f"{entry} ({path})"
        try:
            source = self._open_source(Path(path), label, lora_base)
            _ = source.config  # parse config.json now: a broken one is this entry's mistake, found before any tensor
            return source
        except OSError as err:  # e.g. no permission to read a shard
            raise MergeError(f"{label}: cannot read {err.filename or path} ({err.strerror or err})",
                             _entry_fields(entry)) from None
        except MergeError as err:
            raise MergeError(str(err), err.fields or _entry_fields(entry)) from None

    def _open_source(self, directory: Path, label: str, lora_base: str | None) -> Source:
        if not directory.is_dir():
            problem = "is a file, not a model directory" if directory.exists() else _not_found(directory)
            raise MergeError(f"{label}: {problem}")
        scorer = next((name for name in SCORER_FILES if (directory / name).is_file()), None)
        if scorer is not None:
            raise MergeError(f"{label}: holds {scorer}, so it is a reward model (or an ensemble of them), not a "
                             "policy: merging its backbone would write a model without its head and without an output "
                             "layer; merge policies, and join reward models with `python rlhf.py combine-rm` instead")
        if (directory / "adapter_config.json").is_file():
            base_dir = self._lora_base(directory, label, lora_base)
            return LoraCheckpoint(directory, label, Checkpoint(base_dir, f"{label}'s base ({base_dir})"))
        return Checkpoint(directory, label)

    def _lora_base(self, directory: Path, label: str, explicit: str | None) -> Path:
        if explicit:
            if not Path(explicit).is_dir():
                raise MergeError(f"{label}: base {explicit} (the LoRA adapter's base model): "
                                 f"{_not_found(Path(explicit))}")
            return Path(explicit)
        recorded = _read_adapter_config(directory, label).get("base_model_name_or_path")
        if recorded and Path(recorded).is_dir():
            return Path(recorded)
        if self.config.base_model and not (Path(self.config.base_model) / "adapter_config.json").exists():
            return Path(self.config.base_model)
        raise MergeError(f"{label}: the LoRA adapter's base_model_name_or_path {recorded!r} is not a local directory; "
                         "set this model's 'base' (or base_model) to the directory of the model it was trained from")

    @staticmethod
    def _short(source: Source) -> str:
        return _entry(source.label)

    def _check_inputs(self, reference: Source, others: list[Source]) -> None:
        arch = _architecture(reference.config)
        ref_names = set(reference.names)
        for source in others:
            fields = _entry_fields(self._short(source))
            other_arch = _architecture(source.config)
            if arch and other_arch and arch != other_arch:
                raise MergeError(f"{source.label}: architecture {'/'.join(other_arch[1]) or other_arch[0]} differs "
                                 f"from {self._short(reference)}'s {'/'.join(arch[1]) or arch[0]}; only models of one "
                                 "architecture can be merged", fields)
            missing = [n for n in reference.names if n not in source.infos]
            if missing:
                hint = (" (tie_word_embeddings differs: one model stores a separate output head)"
                        if missing[0].endswith("lm_head.weight") else "")
                raise MergeError(f"{source.label}: tensor {missing[0]} is missing; {self._short(reference)} has it"
                                 f"{hint}" + (f" ({len(missing) - 1} more missing)" if len(missing) > 1 else ""),
                                 fields)
            extra = [n for n in source.names if n not in ref_names]
            if extra:
                raise MergeError(f"{source.label}: tensor {extra[0]} is not in {self._short(reference)}"
                                 + (f" ({len(extra) - 1} more)" if len(extra) > 1 else "")
                                 + "; the models must have the same tensors", fields)
            for name in reference.names:
                ours, theirs = source.infos[name], reference.infos[name]
                if ours.shape != theirs.shape:
                    raise MergeError(f"{source.label}: tensor {name} has shape {_shape(ours.shape)}, "
                                     f"{self._short(reference)} has {_shape(theirs.shape)}", fields)
                if ours.dtype.is_floating_point != theirs.dtype.is_floating_point:
                    raise MergeError(f"{source.label}: tensor {name} has dtype {ours.dtype}, "
                                     f"{self._short(reference)} has {theirs.dtype}", fields)

    def _check_tokenizers(self, inputs: list[Source]) -> None:
        """Row i of every embedding must be the same token in every model. A token added at a new id
        changes the embedding's shape (caught above); a different tokenizer of the same size is caught
        here, where an id means another token. Inputs without tokenizer files are not compared."""
        named = [(s.label, next((Path(d) for d in (s.directory, s.config_dir) if _has_tokenizer(Path(d))), None))
                 for s in inputs]  # a LoRA adapter's own tokenizer, else its base's
        if self.config.tokenizer_source:
            named.append((f"tokenizer_source ({self.config.tokenizer_source})", Path(self.config.tokenizer_source)))
        first: tuple[str, dict[int, str]] | None = None
        for label, directory in named:
            vocab = None if directory is None else _vocabulary(directory)
            if vocab is None:
                continue
            if first is None:
                first = (label, vocab)
                continue
            clash = next((i for i, token in vocab.items() if first[1].get(i, token) != token), None)
            if clash is not None:
                raise MergeError(f"{label}: its tokenizer differs from {_entry(first[0])}'s (token id {clash} is "
                                 f"{vocab[clash]!r} here, {first[1][clash]!r} there), so their embeddings mean "
                                 "different tokens; merge models that share one tokenizer",
                                 _entry_fields(_entry(label)))

    def _setting(self, value: Setting, field_name: str, name: str, num_layers: int) -> float:
        try:
            return setting_for_tensor(value, name, num_layers)
        except ValueError as err:
            raise MergeError(f"{field_name}: {err}", _entry_fields(field_name.removesuffix(".weight"))) from None

    def _job(self, name: str, info: TensorInfo, num_layers: int) -> TensorJob:
        config = self.config
        merged = info.dtype.is_floating_point
        weights = [self._setting(m.weight, f"models[{i}].weight", name, num_layers)
                   for i, m in enumerate(config.models)]
        return TensorJob(
            name=name, info=info, merged=merged,
            out_dtype=OUTPUT_DTYPES[config.dtype] if config.dtype and merged else info.dtype, weights=weights,
            density=None if config.density is None else self._setting(config.density, "density", name, num_layers),
            t=None if config.t is None else self._setting(config.t, "t", name, num_layers),
            lam=self._setting(config.lambda_, "lambda", name, num_layers))

    def _check_weight_sums(self, jobs: list[TensorJob]) -> None:
        # per-layer weights can cancel at one depth only: find it now, not after half the output is written
        if self.config.method == "linear" and self.config.normalize:
            zero = next((j for j in jobs if j.merged and sum(j.weights) == 0), None)
            if zero is not None:
                raise MergeError(f"the models' weights sum to 0 for tensor {zero.name}, so linear cannot normalise "
                                 "them; change a weight or set normalize: false", ("models", "normalize"))

    def _check_output(self, inputs: list[Source]) -> None:
        config = self.config
        output = Path(config.output_dir)
        fields = ("output_dir",)
        # everything the merge reads, so that overwrite: true can never delete an input (or its LoRA base)
        read = [(s.label, Path(s.directory)) for s in inputs] + [
            (s.base.label, Path(s.base.directory)) for s in inputs if isinstance(s, LoraCheckpoint)]
        if config.tokenizer_source:
            read.append((f"tokenizer_source ({config.tokenizer_source})", Path(config.tokenizer_source)))
        for label, directory in read:
            if output.resolve() == directory.resolve():
                raise MergeError(f"output_dir {output} is one of the inputs ({_entry(label)}); choose a new "
                                 "directory", fields)
            if output.resolve() in directory.resolve().parents:
                raise MergeError(f"output_dir {output} contains an input, {label}, which replacing output_dir would "
                                 "delete; choose another output_dir", fields)
        if config.overwrite and output.resolve() in (Path.cwd().resolve(), *Path.cwd().resolve().parents):
            raise MergeError(f"output_dir {output} contains the current directory, which overwrite: true would delete; "
                             "choose another output_dir", fields)
        if output.exists() and not output.is_dir():
            raise MergeError(f"output_dir {output} is a file; give a directory path for the merged model", fields)
        if output.exists() and not config.overwrite:
            raise MergeError(f"output_dir {output} already exists; set overwrite: true to replace it "
                             "(or choose another output_dir)", fields)
        existing = output.parent  # the merge creates the missing directories above output_dir: can it?
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            raise MergeError(f"output_dir {output} cannot be created ({existing} is a file); choose another output_dir",
                             fields)
        if not os.access(existing, os.W_OK | os.X_OK):
            raise MergeError(f"output_dir {output}: no permission to write in {existing}; choose another output_dir",
                             fields)

    def _tokenizer_dir(self, models: list[Source], base: Source | None) -> Path | None:
        if self.config.tokenizer_source:
            path = Path(self.config.tokenizer_source)
            if not _has_tokenizer(path):
                problem = (f"no tokenizer files there ({', '.join(TOKENIZER_FILES[:2])})" if path.is_dir()
                           else _not_found(path))
                raise MergeError(f"tokenizer_source {path}: {problem}", ("tokenizer_source",))
            return path
        candidates = [models[0].directory, models[0].config_dir] + ([base.directory] if base is not None else [])
        return next((Path(d) for d in candidates if _has_tokenizer(Path(d))), None)

    def _notes(self, reference: Source, jobs: list[TensorJob]) -> list[str]:
        notes = []
        unused = self.config.unused_fields()
        if unused:
            notes.append(f"not used by {self.config.method}: {', '.join(unused)}")
        ignored = [f"models[{i}].base" for i, m in enumerate(self.config.models)
                   if m.base and not (Path(m.model) / "adapter_config.json").is_file()]
        if ignored:
            notes.append(f"{', '.join(ignored)} ignored: 'base' is for LoRA adapters, and that model is a full one")
        copied = [j.name for j in jobs if not j.merged]
        if copied:
            notes.append(f"{len(copied)} non-floating tensor(s) copied from {self._short(reference)}: {copied[0]}"
                         + (", ..." if len(copied) > 1 else ""))
        config = reference.config or {}
        if config.get("tie_word_embeddings") and not any(j.name.endswith("lm_head.weight") for j in jobs):
            notes.append("tied word embeddings: lm_head is the merged input embedding")
        if reference.config is None:
            notes.append(f"{self._short(reference)} has no config.json, so the output has none")
        return notes

    # -- merging ------------------------------------------------------------------------------------

    def merge(self, progress: Callable[[int, int, str], None] | None = None) -> MergeResult:
        """Plan, then stream every tensor into ``output_dir``; ``progress(done, total, name)`` is called
        after each tensor. Returns a MergeResult; raises MergeError on user mistakes."""
        started = time.perf_counter()
        plan = self.plan()
        output = Path(self.config.output_dir)
        output.parent.mkdir(parents=True, exist_ok=True)
        staging = output.parent / f".{output.name}.tmp-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        writer = SafetensorsWriter(staging, [_OutputTensor(j.name, j.out_dtype, j.info.shape) for j in plan.jobs],
                                   _parse_size(self.config.max_shard_size))
        kernel = KERNELS[self.config.method](self.config)
        try:
            for done, job in enumerate(plan.jobs, start=1):
                self._write_tensor(job, plan, kernel, writer)
                if progress is not None:
                    progress(done, len(plan.jobs), job.name)
            total_bytes = writer.finish()
            self._write_metadata(staging, plan)
            self._publish(staging, output)
        except BaseException:
            writer.abort()
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return MergeResult(
            output_dir=output, method=self.config.method, models=[m.model for m in self.config.models],
            base_model=self.config.base_model, tensors=sum(j.merged for j in plan.jobs),
            copied=sum(not j.merged for j in plan.jobs), shards=len(writer.shards), total_bytes=total_bytes,
            dtypes=sorted({str(j.out_dtype).removeprefix("torch.") for j in plan.jobs}),
            seconds=time.perf_counter() - started, notes=plan.notes)

    def _write_tensor(self, job: TensorJob, plan: MergePlan, kernel: _Kernel, writer: SafetensorsWriter) -> None:
        with contextlib.ExitStack() as stack:
            base = stack.enter_context(plan.base.open(job.name)) if plan.base is not None else None
            models = [stack.enter_context(m.open(job.name)) for m in plan.models]
            writer.begin(job.name)
            if not job.merged:
                writer.write((base or models[0]).whole())
            else:
                inputs = _TensorInputs(job, base, models, self.chunk_elements)
                try:
                    state = kernel.prepare(job, inputs)
                    for base_rows, model_rows in inputs.chunks():
                        writer.write(kernel.merge(job, base_rows, model_rows, state).to(job.out_dtype))
                except MergeError:
                    raise
                except ValueError as err:  # e.g. per-layer linear weights that sum to 0 for this tensor
                    raise MergeError(f"tensor {job.name}: {err}") from None
            writer.end()

    def _write_metadata(self, directory: Path, plan: MergePlan) -> None:
        import yaml

        config = plan.reference.config
        if config is not None:
            if self.config.dtype:
                config["dtype"] = self.config.dtype  # transformers 5 reads "dtype"; older ones "torch_dtype"
                if "torch_dtype" in config:
                    config["torch_dtype"] = self.config.dtype
            (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        generation = Path(plan.reference.config_dir) / "generation_config.json"
        if generation.is_file():
            shutil.copy2(generation, directory / generation.name)
        if plan.tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                if (plan.tokenizer_dir / name).is_file():
                    shutil.copy2(plan.tokenizer_dir / name, directory / name)
        (directory / "merge_config.yaml").write_text(yaml.safe_dump(self.config.to_dict(), sort_keys=False))

    def _publish(self, staging: Path, output: Path) -> None:
        if output.exists():
            if not self.config.overwrite:
                raise MergeError(f"output_dir {output} appeared during the merge; set overwrite: true to replace it")
            retired = output.parent / f".{output.name}.old-{os.getpid()}"
            output.rename(retired)
            staging.rename(output)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            staging.rename(output)


# ==== 6. Model soups and ensembles (models in memory) ================================================


def average_state_dicts(state_dicts: Sequence[dict[str, torch.Tensor]],
                        weights: Sequence[float] | None = None) -> dict[str, torch.Tensor]:
    """Weighted average of state dicts: the uniform soup of Wortsman et al. 2022 ("Model soups:
    averaging weights of multiple fine-tuned models improves accuracy without increasing inference
    time") when the weights are equal (the default). Floating tensors are averaged in float32 and cast
    back to the first dict's dtype; other tensors (integer buffers) are taken from the first dict.

    Raises:
        MergeError: when the dicts do not have the same keys and shapes (naming the tensor).
    """
    if not state_dicts:
        raise MergeError("average_state_dicts needs at least one state dict")
    weights = [1.0] * len(state_dicts) if weights is None else [float(w) for w in weights]
    if len(weights) != len(state_dicts) or sum(weights) == 0:
        raise MergeError(f"need one weight per state dict with a non-zero sum, got {weights}")
    first = state_dicts[0]
    for i, other in enumerate(state_dicts[1:], start=1):
        missing = [k for k in first if k not in other] or [k for k in other if k not in first]
        if missing:
            raise MergeError(f"ingredient {i}: tensor {missing[0]} is in one model but not the other")
        for key, value in first.items():
            if other[key].shape != value.shape:
                raise MergeError(f"ingredient {i}: tensor {key} has shape {_shape(other[key].shape)}, "
                                 f"ingredient 0 has {_shape(value.shape)}")
    total = sum(weights)
    averaged = {}
    for key, value in first.items():
        if not value.dtype.is_floating_point:
            averaged[key] = value.detach().clone()
            continue
        acc = torch.zeros(value.shape, dtype=torch.float32, device=value.device)
        for w, sd in zip(weights, state_dicts):
            acc.add_(sd[key].detach().float(), alpha=w / total)
        averaged[key] = acc.to(value.dtype)
    return averaged


@dataclass
class SoupResult:
    """A soup: the model, which ingredients it averages (indices into the inputs, in the order they
    were added), every ingredient's own score, the soup's score and the greedy trace."""

    model: torch.nn.Module
    ingredients: list[int]
    individual_scores: list[float]
    score: float
    trace: list[dict] = field(default_factory=list)


class ModelSoup:
    """Model soups (Wortsman et al. 2022, "Model soups: averaging weights of multiple fine-tuned
    models improves accuracy without increasing inference time") of models held in memory.

    ``uniform()`` averages all ingredients. ``greedy(eval_fn)`` is the paper's greedy soup: score every
    ingredient alone with ``eval_fn(model) -> float`` (higher is better, on held-out data), sort them
    by that score, start the soup with the best, and add each next ingredient only if the soup's score
    with it does not drop (``>=``, as in the paper's Recipe 1). Ingredients are fine-tuned from one
    base (same architecture and shapes); the inputs are never modified: soups are new copies.
    """

    def __init__(self, models: Sequence[torch.nn.Module]) -> None:
        if not models:
            raise MergeError("ModelSoup needs at least one model")
        self.models = list(models)

    def _state_dicts(self) -> list[dict[str, torch.Tensor]]:
        return [m.state_dict() for m in self.models]

    def _with_weights(self, template: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
        model = copy.deepcopy(template)
        model.load_state_dict(state)
        return model

    def uniform(self) -> torch.nn.Module:
        """The uniform soup: every ingredient averaged with equal weight."""
        return self._with_weights(self.models[0], average_state_dicts(self._state_dicts()))

    def greedy(self, eval_fn: Callable[[torch.nn.Module], float]) -> SoupResult:
        """The greedy soup (Wortsman et al. 2022, Recipe 1); ``eval_fn`` runs ``2n - 1`` times."""
        states = self._state_dicts()
        scores = [float(eval_fn(m)) for m in self.models]
        order = sorted(range(len(states)), key=lambda i: -scores[i])  # stable: ties keep input order
        soup, best = [order[0]], scores[order[0]]
        trace = [{"ingredient": order[0], "score": best, "accepted": True}]
        work = self._with_weights(self.models[order[0]], states[order[0]])
        for i in order[1:]:
            work.load_state_dict(average_state_dicts([states[j] for j in soup + [i]]))
            score = float(eval_fn(work))
            accepted = score >= best
            trace.append({"ingredient": i, "score": score, "accepted": accepted})
            if accepted:
                soup.append(i)
                best = score
        work.load_state_dict(average_state_dicts([states[j] for j in soup]))
        return SoupResult(work, soup, scores, best, trace)


@dataclass
class VoteResult:
    """One prompt's majority vote: the winning answer (None when no member gave one), the weighted
    votes per answer, every member's answer and completion (token ids)."""

    answer: Any
    votes: dict
    answers: list
    completions: list[list[int]]


class EnsemblePolicy:
    """Generation from several causal LMs that share a tokenizer.

    ``generate`` decodes one sequence per prompt from the weighted mean of the members' next-token
    log-probabilities (a product of experts, as in logit/log-prob ensembling of language models; each
    member keeps its own KV cache and sees the same tokens): greedy takes the argmax, sampling draws
    from ``softmax(mean_logprobs / temperature)``. ``majority_vote`` lets every member answer on its
    own and returns the most voted final answer (self-consistency across models, Wang et al. 2023,
    "Self-Consistency Improves Chain of Thought Reasoning in Language Models"). Members are Hugging
    Face causal LMs accepting ``attention_mask``, ``position_ids`` and a KV cache (``cache``; ``past_key_values`` before
    transformers 5.24).
    """

    def __init__(self, models: Sequence[torch.nn.Module], tokenizer: Any = None,
                 weights: Sequence[float] | None = None) -> None:
        if not models:
            raise MergeError("EnsemblePolicy needs at least one model")
        weights = [1.0] * len(models) if weights is None else [float(w) for w in weights]
        if len(weights) != len(models) or any(w < 0 for w in weights) or sum(weights) <= 0:
            raise MergeError(f"weights must be one non-negative number per model with a positive sum, got {weights}")
        self.models = list(models)
        self.tokenizer = tokenizer
        self.weights = [w / sum(weights) for w in weights]
        # the keyword each forward takes its KV cache by: transformers 5.24 renamed past_key_values to cache
        # (the old name warns, and goes in 5.40); looked up once here, not at every decoding step
        self._cache_keywords = ["cache" if "cache" in inspect.signature(type(m).forward).parameters
                                else "past_key_values" for m in self.models]

    @property
    def device(self) -> torch.device:
        return next(self.models[0].parameters()).device

    def _pad_id(self, pad_token_id: int | None) -> int:
        if pad_token_id is not None:
            return pad_token_id
        tokenizer_pad = getattr(self.tokenizer, "pad_token_id", None)
        return tokenizer_pad if tokenizer_pad is not None else 0

    def _left_pad(self, prompts: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise MergeError("every prompt needs at least one token")
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt):] = 1
        return ids.to(self.device), mask.to(self.device)

    def _step(self, members: list[int], ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
              caches: list) -> torch.Tensor:
        """The weighted mean of the members' log-softmax at the last position, (B, V) float32."""
        total = None
        for slot, index in enumerate(members):
            keyword = self._cache_keywords[index]
            out = self.models[index](input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                                     **{keyword: caches[slot]})
            caches[slot] = getattr(out, keyword)
            logprobs = torch.log_softmax(out.logits[:, -1, :].float(), dim=-1)
            if total is not None and logprobs.shape[-1] != total.shape[-1]:
                raise MergeError(f"members[{index}] scores {logprobs.shape[-1]} tokens, members[{members[0]}] "
                                 f"{total.shape[-1]}: ensemble members need the same tokenizer and vocabulary")
            weight = self.weights[index] / sum(self.weights[i] for i in members)
            total = weight * logprobs if total is None else total + weight * logprobs
        return total

    @torch.inference_mode()
    def next_token_logprobs(self, prompts: Sequence[Sequence[int]], pad_token_id: int | None = None) -> torch.Tensor:
        """The ensemble's scores for the token after each prompt: ``sum_m w_m log_softmax(logits_m)``
        with the weights normalised to sum 1. Shapes: returns ``(len(prompts), vocab)``."""
        ids, mask = self._left_pad(prompts, self._pad_id(pad_token_id))
        with self._eval():
            return self._step(list(range(len(self.models))), ids, mask, (mask.cumsum(-1) - 1).clamp(min=0),
                              [None] * len(self.models))

    @contextlib.contextmanager
    def _eval(self) -> Iterator[None]:
        modes = [m.training for m in self.models]
        for m in self.models:
            m.eval()
        try:
            yield
        finally:
            for m, mode in zip(self.models, modes):
                m.train(mode)

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64, *, temperature: float = 0.0,
                 stop_token_ids: Sequence[int] = (), pad_token_id: int | None = None,
                 generator: torch.Generator | None = None) -> list[list[int]]:
        """One completion per prompt (token ids, the stop token included when one ended it).
        ``temperature`` 0 is greedy. Shapes: ``prompts`` is a list of token-id lists."""
        return self._decode(list(range(len(self.models))), prompts, max_new_tokens, temperature, stop_token_ids,
                            pad_token_id, generator)

    @torch.inference_mode()
    def _decode(self, members: list[int], prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float,
                stop_token_ids: Sequence[int], pad_token_id: int | None,
                generator: torch.Generator | None) -> list[list[int]]:
        if max_new_tokens < 1 or temperature < 0:
            raise MergeError("max_new_tokens must be >= 1 and temperature >= 0")
        pad = self._pad_id(pad_token_id)
        ids, mask = self._left_pad(prompts, pad)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        stops = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.long, device=ids.device)
        caches: list = [None] * len(members)
        done = torch.zeros(len(prompts), dtype=torch.bool, device=ids.device)
        completions: list[list[int]] = [[] for _ in prompts]
        with self._eval():
            for _ in range(max_new_tokens):
                scores = self._step(members, ids, mask, positions, caches)
                if temperature == 0:
                    token = scores.argmax(dim=-1)
                else:
                    probs = torch.softmax(scores / temperature, dim=-1)
                    token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
                token = torch.where(done, torch.full_like(token, pad), token)
                for row in (~done).nonzero().flatten().tolist():
                    completions[row].append(int(token[row]))
                done |= torch.isin(token, stops)
                if bool(done.all()):
                    break
                ids = token[:, None]
                mask = torch.cat([mask, torch.ones_like(ids)], dim=-1)
                positions = positions[:, -1:] + 1
        return completions

    def majority_vote(self, prompts: Sequence[Sequence[int]], answer_fn: Callable[[str], Any], *,
                      max_new_tokens: int = 64, temperature: float = 0.0, stop_token_ids: Sequence[int] = (),
                      pad_token_id: int | None = None, generator: torch.Generator | None = None) -> list[VoteResult]:
        """Every member answers every prompt on its own; ``answer_fn(decoded completion)`` extracts the
        final answer (None: no answer, no vote); the answer with the largest total member weight wins,
        a tie going to the answer of the earliest member."""
        if self.tokenizer is None:
            raise MergeError("majority_vote decodes completions: build EnsemblePolicy(models, tokenizer=...)")
        per_member = [self._decode([m], prompts, max_new_tokens, temperature, stop_token_ids, pad_token_id, generator)
                      for m in range(len(self.models))]
        results = []
        for row in range(len(prompts)):
            completions = [member[row] for member in per_member]
            answers = [answer_fn(self.tokenizer.decode(c, skip_special_tokens=True)) for c in completions]
            votes: dict = {}
            for answer, weight in zip(answers, self.weights):
                if answer is not None:
                    votes[answer] = votes.get(answer, 0.0) + weight
            best = max(votes.values(), default=None)
            winner = next((a for a in answers if a is not None and votes[a] == best), None)
            results.append(VoteResult(winner, votes, answers, completions))
        return results


# ==== 7. Command line ==============================================================================


@contextlib.contextmanager
def _progress_bar(enabled: bool) -> Iterator[Callable[[int, int, str], None] | None]:
    """A rich progress bar over tensors (plain periodic lines without rich; nothing when disabled)."""
    if not enabled:
        yield None
        return
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        def plain(done: int, total: int, name: str) -> None:
            if done == total or done % max(1, total // 20) == 0:
                print(f"  {done}/{total} tensors ({name})", file=sys.stderr)

        yield plain
        return
    bar = Progress(TextColumn("[bold]merging"), BarColumn(), MofNCompleteColumn(), TextColumn("tensors"),
                   TimeElapsedColumn(), TextColumn("{task.fields[name]}"), transient=True)
    task = bar.add_task("merge", total=None, name="")
    with bar:
        yield lambda done, total, name: bar.update(task, completed=done, total=total, name=name)


def _peak_memory_mb() -> float | None:
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def main(argv: Sequence[str] | None = None) -> int:
    """``python model_merging.py --config merge.yaml [key=value ...]``: merge, print a summary; a user
    mistake prints one ``error:`` line and exits with status 2."""
    parser = argparse.ArgumentParser(
        prog="model_merging.py", description="Merge fine-tuned checkpoints of one base model (streaming: "
        f"one tensor at a time). Methods: {', '.join(MERGE_METHODS)}. Example configs: configs/merge_*.yaml.",
        epilog=CONFIG_KEYS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="merge YAML (method, base_model, models, output_dir, ...)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="override a top-level key, e.g. density=0.3")
    parser.add_argument("--dry-run", action="store_true", help="check the config and inputs, write nothing")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")

    def usage_error(message: str) -> None:  # argparse's own prints the whole usage first: keep to one line
        print(f"error: command line: {message} (python model_merging.py --help lists the options)", file=sys.stderr)
        sys.exit(2)

    parser.error = usage_error
    if isinstance(argv, str):  # would be parsed letter by letter
        raise TypeError(f"argv must be a list of arguments, e.g. ['--config', 'merge.yaml'], got the string {argv!r}")
    args = parser.parse_args(argv)
    try:
        merger = ModelMerger(MergeConfig.from_yaml(args.config, args.overrides))
        if args.dry_run:
            plan = merger.plan()
            print(f"ok: {len(plan.jobs)} tensors from {len(plan.models) + (plan.base is not None)} checkpoints would "
                  f"be merged with {merger.config.method} into {merger.config.output_dir}")
            return 0
        with _progress_bar(not args.no_progress and sys.stderr.isatty()) as progress:
            result = merger.merge(progress=progress)
    except MergeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: nothing was written (the output appears only when a merge completes)", file=sys.stderr)
        return 130
    except OSError as err:  # the inputs and output_dir were checked: the disk or file system failed (status 1)
        print(f"error: {err}; nothing was written", file=sys.stderr)
        return 1
    peak = _peak_memory_mb()
    print(result.summary() + (f"\n  peak memory (this process): {peak:.0f} MB" if peak else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
