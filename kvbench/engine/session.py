"""The engine session: one cache under one policy and budget, and the few calls every task makes of it.

    session = Session(lm, policy, settings, prompt_tokens=len(prompt), adds=max_new_tokens)
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

import copy
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar, cast

import torch
from transformers.cache_utils import Cache

from kvbench.engine.cache import CacheSettings, KVCache, Phase
from kvbench.engine.instruments import PeakMemory, Stopwatch
from kvbench.engine.joint import JointCache
from kvbench.engine.measurements import cache_measurements, timings
from kvbench.engine.row_accounts import RowAccounts
from kvbench.engine.segments import Segment
from kvbench.engine.settings import RunSettings, compression_plan, headroom, threshold_of

if TYPE_CHECKING:
    from kvbench.engine.accounting import CacheStats
    from kvbench.engine.models import LoadedModel
    from kvbench.engine.sharing import SharedPrefill
    from kvbench.policies.base import Policy

T = TypeVar("T")


class Scored(NamedTuple):
    """What `Session.score` returns, one entry per scored token."""

    logprobs: torch.Tensor  # float32 log-probability of each token
    greedy: torch.Tensor  # bool: the token was the most likely one


class Session:
    """A cache under `policy` at the settings' budget (resolved against `prompt_tokens`), fed through `lm`.

    What the caller will feed after the prompt: at most `arrival` tokens at once (a question, a user turn, a
    scored chunk), and `adds` tokens in all, fed and generated (None: it cannot tell, as a stream or a
    conversation cannot). The session sizes the buffers from them: between two evictions a layer may receive a
    prefill chunk, `evict_every` decode tokens or an arrival, so it has room for that beyond the budget; a cache
    that stops evicting grows by `adds` slots at once (by max(arrival, 256) at a time without it). `chunked` says
    whether the prompt is compressed more than once (default: the settings' prefill mode); `observers` gathers the
    statistics of other policies too (a shared prefill); `left_padding` `[batch]` makes it a left-padded batch.
    `segments` are the prompt's units a task names (segments.py: few-shot examples, a system prompt's rules),
    for a policy that keeps them whole; one row's.

    A batch gives `prompt_tokens`, `arrival` and `adds` per row (or one for all): every row evicts as its own
    cache would (kvbench/engine/row_accounts.py keeps each row's accounts), so the rows must share one resolved budget
    (`compression_plan`).
    """

    def __init__(self, lm: LoadedModel, policy: Policy, settings: RunSettings, prompt_tokens: int | Sequence[int],
                 *, arrival: int | Sequence[int] = 1, adds: int | Sequence[int] | None = None,
                 chunked: bool | None = None, growth: int | Sequence[int] | None = None,
                 observers: list[Policy] | None = None, left_padding: torch.Tensor | None = None,
                 segments: Sequence[Segment] = ()) -> None:
        self.lm, self.policy, self.settings = lm, policy, settings
        self.segments = tuple(segments)
        self.rows = 1 if left_padding is None else len(left_padding)
        prompts, arrivals = _per_row(prompt_tokens, self.rows), _per_row(arrival, self.rows)
        if growth is not None:
            warnings.warn("Session(growth=) is deprecated and goes in the next release: say what you will feed "
                          "after the prompt with `adds=`, and the session sizes the buffers", DeprecationWarning,
                          stacklevel=2)
        # a cache that stops evicting grows by what the row adds at once, or a step at a time when it cannot tell
        growths = [max(a, 256) if later is None else later
                   for a, later in zip(arrivals, _per_row(adds if growth is None else growth, self.rows), strict=True)]
        chunked = settings.prefill == "chunked" if chunked is None else chunked
        plans = {compression_plan(policy, settings, tokens, chunked, lm.num_layers) for tokens in prompts}
        if len(plans) > 1:
            raise ValueError(f"the rows of a batch must share one budget and its layer budgets, got {sorted(plans)}")
        self.budget = plans.pop()[0]
        policy.prepare(lm)
        evict_every = policy.schedule.every or settings.evict_every  # R-KV's buffer is its own
        headrooms = [headroom(policy, settings, a) for a in arrivals]
        padded = left_padding is not None and int(left_padding.max()) > 0
        # a batch keeps each row's accounts; compressed storage batches only rows that hold alike (`row_stats`)
        accounts = None if left_padding is None or policy.layout() is not None else \
            RowAccounts(lm.num_layers, lm.kv_heads, left_padding.tolist(), growths, headrooms)
        # a sparse policy's budget bounds what each decode step reads, not what the cache keeps
        sparse = policy.schedule.when == "read"
        sizing = CacheSettings(budget=None if sparse else self.budget, read_budget=self.budget if sparse else None,
                               threshold=None if self.budget is None else threshold_of(settings),
                               evict_every=evict_every, headroom=max(headrooms), growth=max(growths),
                               limit_bytes=settings.kv_limit_bytes, prompt_tokens=prompts[0])
        self.cache = KVCache(lm.num_layers, (self.rows, lm.kv_heads, lm.head_dim), policy, sizing,
                             observers=observers, left_padding=left_padding if padded else None, model=lm.internals,
                             kinds=lm.layer_kinds, rows=accounts)
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

    def __exit__(self, *exc: object) -> None:
        assert self.memory is not None, "exited a `with session:` block it did not enter"
        self.memory.__exit__(*exc)

    @property
    def seen(self) -> int:
        """Tokens fed so far (a pending generated token not included)."""
        return self.cache.layers[0].seen

    def measurements(self, row: int | None = None) -> dict[str, Any]:
        """The record's speed, byte and memory columns (after the `with` block). In a batch, `row`'s: its own
        tokens and its cache as its own cache would hold it when its answer ended (row_accounts.py), beside what
        the batch measured together (`ttft_s` and `tpot_s`: what every row waited; `prefill_tok_s` and
        `decode_tok_s`: the batch's throughput; the memory peaks: the batch's). Without `row`, the whole batch."""
        if self.memory is None:
            raise RuntimeError("measurements() needs the session to have run inside `with session:`")
        self.cache.leave_static()  # the records read the dynamic layout
        schedule = self.policy.schedule
        # before any decode step, a decode-time budget has bounded the prompt only, and a sparse one nothing
        scope = schedule.when if self.decoded else ("prefill" if schedule.evicts else "none")
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
        whole cache's). Its rows run alone (`batching._alone`), so the cache is the sample's."""
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
        for _ in self.prefill_chunks(ids, shared):
            pass

    @torch.inference_mode()
    def prefill_chunks(self, ids: list[int] | torch.Tensor, shared: SharedPrefill | None = None) -> Iterator[None]:
        """`prefill`, pausing after each chunk but the last of a `chunked` prefill (a `full` one never pauses), so
        that a service decodes other requests between the chunks (kvbench/serving/); the prompt is compressed as
        `prefill` compresses it, and only the chunks' own time counts as prefill time."""
        ids = self._inputs(ids)
        self._enter(Phase.PREFILL)
        clock = Stopwatch(self.lm.devices)
        shared_s = 0.0  # counted beyond this call's clock: its share of a shared forward (kvbench/engine/sharing.py)
        self._count_fed(ids.shape[1])
        if shared is not None:
            self.logits, self.shared = shared.logits, shared
            self.policy, self.cache, shared_s = shared.compress_for(self, ids, clock)
        else:
            chunk = self.settings.prefill_chunk if self.settings.prefill == "chunked" else ids.shape[1]
            for start in range(0, ids.shape[1], chunk):
                self.logits = self._forward(ids[:, start : start + chunk])[:, -1]
                if start + chunk >= ids.shape[1]:
                    self.policy.after_prompt(self, ids)
                self._compress()
                if start + chunk < ids.shape[1]:
                    self.prefill_s += clock.lap()
                    yield
                    clock = Stopwatch(self.lm.devices)
        self.cache.store_prompt()
        self._enter(Phase.DECODE)
        self.prefill_s += clock.lap() + shared_s
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
        clock = Stopwatch(self.lm.devices)
        self._enter(Phase.DECODE)
        if self.cache.prepare_step(compiled=self.lm.compile):
            logits = (compiled_step(self.lm.device) if self.lm.compile else static_step)(self.lm, self.cache, ids)
            if self.lm.compile and self.lm.device.type == "cuda":
                logits = logits.clone()  # a CUDA graph's output is overwritten by its next replay
            self.cache.account_step(compiled=self.lm.compile)
            self.logits = logits
        else:
            logits = self._forward(ids)[:, -1]
            self.end_step(logits)
        self.step_s.append(clock.lap())
        return logits

    def enter_decode(self) -> None:
        """From here on, what is fed is decoded (a decode-time policy evicts as tokens arrive)."""
        self._enter(Phase.DECODE)

    def begin_step(self) -> None:
        """Before a decode step's forward (this session's own, or a joint step of several: kvbench/engine/joint.py)."""
        self._enter(Phase.DECODE)
        if self.cache.prepare_step():  # a joint step runs eager (kvbench/engine/joint.py)
            self.cache.open_step()

    def end_step(self, logits: torch.Tensor) -> None:
        """After a decode step's forward: its prediction `[rows, vocab]`, and a decode-time policy's eviction."""
        self.logits = logits
        if self.cache.static:
            self.cache.close_step()
            self.cache.account_step()
        else:
            self._compress()

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
        one = not stop or isinstance(stop[0], str)  # one tuple of stop strings for every row, or one per row
        stops = cast("list[tuple[str, ...]]", [stop] * self.rows if one else list(stop))
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
        if self.cache.phase is Phase.PREFILL or self.policy.schedule.decodes:
            self.cache.compress()

    def _forward(self, ids: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """Feed `ids` `[rows, n]` after what the cache has seen; the logits `[rows, n, vocab]` of every
        position with `all_logits`, else of the last one only (`[rows, 1, vocab]`)."""
        self.cache.leave_static()
        cache, lm, seen = self.cache, self.lm, self.seen
        positions = torch.arange(seen, seen + ids.shape[1], device=lm.device)[None]
        if cache.left_padding is not None:  # each row counts from its first real token; padding sits at 0
            positions = (positions - cache.left_padding.to(lm.device)[:, None]).clamp(min=0)
        return forward(lm, cache, ids, positions, cache.layers[0].length, all_logits)

    def _end_answers(self, rows: list[list[int]], going: list[bool], limits: list[int], eos: set[int],
                     stops: list[tuple[str, ...]]) -> None:
        """Mark the rows whose answer just ended (their last token); a batch keeps what each one's record reads."""
        for index, row in enumerate(rows):
            if going[index] and (row[-1] in eos or len(row) >= limits[index] or stopped(self.lm, row, stops[index])):
                going[index] = False
                if self.rows > 1:
                    assert self.logits is not None
                    self.finished[index] = (self.cache.row_stats(index), self.logits[index].clone())

    def _count_fed(self, new: int) -> None:
        """Count `new` tokens about to be fed as each row's own (its left padding is not)."""
        seen = self.seen
        self.row_tokens_fed = [fed + max(0, seen + new - pad) - max(0, seen - pad)
                               for fed, pad in zip(self.row_tokens_fed, self.cache.row_padding, strict=True)]


def static_step(lm: LoadedModel, cache: KVCache, ids: torch.Tensor) -> torch.Tensor:
    """A decode step on static buffers (kvbench/engine/step.py): its device work only, the same work every step,
    which is what `--compile` compiles to one graph. The ids `[rows, 1]` in, the next token's logits `[rows, vocab]`
    out."""
    cache.open_step()
    assert cache.position is not None
    logits = forward(lm, cache, ids, cache.position[:, :, 0], cache.layers[0].length)[:, -1]
    cache.close_step()
    return logits


_COMPILED: dict[str, Callable[[LoadedModel, KVCache, torch.Tensor], torch.Tensor]] = {}


def compiled_step(device: torch.device) -> Callable[[LoadedModel, KVCache, torch.Tensor], torch.Tensor]:
    """`static_step` compiled whole (`fullgraph`), once per process and device type: a session of another model
    or shape adds a graph, not a compiler. On CUDA the graph replays as CUDA graphs (`reduce-overhead`)."""
    if device.type not in _COMPILED:
        # one graph per policy, budget and context a process runs (a sweep's cells): never fall back to eager
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 1024)
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                              4096)
        mode = "reduce-overhead" if device.type == "cuda" else None
        _COMPILED[device.type] = torch.compile(static_step, fullgraph=True, dynamic=False, mode=mode)
    return _COMPILED[device.type]


def forward(lm: LoadedModel, cache: Cache, ids: torch.Tensor, positions: torch.Tensor, length: int,
            all_logits: bool = False) -> torch.Tensor:
    """The model's forward of `ids` `[rows, n]` at `positions` `[rows, n]` into `cache` (the kvbench attention
    reads it as `kv_observer`), `length` slots already held; logits as `Session._forward` returns them."""
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


@torch.inference_mode()
def step_together(sessions: list[Session], tokens: list[int]) -> torch.Tensor:
    """Feed each single-row session its next token in one forward; each then evicts as its policy says and
    counts the step's time as its own decode step. Returns the next tokens' logits `[rows, vocab]`."""
    lm = sessions[0].lm
    joint = JointCache([session.cache for session in sessions])
    ids = torch.tensor(tokens, device=lm.device)[:, None]
    positions = torch.tensor([session.seen for session in sessions], device=lm.device)[:, None]
    for session in sessions:
        session.begin_step()
    clock = Stopwatch(lm.devices)
    logits = forward(lm, joint, ids, positions, joint.get_seq_length())[:, -1]
    for row, session in enumerate(sessions):
        session.end_step(logits[row : row + 1])
    seconds = clock.lap()
    for session in sessions:
        session.step_s.append(seconds)
    return logits


def stopped(lm: LoadedModel, tokens: list[int], stop: tuple[str, ...]) -> bool:
    """Whether the text of `tokens` so far holds one of the `stop` strings (an answer ends there)."""
    if not stop:
        return False
    text = cast(str, lm.tokenizer.decode(tokens, skip_special_tokens=True))  # one sequence: one text
    return any(s in text.lstrip() for s in stop)


def _per_row(value: T | Sequence[T], rows: int) -> list[T]:
    """One value for each of `rows` rows: given per row, or one for all."""
    if not isinstance(value, Sequence):
        return [value] * rows
    if len(value) != rows:
        raise ValueError(f"{len(value)} values for {rows} rows")
    return list(value)
