"""A load cell's service columns, from what it served."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvbench.serving.requests import Load, Served


def percentiles(values: list[float], name: str) -> dict[str, float | None]:
    """`<name>_p50`, `_p90` and `_p99` of `values` (None where there are none)."""
    return {f"{name}_p{q}": float(np.percentile(values, q)) if values else None for q in (50, 90, 99)}


def service_metrics(served: Served, load: Load) -> dict[str, Any]:
    """A load cell's service columns: what was offered (every request that arrived before the horizon), finished,
    rejected (by why) and preempted; throughput; TTFT, TPOT, end-to-end latency and queue wait at p50 / p90 / p99;
    goodput (finished requests per second that met the SLO: every bound given) and SLO attainment (their share of the
    offered); concurrency and pool use over the steps (mean, peak)."""
    offered = [r for r in served.requests if r.offered]
    finished = [r for r in served.requests if r.finished_s is not None]
    latency = [r.latencies() for r in finished]
    duration = max(served.duration_s, 1e-9)

    def good(row: dict[str, Any]) -> bool:
        tpot = row["tpot_s"] or 0.0
        return (load.slo_ttft_s is None or row["ttft_s"] <= load.slo_ttft_s) and \
            (load.slo_tpot_s is None or tpot <= load.slo_tpot_s)

    met = sum(map(good, latency))
    rejected: dict[str, int] = {}
    for request in served.requests:
        if request.rejected is not None:
            rejected[request.rejected] = rejected.get(request.rejected, 0) + 1
    steps = served.timeline
    return {
        "offered": len(offered),
        "finished": len(finished),
        "rejected": sum(rejected.values()),
        "rejected_why": rejected,
        "preemptions": served.preemptions,
        "duration_s": served.duration_s,
        "request_rate": len(finished) / duration,
        "output_tok_s": sum(len(r.tokens) for r in finished) / duration,
        "goodput": met / duration,
        "slo_attained": met / len(offered) if offered else None,
        **percentiles([row["ttft_s"] for row in latency], "ttft"),
        **percentiles([row["tpot_s"] for row in latency if row["tpot_s"] is not None], "tpot"),
        **percentiles([row["e2e_s"] for row in latency], "e2e"),
        **percentiles([row["queue_s"] for row in latency], "queue"),
        "concurrency_mean": float(np.mean([s["running"] for s in steps])) if steps else 0.0,
        "concurrency_peak": max((s["running"] for s in steps), default=0),
        "pool_bytes": served.pool_bytes,
        "pool_rows": served.pool_rows,
        "pool_allocated": served.pool_allocated,
        "pool_step": "batched" if served.joint_because is None else f"joint: {served.joint_because}",
        "pool_used_mean": float(np.mean([s["pool_bytes"] for s in steps])) if steps else 0.0,
        "pool_used_peak": max((s["pool_bytes"] for s in steps), default=0),
    }
