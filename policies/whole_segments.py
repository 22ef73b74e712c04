from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvbench.engine.segments import Segment
from kvbench.policies.base import Rescorer, register


@register
@dataclass
class WholeSegments(Rescorer):
    """The units a task names in its prompt (few-shot examples, the rules of a system prompt) kept or dropped whole,
    ranked by a base policy's scores: ChunkKV's idea (policies/chunkkv.py) with the task's own boundaries in place of
    fixed chunks, as "Semantic Integrity Matters" (KVFundaBench, 2026) finds few-shot examples need.

    A segment ranks by its entries' mean base score, averaged over the layer's KV heads (a base-protected entry
    protects its segment); an entry outside every segment ranks by its own score. Each head takes them best first
    while they fit its budget; from the first segment that does not fit, the budget's rest goes to the later segments
    that still fit, best first, then to the best single entries left, so no segment is ever cut and a smaller segment
    is not skipped for a larger one. The segments are the session's (`Session(segments=...)`, from the task),
    known once the whole prompt is in: a prompt without them, and the earlier chunks of a chunked prefill, are
    compressed as the base alone would.
    """

    name = "whole_segments"
    colour = "#CC6677"
    decides = frozenset({"select"})
    _segments: tuple[Segment, ...] = field(default=(), init=False, repr=False, compare=False)

    def after_prompt(self, session, prompt: torch.Tensor) -> None:
        self._segments = tuple(sorted(session.segments, key=lambda segment: segment.start))
        super().after_prompt(session, prompt)

    def select(self, layer, budget: int) -> torch.Tensor | None:
        if not self._segments:
            return None
        scores = self.stage(layer.owner).score(layer, budget).float()
        segment = self._segment_of(layer.live_positions())
        padding = layer.padding()
        held = torch.ones_like(scores, dtype=torch.bool) if padding is None else ~padding
        inside = (segment >= 0) & held
        shared = self._segment_scores(scores, segment, inside)
        rank_by = torch.where(inside, shared.gather(-1, segment.clamp(min=0)), scores).masked_fill(~held, float("-inf"))
        # best first, each segment's entries side by side: grouped by segment (an outside entry is a group of its own),
        # then a stable sort by score
        length = scores.shape[-1]
        group = torch.where(inside, segment, len(self._segments) + torch.arange(length, device=scores.device))
        order = group.argsort(dim=-1, stable=True)
        order = order.gather(-1, rank_by.gather(-1, order).argsort(dim=-1, descending=True, stable=True))
        unit = torch.where(inside, segment + 1, 0).gather(-1, order)  # 0: an entry outside every segment
        real = held.gather(-1, order)
        first = (torch.arange(length, device=scores.device) < budget) & real
        units = unit.shape[:2] + (len(self._segments) + 1,)
        total = torch.zeros(units, dtype=torch.long, device=scores.device)
        taken_part = total.clone().scatter_add_(-1, unit, first.long())
        total.scatter_add_(-1, unit, real.long())
        taken = taken_part == total  # a segment all of whose entries lie within the budget's first places
        taken[..., 0] = False
        spare = budget - (first & (taken.gather(-1, unit) | (unit == 0))).sum(dim=-1, keepdim=True)
        # then the segments left, best first (by where each one's entries start in the order), each while it fits
        places = torch.arange(length, device=scores.device).expand_as(unit)
        starts = torch.full(units, length, device=scores.device).scatter_reduce_(-1, unit, places, "amin")
        for ranked in starts[..., 1:].argsort(dim=-1, stable=True).unbind(dim=-1):
            segment_unit = ranked[..., None] + 1
            size = total.gather(-1, segment_unit)
            fits = ~taken.gather(-1, segment_unit) & (size > 0) & (size <= spare)
            taken.scatter_(-1, segment_unit, fits | taken.gather(-1, segment_unit))
            spare -= torch.where(fits, size, 0)
        keep = real & (taken.gather(-1, unit) | (first & (unit == 0)))
        waiting = (unit == 0) & real & ~keep
        keep |= waiting & (waiting.cumsum(dim=-1) <= spare)
        return torch.zeros_like(keep).scatter_(-1, order, keep)

    def _segment_of(self, positions: torch.Tensor) -> torch.Tensor:
        """Each entry's segment index, -1 outside every segment."""
        starts = torch.tensor([s.start for s in self._segments], device=positions.device)
        ends = torch.tensor([s.end for s in self._segments], device=positions.device)
        index = torch.searchsorted(starts, positions.contiguous(), right=True) - 1
        inside = (index >= 0) & (positions < ends[index.clamp(min=0)])
        return torch.where(inside, index, -1)

    def _segment_scores(self, scores: torch.Tensor, segment: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
        """`[B, heads, segments]`: each segment's mean score over its live entries, averaged over the heads that hold
        some of it (the same in every head); +inf where a base-protected entry lies in it."""
        slot = segment.clamp(min=0)
        counted = inside & torch.isfinite(scores)
        shape = scores.shape[:2] + (len(self._segments),)
        total = scores.new_zeros(shape).scatter_add_(-1, slot, torch.where(counted, scores, 0.0))
        count = scores.new_zeros(shape).scatter_add_(-1, slot, counted.float())
        protected = scores.new_zeros(shape).scatter_add_(-1, slot, (inside & (scores == float("inf"))).float())
        mean = (total / count.clamp(min=1)).sum(dim=1, keepdim=True) / (count > 0).sum(dim=1, keepdim=True).clamp(min=1)
        return mean.masked_fill(protected.sum(dim=1, keepdim=True) > 0, float("inf")).expand(shape)
