"""A prompt's segments: spans of token positions that a task names as units (a few-shot example, one instruction of a
system prompt), and what a cache kept of each. A policy may keep or drop them whole (policies/whole_segments.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvbench.engine.cache import KVCache


@dataclass(frozen=True)
class Segment:
    """Positions `start` (included) to `end` (excluded) of a prompt, named by `label` ("example 3", "rule 2")."""

    label: str
    start: int
    end: int


def segment_measurements(cache: KVCache, segments: tuple[Segment, ...]) -> dict[str, Any]:
    """The record's segment columns: what the cache kept of each (`kept_segments`), and the shares of the segments it
    split (kept part of one in some layer and KV head: `segments_split`) and dropped whole in every one of them."""
    kept = kept_segments(cache, segments)
    if not kept:
        return {}
    return {"segments": kept, "segments_split": sum(s["split"] > 0 for s in kept) / len(kept),
            "segments_dropped": sum(s["dropped"] == 1 for s in kept) / len(kept)}


def kept_segments(cache: KVCache, segments: tuple[Segment, ...]) -> list[dict[str, Any]]:
    """What the cache holds of each segment (its first row's), as the shares of (layer, KV head) pairs that hold all of
    it (`whole`), part of it (`split`) or none (`dropped`). Only the layers where a stock cache still holds every
    token count: a sliding layer whose window has passed a segment drops it whatever the policy ([] where no layer
    does)."""
    starts = torch.tensor([s.start for s in segments])[:, None, None]
    ends = torch.tensor([s.end for s in segments])[:, None, None]
    counts = []
    for layer, kind in zip(cache.layers, cache.kinds, strict=True):
        if kind.window is not None and kind.window <= layer.seen:
            continue
        positions = layer.live_positions()[0].cpu()
        held = layer.held_slots()[0].cpu()
        counts.append(((positions >= starts) & (positions < ends) & held).sum(-1))  # [segments, kv_heads]
    if not counts:
        return []
    held_counts = torch.cat(counts, dim=1)
    sizes = ends[:, :, 0] - starts[:, :, 0]
    pairs = held_counts.shape[1]
    whole = (held_counts == sizes).sum(-1) / pairs
    dropped = (held_counts == 0).sum(-1) / pairs
    return [{"label": segment.label, "start": segment.start, "end": segment.end, "whole": round(float(w), 4),
             "split": round(float(1 - w - d), 4), "dropped": round(float(d), 4)}
            for segment, w, d in zip(segments, whole, dropped, strict=True)]
