"""What a compression keeps: one decision per layer, made here for any batch and applied by the cache.

A layer compresses once its fullest KV head (in any row) holds `slack` entries beyond its budget: one after a prompt
chunk, the policy's `evict_every` while decoding. Each row is judged by its own entries, so a row of a batch evicts
when and what its unbatched cache would, whatever the others hold. The policy keeps, per head, the `budget` entries
it scores highest, or the set its `select` picks (any count per head); under a threshold, every entry whose
`threshold_score` reaches it. A batch's padding slots go first, then what no query of a sliding layer can see.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvbench.engine.row_accounts import RowView

if TYPE_CHECKING:
    from kvbench.engine.cache import KVCache
    from kvbench.engine.layer import LayerKV
    from kvbench.policies.base import Policy
    from kvbench.policies.budgets import Threshold


@dataclass
class Decision:
    """What one layer keeps: `evicted` `[batch, heads, e]`, the slots every head drops (as many for each: the buffer
    shrinks by `e`), or `keep` `[batch, heads, length]`, a mask with any count per head. `due` `[rows]` marks the rows
    that compressed, `dropped` `[rows]` their evictions as their unbatched caches count them, `held` `[rows, heads]`
    what each head of each row holds after (a batch's accounts); `fit` gives back the buffer's spare slots."""

    due: np.ndarray
    dropped: np.ndarray
    held: np.ndarray | None
    evicted: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    fit: bool = False


def decide(cache: KVCache, layer: LayerKV, budget: int, slack: int) -> Decision | None:
    """What `layer` keeps under its `budget` (or the cache's threshold); None: nothing to evict yet."""
    policy = cache.policy
    if cache.threshold is not None:
        return _threshold(policy, layer, cache.threshold, fit=cache.phase == "prefill")
    if not policy.bounded(layer):  # left whole by the policy (SimLayerKV's layers that are not lazy)
        return None
    held = _held(cache, layer)
    due = held.max(axis=1) - budget >= slack
    if not due.any():
        return None
    if cache.rows is not None and layer.padding() is not None and layer.slots_in_order:
        return _each_row(policy, layer, budget, due, held)  # a padded batch's prompt, compressed the first time
    chosen = policy.select(layer, budget)
    if chosen is not None:
        return _selected(layer, chosen, due, held)
    return _scored(policy, layer, budget, due, held)


def _held(cache: KVCache, layer: LayerKV) -> np.ndarray:
    """`[rows, heads]` the entries each head of each row holds: a batch's from the host's accounts; one row's from
    its length, or its padding once its heads hold uneven counts."""
    if cache.rows is not None:
        return cache.rows.held[layer.layer_idx]
    padding = layer.padding()
    if padding is None:
        return np.full(cache.batch_heads_dim[:2], layer.length)
    return (~padding).sum(dim=-1).cpu().numpy()


def _selected(layer: LayerKV, chosen: torch.Tensor, due: np.ndarray, held: np.ndarray) -> Decision:
    """The kept set a policy picked itself (Ada-KV's uneven heads), in the rows due; the others keep theirs."""
    padding = layer.padding()
    real = torch.ones_like(chosen) if padding is None else ~padding
    due_rows = torch.from_numpy(due).to(layer.device)[:, None, None]
    keep = torch.where(due_rows, chosen & real, real)
    counts = keep.sum(dim=-1).cpu().numpy()
    return Decision(due, held.sum(axis=1) - counts.sum(axis=1), counts, keep=keep)


def _scored(policy: Policy, layer: LayerKV, budget: int, due: np.ndarray, held: np.ndarray) -> Decision:
    """Each due row's best `budget` entries per head by the policy's scores. The buffer shrinks to the widest row
    that remains, padding slots going first; when a row must drop more real entries than that (a row due while a
    wider one is not), its extra drops become padding slots in place."""
    scores = policy.score(layer, budget)
    unseen = layer.out_of_window()
    if unseen is not None:  # what no query can see goes first after padding: the lowest finite score
        scores = scores.masked_fill(unseen, torch.finfo(scores.dtype).min)
    padding = layer.padding()
    if padding is not None:
        scores = scores.masked_fill(padding, float("-inf"))
    target = np.where(due[:, None], np.minimum(held, budget), held)
    # an unbatched cache counts the slots it evicts: its fullest head's excess, in every head
    dropped = (held.max(axis=1) - budget) * held.shape[1]
    width = int(target.max())
    # the real entries each head loses when the buffer shrinks to `width` (padding first), beyond its target
    extra = (held - target) - np.clip(held - width, 0, None)
    if not extra.any():  # every due row drops what the buffer sheds: the decode step's path
        evicted = scores.topk(layer.length - width, dim=-1, largest=False, sorted=False).indices
        return Decision(due, dropped, target, evicted=evicted)
    rank = scores.argsort(dim=-1, descending=True).argsort(dim=-1)
    return Decision(due, dropped, target, keep=rank < torch.from_numpy(target).to(layer.device)[..., None])


def _each_row(policy: Policy, layer: LayerKV, budget: int, due: np.ndarray, held: np.ndarray) -> Decision:
    """A due row's prompt compressed by the very calls its unbatched cache makes, on its own slots in prompt order
    (`RowView`): once per prompt and row, so that what the policy keeps, its ties included, is what it keeps alone.
    The rows then keep what they chose, padding dropped."""
    padding = layer.padding()
    assert padding is not None
    keep = ~padding
    unseen = layer.out_of_window()
    dropped = np.zeros(len(due), dtype=np.int64)
    for row in np.flatnonzero(due):
        start = layer.length - int(held[row].max())  # the row's left padding still held
        view = RowView(layer, int(row), start)
        chosen = policy.select(view, budget)
        if chosen is None:
            scores = policy.score(view, budget)
            if unseen is not None:
                scores = scores.masked_fill(unseen[row : row + 1, :, start:], torch.finfo(scores.dtype).min)
            lost = scores.topk(view.length - budget, dim=-1, largest=False, sorted=False).indices
            chosen = torch.ones_like(scores, dtype=torch.bool).scatter_(-1, lost, False)
            dropped[row] = lost.numel()
        else:
            dropped[row] = int(held[row].sum()) - int(chosen.sum())
        keep[row, :, start:] = chosen[0]
    return Decision(due, dropped, keep.sum(dim=-1).cpu().numpy(), keep=keep)


def _threshold(policy: Policy, layer: LayerKV, threshold: Threshold, fit: bool) -> Decision:
    """Per KV head, the entries whose `threshold_score` reaches `threshold` (the policy's protected, +inf ones
    always; never more than it holds). A prompt's compression (`fit`) frees what it dropped, whatever share it kept.
    A threshold runs one sequence at a time."""
    keep = policy.threshold_score(layer) >= threshold.value
    padding = layer.padding()
    if padding is not None:  # slots an earlier compression left a head without: never kept
        keep &= ~padding
    unseen = layer.out_of_window()
    if unseen is not None:  # on a sliding layer, what no query can see goes whatever its score
        keep &= ~unseen
    dropped = np.array([layer.live_entries() - int(keep.sum())])
    return Decision(np.ones(1, dtype=bool), dropped, None, keep=keep, fit=fit)
