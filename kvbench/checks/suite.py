"""`kvbench check`: kvbench proves itself on the user's own model, dtype, attention kernel and device.

Each check is one line, passed, failed or skipped (what it cannot check here, and why), with its numbers:
  generate   `full` decodes `model.generate`'s greedy tokens, logits within a stated tolerance (short, long prompt)
  window     a window covering the whole sequence equals `full`
  layers     sliding-window layers hold exactly what the model's own cache holds (window - 1 entries)
  policy     each policy keeps what its plain-loop reference (policies/reference.py) keeps, short and long prompt
  dtype      attention statistics in the model's dtype keep what they keep in float32
  memory     the counted cache bytes are the bytes of its tensors; on a GPU the allocator's peak covers them, NVML's
             device peak covers the allocator's, a cap below the weights is refused, an out-of-memory under a cap
             is caught and its memory released; the NVML sampler's rate and its cost on a decode step
  compiled   a decode step compiled whole (`--compile`: torch.compile, CUDA graphs on a GPU) decodes what the eager
             one decodes, under a policy evicting at every step
  timing     a decode step of `full` within `TIMING_LIMIT` of `model.generate`'s
The report (`--json`, `--json-out`) carries versions, device (name, UUID, MIG slice), dtype and kernel with every
number. `--no-timing` reports `timing` skipped: a speed verdict is only fair on cores no other work shares.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch

from kvbench.checks.generations import compare_generations, kvbench_generate, logit_limit, stock_generate
from kvbench.checks.kept import TIE_TOLERANCE, agreement, kept_channels, kept_history, kept_masks
from kvbench.engine.instruments import Stopwatch, memory_pressure, open_nvml, tracing
from kvbench.engine.models import LoadedModel
from kvbench.engine.session import Session
from kvbench.engine.settings import RunSettings
from kvbench.errors import KvbenchError
from kvbench.policies import POLICIES, build_policy
from kvbench.policies.base import Demand

# parity, tests and plugins import the kept sets' and the generations' names from here too
__all__ = [
    "BUDGET_RATIO", "Check", "CheckSettings", "DTYPE_AGREEMENT_MEAN", "NVML_RATE_HZ", "RELEASE_SLACK", "Status",
    "TIE_TOLERANCE", "TIMING_LIMIT", "agreement", "check_cap_below_weights", "check_compiled", "check_cpu_limit",
    "check_dtype",
    "check_generate", "check_layers", "check_memory", "check_oom_released", "check_policy", "check_sampler",
    "check_timing", "check_window", "checkable", "compare_generations", "default_context", "device_facts",
    "judge_allocator", "judge_counted", "judge_nvml", "kept_channels", "kept_history", "kept_masks",
    "kvbench_generate", "logit_limit", "prompt_tokens", "reference_kernel", "report_dict", "run_checks",
    "stock_generate",
]

Status = Literal["pass", "fail", "skip"]
# kept sets against the reference (Jaccard index over layers x KV heads): ties broken otherwise and summation order
# may move an entry at the margin, a wrong rule moves many
AGREEMENT_MEAN, AGREEMENT_WORST = 0.99, 0.90
DTYPE_AGREEMENT_MEAN = 0.90  # the model's dtype against float32: its rounding moves entries at the margin
TIMING_LIMIT = 1.5  # kvbench's decode step over model.generate's, medians of interleaved runs
BUDGET_RATIO = 0.25
NVML_RATE_HZ = 100.0
# what an out-of-memory may leave allocated (the allocator's rounding, a cached rotary table)
RELEASE_SLACK = 256 * 2**20


def checkable() -> tuple[str, ...]:
    """The policies checked by default, and every one `--policies` may name: those whose class itself defines its
    plain-loop `reference`, built-in or plugin (a subclass is another policy: pyramidkv's is not snapkv's)."""
    return tuple(name for name in POLICIES.names() if "reference" in vars(POLICIES.get(name)))


@dataclass
class Check:
    name: str
    status: Status
    detail: str
    numbers: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckSettings:
    short: int = 256  # tokens of the short prompt
    long: int = 1024  # tokens of the long prompt (`--context`)
    new_tokens: int = 16
    decode_steps: int = 8  # decode tokens a decode-time policy evicts through against its reference
    policies: tuple[str, ...] = field(default_factory=checkable)
    attention: str = "sdpa"  # model.generate's attention implementation, kvbench's reference (`reference_kernel`)
    timing: bool = True  # judge decode speed; off where other work shares the cores, which slows kvbench unevenly

    def __post_init__(self) -> None:
        known = checkable()
        unknown = [name for name in self.policies if name not in known]
        if unknown:
            raise KvbenchError(f"--policies: no reference for {', '.join(unknown)} (checkable: {', '.join(known)})")
        if not 16 <= self.short <= self.long:
            raise KvbenchError(f"--context {self.long} must be at least the short prompt's {self.short} tokens")


def reference_kernel(lm: LoadedModel, asked: str) -> str:
    """The attention implementation `model.generate` runs with: `auto` is SDPA, or eager where the logits are
    soft-capped (SDPA cannot cap them; transformers refuses it there)."""
    if asked != "auto":
        return asked
    return "eager" if any(kind.softcap is not None for kind in lm.layer_kinds) else "sdpa"


def default_context(device: torch.device) -> int:
    """The long prompt: a few minutes on an 8B model on one GPU, seconds on the embedded model on 2 CPU cores."""
    return 16384 if device.type == "cuda" else 1024


def run_checks(lm: LoadedModel, settings: CheckSettings, report: Callable[[Check], None]) -> list[Check]:
    """Every check on `lm`, each passed to `report` as it finishes."""
    checks: list[Check] = []
    tokens = prompt_tokens(lm, settings.long + settings.new_tokens + settings.decode_steps)
    prompts = {"short": tokens[: settings.short], "long": tokens[: settings.long]}
    decode = tokens[settings.long : settings.long + settings.decode_steps]
    for check in _all_checks(lm, settings, prompts, decode):
        checks.append(check)
        report(check)
    return checks


def _all_checks(lm: LoadedModel, settings: CheckSettings, prompts: dict[str, list[int]],
                decode: list[int]) -> Iterator[Check]:
    for label, prompt in prompts.items():
        yield check_generate(lm, prompt, settings, label)
    yield check_window(lm, prompts["long"], settings)
    yield check_layers(lm, prompts["long"])
    for name in settings.policies:
        for label, prompt in prompts.items():
            yield check_policy(lm, name, prompt, decode, label)
    yield check_dtype(lm, prompts["long"], decode)
    yield check_compiled(lm, prompts["short"], settings)
    yield from check_memory(lm, prompts["long"], prompts["short"])
    yield check_timing(lm, prompts["short"], settings)


def prompt_tokens(lm: LoadedModel, count: int) -> list[int]:
    """`count` tokens of the embedded corpus (repeated if short), after the model's start token if it has one."""
    from kvbench.tasks.corpus import haystack_text, load_corpus

    bos = [lm.tokenizer.bos_token_id] if lm.tokenizer.bos_token_id is not None else []
    text, _ = haystack_text(lm.tokenizer, load_corpus("embedded"), count)
    return (bos + lm.tokenizer(text, add_special_tokens=False).input_ids)[:count]


# --- full against model.generate ---------------------------------------------------------------

def check_generate(lm: LoadedModel, prompt: list[int], settings: CheckSettings, label: str) -> Check:
    expected = stock_generate(lm, prompt, settings.new_tokens, settings.attention)
    tokens, logits, _ = kvbench_generate(lm, "full", prompt, settings.new_tokens)
    passed, text, numbers = compare_generations(expected, (tokens, logits), logit_limit(lm))
    return Check(f"generate.{label}", _status(passed),
                 f"full against model.generate ({settings.attention}), {len(prompt)} tokens: {text}",
                 {"prompt_tokens": len(prompt), **numbers})


def check_window(lm: LoadedModel, prompt: list[int], settings: CheckSettings) -> Check:
    budget = len(prompt) + settings.new_tokens + 1
    full_tokens, full_logits, _ = kvbench_generate(lm, "full", prompt, settings.new_tokens)
    tokens, logits, session = kvbench_generate(lm, "window", prompt, settings.new_tokens, budget)
    passed, text, numbers = compare_generations((full_tokens, full_logits), (tokens, logits), logit_limit(lm))
    evictions = session.cache.stats().evictions
    passed &= evictions == 0
    return Check("window", _status(passed), f"window of {budget} over a {len(prompt)}-token prompt against full: "
                 f"{text}; {evictions} evictions", {**numbers, "evictions": evictions})


def check_compiled(lm: LoadedModel, prompt: list[int], settings: CheckSettings) -> Check:
    """H2O, evicting at every decode step, eager and compiled: the same tokens, logits within the model's rounding
    (the compiler orders sums its own way)."""
    budget = max(1, round(BUDGET_RATIO * len(prompt)))
    eager = kvbench_generate(lm, "h2o", prompt, settings.new_tokens, budget, until_eos=False)
    started, compiled_before = time.perf_counter(), lm.compile
    lm.compile = True
    try:
        compiled = kvbench_generate(lm, "h2o", prompt, settings.new_tokens, budget, until_eos=False)
    finally:
        lm.compile = compiled_before
    seconds = time.perf_counter() - started
    passed, text, numbers = compare_generations(eager[:2], compiled[:2], logit_limit(lm))
    return Check("compiled", _status(passed), f"h2o at {budget} of {len(prompt)} tokens compiled against eager: {text} "
                 f"(compiling and running took {seconds:.0f} s)", {**numbers, "seconds": seconds})


def check_layers(lm: LoadedModel, prompt: list[int]) -> Check:
    """Sliding layers physically hold `window - 1` entries after a prompt longer than the window, as the model's own
    cache does (the generate check proves the attention over them); soft-capped logits are noted."""
    kinds = lm.layer_kinds
    windows = sorted({kind.window for kind in kinds if kind.window is not None})
    softcap = next((kind.softcap for kind in kinds if kind.softcap is not None), None)
    shape = (f"{len(kinds)} layers: {sum(k.window is not None for k in kinds)} sliding (window "
             f"{', '.join(map(str, windows))}), {sum(k.window is None for k in kinds)} full") if windows else \
        f"{len(kinds)} full-attention layers"
    shape += f", logits soft-capped at {softcap:g}" if softcap is not None else ""
    if not windows:
        return Check("layers", "skip", f"{shape}: no sliding layers to check", {"layers": len(kinds)})
    if len(prompt) <= max(windows):
        return Check("layers", "skip", f"{shape}: the {len(prompt)}-token prompt does not pass the window "
                     f"(raise --context)", {"layers": len(kinds)})
    session = Session(lm, build_policy("full"), RunSettings(), prompt_tokens=len(prompt), adds=0)
    with session:
        session.prefill(prompt)
    held = [int(layer.live_positions().shape[-1]) for layer in session.cache.layers]
    wrong = [f"layer {i} holds {n}" for i, (n, kind) in enumerate(zip(held, kinds, strict=True))
             if n != (len(prompt) if kind.window is None else kind.window - 1)]
    detail = f"{shape}; after {len(prompt)} tokens the sliding layers hold window - 1 entries, the full ones all"
    return Check("layers", _status(not wrong), detail + (f": {'; '.join(wrong[:3])}" if wrong else ""),
                 {"held": held, "windows": windows, "softcap": softcap})


# --- policies against their references -----------------------------------------------------------

def check_policy(lm: LoadedModel, name: str, prompt: list[int], decode: list[int], label: str) -> Check:
    budget, policy = max(1, round(BUDGET_RATIO * len(prompt))), build_policy(name)
    try:
        policy.check(Demand(budget=budget))
    except KvbenchError as exc:
        return Check(f"policy.{name}.{label}", "skip", f"{name} at {budget} of {len(prompt)} tokens: {exc}")
    steps = decode if policy.schedule.decodes else []
    try:
        ours, policy = kept_history(lm, name, prompt, steps, budget)
    except KvbenchError as exc:  # it cannot run on this model as it is (qfilter before its calibration)
        return Check(f"policy.{name}.{label}", "skip", f"{name}: {exc}")
    theirs, scores = policy.reference(lm, prompt, steps, budget)
    mean, worst = agreement(ours if scores is None else ours[:1], theirs, scores)
    passed = mean >= AGREEMENT_MEAN and worst >= AGREEMENT_WORST
    return Check(f"policy.{name}.{label}", _status(passed),
                 f"{name} against its reference at {budget} of {len(prompt)} tokens"
                 f"{f' and {len(steps)} decode steps' if steps else ''}: kept sets agree {mean:.4f} on average, "
                 f"{worst:.4f} at worst (limits {AGREEMENT_MEAN}, {AGREEMENT_WORST})",
                 {"budget": budget, "prompt_tokens": len(prompt), "decode_steps": len(steps), "mean": mean,
                  "worst": worst})


def check_dtype(lm: LoadedModel, prompt: list[int], decode: list[int]) -> Check:
    """SnapKV and H2O in the model's dtype against the same model in float32 (upcast in place and back: a 16-bit
    weight survives the round trip exactly)."""
    if lm.dtype == torch.float32:
        return Check("dtype", "skip", "the model runs in float32 (pass --dtype bfloat16 to check half precision)")
    budget = max(1, round(BUDGET_RATIO * len(prompt)))
    compared = {"snapkv": [], "h2o": decode}  # a prompt-time and a decode-time policy
    results = {name: kept_history(lm, name, prompt, steps, budget)[0] for name, steps in compared.items()}
    lm.model.float()
    try:
        upcast = {name: kept_history(lm, name, prompt, steps, budget)[0] for name, steps in compared.items()}
    finally:
        cast(Any, lm.model).to(lm.dtype)
    means = {name: agreement(results[name], upcast[name]) for name in results}
    passed = all(mean >= DTYPE_AGREEMENT_MEAN for mean, _ in means.values())
    dtype = str(lm.dtype).removeprefix("torch.")
    text = "; ".join(f"{name} {mean:.4f} (worst {worst:.4f})" for name, (mean, worst) in means.items())
    return Check("dtype", _status(passed), f"kept sets in {dtype} against float32 at {budget} of {len(prompt)} "
                 f"tokens: {text} (limit {DTYPE_AGREEMENT_MEAN} on average)",
                 {name: {"mean": m, "worst": w} for name, (m, w) in means.items()})


# --- memory ----------------------------------------------------------------------------------------

def check_memory(lm: LoadedModel, prompt: list[int], short: list[int]) -> Iterator[Check]:
    """The memory checks, at the long `prompt` (the sampler's cost at the `short` one: it decodes many times)."""
    record, storage = _measured_full(lm, prompt)
    yield judge_counted(record, storage)
    if lm.device.type != "cuda":
        note = "on CPU kvbench records the process's resident memory, not an allocator's"
        yield Check("memory.allocator", "skip", f"no GPU: {note}")
        yield Check("memory.nvml", "skip", "no GPU")
        yield check_cpu_limit(lm, prompt, record["kv_bytes_peak"])
        return
    yield judge_allocator(record)
    yield judge_nvml(record)
    yield check_cap_below_weights(lm, prompt)
    yield check_oom_released(lm)
    yield check_sampler(lm, short)


def _measured_full(lm: LoadedModel, prompt: list[int]) -> tuple[dict[str, Any], int]:
    """A `full` session's record after a prompt and a few tokens, and the bytes its cache's tensors hold."""
    session = Session(lm, build_policy("full"), RunSettings(), prompt_tokens=len(prompt), adds=4)
    with session:
        session.prefill(prompt)
        session.decode(4, set())
    storage = sum(int(tensor.untyped_storage().nbytes()) for layer in session.cache.layers
                  for tensor in (layer.keys, layer.values) if tensor is not None)
    return session.measurements(), storage


def judge_counted(record: dict[str, Any], storage: int) -> Check:
    counted = record["kv_bytes_physical"]
    return Check("memory.counted", _status(counted == storage),
                 f"the cache bytes kvbench counts ({_gib(counted)}) are its tensors' ({_gib(storage)})",
                 {"counted": counted, "storage": storage})


def judge_allocator(record: dict[str, Any]) -> Check:
    grown = record["mem_peak_alloc"] - record["mem_baseline"]
    return Check("memory.allocator", _status(grown >= record["kv_bytes_peak"]),
                 f"the allocator's peak grew {_gib(grown)} over the sample, at least the cache's "
                 f"{_gib(record['kv_bytes_peak'])}", {"grown": grown, "kv_bytes_peak": record["kv_bytes_peak"]})


def judge_nvml(record: dict[str, Any]) -> Check:
    device, alloc = record.get("mem_peak_device"), record["mem_peak_alloc"]
    if device is None:
        return Check("memory.nvml", "fail", f"no NVML device peak: {record.get('mem_device_note')}")
    return Check("memory.nvml", _status(device >= alloc > 0),
                 f"NVML's device peak {_gib(device)} is at least the allocator's {_gib(alloc)}",
                 {"device": device, "allocator": alloc})


def check_cpu_limit(lm: LoadedModel, prompt: list[int], full_bytes: int) -> Check:
    """On CPU the memory condition caps the KV cache: a cap of half the full cache must stop `full`."""
    try:
        session = Session(lm, build_policy("full"), RunSettings(kv_limit_bytes=full_bytes // 2),
                          prompt_tokens=len(prompt), adds=0)
        with session:
            session.prefill(prompt)
    except torch.OutOfMemoryError as exc:
        return Check("memory.cap", "pass", f"a KV cap of half the full cache stops full: {str(exc).splitlines()[0]}")
    return Check("memory.cap", "fail", f"full ran under a KV cap of {_gib(full_bytes // 2)}, half its cache")


def check_cap_below_weights(lm: LoadedModel, prompt: list[int]) -> Check:
    weights = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    try:
        with memory_pressure(lm.devices, limit_bytes=weights // 2):
            kvbench_generate(lm, "full", prompt, 1)
    except torch.OutOfMemoryError:
        return Check("memory.cap", "pass", f"a cap of {_gib(weights // 2)}, half the weights, is refused (out of "
                     f"memory at the first allocation)", {"cap": weights // 2, "weights": weights})
    return Check("memory.cap", "fail", f"full ran under a cap of {_gib(weights // 2)}, below its weights "
                 f"({_gib(weights)}): the cap was not applied", {"cap": weights // 2, "weights": weights})


def check_oom_released(lm: LoadedModel, tokens: int = 131072, headroom: int = 64 * 2**20) -> Check:
    """A prompt that cannot fit under a cap a little above what is held: the error comes, and its memory goes."""
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(lm.device)
    cap = torch.cuda.memory_reserved(lm.device) + headroom
    message = None
    with memory_pressure(lm.devices, limit_bytes=cap):
        try:
            kvbench_generate(lm, "full", [i % 256 for i in range(tokens)], 1)
        except torch.OutOfMemoryError as exc:
            message = str(exc).splitlines()[0][:160]
    after = torch.cuda.memory_allocated(lm.device)
    numbers = {"cap": cap, "allocated_before": before, "allocated_after": after, "message": message}
    if message is None:
        return Check("memory.oom", "fail", f"{tokens} tokens ran under a cap of {_gib(cap)}: no out-of-memory",
                     numbers)
    released = after - before <= RELEASE_SLACK
    return Check("memory.oom", _status(released), f"{tokens} tokens under a cap of {_gib(cap)}: out of memory "
                 f"caught; {_gib(after - before)} still allocated after it", numbers)


def check_sampler(lm: LoadedModel, prompt: list[int], steps: int = 32, rounds: int = 3) -> Check:
    """The NVML sampler's achieved rate (from a measured sample's trace), and a decode step's time measured (the
    sampler running) against unmeasured, interleaved."""
    timed: dict[bool, list[float]] = {False: [], True: []}
    rates = []
    for _ in range(rounds):
        for measured in (False, True):
            with tracing() as traces:
                session = kvbench_generate(lm, "full", prompt, steps, until_eos=False, measured=measured)[2]
            timed[measured].append(statistics.median(session.step_s))
            if traces and traces[0]["rows"]:
                rows = traces[0]["rows"]
                rates.append((len(rows) - 1) / max(rows[-1][0], 1e-9))
    if not rates:
        return Check("memory.sampler", "fail", f"no NVML samples: {open_nvml(lm.devices)[1]}")
    rate = statistics.median(rates)
    cost = statistics.median(timed[True]) / statistics.median(timed[False]) - 1
    return Check("memory.sampler", _status(rate >= NVML_RATE_HZ / 2),
                 f"NVML sampled at {rate:.0f} Hz (asked {NVML_RATE_HZ:g}, limit half that); a decode step costs "
                 f"{cost:+.1%} with it", {"rate_hz": rate, "decode_step_cost": cost})


# --- timing ----------------------------------------------------------------------------------------

def check_timing(lm: LoadedModel, prompt: list[int], settings: CheckSettings, rounds: int = 3) -> Check:
    """Median decode-step time of `full` against model.generate's (its N-token run less its 1-token run, per
    token), interleaved so a noisy machine slows both; skipped without `settings.timing`."""
    if not settings.timing:
        return Check("timing", "skip", "not judged (--no-timing): decode speed compares only on cores no other "
                     "work shares")
    ours, theirs = [], []
    tokens = max(settings.new_tokens, 16)
    for _ in range(rounds):
        session = kvbench_generate(lm, "full", prompt, tokens, until_eos=False)[2]
        ours.append(statistics.median(session.step_s))
        clock = Stopwatch(lm.devices)
        stock_generate(lm, prompt, 1, settings.attention, until_eos=False)
        one = clock.lap()
        stock_generate(lm, prompt, tokens, settings.attention, until_eos=False)
        theirs.append((clock.lap() - one) / (tokens - 1))
    ratio = statistics.median(ours) / statistics.median(theirs)
    return Check("timing", _status(ratio <= TIMING_LIMIT),
                 f"a decode step of full takes {statistics.median(ours) * 1e3:.1f} ms, model.generate's "
                 f"{statistics.median(theirs) * 1e3:.1f} ms: {ratio:.2f}x (limit {TIMING_LIMIT}x)",
                 {"kvbench_step_s": statistics.median(ours), "generate_step_s": statistics.median(theirs),
                  "ratio": ratio})


# --- the report ------------------------------------------------------------------------------------

def _status(passed: bool) -> Status:
    return "pass" if passed else "fail"


def _gib(value: float) -> str:
    return f"{value / 2**30:.2f} GiB" if value >= 2**26 else f"{value / 2**20:.1f} MiB"


def device_facts(lm: LoadedModel) -> dict[str, Any]:
    """The device as a bug report needs it: name, UUID and MIG slice on a GPU."""
    from kvbench.runs.run_folder import environment

    facts = environment(lm.device)
    if lm.device.type == "cuda":
        properties = torch.cuda.get_device_properties(lm.device)
        uuid = str(getattr(properties, "uuid", "") or "") or None
        facts.update(device_uuid=uuid, mig=None)
        nvml, note = open_nvml(lm.devices)
        if nvml is not None:
            handle = nvml.handles[0]
            try:
                facts["mig"] = nvml.nvml.nvmlDeviceGetMigMode(handle)[0] == nvml.nvml.NVML_DEVICE_MIG_ENABLE
            except nvml.nvml.NVMLError:  # a GPU without MIG
                facts["mig"] = False
            nvml.close()
        else:
            facts["nvml_note"] = note
    return facts


def report_dict(lm: LoadedModel, settings: CheckSettings, checks: list[Check], seconds: float) -> dict[str, Any]:
    return {
        "model": lm.describe(),
        "environment": device_facts(lm),
        "attention": {"kvbench": "kvbench (transformers' SDPA, statistics in float32)",
                      "reference": settings.attention},
        "settings": dataclasses.asdict(settings),
        "checks": [dataclasses.asdict(check) for check in checks],
        "passed": all(check.status != "fail" for check in checks),
        "seconds": round(seconds, 1),
    }
