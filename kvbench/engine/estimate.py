"""What a KV cache costs before running anything: 2 x layers x kv_heads x head_dim x tokens x batch x
bytes, full and under a budget, beside the weights, against a device's memory; and how long a sweep's work takes
from the model's shape, on one worker or several."""

from __future__ import annotations

import contextlib
import heapq
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.errors import KvbenchError

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1, "int8": 1, "int4": 0.5}
# the short names users write (and help texts use) for torch's
DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


@dataclass(frozen=True)
class Shape:
    layers: int
    kv_heads: int
    head_dim: int
    parameters: int | None = None  # for the weights' bytes; None when unknown
    heads: int | None = None  # query heads, for the attention's FLOPs in a sweep's time estimate; None when unknown

    def bytes_per_token(self, dtype_bytes: float) -> float:
        """K and V of one token in every layer and KV head (GQA: kv_heads, not attention heads)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


# (layers, KV heads, head_dim, parameters, query heads) from each model's config.json
SHAPES: dict[str, Shape] = {
    "llama-2-7b": Shape(32, 32, 128, 6_738_415_616, 32),
    "llama-2-13b": Shape(40, 40, 128, 13_015_864_320, 40),
    "llama-2-70b": Shape(80, 8, 128, 68_976_648_192, 64),
    "llama-3.2-1b": Shape(16, 8, 64, 1_235_814_400, 32),
    "llama-3-8b": Shape(32, 8, 128, 8_030_261_248, 32),
    "llama-3.1-8b": Shape(32, 8, 128, 8_030_261_248, 32),
    "llama-3-70b": Shape(80, 8, 128, 70_553_706_496, 64),
    "llama-3.1-70b": Shape(80, 8, 128, 70_553_706_496, 64),
    "mistral-7b": Shape(32, 8, 128, 7_241_732_096, 32),  # v0.1 and v0.2: a vocabulary of 32000
    "mistral-7b-v0.3": Shape(32, 8, 128, 7_248_023_552, 32),  # a vocabulary of 32768; 32k positions, no sliding window
    "qwen2.5-7b": Shape(28, 4, 128, 7_615_616_512, 28),
    "smollm2-135m": Shape(30, 3, 64, 134_515_008, 9),
    "smollm2-1.7b": Shape(24, 32, 64, 1_711_376_384, 32),
    "gemma3-270m": Shape(18, 1, 256, 268_098_176, 4),
}


# what a hub id's name adds to its base model's: Llama-3.1-8B-Instruct is llama-3.1-8b
_VARIANT = re.compile(r"(-(instruct|chat|hf|it|base|v\d+(\.\d+)*))+$")
_VERSION = re.compile(r"-v\d+(\.\d+)*")


def builtin_shape(model: str) -> Shape | None:
    """The built-in shape a name or hub id names, without the network: its base model's and version's where both
    have one (`mistralai/Mistral-7B-Instruct-v0.3` -> `mistral-7b-v0.3`), else its base model's
    (`meta-llama/Llama-3.1-8B-Instruct` -> `llama-3.1-8b`); None when it names none."""
    name = model.rsplit("/", 1)[-1].lower()
    base = _VARIANT.sub("", name)
    version = "".join(match.group() for match in _VERSION.finditer(name[len(base):]))
    return SHAPES.get(name) or SHAPES.get(base + version) or SHAPES.get(base)


def offline_shape(model: str) -> Shape | None:
    """`model`'s shape without the network or its weights (`model_shape` where that needs no download); None for
    anything else (a hub id with no built-in shape, a GGUF file)."""
    if not _has_own_config(model) and builtin_shape(model) is None:
        return None
    try:
        return model_shape(model)
    except KvbenchError:
        return None


def _has_own_config(model: str) -> bool:
    """`random:<shape>` and a local folder say their shape themselves, whatever their name reads like."""
    return model.startswith("random:") or Path(model).expanduser().is_dir()


def model_shape(model: str) -> Shape:
    """`random:<shape>` or a local folder (its config), a built-in shape or a hub id naming one (offline), a GGUF
    file or another hub id (its config, fetched)."""
    shape = None if _has_own_config(model) else builtin_shape(model)
    if shape is not None:
        return shape
    from transformers import AutoConfig

    from kvbench.engine.models import _random_config, config_parameters, local_source

    if model.startswith("random:"):
        config = _random_config(model.removeprefix("random:"))
    else:
        try:
            with _quiet_hub():
                config = AutoConfig.from_pretrained(local_source(model))
        except (OSError, ValueError) as exc:  # not a folder, not on the hub, offline; a config of no known type
            raise KvbenchError(f"model '{model}': no local config, and the hub's could not be fetched "
                               f"({str(exc).splitlines()[0]}); built-in shapes, which need no network: "
                               f"{', '.join(SHAPES)}") from None
    heads = config.num_attention_heads
    return Shape(config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or heads,
                 getattr(config, "head_dim", None) or config.hidden_size // heads, config_parameters(config), heads)


@contextlib.contextmanager
def _quiet_hub() -> Iterator[None]:
    """Without a network the hub logs every retry (about 20 lines) before it gives up; the error that follows says
    all of it in one line."""
    hub = logging.getLogger("huggingface_hub")
    level = hub.level
    hub.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hub.setLevel(level)


def canonical_dtype(dtype: str) -> str:
    """A dtype by its full name: `bf16` -> `bfloat16` (`DTYPE_ALIASES`); any other name as given, for its consumer
    to check."""
    return DTYPE_ALIASES.get(dtype, dtype)


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def parse_bytes(text: str) -> int:
    """`80GiB`, `24 GB`, `8e9`: bytes."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise KvbenchError(f"'{text}' is not a memory size (e.g. 80GiB, 24GB, 8e9)")
    return int(float(match.group(1)) * _UNITS[unit])


def estimate(shape: Shape, contexts: list[int], batches: list[int], dtypes: list[str],
             budgets: list[int | float | None], device_memory: int | None = None) -> list[dict[str, Any]]:
    """One row per (context, batch, dtype, budget): bytes per token, the full and budgeted cache, and
    whether cache plus weights (in the same dtype) fit `device_memory`."""
    unknown = [d for d in dtypes if d not in DTYPE_BYTES]
    if unknown:
        raise KvbenchError(f"unknown dtype '{unknown[0]}' (use {', '.join([*DTYPE_BYTES, *DTYPE_ALIASES])})")
    rows = []
    for dtype in dtypes:
        per_token = shape.bytes_per_token(DTYPE_BYTES[dtype])
        weights = None if shape.parameters is None else shape.parameters * DTYPE_BYTES[dtype]
        for context in contexts:
            for batch in batches:
                for budget in budgets:
                    kept = context if budget is None else min(context, _tokens(budget, context))
                    cache = per_token * kept * batch
                    total = None if weights is None else weights + cache
                    rows.append({
                        "context": context, "batch": batch, "dtype": dtype, "budget": budget,
                        "bytes_per_token": per_token, "full_cache_bytes": per_token * context * batch,
                        "cache_bytes": cache, "weights_bytes": weights, "total_bytes": total,
                        "fits": None if device_memory is None or total is None else total <= device_memory,
                    })
    return rows


def _tokens(budget: int | float, context: int) -> int:
    return max(1, round(budget * context)) if isinstance(budget, float) and budget <= 1 else int(budget)


@dataclass(frozen=True)
class Throughput:
    """What `estimate_seconds` assumes a device sustains: FLOP/s, and bytes/s streamed from memory."""

    flops: float
    bandwidth: float


# one large GPU (an H100's order: 2e14 dense bfloat16 FLOP/s reached, 1.5 of its 3.35 TB/s streamed in practice); 2 CPU
# cores, calibrated on the embedded SmolLM2-135M in float32 (~450 prompt tokens/s, ~90 ms a decode step)
SPEEDS = {"cuda": Throughput(2e14, 1.5e12), "cpu": Throughput(1.2e11, 6e9)}


@dataclass(frozen=True)
class CellWork:
    """What one cell costs, as a time estimate counts it: `prompts` forwards of `prompt_tokens` tokens (none where
    its sample group's shared forward already ran them) and `steps` decode steps of `rows` rows each."""

    prompts: int
    prompt_tokens: int
    steps: int
    rows: int

    @property
    def relative_cost(self) -> int:
        """The cost without the model's shape (to order work units): prompt tokens run plus 40 per decode step (one
        for the rows of a batch), as 2 CPU cores run a small model."""
        return self.prompts * self.prompt_tokens + 40 * self.steps


def estimate_seconds(work: list[CellWork], shape: Shape, dtype_bytes: float, speed: Throughput) -> float:
    """A rough wall-time guess for one model's cells from its shape. A prompt of n tokens costs 2 x parameters x n
    FLOPs plus its causal attention's 2 x layers x heads x head_dim x n^2; a decode step reads the weights and its
    rows' full caches once, or computes 2 x parameters FLOPs a row, whichever takes longer. A floor: kernel launches,
    Python and a policy's own work are not counted."""
    parameters, heads = shape.parameters or 0, shape.heads or shape.kv_heads
    seconds = 0.0
    for cell in work:
        n = cell.prompt_tokens
        prompt_flops = 2 * parameters * n + 2 * shape.layers * heads * shape.head_dim * n * n
        step_bytes = parameters * dtype_bytes + cell.rows * n * shape.bytes_per_token(dtype_bytes)
        step = max(cell.rows * 2 * parameters / speed.flops, step_bytes / speed.bandwidth)
        seconds += cell.prompts * prompt_flops / speed.flops + cell.steps * step
    return seconds


def wall_seconds(unit_seconds: list[float], workers: int) -> float:
    """The sweep's wall time when `workers` take the units in this order, each the next one as it gets free."""
    free_at = [0.0] * workers
    for seconds in unit_seconds:
        heapq.heapreplace(free_at, free_at[0] + seconds)
    return max(free_at)
