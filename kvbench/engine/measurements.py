"""The record's speed, byte and memory columns, from what a session measured (`Session.measurements`).

instruments.py takes the measures (stopwatch, memory peaks); kvbench/analysis/columns.py declares the columns."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from kvbench.engine.instruments import PeakMemory

if TYPE_CHECKING:
    from kvbench.engine.cache import CacheStats, KVCache
    from kvbench.engine.sharing import SharedPrefill

# the record's memory peak columns: PeakMemory's peak attribute, whose baseline is the same name with `baseline`
MEMORY_PEAKS = {"mem_peak_alloc": "peak_bytes", "mem_peak_reserved": "peak_reserved", "mem_peak_device": "peak_device"}


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


def cache_measurements(cache: KVCache, memory: PeakMemory, earlier: Sequence[PeakMemory] = (),
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
