from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.engine.attention import attention_probs, record_attention_inputs
from kvbench.errors import KvbenchError
from kvbench.policies.base import BatchLimit, Demand, Policy, Schedule, protect, register

# kvpress's KVzipPress.prepare: the repeat request, and for later chunks the previous chunk's last tokens
FIRST_REQUEST = "\n\nRepeat the previous context exactly."
LATER_REQUEST = "\n\nRepeat the part of the previous context exactly, starting with"
OVERLAP = 8


@register
@dataclass
class KVzip(Policy):
    """KVzip (Kim et al. 2025): query-agnostic scores from context reconstruction.

    Once the prompt is in the cache, the model is asked to repeat it ("Repeat the previous context exactly."
    and the chat template's assistant turn, then the prompt itself, teacher-forced), `chunk` tokens of prompt
    per extra forward (later requests start with the previous chunk's last 8 tokens); each prompt entry's score
    is the most attention any query of its chunk's repetition gives it, over the KV head's query heads, where
    those queries attend to the first `n_sink` entries, their chunk's entries and the repetition itself (as
    kvpress's KVzipPress and the official code chunk it). The repetition's own entries are then dropped. The
    first `n_sink` positions are always kept. Selection is global (the paper's non-uniform budgets): the
    layers x heads x budget best scores of the whole cache are kept, so layers and heads keep different counts
    (`layerwise: true`: each layer keeps heads x budget, shared over its heads), stored as Ada-KV stores them.
    The reconstruction costs about one more prefill per chunk: it is in `ttft_s`.
    """

    name = "kvzip"
    schedule = Schedule.PREFILL
    needs_attention = True
    n_sink: int = 4
    chunk: int = 2048
    layerwise: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.storage is not None:
            raise KvbenchError("policy 'kvzip' drops its reconstruction from plain slots; it takes no storage")
        if self.chunk < 1 or self.n_sink < 0:
            raise KvbenchError("policy 'kvzip' needs chunk >= 1 and n_sink >= 0")
        self._probe: tuple[int, int] | None = None  # positions of the prompt chunk being reconstructed
        self._keep: list[int] = []  # entries each layer keeps, over its heads

    def check(self, demand: Demand) -> None:
        super().check(demand)
        if demand.chunked:
            raise KvbenchError("policy 'kvzip' reconstructs the whole prompt once it is in: use prefill mode 'full'")

    def batch_limits(self) -> list[BatchLimit]:
        return [BatchLimit("alone", "policy 'kvzip' reconstructs each prompt with forwards of its own")]

    def after_prompt(self, session, prompt: torch.Tensor) -> None:
        if session.rows != 1:
            raise KvbenchError("policy 'kvzip' runs at batch 1")
        if session.cache.budget is None or prompt.shape[1] <= min(session.cache.layer_budgets):
            return  # nothing to evict
        ids, encode = prompt[0].tolist(), _encoder(session.lm.tokenizer)
        first, later, answer = encode(FIRST_REQUEST), encode(LATER_REQUEST), _answer_prefix(session.lm.tokenizer)
        start0 = session.seen - len(ids)
        for start in range(0, len(ids), self.chunk):
            piece = ids[start : start + self.chunk]
            request = first if start == 0 else later + ids[max(0, start - OVERLAP) : start]
            self._probe = (start0 + start, start0 + start + len(piece))
            try:
                session.probe(request + answer + piece)
            finally:
                self._probe = None
        self._allot(session.cache)

    def observe(self, layer, query, key, scaling, phase) -> None:
        if self._probe is None:
            return
        first, end = self._probe
        own = query.shape[2]
        positions = layer.live_positions()[0, 0, : layer.length - own]
        context = ((positions >= first) & (positions < end)).nonzero()[:, 0]
        sinks = (positions < min(self.n_sink, first)).nonzero()[:, 0]
        # the repetition's queries see the sinks, their chunk and themselves (the newest slots, causally)
        seen = torch.cat([sinks, context, torch.arange(layer.length - own, layer.length, device=key.device)])
        best = torch.zeros(key.shape[:2] + (len(context),), device=key.device)
        for start, probs in attention_probs(query, key[:, :, seen], scaling, kind=layer.kind,
                                            positions=layer.live_positions()[:, :, seen]):
            weights = self.weigh(layer, probs[..., len(sinks) : len(sinks) + len(context)], start, context)
            torch.maximum(best, weights.amax(dim=(2, 3)), out=best)
        layer.slot_stat(self.state_key)[:, :, context] = best

    def weigh(self, layer, probs: torch.Tensor, start: int, context: torch.Tensor) -> torch.Tensor:
        """The score each reconstruction query `start`... gives each `context` slot, from its attention weights
        `probs` `[B, kv_heads, group, queries, context]`: KVzip scores by the weights themselves."""
        return probs

    def score(self, layer, budget: int) -> torch.Tensor:
        return protect(layer.slot_stat(self.state_key), layer.live_positions() < self.n_sink)

    def select(self, layer, budget: int) -> torch.Tensor:
        scores = self.score(layer, budget)
        batch, heads, n = scores.shape
        count = heads * budget if self.layerwise or not self._keep else self._keep[layer.layer_idx]
        best = scores.reshape(batch, heads * n).topk(min(count, heads * n), dim=-1).indices
        return torch.zeros(batch, heads * n, dtype=torch.bool, device=scores.device).scatter_(
            -1, best, True).view(batch, heads, n)

    def _allot(self, cache) -> None:
        """Each layer's share of the whole cache's best layers x heads x budget scores (global selection)."""
        scores = [self.score(layer, budget).flatten() for layer, budget in zip(cache.layers, cache.layer_budgets,
                                                                                 strict=True)]
        total = sum(cache.layer_budgets) * cache.batch_heads_dim[1]
        owner = torch.cat([torch.full_like(s, i, dtype=torch.long) for i, s in enumerate(scores)])
        best = torch.cat(scores).topk(min(total, len(owner))).indices
        self._keep = torch.bincount(owner[best], minlength=len(scores)).tolist()


@register
@dataclass
class KVzipPlus(KVzip):
    """KVzip+ (kvpress's `kvzip_plus`, the targets KVzap learns): KVzip with each reconstruction query's attention
    weight divided by the norm of that query's hidden state (the attention's input) and multiplied by the norm of
    what the entry writes into the residual stream through the query head's output projection, ||W_o^h v||,
    before the maximum over the repetition and the KV head's query heads. Everything else is KVzip's.
    """

    name = "kvzip_plus"

    def __post_init__(self) -> None:
        super().__post_init__()
        self._output_grams: dict[int, torch.Tensor] = {}

    def prepare(self, lm) -> None:
        record_attention_inputs(lm.model)

    def weigh(self, layer, probs: torch.Tensor, start: int, context: torch.Tensor) -> torch.Tensor:
        assert layer.attention_input is not None, "prepare() asked for the attention's inputs"
        hidden_norms = layer.attention_input[:, start : start + probs.shape[3]].float().norm(dim=-1)  # [B, queries]
        values = layer.live_values()[:, :, context].float()  # [B, kv_heads, context, D]
        # ||W_o^h v||^2 = v^T (W_o^h^T W_o^h) v: a head_dim x head_dim Gram per query head, not a hidden-wide product
        grams = self._output_gram(layer, values.shape[1])  # [kv_heads, group, D, D]
        written = torch.einsum("bktd,kgde,bkte->bkgt", values, grams, values).clamp_min(0).sqrt()
        return probs / hidden_norms[:, None, None, :, None] * written[:, :, :, None, :]

    def _output_gram(self, layer, kv_heads: int) -> torch.Tensor:
        if layer.layer_idx not in self._output_grams:
            weight = layer.owner.model.output_projection(layer.layer_idx).float()  # [hidden, heads * D]
            per_head = weight.view(weight.shape[0], kv_heads, -1, layer.owner.batch_heads_dim[2])
            self._output_grams[layer.layer_idx] = torch.einsum("okgd,okge->kgde", per_head, per_head)
        return self._output_grams[layer.layer_idx]


def _encoder(tokenizer):
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


def _answer_prefix(tokenizer) -> list[int]:
    """What the chat template puts between a user turn's text and the assistant's answer (a newline without a
    template), found as kvpress finds it: by templating a dummy turn and cutting at a separator."""
    if not getattr(tokenizer, "chat_template", None):
        return _encoder(tokenizer)("\n")
    dummy = "dummy context"
    separator = "\n" + "#" * len(dummy)
    text = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}],
                                         add_generation_prompt=True, tokenize=False, enable_thinking=False)
    return _encoder(tokenizer)(text.split(separator)[1])
