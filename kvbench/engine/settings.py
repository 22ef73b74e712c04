"""A run's settings and the budget they resolve to for a prompt (tokens per layer and KV head, or a threshold)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvbench.errors import KvbenchError
from kvbench.policies.base import Demand, Policy, spread_budgets, takes_budget
from kvbench.policies.budgets import Threshold


@dataclass(frozen=True)
class RunSettings:
    # tokens per layer and KV head, a ratio of the prompt (< 1), or a threshold on the policy's normalised score
    budget: int | float | Threshold | None = None
    prefill: Literal["full", "chunked"] = "full"
    prefill_chunk: int = 512
    question: Literal["aware", "agnostic"] = "aware"
    evict_every: int = 1
    max_new_tokens: int | None = None  # overrides the task's
    kv_limit_bytes: int | None = None  # KV-cache bytes allowed before an out-of-memory error (CPU pressure)
    fidelity: bool = False  # compare every generated step with a full cache run in lockstep (fidelity.py)

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


def check_budget(budget: int | float | Threshold | None) -> None:
    if budget is None or isinstance(budget, Threshold):  # a Threshold checks itself
        return
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0:
        raise KvbenchError(f"budget must be a positive token count or a ratio in (0, 1), got {budget!r}")
    if isinstance(budget, float) and not budget.is_integer() and budget > 1:
        raise KvbenchError(f"budget {budget} is neither a token count nor a ratio in (0, 1]")


def resolve_budget(budget: int | float | Threshold | None, prompt_tokens: int) -> int | None:
    """Tokens per layer and KV head: a ratio (<= 1.0 as a float) is taken of the prompt length; a threshold keeps
    at most the whole prompt (what it keeps is each head's own count, `KVCache.threshold`)."""
    if budget is None:
        return None
    if isinstance(budget, Threshold):
        return prompt_tokens
    if isinstance(budget, float) and budget <= 1.0:
        return max(1, round(budget * prompt_tokens))
    return int(budget)


def threshold_of(settings: RunSettings) -> Threshold | None:
    """The settings' budget when it is a threshold."""
    return settings.budget if isinstance(settings.budget, Threshold) else None


def headroom(policy: Policy, settings: RunSettings, arrival: int = 1) -> int:
    """Slots a layer's buffer keeps beyond its budget: what it may receive between two evictions (`evict_every`
    decode tokens, or the policy's own period, as R-KV's buffer; a prefill chunk; an arrival of `arrival` tokens at
    once). The session sizes its buffers by it, and a service's admission judges a request's cache by it."""
    chunk = settings.prefill_chunk if settings.prefill == "chunked" else 1
    return max(policy.schedule.every or settings.evict_every, chunk, arrival)


def policy_budget(policy: Policy, settings: RunSettings, prompt_tokens: int, chunked: bool) -> int | None:
    """The resolved budget of `policy` for a prompt of `prompt_tokens`, after the policy's own checks."""
    budget = None if not takes_budget(policy) else resolve_budget(settings.budget, prompt_tokens)
    if takes_budget(policy) and budget is None:
        raise KvbenchError(f"policy '{policy.name}' needs a budget")
    policy.check(Demand(budget, budget is not None and isinstance(settings.budget, Threshold), chunked))
    return budget


def compression_plan(policy: Policy, settings: RunSettings, prompt_tokens: int, chunked: bool,
                     num_layers: int) -> tuple[int | None, tuple[int, ...] | None]:
    """What a prompt of `prompt_tokens` is compressed to: the resolved budget and each layer's (PyramidKV caps
    them by the prompt). Rows of one batch share it: a ratio budget over prompts of different lengths does not."""
    budget = policy_budget(policy, settings, prompt_tokens, chunked)
    return budget, None if budget is None else tuple(spread_budgets(policy, budget, num_layers, prompt_tokens))
