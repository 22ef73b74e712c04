"""Fidelity to the full cache: a full-cache session runs in lockstep with the policy's, fed the policy's own
tokens (what the user would see), and each generated step is compared.

  kl_mean, kl_max       KL(full || policy) of the next-token distributions, every generated step
  top1_agreement        share of steps where both caches' most likely token is the same
  first_divergence      the first generated position where the full cache would have chosen another token
                        (null if never): where greedy outputs part
  attn_recall           share of the full cache's attention mass, at each decode step, on the entries the policy
                        kept (its cache hit rate), averaged over KV heads, steps and layers; `attn_recall_by_layer`

Cost: one more decode step per generated token (the full cache's) and each new query's attention recomputed in
both caches; off by default (`diagnostics: [fidelity]`, `kvbench run --fidelity`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from kvbench.engine.attention import query_weights
from kvbench.policies.base import Policy, Schedule


@dataclasses.dataclass
class AttentionRecorder(Policy):
    """Not a policy users pick: it keeps, per layer, the newest query's attention over the live slots (its KV
    heads' query heads averaged) and the positions those slots hold."""

    name: ClassVar[str] = "attention_recorder"
    schedule: ClassVar[Schedule] = Schedule.NONE
    needs_attention: ClassVar[bool] = True
    side: str = "full"  # names its statistics apart from the other session's recorder
    last: dict[int, tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=dict, init=False)

    def observe(self, layer, query, key, scaling, phase) -> None:
        padding = layer.padding()  # the slots the query saw: a static step's write slot holds its new entry
        held = layer.live_positions() if padding is None else layer.live_positions().masked_fill(padding, -1)
        self.last[layer.layer_idx] = (query_weights(layer, query, key, scaling).mean(dim=2), held.clone())


class Follower:
    """`Session.decode`'s step callback: steps the full-cache session with the policy's tokens and compares."""

    def __init__(self, full, full_attention: AttentionRecorder, kept: AttentionRecorder) -> None:
        self.full, self.full_attention, self.kept = full, full_attention, kept
        self.previous: int | None = None
        self.kl: list[float] = []
        self.agree: list[bool] = []
        self.recall: list[list[float]] = []  # per decode step, per layer

    def __call__(self, token: int, logits: torch.Tensor) -> None:
        if self.previous is not None:  # both caches have just attended from the previous token's query
            self.full.step(self.previous)
            self.recall.append(_recall(self.full_attention.last, self.kept.last))
        reference = self.full.logits[0].float().log_softmax(-1)
        ours = logits[0].float().log_softmax(-1)
        self.kl.append(float((reference.exp() * (reference - ours)).sum()))
        self.agree.append(int(reference.argmax()) == token)
        self.previous = token

    def measurements(self) -> dict[str, Any]:
        by_layer = torch.tensor(self.recall).mean(0).tolist() if self.recall else []
        return {
            "kl_mean": sum(self.kl) / len(self.kl),
            "kl_max": max(self.kl),
            "kl_by_position": [round(value, 6) for value in self.kl],
            "top1_agreement": sum(self.agree) / len(self.agree),
            "first_divergence": next((i for i, same in enumerate(self.agree) if not same), None),
            "attn_recall": sum(by_layer) / len(by_layer) if by_layer else None,
            "attn_recall_by_layer": [round(value, 6) for value in by_layer],
        }


def _recall(full: dict[int, tuple[torch.Tensor, torch.Tensor]],
            kept: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """Per layer, the share of the full cache's attention (mean over KV heads) on positions the policy held."""
    out = []
    for layer, (probs, positions) in sorted(full.items()):
        held = kept[layer][1]  # [B, kv, m] positions the policy's query saw, -1 where a head holds nothing
        mass = torch.zeros_like(probs)  # by position: the full cache's slots are in position order
        mass.scatter_(-1, positions, probs)
        hit = torch.zeros_like(probs, dtype=torch.uint8)  # a slot holding nothing marks no position
        hit = hit.scatter_reduce(-1, held.clamp(min=0), (held >= 0).to(torch.uint8), reduce="amax").bool()
        out.append(float((mass * hit).sum(-1).mean()))
    return out
