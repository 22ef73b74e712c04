"""Timing and peak-memory measurement around one sample."""

from __future__ import annotations

import threading
import time

import psutil
import torch


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


class PeakMemory:
    """Peak memory over a `with` block: the CUDA allocator peak on a GPU, else the process RSS
    sampled every `interval_s` by a background thread (so the prefill spike is seen too)."""

    def __init__(self, device: torch.device, interval_s: float = 0.005) -> None:
        self.device = device
        self.interval_s = interval_s
        self.peak_bytes = 0
        self.baseline_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._process = psutil.Process()

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline_bytes = torch.cuda.memory_allocated(self.device)
        else:
            self.baseline_bytes = self.peak_bytes = self._process.memory_info().rss
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_bytes = max(self.peak_bytes, self._process.memory_info().rss)

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            self._thread.join()
            self.peak_bytes = max(self.peak_bytes, self._process.memory_info().rss)
