"""What a cache keeps, a mask per layer over its KV heads and positions, and how far two kept sets agree: what
`kvbench check` and the kvpress parity lane hold a policy to its reference by."""

from __future__ import annotations

import statistics
from typing import Any

import torch

from kvbench.engine.cache import KVCache
from kvbench.engine.models import LoadedModel
from kvbench.engine.session import Session
from kvbench.engine.settings import RunSettings
from kvbench.engine.storage import StoredLayerKV
from kvbench.policies import build_policy

TIE_TOLERANCE = 1e-4  # relative: reference scores this close to the margin rank either way


def kept_history(lm: LoadedModel, policy_name: str, prompt: list[int], decode: list[int], budget: int,
                 ) -> tuple[list[list[torch.Tensor]], Any]:
    """kvbench's kept masks `[kv_heads, seen]` per layer, after the prompt and after each decode token, and the
    policy."""
    policy = build_policy(policy_name)
    session = Session(lm, policy, RunSettings(budget=budget), prompt_tokens=len(prompt), adds=len(decode))
    with torch.inference_mode():
        session.prefill(prompt)
        history = [kept_masks(session.cache)]
        for token in decode:
            session.step(token)
            history.append(kept_masks(session.cache))
    return history, session.policy


def kept_masks(cache: KVCache) -> list[torch.Tensor]:
    """Per layer, a `[kv_heads, seen]` mask of the positions the cache physically holds (the first row's)."""
    masks = []
    for layer in cache.layers:
        positions = layer.live_positions()[0].cpu().clamp(0, layer.seen - 1)  # a free slot's may be anything
        held = layer.held_slots()[0].cpu().to(torch.uint8)
        mask = torch.zeros(positions.shape[0], layer.seen, dtype=torch.uint8)
        masks.append(mask.scatter_reduce_(1, positions, held, reduce="amax").bool())
    return masks


def kept_channels(cache: KVCache) -> list[torch.Tensor]:
    """Per layer, a `[kv_heads, head_dim]` mask of the key channels the cache stores for its older entries (the first
    row's): all of them, but those ThinK prunes."""
    _, heads, head_dim = cache.batch_heads_dim
    masks = []
    for layer in cache.layers:
        channels = layer.final.keys.kept_channels() if isinstance(layer, StoredLayerKV) else None
        mask = torch.ones(heads, head_dim, dtype=torch.bool)
        masks.append(mask if channels is None else mask.zero_().scatter_(1, channels[0].cpu(), True))
    return masks


def agreement(ours: list[list[torch.Tensor]], theirs: list[list[torch.Tensor]],
              scores: list[torch.Tensor] | None = None) -> tuple[float, float]:
    """Mean and worst Jaccard index of the kept sets over steps x layers x KV heads. With reference `scores`, the
    entries that score as the reference's lowest kept one, within `TIE_TOLERANCE` (a tie, which float32 sums in
    another order break either way), are interchangeable: what counts of them is how many each side keeps."""
    values = []
    for step_ours, step_theirs in zip(ours, theirs, strict=False):
        for layer, (mine, expected) in enumerate(zip(step_ours, step_theirs, strict=True)):
            mine = mine[:, : expected.shape[1]]
            tie = torch.zeros_like(expected)
            if scores is not None:
                score = scores[layer]
                lowest = score.masked_fill(~expected, float("inf")).min(dim=-1, keepdim=True).values
                tie = ((score - lowest).abs() <= TIE_TOLERANCE * lowest.abs()) & (score > float("-inf"))
            ours_tied, theirs_tied = (mine & tie).sum(-1), (expected & tie).sum(-1)
            shared = (mine & expected & ~tie).sum(-1) + torch.minimum(ours_tied, theirs_tied)
            union = ((mine | expected) & ~tie).sum(-1) + torch.maximum(ours_tied, theirs_tied)
            values.extend((shared / union.clamp(min=1)).tolist())
    return statistics.fmean(values), min(values)
