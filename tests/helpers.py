from __future__ import annotations

import torch

from kvbench.cache import KVCache
from kvbench.runner import forward


def kept_masks(cache: KVCache) -> list[torch.Tensor]:
    """Per layer, a `[kv_heads, seen]` mask of the positions the cache physically holds."""
    masks = []
    for layer in cache.layers:
        mask = torch.zeros(layer.positions.shape[1], layer.seen, dtype=torch.bool)
        held = torch.ones_like(layer.live_positions()[0], dtype=torch.bool)
        if layer.padding() is not None:  # heads with uneven counts: padding slots hold nothing
            held = ~layer.padding()[0]
        mask.scatter_(1, layer.live_positions()[0], held)
        masks.append(mask)
    return masks


@torch.inference_mode()
def run_cache(lm, policy, prompt, decode, budget, chunk=None, evict_every=1):
    """Feed `prompt` (in chunks if given) then `decode` tokens one by one, as the runner does;
    return the cache and the kept masks after the prompt and after each decode token."""
    cache = KVCache(lm.num_layers, (1, lm.kv_heads, lm.head_dim), policy, budget, evict_every=evict_every,
                    headroom=max(evict_every, chunk or 1), growth=len(decode))
    chunk = chunk or len(prompt)
    for start in range(0, len(prompt), chunk):
        forward(lm, cache, prompt[start : start + chunk])
        cache.compress()
    history = [kept_masks(cache)]
    cache.phase = "decode"
    for token in decode:
        forward(lm, cache, [token])
        if policy.evicts_during_decode:
            cache.compress()
        history.append(kept_masks(cache))
    return cache, history
