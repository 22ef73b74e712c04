"""What a cache measures at one moment, by the names of the record columns (docs/measurements.md): what a cache
(kvbench/engine/accounting.py) and each row of a batch (kvbench/engine/row_accounts.py) report."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CacheStats:
    """Byte and count measurements of a cache at one moment (the record columns of docs/measurements.md)."""

    kv_bytes_live: int
    kv_bytes_physical: int
    kv_bytes_peak: int
    kv_bytes_full: int
    kept_mean: float
    kept_max: int
    kept_max_ever: int
    evictions: int
    # K/V bytes the attention of one decode step read, mean over the decode steps so far, and what a full cache's
    # step read (None before any decode step): what bounds a memory-bound decode step's time
    kv_bytes_read: float | None = None
    kv_bytes_read_full: float | None = None

    @property
    def cache_ratio(self) -> float:
        return self.kv_bytes_live / self.kv_bytes_full if self.kv_bytes_full else 1.0

    @property
    def read_ratio(self) -> float | None:
        return None if not self.kv_bytes_read_full else (self.kv_bytes_read or 0.0) / self.kv_bytes_read_full
