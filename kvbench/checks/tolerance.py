"""How far apart two correct computations of the same quantity may land when only their rounding differs.

Another CPU, thread count or BLAS build, a GPU kernel or a prompt split in two sums the same terms in another order.
Each rounding moves a result by up to one unit roundoff `u` of the dtype, in either direction, so the differences
add up like a random walk: about `u * sqrt(n)` of the result's magnitude after `n` roundings. A tolerance is that,
times a margin, relative to the size of the values compared, never a number read off one machine.

A model's output (a logit, a log-probability) went through every layer: its activations are rounded after each of
about `ROUNDINGS_PER_LAYER` operations, and in float32 every term of every sum is rounded too (a 16-bit matmul
accumulates in float32, so there only the outputs count).
"""

from __future__ import annotations

import math
from typing import Any

import torch

UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
ROUNDINGS_PER_LAYER = 12  # norm, q/k/v, rotary, attention, output projection, residual, norm, gate/up, act, down
MARGIN = 2.0  # a random walk lands past two standard deviations one time in twenty; past its worst case never
SELF_ACCUMULATING = (torch.float64, torch.float32)  # dtypes whose sums also accumulate in the dtype itself


def relative_tolerance(dtype: torch.dtype, roundings: float) -> float:
    """How far, relative to the values' magnitude, two orders of the same `roundings` roundings may differ."""
    return MARGIN * UNIT_ROUNDOFF[dtype] * math.sqrt(max(roundings, 1.0))


def sum_roundings(terms: int) -> float:
    """Roundings in a sum of `terms` terms, one per addition."""
    return float(terms)


def forward_roundings(config: Any, dtype: torch.dtype) -> float:
    """Roundings in a model's output: each layer's operations, and in a self-accumulating dtype every term of the
    widest sum in a layer (the MLP's, over `intermediate_size`)."""
    config = getattr(config, "text_config", None) or config
    per_layer = ROUNDINGS_PER_LAYER
    if dtype in SELF_ACCUMULATING:
        per_layer *= max(config.hidden_size, getattr(config, "intermediate_size", None) or config.hidden_size)
    return float(config.num_hidden_layers * per_layer)


def model_tolerance(config: Any, dtype: torch.dtype) -> float:
    """Relative tolerance for a model's outputs in `dtype` (`relative_tolerance` of `forward_roundings`)."""
    return relative_tolerance(dtype, forward_roundings(config, dtype))


def magnitude(values: Any, floor: float = 1.0) -> float:
    """The size a relative tolerance scales with: the largest |value|, but at least `floor` so that values near zero
    (a log-probability of a sure token, a difference of nearly equal terms) keep the scale of what produced them."""
    tensor = torch.as_tensor(values).double()
    finite = tensor[tensor.isfinite()]  # an infinite entry (a masked score) compares as equal or not, by no scale
    largest = float(finite.abs().max()) if finite.numel() else 0.0
    return max(largest, floor)
