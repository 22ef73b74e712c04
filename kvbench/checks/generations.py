"""The two greedy generations `kvbench check` compares, `model.generate`'s with transformers' own cache and
kvbench's under a policy, and how close their tokens and logits are."""

from __future__ import annotations

import contextlib
from typing import Any, cast

import torch

from kvbench.checks.tolerance import model_tolerance
from kvbench.engine.models import LoadedModel
from kvbench.engine.session import Session
from kvbench.engine.settings import RunSettings
from kvbench.errors import KvbenchError
from kvbench.policies import build_policy


def stock_generate(lm: LoadedModel, prompt: list[int], new_tokens: int, attention: str, until_eos: bool = True,
                   ) -> tuple[list[int], list[torch.Tensor]]:
    """`model.generate`'s greedy tokens (up to kvbench's end-of-sequence tokens, or exactly `new_tokens` without
    `until_eos`) and each step's raw logits, with transformers' own cache and `attention`."""
    try:
        lm.model.set_attn_implementation(attention)
        ids = torch.tensor([prompt], device=lm.device)
        length = {} if until_eos else {"min_new_tokens": new_tokens}
        out = cast(Any, lm.model).generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, **length,
            eos_token_id=sorted(lm.eos_token_ids) or None, do_sample=False, top_p=None, top_k=None, temperature=None,
            pad_token_id=lm.pad_token_id, output_logits=True, return_dict_in_generate=True)
    except (ValueError, ImportError) as exc:  # an attention implementation this model or machine lacks
        raise KvbenchError(f"--attention {attention}: {str(exc).splitlines()[0]}") from None
    finally:
        lm.model.set_attn_implementation("kvbench")
    return out.sequences[0, len(prompt) :].tolist(), [step[0].float() for step in out.logits]


def kvbench_generate(lm: LoadedModel, policy: str, prompt: list[int], new_tokens: int, budget: int | None = None,
                     until_eos: bool = True, measured: bool = True) -> tuple[list[int], list[torch.Tensor], Session]:
    """kvbench's greedy tokens and each step's logits under `policy` (as `stock_generate`); `measured`: inside the
    session's memory measurement (its NVML sampler runs on a GPU)."""
    session = Session(lm, build_policy(policy), RunSettings(budget=budget), prompt_tokens=len(prompt),
                      adds=new_tokens)
    logits: list[torch.Tensor] = []
    with session if measured else contextlib.nullcontext():
        session.prefill(prompt)
        tokens = session.decode(new_tokens, lm.eos_token_ids if until_eos else set(),
                                follow=lambda _, step: logits.append(step[0].float().clone()))[0]
    return tokens, logits, session


def compare_generations(expected: tuple[list[int], list[torch.Tensor]], got: tuple[list[int], list[torch.Tensor]],
                        limit: float) -> tuple[bool, str, dict[str, Any]]:
    """Same tokens, and the logits of the steps both took within `limit` x max |logit|: (passed, text, numbers).

    A token may differ where the reference's own logits tie it with the expected one within that tolerance: either
    order of the sums may pick either, and the generations go separate ways from there, so the comparison stops."""
    (want, want_logits), (have, have_logits) = expected, got
    same = next((i for i, (a, b) in enumerate(zip(want, have, strict=False)) if a != b), min(len(want), len(have)))
    steps = min(same + 1, len(want_logits), len(have_logits))
    difference = max(float((a - b).abs().max()) for a, b in zip(want_logits[:steps], have_logits[:steps],
                                                                  strict=True))
    scale = max(float(a.abs().max()) for a in want_logits[:steps])
    relative = difference / scale
    tie = same < min(len(want), len(have)) and same < len(want_logits) and \
        float(want_logits[same][want[same]] - want_logits[same][have[same]]) <= limit * scale
    passed = (same == len(want) == len(have) or tie) and relative <= limit
    text = (f"{same} of {len(want)} tokens equal; max |d logit| {difference:.3g} = {relative:.2g} x max |logit| "
            f"(limit {limit:.2g}: the model's rounding in its dtype)")
    if same < len(want):
        text += f"; first difference at token {same}: {want[same]} expected, {have[same] if same < len(have) else '-'}"
        if tie:
            text += ", tied with it in the reference's logits within the limit: compared up to there"
    return passed, text, {"tokens_equal": same, "tokens": len(want), "max_logit_diff": difference,
                          "relative_logit_diff": relative, "limit": limit, "tied": tie}


def logit_limit(lm: LoadedModel) -> float:
    """How far kvbench's logits may land from the reference's: the model's rounding in its dtype
    (`kvbench.checks.tolerance.model_tolerance`)."""
    return model_tolerance(lm.model.config, lm.dtype)
