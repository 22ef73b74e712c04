"""Timing and peak-memory measurement around one sample.

Memory is measured three ways, because they answer different questions:
  allocator - torch's CUDA allocator peak (allocated, and reserved by its caching), reset per sample;
  device    - the GPU's memory in use as NVML sees it (what OOMs: includes the CUDA context, other
              processes, fragmentation), sampled by a background thread at `rate_hz`;
  process   - on CPU, the resident set size, sampled the same way.
Each measure that cannot be taken (no GPU, no `nvidia-ml-py`) is None, with a note saying why.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Iterator
from typing import Any

import psutil
import torch

# a list that every PeakMemory appends its time series to, while `tracing()` is active
_TRACES: contextvars.ContextVar[list | None] = contextvars.ContextVar("kvbench_traces", default=None)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """Wall-clock seconds between device-synchronized marks."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        synchronize(device)
        self.last = time.perf_counter()

    def lap(self) -> float:
        synchronize(self.device)
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        return elapsed


class Sampler:
    """A background thread calling `read()` every 1/`rate_hz` seconds between start and stop; keeps the
    peak of its first value and, when `keep`, the whole series as (seconds, *values)."""

    def __init__(self, read, rate_hz: float, keep: bool = False) -> None:
        self.read = read
        self.interval_s = 1.0 / rate_hz
        self.keep = keep
        self.peak: float | None = None
        self.series: list[tuple[float, ...]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> Sampler:
        self._start = time.perf_counter()
        self._take()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._take()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._take()

    def _take(self) -> None:
        values = self.read()
        self.peak = values[0] if self.peak is None else max(self.peak, values[0])
        if self.keep:
            self.series.append((round(time.perf_counter() - self._start, 6), *values))


class Nvml:
    """The device's memory in use, utilization and power through NVML (`nvidia-ml-py`, imported lazily)."""

    def __init__(self, index: int) -> None:
        import pynvml

        self.nvml = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)

    def read(self) -> tuple[float, float | None, float | None]:
        """(bytes used, GPU utilization %, power W)"""
        used = self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used
        try:
            utilization = self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu
        except self.nvml.NVMLError:
            utilization = None
        try:
            power = self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1000
        except self.nvml.NVMLError:
            power = None
        return used, utilization, power

    def close(self) -> None:
        self.nvml.nvmlShutdown()


def open_nvml(device: torch.device) -> tuple[Nvml | None, str | None]:
    """NVML for `device`, or None and the reason it is unavailable."""
    if device.type != "cuda":
        return None, "no GPU"
    try:
        return Nvml(device.index or 0), None
    except ImportError:
        return None, "nvidia-ml-py is not installed (pip install 'kvbench[gpu]')"
    except Exception as exc:  # NVMLError_LibraryNotFound, driver mismatch, ...
        return None, f"NVML unavailable: {exc}"


@contextlib.contextmanager
def memory_pressure(device: torch.device, pressure: float | None = None,
                    limit_bytes: int | None = None) -> Iterator[int | None]:
    """Run the block as if `pressure` of the device's memory were taken by others (or with `limit_bytes`
    in all). On a GPU the process's allocator is capped (`set_per_process_memory_fraction`), so weights,
    activations and cache meet the limit where they would on a fuller GPU; yields None. On CPU the
    limit applies to the KV cache's bytes (a share of the RAM available now); yields those bytes."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        allowed = limit_bytes if limit_bytes is not None else (1 - pressure) * total
        torch.cuda.set_per_process_memory_fraction(min(1.0, allowed / total), device)
        try:
            yield None
        finally:
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        return
    yield limit_bytes if limit_bytes is not None else int((1 - pressure) * psutil.virtual_memory().available)


@contextlib.contextmanager
def tracing() -> Iterator[list[dict[str, Any]]]:
    """Collect the memory time series of every sample measured inside the block."""
    traces: list[dict[str, Any]] = []
    token = _TRACES.set(traces)
    try:
        yield traces
    finally:
        _TRACES.reset(token)


class PeakMemory:
    """Peak memory over a `with` block (see the module docstring): `peak_bytes` is the allocator's peak
    on a GPU, else the process RSS peak; `peak_reserved` and `peak_device` are None where unmeasurable."""

    def __init__(self, device: torch.device, rate_hz: float = 100.0) -> None:
        self.device = device
        self.rate_hz = rate_hz
        self.peak_bytes = 0
        self.baseline_bytes = 0
        self.peak_reserved: int | None = None
        self.peak_device: int | None = None
        self.device_note: str | None = None
        self._process = psutil.Process()

    def __enter__(self) -> PeakMemory:
        traces = _TRACES.get()
        if self.device.type == "cuda":
            synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline_bytes = torch.cuda.memory_allocated(self.device)
            self._nvml, self.device_note = open_nvml(self.device)
            read = self._nvml.read if self._nvml else lambda: (torch.cuda.memory_allocated(self.device),)
        else:
            self._nvml, self.device_note = None, "no GPU"
            self.baseline_bytes = self._process.memory_info().rss
            read = lambda: (self._process.memory_info().rss,)  # noqa: E731
        # on a GPU without NVML the allocator's own peak is exact: sample only for a trace
        needed = self.device.type != "cuda" or self._nvml is not None or traces is not None
        self._sampler = Sampler(read, self.rate_hz, keep=traces is not None).start() if needed else None
        return self

    def __exit__(self, *exc) -> None:
        if self._sampler:
            self._sampler.stop()
        if self.device.type == "cuda":
            synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
            self.peak_reserved = torch.cuda.max_memory_reserved(self.device)
            if self._nvml:
                self.peak_device = int(self._sampler.peak)
                self._nvml.close()
        else:
            self.peak_bytes = int(self._sampler.peak)
        traces = _TRACES.get()
        if traces is not None and self._sampler:
            columns = ["seconds", "device_used", "gpu_util", "power_w"] if self._nvml else ["seconds", "bytes"]
            traces.append({"columns": columns, "rows": self._sampler.series})
