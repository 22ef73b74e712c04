"""The engine session: one cache under one policy and budget, and the few calls every task makes of it.

    session = Session(lm, policy, settings, prompt_tokens=len(prompt), growth=max_new_tokens)
    with session:                             # peak memory is measured over the block
        session.prefill(context)              # `full` or `chunked`, compressing as the settings say
        session.append(question)              # text after compression (an agnostic question)
        tokens, = session.decode(32, eos)     # greedy; a decode-time policy evicts as tokens arrive
    record = session.measurements()           # speed, byte and memory columns

`step(token)` is one decode step, `score(ids)` the log-probabilities of a continuation teacher-forced through
the compressed cache, `fork()` an independent copy (one compressed context, many questions). The phase is the
session's state: `prefill` compresses what it feeds as a prompt and leaves the session in the decode phase,
where only a decode-time policy evicts (every `evict_every` tokens, or the period its definition fixes: R-KV's
buffer). A generated token is fed with whatever comes next, so a conversation continues exactly where its reply
stopped.

Positions are true token positions (RoPE continues at the number of tokens seen), while the mask is sized by
the cache's own length (a sliding-window layer's is built from the true positions). A left-padded batch is one
session too: each row counts positions from its first real token, padding is masked and evicted first.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import torch

from kvbench.budgets import Threshold
from kvbench.cache import CacheStats, KVCache, Phase
from kvbench.errors import KvbenchError
from kvbench.measure import PeakMemory, Stopwatch
from kvbench.models import LoadedModel
from kvbench.policies.base import Policy
from kvbench.rows import RowAccounts
from kvbench.settings import RunSettings, compression_plan, policy_budget, threshold_of
from kvbench.settings import check_budget as check_budget  # re-exported: plugins and tests import from here
from kvbench.settings import resolve_budget as resolve_budget


class Scored(NamedTuple):
    """What `Session.score` returns, one entry per scored token."""

    logprobs: torch.Tensor  # float32 log-probability of each token
    greedy: torch.Tensor  # bool: the token was the most likely one


@dataclass
class SharedPrefill:
    """One forward over a prompt, gathering every listed policy's statistics; each cell of a sweep that
    compresses this prompt starts from its cache instead of running the prompt again (compressing straight
    from it into buffers of its own). Cells that compress it the same way (policy, resolved budget) share that
    too: `wanted` counts them, and the first one's result is kept in `compressed` for the others to copy."""

    cache: KVCache
    logits: torch.Tensor
    seconds: float
    memory: PeakMemory
    wanted: Counter[str] = dataclasses.field(default_factory=Counter)
    compressed: dict[str, tuple[Policy, KVCache, float]] = dataclasses.field(default_factory=dict)

    def select(self, rows: list[int], users: list[tuple[Policy, RunSettings]] = ()) -> SharedPrefill:
        """The prefill of a batch's `rows` only (in that order), for cells that run those rows together; `users`
        are their (policy, settings), as `shared_prefill` takes them."""
        cache = self.cache.select_rows(rows)
        prompt_tokens = cache.layers[0].seen - cache.row_padding[0]
        return SharedPrefill(cache, self.logits[rows], self.seconds, self.memory,
                             wanted_compressions(users, prompt_tokens))

    def seconds_for(self, policy: Policy) -> float:
        """The forward's time without the other policies' statistics: what `policy` alone would have spent."""
        spent = self.cache.observe_seconds
        own = sum(spent.get(leaf.state_key, 0.0) for leaf in {p.state_key: p for p in policy.observers()}.values())
        return self.seconds - sum(spent.values()) + own


class Session:
    """A cache under `policy` at the settings' budget (resolved against `prompt_tokens`), fed through `lm`.

    Sizing: between two evictions a layer may receive a prefill chunk, `evict_every` decode tokens or
    `arrival` tokens at once (a question, a user turn, a scored chunk), so its buffer has room for that beyond
    the budget; a cache that stops evicting grows `growth` slots at a time. `chunked` says whether the prompt
    is compressed more than once (default: the settings' prefill mode); `observers` gathers the statistics of
    other policies too (a shared prefill); `left_padding` `[batch]` makes it a left-padded batch.

    A batch gives `prompt_tokens`, `arrival` and `growth` per row (or one for all): every row evicts as its own
    cache would (kvbench/rows.py keeps each row's accounts), so the rows must share one resolved budget
    (`compression_plan`).
    """

    def __init__(self, lm: LoadedModel, policy: Policy, settings: RunSettings, prompt_tokens: int | Sequence[int],
                 *, arrival: int | Sequence[int] = 1, growth: int | Sequence[int] = 256, chunked: bool | None = None,
                 observers: list[Policy] | None = None, left_padding: torch.Tensor | None = None) -> None:
        self.lm, self.policy, self.settings = lm, policy, settings
        self.rows = 1 if left_padding is None else len(left_padding)
        prompts, arrivals, growths = (_per_row(value, self.rows) for value in (prompt_tokens, arrival, growth))
        chunked = settings.prefill == "chunked" if chunked is None else chunked
        plans = {compression_plan(policy, settings, tokens, chunked, lm.num_layers) for tokens in prompts}
        if len(plans) > 1:
            raise ValueError(f"the rows of a batch must share one budget and its layer budgets, got {sorted(plans)}")
        self.budget = plans.pop()[0]
        policy.prepare(lm)
        evict_every = max(policy.eviction_periods(), default=settings.evict_every)  # R-KV's buffer is its own
        headrooms = [max(evict_every, settings.prefill_chunk if settings.prefill == "chunked" else 1, a)
                     for a in arrivals]
        padded = left_padding is not None and int(left_padding.max()) > 0
        # a batch keeps each row's accounts; compressed storage batches only rows that hold alike (`row_stats`)
        accounts = None if left_padding is None or policy.layout() is not None else \
            RowAccounts(lm.num_layers, lm.kv_heads, left_padding.tolist(), growths, headrooms)
        # a sparse policy's budget bounds what each decode step reads, not what the cache keeps
        sparse = policy.family == "sparse"
        self.cache = KVCache(lm.num_layers, (self.rows, lm.kv_heads, lm.head_dim), policy,
                             None if sparse else self.budget, read_budget=self.budget if sparse else None,
                             evict_every=evict_every, headroom=max(headrooms), growth=max(growths),
                             observers=observers, limit_bytes=settings.kv_limit_bytes, prompt_tokens=prompts[0],
                             left_padding=left_padding if padded else None, model=lm.internals,
                             kinds=lm.layer_kinds, rows=accounts,
                             threshold=None if self.budget is None else threshold_of(settings))
        self.logits: torch.Tensor | None = None  # [rows, vocab]: the prediction of the next token
        self.pending: list[int] = []  # a generated token not fed yet: it goes in front of what comes next
        self.shared: SharedPrefill | None = None
        self.memory: PeakMemory | None = None
        self.earlier: list[PeakMemory] = []  # peaks this state grew out of: a fork's parent's
        self.prefill_s = 0.0  # prefill, append and score time
        self.ttft_s: float | None = None
        self.step_s: list[float] = []  # each one-token step (decode, or scoring one token at a time)
        self.tokens_fed = 0  # tokens fed other than by decoding: the record's prompt_tokens
        self.generated_tokens = 0
        self.decoded = False  # entered the decode phase at least once
        # a batch: each row's own tokens fed and generated, and its accounts and logits when its answer ended
        self.row_tokens_fed = [0] * self.rows
        self.row_generated = [0] * self.rows
        self.row_steps = 0  # one-token decode steps summed over the rows still generating (decode_tok_s)
        self.finished: dict[int, tuple[CacheStats, torch.Tensor]] = {}

    # --- measurement ---------------------------------------------------------------------
    def __enter__(self) -> Session:
        self.memory = PeakMemory(self.lm.devices).__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.memory.__exit__(*exc)

    @property
    def seen(self) -> int:
        """Tokens fed so far (a pending generated token not included)."""
        return self.cache.layers[0].seen

    def measurements(self, row: int | None = None) -> dict[str, Any]:
        """The record's speed, byte and memory columns (after the `with` block). In a batch, `row`'s: its own
        tokens and its cache as its own cache would hold it when its answer ended (kvbench/rows.py), beside what
        the batch measured together (`ttft_s` and `tpot_s`: what every row waited; `prefill_tok_s` and
        `decode_tok_s`: the batch's throughput; the memory peaks: the batch's). Without `row`, the whole batch."""
        if self.memory is None:
            raise RuntimeError("measurements() needs the session to have run inside `with session:`")
        scope = self.policy.budget_scope if self.decoded else ("prefill" if self.policy.phases else "none")
        if self.rows == 1:
            speed = timings(self.tokens_fed, self.prefill_s, self.ttft_s, self.step_s, self.generated_tokens)
        else:
            speed = timings(sum(self.row_tokens_fed), self.prefill_s, self.ttft_s, self.step_s,
                            sum(self.row_generated), decoded=self.row_steps)
        stats = None
        if row is not None and self.rows > 1:
            speed.update(prompt_tokens=self.row_tokens_fed[row], generated_tokens=self.row_generated[row])
            stats = self.finished[row][0] if row in self.finished else self.cache.row_stats(row)
        return {
            **speed,
            "batch_size": self.rows,
            "budget_tokens": self.budget,
            "budget_scope": scope,
            **cache_measurements(self.cache, self.memory, self.earlier, shared=self.shared, stats=stats, row=row),
            **self._threshold_measurements(),
            **self.policy.report(),
        }

    def _threshold_measurements(self) -> dict[str, Any]:
        """A threshold cell's record: its threshold and what it achieved in each layer (`cache_ratio` is the
        whole cache's). Its rows run alone (`sweep._alone`), so the cache is the sample's."""
        threshold = self.cache.threshold
        if threshold is None:
            return {}
        assert self.rows == 1, "a threshold keeps each sample's own count: its samples run one at a time"
        return {"threshold": threshold.value, "layer_ratios": self.cache.layer_ratios()}

    def row_logits(self, row: int) -> torch.Tensor:
        """`[vocab]`: the logits that chose the last token of `row`'s answer."""
        assert self.logits is not None, "no prediction yet"
        return self.finished[row][1] if row in self.finished else self.logits[row]

    # --- the calls -----------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, ids: list[int] | torch.Tensor, shared: SharedPrefill | None = None) -> None:
        """Feed a prompt (or a new user turn) and compress it as a prompt: once after it (`full`), or after
        every `prefill_chunk` tokens (`chunked`). With `shared` (a `full` prefill of exactly these tokens into
        an empty session), start from a copy of its cache instead of running the forward."""
        ids = self._inputs(ids)
        self._enter(Phase.PREFILL)
        clock = Stopwatch(self.lm.devices)
        own_statistics = 0.0
        self._count_fed(ids.shape[1])
        if shared is not None:
            if self.settings.prefill == "chunked" or self.seen or shared.cache.layers[0].seen != ids.shape[1] \
                    or not _same_rows(shared.cache, self.cache):
                raise ValueError("a shared prefill serves only a `full` prefill of the same prompt")
            self.logits, self.shared = shared.logits, shared
            own_statistics = shared.seconds_for(self.policy) + self._compress_shared(shared, ids, clock)
        else:
            chunk = self.settings.prefill_chunk if self.settings.prefill == "chunked" else ids.shape[1]
            for start in range(0, ids.shape[1], chunk):
                self.logits = self._forward(ids[:, start : start + chunk])[:, -1]
                if start + chunk >= ids.shape[1]:
                    self.policy.after_prompt(self, ids)
                self._compress()
        self.cache.store_prompt()
        self._enter(Phase.DECODE)
        self.prefill_s += clock.lap() + own_statistics
        self.tokens_fed += ids.numel()

    @torch.inference_mode()
    def append(self, ids: list[int] | torch.Tensor) -> None:
        """Feed text that arrives after compression (an agnostic question): decode phase, one forward."""
        ids = self._inputs(ids)
        self._enter(Phase.DECODE)
        clock = Stopwatch(self.lm.devices)
        self._count_fed(ids.shape[1])
        self.logits = self._forward(ids)[:, -1]
        self._compress()
        self.prefill_s += clock.lap()
        self.tokens_fed += ids.numel()

    @torch.inference_mode()
    def step(self, token: int | torch.Tensor) -> torch.Tensor:
        """One decode step: feed one token per row (`[rows]`), evict as a decode-time policy must; returns the
        next token's logits `[rows, vocab]`."""
        ids = self._inputs([int(token)] if isinstance(token, int) else token.reshape(self.rows, 1))
        self._enter(Phase.DECODE)
        clock = Stopwatch(self.lm.devices)
        self.logits = self._forward(ids)[:, -1]
        self._compress()
        self.step_s.append(clock.lap())
        return self.logits

    @torch.inference_mode()
    def decode(self, max_new_tokens: int | Sequence[int], eos: set[int],
               stop: tuple[str, ...] | Sequence[tuple[str, ...]] = (),
               follow: Callable[[int, torch.Tensor], None] | None = None) -> list[list[int]]:
        """Greedy tokens from the pending prediction on, each fed back, until every row's answer ended: at an
        end-of-sequence token (included), at a `stop` string or after `max_new_tokens` (`stop` and
        `max_new_tokens` per row, or one for all). A batch's rows keep decoding together: a row whose answer
        ended is fed along (its tokens are no longer its answer) and its accounts are taken as it ended
        (`finished`), where its own cache would have stopped. The last token is not fed: single row, it is
        pending. `follow(token, logits)` sees each chosen token (single row) with the logits that chose it,
        untimed."""
        if self.logits is None:
            raise RuntimeError("decode() needs a prediction: prefill, append or step first")
        if follow is not None and self.rows != 1:
            raise ValueError("follow() follows a single-row session")
        limits = _per_row(max_new_tokens, self.rows)
        stops = [stop] * self.rows if not stop or isinstance(stop[0], str) else list(stop)
        clock = Stopwatch(self.lm.devices)
        token = self.logits.argmax(-1).cpu()
        rows = [[t] for t in token.tolist()]
        first_s = clock.lap()
        if self.ttft_s is None:
            self.ttft_s = self.prefill_s + first_s
        going = [True] * self.rows
        self._end_answers(rows, going, limits, eos, stops)
        if follow:
            follow(int(token[0]), self.logits)
        while any(going):
            token = self.step(token).argmax(-1).cpu()
            self.row_steps += sum(going)
            for row, t, more in zip(rows, token.tolist(), going, strict=True):
                if more:
                    row.append(t)
            self._end_answers(rows, going, limits, eos, stops)
            if follow:
                follow(int(token[0]), self.logits)
        self.generated_tokens += sum(map(len, rows))
        self.row_generated = [done + len(row) for done, row in zip(self.row_generated, rows, strict=True)]
        self.pending = rows[0][-1:] if self.rows == 1 and rows[0][-1] not in eos else []
        return rows

    @torch.inference_mode()
    def probe(self, ids: list[int] | torch.Tensor) -> None:
        """Feed `ids` for their attention statistics only (the observers see them), then forget them: the cache
        holds what it held before, its peak counts them. KVzip's reconstruction runs this way."""
        ids = ids.to(self.lm.device) if isinstance(ids, torch.Tensor) else torch.tensor([ids], device=self.lm.device)
        self.cache.slides = False  # a sliding layer must keep its window for the tokens that come after the probe
        try:
            self._forward(ids)
        finally:
            self.cache.slides = True
        for layer in self.cache.layers:
            layer.truncate(ids.shape[1])

    @torch.inference_mode()
    def score(self, ids: list[int], chunk: int | None = None) -> Scored:
        """Log-probabilities of `ids`, teacher-forced through the cache `chunk` tokens at a time (all at once
        by default), compressing after each chunk as the phase says. On a fresh session the text streams: its
        first chunk is the prompt (compressed as one), the rest decode, where only a decode-time policy evicts,
        so a prefill-time policy's cache grows over the text as it would over a generation. After a prefill
        the text is a continuation (decode). Every token is scored from what precedes it, the first from the
        pending prediction; a fresh session has none, so there the first token only starts the text and
        `len(ids) - 1` are scored. The last token is left pending. Single row."""
        if self.rows != 1:
            raise ValueError("score() runs on a single-row session")
        before = None if self.pending else self.logits
        fresh = self.seen == 0
        fed = self._inputs(ids[:-1])
        targets = torch.tensor(ids, device=self.lm.device)[(0 if before is not None else 1) :]
        chunk = chunk or max(1, fed.shape[1])
        logprobs = []
        if before is not None:
            logprobs.append(before.float().log_softmax(-1))
        for start in range(0, fed.shape[1], chunk):
            clock = Stopwatch(self.lm.devices)
            self._enter(Phase.PREFILL if fresh and start == 0 else Phase.DECODE)
            logits = self._forward(fed[:, start : start + chunk], all_logits=True)[0]
            if self.cache.phase is Phase.PREFILL:
                self.policy.after_prompt(self, fed[:, :chunk])
            self._compress()
            if self.cache.phase is Phase.PREFILL:
                self.cache.store_prompt()
            seconds = clock.lap()
            self.prefill_s += seconds
            if logits.shape[0] == 1:
                self.step_s.append(seconds)
            logprobs.append(logits.float().log_softmax(-1))
            self.logits = logits[-1:]
        self.tokens_fed += fed.shape[1]
        self.pending = [int(ids[-1])]
        table = torch.cat(logprobs)
        greedy = table.argmax(-1) == targets
        return Scored(table.gather(-1, targets[:, None])[:, 0], greedy)

    def fork(self) -> Session:
        """An independent copy: its own cache, policy state, pending token and counters; the model is shared.
        Measure it in its own `with` block: its memory peak includes its parent's so far."""
        twin = copy.copy(self)
        with torch.inference_mode():
            twin.policy, twin.cache = copy.deepcopy((self.policy, self.cache))
        twin.pending, twin.step_s, twin.memory = list(self.pending), list(self.step_s), None
        twin.earlier = [*self.earlier, *([self.memory] if self.memory else [])]
        return twin

    # --- internals -----------------------------------------------------------------------
    def _compress_shared(self, shared: SharedPrefill, ids: torch.Tensor, clock: Stopwatch) -> float:
        """Compress `shared`'s prompt into this session's cache, or copy the result of a cell that compressed it the
        same way; returns the compression seconds a copy did not spend (charged as if it had)."""
        wanted = compression_key(self.policy, self.budget, self.cache.threshold)
        shared.wanted[wanted] -= 1
        sizing = [self.cache.headroom, self.cache.growth] if self.cache.rows is None else \
            [self.cache.rows.headroom.tolist(), self.cache.rows.growth.tolist()]
        key = json.dumps([wanted, *sizing, self.cache.evict_every])
        if key in shared.compressed and not self.settings.fidelity:
            policy, cache, seconds = shared.compressed[key]
            if shared.wanted[wanted] <= 0:  # the last cell to want it takes it
                del shared.compressed[key]
            else:
                policy, cache = copy.deepcopy((policy, cache))
            self.policy, self.cache = policy, cache
            clock.lap()
            return seconds
        self.cache.adopt(shared.cache)
        self.policy.after_prompt(self, ids)
        self.cache.compress()
        self.cache.own_entries()
        if shared.wanted[wanted] > 0 and self.cache.evictions and not self.settings.fidelity:
            seconds = clock.lap()
            shared.compressed[key] = (*copy.deepcopy((self.policy, self.cache)), seconds)
            clock.lap()  # the copy kept for the others is not this cell's work
            return seconds
        return 0.0

    def _inputs(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        """`[rows, n]` ids on the model's device, the pending token in front."""
        ids = torch.tensor([ids], dtype=torch.long) if isinstance(ids, list) else ids
        if self.pending:
            ids = torch.cat([torch.tensor([self.pending], dtype=ids.dtype), ids.cpu()], dim=1)
            self.pending = []
        return ids.to(self.lm.device)

    def _enter(self, phase: Phase) -> None:
        self.cache.phase = phase
        self.decoded |= phase is Phase.DECODE

    def _compress(self) -> None:
        """Evict to the budget: always after prompt text, in the decode phase only for a decode-time policy."""
        if self.cache.phase is Phase.PREFILL or self.policy.evicts_during_decode:
            self.cache.compress()

    def _forward(self, ids: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """Feed `ids` `[rows, n]` after what the cache has seen; the logits `[rows, n, vocab]` of every
        position with `all_logits`, else of the last one only (`[rows, 1, vocab]`)."""
        cache, lm = self.cache, self.lm
        seen, length = cache.layers[0].seen, cache.layers[0].length
        positions = torch.arange(seen, seen + ids.shape[1], device=lm.device)[None]
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
            kwargs["cache_position"] = torch.arange(length, length + ids.shape[1], device=lm.device)
        return lm.model(input_ids=ids, **kwargs).logits

    def _end_answers(self, rows: list[list[int]], going: list[bool], limits: list[int], eos: set[int],
                     stops: list[tuple[str, ...]]) -> None:
        """Mark the rows whose answer just ended (their last token); a batch keeps what each one's record reads."""
        for index, row in enumerate(rows):
            if going[index] and (row[-1] in eos or len(row) >= limits[index] or self._stopped(row, stops[index])):
                going[index] = False
                if self.rows > 1:
                    assert self.logits is not None
                    self.finished[index] = (self.cache.row_stats(index), self.logits[index].clone())

    def _stopped(self, tokens: list[int], stop: tuple[str, ...]) -> bool:
        if not stop:
            return False
        text = self.lm.tokenizer.decode(tokens, skip_special_tokens=True)
        return any(s in text.lstrip() for s in stop)

    def _count_fed(self, new: int) -> None:
        """Count `new` tokens about to be fed as each row's own (its left padding is not)."""
        seen = self.seen
        self.row_tokens_fed = [fed + max(0, seen + new - pad) - max(0, seen - pad)
                               for fed, pad in zip(self.row_tokens_fed, self.cache.row_padding, strict=True)]


def _per_row(value: int | Sequence[int], rows: int) -> list[int]:
    """One value for each of `rows` rows: given per row, or one for all."""
    if isinstance(value, int):
        return [value] * rows
    if len(value) != rows:
        raise ValueError(f"{len(value)} values for {rows} rows")
    return list(value)


def _same_rows(shared: KVCache, cache: KVCache) -> bool:
    """Whether a shared prefill's cache holds the rows `cache` is for (the same left padding)."""
    return shared.row_padding == cache.row_padding


def timings(prompt_tokens: int, prefill_s: float, ttft_s: float | None, step_s: list[float],
            generated_tokens: int, decoded: int | None = None) -> dict[str, Any]:
    """The record's speed columns; `step_s` are one-token steps, which decoded `decoded` tokens in all (default:
    one each; a batch's step decodes one for every row still generating)."""
    return {
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated_tokens,
        "ttft_s": ttft_s,
        "tpot_s": statistics.median(step_s) if step_s else None,
        "prefill_tok_s": prompt_tokens / prefill_s,
        "decode_tok_s": (len(step_s) if decoded is None else decoded) / sum(step_s) if step_s else None,
    }


def cache_measurements(cache: KVCache, memory: PeakMemory, earlier: list[PeakMemory] = (),
                       shared: SharedPrefill | None = None, stats: CacheStats | None = None,
                       row: int | None = None) -> dict[str, Any]:
    """The cache's byte accounting and the process's memory peak: the record's memory columns. `earlier` are
    the peaks of what this cache started from (a fork's parent): it peaked at least there. A cell of a `shared`
    prefill reports its own peak (what it allocated after adopting, on top of what was there before the shared
    forward) and, as `mem_group_peak_*`, the peak with the shared prefill counted; `kv_bytes_peak` counts the
    prompt's full cache it compressed from, as a cell run alone holds it, and `kv_bytes_peak_own` its own
    buffers. A batch's `row` gives its `stats` (its own cache's accounts); the memory peaks stay the batch's."""
    stats = cache.stats() if stats is None else stats
    memories = [memory, *earlier]
    peaks = {column: _peak(memories, name) for column, name in MEMORY_PEAKS.items()}
    own: dict[str, Any] = {}
    if shared is not None:
        started = earlier[0] if earlier else memory  # the first session's: entered before adopting
        own = {column: _own_peak(peaks[column], started, shared.memory, name) for column, name in MEMORY_PEAKS.items()}
        own.update({column.replace("mem_", "mem_group_"): _peak([*memories, shared.memory], name)
                    for column, name in MEMORY_PEAKS.items()})
        prompt = shared.cache.stats() if row is None or shared.cache.rows is None else shared.cache.row_stats(row)
        own.update(kv_bytes_peak=max(stats.kv_bytes_peak, prompt.kv_bytes_peak), kv_bytes_peak_own=stats.kv_bytes_peak)
    return {
        **asdict(stats),
        "cache_ratio": stats.cache_ratio,
        "read_ratio": stats.read_ratio,
        **peaks,
        **own,
        "mem_baseline": memory.baseline_bytes,
        "mem_device_note": memory.device_note,
        **({} if cache.limit_bytes is None else {
            "kv_limit_bytes": cache.limit_bytes,
            # the limit bounds the cache; what the process grew by says whether the rest fit too
            "mem_growth_over_limit": memory.peak_bytes - memory.baseline_bytes > cache.limit_bytes}),
        "prefill_shared": shared is not None,
        "layer_kinds": cache.layer_kinds(),
    }


# the record's memory peak columns: PeakMemory's peak attribute, whose baseline is the same name with `baseline`
MEMORY_PEAKS = {"mem_peak_alloc": "peak_bytes", "mem_peak_reserved": "peak_reserved", "mem_peak_device": "peak_device"}


def _peak(memories: list[PeakMemory], name: str) -> int | None:
    values = [getattr(memory, name) for memory in memories if getattr(memory, name) is not None]
    return max(values) if values else None


def _own_peak(peak: int | None, started: PeakMemory, before: PeakMemory, name: str) -> int | None:
    """`peak` without what the shared prefill added: the cell's growth since `started` on top of the baseline
    `before` the shared forward."""
    baseline = name.replace("peak", "baseline")
    if peak is None or getattr(started, baseline, None) is None or getattr(before, baseline, None) is None:
        return None
    return getattr(before, baseline) + peak - getattr(started, baseline)


def compression_key(policy: Policy, budget: int | None, threshold: Threshold | None = None) -> str:
    """What a shared prompt's compression depends on besides the prompt: cells with one key compress it alike."""
    return json.dumps([policy.describe(), budget, *([threshold.describe()] if threshold else [])], sort_keys=True,
                      default=str)


# --- what most tasks need: one prompt, one answer ------------------------------------------------

@dataclass
class Generation:
    """What a task's run returns: the text, its tokens, the final logits, and the measurements."""

    prediction: str
    tokens: list[int]
    last_logits: torch.Tensor | None
    measurements: dict[str, Any]
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # a task's own outputs (see Task.outcome)


@dataclass(frozen=True)
class Prompt:
    """One row of a batch: its context and question token ids (the question appended after compression with
    `question: agnostic`), and how its answer ends."""

    context: list[int]
    question: list[int]
    max_new_tokens: int
    stop: tuple[str, ...] = ()


def generate(lm: LoadedModel, policy: Policy, context_ids: list[int], question_ids: list[int],
             settings: RunSettings, max_new_tokens: int, stop: tuple[str, ...] = (),
             eos_token_ids: set[int] | None = None, shared: SharedPrefill | None = None) -> Generation:
    """Prefill (or adopt `shared`, a prefill of the same prompt in `full` mode), compress, decode greedily."""
    return generate_rows(lm, policy, [Prompt(context_ids, question_ids, max_new_tokens, stop)], settings,
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
    fed = [p.context if agnostic else p.context + p.question for p in prompts]
    ids, padding = (fed[0], None) if single else left_padded(lm, fed)

    def session_of(policy: Policy, observers: list[Policy] | None = None) -> Session:
        return Session(lm, policy, settings, prompt_tokens=[len(p.context) + len(p.question) for p in prompts],
                       arrival=[len(p.question) if agnostic else 1 for p in prompts], observers=observers,
                       growth=[p.max_new_tokens + (len(p.question) if agnostic else 0) for p in prompts],
                       left_padding=padding)

    def prefill(session: Session) -> None:
        session.prefill(ids, shared=shared)
        if agnostic and prompts[0].question:
            session.append(prompts[0].question if single else torch.tensor([p.question for p in prompts]))

    follower, observers = None, None
    if settings.fidelity:  # the full-cache reference, fed the same prompt (free with a shared prefill)
        if not single:
            raise ValueError("fidelity follows one prompt at a time")
        from kvbench.fidelity import AttentionRecorder, Follower
        from kvbench.policies.full import Full

        full_attention, kept = AttentionRecorder("full"), AttentionRecorder("policy")
        reference = session_of(Full(), [full_attention])
        prefill(reference)
        follower, observers = Follower(reference, full_attention, kept), [policy, kept]
    session = session_of(policy, observers)
    with session:
        prefill(session)
        answers = session.decode([p.max_new_tokens for p in prompts], eos, [p.stop for p in prompts],
                                 follow=follower)
    generations = []
    for row, (prompt, tokens) in enumerate(zip(prompts, answers, strict=True)):
        tokens = tokens[:-1] if tokens[-1] in eos else tokens
        text = lm.tokenizer.decode(tokens, skip_special_tokens=True)
        if single:
            measured = {**session.measurements(), **(follower.measurements() if follower else {})}
            logits = session.logits
        else:
            measured, logits = session.measurements(row), session.row_logits(row)[None]
        generations.append(Generation(_cut(text, prompt.stop), tokens, logits, measured))
    return generations


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
    session = Session(lm, policy, settings, prompt_tokens=ids.shape[1], growth=max_new_tokens, left_padding=padding)
    with session:
        session.prefill(ids)
        rows = session.decode(max_new_tokens, eos)
    rows = [row[:-1] if row[-1] in eos else row for row in rows]
    return rows, {**session.measurements(), "batch": len(prompts)}


def shared_prefill(lm: LoadedModel, ids: list[int] | list[list[int]], observers: list[Policy],
                   settings: list[RunSettings] | None = None) -> SharedPrefill:
    """The prompt's forward once (or a batch's prompts, left-padded into one forward), gathering every
    `observers` policy's statistics, for cells to adopt. `settings`, paired with `observers`, are those of the
    cells that will adopt it: the ones that compress it alike then compress it once."""
    from kvbench.policies.full import Full

    prompts = [row for row in ids if isinstance(row, list)] or [ids]
    batch = left_padded(lm, prompts) if len(prompts) > 1 else None
    session = Session(lm, Full(), RunSettings(), prompt_tokens=[len(p) for p in prompts], growth=0,
                      observers=observers, left_padding=None if batch is None else batch[1])
    with session:
        session.prefill(ids if batch is None else batch[0])
    wanted = wanted_compressions(list(zip(observers, settings or [], strict=False)), len(prompts[0]))
    return SharedPrefill(session.cache, session.logits, session.prefill_s, session.memory, wanted)


def wanted_compressions(users: Sequence[tuple[Policy, RunSettings]], prompt_tokens: int) -> Counter[str]:
    """How many of the cells that adopt a shared prefill (each its policy and settings) compress it each way: the
    first of those that compress alike keeps its result for the others to copy."""
    wanted: Counter[str] = Counter()
    for policy, setting in users:
        with contextlib.suppress(KvbenchError):  # a cell that cannot run this budget fails on its own
            wanted[compression_key(policy, policy_budget(policy, setting, prompt_tokens, chunked=False),
                                   threshold_of(setting))] += 1
    return wanted


def _cut(text: str, stop: tuple[str, ...]) -> str:
    text = text.strip()
    for s in stop:
        text = text.split(s, 1)[0]
    return text.strip()
