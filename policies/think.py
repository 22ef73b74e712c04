from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.engine.codecs import Codec, KeyChannels
from kvbench.engine.storage import Layout, Tier
from kvbench.errors import KvbenchError
from kvbench.policies.base import Policy, Schedule, positive, register


@register
@dataclass
class ThinK(Policy):
    """ThinK (Xu et al. 2024): every token kept, each KV head's keys stored in fewer channels. Channel c of a head
    scores ||Q_window[:, c]||^2 x ||K[:, c]||^2 (the paper's query-driven criterion, squared as the official code
    and kvpress's ThinKPress compute it: per-channel means of the squares), Q_window the last `window` prompt queries
    of the head's query heads (their squares averaged over the group, as kvpress does), K the prompt's keys the cache
    keeps; the lowest `ratio` of the channels (kvpress's key_channel_compression_ratio) are not stored.

    The channels are chosen once the prompt is compressed, so under an eviction policy they are scored on its
    survivors. The newest `recent` tokens keep whole keys (the official code's recent buffer), and later tokens lose
    the same channels as they age out of it. Values are stored whole.

    Takes no budget; an eviction policy adds it as `storage: {think: {ratio: 0.5}}`.
    """

    name = "think"
    schedule = Schedule.NONE
    family = "compression"
    needs_attention = True  # the window's queries
    ratio: float = 0.5
    window: int = 32
    recent: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.ratio < 1:
            raise KvbenchError(f"policy 'think' parameter 'ratio' (the share of key channels pruned) must be in "
                               f"[0, 1), got {self.ratio}")
        positive("think", window=self.window)
        if self.recent < 0:
            raise KvbenchError(f"policy 'think' parameter 'recent' must be at least 0, got {self.recent}")

    def layout(self) -> Layout:
        pruned = Tier(KeyChannels(self.ratio), Codec())
        tiers = [Tier(Codec(), Codec(), self.recent), pruned] if self.recent else [pruned]
        return Layout(self.name, tiers, channel_scores=self.channel_scores)

    def observe(self, layer, query, key, scaling, phase) -> None:
        if phase != "prefill":
            return
        window = query[:, :, -self.window :].float()
        batch, heads, _, head_dim = window.shape
        kv_heads = key.shape[1]
        # each query head's mean square per channel, averaged over the query heads of a KV head: [B, kv_heads, D]
        layer.layer_stats[self.state_key] = window.pow(2).mean(dim=2).view(
            batch, kv_heads, heads // kv_heads, head_dim).mean(dim=2)

    def channel_scores(self, layer) -> torch.Tensor:
        """`[B, kv_heads, D]`: each channel's query energy times its mean square over the keys the layer holds."""
        keys = layer.live_keys().float()
        padding = layer.padding()
        held = torch.ones(keys.shape[:3], device=keys.device) if padding is None else (~padding).float()
        key_energy = (keys.pow(2) * held[..., None]).sum(dim=2) / held.sum(dim=2)[..., None]
        return layer.layer_stats[self.state_key] * key_energy
