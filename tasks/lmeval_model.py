"""lm-evaluation-harness under a kvbench policy: the lm-eval model `kvbench`, whose every request runs through an
engine session (kvbench/engine/session.py), so what lm-eval scores is the compressed cache:

  generate_until         prefill the request's context, compress, decode greedily (a decode-time policy evicting
                         as tokens arrive) until a stop sequence or `max_gen_toks`;
  loglikelihood          prefill the context, compress, then teacher-force the continuation through the
                         compressed cache (`Session.score`, `score_chunk` tokens at a time): lm-eval's usual single
                         forward over context + continuation would never read a compressed cache; the choices of
                         one doc share its compressed context, each scored on a fork;
  loglikelihood_rolling  stream the text through the cache `stream_chunk` tokens at a time, compressing after each,
                         as the perplexity task does (the first token is predicted from lm-eval's prefix token).

The first token of a continuation is predicted by the prefill's forward, which attends to the whole context before
anything is compressed (a `full` prefill): a single-token continuation (a multiple choice among letters) scores
exactly as the full cache's under any policy and budget. `split_at` makes the question arrive after compression
(question placement `agnostic`): each context is cut at the last occurrence of a marker, the text before it is
prefilled and compressed, the marker onward appended (`Session.append`), then the continuation is scored or
generated. Without it, a run warns once when it meets such continuations.

Importing this module registers the model with lm-eval (`lm_eval.simple_evaluate(model="kvbench", ...)`);
`kvbench lm-eval ...` is lm-eval's own command line with it registered. Tokenization, chat templates and stop
sequences are lm-eval's (`HFLM`); requests run one at a time, each in its own session.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import logging
import re
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

from kvbench.engine.estimate import canonical_dtype
from kvbench.engine.models import LoadedModel, load_model
from kvbench.engine.session import Session
from kvbench.engine.settings import RunSettings
from kvbench.errors import KvbenchError, did_you_mean
from kvbench.policies import Policy, build_policy

# what `--model_args` of `--model kvbench` takes, as `kvbench lm-eval --help` lists it; a test holds it to
# KvbenchLM's signature
MODEL_ARGS = {
    "pretrained": "a kvbench model spec: hub id, local folder, .gguf file, smollm2-135m, gemma3-270m or "
                  "random:<shape> (default smollm2-135m)",
    "policy": "a policy name, see `kvbench policies` (default full)",
    "policy.<param>": "a parameter of the policy, e.g. policy.window=16 (or the bare name where it is none of these)",
    "budget": "tokens per layer and KV head (128) or a ratio of the prompt (0.25) (default: none, the whole cache)",
    "prefill": "full (one forward, then compress; default) or chunked (compress after every prefill_chunk tokens)",
    "prefill_chunk": "tokens per chunk of a chunked prefill (default 512)",
    "split_at": "a marker (Question:, or re:<pattern>): each context is cut at its last occurrence, the text before "
                "it compressed, the rest appended after",
    "question": "aware (the question compressed with its context; default) or agnostic (default with split_at, "
                "which it needs)",
    "evict_every": "decode-time slack: evict once this many tokens exceed the budget (default 1)",
    "dtype": "auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16, float16 (or fp32, bf16, fp16)",
    "device": "auto, cpu, cuda or cuda:N (default auto)",
    "seed": "seed for random weights (default 0)",
    "score_chunk": "continuation tokens teacher-forced per forward through the compressed cache (default 1)",
    "stream_chunk": "tokens per forward of loglikelihood_rolling, compressed after each (default 64)",
    "max_length": "the longest context (default: the model's max_position_embeddings)",
}


def model_args_help() -> str:
    """kvbench's section of `kvbench lm-eval --help`: the model and its `model_args`."""
    width = max(map(len, MODEL_ARGS))
    lines = [textwrap.fill(text, 110, initial_indent=f"  {name:<{width}}  ", subsequent_indent=" " * (width + 4))
             for name, text in MODEL_ARGS.items()]
    return "\n".join(["kvbench's model: --model kvbench --model_args pretrained=SPEC,policy=NAME,budget=0.25,...",
                      *lines, "", "lm-eval's own usage follows.", ""])


@register_model("kvbench")
class KvbenchLM(HFLM):
    """`model_args`: `MODEL_ARGS` (or, from Python, a loaded model, a built policy and `settings`); `policy.<name>`
    (or the bare name when it is not one of `MODEL_ARGS`) sets a policy parameter. `measurements` gathers each
    request's record."""

    def __init__(self, pretrained: str | LoadedModel = "smollm2-135m", policy: str | Policy = "full",
                 budget: int | float | None = None, prefill: Literal["full", "chunked"] = "full",
                 prefill_chunk: int = 512, question: Literal["aware", "agnostic"] | None = None,
                 split_at: str | None = None, evict_every: int = 1,
                 dtype: str = "auto", device: str | None = "auto", seed: int = 0, score_chunk: int = 1,
                 stream_chunk: int = 64, batch_size: int | str = 1, max_batch_size: int | None = None,
                 max_length: int | None = None, settings: RunSettings | None = None, **params: Any) -> None:
        self.split_at = None if split_at is None else str(split_at)  # lm-eval's arguments parser makes `1` an int
        self.marker = marker_pattern(self.split_at)
        settings = settings or RunSettings(budget=budget, prefill=prefill, prefill_chunk=prefill_chunk,
                                           question=question or ("agnostic" if split_at is not None else "aware"),
                                           evict_every=evict_every)
        if settings.question == "agnostic" and self.marker is None:
            raise KvbenchError("question=agnostic needs split_at=MARKER: lm-eval requests carry no context/question "
                               "split, the marker's last occurrence in each context makes one")
        if settings.question == "aware" and self.marker is not None:
            raise KvbenchError(f"split_at={self.split_at} appends the question after compression (question=agnostic); "
                               "question=aware compresses each context whole")
        if score_chunk < 1 or stream_chunk < 1:
            raise KvbenchError(f"score_chunk and stream_chunk must be at least 1, got {score_chunk}, {stream_chunk}")
        self.kv_lm = pretrained if isinstance(pretrained, LoadedModel) else load_model(
            str(pretrained), dtype=canonical_dtype(dtype), device=device or "auto", seed=seed)
        self.kv_policy = policy if isinstance(policy, Policy) else build_policy(
            policy, {key.removeprefix("policy."): value for key, value in params.items()})
        self.settings = settings
        self.score_chunk, self.stream_chunk = score_chunk, stream_chunk
        self.measurements: list[dict[str, Any]] = []  # one per request, in the order requests ran
        super().__init__(pretrained=self.kv_lm.model, tokenizer=self.kv_lm.tokenizer, backend="causal", batch_size=1,
                         max_length=max_length or self.kv_lm.model.config.max_position_embeddings)

    def _session(self, prompt_tokens: int, arrival: int, adds: int | None = None,
                 chunked: bool | None = None) -> Session:
        # a fresh copy per request: a policy's per-sample state (the random policy's generator) starts anew
        return Session(self.kv_lm, dataclasses.replace(self.kv_policy), self.settings, prompt_tokens,
                       arrival=arrival, adds=adds, chunked=chunked)

    def _record(self, request, kind: str, session: Session, **outputs: Any) -> None:
        self.measurements.append({"request_type": kind, "task": getattr(request, "task_name", None),
                                  "doc_id": getattr(request, "doc_id", None), **outputs, **session.measurements()})

    def _marker_start(self, text: str, where: str) -> int:
        """Where the marker's last occurrence in `text` begins; it must have text before it."""
        assert self.marker is not None, "called only with split_at"
        found = [match.start() for match in self.marker.finditer(text)]
        if not found or found[-1] == 0:
            raise KvbenchError(f"split_at={self.split_at}: the context of {where} has "
                               f"{'nothing before' if found else 'no'} such marker (it is cut at its last occurrence)")
        return found[-1]

    def _split(self, text: str, ids: list[int], where: str) -> tuple[list[int], list[int]]:
        """`ids`, lm-eval's tokens of `text`, cut where the marker's last occurrence begins: (compressed,
        appended). They stay the whole text's tokens (one straddling the marker's first character is appended),
        so the split alone changes no score."""
        start = self._marker_start(text, where)
        try:
            encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError:
            raise KvbenchError("split_at needs a tokenizer that maps tokens to characters (a fast one)") from None
        special = len(ids) - len(encoded["input_ids"])  # a BOS token lm-eval put in front
        if special < 0 or ids[special:] != encoded["input_ids"]:
            raise KvbenchError(f"split_at: the tokenizer's tokens of {where} differ from lm-eval's")
        cut = special + sum(end <= start for _, end in encoded["offset_mapping"])
        if cut == 0:
            raise KvbenchError(f"split_at={self.split_at}: in {where}, no token precedes the marker")
        return ids[:cut], ids[cut:]

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        start = len(self.measurements)
        if self.marker is not None:  # tokenized, a request no longer names its doc: a missing marker is found here
            for request in requests:
                self._marker_start(request.args[0].rstrip(), doc_name(request))
        out = super().loglikelihood(requests, disable_tqdm=True)  # tokenizes, then `_loglikelihood_tokens`
        for request, record in zip(requests, self.measurements[start:], strict=True):
            record.update(task=request.task_name, doc_id=request.doc_id)
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None) -> list[tuple[float, bool]]:
        out, parent, compressed = [], None, None
        for (text, _), context, continuation in requests:
            if context != compressed:  # a doc's choices share its context: compressed once, each scored on a fork
                # lm-eval moved the context's trailing spaces into the continuation before tokenizing it
                head, question = self._split(text.rstrip(), context, "a doc") if self.marker else (context, [])
                parent, compressed = self._session(len(context), arrival=max(self.score_chunk, len(question))), context
                with parent:
                    parent.prefill(head)
                    if question:
                        parent.append(question)
            if len(continuation) == 1 and not question and self._uncompressed_when_predicting(context):
                warn_first_token_uncompressed()
            assert parent is not None, "the first request compresses its context"
            with parent.fork() as session:
                scored = session.score(continuation, chunk=self.score_chunk)
            logprob, greedy = float(scored.logprobs.sum()), bool(scored.greedy.all())
            out.append((logprob, greedy))
            self._record(None, "loglikelihood", session, logprob=logprob, is_greedy=greedy,
                         **({"question_tokens": len(question)} if self.marker else {}))
        return out

    def _uncompressed_when_predicting(self, context: list[int]) -> bool:
        """Whether the forward that predicts the first continuation token ran before anything was compressed:
        a `full` prefill, or a chunked one in one chunk, under a policy that changes the cache at all."""
        one_forward = self.settings.prefill == "full" or len(context) <= self.settings.prefill_chunk
        return one_forward and self.kv_policy.kind != "none"

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for request in requests:
            ids = [self.prefix_token_id, *self.tok_encode(request.args[0], add_special_tokens=False)]
            session = self._session(len(ids), arrival=self.stream_chunk)
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
            head, question = self._split(context, ids, doc_name(request)) if self.marker else (ids, [])
            session = self._session(len(ids), arrival=max(1, len(question)), adds=max_gen_toks + len(question))
            with session:
                session.prefill(head)
                if question:
                    session.append(question)
                tokens = session.decode(max_gen_toks, self.kv_lm.eos_token_ids, stop=until)[0]
            text = self.tok_decode([t for t in tokens if t not in self.kv_lm.eos_token_ids])
            for stop in until:  # greedy: sampling arguments (temperature, ...) are not used
                text = text.split(stop, 1)[0]
            out.append(text)
            self._record(request, "generate_until", session, generated=text,
                         **({"question_tokens": len(question)} if self.marker else {}))
        return out


def marker_pattern(split_at: str | None) -> re.Pattern | None:
    """`split_at` as a pattern: `re:<regular expression>`, else the literal text."""
    if split_at is None:
        return None
    if not split_at.startswith("re:"):
        return re.compile(re.escape(split_at))
    try:
        return re.compile(split_at.removeprefix("re:"))
    except re.error as exc:
        raise KvbenchError(f"split_at={split_at}: not a regular expression ({exc})") from None


def doc_name(request: Any) -> str:
    return f"task '{request.task_name}' doc {request.doc_id}"


@functools.cache  # once per process: a sweep runs a model per doc
def warn_first_token_uncompressed() -> None:
    logging.getLogger(__name__).warning(
        "warning: a single-token continuation is predicted by the forward over the whole context, before the policy "
        "compresses it, so it scores exactly as under the full cache at any budget; compress the context before its "
        "question with split_at=MARKER (a sweep: question: agnostic and the task's split_at; docs/lm-eval.md)")


def lm_eval_tasks(names: tuple[str, ...], include_path: str | None, metadata: dict[str, Any]) -> tuple[Any, dict]:
    """lm-eval's task manager and task objects by name, with kvbench's length knob (and tokenizer) in their
    metadata."""
    manager = task_manager(names, include_path, metadata, "give include_path, a folder of task YAML files")
    return manager, manager.load(list(names))["tasks"]  # a group or tag expands into its tasks


def task_manager(names: Sequence[str], include_path: str | None, metadata: dict[str, Any] | None,
                 local_hint: str) -> Any:
    """lm-eval's task manager once every name resolves (a task, group or tag, a pattern as lm-eval matches it);
    an unknown one is a one-line error with the closest name and `local_hint` (how to add local tasks) when no
    `include_path` was given. Local tasks alone (all found under `include_path`) skip indexing lm-eval's thousands
    of built-in ones."""
    from lm_eval.tasks import TaskManager

    def unknown(manager: Any) -> list[str]:
        return [name for name in names if not manager.match_tasks([name])]

    manager = TaskManager(include_path=include_path, include_defaults=False, metadata=metadata) \
        if include_path else None
    if manager is None or unknown(manager):
        manager = TaskManager(include_path=include_path, metadata=metadata)
    missing = unknown(manager)
    if missing:
        raise KvbenchError(f"lm-eval has no task '{missing[0]}'{did_you_mean(missing[0], manager.all_tasks)}"
                           + ("" if include_path else f" (local tasks: {local_hint})"))
    return manager


def check_command_tasks(args: Sequence[str]) -> None:
    """The task names of an lm-eval `run` command line (`--tasks a,b c`), checked before lm-eval loads the model:
    lm-eval's own check ends in a traceback. Task YAML files and folders are left to lm-eval."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--tasks", "-t", nargs="+", default=[])
    parser.add_argument("--include_path")
    known, _ = parser.parse_known_args(args)
    names = [name for group in known.tasks for name in group.split(",") if name]
    names = [name for name in names if not name.endswith(".yaml") and not Path(name).is_dir()]
    if names:
        task_manager(names, known.include_path, None, "--include_path DIR, a folder of task YAML files")


class _CurrentStderr:
    """Writes to whatever `sys.stderr` is at the time of each write."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def log_to_current_stderr() -> None:
    """lm-eval's logging, set up as its command line does, writing to the `sys.stderr` of each record: lm-eval binds
    its handler to the `sys.stderr` of its first setup, which a caller that swaps it (a test runner capturing a
    command's output) closes afterwards, so every later record of the process failed to print."""
    from lm_eval.utils import setup_logging

    setup_logging()
    for handler in logging.getLogger("lm_eval").handlers:
        if type(handler) is logging.StreamHandler and not isinstance(handler.stream, _CurrentStderr):
            handler.stream = _CurrentStderr()


def evaluate_doc(lm: LoadedModel, policy: Policy, settings: RunSettings, manager: Any, task: Any, name: str,
                 doc: int, num_fewshot: int | None, apply_chat_template: bool, score_chunk: int,
                 stream_chunk: int, split_at: str | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One doc of an lm-eval task through the `kvbench` model (its contexts cut at `split_at` under `settings`'
    question placement `agnostic`): lm-eval's logged sample (its metrics included) and the measurements of each of
    its requests."""
    import lm_eval

    # a sweep has its own progress display: lm-eval's per-call bars (stderr) and notices (its logger) stay quiet
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            model = KvbenchLM(pretrained=lm, policy=policy, settings=settings, score_chunk=score_chunk,
                              stream_chunk=stream_chunk, split_at=split_at)
            results = lm_eval.simple_evaluate(model=model, tasks=[task], samples={name: [doc]},
                                              num_fewshot=num_fewshot, bootstrap_iters=0, log_samples=True,
                                              apply_chat_template=apply_chat_template, task_manager=manager)
    finally:
        logger.setLevel(level)
    return results["samples"][name][0], model.measurements
