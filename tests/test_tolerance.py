"""Tolerances from the arithmetic (checks/tolerance.py) and the check's comparison of generations that uses them."""

import pytest
import torch

from kvbench.checks.suite import compare_generations
from kvbench.checks.tolerance import forward_roundings, magnitude, model_tolerance, relative_tolerance, sum_roundings
from kvbench.engine.models import _random_config


def test_a_tolerance_grows_with_the_roundings_and_the_dtypes_unit_roundoff():
    assert relative_tolerance(torch.float32, 400) == pytest.approx(2 * 2**-24 * 20)
    assert relative_tolerance(torch.float32, 4) < relative_tolerance(torch.float32, 400)
    tolerances = [relative_tolerance(dtype, 100) for dtype in (torch.float64, torch.float32, torch.float16,
                                                                 torch.bfloat16)]
    assert tolerances == sorted(tolerances)
    assert relative_tolerance(torch.float32, sum_roundings(0)) == relative_tolerance(torch.float32, 1)


def test_float32_counts_every_term_of_a_sum_and_16_bit_dtypes_only_the_outputs():
    config = _random_config("smollm2-135m")  # 30 layers, an MLP of 1536
    assert forward_roundings(config, torch.bfloat16) == 30 * 12
    assert forward_roundings(config, torch.float32) == 30 * 12 * 1536


def test_the_magnitude_has_a_floor_for_values_near_zero():
    assert magnitude([-6.5, 2.0]) == 6.5
    assert magnitude([1e-9]) == 1.0 and magnitude([1e-9], floor=10.0) == 10.0
    assert magnitude(torch.empty(0)) == 1.0
    assert magnitude([float("-inf"), -3.0, float("nan")]) == 3.0


# Differences between two correct computations, measured (each the largest of its kind seen, then the date):
# SmolLM2-135M float32 on an AMD EPYC, a log-probability after a split prompt against one pass, 2026-12-03:
# -6.470528602600098 against -6.470517158508301; Llama-3-8B shape (random weights) in bfloat16 on an H200, kvbench's
# full against model.generate: 0.0226 x max |logit| (benchmarks/results/gpu-2026-12-04).
def test_the_tolerances_cover_what_other_machines_measured():
    smollm, llama = _random_config("smollm2-135m"), _random_config("llama-3-8b")
    epyc = abs(-6.470528602600098 - -6.470517158508301)
    assert epyc <= model_tolerance(smollm, torch.float32) * magnitude([-6.470517158508301])
    assert model_tolerance(llama, torch.bfloat16) >= 0.0226


def _steps(*rows: list[float]) -> list[torch.Tensor]:
    return [torch.tensor(row) for row in rows]


def test_generations_that_agree_pass_and_a_logit_beyond_the_limit_fails():
    reference = ([0, 1], _steps([5.0, 1.0, 0.0], [1.0, 5.0, 0.0]))
    close = ([0, 1], _steps([5.0, 1.0, 1e-3], [1.0, 5.0, 0.0]))
    far = ([0, 1], _steps([5.0, 1.0, 0.5], [1.0, 5.0, 0.0]))
    assert compare_generations(reference, close, limit=1e-3)[0]
    passed, text, numbers = compare_generations(reference, far, limit=1e-3)
    assert not passed and numbers["relative_logit_diff"] == pytest.approx(0.1) and "limit" in text


def test_a_token_the_reference_ties_within_the_limit_may_differ_and_ends_the_comparison():
    # step 1: the reference prefers token 1 over token 2 by 0.01 logits, 0.002 of its largest logit
    reference = ([0, 1, 0], _steps([5.0, 1.0, 0.0], [0.0, 4.99, 4.98], [5.0, 0.0, 0.0]))
    flipped = ([0, 2, 2], _steps([5.0, 1.0, 0.0], [0.0, 4.98, 4.99], [0.0, 0.0, 5.0]))
    passed, text, numbers = compare_generations(reference, flipped, limit=0.005)
    assert passed and numbers["tied"] and numbers["tokens_equal"] == 1 and "tied" in text
    # the same flip where the reference's margin is beyond the limit is a real difference
    assert not compare_generations(reference, flipped, limit=0.001)[0]


def test_a_token_flip_with_a_clear_margin_fails_even_if_the_logits_are_within_the_limit():
    reference = ([0, 1], _steps([5.0, 1.0, 0.0], [0.0, 5.0, 0.0]))
    flipped = ([0, 2], _steps([5.0, 1.0, 0.0], [0.0, 5.0, 0.0]))
    passed, _, numbers = compare_generations(reference, flipped, limit=0.5)
    assert not passed and not numbers["tied"]
