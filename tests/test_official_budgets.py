"""PyramidKV's layer budgets and Ada-KV's head budgets are the official implementations' numbers, worked out by hand.

PyramidKV: KVCache-Factory `PyramidKVCluster.update_kv` (pyramidkv/pyramidkv_utils.py), with C the budget
(`max_capacity_prompt`), w the window, L the layers, i the layer, n the prompt (`q_len`), all integers:
    min_num = (C - w) // beta;  max_num = 2 (C - w) - min_num
    if max_num >= n - w:  max_num = n - w;  min_num = 2 (C - w) - max_num        (the cap)
    steps = (max_num - min_num) // (L - 1);  prefix_i = max_num - i x steps
    n < C: nothing evicted;  n < 2 (C - w): every layer keeps C - w + w;  else layer i keeps prefix_i + w.
Ada-KV: FFY0/AdaKV `AdaptiveSnapKVCluster` (adaptive_snapkv/monkeypatch/snapkv_utils.py), base = C - w:
    floor = int(base x alpha); the layer's heads x base best prefix scores are counted per head (c_h);
    head h keeps its round(c_h x (1 - alpha) + floor) best prefix entries, and its window.
"""

from __future__ import annotations

import pytest
import torch

from kvbench.engine.cache import CacheSettings, KVCache
from kvbench.policies import build_policy
from kvbench.policies.base import spread_budgets
from tests.conftest import random_ids
from tests.helpers import kept_masks, run_session

# --- PyramidKV: C = 614, w = 32, beta = 20, L = 32 ------------------------------------------------------------
# C - w = 582; min_num = 582 // 20 = 29; max_num = 2 x 582 - 29 = 1135.

# n = 1024: the cap gives max_num = 1024 - 32 = 992 (992 <= 1135), min_num = 1164 - 992 = 172, but n = 1024 is
# below 2 (C - w) = 1164, so the official code takes its middle branch: every layer keeps 582 + 32 = 614
# (the old kvbench schedule gave layer 0 1167 entries, more than the prompt)
MIDDLE_1024 = [614] * 32

# n = 1166 >= 1164, and max_num 1135 >= 1166 - 32 = 1134: the cap binds. max_num = 1134, min_num = 1164 - 1134
# = 30; steps = (1134 - 30) // 31 = 1104 // 31 = 35 (31 x 35 = 1085, 19 left over); layer i keeps
# 1134 - 35 i + 32 = 1166 - 35 i: 1166 at layer 0 (the whole prompt), 1166 - 1085 = 81 at layer 31.
# Total 32 x 1166 - 35 x 496 = 19952, above 32 x 614 = 19648 by 19 x 32 / 2 = 304 (the floored step).
CAPPED_1166 = [1166, 1131, 1096, 1061, 1026, 991, 956, 921, 886, 851, 816, 781, 746, 711, 676, 641,
               606, 571, 536, 501, 466, 431, 396, 361, 326, 291, 256, 221, 186, 151, 116, 81]

# n = 4096 (or 1168, or unknown): max_num 1135 < n - 32, the cap does not bind. min_num = 29; steps =
# (1135 - 29) // 31 = 1106 // 31 = 35 (1085, 21 left over); layer i keeps 1135 - 35 i + 32 = 1167 - 35 i,
# 82 at layer 31 (50 = min_num 29 + the 21 the floored step leaves); total 19984 = 19648 + 21 x 32 / 2.
UNCAPPED = [1167, 1132, 1097, 1062, 1027, 992, 957, 922, 887, 852, 817, 782, 747, 712, 677, 642,
            607, 572, 537, 502, 467, 432, 397, 362, 327, 292, 257, 222, 187, 152, 117, 82]


@pytest.mark.parametrize("prompt,expected", [
    (1024, MIDDLE_1024),
    (600, [614] * 32),  # n < C: nothing is evicted (the budget is never reached)
    (1163, [614] * 32),  # 1163 < 1164: still the middle branch
    (1166, CAPPED_1166),
    (1168, UNCAPPED),  # 1168 - 32 = 1136 > 1135: the cap misses by one
    (4096, UNCAPPED),
    (None, UNCAPPED),  # prompt unknown: as long as no cap binds
])
def test_pyramidkv_layer_budgets_at_614_are_the_official_schedule(prompt, expected):
    policy = build_policy("pyramidkv", {"window": 32, "beta": 20})
    assert policy.layer_budgets(614, 32, prompt) == expected


@pytest.mark.parametrize("prompt,expected", [
    # C = 100, w = 32, beta = 4, L = 4: C - w = 68; min_num = 68 // 4 = 17; max_num = 136 - 17 = 119.
    # n = 1000: no cap; steps = (119 - 17) // 3 = 34 (exact); 119 - 34 i + 32 = 151, 117, 83, 49 (total 400)
    (1000, [151, 117, 83, 49]),
    # n = 140 >= 136 and 119 >= 140 - 32 = 108: capped. max_num = 108, min_num = 136 - 108 = 28;
    # steps = 80 // 3 = 26 (2 left over); 108 - 26 i + 32 = 140, 114, 88, 62 (total 404 = 400 + 2 x 4 / 2)
    (140, [140, 114, 88, 62]),
    # n = 120 < 136: the middle branch, 68 + 32 everywhere
    (120, [100, 100, 100, 100]),
])
def test_pyramidkv_layer_budgets_on_four_layers(prompt, expected):
    assert build_policy("pyramidkv", {"window": 32, "beta": 4}).layer_budgets(100, 4, prompt) == expected


def test_ada_kv_over_pyramidkv_takes_its_layer_budgets():
    policy = build_policy("ada_kv", {"base": {"name": "pyramidkv", "window": 32, "beta": 20}})
    assert spread_budgets(policy, 614, 32, 1166) == CAPPED_1166


@pytest.mark.parametrize("prompt,expected", [
    # C = 40, w = 8, beta = 20, L = 2: C - w = 32; min_num = 32 // 20 = 1; max_num = 64 - 1 = 63.
    # n = 70: 63 >= 62, capped: max_num = 62, min_num = 2; steps = 60 // 1; layers keep 62 + 8, 2 + 8
    (70, [70, 10]),
    (60, [40, 40]),  # 60 < 64: the middle branch
    (96, [71, 9]),  # 63 < 88: no cap; steps = 62; 63 + 8, 1 + 8
])
def test_a_session_sizes_pyramidkv_layers_by_its_prompt(tiny_llama, prompt, expected):
    session, _ = run_session(tiny_llama, build_policy("pyramidkv", {"window": 8, "beta": 20}),
                             random_ids(prompt, seed=3), [], budget=40)
    assert [layer.length for layer in session.cache.layers] == expected


# --- Ada-KV ---------------------------------------------------------------------------------------------------

def ada_kept(prefix_scores: list[list[float]], budget: int, window: int, alpha: float) -> list[list[int]]:
    """The positions each head keeps after Ada-KV (over SnapKV with kernel 1: the scores as given) compresses a
    one-layer cache whose prompt is `prefix_scores` per head followed by `window` tokens."""
    heads, prefix = len(prefix_scores), len(prefix_scores[0])
    policy = build_policy("ada_kv", {"base": {"name": "snapkv", "window": window, "kernel": 1}, "alpha": alpha})
    cache = KVCache(1, (1, heads, 4), policy, CacheSettings(budget=budget))
    layer = cache.layers[0]
    n = prefix + window
    layer.update(torch.zeros(1, heads, n, 4), torch.zeros(1, heads, n, 4))
    votes = torch.zeros(1, heads, n)
    votes[0, :, :prefix] = torch.tensor(prefix_scores)
    layer.slot_stat(policy._stages[0].state_key).copy_(votes)
    cache.compress()
    return [mask.nonzero()[:, 0].tolist() for mask in kept_masks(cache)[0]]


def test_ada_kv_floor_binds_for_a_head_with_only_low_scores():
    # budget 100, window 32, alpha 0.2: base = 68, floor = int(68 x 0.2) = int(13.6) = 13 prefix entries.
    # 2 heads, prefix 168 each; every score of head 0 beats every score of head 1, so the layer's 2 x 68 = 136
    # best are all head 0's: c = (136, 0). Head 0 keeps round(136 x 0.8 + 13) = round(121.8) = 122, head 1
    # round(0 x 0.8 + 13) = 13 (its floor): 199 entries, 1 short of 2 x 100 through the rounding.
    # (The old rule, round(0.2 x 100) = 20 counting the window, protected none of head 1's prefix: 168 and 32.)
    scores = [[2 - p / 1000 for p in range(168)], [1 - p / 1000 for p in range(168)]]
    window = list(range(168, 200))
    assert ada_kept(scores, budget=100, window=32, alpha=0.2) == [list(range(122)) + window,
                                                                   list(range(13)) + window]


def test_ada_kv_shares_base_x_heads_then_shrinks_toward_the_floor():
    # budget 100, window 32, alpha 0.2: base 68, floor 13; 4 heads, prefix 168. Head h has k_h = 100, 50, 0, 122
    # scores at the high level (272 = 4 x 68 in all), the rest low: c = (100, 50, 0, 122). Kept prefix:
    # round(100 x 0.8 + 13) = 93, round(50 x 0.8 + 13) = 53, round(0 + 13) = 13, round(122 x 0.8 + 13) =
    # round(110.6) = 111 (270 in all), each head's best by its own scores (falling with the position here).
    counted = [100, 50, 0, 122]
    scores = [[(10 if p < k else 1) - p / 1000 for p in range(168)] for k in counted]
    kept = ada_kept(scores, budget=100, window=32, alpha=0.2)
    assert [len(head) - 32 for head in kept] == [93, 53, 13, 111]
    assert kept == [list(range(k)) + list(range(168, 200)) for k in [93, 53, 13, 111]]


def test_ada_kv_default_floor_protects_prefix_entries_below_budget_160():
    # budget 160, window 32, alpha 0.2 (the defaults but the budget): base 128, floor = int(25.6) = 25;
    # 2 heads, prefix 268, head 0 above head 1: c = (256, 0); kept prefix round(204.8 + 25) = 230 and 25.
    # (The old floor, round(0.2 x 160) = 32, was all window: head 1 kept no prefix entry.)
    scores = [[2 - p / 1000 for p in range(268)], [1 - p / 1000 for p in range(268)]]
    kept = ada_kept(scores, budget=160, window=32, alpha=0.2)
    assert [len(head) - 32 for head in kept] == [230, 25]
    assert kept[1] == list(range(25)) + list(range(268, 300))
