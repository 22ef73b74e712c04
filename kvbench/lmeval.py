"""lm-evaluation-harness under a kvbench policy: the lm-eval model `kvbench`, whose every request runs through an
engine session (kvbench/session.py), so what lm-eval scores is the compressed cache:

  generate_until         prefill the request's context, compress, decode greedily (a decode-time policy evicting
                         as tokens arrive) until a stop sequence or `max_gen_toks`;
  loglikelihood          prefill the context, compress, then teacher-force the continuation through the
                         compressed cache (`Session.score`, `score_chunk` tokens at a time): lm-eval's usual single
                         forward over context + continuation would never read a compressed cache; the choices of
                         one doc share its compressed context, each scored on a fork;
  loglikelihood_rolling  stream the text through the cache `stream_chunk` tokens at a time, compressing after each,
                         as the perplexity task does (the first token is predicted from lm-eval's prefix token).

Importing this module registers the model with lm-eval (`lm_eval.simple_evaluate(model="kvbench", ...)`);
`kvbench lm-eval ...` is lm-eval's own command line with it registered. Tokenization, chat templates and stop
sequences are lm-eval's (`HFLM`); requests run one at a time, each in its own session.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
from typing import Any

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

from kvbench.errors import KvbenchError
from kvbench.models import LoadedModel, load_model
from kvbench.policies import Policy, build_policy
from kvbench.session import RunSettings, Session


@register_model("kvbench")
class KvbenchLM(HFLM):
    """`model_args`: `pretrained` (any kvbench model spec), `policy` and its parameters (`policy.<name>=value`, or
    the bare name when it is not one of these arguments), `budget`, `prefill`, `prefill_chunk`, `evict_every`,
    `dtype`, `device`, `seed`, `score_chunk`, `stream_chunk` (or, from Python, a loaded model, a built policy and
    `settings`). `measurements` gathers each request's record."""

    def __init__(self, pretrained: str | LoadedModel = "smollm2-135m", policy: str | Policy = "full",
                 budget: int | float | None = None, prefill: str = "full", prefill_chunk: int = 512,
                 question: str = "aware", evict_every: int = 1, dtype: str = "auto", device: str | None = "auto",
                 seed: int = 0, score_chunk: int = 1, stream_chunk: int = 64, batch_size: int | str = 1,
                 max_batch_size: int | None = None, max_length: int | None = None,
                 settings: RunSettings | None = None, **params: Any) -> None:
        if question != "aware":
            raise KvbenchError("lm-eval requests carry no context/question split: the request's context is "
                               "compressed and its continuation or answer comes after it (use question=aware)")
        if score_chunk < 1 or stream_chunk < 1:
            raise KvbenchError(f"score_chunk and stream_chunk must be at least 1, got {score_chunk}, {stream_chunk}")
        self.kv_lm = pretrained if isinstance(pretrained, LoadedModel) else load_model(
            str(pretrained), dtype=dtype, device=device or "auto", seed=seed)
        self.kv_policy = policy if isinstance(policy, Policy) else build_policy(
            policy, {key.removeprefix("policy."): value for key, value in params.items()})
        self.settings = settings or RunSettings(budget=budget, prefill=prefill, prefill_chunk=prefill_chunk,
                                                evict_every=evict_every)
        self.score_chunk, self.stream_chunk = score_chunk, stream_chunk
        self.measurements: list[dict[str, Any]] = []  # one per request, in the order requests ran
        super().__init__(pretrained=self.kv_lm.model, tokenizer=self.kv_lm.tokenizer, backend="causal", batch_size=1,
                         max_length=max_length or self.kv_lm.model.config.max_position_embeddings)

    def _session(self, prompt_tokens: int, arrival: int, growth: int = 256, chunked: bool | None = None) -> Session:
        # a fresh copy per request: a policy's per-sample state (the random policy's generator) starts anew
        return Session(self.kv_lm, dataclasses.replace(self.kv_policy), self.settings, prompt_tokens,
                       arrival=arrival, growth=growth, chunked=chunked)

    def _record(self, request, kind: str, session: Session, **outputs: Any) -> None:
        self.measurements.append({"request_type": kind, "task": getattr(request, "task_name", None),
                                  "doc_id": getattr(request, "doc_id", None), **outputs, **session.measurements()})

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        start = len(self.measurements)
        out = super().loglikelihood(requests, disable_tqdm=True)  # tokenizes, then `_loglikelihood_tokens`
        for request, record in zip(requests, self.measurements[start:], strict=True):
            record.update(task=request.task_name, doc_id=request.doc_id)
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None) -> list[tuple[float, bool]]:
        out, parent, compressed = [], None, None
        for _, context, continuation in requests:
            if context != compressed:  # a doc's choices share its context: compressed once, each scored on a fork
                parent, compressed = self._session(len(context), arrival=self.score_chunk), context
                with parent:
                    parent.prefill(context)
            with parent.fork() as session:
                scored = session.score(continuation, chunk=self.score_chunk)
            logprob, greedy = float(scored.logprobs.sum()), bool(scored.greedy.all())
            out.append((logprob, greedy))
            self._record(None, "loglikelihood", session, logprob=logprob, is_greedy=greedy)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for request in requests:
            ids = [self.prefix_token_id, *self.tok_encode(request.args[0], add_special_tokens=False)]
            session = self._session(len(ids), arrival=self.stream_chunk, growth=max(self.stream_chunk, 256))
            with session:  # a fresh session streams the text: the first chunk is the prompt, compressed once
                logprob = float(session.score(ids, chunk=self.stream_chunk).logprobs.sum())
            out.append(logprob)
            self._record(request, "loglikelihood_rolling", session, logprob=logprob, tokens=len(ids) - 1)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos_text = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        out = []
        for request in requests:
            context, gen_kwargs = request.args
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = tuple(handle_stop_sequences(kwargs.pop("until", None), eos=eos_text))
            max_gen_toks = kwargs.pop("max_gen_toks")
            ids = self.tok_encode(context)
            session = self._session(len(ids), arrival=1, growth=max_gen_toks)
            with session:
                session.prefill(ids)
                tokens = session.decode(max_gen_toks, self.kv_lm.eos_token_ids, stop=until)[0]
            text = self.tok_decode([t for t in tokens if t not in self.kv_lm.eos_token_ids])
            for stop in until:  # greedy: sampling arguments (temperature, ...) are not used
                text = text.split(stop, 1)[0]
            out.append(text)
            self._record(request, "generate_until", session, generated=text)
        return out


def lm_eval_tasks(names: tuple[str, ...], include_path: str | None, metadata: dict[str, Any]) -> tuple[Any, dict]:
    """lm-eval's task manager and task objects by name, with kvbench's length knob (and tokenizer) in their
    metadata. Local tasks alone (all found under `include_path`) skip indexing lm-eval's thousands of built-in
    ones."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path, include_defaults=False, metadata=metadata) \
        if include_path else None
    if manager is None or any(name not in manager.all_tasks for name in names):
        manager = TaskManager(include_path=include_path, metadata=metadata)
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        raise KvbenchError(f"lm-eval has no task '{unknown[0]}'" + ("" if include_path else
                           " (local tasks: give include_path, a folder of task YAML files)"))
    return manager, manager.load(list(names))["tasks"]  # a group or tag expands into its tasks


def evaluate_doc(lm: LoadedModel, policy: Policy, settings: RunSettings, manager: Any, task: Any, name: str,
                 doc: int, num_fewshot: int | None, apply_chat_template: bool, score_chunk: int,
                 stream_chunk: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One doc of an lm-eval task through the `kvbench` model: lm-eval's logged sample (its metrics included)
    and the measurements of each of its requests."""
    import lm_eval

    # a sweep has its own progress display: lm-eval's per-call bars (stderr) and notices (its logger) stay quiet
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            model = KvbenchLM(pretrained=lm, policy=policy, settings=settings, score_chunk=score_chunk,
                              stream_chunk=stream_chunk)
            results = lm_eval.simple_evaluate(model=model, tasks=[task], samples={name: [doc]},
                                              num_fewshot=num_fewshot, bootstrap_iters=0, log_samples=True,
                                              apply_chat_template=apply_chat_template, task_manager=manager)
    finally:
        logger.setLevel(level)
    return results["samples"][name][0], model.measurements
