"""Tests for the tensor merge functions in model_merging.py.

Three kinds of checks:

- agreement with PEFT's reference implementation (``peft.utils.merge_utils``;
  PEFT is imported here only, never by the module under test);
- small examples worked out by hand;
- invariants (expectation of DARE, hypothesis property tests).
"""

from __future__ import annotations

import ast
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import model_merging as mm

MODULE_PATH = Path(mm.__file__)


def _load_peft_merge_utils():
    """Load ``peft/utils/merge_utils.py`` (the reference) from the installed PEFT.

    ``import peft.utils.merge_utils`` runs ``peft/__init__``, which imports
    transformers and takes several seconds; merge_utils itself only needs
    torch, so it is loaded on its own from its file. Returns None when PEFT
    is not installed.
    """
    spec = importlib.util.find_spec("peft")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = (
        Path(next(iter(spec.submodule_search_locations))) / "utils" / "merge_utils.py"
    )
    if not path.is_file():
        return None
    module_spec = importlib.util.spec_from_file_location(
        "_peft_merge_utils_reference", path
    )
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


peft_merge = _load_peft_merge_utils()
requires_peft = pytest.mark.skipif(peft_merge is None, reason="PEFT is not installed")

# PEFT warns "The density 1.0 is greater than or equal to 1, no pruning will be
# performed." when density == 1; that is expected in the comparisons below.
ignore_peft_density_warning = pytest.mark.filterwarnings(
    "ignore:The density .* no pruning:UserWarning"
)


def _task_tensors(n: int, shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(n)]


# ---------------------------------------------------------------------------
# Module hygiene
# ---------------------------------------------------------------------------


def test_module_imports_only_torch_and_stdlib():
    tree = ast.parse(MODULE_PATH.read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            roots.add((node.module or "").split(".")[0])
    third_party = roots - set(sys.stdlib_module_names)
    # yaml (config files) and rich (progress bar) are imported lazily, inside functions
    assert third_party <= {"torch", "yaml", "rich"}, third_party
    assert not roots & {"rlhf", "transformers", "peft", "inference_optimizations", "pickle"}
    top_level = {alias.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
    top_level |= {(node.module or "").split(".")[0] for node in tree.body if isinstance(node, ast.ImportFrom)}
    assert top_level - set(sys.stdlib_module_names) == {"torch"}


def test_docstrings_name_public_functions_and_shapes():
    doc = mm.__doc__ or ""
    for name in mm.__all__:
        assert f"``{name}``" in doc, f"module docstring does not list {name}"
        assert getattr(mm, name).__doc__ or name == "MERGE_METHODS", name
    for name in mm.TENSOR_FUNCTIONS:
        assert name in mm.__all__ and "Shapes:" in getattr(mm, name).__doc__, name
    assert "Ilharco" in mm.task_arithmetic.__doc__
    assert "Yadav" in mm.ties.__doc__
    assert "Super Mario" in mm.dare_linear.__doc__
    assert "Shoemake" in mm.slerp.__doc__
    assert "Jang" in mm.model_stock.__doc__
    assert "Wortsman" in mm.linear.__doc__ and "Wortsman" in mm.ModelSoup.__doc__
    assert "mergekit" in mm.layer_wise_interpolation.__doc__


# ---------------------------------------------------------------------------
# Agreement with PEFT
# ---------------------------------------------------------------------------


@requires_peft
@ignore_peft_density_warning
@pytest.mark.parametrize("density", [0.05, 0.29, 0.5, 0.7, 1.0])
@pytest.mark.parametrize("shape", [(100,), (7, 13), (3, 4, 5)])
def test_magnitude_based_pruning_matches_peft(density, shape):
    (x,) = _task_tensors(1, shape, seed=0)
    expected = peft_merge.prune(x, density, method="magnitude")
    torch.testing.assert_close(mm.magnitude_based_pruning(x, density), expected)


@requires_peft
@ignore_peft_density_warning
@pytest.mark.parametrize("rescale", [True, False])
@pytest.mark.parametrize("density", [0.1, 0.5, 0.9, 1.0])
def test_random_prune_matches_peft(density, rescale):
    (x,) = _task_tensors(1, (8, 16), seed=1)
    torch.manual_seed(123)
    expected = peft_merge.prune(x, density, method="random", rescale=rescale)
    # Explicit generator seeded like the global RNG gives the same mask...
    gen = torch.Generator().manual_seed(123)
    torch.testing.assert_close(
        mm.random_prune(x, density, rescale, generator=gen), expected
    )
    # ... and so does the global RNG when no generator is given.
    torch.manual_seed(123)
    torch.testing.assert_close(mm.random_prune(x, density, rescale), expected)


@requires_peft
@pytest.mark.parametrize("method", ["total", "frequency"])
def test_majority_sign_mask_and_disjoint_merge_match_peft(method):
    stacked = torch.stack(_task_tensors(4, (6, 5), seed=2))
    stacked[:, 0, :] = 0.0  # some all-zero entries (no agreeing task)
    expected_mask = peft_merge.calculate_majority_sign_mask(stacked, method=method)
    mask = mm.calculate_majority_sign_mask(stacked, method=method)
    assert torch.equal(mask, expected_mask)
    torch.testing.assert_close(
        mm.disjoint_merge(stacked, mask),
        peft_merge.disjoint_merge(stacked, expected_mask),
    )
    # A list of tensors is accepted as well as a stacked tensor.
    torch.testing.assert_close(
        mm.disjoint_merge(list(stacked), mask), peft_merge.disjoint_merge(stacked, mask)
    )


@requires_peft
@pytest.mark.parametrize("n", [1, 2, 4])
def test_task_arithmetic_matches_peft(n):
    tasks = _task_tensors(n, (9, 11), seed=3)
    weights = torch.linspace(-0.5, 1.5, n)
    expected = peft_merge.task_arithmetic(tasks, weights)
    torch.testing.assert_close(mm.task_arithmetic(tasks, weights), expected)
    torch.testing.assert_close(mm.task_arithmetic(tasks, weights.tolist()), expected)


@requires_peft
@ignore_peft_density_warning
@pytest.mark.parametrize("method", ["total", "frequency"])
@pytest.mark.parametrize("density", [0.2, 0.5, 1.0])
def test_ties_matches_peft(density, method):
    tasks = _task_tensors(3, (10, 12), seed=4)
    weights = torch.tensor([0.7, 1.3, -0.4])
    expected = peft_merge.ties(tasks, weights, density, majority_sign_method=method)
    got = mm.ties(tasks, weights, density, majority_sign_method=method)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(
        mm.ties(tasks, weights.tolist(), density, majority_sign_method=method), expected
    )


@requires_peft
@ignore_peft_density_warning
@pytest.mark.parametrize("density", [0.3, 0.8, 1.0])
def test_dare_linear_matches_peft(density):
    tasks = _task_tensors(3, (10, 12), seed=5)
    weights = torch.tensor([0.5, 1.0, 2.0])
    torch.manual_seed(7)
    expected = peft_merge.dare_linear(tasks, weights, density)
    gen = torch.Generator().manual_seed(7)
    torch.testing.assert_close(
        mm.dare_linear(tasks, weights, density, generator=gen), expected
    )
    torch.manual_seed(7)
    torch.testing.assert_close(
        mm.dare_linear(tasks, weights.tolist(), density), expected
    )


@requires_peft
@ignore_peft_density_warning
@pytest.mark.parametrize("method", ["total", "frequency"])
@pytest.mark.parametrize("density", [0.3, 0.8, 1.0])
def test_dare_ties_matches_peft(density, method):
    tasks = _task_tensors(3, (10, 12), seed=6)
    weights = torch.tensor([0.5, 1.0, 2.0])
    torch.manual_seed(11)
    expected = peft_merge.dare_ties(
        tasks, weights, density, majority_sign_method=method
    )
    gen = torch.Generator().manual_seed(11)
    got = mm.dare_ties(
        tasks, weights, density, majority_sign_method=method, generator=gen
    )
    torch.testing.assert_close(got, expected)


# ---------------------------------------------------------------------------
# Hand-derived examples
# ---------------------------------------------------------------------------


def test_magnitude_based_pruning_small_example():
    x = torch.tensor([0.1, -3.0, 2.0, -0.5, 0.0, 1.0])
    # density 0.5 -> k = 3: keep |-3|, |2|, |1|.
    expected = torch.tensor([0.0, -3.0, 2.0, 0.0, 0.0, 1.0])
    torch.testing.assert_close(mm.magnitude_based_pruning(x, 0.5), expected)


@pytest.mark.parametrize(
    ("density", "numel"), [(0.1, 50), (0.25, 40), (0.5, 7), (0.29, 100), (0.999, 10)]
)
def test_magnitude_based_pruning_keeps_exact_count(density, numel):
    # The kept count is int(density * numel), truncated exactly as PEFT does
    # (note 0.29 * 100 == 28.999999999999996 -> 28 kept, and 0.5 * 7 -> 3).
    (x,) = _task_tensors(1, (numel,), seed=8)
    out = mm.magnitude_based_pruning(x, density)
    k = int(density * numel)
    assert int((out != 0).sum()) == k
    kept = out != 0
    if 0 < k < numel:
        assert x[kept].abs().min() > x[~kept].abs().max()
    torch.testing.assert_close(out[kept], x[kept])


def test_task_arithmetic_is_weighted_sum():
    a = torch.tensor([1.0, 2.0, -1.0])
    b = torch.tensor([0.5, -4.0, 3.0])
    # 2 * a - 0.5 * b = [2 - 0.25, 4 + 2, -2 - 1.5]
    expected = torch.tensor([1.75, 6.0, -3.5])
    torch.testing.assert_close(mm.task_arithmetic([a, b], [2.0, -0.5]), expected)
    torch.testing.assert_close(
        mm.task_arithmetic([a, b], torch.tensor([2.0, -0.5])), expected
    )


def test_ties_two_task_example_by_hand():
    tau1 = torch.tensor([3.0, -1.0, 0.5, -4.0])
    tau2 = torch.tensor([-2.0, 5.0, -1.0, -0.5])
    weights = [1.0, 0.5]
    # density 0.5, numel 4 -> keep k = 2 entries per task.
    # 1. Trim:    tau1 -> [ 3, 0, 0, -4]   (|-4|, |3| are the top 2)
    #             tau2 -> [-2, 5, 0,  0]   (|5|, |-2| are the top 2)
    # 2. Elect ("total", on the trimmed, unweighted tensors):
    #             sums  = [ 1, 5, 0, -4] -> signs [+, +, + (tie -> +), -]
    #             agree1 = [T, F (zero), F (zero), T]
    #             agree2 = [F (neg), T, F (zero), F (zero)]
    # 3. Weight then disjoint mean over agreeing tasks (count, not weight sum):
    #             weighted tau2 = [-1, 2.5, 0, 0]
    #             entry 0: 3 / 1 = 3        (tau2 disagrees, dropped)
    #             entry 1: 2.5 / 1 = 2.5
    #             entry 2: 0 / max(0, 1) = 0
    #             entry 3: -4 / 1 = -4
    expected = torch.tensor([3.0, 2.5, 0.0, -4.0])
    torch.testing.assert_close(mm.ties([tau1, tau2], weights, 0.5), expected)

    # Same trimming, both tasks agreeing on entry 0 once tau2[0] is positive:
    # entry 0 = (1 * 3 + 0.5 * 2) / 2 = 2  (mean over 2 agreeing tasks).
    tau2_pos = torch.tensor([2.0, 5.0, -1.0, -0.5])
    expected_pos = torch.tensor([2.0, 2.5, 0.0, -4.0])
    torch.testing.assert_close(mm.ties([tau1, tau2_pos], weights, 0.5), expected_pos)


def test_ties_total_vs_frequency_by_hand():
    # One entry, three tasks, no trimming: values 1, 1, -5, weights 1.
    tasks = [torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor([-5.0])]
    # "total": 1 + 1 - 5 = -3 -> sign -, only task 3 agrees -> -5 / 1.
    torch.testing.assert_close(
        mm.ties(tasks, [1.0, 1.0, 1.0], 1.0, "total"), torch.tensor([-5.0])
    )
    # "frequency": +1 +1 -1 = +1 -> sign +, tasks 1, 2 agree -> (1 + 1) / 2.
    torch.testing.assert_close(
        mm.ties(tasks, [1.0, 1.0, 1.0], 1.0, "frequency"), torch.tensor([1.0])
    )


def test_merge_keeps_task_dtype():
    tasks = [t.to(torch.bfloat16) for t in _task_tensors(2, (4, 4), seed=9)]
    for out in (
        mm.task_arithmetic(tasks, [0.3, 0.7]),
        mm.ties(tasks, torch.tensor([0.3, 0.7]), 0.5),
        mm.dare_linear(
            tasks, [0.3, 0.7], 0.5, generator=torch.Generator().manual_seed(0)
        ),
        mm.dare_ties(
            tasks, [0.3, 0.7], 0.5, generator=torch.Generator().manual_seed(0)
        ),
        mm.slerp(0.3, tasks[0], tasks[1]),
    ):
        assert out.dtype == torch.bfloat16
        assert out.shape == (4, 4)


# ---------------------------------------------------------------------------
# DARE
# ---------------------------------------------------------------------------


def test_dare_density_one_equals_task_arithmetic():
    tasks = _task_tensors(3, (5, 6), seed=10)
    weights = [0.2, -1.0, 0.9]
    expected = mm.task_arithmetic(tasks, weights)
    torch.testing.assert_close(mm.dare_linear(tasks, weights, 1.0), expected)
    # dare_ties at density 1 is TIES without trimming.
    torch.testing.assert_close(
        mm.dare_ties(tasks, weights, 1.0), mm.ties(tasks, weights, 1.0)
    )


def test_dare_density_one_draws_no_random_numbers():
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    mm.dare_linear(_task_tensors(2, (3,), seed=0), [1.0, 1.0], 1.0, generator=gen)
    assert torch.equal(gen.get_state(), state)


def test_random_prune_preserves_expectation():
    density = 0.3
    x = torch.tensor([1.0, -2.0, 0.5, 4.0, -0.25, 3.0, 0.0, -1.5])
    draws = 20_000
    gen = torch.Generator().manual_seed(0)
    pruned = mm.random_prune(
        x.expand(draws, -1).contiguous(), density, True, generator=gen
    )
    # Each entry: x / p with prob. p, else 0 -> mean x, std |x| sqrt((1-p)/p).
    std_of_mean = x.abs() * math.sqrt((1 - density) / density / draws)
    assert torch.all((pruned.mean(dim=0) - x).abs() <= 5 * std_of_mean + 1e-6)
    # Fraction kept is about density.
    kept = (pruned[:, x != 0] != 0).float().mean()
    assert abs(float(kept) - density) < 0.01


def test_dare_linear_preserves_expectation():
    tasks = _task_tensors(2, (12,), seed=12)
    weights = [0.6, 1.4]
    density, draws = 0.5, 3000
    gen = torch.Generator().manual_seed(1)
    mean = torch.stack(
        [mm.dare_linear(tasks, weights, density, generator=gen) for _ in range(draws)]
    ).mean(dim=0)
    expected = mm.task_arithmetic(tasks, weights)
    # Per entry std of a draw: sqrt(sum_i w_i^2 x_i^2 (1-p)/p); 5 sigma band.
    stacked = torch.stack(tasks)
    w = torch.tensor(weights)[:, None]
    sigma = ((w * stacked) ** 2 * (1 - density) / density).sum(0).sqrt()
    assert torch.all((mean - expected).abs() <= 5 * sigma / math.sqrt(draws) + 1e-6)


def test_random_prune_without_rescale_only_zeroes():
    (x,) = _task_tensors(1, (200,), seed=13)
    out = mm.random_prune(
        x, 0.4, rescale=False, generator=torch.Generator().manual_seed(0)
    )
    kept = out != 0
    torch.testing.assert_close(out[kept], x[kept])
    assert 0 < int(kept.sum()) < 200


# ---------------------------------------------------------------------------
# SLERP
# ---------------------------------------------------------------------------


def test_slerp_endpoints():
    v0, v1 = _task_tensors(2, (3, 4), seed=14)
    torch.testing.assert_close(mm.slerp(0.0, v0, v1), v0)
    torch.testing.assert_close(mm.slerp(1.0, v0, v1), v1)


def test_slerp_orthogonal_midpoint():
    v0 = torch.tensor([1.0, 0.0, 0.0])
    v1 = torch.tensor([0.0, 1.0, 0.0])
    out = mm.slerp(0.5, v0, v1)
    assert math.isclose(float(out.norm()), 1.0, rel_tol=1e-6)
    angle0 = math.acos(float(out @ v0) / float(out.norm()))
    angle1 = math.acos(float(out @ v1) / float(out.norm()))
    assert math.isclose(angle0, angle1, rel_tol=1e-6)
    assert math.isclose(angle0, math.pi / 4, rel_tol=1e-6)


@pytest.mark.parametrize("t", [0.1, 0.37, 0.8])
@pytest.mark.parametrize("theta", [0.3, 1.2, 2.5])
def test_slerp_follows_great_circle(t, theta):
    # With e0, e1 orthonormal, v0 = e0 and v1 = cos(theta) e0 + sin(theta) e1,
    # the point at fraction t of the arc is cos(t theta) e0 + sin(t theta) e1.
    e0 = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    e1 = torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    v1 = math.cos(theta) * e0 + math.sin(theta) * e1
    expected = math.cos(t * theta) * e0 + math.sin(t * theta) * e1
    torch.testing.assert_close(mm.slerp(t, e0, v1), expected)
    # Shape is preserved for non-flat tensors.
    out = mm.slerp(t, e0.view(2, 2), v1.view(2, 2))
    torch.testing.assert_close(out, expected.view(2, 2))


def test_slerp_colinear_falls_back_to_lerp():
    v0 = torch.tensor([1.0, 2.0, 3.0])
    v1 = 2.5 * v0  # parallel: cos = 1 > dot_threshold
    torch.testing.assert_close(mm.slerp(0.3, v0, v1), 0.7 * v0 + 0.3 * v1)
    # Nearly parallel: still above the default threshold.
    v2 = v0 + torch.tensor([1e-3, 0.0, 0.0])
    torch.testing.assert_close(mm.slerp(0.6, v0, v2), 0.4 * v0 + 0.6 * v2)
    # A zero vector has no direction: lerp as well.
    zero = torch.zeros(3)
    torch.testing.assert_close(mm.slerp(0.25, zero, v0), 0.25 * v0)


# ---------------------------------------------------------------------------
# Argument validation
# ---------------------------------------------------------------------------

BAD_DENSITIES = [0.0, -0.1, 1.5, float("nan")]


@pytest.mark.parametrize("density", BAD_DENSITIES)
def test_bad_density_raises(density):
    tasks = _task_tensors(2, (4,), seed=15)
    w = [1.0, 1.0]
    calls = [
        lambda: mm.magnitude_based_pruning(tasks[0], density),
        lambda: mm.magnitude_prune(tasks, w, density),
        lambda: mm.random_prune(tasks[0], density, True),
        lambda: mm.ties(tasks, w, density),
        lambda: mm.dare_linear(tasks, w, density),
        lambda: mm.dare_ties(tasks, w, density),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"density must be in \(0, 1\]"):
            call()


@pytest.mark.parametrize(
    "func", ["task_arithmetic", "ties", "dare_linear", "dare_ties", "magnitude_prune", "linear"]
)
def test_bad_lengths_and_shapes_raise(func):
    merge = getattr(mm, func)
    extra = {} if func in ("task_arithmetic", "linear") else {"density": 0.5}
    tasks = _task_tensors(2, (4,), seed=16)
    with pytest.raises(ValueError, match="weights must have one entry per task tensor"):
        merge(tasks, [1.0, 1.0, 1.0], **extra)
    with pytest.raises(ValueError, match="weights must have one entry per task tensor"):
        merge(tasks, torch.tensor([1.0]), **extra)
    with pytest.raises(ValueError, match="weights must be 1-D"):
        merge(tasks, torch.ones(2, 1), **extra)
    with pytest.raises(ValueError, match="(task_)?tensors must all have the same shape"):
        merge([tasks[0], torch.zeros(5)], [1.0, 1.0], **extra)
    with pytest.raises(ValueError, match="at least one tensor"):
        merge([], [], **extra)


def test_unknown_sign_method_raises():
    tasks = _task_tensors(2, (4,), seed=17)
    with pytest.raises(
        ValueError,
        match=r"majority_sign_method must be one of \['total', 'frequency'\]",
    ):
        mm.ties(tasks, [1.0, 1.0], 0.5, majority_sign_method="mean")
    with pytest.raises(ValueError, match=r"majority_sign_method must be one of"):
        mm.dare_ties(tasks, [1.0, 1.0], 0.5, majority_sign_method="sum")
    with pytest.raises(
        ValueError, match=r"method must be one of \['total', 'frequency'\]"
    ):
        mm.calculate_majority_sign_mask(torch.stack(tasks), method="mean")


def test_validation_happens_before_random_draws():
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    with pytest.raises(ValueError):
        mm.dare_ties(_task_tensors(2, (4,), seed=0), [1.0], 0.5, generator=gen)
    assert torch.equal(gen.get_state(), state)


def test_disjoint_merge_mask_shape_mismatch_raises():
    stacked = torch.stack(_task_tensors(2, (4,), seed=18))
    with pytest.raises(ValueError, match="majority_sign_mask must have the same shape"):
        mm.disjoint_merge(stacked, torch.ones(3, 4, dtype=torch.bool))


def test_slerp_bad_arguments_raise():
    v = torch.ones(3)
    for t in (-0.1, 1.1):
        with pytest.raises(ValueError, match=r"t must be in \[0, 1\]"):
            mm.slerp(t, v, v)
    with pytest.raises(ValueError, match="v0 and v1 must have the same shape"):
        mm.slerp(0.5, v, torch.ones(4))


# ---------------------------------------------------------------------------
# Property tests
# ---------------------------------------------------------------------------

_positive = st.floats(
    min_value=1e-3, max_value=1e3, allow_nan=False, allow_infinity=False
)
_weight = st.floats(
    min_value=-2.0, max_value=2.0, allow_nan=False, allow_infinity=False
)


@st.composite
def _positive_tasks_and_weights(draw):
    n = draw(st.integers(min_value=1, max_value=4))
    size = draw(st.integers(min_value=1, max_value=6))
    values = draw(st.lists(_positive, min_size=n * size, max_size=n * size))
    weights = draw(st.lists(_weight, min_size=n, max_size=n))
    tasks = torch.tensor(values, dtype=torch.float64).view(n, size)
    return list(tasks), weights


@settings(max_examples=50, deadline=None)
@given(
    data=_positive_tasks_and_weights(), method=st.sampled_from(["total", "frequency"])
)
def test_ties_density_one_positive_is_mean_of_weighted(data, method):
    # With density 1 nothing is trimmed; with all-positive task tensors every
    # task agrees with the elected + sign (whatever the weights), so the PEFT
    # disjoint merge is the plain mean over all n tasks of w_i * tau_i.
    tasks, weights = data
    n = len(tasks)
    expected = sum(w * t for w, t in zip(weights, tasks, strict=True)) / n
    torch.testing.assert_close(mm.ties(tasks, weights, 1.0, method), expected)


@settings(max_examples=50, deadline=None)
@given(
    # Integer values keep the "total" vote sums exact, so the elected sign
    # cannot flip with the summation order.
    values=st.lists(st.integers(min_value=-10, max_value=10), min_size=12, max_size=12),
    weights=st.lists(_weight, min_size=3, max_size=3),
    perm=st.permutations([0, 1, 2]),
    density=st.sampled_from([0.25, 0.5, 1.0]),
)
def test_ties_is_invariant_to_task_order(values, weights, perm, density):
    tasks = list(torch.tensor(values, dtype=torch.float64).view(3, 4))
    out = mm.ties(tasks, weights, density)
    permuted = mm.ties([tasks[i] for i in perm], [weights[i] for i in perm], density)
    torch.testing.assert_close(permuted, out)


@settings(max_examples=50, deadline=None)
@given(
    values=st.lists(
        st.floats(min_value=-10, max_value=10, allow_nan=False), min_size=1, max_size=10
    ),
    weight=_weight,
)
def test_ties_single_task_density_one_is_scaled_task(values, weight):
    # One task always agrees with its own sign, so TIES reduces to w * tau.
    tau = torch.tensor(values, dtype=torch.float64)
    torch.testing.assert_close(mm.ties([tau], [weight], 1.0), weight * tau)


# ---------------------------------------------------------------------------
# magnitude_prune (PEFT's combination), linear, model_stock
# ---------------------------------------------------------------------------


@requires_peft
@ignore_peft_density_warning
@pytest.mark.parametrize("density", [0.1, 0.5, 1.0])
def test_magnitude_prune_merge_matches_peft(density):
    tasks = _task_tensors(3, (9, 7), seed=19)
    weights = torch.tensor([0.3, -1.0, 2.0])
    expected = peft_merge.magnitude_prune(tasks, weights, density)
    torch.testing.assert_close(mm.magnitude_prune(tasks, weights, density), expected)


def test_magnitude_prune_merge_by_hand():
    tau1 = torch.tensor([3.0, -1.0, 0.5, -4.0])
    tau2 = torch.tensor([-2.0, 5.0, -1.0, -0.5])
    # density 0.5 keeps 2 entries each: [3, 0, 0, -4] and [-2, 5, 0, 0]; no sign election:
    # 1 * [3, 0, 0, -4] + 0.5 * [-2, 5, 0, 0] = [2, 2.5, 0, -4]
    expected = torch.tensor([2.0, 2.5, 0.0, -4.0])
    torch.testing.assert_close(mm.magnitude_prune([tau1, tau2], [1.0, 0.5], 0.5), expected)


def test_linear_by_hand():
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, -2.0])
    # normalised: (1 * a + 3 * b) / 4 = [(1 + 9) / 4, (2 - 6) / 4]
    torch.testing.assert_close(mm.linear([a, b], [1.0, 3.0]), torch.tensor([2.5, -1.0]))
    torch.testing.assert_close(mm.linear([a, b], [1.0, 3.0], normalize=False), torch.tensor([10.0, -4.0]))
    with pytest.raises(ValueError, match="weights sum to 0"):
        mm.linear([a, b], [1.0, -1.0])


def _model_stock_by_formula(base, tensors):
    # Jang et al. 2024 eq. 6 with mergekit's mean of pairwise cosines, written out independently
    deltas = [(t - base).double().flatten() for t in tensors]
    cosines = [
        float(deltas[i] @ deltas[j] / (deltas[i].norm() * deltas[j].norm()))
        for i in range(len(deltas))
        for j in range(i + 1, len(deltas))
    ]
    cos = sum(cosines) / len(cosines)
    k = len(tensors)
    t = k * cos / (1 + (k - 1) * cos)
    return t * torch.stack(tensors).mean(0) + (1 - t) * base


def test_model_stock_by_hand():
    base = torch.tensor([1.0, 1.0, 1.0])
    e1, e2 = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 1.0, 0.0])
    # orthogonal task vectors: cos 0 -> t 0 -> the base itself
    torch.testing.assert_close(mm.model_stock(base, [base + e1, base + e2]), base)
    # identical task vectors: cos 1 -> t = 2 / (1 + 1) = 1 -> the fine-tuned mean
    torch.testing.assert_close(mm.model_stock(base, [base + e1, base + e1]), base + e1)
    # 60 degrees: cos 0.5, k = 2 -> t = 1 / 1.5 = 2/3 of the way to the mean (e1 + v) / 2
    v = torch.tensor([0.5, math.sqrt(3) / 2, 0.0])
    expected = base + (2 / 3) * (e1 + v) / 2
    torch.testing.assert_close(mm.model_stock(base, [base + e1, base + v]), expected)


def test_model_stock_matches_formula_for_three_models():
    base, *tensors = _task_tensors(4, (6, 5), seed=20)
    tensors = [base + 0.3 * t + 0.5 for t in tensors]  # correlated task vectors (common shift)
    torch.testing.assert_close(mm.model_stock(base, tensors), _model_stock_by_formula(base, tensors).float())


def test_model_stock_needs_two_models():
    (x,) = _task_tensors(1, (3,), seed=21)
    with pytest.raises(ValueError, match="at least 2 fine-tuned tensors"):
        mm.model_stock(x, [x + 1])


# ---------------------------------------------------------------------------
# SLERP norms, DARE with one generator per task
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("t", [0.0, 0.2, 0.5, 0.9, 1.0])
def test_slerp_keeps_unit_norm(t):
    v0, v1 = _task_tensors(2, (16,), seed=22)
    v0, v1 = v0 / v0.norm(), v1 / v1.norm()
    out = mm.slerp(t, v0, v1)
    assert math.isclose(float(out.norm()), 1.0, rel_tol=1e-5)
    # a linear interpolation of the same vectors is shorter (the chord, not the arc), except at the ends
    chord = float(((1 - t) * v0 + t * v1).norm())
    assert chord <= 1.0 + 1e-6 and (chord < 0.999 or t in (0.0, 1.0))


def test_dare_with_one_generator_per_task_equals_per_task_drops():
    tasks = _task_tensors(3, (40,), seed=23)
    weights = [0.5, 1.0, -0.7]
    got = mm.dare_ties(tasks, weights, 0.4, generator=[torch.Generator().manual_seed(s) for s in (1, 2, 3)])
    dropped = [
        mm.random_prune(t, 0.4, True, generator=torch.Generator().manual_seed(s))
        for t, s in zip(tasks, (1, 2, 3))
    ]
    stacked = torch.stack(dropped)
    mask = mm.calculate_majority_sign_mask(stacked)
    expected = mm.disjoint_merge(stacked * torch.tensor(weights)[:, None], mask)
    torch.testing.assert_close(got, expected)
    with pytest.raises(ValueError, match="one per task tensor"):
        mm.dare_linear(tasks, weights, 0.4, generator=[torch.Generator()])


def test_bernoulli_draws_chunk_by_chunk_equal_one_draw():
    # The streaming merger relies on this: a generator's draws over consecutive chunks of a tensor
    # equal one draw over the whole tensor (torch.bernoulli fills entries in order on CPU).
    x = torch.randn(300_001)
    whole = mm.random_prune(x, 0.3, True, generator=torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(5)
    bounds = [0, 7, 100_000, 250_003, 300_001]
    parts = [mm.random_prune(x[a:b], 0.3, True, generator=gen) for a, b in zip(bounds, bounds[1:])]
    assert torch.equal(torch.cat(parts), whole)


# ---------------------------------------------------------------------------
# Per-layer schedules
# ---------------------------------------------------------------------------


def test_layer_index_parses_common_names():
    assert mm.layer_index("model.layers.3.mlp.up_proj.weight") == 3
    assert mm.layer_index("transformer.h.11.attn.c_attn.weight") == 11
    assert mm.layer_index("backbone.layers.0.mixer.A_log") == 0
    assert mm.layer_index("encoder.layer.2.output.dense.bias") == 2
    assert mm.layer_index("model.embed_tokens.weight") is None
    assert mm.layer_index("lm_head.weight") is None


def test_layer_wise_interpolation_by_hand():
    assert mm.layer_wise_interpolation([0.0, 1.0], 5) == [0.0, 0.25, 0.5, 0.75, 1.0]
    # three anchors over five layers sit at positions 0, 0.5, 1: layer 3 is halfway between 0.5 and 0.3
    assert mm.layer_wise_interpolation([0.0, 0.5, 0.3], 5) == pytest.approx([0.0, 0.25, 0.5, 0.4, 0.3])
    assert mm.layer_wise_interpolation([0.7], 3) == [0.7, 0.7, 0.7]
    assert mm.layer_wise_interpolation([0.2, 0.9], 1) == [0.9]  # mergekit: t = 1 for a single layer
    with pytest.raises(ValueError):
        mm.layer_wise_interpolation([], 3)


def test_setting_for_tensor_layers_and_outside():
    anchors = [0.0, 1.0]
    assert mm.setting_for_tensor(anchors, "model.layers.2.mlp.up_proj.weight", 5) == 0.5
    assert mm.setting_for_tensor(anchors, "model.embed_tokens.weight", 5) == 0.0  # before the layers
    assert mm.setting_for_tensor(anchors, "model.norm.weight", 5) == 1.0  # after them
    assert mm.setting_for_tensor(anchors, "lm_head.weight", 5) == 1.0
    assert mm.setting_for_tensor(0.3, "anything", 5) == 0.3
    conditional = [{"filter": "self_attn", "value": [0.0, 1.0]}, {"filter": "mlp", "value": 0.9}, {"value": 0.5}]
    assert mm.setting_for_tensor(conditional, "model.layers.1.self_attn.q_proj.weight", 3) == 0.5
    assert mm.setting_for_tensor(conditional, "model.layers.2.self_attn.q_proj.weight", 3) == 1.0
    assert mm.setting_for_tensor(conditional, "model.layers.0.mlp.up_proj.weight", 3) == 0.9
    assert mm.setting_for_tensor(conditional, "model.norm.weight", 3) == 0.5
    with pytest.raises(ValueError, match="no entry"):
        mm.setting_for_tensor([{"filter": "mlp", "value": 1.0}], "model.norm.weight", 3)


# ---------------------------------------------------------------------------
# The streaming trim (used by ModelMerger for TIES and magnitude_prune)
# ---------------------------------------------------------------------------


def _trim_in_chunks(x, density, chunk):
    trim = mm._MagnitudeTrim.from_magnitudes(x.abs().flatten(), density)
    flat = x.flatten()
    return torch.cat([trim.apply(flat[i:i + chunk]) for i in range(0, flat.numel(), chunk)]).view(x.shape)


@pytest.mark.parametrize("density", [0.01, 0.3, 0.5, 0.99, 1.0])
@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_streaming_trim_equals_topk_without_ties(density, chunk):
    (x,) = _task_tensors(1, (20, 13), seed=24)  # continuous values: no two magnitudes tie
    torch.testing.assert_close(_trim_in_chunks(x, density, chunk), mm.magnitude_based_pruning(x, density))


def test_streaming_trim_breaks_ties_by_position():
    x = torch.tensor([1.0, -2.0, 2.0, 2.0, 0.5, -2.0])
    # density 0.5 -> k = 3 of the four entries with |x| = 2: the first three in flat order
    torch.testing.assert_close(_trim_in_chunks(x, 0.5, 2), torch.tensor([0.0, -2.0, 2.0, 2.0, 0.0, 0.0]))
    # k = 4 keeps every tie; k = 1 only the first
    torch.testing.assert_close(_trim_in_chunks(x, 0.67, 4), torch.tensor([0.0, -2.0, 2.0, 2.0, 0.0, -2.0]))
    torch.testing.assert_close(_trim_in_chunks(x, 0.2, 1), torch.tensor([0.0, -2.0, 0.0, 0.0, 0.0, 0.0]))
    # k = 0 keeps nothing
    torch.testing.assert_close(_trim_in_chunks(x, 0.1, 3), torch.zeros(6))
