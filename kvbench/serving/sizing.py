"""What a request's cache holds, judged from its lengths before it runs, and the pool's bytes."""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvbench.engine.estimate import parse_bytes
from kvbench.engine.generation import Prompt
from kvbench.engine.models import LoadedModel
from kvbench.engine.settings import RunSettings, headroom, resolve_budget
from kvbench.errors import KvbenchError
from kvbench.policies.base import Policy


class Need(NamedTuple):
    """Slots per layer a request's cache holds at its largest (`peak`, while its prompt is compressed) and once its
    prompt is compressed, to its last token (`held`)."""

    peak: int
    held: int


def cache_need(lm: LoadedModel, policy: Policy, settings: RunSettings, prompt: Prompt) -> Need:
    """Bytes the request's cache holds at its largest and once its prompt is compressed, judged from its lengths
    before it runs (`need_tokens`)."""
    need = need_tokens(policy, settings, len(prompt.context) + len(prompt.question), prompt.max_new_tokens,
                       lm.num_layers)
    return Need(_row_bytes(lm, need.peak), _row_bytes(lm, need.held))


def need_tokens(policy: Policy, settings: RunSettings, prompt_tokens: int, adds: int, layers: int) -> Need:
    """What a request's cache holds, as the session sizes its buffers (`adds` tokens generated after the prompt, one
    at a time): a full cache, its prompt plus what it adds (its buffer grows by that at once). A policy that
    compresses a whole prompt holds all of it and, for a moment, one layer's compressed buffer beside it (the layers
    compress one after another); a chunked prefill holds the budget plus a chunk throughout. Either buffer has the
    session's `headroom` beyond the budget; a decode-time policy stays in it, a prefill-time one's output grows the
    buffer by all it adds once the room is full (each layer's old buffer beside its new one for a moment). A storage
    layout's savings are not counted ahead."""
    budget = resolve_budget(settings.budget, prompt_tokens)
    schedule = policy.schedule
    if budget is None or not schedule.evicts or budget >= prompt_tokens:
        return Need(prompt_tokens + adds, prompt_tokens + adds)
    chunked = settings.prefill == "chunked"
    room = headroom(policy, settings)
    buffer = budget + room
    held = buffer if schedule.decodes or adds <= room else buffer + 1 + adds
    moment = -(-buffer // layers)  # one layer's old buffer beside the others' new ones, or the prompt's beside its own
    grown = held + moment if held > buffer else held
    return Need(max(grown, buffer if chunked else prompt_tokens + moment), held)


def pool_spec(text: str) -> tuple[int, str]:
    """A `kv_pool` as a config writes it: `(count, "bytes")` for `512MiB`, `(count, "tokens")` for `4096 tokens`."""
    words = text.split()
    if len(words) == 2 and words[1] == "tokens":
        if not words[0].isdigit() or int(words[0]) < 1:
            raise KvbenchError(f"kv_pool '{text}': a token count is a positive integer, as '4096 tokens'")
        return int(words[0]), "tokens"
    return parse_bytes(text), "bytes"


def pool_bytes(lm: LoadedModel, kv_pool: str | None, pressure: float | None) -> int | None:
    """The KV pool of a load cell on `lm`: `kv_pool` bytes or tokens of a full cache, or `pressure` (a share of the
    GPU memory free now, after the weights); None: unbounded."""
    if kv_pool is not None:
        count, unit = pool_spec(kv_pool)
        return count if unit == "bytes" else _row_bytes(lm, count)
    if pressure is None:
        return None
    if lm.device.type != "cuda":
        raise KvbenchError(f"load pressure {pressure} is a share of free GPU memory: on {lm.device.type}, give "
                           "kv_pool instead (bytes as 512MiB, or 4096 tokens)")
    return int(pressure * torch.cuda.mem_get_info(lm.device)[0])


def _row_bytes(lm: LoadedModel, tokens: int) -> int:
    """A single row's KV bytes for `tokens` entries in every layer (a sliding layer holds its window at most)."""
    slot = 2 * lm.kv_heads * lm.head_dim * lm.dtype.itemsize
    return sum(min(tokens, kind.window or tokens) for kind in lm.layer_kinds) * slot
