"""Prefill, compress and greedy-decode one sample under a policy, measuring as it goes.

The loop is ours (not `model.generate`) so eviction, positions and timings are under control:
  prefill  - the prompt in one forward (`full`) or in chunks (`chunked`), compressing after each;
  question - with `question: agnostic` the context is compressed before the question is fed;
  decode   - one token per forward; a decode-time policy evicts every `evict_every` tokens.
Positions are true token positions (RoPE continues at the number of tokens seen), while the mask is
sized by the cache's own length.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from kvbench.cache import KVCache
from kvbench.errors import KvbenchError
from kvbench.measure import PeakMemory, Stopwatch
from kvbench.models import LoadedModel
from kvbench.policies.base import Policy
from kvbench.tasks.base import Sample, Task, encode_prompt


@dataclass(frozen=True)
class RunSettings:
    budget: int | float | None = None  # tokens per layer and KV head, or a ratio of the prompt (< 1)
    prefill: Literal["full", "chunked"] = "full"
    prefill_chunk: int = 512
    question: Literal["aware", "agnostic"] = "aware"
    evict_every: int = 1
    max_new_tokens: int | None = None  # overrides the task's
    kv_limit_bytes: int | None = None  # KV-cache bytes allowed before an out-of-memory error (CPU pressure)

    def __post_init__(self) -> None:
        if self.prefill not in ("full", "chunked"):
            raise KvbenchError(f"prefill mode must be 'full' or 'chunked', got '{self.prefill}'")
        if self.question not in ("aware", "agnostic"):
            raise KvbenchError(f"question placement must be 'aware' or 'agnostic', got '{self.question}'")
        if self.prefill_chunk < 1 or self.evict_every < 1:
            raise KvbenchError("prefill_chunk and evict_every must be at least 1")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise KvbenchError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        check_budget(self.budget)


def check_budget(budget: int | float | None) -> None:
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0:
        raise KvbenchError(f"budget must be a positive token count or a ratio in (0, 1), got {budget!r}")
    if isinstance(budget, float) and not budget.is_integer() and budget > 1:
        raise KvbenchError(f"budget {budget} is neither a token count nor a ratio in (0, 1]")


def resolve_budget(budget: int | float | None, prompt_tokens: int) -> int | None:
    """Tokens per layer and KV head: a ratio (<= 1.0 as a float) is taken of the prompt length."""
    if budget is None:
        return None
    if isinstance(budget, float) and budget <= 1.0:
        return max(1, round(budget * prompt_tokens))
    return int(budget)


def forward(lm: LoadedModel, cache: KVCache, ids: list[int] | torch.Tensor, all_logits: bool = False) -> torch.Tensor:
    """Feed `ids` (a list, or `[batch, n]` for a left-padded batch) after what `cache` has seen; return the
    last position's logits `[batch, vocab]` (every position's, `[len(ids), vocab]`, with `all_logits`)."""
    seen, length = cache.layers[0].seen, cache.layers[0].length
    inputs = torch.tensor([ids], device=lm.device) if isinstance(ids, list) else ids.to(lm.device)
    positions = torch.arange(seen, seen + inputs.shape[1], device=lm.device)[None]
    if cache.left_padding is not None:  # each row counts from its first real token; padding sits at 0
        positions = (positions - cache.left_padding.to(lm.device)[:, None]).clamp(min=0)
    kwargs: dict[str, Any] = {
        lm.cache_arg: cache,
        "position_ids": positions,
        "use_cache": True,
        "logits_to_keep": 0 if all_logits else 1,
        "kv_observer": cache,
    }
    if lm.takes_cache_position:  # transformers < 5.2x sizes the mask from cache positions
        kwargs["cache_position"] = torch.arange(length, length + inputs.shape[1], device=lm.device)
    logits = lm.model(input_ids=inputs, **kwargs).logits
    return logits[0] if all_logits else logits[:, -1]


@dataclass
class Generation:
    """What `generate` returns: the text, its tokens, the final logits, and the measurements."""

    prediction: str
    tokens: list[int]
    last_logits: torch.Tensor
    measurements: dict[str, Any]
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # a task's own outputs (see Task.outcome)


@dataclass
class SharedPrefill:
    """One forward over a prompt, gathering every listed policy's statistics; each cell of a sweep that
    compresses this prompt starts from a copy of its cache instead of running the prompt again."""

    cache: KVCache
    logits: torch.Tensor
    seconds: float
    memory: PeakMemory

    def seconds_for(self, policy: Policy) -> float:
        """The forward's time without the other policies' statistics: what `policy` alone would have spent."""
        spent = self.cache.observe_seconds
        own = sum(spent.get(leaf.state_key, 0.0) for leaf in {p.state_key: p for p in policy.observers()}.values())
        return self.seconds - sum(spent.values()) + own


@torch.inference_mode()
def shared_prefill(lm: LoadedModel, ids: list[int], observers: list[Policy]) -> SharedPrefill:
    from kvbench.policies.full import Full

    cache = KVCache(lm.num_layers, (1, lm.kv_heads, lm.head_dim), Full(), None, growth=0, observers=observers)
    with PeakMemory(lm.device) as memory:
        clock = Stopwatch(lm.device)
        logits = forward(lm, cache, ids)
        seconds = clock.lap()
    return SharedPrefill(cache, logits, seconds, memory)


def policy_budget(policy: Policy, settings: RunSettings, prompt_tokens: int, chunked: bool) -> int | None:
    """The resolved budget of `policy` for a prompt of `prompt_tokens`, after the policy's own checks."""
    budget = None if not policy.phases else resolve_budget(settings.budget, prompt_tokens)
    if policy.phases and budget is None:
        raise KvbenchError(f"policy '{policy.name}' needs a budget")
    if budget is not None:
        policy.check_budget(budget)
    policy.check_settings(chunked=chunked)
    return budget


def new_cache(lm: LoadedModel, policy: Policy, budget: int | None, settings: RunSettings, headroom: int = 1,
              growth: int = 256, left_padding: torch.Tensor | None = None) -> KVCache:
    batch = 1 if left_padding is None else len(left_padding)
    return KVCache(lm.num_layers, (batch, lm.kv_heads, lm.head_dim), policy, budget, evict_every=settings.evict_every,
                   headroom=headroom, growth=growth, limit_bytes=settings.kv_limit_bytes,
                   left_padding=left_padding if left_padding is not None and int(left_padding.max()) else None)


def decode(lm: LoadedModel, cache: KVCache, logits: torch.Tensor, max_new_tokens: int, eos: set[int],
           stop: tuple[str, ...]) -> tuple[list[int], float, list[float], torch.Tensor]:
    """Greedy tokens from `logits` on, each fed back while a decode-time policy evicts as they arrive.
    Returns the tokens (the last one, or the end-of-sequence token, is not fed), the seconds to the first
    token, each later step's seconds and the last logits."""
    cache.phase = "decode"
    clock = Stopwatch(lm.device)
    tokens = [int(logits.argmax(-1))]
    first_s = clock.lap()
    step_s: list[float] = []
    while len(tokens) < max_new_tokens and not _finished(lm, tokens, eos, stop):
        logits = forward(lm, cache, tokens[-1:])
        if cache.policy.evicts_during_decode:
            cache.compress()
        tokens.append(int(logits.argmax(-1)))
        step_s.append(clock.lap())
    return tokens, first_s, step_s, logits


@torch.inference_mode()
def generate(lm: LoadedModel, policy: Policy, context_ids: list[int], question_ids: list[int],
             settings: RunSettings, max_new_tokens: int, stop: tuple[str, ...] = (),
             eos_token_ids: set[int] | None = None, shared: SharedPrefill | None = None) -> Generation:
    """Prefill (or adopt `shared`, a prefill of the same prompt in `full` mode), compress, decode."""
    prompt_tokens = len(context_ids) + len(question_ids)
    chunked = settings.prefill == "chunked"
    budget = policy_budget(policy, settings, prompt_tokens, chunked)
    agnostic = settings.question == "agnostic"
    compressed = context_ids if agnostic else context_ids + question_ids
    chunk = settings.prefill_chunk if chunked else len(compressed)
    # headroom: what arrives between two evictions; growth: what a cache that stopped evicting still takes
    headroom = max(settings.evict_every, chunk if chunked else 1, len(question_ids) if agnostic else 1)
    growth = max_new_tokens + (len(question_ids) if agnostic else 0)
    cache = new_cache(lm, policy, budget, settings, headroom, growth)
    eos = lm.eos_token_ids if eos_token_ids is None else eos_token_ids

    with PeakMemory(lm.device) as memory:
        clock = Stopwatch(lm.device)
        if shared is not None:
            if chunked or shared.cache.layers[0].seen != len(compressed):
                raise ValueError("a shared prefill serves only `full` prefill of the same prompt")
            cache.adopt(shared.cache)
            logits = shared.logits
            cache.compress()
        for start in range(0, len(compressed) if shared is None else 0, chunk):
            logits = forward(lm, cache, compressed[start : start + chunk])
            cache.compress()
        cache.phase = "decode"
        if agnostic and question_ids:
            logits = forward(lm, cache, question_ids)
            if policy.evicts_during_decode:
                cache.compress()
        prefill_s = clock.lap() + (shared.seconds_for(policy) if shared else 0.0)
        tokens, first_s, step_s, logits = decode(lm, cache, logits, max_new_tokens, eos, stop)

    if tokens[-1] in eos:
        tokens = tokens[:-1]
    measurements = {
        **timings(prompt_tokens, prefill_s, prefill_s + first_s, step_s),
        "budget_tokens": budget,
        "budget_scope": policy.budget_scope,
        **cache_measurements(cache, memory, shared),
        **policy.report(),
    }
    return Generation(_cut(lm.tokenizer.decode(tokens, skip_special_tokens=True), stop), tokens, logits, measurements)


def timings(prompt_tokens: int, prefill_s: float, ttft_s: float | None, step_s: list[float],
            generated_tokens: int | None = None, rows: int = 1) -> dict[str, Any]:
    """The record's speed columns; `step_s` are the decode steps after the first token, each decoding one
    token for each of `rows` sequences."""
    return {
        "prompt_tokens": prompt_tokens,
        "generated_tokens": len(step_s) + 1 if generated_tokens is None else generated_tokens,
        "ttft_s": ttft_s,
        "tpot_s": statistics.median(step_s) if step_s else None,
        "prefill_tok_s": prompt_tokens / prefill_s,
        "decode_tok_s": rows * len(step_s) / sum(step_s) if step_s else None,
    }


SPEED = ("ttft_s", "tpot_s", "prefill_tok_s", "decode_tok_s")


def repeat_timed(run: Callable[[], dict[str, Any]], warmup: int, repeats: int) -> dict[str, Any]:
    """Run a sample `warmup` times unmeasured, then `repeats` times: the last record, with each speed
    column the median of the repeats and `<column>_spread` their [min, max]."""
    for _ in range(warmup):
        run()
    records = [run() for _ in range(repeats)]
    record = records[-1]
    for key in SPEED:
        values = [r[key] for r in records if r.get(key) is not None]
        if values:
            record[key] = statistics.median(values)
            record[f"{key}_spread"] = [min(values), max(values)]
    record["timing"] = {"warmup": warmup, "repeats": repeats}
    return record


def cache_measurements(cache: KVCache, memory: PeakMemory, shared: SharedPrefill | None = None) -> dict[str, Any]:
    """The cache's byte accounting and the process's memory peak: the record's memory columns."""
    stats = cache.stats()
    return {
        **asdict(stats),
        "cache_ratio": stats.cache_ratio,
        # a cell that adopted a shared prefill peaked at least where that forward did
        "mem_peak_alloc": _peak(memory, shared, "peak_bytes"),
        "mem_peak_reserved": _peak(memory, shared, "peak_reserved"),
        "mem_peak_device": _peak(memory, shared, "peak_device"),
        "mem_baseline": memory.baseline_bytes,
        "mem_device_note": memory.device_note,
        **({} if cache.limit_bytes is None else {
            "kv_limit_bytes": cache.limit_bytes,
            # the limit bounds the cache; what the process grew by says whether the rest fit too
            "mem_growth_over_limit": memory.peak_bytes - memory.baseline_bytes > cache.limit_bytes}),
        "prefill_shared": shared is not None,
    }


def _peak(memory: PeakMemory, shared: SharedPrefill | None, name: str) -> int | None:
    values = [v for v in (getattr(memory, name), getattr(shared.memory, name) if shared else None) if v is not None]
    return max(values) if values else None


@torch.inference_mode()
def generate_batch(lm: LoadedModel, policy: Policy, prompts: list[list[int]], settings: RunSettings,
                   max_new_tokens: int, eos_token_ids: set[int] | None = None,
                   ) -> tuple[list[list[int]], dict[str, Any]]:
    """Greedy decoding of several prompts in one cache: left-padded to the longest (padding is masked, evicted
    first and never counted as kept), one budget for every row so the cache stays rectangular. Returns each
    row's tokens (up to its end of sequence) and the run's measurements."""
    longest, batch = max(map(len, prompts)), len(prompts)
    pad_id = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
    padding = torch.tensor([longest - len(p) for p in prompts])
    ids = torch.tensor([[pad_id] * (longest - len(p)) + p for p in prompts])
    chunked = settings.prefill == "chunked"
    budget = policy_budget(policy, settings, longest, chunked)
    chunk = settings.prefill_chunk if chunked else longest
    cache = new_cache(lm, policy, budget, settings, headroom=max(settings.evict_every, chunk if chunked else 1),
                      growth=max_new_tokens, left_padding=padding)
    eos = torch.tensor(sorted(lm.eos_token_ids if eos_token_ids is None else eos_token_ids) or [-1])
    with PeakMemory(lm.device) as memory:
        clock = Stopwatch(lm.device)
        for start in range(0, longest, chunk):
            logits = forward(lm, cache, ids[:, start : start + chunk])
            cache.compress()
        prefill_s = clock.lap()
        cache.phase = "decode"
        tokens = [logits.argmax(-1).cpu()]
        done = torch.isin(tokens[0], eos)
        first_s, step_s = clock.lap(), []
        while len(tokens) < max_new_tokens and not bool(done.all()):
            logits = forward(lm, cache, tokens[-1][:, None])
            if policy.evicts_during_decode:
                cache.compress()
            tokens.append(logits.argmax(-1).cpu())
            done |= torch.isin(tokens[-1], eos)
            step_s.append(clock.lap())
    ends = set(eos.tolist())
    rows = []
    for row in torch.stack(tokens, dim=1).tolist():
        stops = [i for i, t in enumerate(row) if t in ends]
        rows.append(row[: stops[0]] if stops else row)
    measurements = {
        **timings(longest * batch, prefill_s, prefill_s + first_s, step_s, generated_tokens=sum(map(len, rows)),
                  rows=batch),
        "batch": batch,
        "budget_tokens": budget,
        **cache_measurements(cache, memory),
    }
    return rows, measurements


def _finished(lm: LoadedModel, tokens: list[int], eos: set[int], stop: tuple[str, ...]) -> bool:
    if tokens[-1] in eos:
        return True
    if not stop:
        return False
    text = lm.tokenizer.decode(tokens, skip_special_tokens=True)
    return any(s in text.lstrip() for s in stop)


def _cut(text: str, stop: tuple[str, ...]) -> str:
    text = text.strip()
    for s in stop:
        text = text.split(s, 1)[0]
    return text.strip()


def compressed_prompt(lm: LoadedModel, sample: Sample, question: str) -> list[int]:
    """The tokens compressed before decoding: the whole prompt (`aware`) or its context (`agnostic`)."""
    context_ids, question_ids = encode_prompt(lm.tokenizer, sample)
    return context_ids if question == "agnostic" else context_ids + question_ids


def run_sample(lm: LoadedModel, policy: Policy, sample: Sample, settings: RunSettings,
               shared: SharedPrefill | None = None) -> Generation:
    context_ids, question_ids = encode_prompt(lm.tokenizer, sample)
    return generate(lm, policy, context_ids, question_ids, settings, stop=sample.stop, shared=shared,
                    max_new_tokens=settings.max_new_tokens or sample.max_new_tokens)


def evaluate(lm: LoadedModel, task: Task, policy: Policy, sample: Sample, settings: RunSettings,
             context_length: int, seed: int, shared: SharedPrefill | None = None) -> dict[str, Any]:
    """Run and score one sample: one record (a JSON-able dict)."""
    policy = dataclasses.replace(policy)  # fresh per-sample state (e.g. the random policy's generator)
    generation = task.run(lm, policy, sample, settings, shared)
    return {
        "model": lm.spec,
        "task": task.describe(),
        "policy": policy.describe(),
        "family": policy.kind,
        "budget": settings.budget if policy.phases else None,
        "context_length": context_length,
        "sample_id": sample.id,
        "prefill": settings.prefill,
        "prefill_chunk": settings.prefill_chunk if settings.prefill == "chunked" else None,
        "question": settings.question,
        "evict_every": settings.evict_every,
        "seed": seed,
        **task.outcome(generation, sample),
        "higher_is_better": task.higher_is_better,
        "meta": sample.meta,
        **generation.measurements,
    }
