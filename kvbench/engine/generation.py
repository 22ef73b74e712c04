"""What most tasks need of the engine: one prompt (or a left-padded batch of them) and one greedy answer each."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from kvbench.engine.fidelity import AttentionRecorder, Follower
from kvbench.engine.segments import Segment, segment_measurements
from kvbench.engine.session import Session, stopped
from kvbench.policies.full import Full

if TYPE_CHECKING:
    from kvbench.engine.models import LoadedModel
    from kvbench.engine.settings import RunSettings
    from kvbench.engine.sharing import SharedPrefill
    from kvbench.policies.base import Policy

__all__ = ["Generation", "Prompt", "answer", "generate", "generate_batch", "generate_rows", "left_padded", "stopped"]


@dataclass
class Generation:
    """What a task's run returns: the text, its tokens, the final logits, and the measurements."""

    prediction: str
    tokens: list[int]
    last_logits: torch.Tensor | None
    measurements: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)  # a task's own outputs (see Task.outcome)


@dataclass(frozen=True)
class Prompt:
    """One row of a batch: its context and question token ids (the question appended after compression with
    `question: agnostic`), how its answer ends, and the units a task names in it (a prompt with segments runs
    alone: its record says what the cache kept of each, `segment_measurements`)."""

    context: list[int]
    question: list[int]
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    segments: tuple[Segment, ...] = ()


def generate(lm: LoadedModel, policy: Policy, context_ids: list[int], question_ids: list[int],
             settings: RunSettings, max_new_tokens: int, stop: tuple[str, ...] = (),
             eos_token_ids: set[int] | None = None, shared: SharedPrefill | None = None,
             segments: tuple[Segment, ...] = ()) -> Generation:
    """Prefill (or adopt `shared`, a prefill of the same prompt in `full` mode), compress, decode greedily."""
    return generate_rows(lm, policy, [Prompt(context_ids, question_ids, max_new_tokens, stop, segments)], settings,
                         eos_token_ids, shared)[0]


def generate_rows(lm: LoadedModel, policy: Policy, prompts: list[Prompt], settings: RunSettings,
                  eos_token_ids: set[int] | None = None, shared: SharedPrefill | None = None) -> list[Generation]:
    """`generate` for several prompts at once, left-padded into one batch (`shared`: a shared prefill of these
    prompts, in this order): each row's answer and its record's columns as `generate` gives them for the prompt
    alone, but for the times and memory peaks, which are the batch's (`Session.measurements`). Every row must
    resolve the budget alike (`compression_plan`), and with `question: agnostic` their questions (appended
    together after compression) must be of one length."""
    agnostic = settings.question == "agnostic"
    eos = lm.eos_token_ids if eos_token_ids is None else eos_token_ids
    single = len(prompts) == 1
    if agnostic and len({len(p.question) for p in prompts}) > 1:
        raise ValueError("the rows of an agnostic batch append questions of one length")
    if not single and any(p.segments for p in prompts):
        raise ValueError("a prompt with segments runs alone")
    fed = [p.context if agnostic else p.context + p.question for p in prompts]
    ids, padding = (fed[0], None) if single else left_padded(lm, fed)

    def session_of(policy: Policy, observers: list[Policy] | None = None) -> Session:
        return Session(lm, policy, settings, prompt_tokens=[len(p.context) + len(p.question) for p in prompts],
                       arrival=[len(p.question) if agnostic else 1 for p in prompts], observers=observers,
                       adds=[p.max_new_tokens + (len(p.question) if agnostic else 0) for p in prompts],
                       left_padding=padding, segments=prompts[0].segments if single else ())

    def prefill(session: Session) -> None:
        session.prefill(ids, shared=shared)
        if agnostic and prompts[0].question:
            session.append(prompts[0].question if single else torch.tensor([p.question for p in prompts]))

    follower, observers = None, None
    if settings.fidelity:  # the full-cache reference, fed the same prompt (free with a shared prefill)
        if not single:
            raise ValueError("fidelity follows one prompt at a time")
        full_attention, kept = AttentionRecorder("full"), AttentionRecorder("policy")
        reference = session_of(Full(), [full_attention])
        prefill(reference)
        follower, observers = Follower(reference, full_attention, kept), [policy, kept]
    session = session_of(policy, observers)
    with session:
        prefill(session)
        answers = session.decode([p.max_new_tokens for p in prompts], eos, [p.stop for p in prompts],
                                 follow=follower)
    return _generations(lm, session, prompts, answers, eos, follower)


def _generations(lm: LoadedModel, session: Session, prompts: list[Prompt], answers: list[list[int]], eos: set[int],
                 follower: Follower | None) -> list[Generation]:
    """Each row's answer (cut at its end of sequence and its stop strings) and its record's columns."""
    generations = []
    for row, (prompt, tokens) in enumerate(zip(prompts, answers, strict=True)):
        text, tokens = answer(lm, tokens, eos, prompt.stop)
        if len(prompts) == 1:
            measured = {**session.measurements(), **(follower.measurements() if follower else {})}
            if prompt.segments:
                measured |= segment_measurements(session.cache, prompt.segments)
            logits = session.logits
        else:
            measured, logits = session.measurements(row), session.row_logits(row)[None]
        generations.append(Generation(text, tokens, logits, measured))
    return generations


def answer(lm: LoadedModel, tokens: list[int], eos: set[int], stop: tuple[str, ...]) -> tuple[str, list[int]]:
    """A generated answer's text (cut at its stop strings) and tokens (without the end of sequence that ended it)."""
    tokens = _without_eos(tokens, eos)
    return _cut(cast(str, lm.tokenizer.decode(tokens, skip_special_tokens=True)), stop), tokens


def left_padded(lm: LoadedModel, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """`[rows, longest]` ids, each prompt left-padded to the longest, and each row's padding `[rows]`."""
    longest = max(map(len, prompts))
    pad_id = lm.pad_token_id
    padding = torch.tensor([longest - len(p) for p in prompts])
    return torch.tensor([[pad_id] * (longest - len(p)) + p for p in prompts]), padding


def generate_batch(lm: LoadedModel, policy: Policy, prompts: list[list[int]], settings: RunSettings,
                   max_new_tokens: int, eos_token_ids: set[int] | None = None,
                   ) -> tuple[list[list[int]], dict[str, Any]]:
    """Greedy decoding of several prompts in one cache: left-padded to the longest (padding is masked, evicted
    first and never counted as kept), the budget resolved against the longest. Returns each row's tokens (up to
    its end of sequence) and the whole batch's measurements (its cache's bytes over every row: what a capacity
    search fits into memory)."""
    ids, padding = left_padded(lm, prompts)
    eos = lm.eos_token_ids if eos_token_ids is None else eos_token_ids
    session = Session(lm, policy, settings, prompt_tokens=ids.shape[1], adds=max_new_tokens, left_padding=padding)
    with session:
        session.prefill(ids)
        rows = session.decode(max_new_tokens, eos)
    return [_without_eos(row, eos) for row in rows], {**session.measurements(), "batch": len(prompts)}


def _without_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """An answer's tokens without the end-of-sequence token that ended it."""
    return tokens[:-1] if tokens[-1] in eos else tokens


def _cut(text: str, stop: tuple[str, ...]) -> str:
    text = text.strip()
    for s in stop:
        text = text.split(s, 1)[0]
    return text.strip()
