"""The session and what tasks run with it, by the names plugins, tests and benchmarks import: the engine session
(kvbench/engine/session.py), a task's generation (kvbench/generation.py), a sweep's shared prefill
(kvbench/sharing.py), a run's settings (kvbench/settings.py) and a record's columns (kvbench/measurements.py)."""

from kvbench.engine.session import Scored, Session, compiled_step, forward, static_step, step_together, stopped
from kvbench.generation import Generation, Prompt, answer, generate, generate_batch, generate_rows, left_padded
from kvbench.measurements import cache_measurements, timings
from kvbench.settings import RunSettings, check_budget, compression_plan, policy_budget, resolve_budget, threshold_of
from kvbench.sharing import SharedPrefill, compression_key, shared_prefill, wanted_compressions

__all__ = [
    "Generation", "Prompt", "RunSettings", "Scored", "Session", "SharedPrefill", "answer", "cache_measurements",
    "check_budget", "compiled_step", "compression_key", "compression_plan", "forward", "generate", "generate_batch",
    "generate_rows", "left_padded", "policy_budget", "resolve_budget", "shared_prefill", "static_step",
    "step_together", "stopped", "threshold_of", "timings", "wanted_compressions",
]
